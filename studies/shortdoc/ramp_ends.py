"""What closes a short-document cell's ``ends`` and ``schedule`` terms: dynamic's plan re-ordered at both ends
(issue 39, the 24 GiB sharegpt Llama-2-7B P 16 cell).

One cell as ``studies.shortdoc.shortdoc`` plans it (``planner_for``), dynamic's plan only, then the same documents
in other microbatches and orders, each with ``zb`` rebuilt memory-aware (``build_zb``) and simulated, its gap terms
read as the study reads them (``gap_terms``, GEMMs saturated):

- ``down k``: the ``k`` smallest microbatches moved to the end, largest first (a ramp-down for the drain);
- ``front 1/d``: a front ramp of the shortest documents, taken out of the plan's many-document microbatches and
  packed one row a microbatch up to targets ``s0 g^i`` (``s0`` = the median microbatch's tokens / ``d``, ``g`` the
  ramp's growth ``1 + 2 / P``) below the plan's smallest microbatch (the packer's ramp, ``packing/dynamic/ramp.py``,
  is filled with the body's smallest microbatches' documents: single long documents on sharegpt);
- ``front 1/d + down k``: both; and the plan's own schedule re-simulated with every P2P hop at NVLink and at 0.

    PYTHONPATH=$PWD nice -n 10 python3 -m studies.shortdoc.ramp_ends --traces sharegpt --stages 16 --limits 24GiB
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import asdict, dataclass

import numpy as np
from studies.scaling import scaling

import dynmb
from dynmb import data
from dynmb.core.microbatch import Microbatch
from dynmb.core.types import Plan, Schedule
from dynmb.costmodel.base import CommModel
from dynmb.costmodel.loader import Models
from dynmb.packing.dynamic.ramp import growth
from dynmb.planning.zerobubble import build_zb, zb_evaluator, zb_inputs
from dynmb.timing.bounds import dependency_terms, split_mask, stage_ranks
from dynmb.timing.gap_terms import gap_terms
from dynmb.timing.simulate import plan_op_costs, simulate, simulate_costs
from studies.common import append_row
from studies.shortdoc import shortdoc

NVLINK = CommModel(alpha_s=10e-6, bytes_per_s=370e9)
"""The what-if link: ``GPUCostModel``'s NVLink 4 figures (one way)."""
DOWNS = (2, 4, 6, 8, 12)
SPANS = (16.0, 8.0)
BOTH_DOWNS = (4, 6, 8)


@dataclass
class EndsRow:
    """One variant of one cell (gap and terms in % of the ideal)."""

    trace: str
    model: str
    P: int
    limit: str
    embedding: str
    variant: str
    microbatches: int
    step_s: float
    gap: float
    schedule: float
    ends: float
    overhead: float
    shape: float
    fits: bool


def packed_row(seq_ids: np.ndarray, lengths: np.ndarray) -> Microbatch:
    """One microbatch of one packed row holding ``seq_ids`` (lengths ``lengths``)."""
    return Microbatch(seq_ids, lengths, int(np.sum(lengths)), 1, row_ids=np.zeros(len(seq_ids), dtype=int))


def tokens(mbs: list[Microbatch]) -> np.ndarray:
    return np.array([int(m.lengths.sum()) for m in mbs])


def ramp_down(mbs: list[Microbatch], k: int, start: int = 0) -> list[Microbatch]:
    """``mbs`` with the ``k`` smallest (by tokens) of its microbatches from ``start`` on moved to the end, largest of
    them first."""
    down = [start + int(i) for i in np.argsort(tokens(mbs[start:]), kind="stable")[:k][::-1]]
    return [m for i, m in enumerate(mbs) if i not in set(down)] + [mbs[i] for i in down]


def front_ramp(mbs: list[Microbatch], num_stages: int, span: float) -> tuple[list[Microbatch], list[Microbatch]]:
    """A front ramp of the shortest documents of ``mbs`` (module doc, ``front 1/span``) and what is left of ``mbs``."""
    sizes = tokens(mbs)
    targets, target = [], float(np.median(sizes)) / span
    while target < sizes.min():
        targets.append(target)
        target *= growth(num_stages)
    pool = sorted((int(length), int(s)) for m in mbs if len(m.lengths) > 1 for s, length in zip(m.seq_ids, m.lengths))
    ramp, used, k = [], set(), 0
    for target in targets:
        start, total = k, 0
        while k < len(pool) and total + pool[k][0] <= target:
            total += pool[k][0]
            k += 1
        if k > start:
            ramp.append(packed_row(np.array([s for _, s in pool[start:k]]), np.array([n for n, _ in pool[start:k]])))
            used.update(s for _, s in pool[start:k])
    rest = []
    for m in mbs:
        keep = [i for i, s in enumerate(m.seq_ids) if int(s) not in used]
        if keep:
            rest.append(m if len(keep) == len(m.seq_ids) else packed_row(m.seq_ids[keep], m.lengths[keep]))
    return ramp, rest


