"""Where the ``schedule`` term (step above its dependency bound) of a short-document cell sits, and what P2P
latency makes of it (issue 39, the 24 GiB P 16 cells).

One cell as ``studies.shortdoc.shortdoc`` plans it (``planner_for``: the same planner, batch and ``--embedding``
what-if), dynamic's plan only. Per cell: the kind and microbatch count, the step, its bound and the ideal
(``gap_terms``, GEMMs saturated), the ``schedule`` term and its P2P share (``dynmb.timing.gap_terms.schedule_wire``:
what the messages' latency costs the schedule beyond what the bound charges), the idle time of the bound's rank
in the first, middle eight and last tenths of the step, and the plan's ``zb`` schedule rebuilt with and without
the list scheduler's pumped candidates (``dynmb.schedule.zerobubble.PUMPED``) on the same microbatches.

    PYTHONPATH=$PWD nice -n 10 python3 -m studies.shortdoc.schedule_gap --stages 16 --embedding last
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

import numpy as np
from studies.scaling import scaling

from dynmb import data
from dynmb.costmodel.loader import Models
from dynmb.planning.zerobubble import build_zb, zb_evaluator, zb_inputs
from dynmb.schedule import zerobubble
from dynmb.timing.gap_terms import gap_terms, schedule_wire
from dynmb.timing.simulate import simulate
from studies.common import append_row
from studies.shortdoc import shortdoc


@dataclass
class GapRow:
    """One cell's schedule-term breakdown (percentages of the ideal; idle in ms on the bound's rank)."""

    trace: str
    model: str
    P: int
    limit: str
    embedding: str
    kind: str
    microbatches: int
    step_s: float
    bound_s: float
    ideal_s: float
    gap: float
    schedule: float
    wire: float
    idle_first_ms: float
    idle_middle_ms: float
    idle_last_ms: float
    rank: int
    zb_plain_s: float
    zb_pumped_s: float


def idle_tenths(timeline, rank: int, step_s: float) -> tuple[float, float, float]:
    """Idle seconds of ``rank`` in the first tenth of the step, the middle eight and the last tenth."""
    rows = timeline[timeline["rank"] == rank]
    edges = np.linspace(0.0, step_s, 11)
    busy = np.array([np.clip(np.minimum(rows.end_s, hi) - np.maximum(rows.start_s, lo), 0.0, None).sum()
                     for lo, hi in zip(edges[:-1], edges[1:])])
    idle = (edges[1] - edges[0]) - busy
    return float(idle[0]), float(idle[1:-1].sum()), float(idle[-1])


def zb_steps(plan, models: Models) -> tuple[float, float]:
    """The plan's ``zb`` step without and with the pumped candidates, same microbatches and order."""
    evaluate = zb_evaluator(plan, models, zb_inputs(plan, models))
    out = []
    try:
        for pumped in (False, True):
            zerobubble.PUMPED = pumped
            out.append(evaluate(build_zb(plan, "zb", models=models))[0])
    finally:
        zerobubble.PUMPED = True
    return out[0], out[1]


def cell(trace_name: str, model: str, P: int, limit: str, embedding: str) -> GapRow:
    """One cell's ``GapRow`` (module doc)."""
    trace = data.load_trace(trace_name)
    cfg = scaling.model_for(model, [trace])
    batch = scaling.token_batch(trace, 500_000, 1, 0)
    planner = shortdoc.planner_for(cfg, trace, P, limit, shortdoc.Variant(embedding=embedding))
    step = planner.plan(batch, method="dynamic")
    plan, cm = step.plan, planner.cost_model
    sim = simulate(step.schedule, plan, cm, planner.memory_model)
    terms = gap_terms(plan, step.schedule, cm, sim.makespan_s, ideal_model=scaling.saturated(cm), ideal_split=False)
    wire = schedule_wire(plan, step.schedule, cm)
    first, middle, last = idle_tenths(sim.timeline, terms.rank, sim.makespan_s)
    plain, pumped = zb_steps(plan, Models(cm, planner.memory_model))
    pct = 100.0 / terms.ideal
    return GapRow(trace_name, model, P, limit, embedding, plan.schedule_kind, plan.num_microbatches, sim.makespan_s,
                  terms.bound, terms.ideal, pct * (sim.makespan_s - terms.ideal), pct * terms.schedule, pct * wire,
                  1e3 * first, 1e3 * middle, 1e3 * last, terms.rank, plain, pumped)


def markdown(r: GapRow) -> str:
    return (f"| {r.trace} | {r.model} | {r.P} | {r.limit} | {r.embedding} | {r.kind} {r.microbatches} | "
            f"{r.step_s:.4f} | {r.gap:+.1f}% | {r.schedule:+.1f} | {r.wire:+.1f} | {r.schedule - r.wire:+.1f} | "
            f"{r.idle_first_ms:.0f} / {r.idle_middle_ms:.0f} / {r.idle_last_ms:.0f} | "
            f"{r.zb_plain_s:.4f} -> {r.zb_pumped_s:.4f} |")


HEADER = ("| trace | model | P | limit | embedding | kind, mb | step s | gap | schedule | of it P2P | rest | "
          "idle ms first / middle 8 / last tenth | zb without -> with pumped s |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shortdoc.add_cell_flags(ap, "gsm8k", "llama2-7b,llama3.1-8b", "last", "JSON lines of the rows (appended per cell)")
    args = ap.parse_args(argv)
    print(HEADER, flush=True)
    for trace, model, P, limit in shortdoc.cell_grid(args):
        row = cell(trace, model, P, limit, args.embedding)
        append_row(asdict(row), args.out)
        print(markdown(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
