"""Short documents near the limit (issue 39, judged criterion): dynamic's gap to the batch's ideal step and to every
other method on the chat / instruction traces, per cell, with the gap's terms.

One cell = (trace, model, P, memory limit): one 0.5M-token pipeline (``studies.scaling.scaling.token_batch``, seed 0,
DP 1) of a short-document trace (every shipped trace whose longest record is at most ``SHORT_LONGEST`` tokens), the
public ``dynmb.Planner`` with ``GPUCostModel`` (H100, ib), ``schedule="auto"``, ``stage_split="auto"`` on the trace
(``workload``) and so the token embedding's place chosen by the batch's simulated step (``embedding="auto"``, the
planner's default there), the model preset's ``max_seq_len`` raised as the scaling study raises it
(``scaling.model_for``). The other methods are planned under both embedding places and keep their faster
(``baseline_planners``; ``--others-embedding same``: on dynamic's planner only).
Every method plans the same batch with the same planner; the tuned baselines are swept as the scaling study sweeps
them (``token-budget`` and ``balanced`` at budgets cap / 2^j until the microbatch count stops changing, the step has
grown on two budgets in a row past the best, or the next would make more than ``MAX_MICROBATCHES``; ``fixed`` at its
largest fitting mbs and its halvings under the same rules), ``sorted`` at mbs 1, ``packed``, ``dynapipe``.

Per cell it prints one markdown row: dynamic's step, ``ideal_s`` (``dynmb.timing.gap_terms`` against the whole
batch priced with GEMMs saturated, no split-backward drain dropped: the scaling study's ideal, the same for every
method), the gap, the best other method and dynamic's step over it, the kind ``auto`` chose, the microbatch count,
the final check's ``grouping`` (an alternative grouping chosen over the packer's), and the gap's terms in % of the
ideal (``schedule`` = step - bound, ``ends`` fill / drain, ``overhead`` per-op fixed cost, ``padding``,
``passes`` split backward / recomputation, ``shape`` GEMM and attention efficiency at the microbatch's size).

    PYTHONPATH=$PWD nice -n 19 python3 -m studies.shortdoc.shortdoc --out results/shortdoc.jsonl
    python3 -m studies.shortdoc.shortdoc --table results/shortdoc.jsonl [--before results/shortdoc_before.jsonl]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
from studies.scaling import scaling

import dynmb
from studies.common import append_row
from dynmb import data
from dynmb.core.config import ModelConfig
from dynmb.costmodel.gpu import H100_SXM, GPUCostModel
from dynmb.memory.model import MemoryModelLike
from dynmb.packing.context import stage_windows
from dynmb.schedule.kinds import get_kind
from dynmb.timing import offload as timing_offload
from dynmb.timing.gap_terms import gap_terms
from dynmb.planning.memory_split import layout_of

SHORT_LONGEST = 8192
"""A trace is a short-document trace when its longest record is at most this many tokens (sharegpt's is 4,206; the
long-document traces reach 20,980)."""
MAX_MICROBATCHES = 4096
"""The sweeps stop before a setting that would make more microbatches than this (one pipeline)."""
PLAIN = ("sorted/1", "packed", "dynapipe")
"""The other methods planned once (name or name/mbs)."""
SWEPT = ("token-budget", "balanced", "fixed")
"""The other methods swept (module doc)."""


def add_cell_flags(ap: argparse.ArgumentParser, traces: str, models: str, embedding: str, out_help: str) -> None:
    """The grid flags of the one-cell scripts beside this one (``schedule_gap``, ``ramp_ends``)."""
    ap.add_argument("--traces", default=traces, help="trace names")
    ap.add_argument("--models", default=models, help="model presets")
    ap.add_argument("--stages", default="16", help="pipeline depths P")
    ap.add_argument("--limits", default="24GiB", help="memory limits per GPU")
    ap.add_argument("--embedding", choices=("first", "last"), default=embedding, help="shortdoc's --embedding")
    ap.add_argument("--out", type=Path, default=None, help=out_help)


def cell_grid(args: argparse.Namespace) -> list[tuple[str, str, int, str]]:
    """(trace, model, P, limit) of ``add_cell_flags``' flags, traces outermost, then limits, models, P."""
    return [(trace, model, P, limit) for trace in args.traces.split(",") for limit in args.limits.split(",")
            for model in args.models.split(",") for P in map(int, args.stages.split(","))]


