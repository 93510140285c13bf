"""Where ``dynamic``'s weighing of the plain methods' sliced searches spends its time (issue 39, plan time):
one ``longdoc`` cell (``plantime``'s batch, layout, models and planner), ``dynamic`` planned once with the weighing
on under ``cProfile`` (``--finalists none``: the full weighing, every method's whole search; ``--finalists K``: the
screened weighing with K whole searches); per search (``slicing._search_anew``: dynamic's own and each alternative's, per kind) its CPU
seconds, simulations and floor-pruned candidates; per part of the planner (packing, cutting, dealing, the floor,
schedule build, simulation) its cumulative CPU seconds.

    PYTHONPATH=$PWD nice -n 19 python3 -m studies.slicing.weighprofile --trace wikitext2 --model llama2-7b --stages 8 \
        --finalists none

CPU seconds are ``time.process_time`` (cProfile's overhead included; loaded box: compare only within one run).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections import defaultdict
from pathlib import Path

import dynmb
from dynmb.costmodel.gpu import GPUCostModel
from dynmb.planning import slicing
from studies.scaling import scaling
from studies.slicing import longdoc

PARTS = {"pack (short sequences)": ("packing/dispatch.py", "pack"),
         "chains (cuts)": ("planning/slicing.py", "chains"),
         "deal to replicas": ("planning/slicing.py", "_replicas"),
         "floor (order-free bound)": ("planning/slicing.py", "floor"),
         "schedule build": ("planning/replicas.py", "make_schedule"),
         "simulate": ("timing/simulate.py", "simulate"),
         "search total": ("planning/slicing.py", "_search_anew")}
"""The planner's parts reported: (file suffix, function name) of ``pstats``' entries."""


def _searches(rows: list[dict]):
    """``slicing._search_anew`` wrapped to log each search's kind, method, CPU s, simulations and pruned."""
    real = slicing._search_anew

    def logged(job):
        t0 = time.process_time()
        found = real(job)
        s = job.spec
        rows.append({"kind": s.schedule_kind, "search": s.method if s.mbs is None else f"{s.method}/{s.mbs}",
                     "cpu_s": time.process_time() - t0, "simulated": found.simulated, "pruned": found.pruned,
                     "best_s": None if found.best is None else found.best[0]})
        return found
    return real, logged


def profile_cell(trace_name: str, model: str, P: int, cache: Path,
                 finalists: int | None) -> tuple[list[dict], pstats.Stats, float, float]:
    """(per-search rows, the profile, total CPU s, dynamic's predicted step) of one weighed plan."""
    trace = longdoc.load(trace_name, cache)
    cfg = scaling.model_for(model, [trace])
    batch = scaling.token_batch(trace, 500_000, 1, 0)
    cfg = scaling.resolve_stage_split(cfg, P, "auto", stage_cost=scaling.ideal_cost(batch, "ib"))
    planner = dynmb.Planner(model=cfg, num_stages=P, memory_limit="80GiB", cost_model=GPUCostModel(cfg, P),
                            schedule="auto", oversize="split", recompute="auto")
    rows: list[dict] = []
    real, logged = _searches(rows)
    prof = cProfile.Profile(time.process_time)          # CPU seconds: the box is loaded, wall time is not the cost
    slicing._search_anew = logged
    try:
        with slicing.weighing_alternatives(True, finalists):
            t0 = time.process_time()
            prof.enable()
            step = planner.plan(batch, method="dynamic")
            prof.disable()
            total = time.process_time() - t0
    finally:
        slicing._search_anew = real
    return rows, pstats.Stats(prof), total, step.sim.makespan_s


def part_seconds(stats: pstats.Stats) -> dict[str, tuple[float, int]]:
    """``PARTS``' cumulative CPU s and call counts (summed over matching entries)."""
    out: dict[str, tuple[float, int]] = {}
    for part, (suffix, name) in PARTS.items():
        cum, calls = 0.0, 0
        for (file, _, func), (_, ncalls, _, ct, _) in stats.stats.items():  # type: ignore[attr-defined]
            if func == name and file.endswith(suffix):
                cum, calls = cum + ct, calls + ncalls
        out[part] = (cum, calls)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="wikitext2", help="trace name (longdoc's)")
    ap.add_argument("--model", default="llama2-7b", help="model preset")
    ap.add_argument("--stages", type=int, default=8, help="pipeline depth P")
    ap.add_argument("--cache", type=Path, default=Path("results/traces"), help="where the pycode trace is cached")
    ap.add_argument("--finalists", default="none", help="none (the full weighing) or K (screened)")
    ap.add_argument("--top", type=int, default=25, help="functions of the profile listed by cumulative time")
    args = ap.parse_args(argv)
    finalists = None if args.finalists == "none" else int(args.finalists)
    rows, stats, total, step = profile_cell(args.trace, args.model, args.stages, args.cache, finalists)
    print(f"{args.trace} {args.model} P{args.stages} finalists {args.finalists}: {total:.1f} CPU s (profiled), step {step:.4f} s")
    print("| kind | search | CPU s | simulated | pruned | best s |\n|---|---|---|---|---|---|")
    by_search: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0])
    for r in rows:
        best = "-" if r["best_s"] is None else f"{r['best_s']:.4f}"
        print(f"| {r['kind']} | {r['search']} | {r['cpu_s']:.1f} | {r['simulated']} | {r['pruned']} | {best} |")
        acc = by_search["dynamic (own)" if r["search"] == "dynamic" else "alternatives"]
        acc[0] += r["cpu_s"]
        acc[1] += r["simulated"]
        acc[2] += r["pruned"]
    for name, (cpu, sims, pruned) in by_search.items():
        print(f"{name}: {cpu:.1f} CPU s, {sims} simulations, {pruned} pruned")
    print("| part | cumulative CPU s | calls |\n|---|---|---|")
    for part, (cum, calls) in part_seconds(stats).items():
        print(f"| {part} | {cum:.1f} | {calls} |")
    stats.sort_stats("cumulative").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
