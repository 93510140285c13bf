"""Benchmark: build, validate and simulate a P = 64, m = 1,024 pipeline (the target is <= 1 s to simulate).

    python benchmarks/bench_simulate.py [--stages 64] [--microbatches 1024] [--repeats 3]

Prints one row per schedule kind: seconds to build the schedule, to validate it,
and to simulate it from cost arrays (``simulate_costs``; with memory, as the
planner calls it), best of ``--repeats``. Exits 1 if a simulation takes longer
than ``--limit-s`` (default 1 s).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from dynmb.schedule import build_schedule, validate
from dynmb.timing.simulate import simulate_costs


def _best(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=64, help="pipeline stages P (default 64)")
    ap.add_argument("--microbatches", type=int, default=1024, help="microbatches m (default 1024)")
    ap.add_argument("--virtual", type=int, default=4, help="chunks per rank for interleaved (default 4)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats, best kept (default 3)")
    ap.add_argument("--limit-s", type=float, default=1.0, help="fail above this simulate time (default 1 s)")
    args = ap.parse_args(argv)
    P, m = args.stages, args.microbatches
    rng = np.random.default_rng(0)
    work = rng.lognormal(0.0, 0.6, size=m)
    costs = {"F": np.outer(np.linspace(1.0, 1.3, P), work), "B": 2 * np.outer(np.linspace(1.0, 1.3, P), work)}
    act = np.tile(work * 1e6, (P, 1))
    state = np.full(P, 1e9)
    limit = 1e9 + 8 * act.max()
    print(f"P={P} stages, m={m} microbatches ({2 * P * m:,} actions)")
    print(f"{'kind':<14}{'build_s':>9}{'validate_s':>12}{'sim_s':>9}{'sim+mem_s':>11}{'makespan':>12}{'bubble':>8}")
    worst = 0.0
    for kind in ("gpipe", "1f1b", "interleaved", "memory-aware"):
        kw = dict(virtual=args.virtual) if kind == "interleaved" else {}
        if kind == "memory-aware":
            kw = dict(act_bytes=act, state_bytes=state, limit_bytes=limit)
        t_build, sched = _best(lambda: build_schedule(kind, P, m, **kw), args.repeats)
        t_val, _ = _best(lambda: validate(sched), args.repeats)
        t_sim, res = _best(lambda: simulate_costs(sched, costs, comm_s=0.01), args.repeats)
        t_mem, _ = _best(lambda: simulate_costs(sched, costs, 0.01, act, state, limit_bytes=int(limit)), args.repeats)
        worst = max(worst, t_sim, t_mem)
        print(f"{kind:<14}{t_build:>9.3f}{t_val:>12.3f}{t_sim:>9.3f}{t_mem:>11.3f}{res.makespan_s:>12.1f}"
              f"{res.mean_bubble:>8.3f}")
    ok = worst <= args.limit_s
    print(f"slowest simulation {worst:.3f} s: {'OK' if ok else 'OVER'} the {args.limit_s:g} s target")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
