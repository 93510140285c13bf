"""Every shipped trace x a few memory limits x every packing method: throughput, padding, bubble, memory.

What it measures: for each (trace, memory limit, method) the tokens/s of real pipeline runs
(``dynmb.runtime``: torchrun, gloo on CPU / NCCL on CUDA; tables ``steps``, ``actions``,
``memory``, ``runs`` plus ``configs`` = settings + run_id), or with ``--simulate-only`` the
planner's prediction (``dynmb.planning.plan_step``: pack, schedule, simulate; table ``sim``,
one row per simulated global batch). Both are resumable: a configuration whose settings
columns already have rows in the output tables is skipped (``--retry-failed`` reruns real
runs that failed). Summarise with ``python experiments/analyze.py OUT``.

    python -m studies.sweeps.sweep_traces --simulate-only --out results/sweep_traces
    python -m studies.sweeps.sweep_traces --out results/sweep_traces_real --steps 2 --warmup 1 \\
        --global-batch 64,wikitext2=16 --memory-limits 512MiB,1GiB,2GiB

Real runs launch one torchrun job per (trace, limit) holding all its methods as cases
(start-up paid once); ``--nproc`` = ``--stages`` ranks.
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
from dynmb.packing import METHODS
from dynmb.planning import default_cost_model_path, reorder_for
from dynmb.io.results import TableWriter

REAL_KEYS = SIM_SETTINGS + ("steps", "warmup")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--traces", default=",".join(data.list_traces()), help="comma-separated traces (default: all shipped)")
    ap.add_argument("--memory-limits", default="512MiB,1GiB,2GiB", help="comma-separated per-GPU limits")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated packing methods (default: all)")
    ap.add_argument("--global-batch", default="64,wikitext2=16",
                    help="sequences per global batch, with per-trace overrides (default '64,wikitext2=16')")
    ap.add_argument("--cost-model", default=None,
                    help="fitted cost-model JSON (default: the one shipped for this model/stages on CPU, as "
                         "`dynmb compare` uses; 'analytic' for the stand-in)")
    ap.add_argument("--reorder", default="auto",
                    help="microbatch order: auto (each method its own, as `dynmb compare`) or one pass for all")
    ap.add_argument("--simulate-only", action="store_true", help="predict with the planner only (no torch.distributed)")
    ap.add_argument("--retry-failed", action="store_true", help="rerun real configurations recorded as failed")
    ap.add_argument("--out", default="results/sweep_traces", help="results folder (default results/sweep_traces)")
    add_model_flags(ap)
    real_flags(ap, steps=2)
    return ap


def _cost_model(args: argparse.Namespace) -> str | None:
    """The cost-model path of the sweep (None: the analytic stand-in)."""
    if args.cost_model == "analytic":
        return None
    return args.cost_model or default_cost_model_path(args.model, args.stages)


def configurations(args: argparse.Namespace) -> list[dict]:
    batch_of = parse_batches(args.global_batch)
    cm = _cost_model(args) or "analytic"
    return [dict(dataset=t, model=args.model, num_stages=args.stages, dp=1, global_batch=batch_of(t),
                 memory_limit_bytes=parse_bytes(lim), method=m, mbs=None, schedule=args.schedule,
                 reorder=reorder_for(m, args.reorder), cost_model=cm, seed=args.seed, oversize=args.oversize)
            for t in split_list(args.traces) for lim in split_list(args.memory_limits) for m in split_list(args.methods)]


def run_simulated(args: argparse.Namespace, configs: list[dict]) -> int:
    resume = Resume(args.out, "sim", SIM_SETTINGS)
    todo = [c for c in configs if not resume.done(c)]
    print(f"sweep_traces: {len(configs)} configurations, {len(configs) - len(todo)} already done", file=sys.stderr)
    cfg = ModelConfig.preset(args.model)
    cm = get_cost_model(_cost_model(args), cfg, args.stages)
    mm = get_memory_model(args.memory_model, cfg, args.stages)
    traces = {}
    with TableWriter(args.out) as w:
        for c in progress(todo, total=len(todo), desc="simulate", disable=args.no_progress):
            tr = traces.setdefault(c["dataset"], data.load_trace(c["dataset"]))
            w.append("sim", strip_private(simulate_rows(c, tr, model_cfg=cfg, cost_model=cm, memory_model=mm,
                                                        steps=args.steps)))
    return 0


def run_measured(args: argparse.Namespace, configs: list[dict]) -> int:
    keep = ("ok",) if args.retry_failed else ("ok", "failed")
    resume = Resume(args.out, "configs", REAL_KEYS, where=lambda d: d["status"].isin(keep))
    for c in configs:
        c.update(steps=args.steps, warmup=args.warmup)
    todo = [c for c in configs if not resume.done(c)]
    print(f"sweep_traces: {len(configs)} configurations, {len(configs) - len(todo)} already done", file=sys.stderr)
    groups: dict[tuple, list[dict]] = {}
    for c in todo:
        groups.setdefault((c["dataset"], c["memory_limit_bytes"]), []).append(c)
    failed = 0
    for key, cases in progress(list(groups.items()), total=len(groups), desc="real runs", disable=args.no_progress):
        rows = run_real(cases, args.out, steps=args.steps, warmup=args.warmup, timeout=args.timeout,
                        cost_model_path=lambda s: _cost_model(args), memory_model=args.memory_model, quiet=args.quiet)
        failed += sum(r["status"] != "ok" for r in rows)
    if failed:
        print(f"sweep_traces: {failed} configuration(s) failed; see {args.out}/configs.csv", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configs = configurations(args)
    return run_simulated(args, configs) if args.simulate_only else run_measured(args, configs)


if __name__ == "__main__":
    sys.exit(main())