def short_traces() -> list[str]:
    """The shipped traces whose longest record is at most ``SHORT_LONGEST`` tokens."""
    return [n for n in data.list_traces() if int(data.load_trace(n).max()) <= SHORT_LONGEST]


def plan_method(planner: dynmb.Planner, batch: np.ndarray, name: str) -> tuple[dynmb.PlannedStep, float]:
    """``name`` (``method`` or ``method/mbs``) planned, with the CPU seconds it took."""
    method, _, mbs = name.partition("/")
    t0 = time.process_time()
    step = planner.plan(batch, method=method, mbs=int(mbs) if mbs else None)
    return step, time.process_time() - t0


def sweep(plan: Callable[[int | None], dynmb.PlannedStep], start: list[int | None]) -> tuple[float, int | None]:
    """The scaling study's stop rules over the settings ``start`` (in order): the best step and its setting."""
    best, best_at, last, worse = float("inf"), None, None, 0
    for setting in start:
        if last is not None and 2 * last > MAX_MICROBATCHES:
            break
        try:
            step = plan(setting)
        except ValueError:
            break
        s, m = step.sim.makespan_s, step.plan.num_microbatches
        if s < best:
            best, best_at, worse = s, setting, 0
        else:
            worse += 1
        if m == last or worse >= 2:
            break
        last = m
    return best, best_at


def others(planners: dynmb.Planner | list[dynmb.Planner], batch: np.ndarray, names: list[str]) -> dict[str, Any]:
    """Every other method's step (``step_<name>``; a swept one at its best setting, ``<name>_at``), the fastest over
    ``planners`` (a list: one per embedding place, ``<name>_embedding`` the place kept)."""
    if not isinstance(planners, list):
        return method_steps(planners, batch, names)
    per = [method_steps(p, batch, names) for p in planners]
    out: dict[str, Any] = {}
    for name in names:
        got = [(o[f"step_{name}"], p.spec.embedding, o) for o, p in zip(per, planners) if f"step_{name}" in o]
        if got:
            _, place, best = min(got, key=lambda t: t[0])
            out.update({k: v for k, v in best.items() if k in (f"step_{name}", f"{name}_at")})
            out[f"{name}_embedding"] = place
    return out


def method_steps(planner: dynmb.Planner, batch: np.ndarray, names: list[str]) -> dict[str, Any]:
    """Every other method's step on ``planner`` (``step_<name>``; a swept one at its best setting, ``<name>_at``)."""
    out: dict[str, Any] = {}
    for name in names:
        try:
            if name not in SWEPT:
                out[f"step_{name}"] = plan_method(planner, batch, name)[0].sim.makespan_s
                continue
            if name == "fixed":
                first = planner.plan(batch, method="fixed")
                mbs = int(first.plan.meta.get("mbs") or 1)
                settings: list[int | None] = [mbs >> k for k in range(mbs.bit_length())]
            else:
                settings = [1 << j for j in range(12)]
            best, at = sweep(lambda s: planner.plan(batch, method=name, mbs=s), settings)  # noqa: B023
            out[f"step_{name}"], out[f"{name}_at"] = best, at
        except ValueError as e:
            print(f"  {name}: {e}", file=sys.stderr)
    return out


