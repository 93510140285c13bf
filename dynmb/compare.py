"""The main job: fixed against dynamic microbatching on real pipelines, in one run.

``run_compare`` plans every method on the same global batches, runs them all as the
cases of ONE torchrun job (one process per stage; gloo on CPU, NCCL on CUDA), so the
throughputs are measured side by side on the same machine state. On CPU the cases run
round by round (step k of every method, the order rotated each round, then step k + 1;
``--sequential`` for one method after another, as on CUDA), so a burst of outside load on a
shared machine slows every method alike instead of whichever ran during it. Then:

1. prints a pandas table per method: tokens/s, speedup vs ``fixed``, padding fraction,
   mean bubble, peak / limit, predicted vs measured step time, plan time;
2. writes ``summary.csv`` next to the tidy ``steps``/``actions``/``memory``/``runs`` tables;
3. plots ``throughput.png`` and measured-vs-predicted Gantt charts for ``fixed`` and
   ``dynamic`` (``gantt_<method>_measured.png`` / ``gantt_<method>_predicted.png``).

Defaults (``dynmb compare``): the sharegpt trace, the ``small`` model, 2 stages, a 1 GiB
limit (binding: ``fixed`` can only afford a few rows of the longest sequences), global
batches of 32 sequences, each method's own microbatch order (``--reorder auto``),
1 warm-up + 3 measured steps per method. The cost model is the
one fitted on this kind of CPU and shipped in ``data/costmodels/`` when the model and
stage count match, else the analytic stand-in (``--cost-model`` for your own fit).

Equivalent torchrun line of one case: see ``dynmb.runtime.worker``.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pandas as pd

__all__ = ["run_compare", "default_cost_model_path", "reorder_for", "COLUMNS", "AUTO_REORDER"]

# The order each method runs its microbatches in under ``--reorder auto``: the systems the
# baselines stand for do not reorder (Megatron, DeepSpeed, fairseq) except DynaPipe, which
# searches permutations of cost clusters; dynmb's own method uses its simulator-guided search.
AUTO_REORDER = {"dynamic": "search", "dynapipe": "dynapipe"}

COLUMNS = ["tokens_per_s", "x_dynamic", "speedup_vs_fixed", "padding_fraction", "mean_bubble", "peak_over_limit",
           "pred_step_s", "step_s", "pred_err", "plan_s", "num_microbatches", "mbs", "distinct_shapes", "new_shapes"]
FIXED_SIZE_METHODS = ("fixed", "sorted", "packed")


def default_cost_model_path(model: str, stages: int, device: str = "cpu") -> str | None:
    """The shipped fitted cost model for (model, stages) on ``device`` ("cpu"/"cuda"), if there is one."""
    p = Path(__file__).resolve().parent.parent / "data" / "costmodels" / f"{model}-p{stages}-{device}.json"
    return str(p) if p.exists() else None


def reorder_for(method: str, reorder: str) -> str:
    """The reorder pass of ``method`` under ``--reorder`` (``auto``: see ``AUTO_REORDER``)."""
    return AUTO_REORDER.get(method, "none") if reorder == "auto" else reorder


def _plan_kwargs(args: argparse.Namespace, method: str, mbs: int | None = None) -> dict[str, Any]:
    """``plan_step`` keyword arguments of one compare case (the worker plans with the same)."""
    from .config import model_config, parse_bytes
    from .costmodel import get_cost_model
    from .memory import get_memory_model

    cfg = model_config(args.model, attention=args.attention)
    return dict(method=method, model_cfg=cfg, num_stages=args.stages, memory_limit_bytes=parse_bytes(args.memory_limit),
                schedule_kind=args.schedule, mbs=mbs if mbs is not None else (args.mbs if method in FIXED_SIZE_METHODS else None),
                reorder=reorder_for(method, args.reorder), virtual=int(getattr(args, "virtual", 1) or 1),
                cost_model=get_cost_model(args.cost_model, cfg, args.stages),
                memory_model=get_memory_model(getattr(args, "memory_model", None), cfg, args.stages),
                oversize=args.oversize, pack_len=args.pack_len, round_to=args.round_to,
                recompute=getattr(args, "recompute", "never"))


def fixed_candidates(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    """``(automatic mbs of each step, candidates)`` for the best fixed mbs in hindsight: 1, 2, 4, ...
    below the smallest automatic mbs (the largest that fits) of the run's steps, so that every
    candidate fits every step."""
    from .data import load_trace, sample_batch
    from .planner import plan_step

    trace = load_trace(args.lengths or args.dataset)
    kw = _plan_kwargs(args, "fixed", mbs=0)
    kw["mbs"], kw["reorder"] = None, "none"
    auto = [int(plan_step(sample_batch(trace, args.global_batch, args.seed, step=k), **kw)[0].meta["mbs"])
            for k in range(args.warmup + args.steps)]
    return auto, [1 << i for i in range(12) if (1 << i) < min(auto)]


def _gantts(out: Path, steps: pd.DataFrame, actions: pd.DataFrame, method: str, args: argparse.Namespace) -> list[str]:
    """Measured and predicted timelines of the first measured step of ``method`` (its main case)."""
    from .data import load_trace, sample_batch
    from .plots import gantt
    from .planner import plan_step

    ms = steps[(steps["label"] == method) & (~steps["warmup"].astype(bool))]
    if ms.empty:
        return []
    run_id, k = ms.iloc[0]["run_id"], int(ms.iloc[0]["step"])
    tl = actions[(actions["run_id"] == run_id) & (actions["step"] == k)]
    paths = [gantt(tl, str(out / f"gantt_{method}_measured.png"),
                   title=f"{method}: measured step {k} ({ms.iloc[0]['step_s']:.2f} s)")]
    batch = sample_batch(load_trace(args.lengths or args.dataset), args.global_batch, args.seed, step=k)
    _, _, sim = plan_step(batch, **_plan_kwargs(args, method))
    paths.append(gantt(sim.timeline, str(out / f"gantt_{method}_predicted.png"),
                       title=f"{method}: predicted step {k} ({sim.makespan_s:.2f} s)"))
    return paths


def display_summary(summary: pd.DataFrame, labels: list[str]) -> pd.DataFrame:
    """``summarise``'s rows indexed by a display name, in case order: ``fixed (mbs 3)`` for the
    largest mbs that fits, ``fixed (mbs 1)`` ... for the hindsight candidates, then a
    ``fixed-best (mbs B)`` row repeating the fastest fixed case."""
    flat = summary.reset_index()
    flat = flat.set_index("label").reindex([lb for lb in labels if lb in set(flat["label"])]).reset_index()

    def name(row: pd.Series) -> str:
        if row["method"] in FIXED_SIZE_METHODS and row["method"] != "packed" and row.get("mbs"):
            return f"{row['method']} (mbs {row['mbs']})"
        return str(row["label"])

    flat.insert(0, "case", flat.apply(name, axis=1))
    fixed = flat[flat["method"] == "fixed"]
    if len(fixed) > 1:
        best = fixed.loc[fixed["tokens_per_s"].idxmax()].copy()
        best["case"] = f"fixed-best (mbs {best['mbs']})"
        at = int(fixed.index.max()) + 1
        flat = pd.concat([flat.iloc[:at], best.to_frame().T, flat.iloc[at:]], ignore_index=True)
    return flat.set_index("case")


def format_summary(summary: pd.DataFrame, reference: str = "dynamic") -> str:
    """The printed table: fixed-point numbers, dynamic's paired ratio to every case with its
    spread, and one line naming the best other case."""
    col = f"x_{reference}"
    view = pd.DataFrame(index=summary.index)
    view["tokens/s"] = summary["tokens_per_s"].map("{:,.0f}".format)
    if col in summary:
        view[f"{reference} x"] = [f"{m:.2f} ({lo:.2f}-{hi:.2f})" for m, lo, hi in
                                  zip(summary[col], summary[f"{col}_lo"], summary[f"{col}_hi"])]
    fmt = {"padding_fraction": ("padding", "{:.3f}"), "mean_bubble": ("bubble", "{:.3f}"),
           "peak_over_limit": ("peak/limit", "{:.3f}"), "pred_step_s": ("pred step s", "{:.2f}"),
           "step_s": ("step s", "{:.2f}"), "pred_err": ("pred err", "{:.1%}"), "num_microbatches": ("mbs/step", "{:.1f}"),
           "distinct_shapes": ("shapes", "{:.1f}"), "new_shapes": ("new shapes", "{:.0f}")}
    for key, (title, f) in fmt.items():
        if key in summary:
            view[title] = summary[key].map(lambda v, f=f: "" if pd.isna(v) else f.format(float(v)))
    if "plan_s" in summary:
        view["plan ms"] = (summary["plan_s"].astype(float) * 1e3).map("{:.1f}".format)
    text = view.to_string()
    others = summary[(summary["method"] != reference) & ~summary.index.str.startswith("fixed-best")]
    if col in summary and not others.empty and (summary["method"] == reference).any():
        best = others[col].astype(float).idxmin()
        text += (f"\n{reference} is {others.loc[best, col]:.2f}x the best other case ({best}; median of per-step "
                 f"paired ratios, range {others.loc[best, col + '_lo']:.2f}-{others.loc[best, col + '_hi']:.2f})")
    return text


def run_compare(args: argparse.Namespace) -> int:
    """``dynmb compare``: see the module docstring. Returns the exit code."""
    from .analysis import summarise
    from .config import PipelineConfig, RunConfig, model_config, parse_bytes
    from .plots import compare_throughput
    from .results import load_results, write_table
    from .runtime.launch import default_backend_device, failure_lines, launch_spec, write_spec

    if args.dataset is None and args.lengths is None:
        args.dataset = "sharegpt"
    if args.memory_limit is None:
        args.memory_limit = "1GiB"
    device = getattr(args, "device", None) or default_backend_device()[1]
    backend = "nccl" if device == "cuda" else "gloo"
    virtual = int(getattr(args, "virtual", 1) or 1)
    if virtual > 1 and args.schedule == "1f1b":
        args.schedule = "interleaved"
    if args.stages % virtual:
        raise ValueError(f"--stages {args.stages} is not a multiple of --virtual {virtual}")
    nproc = args.stages // virtual
    if args.cost_model is None:
        args.cost_model = default_cost_model_path(args.model, args.stages, device)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    limit = parse_bytes(args.memory_limit)
    tag = uuid.uuid4().hex[:6]
    model_cfg = model_config(args.model, attention=args.attention)
    # (label, method, mbs): each method's own case, plus fixed at mbs 1, 2, 4, ... for the best in hindsight
    runs: list[tuple[str, str, int | None]] = [(m, m, args.mbs if m in FIXED_SIZE_METHODS else None) for m in methods]
    auto_mbs: list[int] = []
    if "fixed" in methods and args.mbs is None and not args.no_fixed_best:
        auto_mbs, candidates = fixed_candidates(args)
        runs += [(f"fixed mbs={b}", "fixed", b) for b in candidates]
    cases = []
    for label, m, mbs in runs:
        cfg = RunConfig(model=model_cfg,
                        pipeline=PipelineConfig(num_stages=args.stages, virtual=virtual, schedule=args.schedule,
                                                memory_limit_bytes=limit, reorder=reorder_for(m, args.reorder)),
                        dataset=args.lengths or args.dataset, global_batch=args.global_batch, method=m,
                        mbs=mbs, seed=args.seed, steps=args.steps, warmup=args.warmup, backend=backend, device=device,
                        cost_model=args.cost_model, oversize=args.oversize, pack_len=args.pack_len,
                        round_to=args.round_to, prewarm=args.prewarm, recompute=getattr(args, "recompute", "never"),
                        expandable_segments=not args.no_expandable_segments)
        spec = write_spec(cfg, out, run_id=f"{label.replace(' ', '-').replace('=', '')}-{tag}",
                          memory_model=getattr(args, "memory_model", None),
                          allow_over_limit=bool(getattr(args, "allow_over_limit", False)))
        cases.append({**spec, "label": label})
    print(f"dynmb compare: {len(cases)} cases ({', '.join(r[0] for r in runs)}) x ({args.warmup} warm-up + {args.steps} steps) on "
          f"{nproc} {backend} rank(s) ({args.stages} stages, {args.schedule}, {device}), "
          f"{args.dataset or args.lengths}, global batch {args.global_batch}, "
          f"limit {args.memory_limit}, reorder {args.reorder}, cost model {args.cost_model or 'analytic'} -> {out}", file=sys.stderr)
    t0 = time.perf_counter()
    interleave = device == "cpu" and not getattr(args, "sequential", False)
    rc = launch_spec({"out_dir": str(out.resolve()), "cases": cases, "interleave": interleave}, nproc,
                     quiet=not args.verbose, progress=True)
    wall = time.perf_counter() - t0
    if rc != 0:
        for line in failure_lines(out, "") or [f"torchrun exited with code {rc}"]:
            print(f"dynmb compare: {line}", file=sys.stderr)
        return rc
    tables = load_results(out)
    ids = {c["run_id"] for c in cases}
    tables = {k: (v[v["run_id"].isin(ids)] if "run_id" in v.columns else v) for k, v in tables.items()}
    summary = display_summary(summarise(tables), [r[0] for r in runs])
    write_table(summary.reset_index(), out / "summary.csv")
    compare_throughput(summary, str(out / "throughput.png"),
                       title=f"{args.dataset or args.lengths}, {args.model}, {args.stages} stages, limit {args.memory_limit}")
    pngs = ["throughput.png"]
    for m in ("fixed", "dynamic"):
        if m in methods:
            pngs += [Path(p).name for p in _gantts(out, tables["steps"], tables["actions"], m, args)]
    print(format_summary(summary))
    print(f"\n{len(cases)} cases in {wall:.0f} s; tables steps/actions/memory/runs/summary (.csv"
          f"{', .parquet' if (out / 'summary.parquet').exists() else ''}) and {', '.join(pngs)} in {out}")
    over = summary["peak_over_limit"] > 1 if "peak_over_limit" in summary else pd.Series(dtype=bool)
    if over.any():
        print(f"dynmb compare: measured peak over the limit for {list(summary.index[over])}", file=sys.stderr)
        return 1
    return 0
