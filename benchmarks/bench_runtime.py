"""Runtime overhead: dynmb's interpreter vs torch.distributed.pipelining's Schedule1F1B.

Run (it re-launches itself under torchrun when started directly)::

    python benchmarks/bench_runtime.py [--model small] [--mbs 2] [--seqlen 256] [--microbatches 8] [--steps 10]
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_runtime.py ...

Method. Two gloo ranks (one pipeline stage each, 1 thread each) run the same
model (``dynmb.models`` stages, same weights) on ``m`` equal-size microbatches of
``mbs`` full rows of ``seqlen`` tokens under 1F1B, once with dynmb's runtime
(``comm.P2P`` + ``interpreter.run_actions``) and once with torch's
``PipelineStage`` (shapes inferred at the first step, then fixed) + ``Schedule1F1B``, alternating
step by step in the same process group. Each step is timed barrier to barrier
(forward + backward of the pipeline; no optimizer step). The critical path's
compute is the makespan of the 1F1B schedule with zero communication cost and
each action taking its median compute time measured in place by dynmb's
interpreter (same ranks, same contention; ``dynmb.timing.simulate.simulate_costs``).
Overhead = median step time - that critical path. Rank 0 prints one JSON line and
a small table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["main"]


def _run(args: argparse.Namespace) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from dynmb.core.config import ModelConfig
    from dynmb.models import build_stage, hidden_shape, make_inputs, synthetic_tokens
    from dynmb.runtime.comm import P2P, make_pair_groups
    from dynmb.runtime.device import device_ops
    from dynmb.runtime.interpreter import ActionContext, run_actions
    from dynmb.schedule import build_schedule
    from dynmb.timing.simulate import simulate_costs
    from dynmb.core.types import Microbatch, Plan

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cpu")
    cfg = ModelConfig.preset(args.model)
    m, b, s = args.microbatches, args.mbs, args.seqlen
    lengths = np.full(m * b, s, dtype=np.int64)
    mbs = tuple(Microbatch(np.arange(i * b, (i + 1) * b), lengths[i * b:(i + 1) * b], s, b) for i in range(m))
    plan = Plan(microbatches=mbs, method="fixed", num_stages=P, memory_limit_bytes=2**40, num_sequences=m * b)
    sched = build_schedule("1f1b", P, m)
    tokens = synthetic_tokens(lengths, cfg.vocab_size, 0)
    inputs = [make_inputs(mb, tokens, cfg=cfg) for mb in mbs]
    scale = 1.0 / plan.real_tokens
    ours = build_stage(cfg, rank, P, 0)
    theirs = build_stage(cfg, rank, P, 0)
    groups = make_pair_groups(P, P)

    # --- dynmb runtime ------------------------------------------------------------
    compute: dict[tuple[str, int], list[float]] = {}   # (op, mb) -> in-situ compute seconds on this rank

    def step_ours() -> float:
        p2p = P2P(sched, rank, list(range(P)), groups, lambda k: hidden_shape(mbs[k], cfg),
                  dtype=torch.float32, device=dev)
        dist.barrier()
        t0 = time.perf_counter()
        timings, _ = run_actions(sched.ranks[rank], ActionContext(
            stages={rank: ours}, plan=plan, inputs=lambda k: inputs[k], p2p=p2p, loss_scale=scale,
            clock=device_ops(dev)))
        p2p.finish()
        dist.barrier()
        dt = time.perf_counter() - t0
        for t in timings:
            compute.setdefault((t.action.op, t.action.mb), []).append(t.t_end - t.t_start)
        ours.zero_grad(set_to_none=True)
        return dt

    # --- torch.distributed.pipelining ------------------------------------------
    class Wrapped(torch.nn.Module):
        """Tensor-in, tensor-out view of a dynmb stage on the fixed (b, s) layout."""

        def __init__(self, stage: torch.nn.Module) -> None:
            super().__init__()
            self.stage = stage

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if rank == 0:
                return self.stage(None, replace(inputs[0], input_ids=x))
            return self.stage(x, inputs[0])

    tstage = PipelineStage(Wrapped(theirs), rank, P, dev)   # shapes inferred once, then fixed
    tsched = Schedule1F1B(tstage, m, loss_fn=lambda out, tgt: out * scale, scale_grads=False)
    full_ids = torch.cat([i.input_ids for i in inputs])
    target = torch.zeros(m * b, s)

    def step_torch() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            tsched.step(full_ids)
        elif rank == P - 1:
            tsched.step(target=target, losses=[], return_outputs=False)
        else:
            tsched.step()
        dist.barrier()
        dt = time.perf_counter() - t0
        theirs.zero_grad(set_to_none=True)
        return dt

    res: dict[str, list[float]] = {"dynmb": [], "torch": []}
    for k in range(args.warmup + args.steps):
        a, t = step_ours(), step_torch()
        if k >= args.warmup:
            res["dynmb"].append(a)
            res["torch"].append(t)
    # critical path: the 1F1B DAG with zero communication cost and each action taking its
    # median measured compute time (dynmb's in-situ per-action timings, gathered from all ranks)
    mine = {k: statistics.median(v[args.warmup:] or v) for k, v in compute.items()}
    per: list = [None] * P
    dist.all_gather_object(per, mine)
    costs = {op: np.array([[per[r][(op, j)] for j in range(m)] for r in range(P)]) for op in ("F", "B")}
    critical = simulate_costs(sched, costs).makespan_s
    if rank == 0:
        out = {"model": args.model, "ranks": P, "m": m, "mbs": b, "seqlen": s, "steps": args.steps,
               "f_s": costs["F"].mean(axis=1).tolist(), "b_s": costs["B"].mean(axis=1).tolist(),
               "critical_path_s": critical}
        for name, ts in res.items():
            med = statistics.median(ts)
            out[f"{name}_step_s"] = med
            out[f"{name}_overhead_s"] = med - critical
            out[f"{name}_overhead_frac"] = (med - critical) / med
        print(json.dumps(out))
        print(f"{'runtime':8s} {'median step':>12s} {'critical path':>14s} {'overhead':>10s}")
        for name in res:
            print(f"{name:8s} {out[name + '_step_s'] * 1e3:10.1f}ms {critical * 1e3:12.1f}ms "
                  f"{out[name + '_overhead_s'] * 1e3:8.1f}ms ({100 * out[name + '_overhead_frac']:.1f}%)")
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small", help="model preset (default small)")
    ap.add_argument("--mbs", type=int, default=2, help="rows per microbatch (default 2)")
    ap.add_argument("--seqlen", type=int, default=256, help="tokens per row (default 256)")
    ap.add_argument("--microbatches", type=int, default=8, help="microbatches per step (default 8)")
    ap.add_argument("--steps", type=int, default=10, help="measured steps per runtime (default 10)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up steps per runtime (default 2)")
    ap.add_argument("--nproc", type=int, default=2, help="ranks when self-launching (default 2)")
    args = ap.parse_args(argv)
    if "RANK" not in os.environ:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:])]
        return subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    _run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