@dataclass(frozen=True)
class Variant:
    """Settings outside the judged one, to weigh alternatives (``--recompute``, ``--virtual``)."""

    recompute: str = "never"
    """``Planner(recompute=...)``: never (the judged setting), always or auto."""
    virtual: int = 1
    """Model chunks per GPU: 2 runs ``P`` GPUs as ``2 P`` chunks (``auto`` then weighs ``zb-v``)."""
    embedding: str | None = None
    """``Planner(embedding=...)``: None (the planner's default: ``auto`` under ``stage_split="auto"``, the faster
    place of the first batch, ``dynmb.planning.embedding_choice``), ``first`` or ``last``, the token embedding on the
    last pipeline rank (``dynmb.schedule.embedlast``: its states there, its embeds and their P2P priced on the last
    rank); each place with its own memory relief of the split."""
    offload: str = "never"
    """``PlanSpec.offload``: never (the default) or auto, activation offload to host memory
    (``dynmb.planning.offload``), for every method of the cell alike."""
    host_bytes_per_s: float | None = None
    """A what-if host link (bytes/s each way) in place of ``GPUSpec``'s PCIe figure (None: the H100's)."""
    state_shards: int = 1
    """``Planner(state_shards=...)``: the data-parallel ranks sharing each stage's model states (FSDP2 over the
    replicas, ``dynmb run --dp N --shard``), for every method of the cell alike; 1 (the default): held whole."""

    def gpu(self, cfg: ModelConfig, S: int) -> GPUCostModel:
        """The cell's cost model: H100 constants, the host link of ``host_bytes_per_s`` where given."""
        if self.host_bytes_per_s is None:
            return GPUCostModel(cfg, S)
        rate = float(self.host_bytes_per_s)
        return GPUCostModel(cfg, S, spec=replace(H100_SXM, host_d2h_bytes_per_s=rate, host_h2d_bytes_per_s=rate))


def stage_admission(mm: MemoryModelLike, limit_bytes: int) -> list[int]:
    """Tokens one microbatch may hold on each stage alone (one-token rows, tight budget) under 1F1B's window
    (``P - s`` in flight, which ``zb-h1`` and ``zb`` keep) and the memory model ``mm``: the first stage's is the
    microbatch cap, the next ones' what recomputing on the stages before them could raise it to."""
    num_stages = mm.num_stages
    caps = float(limit_bytes) - mm.state_bytes
    windows = stage_windows(get_kind("1f1b"), num_stages)
    out = []
    for s in range(num_stages):
        alone = np.full(num_stages, np.inf)
        alone[s] = caps[s]
        out.append(int(mm.max_rows(alone, 1, windows, tight=True)[0]))
    return out


def planner_for(cfg: ModelConfig, trace: np.ndarray, S: int, limit: str, variant: Variant) -> dynmb.Planner:
    """The cell's planner (module doc), the embedding placed as ``variant.embedding`` says (each place with the
    memory relief of ``stage_split="auto"`` weighed for it: ``ReliefInputs.embedding``)."""
    return dynmb.Planner(model=cfg, num_stages=S, memory_limit=limit, cost_model=variant.gpu(cfg, S),
                         schedule="auto", stage_split="auto", workload=trace, recompute=variant.recompute,
                         virtual=variant.virtual, embedding=variant.embedding, offload=variant.offload,
                         state_shards=variant.state_shards)


PLACES = ("first", "last")
"""The embedding's places a baseline is planned under (``--others-embedding both``)."""


def baseline_planners(cfg: ModelConfig, trace: np.ndarray, S: int, limit: str, variant: Variant,
                      planner: dynmb.Planner, both: bool) -> list[dynmb.Planner]:
    """The planners the other methods plan with: ``planner`` (dynamic's), or with ``both`` and dynamic's place
    chosen (``embedding`` auto, ``Planner.embedding_choice``) one planner per place, each with its own layout, so a
    baseline keeps its faster place (tuned in hindsight) rather than dynamic's."""
    if not both or planner.embedding_choice is None or planner.embedding_choice.first_s is None:
        return [planner]
    return [planner if place == planner.spec.embedding else planner_for(cfg, trace, S, limit,
                                                                        replace(variant, embedding=place))
            for place in PLACES]


