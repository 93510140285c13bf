"""Planning-speed benchmark: wall time of ``dynmb.packing.pack`` for ``dynapipe`` and ``dynamic``.

Global batches of 1k, 4k, 16k and 64k sequences sampled with replacement from a shipped
trace (sharegpt by default), at P = 4 and 8 pipeline stages, 1F1B, one memory limit;
the median (and min) over repeats of each cell, side by side, with the ratio and the
predicted makespan of each plan (``est_makespan_s``, equal to ``dynmb.timing.simulate``'s).

    python benchmarks/bench_plan.py                      # the full table (dynapipe at 64k takes a while)
    python benchmarks/bench_plan.py --sizes 1024,4096 --stages 8 --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from dynmb.core.config import ModelConfig, format_bytes, parse_bytes
from dynmb.costmodel import get_cost_model
from dynmb.data import load_trace, sample_batch
from dynmb.memory.model import get_memory_model
from dynmb.packing import auto_mbs, pack
from dynmb.core.planspec import PlanSpec
from dynmb.costmodel.loader import Models


def _time(lengths, method, p, limit, mm, cm, repeats, budget_s):
    times, plan = [], None
    t_start = time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = pack(lengths, PlanSpec(method=method, num_stages=p, memory_limit_bytes=limit), models=Models(cm, mm))
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - t_start > budget_s:
            break
    return statistics.median(times), min(times), len(times), plan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="sharegpt", help="shipped trace to sample from (default sharegpt)")
    ap.add_argument("--sizes", default="1024,4096,16384,65536", help="global batch sizes (comma-separated)")
    ap.add_argument("--stages", default="4,8", help="pipeline stage counts (comma-separated)")
    ap.add_argument("--model", default="gpt2", help="model preset (default gpt2: 12 layers split over up to 12 stages)")
    ap.add_argument("--memory-limit", default="8GiB", help="per-GPU memory limit (default 8GiB)")
    ap.add_argument("--cost-model", default=None, help="fitted cost-model JSON (default: the analytic stand-in)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per cell (default 5; median reported)")
    ap.add_argument("--budget", type=float, default=60.0, help="stop repeating a cell after this many seconds (default 60)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    args = ap.parse_args(argv)

    cfg = ModelConfig.preset(args.model)
    limit = parse_bytes(args.memory_limit)
    trace = load_trace(args.dataset)
    print(f"# pack() wall time, {args.dataset} sampled with replacement, model {cfg.name}, limit "
          f"{format_bytes(limit)}, 1f1b, median (min) of up to {args.repeats} repeats")
    print(f"{'P':>2} {'seqs':>6} {'dynapipe ms':>18} {'dynamic ms':>16} {'ratio':>7} {'m dp/dyn':>10} "
          f"{'est makespan dp/dyn':>22} {'fixed mbs':>9}")
    for p in [int(x) for x in args.stages.split(",")]:
        mm = get_memory_model(None, cfg, p)
        cm = get_cost_model(args.cost_model, cfg, p)
        for n in [int(x) for x in args.sizes.split(",")]:
            lengths = np.minimum(sample_batch(trace, n, args.seed), cfg.max_seq_len)
            pack(lengths[:256], PlanSpec(method="dynamic", num_stages=p, memory_limit_bytes=limit), models=Models(cm, mm))
            dyn = _time(lengths, "dynamic", p, limit, mm, cm, args.repeats, args.budget)
            dp = _time(lengths, "dynapipe", p, limit, mm, cm, args.repeats if n <= 4096 else max(1, args.repeats // 3),
                       args.budget)
            e_dp, e_dyn = dp[3].predictions["est_makespan_s"], dyn[3].predictions["est_makespan_s"]
            print(f"{p:>2} {n:>6} {dp[0] * 1e3:>9.1f} ({dp[1] * 1e3:>6.1f}) {dyn[0] * 1e3:>7.1f} ({dyn[1] * 1e3:>6.1f}) "
                  f"{dp[0] / dyn[0]:>6.1f}x {dp[3].num_microbatches:>4}/{dyn[3].num_microbatches:<5} "
                  f"{e_dp:>10.2f}/{e_dyn:<10.2f} {auto_mbs(mm, limit, p, int(lengths.max())):>9}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
