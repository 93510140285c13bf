"""The best fixed microbatch size in hindsight, per trace and memory limit, next to ``dynamic``.

What it measures: for each (trace, memory limit) the throughput of the ``fixed`` method at
mbs = 1, 2, 4, 8, ... up to the largest that fits (the packer refuses a larger one: its
worst case exceeds the limit), plus ``dynamic`` (mbs chosen per microbatch) as the
reference. Real runs by default (tables ``steps``/``actions``/``memory``/``runs`` and
``configs`` = settings + run_id); ``--simulate-only`` predicts with
``dynmb.planning.plan_step`` (table ``sim``, one row per simulated global batch). Feasibility
is decided by planning the same global batches first, so real runs are only launched for
sizes that fit. Resumable by settings columns. ``python experiments/analyze.py OUT``
prints "dynamic vs best fixed mbs" per trace.

    python -m studies.sweeps.fixed_mbs_sweep --simulate-only --out results/fixed_mbs
    python -m studies.sweeps.fixed_mbs_sweep --traces sharegpt,gsm8k --memory-limits 1GiB --out results/fixed_mbs_real
"""

from __future__ import annotations

import argparse
import sys

from studies.common import (Resume, SIM_SETTINGS, add_model_flags, parse_batches, progress, real_flags, run_real,
                     simulate_rows, split_list, strip_private)

from dynmb import data
from dynmb import ModelConfig
from dynmb.core.config import parse_bytes
from dynmb.costmodel import get_cost_model
from dynmb.memory.model import get_memory_model
from dynmb.planning import AUTO_REORDER
from dynmb.io.results import TableWriter

REAL_KEYS = SIM_SETTINGS + ("steps", "warmup")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--traces", default=",".join(data.list_traces()), help="comma-separated traces (default: all shipped)")
    ap.add_argument("--memory-limits", default="1GiB", help="comma-separated per-GPU limits (default 1GiB)")
    ap.add_argument("--global-batch", default="64,wikitext2=16", help="sequences per global batch, per-trace overrides")
    ap.add_argument("--max-mbs", type=int, default=1024, help="stop the doubling here (default 1024)")
    ap.add_argument("--no-dynamic", action="store_true", help="do not add the dynamic reference")
    ap.add_argument("--cost-model", default=None, help="fitted cost-model JSON (default analytic)")
    ap.add_argument("--simulate-only", action="store_true", help="predict with the planner only (no torch.distributed)")
    ap.add_argument("--retry-failed", action="store_true", help="rerun real configurations recorded as failed")
    ap.add_argument("--out", default="results/fixed_mbs", help="results folder (default results/fixed_mbs)")
    add_model_flags(ap)
    real_flags(ap, steps=2)
    return ap


def _base(args: argparse.Namespace, trace: str, limit: str, batch_of) -> dict:
    return dict(dataset=trace, model=args.model, num_stages=args.stages, dp=1, global_batch=batch_of(trace),
                memory_limit_bytes=parse_bytes(limit), schedule=args.schedule, reorder="none",
                cost_model=args.cost_model or "analytic", seed=args.seed, oversize=args.oversize)


def candidates(base: dict, args: argparse.Namespace, ctx: dict, nsteps: int) -> list[tuple[dict, list[dict]]]:
    """(settings, simulated rows) for mbs = 1, 2, 4, ... while it fits, then dynamic."""
    out = []
    mbs = 1
    while mbs <= min(args.max_mbs, base["global_batch"]):
        s = {**base, "method": "fixed", "mbs": mbs}
        rows = simulate_rows(s, steps=nsteps, **ctx)
        if rows[0]["status"] != "ok":
            if not out:                  # even mbs=1 does not fit: record why
                out.append((s, rows))
            break
        out.append((s, rows))
        mbs *= 2
    if not args.no_dynamic:
        s = {**base, "method": "dynamic", "mbs": None, "reorder": AUTO_REORDER["dynamic"]}   # as dynmb compare runs it
        out.append((s, simulate_rows(s, steps=nsteps, **ctx)))
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = ModelConfig.preset(args.model)
    cm = get_cost_model(args.cost_model, cfg, args.stages)
    mm = get_memory_model(args.memory_model, cfg, args.stages)
    batch_of = parse_batches(args.global_batch)
    keep = ("ok",) if args.retry_failed else ("ok", "failed")
    resume = Resume(args.out, "sim", SIM_SETTINGS) if args.simulate_only else \
        Resume(args.out, "configs", REAL_KEYS, where=lambda d: d["status"].isin(keep))
    pairs = [(t, lim) for t in split_list(args.traces) for lim in split_list(args.memory_limits)]
    failed = 0
    with TableWriter(args.out) as w:
        for trace, lim in progress(pairs, total=len(pairs), desc="fixed mbs", disable=args.no_progress):
            ctx = dict(trace=data.load_trace(trace), model_cfg=cfg, cost_model=cm, memory_model=mm)
            base = _base(args, trace, lim, batch_of)
            # feasibility: the measured steps (warm-up included) must all plan
            nsteps = args.steps if args.simulate_only else args.steps + args.warmup
            cands = candidates(base, args, ctx, nsteps)
            if args.simulate_only:
                for s, rows in cands:
                    if not resume.done(s):
                        w.append("sim", strip_private(rows))
                continue
            todo = [{**s, "steps": args.steps, "warmup": args.warmup} for s, rows in cands
                    if rows[0]["status"] == "ok"]
            todo = [s for s in todo if not resume.done(s)]
            if todo:
                rows = run_real(todo, args.out, steps=args.steps, warmup=args.warmup, timeout=args.timeout,
                                cost_model_path=lambda s: args.cost_model, memory_model=args.memory_model,
                                quiet=args.quiet)
                failed += sum(r["status"] != "ok" for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