def cell(trace_name: str, trace: np.ndarray, model: str, P: int, limit: str, names: list[str],
         variant: Variant = Variant(), both_places: bool = True) -> dict:
    """One cell's row (module doc); ``P`` counts GPUs; ``both_places``: the other methods under both embedding places
    where dynamic's was chosen (``baseline_planners``)."""
    cfg = scaling.model_for(model, [trace])
    batch = scaling.token_batch(trace, 500_000, 1, 0)
    S = P * variant.virtual
    planner = planner_for(cfg, trace, S, limit, variant)
    key = {"trace": trace_name, "model": model, "P": P, "limit": limit, "sequences": int(batch.size),
           "recompute": variant.recompute, "virtual": variant.virtual, "embedding": variant.embedding,
           "offload": variant.offload, "host_bytes_per_s": variant.host_bytes_per_s,
           "prefetch_lead": timing_offload.PREFETCH_LEAD, "state_shards": variant.state_shards}
    try:
        dyn, dyn_cpu = plan_method(planner, batch, "dynamic")
    except ValueError as e:
        return {**key, "status": str(e)[:200]}
    cm, choice = planner.cost_model, planner.embedding_choice
    key.update(embedding_place=planner.spec.embedding, embedding_first_s=choice and choice.first_s,
               embedding_last_s=choice and choice.last_s)
    plan, sim = dyn.plan, dyn.sim
    terms = gap_terms(plan, dyn.schedule, cm, sim.makespan_s, ideal_model=scaling.saturated(cm),
                      ideal_split=False).check()
    relief = planner.split_relief
    balanced_ideal = terms.ideal if relief is None or not relief.relieved else gap_terms(
        plan, dyn.schedule, cm, sim.makespan_s, ideal_model=scaling.saturated(
            cm.for_layout(layout_of(planner.model_cfg, S, relief.balanced), S)),
        ideal_split=False).ideal
    steps = others(baseline_planners(cfg, trace, S, limit, variant, planner, both_places), batch, names)
    plain = {k: v for k, v in steps.items() if k.startswith("step_")}
    best = min(plain, key=plain.__getitem__) if plain else ""
    auto = plan.meta.get("schedule_auto") or {}
    row = {**key, "status": "ok", "step_s": sim.makespan_s, "bound_s": terms.bound, "ideal_s": terms.ideal,
           "gap": sim.makespan_s / terms.ideal - 1, "kind": plan.schedule_kind, "microbatches": plan.num_microbatches,
           "grouping": plan.meta.get("grouping") or "dynamic", "plan_cpu_s": dyn_cpu,
           "offload_blocks": list(plan.meta.offload_blocks or []), "offload_stall_s": sim.extra.get("offload_stall_s"),
           "split": list(planner.model_cfg.stage_layer_counts(S)), "relieved": bool(relief and relief.relieved),
           "admission": stage_admission(planner.memory_model, planner.memory_limit_bytes) if variant.virtual == 1
           else None,
           "ideal_balanced_s": balanced_ideal, "gap_balanced": sim.makespan_s / balanced_ideal - 1,
           "best_other": best.removeprefix("step_"), "best_other_s": plain.get(best, float("nan")),
           **{f"auto_{k}": v for k, v in auto.items()}, **steps, **terms.fractions()}
    return row


TABLE_TERMS = ("schedule", "ends", "overhead", "shape", "padding", "passes", "split")


def _pct(r: object) -> str:
    return " | ".join(f"{100 * getattr(r, 'gap_' + t):+.1f}" for t in TABLE_TERMS)


def _place(r: object) -> str:
    """`` (embedding last)`` where the cell's plan puts the embedding on the last rank (recorded rows only)."""
    place = getattr(r, "embedding_place", None)
    return " (embedding last)" if place == "last" else ""


