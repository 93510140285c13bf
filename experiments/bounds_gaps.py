"""Simulated gaps to the step's lower bounds (``dynmb.timing.bounds``) per method, token budgets tuned in hindsight.

For each step's global batch: every method's plan, its predicted step (``dynmb.timing.simulate``), its
``bound_s`` (the dependency bound of its own microbatches) and the batch's ``ideal_s`` (real tokens
only, busiest stage, shortest fill and drain). ``token-budget-best`` / ``balanced-best``: the fastest
predicted of the budgets cap / 2^j (j = 0, 1, ... until every sequence is its own microbatch), the
budget in hindsight. Prints medians over the steps of the predicted step, bound, ideal, the gaps
``step / bound - 1`` and ``step / ideal - 1``, and the microbatch count.

    python experiments/bounds_gaps.py --model small --stages 2 --global-batch 32 --steps 4
    python experiments/bounds_gaps.py --model llama-7b --stages 8 --global-batch 4096 --memory-limit 80GiB --gpu

``--gpu``: ``experiments/scaling.py``'s GPU stand-in (989 TFLOP/s x MFU 0.5, 20 us per op, P2P
10 us + 50 GB/s); else the shipped CPU cost model for (model, stages) when there is one, else analytic.
"""

from __future__ import annotations

import argparse

import numpy as np

from dynmb.core.config import model_config, parse_bytes
from dynmb.costmodel import AnalyticCostModel, CommModel, get_cost_model
from dynmb.data import load_trace, sample_batch
from dynmb.memory.model import get_memory_model
from dynmb.packing import PackingError
from dynmb.planning import default_cost_model_path, plan_step

METHODS = ("fixed", "token-budget", "balanced", "dynapipe", "dynamic")
TUNED = ("token-budget", "balanced")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small", help="model preset (default small)")
    ap.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    ap.add_argument("--global-batch", type=int, default=32, help="sequences per step (default 32)")
    ap.add_argument("--memory-limit", default="1GiB", help="per-GPU limit (default 1GiB)")
    ap.add_argument("--trace", default="sharegpt", help="shipped length trace (default sharegpt)")
    ap.add_argument("--steps", type=int, default=4, help="global batches (default 4)")
    ap.add_argument("--gpu", action="store_true", help="the GPU analytic stand-in instead of the CPU cost model")
    return ap


def cost_model(args: argparse.Namespace, cfg):
    if args.gpu:
        return AnalyticCostModel(cfg, args.stages, flops_per_s=989e12 * 0.5, overhead_s=20e-6, bwd_ratio=2.0,
                                 comm=CommModel(alpha_s=10e-6, bytes_per_s=50e9))
    return get_cost_model(default_cost_model_path(args.model, args.stages, "cpu"), cfg, args.stages)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    cfg = model_config(args.model)
    cm, mm = cost_model(args, cfg), get_memory_model(None, cfg, args.stages)
    trace, limit = load_trace(args.trace), parse_bytes(args.memory_limit)
    rows: dict[str, list[tuple[float, float, float, int]]] = {}
    for k in range(args.steps):
        lengths = sample_batch(trace, args.global_batch, 0, step=k)

        def run(method: str, divisor: int | None = None):
            plan, _, sim = plan_step(lengths, method=method, model_cfg=cfg, num_stages=args.stages,
                                     memory_limit_bytes=limit, mbs=divisor, cost_model=cm, memory_model=mm)
            return sim.makespan_s, sim.bound_s, sim.ideal_s, plan.num_microbatches

        cases = {m: run(m) for m in METHODS}
        for m in TUNED:
            best = cases[m]
            for j in range(1, 12):
                try:
                    c = run(m, 1 << j)
                except PackingError:
                    break
                best = min(best, c)
                if c[3] >= len(lengths):
                    break
            cases[f"{m}-best"] = best
        for name, case in cases.items():
            rows.setdefault(name, []).append(case)
    print(f"{args.model} P={args.stages} global batch {args.global_batch} ({args.trace}), limit {args.memory_limit}, "
          f"{'GPU stand-in' if args.gpu else 'CPU cost model'}; medians over {args.steps} steps")
    print(f"{'method':18s} {'pred_s':>9s} {'bound_s':>9s} {'ideal_s':>9s} {'gap_bound':>9s} {'gap_ideal':>9s} {'mbs':>5s}")
    for name, r in rows.items():
        a = np.array(r, dtype=np.float64)
        print(f"{name:18s} {np.median(a[:, 0]):9.4g} {np.median(a[:, 1]):9.4g} {np.median(a[:, 2]):9.4g} "
              f"{np.median(a[:, 0] / a[:, 1] - 1):9.1%} {np.median(a[:, 0] / a[:, 2] - 1):9.1%} {np.median(a[:, 3]):5.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
