"""Cost-model ablation: plan with the fitted (poly), grid-interpolated or analytic cost model.

What it measures: for each (trace, packing method, cost model) the plan the packer makes
with that model, its step time predicted by that same model (``pred_step_s``), the same
plan simulated under a common reference model (``--reference``, default the fitted poly
model: ``ref_pred_step_s``, ``ref_tokens_per_s``; this is what the choice of model costs in
throughput when the reference is right) -- table ``sim``, one row per global batch -- and,
with ``--real``, the measured step time and tokens/s of real runs of the same
configurations (tables ``steps``/``actions``/``memory``/``runs``, ``configs``, and ``real`` =
settings + measured medians + ``pred_err``). Resumable by settings columns (``cost_model``
holds the kind: poly, grid, analytic).

The poly and grid models are fitted (``dynmb.costmodel.fit_cost_model``) on ``--samples``
(CSV from ``dynmb profile``), or on a quick profile written to ``OUT/samples.csv`` when
none is given; they are saved as ``OUT/cost-poly.json`` and ``OUT/cost-grid.json``. Both
price a packed microbatch by its attention work (sum of document_length^2): the poly model
as a feature, the grid model (which interpolates over shapes only) by its linear correction.

    python -m studies.costmodel.ablation --samples samples-small-p2-cpu.csv --out results/costmodel_ablation
    python -m studies.costmodel.ablation --samples samples.csv --real --traces sharegpt --out results/cm_real
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
from studies.common import (Resume, SIM_SETTINGS, add_model_flags, measured, parse_batches, progress, real_flags, run_real,
                     simulate_rows, split_list)

from dynmb import data
from dynmb import ModelConfig, simulate
from dynmb.core.config import parse_bytes
from dynmb.costmodel import CostModel, get_cost_model
from dynmb.memory.model import get_memory_model
from dynmb.io.results import TableWriter

KINDS = ("poly", "grid", "analytic")
REAL_KEYS = SIM_SETTINGS + ("steps", "warmup")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--samples", nargs="*", default=None, help="profiled samples CSV(s) (default: profile --quick into OUT)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="cost models to plan with (default poly,grid,analytic)")
    ap.add_argument("--reference", default="poly", choices=KINDS, help="model every plan is also simulated under")
    ap.add_argument("--traces", default="sharegpt,alpaca_eval,humaneval", help="comma-separated traces")
    ap.add_argument("--memory-limit", default="1GiB", help="per-GPU limit (default 1GiB)")
    ap.add_argument("--methods", default="dynamic,dynapipe", help="packing methods that use the cost model")
    ap.add_argument("--global-batch", default="64,wikitext2=16", help="sequences per global batch, per-trace overrides")
    ap.add_argument("--real", action="store_true", help="also measure each configuration on a real pipeline")
    ap.add_argument("--retry-failed", action="store_true", help="rerun real configurations recorded as failed")
    ap.add_argument("--out", default="results/costmodel_ablation", help="results folder")
    add_model_flags(ap)
    real_flags(ap, steps=2)
    return ap


def fitted_models(args: argparse.Namespace, cfg: ModelConfig) -> dict[str, str | None]:
    """kind -> cost-model JSON path (None for analytic); fits and saves poly/grid once."""
    from dynmb.costmodel import fit_cost_model
    from dynmb.measure import load_samples

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, str | None] = {"analytic": None}
    need = [k for k in ("poly", "grid") if not (out / f"cost-{k}.json").exists()]
    if need:
        if args.samples:
            samples = load_samples(args.samples)
        else:
            from dynmb.measure import profile

            print("costmodel_ablation: no --samples; profiling a quick grid (about a minute)", file=sys.stderr)
            samples = profile(cfg, args.stages, quick=True, output=out / "samples.csv", progress=not args.no_progress)
        for k in need:
            fit_cost_model(samples, cfg, args.stages, kind=k).save(out / f"cost-{k}.json")
    for k in ("poly", "grid"):
        paths[k] = str((out / f"cost-{k}.json").resolve())
    return paths


def configurations(args: argparse.Namespace) -> list[dict]:
    batch_of = parse_batches(args.global_batch)
    return [dict(dataset=t, model=args.model, num_stages=args.stages, dp=1, global_batch=batch_of(t),
                 memory_limit_bytes=parse_bytes(args.memory_limit), method=m, mbs=None, schedule=args.schedule,
                 reorder="none", cost_model=k, seed=args.seed, oversize=args.oversize)
            for t in split_list(args.traces) for m in split_list(args.methods) for k in split_list(args.kinds)]


def reference_rows(rows: list[dict], ref: CostModel, mm) -> list[dict]:
    """Add the plan's step time simulated under the reference model; drop private fields."""
    out = []
    for r in rows:
        if r.get("status") == "ok":
            t = simulate(r["_sched"], r["_plan"], ref, mm).makespan_s
            r.update(ref_pred_step_s=t, ref_tokens_per_s=r["real_tokens"] / t)
        out.append({k: v for k, v in r.items() if not k.startswith("_")})
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = ModelConfig.preset(args.model)
    paths = fitted_models(args, cfg)
    models = {k: get_cost_model(p, cfg, args.stages) for k, p in paths.items()}
    mm = get_memory_model(args.memory_model, cfg, args.stages)
    configs = configurations(args)
    resume = Resume(args.out, "sim", SIM_SETTINGS)
    todo = [c for c in configs if not resume.done(c)]
    traces: dict = {}
    with TableWriter(args.out) as w:
        for c in progress(todo, total=len(todo), desc="simulate", disable=args.no_progress):
            tr = traces.setdefault(c["dataset"], data.load_trace(c["dataset"]))
            rows = simulate_rows(c, tr, model_cfg=cfg, cost_model=models[c["cost_model"]], memory_model=mm,
                                 steps=args.steps)
            w.append("sim", reference_rows(rows, models[args.reference], mm))
    if not args.real:
        return 0
    keep = ("ok",) if args.retry_failed else ("ok", "failed")
    resume = Resume(args.out, "configs", REAL_KEYS, where=lambda d: d["status"].isin(keep))
    todo = [c for c in ({**c, "steps": args.steps, "warmup": args.warmup} for c in configs) if not resume.done(c)]
    groups: dict = {}
    for c in todo:
        groups.setdefault(c["dataset"], []).append(c)
    failed = 0
    for _, cases in progress(list(groups.items()), total=len(groups), desc="real runs", disable=args.no_progress):
        rows = run_real(cases, args.out, steps=args.steps, warmup=args.warmup, timeout=args.timeout,
                        cost_model_path=lambda s: paths[s["cost_model"]], memory_model=args.memory_model,
                        quiet=args.quiet)
        failed += sum(r["status"] != "ok" for r in rows)
        ok = pd.DataFrame([r for r in rows if r["status"] == "ok"])
        if not ok.empty:
            with TableWriter(args.out) as w:
                w.append("real", ok.merge(measured(args.out, ok["run_id"]), on="run_id"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