def _balanced(r: object) -> str:
    """The gap against the work-balanced split's ideal and the first stages' admitted tokens (where recorded)."""
    gap = getattr(r, "gap_balanced", float("nan"))
    admitted = getattr(r, "admission", None)
    tokens = ", ".join(map(str, admitted[:3])) if isinstance(admitted, list) else ""
    return f"{'' if pd.isna(gap) else f'{100 * gap:+.1f}%'} | {tokens}"


def markdown(df: pd.DataFrame) -> str:
    """One row per cell (module doc), the terms in % of the ideal; the gap against the work-balanced split's ideal
    and the tokens the first three stages admit (``stage_admission``)."""
    head = ("| trace | model | P | limit | step s | ideal s | gap | gap (balanced split's ideal) | tokens admitted, "
            "stages 0-2 | best other (s) | dyn / best | kind | mb | grouping | " + " | ".join(TABLE_TERMS)
            + " | plan CPU s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in df.itertuples():
        if r.status != "ok":
            lines.append(f"| {r.trace} | {r.model} | {r.P} | {r.limit} | {r.status} |")
            continue
        lines.append(f"| {r.trace} | {r.model} | {r.P} | {r.limit} | {r.step_s:.4f} | {r.ideal_s:.4f} | "
                     f"{100 * r.gap:+.1f}% | {_balanced(r)} | {r.best_other} ({r.best_other_s:.4f}) | "
                     f"{r.step_s / r.best_other_s:.3f} | {r.kind}{_place(r)} | {r.microbatches} | {r.grouping} | {_pct(r)} | "
                     f"{r.plan_cpu_s:.1f} |")
    return "\n".join(lines)


KEY = ["trace", "model", "P", "limit"]


def merged(rows: pd.DataFrame, others_from: pd.DataFrame | None = None) -> pd.DataFrame:
    """``rows``' last row per cell, the other methods' steps the smallest of any row of the cell in ``others_from``
    (default ``rows``) that has them (a run of dynamic alone takes them from a run with every method)."""
    src = rows if others_from is None else pd.concat([others_from, rows], ignore_index=True)
    others = [c for c in src.columns if c.startswith("step_") and c != "step_s"]
    df = rows.drop_duplicates(KEY, keep="last").drop(columns=[c for c in rows.columns if c in others
                                                               or c in ("best_other", "best_other_s")])
    if not others:
        return df.assign(best_other="", best_other_s=float("nan"))
    df = df.merge(src.groupby(KEY)[others].min().reset_index(), on=KEY, how="left")
    df["best_other_s"] = df[others].min(axis=1)
    df["best_other"] = [min((v, c) for c, v in r.items() if pd.notna(v))[1].removeprefix("step_")
                        if r.notna().any() else "" for _, r in df[others].iterrows()]
    return df


def before_after(before: pd.DataFrame, after: pd.DataFrame) -> str:
    """One row per cell: dynamic's step and gap before -> after, dynamic / the best other (after), the kind and
    microbatches before -> after, the terms after."""
    df = merged(after[after.status == "ok"], before[before.status == "ok"]).merge(
        before[before.status == "ok"].drop_duplicates(KEY, keep="last")[
            [*KEY, "step_s", "gap", "kind", "microbatches", "plan_cpu_s"]], on=KEY, suffixes=("", "_before"))
    head = ("| trace | model | P | limit | step s before -> after | gap before -> after | best other (s) | dyn / best | "
            "kind, mb before -> after | " + " | ".join(TABLE_TERMS) + " | plan CPU s before -> after |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in df.sort_values(["limit", "P", "trace", "model"]).itertuples():
        lines.append(f"| {r.trace} | {r.model} | {r.P} | {r.limit} | {r.step_s_before:.4f} -> {r.step_s:.4f} | "
                     f"{100 * r.gap_before:+.1f}% -> {100 * r.gap:+.1f}% | {r.best_other} ({r.best_other_s:.4f}) | "
                     f"{r.step_s / r.best_other_s:.3f} | {r.kind_before} {r.microbatches_before} -> {r.kind} "
                     f"{r.microbatches}{_place(r)} | {_pct(r)} | {r.plan_cpu_s_before:.1f} -> {r.plan_cpu_s:.1f} |")
    return "\n".join(lines)


def read(paths: list[Path]) -> pd.DataFrame:
    return pd.concat([pd.read_json(p, lines=True) for p in paths if p.is_file()], ignore_index=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default=None, help="trace names (default: every shipped short-document trace)")
    ap.add_argument("--models", default="llama2-7b,llama3.1-8b", help="model presets")
    ap.add_argument("--stages", default="4,8,16", help="pipeline depths P")
    ap.add_argument("--limits", default="80GiB,24GiB", help="memory limits per GPU")
    ap.add_argument("--others", default=",".join((*SWEPT, *PLAIN)), help="other methods (name or name/mbs); '' none")
    ap.add_argument("--recompute", default="never", help="Planner(recompute=...): never (judged), always, auto")
    ap.add_argument("--virtual", type=int, default=1, help="model chunks per GPU (2: P GPUs as 2P chunks, zb-v)")
    ap.add_argument("--embedding", choices=("first", "last", "auto"), default=None,
                    help="Planner(embedding=...): default the planner's (auto under stage_split='auto': the faster "
                         "place of the first batch), first, or last (the token embedding on the last rank)")
    ap.add_argument("--others-embedding", choices=("both", "same"), default="both",
                    help="both (default): where dynamic's embedding place was chosen, every other method planned "
                         "under both places and its faster kept; same: on dynamic's planner")
    ap.add_argument("--offload", choices=("never", "auto"), default="never",
                    help="PlanSpec.offload for every method: never (default) or auto (activation offload to host)")
    ap.add_argument("--host-gbps", type=float, default=None,
                    help="what-if host link, GB/s each way (default: GPUSpec's PCIe Gen5 figure)")
    ap.add_argument("--prefetch-lead", type=int, default=None,
                    help="what-if: ops before a backward its reload is issued (default: the runtime's, "
                         "dynmb.timing.offload.PREFETCH_LEAD)")
    ap.add_argument("--state-shards", type=int, default=1,
                    help="Planner(state_shards=...) for every method: the data-parallel ranks sharing each stage's "
                         "model states (FSDP2, `dynmb run --dp N --shard`; 8: one replica of an 8-replica job); "
                         "default 1: held whole")
    ap.add_argument("--out", type=Path, default=None, help="JSON lines of the rows (appended per cell)")
    ap.add_argument("--table", type=Path, nargs="+", default=None,
                    help="print the markdown table of these JSON lines (later rows win per cell) and exit")
    ap.add_argument("--before", type=Path, nargs="+", default=None, help="with --table: a before -> after table")
    args = ap.parse_args(argv)
    if args.table is not None:
        after = read(args.table)
        print(markdown(merged(after[after.status == "ok"])) if args.before is None
              else before_after(read(args.before), after))
        return 0
    names = [m for m in args.others.split(",") if m]
    if args.prefetch_lead is not None:             # a what-if of the runtime's prefetch depth
        timing_offload.PREFETCH_LEAD = int(args.prefetch_lead)
    for name in args.traces.split(",") if args.traces else short_traces():
        trace = data.load_trace(name)
        for limit in args.limits.split(","):
            for model in args.models.split(","):
                for P in map(int, args.stages.split(",")):
                    row = cell(name, trace, model, P, limit, names, Variant(
                        args.recompute, args.virtual, args.embedding, args.offload,
                        None if args.host_gbps is None else args.host_gbps * 1e9, args.state_shards),
                        both_places=args.others_embedding == "both")
                    append_row(row, args.out)
                    print(markdown(pd.DataFrame([row])).splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
