"""``dynmb schedule``: build and validate a pipeline schedule for a plan (torch's compute-only CSV),
after the plan's microbatch order pass; the reordered plan is written beside it."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path

from dynmb.io.atomic import write_text_atomic
from dynmb.cli.flags import add_model_file_flags, add_model_flags, add_schedule_flag, positive_int
from dynmb.cli.planfile import plan_models
from dynmb.core.config import format_bytes
from dynmb.planning import make_schedule
from dynmb.planning.reorder import reorder
from dynmb.schedule import to_csv
from dynmb.schedule.io import sidecar_path
from dynmb.schedule.kinds import AUTO, auto_kinds
from dynmb.schedule.kinds import get_kind
from dynmb.timing.simulate import simulate
from dynmb.core.types import Plan, Schedule

__all__ = ["add_parser", "run", "sidecar_path", "check_schedule_plan"]


def sidecar_digest(meta: dict, schedule_path: str | Path) -> str:
    """sha256 over the schedule CSV's bytes and the sidecar's fields (but its own ``digest``): an edit
    of either after ``dynmb schedule`` wrote them shows."""
    h = hashlib.sha256(Path(schedule_path).read_bytes())
    h.update(json.dumps({k: v for k, v in meta.items() if k != "digest"}, sort_keys=True).encode())
    return h.hexdigest()


def check_schedule_plan(plan: Plan, plan_path: str | Path, schedule_path: str | Path) -> None:
    """Raise ``ValueError`` (one line) when the schedule's sidecar records another plan's digest, or
    when the sidecar or the CSV was edited after ``dynmb schedule`` wrote them (``sidecar_digest``).
    A schedule without a sidecar (written by hand or by torch) is taken as it is."""
    meta_path = sidecar_path(schedule_path)
    if not meta_path.exists():
        return
    try:
        meta = json.loads(meta_path.read_text())
        want = str(meta["plan_digest"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{meta_path}: not a schedule sidecar ({e})") from None
    if "digest" in meta and meta["digest"] != sidecar_digest(meta, schedule_path):
        raise ValueError(f"{meta_path} does not match {schedule_path}: one was edited after `dynmb schedule` wrote "
                         "them; build the schedule again, or remove the sidecar to run the CSV as it is")
    if plan.digest() != want:
        hint = f"; use the plan it was built for: --plan {meta['plan']}" if meta.get("plan") else ""
        raise ValueError(f"{schedule_path} was built for another plan than {plan_path} (digest {want[:12]} in "
                         f"{meta_path} vs {plan.digest()[:12]}){hint}")


def add_parser(subparsers: argparse._SubParsersAction, help_text: str) -> None:
    parser = subparsers.add_parser("schedule", help=help_text)
    parser.add_argument("--plan", required=True, help="plan JSON from `dynmb plan`")
    add_schedule_flag(parser, help="schedule kind: gpipe, 1f1b, interleaved, memory-aware, zb-h1, zb, or auto (the "
                                   "fastest predicted of the kinds auto weighs that fits) (default 1f1b)")
    parser.add_argument("--virtual", type=positive_int, default=1,
                        help="model chunks per rank for interleaved (default 1: ranks = stages)")
    parser.add_argument("--reorder", default="none",
                        help="none, descending, ascending, ends, dynapipe, search (default none)")
    add_model_file_flags(parser, from_plan=True)
    add_model_flags(parser, default=None)
    parser.add_argument("-o", "--output", required=True,
                        help="schedule CSV path (torch.distributed.pipelining compute-only format)")
    parser.add_argument("--allow-over-limit", action="store_true",
                        help="take a plan whose predicted peak exceeds its memory limit")
    parser.add_argument("--plan-output", default=None,
                        help="write the reordered plan here (default: next to the schedule)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.schedule != AUTO:
        get_kind(args.schedule)             # an unknown kind: its one line, before any note on the plan
    plan = Plan.load(args.plan, allow_over_limit=args.allow_over_limit)
    source_digest = plan.digest()
    if plan.spec is not None and plan.spec.embedding == "last":
        raise ValueError(f"{args.plan} puts the embedding on the last rank (--embedding last): its schedule runs on "
                         f"`dynmb run` only (torch.distributed.pipelining embeds in stage 0); `dynmb run --plan` it")
    if plan.dp > 1:
        raise ValueError(f"{args.plan} holds {plan.dp} data-parallel pipelines; `dynmb schedule` takes a "
                         f"one-pipeline plan (plan with --dp 1, or use `dynmb run`, which schedules each replica)")
    if plan.schedule_kind != args.schedule and args.schedule != AUTO:
        print(f"dynmb schedule: note: the plan was packed for {plan.schedule_kind!r}, scheduling it as "
              f"{args.schedule!r}; its memory guarantee is for the former", file=sys.stderr)
    _, models = plan_models(plan, args, args.plan)
    # --schedule auto: every kind auto weighs, the fastest that fits kept
    tried: list[tuple[bool, float, int, str, Plan, Schedule]] = []
    for kind in (auto_kinds(args.virtual, plan.has_slices) if args.schedule == AUTO else (args.schedule,)):
        ordered = reorder(plan, args.reorder, models=models, schedule_kind=kind, virtual=args.virtual)
        sched = make_schedule(ordered, kind, virtual=args.virtual, models=models)   # validated, slice order included
        sim = simulate(sched, ordered, models.cost, models.memory)
        tried.append((not sim.fits, sim.makespan_s, len(tried), kind, ordered, sched))
    *_, args.schedule, plan, schedule = min(tried)
    if len(tried) > 1:
        plan = replace(plan, schedule_kind=args.schedule)
        print("dynmb schedule: auto: " + ", ".join(f"{t[3]} {t[1]:.4g} s{' (over the limit)' if t[0] else ''}"
                                                  for t in sorted(tried, key=lambda t: t[2])) + f"; chose {args.schedule}")
    to_csv(schedule, args.output)
    out = Path(args.output)
    plan_out = Path(args.plan_output) if args.plan_output else out.with_name(out.stem + ".plan.json")
    plan.save(plan_out)
    meta_out = sidecar_path(out)
    meta = {"plan_digest": plan.digest(), "plan": str(plan_out), "source_plan": str(args.plan),
            "source_plan_digest": source_digest, "kind": args.schedule, "reorder": args.reorder, "virtual": args.virtual}
    write_text_atomic(meta_out, json.dumps({**meta, "digest": sidecar_digest(meta, out)}, indent=1))
    sim = simulate(schedule, plan, models.cost, models.memory)
    peak = max(sim.peak_bytes_rank) if sim.peak_bytes_rank is not None else float("nan")
    print(f"{args.schedule} schedule: {schedule.num_ranks} ranks, {schedule.num_stages} stages, "
          f"{schedule.num_microbatches} microbatches, reorder {args.reorder}; predicted makespan "
          f"{sim.makespan_s:.4g} s, mean bubble {sim.mean_bubble:.3f}, peak {format_bytes(peak)} / limit "
          f"{format_bytes(plan.memory_limit_bytes)}{'' if sim.fits else ' (OVER THE LIMIT)'}")
    print(f"wrote {out} (plan digest in {meta_out}) and {plan_out}")
    return 0