def variants(plan: Plan) -> list[tuple[str, list[Microbatch]]]:
    """The named microbatch lists of the module doc, the plan's first."""
    mbs = list(plan.microbatches)
    out = [("plan", mbs)] + [(f"down {k}", ramp_down(mbs, k)) for k in DOWNS]
    for span in SPANS:
        ramp, rest = front_ramp(mbs, plan.num_stages, span)
        out += [(f"front 1/{span:g}", ramp + rest)] + [(f"front 1/{span:g} + down {k}",
                                                         ramp_down(ramp + rest, k, len(ramp))) for k in BOTH_DOWNS]
    return out


def with_microbatches(plan: Plan, mbs: list[Microbatch]) -> Plan:
    ids = None if plan.replica_ids is None else (0,) * len(mbs)
    return dataclasses.replace(plan, microbatches=tuple(mbs), replica_ids=ids)


def link_steps(plan: Plan, schedule: Schedule, cm: dynmb.GPUCostModel) -> list[tuple[str, float, float]]:
    """``plan`` under ``schedule`` re-simulated with every P2P hop at ``NVLINK`` and at 0 seconds: (name, step,
    dependency bound) each."""
    costs = plan_op_costs(cm, plan, schedule)
    shapes = plan.shapes()
    nbytes = np.asarray(cm.model_cfg.link_bytes(shapes[:, 0], shapes[:, 1], plan.num_stages), dtype=np.float64)
    ranks, split = stage_ranks(plan.num_stages, schedule), split_mask(schedule)
    out = []
    for name, p2p in (("plan, NVLink hops", np.asarray(NVLINK.time(nbytes), dtype=np.float64).reshape(-1)),
                      ("plan, P2P 0", np.zeros(plan.num_microbatches))):
        bound = max(t.total for t in dependency_terms(costs, p2p, ranks, split).values())
        out.append((name, simulate_costs(schedule, costs, p2p).makespan_s, bound))
    return out


def row_of(where: tuple[str, str, int, str, str], name: str, plan: Plan, planner: dynmb.Planner,
           schedule: Schedule | None = None) -> EndsRow:
    """``plan`` (or its microbatches under ``schedule``) simulated and its gap terms as an ``EndsRow``."""
    cm, models = planner.cost_model, Models(planner.cost_model, planner.memory_model)
    sched = schedule if schedule is not None else build_zb(plan, "zb", models=models)
    _, peak = zb_evaluator(plan, models, zb_inputs(plan, models))(sched)
    step = simulate(sched, plan, cm, planner.memory_model).makespan_s
    t = gap_terms(plan, sched, cm, step, ideal_model=scaling.saturated(cm), ideal_split=False)
    pct = 100.0 / t.ideal
    return EndsRow(*where, name, plan.num_microbatches, step, pct * (step - t.ideal), pct * t.schedule, pct * t.ends,
                   pct * t.overhead, pct * t.shape, bool(np.all(peak <= plan.memory_limit_bytes)))


def cell(trace_name: str, model: str, P: int, limit: str, embedding: str) -> list[EndsRow]:
    """Every variant's ``EndsRow`` of one cell, and the two link what-ifs (terms but ``schedule`` left 0 there)."""
    trace = data.load_trace(trace_name)
    cfg = scaling.model_for(model, [trace])
    planner = shortdoc.planner_for(cfg, trace, P, limit, shortdoc.Variant(embedding=embedding))
    step = planner.plan(scaling.token_batch(trace, 500_000, 1, 0), method="dynamic")
    where = (trace_name, model, P, limit, embedding)
    rows = [row_of(where, "plan", step.plan, planner, step.schedule)]
    base = rows[0]
    ideal = base.step_s / (1 + base.gap / 100)
    for name, s, bound in link_steps(step.plan, step.schedule, planner.cost_model):
        rows.append(EndsRow(*where, name, base.microbatches, s, 100 * (s / ideal - 1), 100 * (s - bound) / ideal,
                            float("nan"), float("nan"), float("nan"), True))
    for name, mbs in variants(step.plan)[1:]:
        rows.append(row_of(where, name, with_microbatches(step.plan, mbs), planner))
    return rows


def _term(value: float) -> str:
    return "" if np.isnan(value) else f"{value:+.1f}"


def markdown(r: EndsRow) -> str:
    """The row of ``HEADER`` (the link what-ifs leave ``ends``, ``overhead``, ``shape`` blank: the plan's)."""
    terms = " | ".join(_term(v) for v in (r.schedule, r.ends, r.overhead, r.shape))
    return (f"| {r.trace} | {r.model} | {r.P} | {r.limit} | {r.embedding} | {r.variant} | {r.microbatches} | "
            f"{r.step_s:.4f} | {r.gap:+.1f}% | {terms} | {'yes' if r.fits else 'no'} |")


HEADER = ("| trace | model | P | limit | embedding | variant | mb | step s | gap | schedule | ends | overhead | shape | "
          "fits |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    shortdoc.add_cell_flags(ap, "sharegpt", "llama2-7b", "first", "JSON lines of the rows (appended per variant)")
    args = ap.parse_args(argv)
    print(HEADER, flush=True)
    for trace, model, P, limit in shortdoc.cell_grid(args):
        for row in cell(trace, model, P, limit, args.embedding):
            append_row(asdict(row), args.out)
            print(markdown(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
