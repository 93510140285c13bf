"""Where does the simulator's step-time error on real runs come from? (pred_err of `fixed`)

Runs the real runtime path (``dynmb.runtime.interpreter.run_actions`` + ``P2P`` over gloo,
one process per stage, 1 torch thread, memory meter on) on a method's global batches, but
with a clock whose marks also read the calling thread's CPU time and its page-fault and
context-switch counters (``getrusage(RUSAGE_THREAD)``). Per action it writes wall seconds,
thread CPU seconds, minor faults, involuntary context switches and the cost model's
prediction, so one can tell apart: the op is slower (thread CPU time up), the thread is
descheduled (wall > thread), the op faults pages (minflt).

    python -m studies.prediction.pred_error --method fixed --steps 0,1,2,3 --repeats 2 -o /tmp/pe.csv
    python -m studies.prediction.pred_error --summarize /tmp/pe.csv

A benchmark of the runtime's internals (the interpreter, P2P, the meter, the host allocator
policy), not an experiment of the public API: it lives in ``benchmarks/``.

Options: ``--cost-model`` (default the shipped one), ``--no-meter``, ``--no-prefault``, ``--env K=V``
(set in the workers before torch is imported, e.g. ``DYNMB_HOST_MALLOC=system`` for glibc's
default malloc policy; see ``dynmb.runtime.hostmem``).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import pandas as pd


class RusageClock:
    """A ``dynmb.runtime.device.Clock`` (CPU): marks are (wall, thread cpu, minflt, nivcsw) tuples."""

    def mark(self):
        r = resource.getrusage(resource.RUSAGE_THREAD)
        return (time.perf_counter(), time.thread_time(), r.ru_minflt, r.ru_nivcsw)

    def seconds(self, a, b) -> float:
        return b[0] - a[0]

    def cpu(self) -> float:
        return time.thread_time()


def _worker(rank: int, args, port: int, out: list) -> None:
    for kv in args.env:
        k, v = kv.split("=", 1)
        os.environ[k] = v
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from dynmb.runtime.hostmem import prefault, retain_freed_memory
    retain_freed_memory()     # as the runtime worker does; --env DYNMB_HOST_MALLOC=system turns it off
    from dynmb.core.config import ModelConfig, parse_bytes
    from dynmb.costmodel import get_cost_model
    from dynmb.costmodel.loader import Models
    from dynmb.memory.model import get_memory_model
    from dynmb.data import load_trace, sample_batch
    from dynmb.models import build_stage, hidden_shape, make_inputs, synthetic_tokens
    from dynmb.core.planspec import PlanSpec
    from dynmb.planning import plan_step
    from dynmb.runtime.comm import P2P, make_pair_groups
    from dynmb.runtime.interpreter import ActionContext, run_actions
    from dynmb.runtime.meter import MemoryMeter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    groups = make_pair_groups(2, 2)
    cfg = ModelConfig.preset(args.model)
    cm = get_cost_model(args.cost_model, cfg, 2)
    stage = build_stage(cfg, rank, 2)
    opt = torch.optim.Adam(stage.parameters(), lr=1e-3)
    if not args.no_prefault:
        prefault(parse_bytes(args.memory_limit), local_ranks=2)
    meter = None if args.no_meter else MemoryMeter("cpu", [stage], opt)
    trace = load_trace(args.dataset)
    clock = RusageClock()
    rows = []
    for rep in range(args.repeats):
        for k in args.steps:
            lengths = sample_batch(trace, args.global_batch, 0, step=k)
            plan, sched, sim = plan_step(lengths, PlanSpec(method=args.method, num_stages=2,
                                                           memory_limit_bytes=parse_bytes(args.memory_limit),
                                                           reorder=args.reorder), model_cfg=cfg,
                                         models=Models(cm, get_memory_model(None, cfg, 2)))
            tokens = synthetic_tokens(lengths, cfg.vocab_size, k)
            cache = {}

            def inputs(m):
                if m not in cache:
                    cache[m] = make_inputs(plan.microbatches[m], tokens, cfg=cfg)
                return cache[m]

            p2p = P2P(sched, rank, [0, 1], groups, lambda m: hidden_shape(plan.microbatches[m], cfg),
                      dtype=torch.float32, device=torch.device("cpu"))
            dist.barrier()
            m0 = clock.mark()
            timings, _ = run_actions(sched.ranks[rank], ActionContext(
                stages={rank: stage}, plan=plan, inputs=inputs, p2p=p2p,
                loss_scale=1.0 / plan.real_tokens, clock=clock, meter=meter))
            p2p.finish()
            opt.step()
            opt.zero_grad(set_to_none=True)
            dist.barrier()
            step_s = time.perf_counter() - m0[0]
            costs = cm.stage_costs(*plan.shapes().T[:2])
            for t in timings:
                a, mb = t.action, plan.microbatches[t.action.mb]
                s, e = t.t_start, t.t_end
                rows.append(dict(rep=rep, step=k, rank=rank, stage=a.stage, op=a.op, mb=a.mb, batch=mb.batch,
                                 padded_len=mb.padded_len, real=int(mb.lengths.sum()),
                                 start_s=s[0] - m0[0], wall_s=e[0] - s[0], cpu_s=e[1] - s[1], minflt=e[2] - s[2],
                                 nivcsw=e[3] - s[3], pred_s=float(costs[a.op][a.stage, a.mb]),
                                 step_s=step_s, pred_step_s=float(sim.makespan_s)))
    out.extend(rows)
    pd.DataFrame(rows).to_csv(f"{args.out}.rank{rank}", index=False)
    dist.barrier()
    dist.destroy_process_group()


def summarize(df: pd.DataFrame) -> None:
    df = df[df["op"].isin(["F", "B"])].copy()
    df["r_wall"] = df["wall_s"] / df["pred_s"]
    df["r_cpu"] = df["cpu_s"] / df["pred_s"]
    g = df.groupby(["step", "stage", "op", "batch", "padded_len"]).agg(
        wall=("wall_s", "median"), cpu=("cpu_s", "median"), pred=("pred_s", "first"),
        minflt=("minflt", "median"), nivcsw=("nivcsw", "median"), n=("wall_s", "size"))
    g["r_wall"], g["r_cpu"] = g["wall"] / g["pred"], g["cpu"] / g["pred"]
    print(g.round(3).to_string())
    st = df.groupby(["rep", "step"]).agg(step_s=("step_s", "first"), pred=("pred_step_s", "first"))
    st["err"] = (st["step_s"] - st["pred"]).abs() / st["step_s"]
    print(st.round(3).to_string())
    tot = df.groupby(["stage", "op"]).agg(wall=("wall_s", "sum"), cpu=("cpu_s", "sum"), pred=("pred_s", "sum"))
    tot["r_wall"], tot["r_cpu"] = tot["wall"] / tot["pred"], tot["cpu"] / tot["pred"]
    print(tot.round(3).to_string())


def main(argv=None) -> int:
    from dynmb.planning import default_cost_model_path   # dynmb is imported after the workers' --env

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="fixed")
    ap.add_argument("--reorder", default="none")
    ap.add_argument("--steps", default="0,1,2,3")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dataset", default="sharegpt")
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--memory-limit", default="1GiB")
    ap.add_argument("--model", default="small")
    ap.add_argument("--cost-model", default=default_cost_model_path("small", 2))
    ap.add_argument("--no-prefault", action="store_true", help="do not touch 2x the memory limit at start (hostmem.prefault)")
    ap.add_argument("--no-meter", action="store_true")
    ap.add_argument("--env", action="append", default=[])
    ap.add_argument("-o", "--out", default="/tmp/pred_error.csv")
    ap.add_argument("--summarize", default=None, help="only print the summary of a written CSV")
    args = ap.parse_args(argv)
    if args.summarize:
        summarize(pd.read_csv(args.summarize))
        return 0
    args.steps = [int(x) for x in args.steps.split(",")]
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(args, port, []), nprocs=2, start_method="spawn")
    df = pd.concat([pd.read_csv(f"{args.out}.rank{r}") for r in range(2)], ignore_index=True)
    df.to_csv(args.out, index=False)
    summarize(df)
    return 0


if __name__ == "__main__":
    sys.exit(main())
