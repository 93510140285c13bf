"""``dynmb simulate``: predicted makespan, bubble and peak memory of a plan under a schedule."""

from __future__ import annotations

import argparse
import json

from dynmb.io.atomic import atomic_path
from dynmb.cli.flags import add_model_file_flags, add_model_flags
from dynmb.cli.planfile import plan_models
from dynmb.cli.schedule import check_schedule_plan
from dynmb.core.config import format_bytes
from dynmb.report.plots import gantt
from dynmb.schedule import from_csv
from dynmb.timing.simulate import simulate
from dynmb.core.types import Plan

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction, help_text: str) -> None:
    parser = subparsers.add_parser("simulate", help=help_text)
    parser.add_argument("--plan", required=True, help="plan JSON")
    parser.add_argument("--schedule", required=True, help="schedule CSV")
    add_model_file_flags(parser, from_plan=True)
    add_model_flags(parser, default=None)
    parser.add_argument("--allow-over-limit", action="store_true",
                        help="take a plan whose predicted peak exceeds its memory limit")
    parser.add_argument("--gantt", default=None, help="write a Gantt PNG of the predicted timeline here")
    parser.add_argument("--timeline", default=None, help="write the timeline CSV here")
    parser.add_argument("--json", action="store_true", help="print a one-line JSON summary")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    plan = Plan.load(args.plan, allow_over_limit=args.allow_over_limit)
    check_schedule_plan(plan, args.plan, args.schedule)
    schedule = from_csv(args.schedule, num_microbatches=plan.num_microbatches)
    _, models = plan_models(plan, args, args.plan)
    sim = simulate(schedule, plan, models.cost, models.memory)
    peak_bytes, peak_bytes_rank = sim.peak_bytes, sim.peak_bytes_rank
    assert peak_bytes is not None and peak_bytes_rank is not None   # a memory model is always given
    if args.timeline:
        with atomic_path(args.timeline) as tmp:
            sim.timeline.to_csv(tmp, index=False)
    if args.gantt:
        gantt(sim.timeline, args.gantt, title=f"{plan.method} plan, {schedule.num_ranks} ranks, "
              f"{schedule.num_microbatches} microbatches: predicted {sim.makespan_s:.4g} s, mean bubble "
              f"{sim.mean_bubble:.2f}")
    if args.json:
        print(json.dumps({
            "makespan_s": sim.makespan_s, "bound_s": sim.bound_s, "ideal_s": sim.ideal_s,
            "mean_bubble": sim.mean_bubble,
            "bubble_fraction": [float(x) for x in sim.bubble_fraction],
            "peak_bytes": [int(round(x)) for x in peak_bytes],
            "peak_bytes_rank": [int(round(x)) for x in peak_bytes_rank],
            "limit_bytes": int(plan.memory_limit_bytes), "fits": sim.fits,
            "num_ranks": schedule.num_ranks, "num_stages": schedule.num_stages,
            "num_microbatches": schedule.num_microbatches,
        }))
        return 0
    print(f"predicted makespan {sim.makespan_s:.4g} s, mean bubble {sim.mean_bubble:.3f} "
          f"({schedule.num_ranks} ranks, {schedule.num_microbatches} microbatches)")
    if sim.bound_s and sim.ideal_s:
        print(f"lower bounds: bound {sim.bound_s:.4g} s (gap {sim.makespan_s / sim.bound_s - 1:.1%}), ideal "
              f"{sim.ideal_s:.4g} s (gap {sim.makespan_s / sim.ideal_s - 1:.1%}); see dynmb.timing.bounds")
    for rank, (bubble, busy) in enumerate(zip(sim.bubble_fraction, sim.busy_s)):
        print(f"  rank {rank}: busy {busy:.4g} s, bubble {bubble:.3f}, peak {format_bytes(peak_bytes_rank[rank])}")
    print(f"limit {format_bytes(plan.memory_limit_bytes)}: {'fits' if sim.fits else 'OVER THE LIMIT'}")
    return 0
