"""Reorder ablation: how much the microbatch order matters, for dynamic and fixed plans.

What it measures: for each (trace, packing method, reorder method) the predicted makespan of
the plan ordered by ``none``, ``descending``, ``ascending``, ``ends``, ``dynapipe`` or
``search`` (``dynmb.planning.reorder``), built and simulated by ``dynmb.planning.plan_step``
(table ``sim``: one row per simulated global batch, with ``speedup_vs_none``), and with
``--real`` the measured step time of real runs of the same configurations (tables
``steps``/``actions``/``memory``/``runs``, ``configs`` = settings + run_id, and ``real`` =
settings + measured medians). Resumable by settings columns.

    python -m studies.reorder.ablation --out results/reorder_ablation
    python -m studies.reorder.ablation --real --stages 2 --traces sharegpt --out results/reorder_ablation_real
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
from studies.common import (Resume, SIM_SETTINGS, add_model_flags, measured, parse_batches, progress, real_flags, run_real,
                     simulate_rows, split_list, strip_private)

from dynmb import data
from dynmb import ModelConfig
from dynmb.core.config import parse_bytes
from dynmb.costmodel import get_cost_model
from dynmb.memory.model import get_memory_model
from dynmb.planning.reorder import REORDER_METHODS
from dynmb.io.results import TableWriter

REAL_KEYS = SIM_SETTINGS + ("steps", "warmup")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--traces", default="sharegpt,alpaca_eval,humaneval", help="comma-separated traces")
    ap.add_argument("--memory-limit", default="1GiB", help="per-GPU limit (default 1GiB)")
    ap.add_argument("--methods", default="dynamic,fixed", help="packing methods (default dynamic,fixed)")
    ap.add_argument("--reorders", default=",".join(REORDER_METHODS), help="reorder methods (default: all)")
    ap.add_argument("--global-batch", default="64,wikitext2=16", help="sequences per global batch, per-trace overrides")
    ap.add_argument("--cost-model", default=None, help="fitted cost-model JSON (default analytic)")
    ap.add_argument("--real", action="store_true", help="also measure each configuration on a real pipeline")
    ap.add_argument("--retry-failed", action="store_true", help="rerun real configurations recorded as failed")
    ap.add_argument("--out", default="results/reorder_ablation", help="results folder")
    add_model_flags(ap, stages=4)
    real_flags(ap, steps=2)
    return ap


def configurations(args: argparse.Namespace) -> list[dict]:
    batch_of = parse_batches(args.global_batch)
    return [dict(dataset=t, model=args.model, num_stages=args.stages, dp=1, global_batch=batch_of(t),
                 memory_limit_bytes=parse_bytes(args.memory_limit), method=m, mbs=None, schedule=args.schedule,
                 reorder=r, cost_model=args.cost_model or "analytic", seed=args.seed, oversize=args.oversize)
            for t in split_list(args.traces) for m in split_list(args.methods) for r in split_list(args.reorders)]


def with_speedup(rows: list[dict], none_s: dict) -> list[dict]:
    for r in rows:
        base = none_s.get((r["dataset"], r["method"], r.get("step")))
        r["speedup_vs_none"] = base / r["pred_step_s"] if base and r.get("status") == "ok" else float("nan")
    return rows


def _baselines(out: str) -> dict:
    """(dataset, method, step) -> predicted step time of reorder ``none`` already in ``sim``."""
    p = Path(out) / "sim.csv"
    if not p.exists():
        return {}
    d = pd.read_csv(p)
    d = d[(d["reorder"] == "none") & (d["status"] == "ok")]
    return {(r.dataset, r.method, int(r.step)): r.pred_step_s for r in d.itertuples()}


def simulate_all(args: argparse.Namespace, configs: list[dict]) -> None:
    cfg = ModelConfig.preset(args.model)
    cm = get_cost_model(args.cost_model, cfg, args.stages)
    mm = get_memory_model(args.memory_model, cfg, args.stages)
    resume = Resume(args.out, "sim", SIM_SETTINGS)
    todo = [c for c in configs if not resume.done(c)]
    print(f"reorder_ablation: {len(configs)} configurations, {len(configs) - len(todo)} already simulated", file=sys.stderr)
    none_s = _baselines(args.out)
    traces: dict = {}
    todo.sort(key=lambda c: c["reorder"] != "none")        # baselines first
    with TableWriter(args.out) as w:
        for c in progress(todo, total=len(todo), desc="simulate", disable=args.no_progress):
            tr = traces.setdefault(c["dataset"], data.load_trace(c["dataset"]))
            rows = strip_private(simulate_rows(c, tr, model_cfg=cfg, cost_model=cm, memory_model=mm, steps=args.steps))
            if c["reorder"] == "none":
                none_s.update({(r["dataset"], r["method"], r["step"]): r.get("pred_step_s") for r in rows})
            w.append("sim", with_speedup(rows, none_s))


def measure_all(args: argparse.Namespace, configs: list[dict]) -> int:
    keep = ("ok",) if args.retry_failed else ("ok", "failed")
    resume = Resume(args.out, "configs", REAL_KEYS, where=lambda d: d["status"].isin(keep))
    todo = [{**c, "steps": args.steps, "warmup": args.warmup} for c in configs]
    todo = [c for c in todo if not resume.done(c)]
    groups: dict = {}
    for c in todo:
        groups.setdefault((c["dataset"], c["method"]), []).append(c)
    failed = 0
    for _, cases in progress(list(groups.items()), total=len(groups), desc="real runs", disable=args.no_progress):
        rows = run_real(cases, args.out, steps=args.steps, warmup=args.warmup, timeout=args.timeout,
                        cost_model_path=lambda s: args.cost_model, memory_model=args.memory_model, quiet=args.quiet)
        failed += sum(r["status"] != "ok" for r in rows)
        ok = pd.DataFrame([r for r in rows if r["status"] == "ok"])
        if not ok.empty:
            with TableWriter(args.out) as w:
                w.append("real", ok.merge(measured(args.out, ok["run_id"]), on="run_id"))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configs = configurations(args)
    simulate_all(args, configs)
    return measure_all(args, configs) if args.real else 0


if __name__ == "__main__":
    sys.exit(main())
