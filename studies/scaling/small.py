"""The small-batch scaling grid (``studies/scaling/scaling.py --small-batch``): P up to 64, DP up to 1,024.

The study before the realistic-load one (``studies/scaling/scaling.py``), kept reachable and unchanged: a few
hundred short sequences per replica, ``AnalyticCostModel`` scaled to a GPU (``--peak-tflops``, ``--mfu``).

What it measures: for each (trace, P, DP, method) one global batch of ``--per-replica`` x DP
sequences (sampled with replacement from the trace) is packed for DP pipelines of P stages
(``dynmb.packing.pack`` with ``dp``; the packer also balances the replicas), and the
replicas the packer predicts slowest (``--sim-replicas``, default 2, 0 for all: the step
waits for the slowest; ``predictions["est_replica_makespan_s"]``, the packers' makespan
estimate per replica, exact where a replica has few microbatches per stage) get their 1F1B
schedule built and simulated (``dynmb.timing.simulate``). Rows (table ``scaling``, one per configuration):

- ``pack_s`` (planning the whole global batch), ``sched_s`` (one replica's schedule, built
  by each replica in parallel), ``plan_s`` = pack_s + sched_s: the planning time per step;
- ``pred_step_s``: the slowest simulated replica's makespan; ``mean_bubble`` of it;
- ``efficiency`` = real-token FLOPs / (DP x P x pred_step_s x peak): forward + backward
  (3x forward) FLOPs of every sequence at its own length; ``attainable`` = efficiency / mfu
  (the cost model runs kernels at ``mfu`` x peak, so 1.0 would mean no bubble, no padding);
- ``padding_fraction``, ``num_microbatches`` (per replica), ``truncated`` (sequences cut to
  the longest that fits alone), ``pred_peak_over_limit``.

Model: the ``gpt2-deep-13b`` preset (GPT-2 blocks at Llama-7B widths, 64 layers, so P = 64 has one block per
stage), an 80GiB limit, and ``AnalyticCostModel`` scaled to the GPU: FLOPs / (peak x mfu) +
a per-op overhead, P2P ``alpha + bytes / bandwidth``. Resumable by settings columns.

    python -m studies.scaling.scaling --small-batch --quick --out results/scaling_quick     # ~30 s on this 2-core box
    python -m studies.scaling.scaling --small-batch --out results/scaling_small          # full grid, ~7 min (DP 1,024)
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from studies.common import Resume, parse_batches, progress, split_list

from dynmb import data
from dynmb import ModelConfig, simulate
from dynmb.core.config import parse_bytes
from dynmb.costmodel import AnalyticCostModel, CommModel
from dynmb.memory.model import get_memory_model
from dynmb.packing import PackingError, pack
from dynmb.planning import make_schedule
from dynmb.io.results import TableWriter
from dynmb.core.planspec import PlanSpec
from dynmb.costmodel.loader import Models

KEYS = ("dataset", "model", "num_stages", "dp", "per_replica", "global_batch", "memory_limit_bytes", "method",
        "peak_tflops", "mfu", "overhead_us", "link_GBps", "alpha_us", "sim_replicas", "replica_pick", "seed",
        "oversize")
FULL = dict(stages="4,8,16,32,64", dp="1,8,64,1024")
QUICK = dict(stages="4,16,64", dp="1,8,64")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="scaling.py --small-batch", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--quick", action="store_true", help=f"smaller grid: P {QUICK['stages']}, DP {QUICK['dp']}")
    ap.add_argument("--stages", default=None, help=f"comma-separated P (default {FULL['stages']})")
    ap.add_argument("--dp", default=None, help=f"comma-separated DP (default {FULL['dp']})")
    ap.add_argument("--traces", default="sharegpt,wikitext2", help="comma-separated traces (default sharegpt,wikitext2)")
    ap.add_argument("--per-replica", default="256", help="sequences per replica, per-trace overrides (default 256)")
    ap.add_argument("--methods", default="fixed,dynapipe,dynamic", help="packing methods (default fixed,dynapipe,dynamic)")
    ap.add_argument("--model", default="gpt2-deep-13b", help="model preset (default gpt2-deep-13b: 64 layers)")
    ap.add_argument("--memory-limit", default="80GiB", help="per-GPU limit (default 80GiB)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="peak dense bf16 TFLOP/s per GPU (default 989)")
    ap.add_argument("--mfu", type=float, default=0.5, help="fraction of peak the kernels reach (default 0.5)")
    ap.add_argument("--overhead-us", type=float, default=20.0, help="fixed cost per op in microseconds (default 20)")
    ap.add_argument("--link-GBps", type=float, default=50.0, help="P2P bandwidth in GB/s (default 50)")
    ap.add_argument("--alpha-us", type=float, default=10.0, help="P2P latency in microseconds (default 10)")
    ap.add_argument("--sim-replicas", type=int, default=2,
                    help="replicas simulated: those the packer predicts slowest (default 2; 0: all)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the global batch (default 0)")
    ap.add_argument("--oversize", default="truncate", choices=["error", "truncate", "drop"],
                    help="a sequence that cannot fit alone (default truncate, counted)")
    ap.add_argument("--out", default="results/scaling_small", help="results folder (default results/scaling_small)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def configurations(args: argparse.Namespace) -> list[dict]:
    grid = QUICK if args.quick else FULL
    per = parse_batches(args.per_replica)
    return [dict(dataset=t, model=args.model, num_stages=p, dp=d, per_replica=per(t), global_batch=per(t) * d,
                 memory_limit_bytes=parse_bytes(args.memory_limit), method=m, peak_tflops=args.peak_tflops,
                 mfu=args.mfu, overhead_us=args.overhead_us, link_GBps=args.link_GBps, alpha_us=args.alpha_us,
                 sim_replicas=args.sim_replicas, replica_pick="estimate", seed=args.seed, oversize=args.oversize)
            for t in split_list(args.traces) for p in map(int, split_list(args.stages or grid["stages"]))
            for d in map(int, split_list(args.dp or grid["dp"])) for m in split_list(args.methods)]


def gpu_cost_model(c: dict, cfg: ModelConfig) -> AnalyticCostModel:
    comm = CommModel(alpha_s=c["alpha_us"] * 1e-6, bytes_per_s=c["link_GBps"] * 1e9)
    return AnalyticCostModel(cfg, c["num_stages"], flops_per_s=c["peak_tflops"] * 1e12 * c["mfu"],
                             overhead_s=c["overhead_us"] * 1e-6, bwd_ratio=2.0, comm=comm)


def real_flops(cfg: ModelConfig, P: int, lengths: np.ndarray) -> float:
    """Forward + backward FLOPs of every sequence at its own length (no padding)."""
    fwd = sum(np.sum(cfg.stage_flops(s, P, 1, lengths.astype(np.float64))) for s in range(P))
    return 3.0 * float(fwd)


def slowest_replicas(plan, k: int) -> list[int]:
    """The k replicas with the longest estimated makespan (all with k = 0). Picking them by
    bottleneck-stage work instead missed the slowest replica in most DP configurations of
    ``--quick`` (up to 5% low: with many stages the longest microbatch's round trip, not the
    work, sets a replica's step)."""
    if plan.dp == 1:
        return [0]
    est = np.asarray(plan.predictions["est_replica_makespan_s"])
    return [int(r) for r in np.argsort(-est, kind="stable")[:k or plan.dp]]


def one_row(c: dict, trace: np.ndarray, cfg: ModelConfig) -> dict:
    P, limit = c["num_stages"], c["memory_limit_bytes"]
    cm, mm = gpu_cost_model(c, cfg), get_memory_model(None, cfg, P)
    batch = data.sample_batch(trace, c["global_batch"], c["seed"])
    t0 = time.perf_counter()
    try:
        plan = pack(batch, PlanSpec(method=c["method"], num_stages=P, memory_limit_bytes=limit, dp=c["dp"],
                                    oversize=c["oversize"]), models=Models(cm, mm))
    except PackingError as e:
        return {**c, "status": "infeasible", "error": str(e)[:300]}
    pack_s = time.perf_counter() - t0
    sims, sched_s = [], []
    for r in slowest_replicas(plan, c["sim_replicas"]):
        sub = plan.replica(r) if plan.dp > 1 else plan
        t1 = time.perf_counter()
        sched = make_schedule(sub, "1f1b", models=Models(cm, mm))
        sched_s.append(time.perf_counter() - t1)
        sims.append(simulate(sched, sub, cm, mm))
    worst = max(sims, key=lambda s: s.makespan_s)
    lengths = np.concatenate([mb.lengths for mb in plan.microbatches])
    eff = real_flops(cfg, P, lengths) / (c["dp"] * P * worst.makespan_s * c["peak_tflops"] * 1e12)
    peak = max(float(np.max(s.peak_bytes)) for s in sims if s.peak_bytes is not None)
    return {**c, "status": "ok", "error": "", "pack_s": pack_s, "sched_s": float(np.mean(sched_s)),
            "plan_s": pack_s + float(np.mean(sched_s)), "pred_step_s": worst.makespan_s,
            "mean_bubble": worst.mean_bubble, "efficiency": eff, "attainable": eff / c["mfu"],
            "real_tokens": plan.real_tokens, "tokens_per_s": plan.real_tokens / worst.makespan_s,
            "padding_fraction": plan.padding_fraction, "num_microbatches": plan.num_microbatches // plan.dp,
            "mbs_used": plan.meta.get("mbs"), "truncated": len(plan.meta.get("truncated", [])),
            "dropped": len(plan.meta.get("dropped", [])), "pred_peak_over_limit": peak / limit}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = ModelConfig.preset(args.model)
    configs = configurations(args)
    resume = Resume(args.out, "scaling", KEYS)
    todo = [c for c in configs if not resume.done(c)]
    todo.sort(key=lambda c: (c["dp"], c["num_stages"]))          # cheap ones first: partial results early
    print(f"scaling: {len(configs)} configurations, {len(configs) - len(todo)} already done", file=sys.stderr)
    traces: dict = {}
    with TableWriter(args.out) as w:
        for c in progress(todo, total=len(todo), desc="scaling", disable=args.no_progress):
            tr = traces.setdefault(c["dataset"], data.load_trace(c["dataset"]))
            w.append("scaling", [one_row(c, tr, cfg)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
