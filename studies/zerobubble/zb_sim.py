"""Zero-bubble vs 1F1B in the simulator, on dynamic plans of every shipped trace at P = 4, 8, 16.

What it measures: for each (trace, P, global batch k of ``--batches``) one global batch of
``--global-batch`` sequences is packed by ``dynamic`` for 1F1B (``dynmb.packing.pack``; the
zero-bubble kinds pack the same way, see ``dynmb.memory.model``), and the same plan is scheduled as
``1f1b``, ``zb-h1`` and ``zb`` (``dynmb.planning.zerobubble.build_zb``) and simulated (``dynmb.timing.simulate``).
One row per (configuration, batch, schedule): ``pred_step_s``, ``mean_bubble``,
``peak_over_limit`` (max over stages of the predicted peak / limit), ``speedup`` (1F1B's
makespan / this one's on the same plan), ``sched_s`` (time to build the schedule).

Default model: ``gpt2-deep-13b`` (64 layers, so P = 16 has 4 blocks per stage) with the GPU-like
analytic costs of ``studies/scaling/scaling.py`` (989 TFLOP/s x 0.5, 20 us per op, 50 GB/s links),
an 80GiB limit (``--memory-limit``; try a tighter one to see ``zb`` held back by memory). I and W
come from B by ``dynmb.costmodel.split``'s measured split (CPU-measured shares; the analytic model has
no I/W of its own).

    python -m studies.zerobubble.zb_sim --out results/zb_sim                  # ~2 min on this 2-core box
    python -m studies.zerobubble.zb_sim --memory-limit 40GiB --out results/zb_sim_40g
    python -m studies.zerobubble.zb_sim --model small --stages 2 --memory-limit 1GiB --traces sharegpt \
        --global-batch 16 --batches 8 --cost-model data/costmodels/small-p2-cpu.json --out results/zb_sim_p2
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import pandas as pd

from dynmb import data
from dynmb.core.config import ModelConfig, parse_bytes
from dynmb.costmodel import AnalyticCostModel, CommModel, get_cost_model
from dynmb.memory.model import get_memory_model
from dynmb.packing import PackingError, pack
from dynmb.planning import make_schedule
from dynmb.io.results import TableWriter
from dynmb.timing.simulate import simulate
from dynmb.core.planspec import PlanSpec
from dynmb.costmodel.loader import Models

KINDS = ("1f1b", "zb-h1", "zb")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--traces", default=",".join(data.list_traces()), help="comma-separated traces (default: all shipped)")
    ap.add_argument("--stages", default="4,8,16", help="comma-separated P (default 4,8,16)")
    ap.add_argument("--global-batch", type=int, default=256, help="sequences per global batch (default 256)")
    ap.add_argument("--batches", type=int, default=3, help="global batches per configuration (default 3)")
    ap.add_argument("--model", default="gpt2-deep-13b", help="model preset (default gpt2-deep-13b)")
    ap.add_argument("--memory-limit", default="80GiB", help="per-GPU limit (default 80GiB)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="peak TFLOP/s per GPU (default 989)")
    ap.add_argument("--mfu", type=float, default=0.5, help="fraction of peak the kernels reach (default 0.5)")
    ap.add_argument("--overhead-us", type=float, default=20.0, help="fixed cost per op, microseconds (default 20)")
    ap.add_argument("--link-GBps", type=float, default=50.0, help="P2P bandwidth GB/s (default 50)")
    ap.add_argument("--alpha-us", type=float, default=10.0, help="P2P latency microseconds (default 10)")
    ap.add_argument("--cost-model", default=None,
                    help="a fitted cost-model JSON for --model and each P instead of the analytic costs, e.g. "
                         "data/costmodels/small-p2-cpu.json with --model small --stages 2")
    ap.add_argument("--seed", type=int, default=0, help="seed of the global batches (default 0)")
    ap.add_argument("--out", default="results/zb_sim", help="results folder (table zb_sim)")
    return ap


def rows_for(trace: str, lengths_of: np.ndarray, P: int, k: int, args: argparse.Namespace, cfg: ModelConfig) -> list[dict]:
    limit = parse_bytes(args.memory_limit)
    if args.cost_model:
        cm = get_cost_model(args.cost_model, cfg, P)
    else:
        cm = AnalyticCostModel(cfg, P, flops_per_s=args.peak_tflops * 1e12 * args.mfu, overhead_s=args.overhead_us * 1e-6,
                               comm=CommModel(alpha_s=args.alpha_us * 1e-6, bytes_per_s=args.link_GBps * 1e9))
    mm = get_memory_model(None, cfg, P)
    batch = data.sample_batch(lengths_of, args.global_batch, args.seed, step=k)
    base = dict(dataset=trace, model=cfg.name, num_stages=P, batch=k, global_batch=args.global_batch,
                memory_limit_bytes=limit)
    try:
        plan = pack(batch, PlanSpec(method="dynamic", num_stages=P, memory_limit_bytes=limit, oversize="truncate"),
                    models=Models(cm, mm))
    except PackingError as e:
        return [{**base, "schedule": kind, "status": "infeasible", "error": str(e)[:200]} for kind in KINDS]
    out, ref = [], None
    for kind in KINDS:
        t0 = time.perf_counter()
        sched = make_schedule(plan, kind, models=Models(cm, mm))
        sched_s = time.perf_counter() - t0
        sim = simulate(sched, plan, cm, mm)
        ref = sim.makespan_s if kind == "1f1b" else ref
        out.append({**base, "schedule": kind, "status": "ok", "error": "", "num_microbatches": plan.num_microbatches,
                    "pred_step_s": sim.makespan_s, "mean_bubble": sim.mean_bubble,
                    "peak_over_limit": float(np.max(sim.peak_bytes)) / limit, "speedup": ref / sim.makespan_s,
                    "split_backwards": sum(a.op == "I" for acts in sched.ranks for a in acts), "sched_s": sched_s})
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = ModelConfig.preset(args.model)
    rows = []
    with TableWriter(args.out) as w:
        for trace in [t.strip() for t in args.traces.split(",") if t.strip()]:
            lengths_of = data.load_trace(trace)
            for P in [int(p) for p in args.stages.split(",")]:
                for k in range(args.batches):
                    got = rows_for(trace, lengths_of, P, k, args, cfg)
                    w.append("zb_sim", got)
                    rows += got
                    print(f"{trace} P={P} batch {k}: " + ", ".join(
                        f"{r['schedule']} {r.get('pred_step_s', float('nan')):.4g}s" for r in got), file=sys.stderr)
    df = pd.DataFrame(rows)
    ok = df[df["status"] == "ok"]
    tab = ok.groupby(["dataset", "num_stages", "schedule"], as_index=False).agg(
        pred_step_s=("pred_step_s", "mean"), bubble=("mean_bubble", "mean"), speedup=("speedup", "mean"),
        peak_over_limit=("peak_over_limit", "max"), m=("num_microbatches", "mean"), sched_s=("sched_s", "mean"))
    print(tab.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
