"""Issue 39's candidate (a) at 24 GiB, measured: a zero-bubble schedule whose stages hold fewer microbatches in
flight than 1F1B's ``P - s``, so that the packer may make each microbatch larger.

The kind ``zb-lean`` (registered here through ``dynmb.schedule.kinds.register_kind``, the documented extension
path; nothing in the package changes) has the window ``ceil(r (P - s))`` for a fraction ``r`` < 1: the packers and
the memory model admit microbatches for that many in flight, and its builder runs the zero-bubble list scheduler
(``dynmb.schedule.zerobubble.list_schedule``) with that window, the memory limit as its caps (every ``W``
deferrable, as ``zb``), with and without the critical-wait fill; the fastest whose simulated peak fits is kept.
``--rows`` prints one line per fraction: dynamic's step under ``zb-lean`` (``schedule`` fixed, ``stage_split`` auto)
against ``zb`` (the same planner at ``r`` = 1: 1F1B's window, what ``zb`` packs for today).

    PYTHONPATH=$PWD nice -n 19 python3 -m studies.shortdoc.lean_window --models llama3.1-8b --stages 8 --fractions 0.75
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

import numpy as np
from studies.scaling import scaling

import dynmb
from dynmb import data
from dynmb.costmodel.gpu import GPUCostModel
from dynmb.core.types import Schedule
from dynmb.schedule.kinds import BuildInputs, ScheduleKind, register_kind
from dynmb.schedule.zerobubble import ZBInputs, list_schedule


@dataclass(frozen=True)
class LeanWindow:
    """``ceil(fraction (P - s))`` microbatches in flight on stage ``s``, at least one."""

    fraction: float

    def __call__(self, stage: int, num_stages: int) -> int:
        return max(1, math.ceil(self.fraction * (num_stages - stage) - 1e-9))


def build_lean(window: LeanWindow):
    """The builder of ``zb-lean`` at ``window`` (module doc)."""
    def build(inp: BuildInputs) -> Schedule:
        P, m = inp.num_stages, inp.num_microbatches
        k = [min(m, window(s, P)) for s in range(P)]
        zb = inp.zb_inputs if inp.zb_inputs is not None else ZBInputs.unit(P, m)   # order searches: unit times
        state = np.zeros(P) if inp.state_bytes is None else np.asarray(inp.state_bytes, dtype=np.float64)
        caps = None if inp.limit_bytes is None else (float(inp.limit_bytes) - state).tolist()
        cands = [list_schedule(zb, k, caps, kind="zb-lean", backward_order=inp.backward_order,
                               w_defer=[m] * P, fill=fill)[0] for fill in (None, "makespan")]
        if inp.evaluate is None:
            return cands[0]
        limit = np.inf if inp.limit_bytes is None else float(inp.limit_bytes)
        timed = [(inp.evaluate(c), c) for c in cands]
        fitting = [(t, c) for (t, peak), c in timed if np.all(np.asarray(peak) <= limit + 1e-6)]
        return min(fitting or [(t, c) for (t, _), c in timed], key=lambda tc: tc[0])[1]
    return build


def register_lean(fraction: float) -> str:
    """Register (or replace) ``zb-lean`` at ``fraction``; its name."""
    window = LeanWindow(fraction)
    register_kind(ScheduleKind(name="zb-lean", build=build_lean(window), window=window, split_backward=True,
                               memory="optional", costs=True, estimate_as="zb"), replace=True)
    return "zb-lean"


def row(model: str, P: int, limit: str, fraction: float) -> str:
    """One line: dynamic's step on gsm8k's 0.5M-token batch under ``zb-lean`` at ``fraction`` (1: ``zb``)."""
    trace = data.load_trace("gsm8k")
    cfg = scaling.model_for(model, [trace])
    batch = scaling.token_batch(trace, 500_000, 1, 0)
    kind = "zb" if fraction >= 1 else register_lean(fraction)
    planner = dynmb.Planner(model=cfg, num_stages=P, memory_limit=limit, cost_model=GPUCostModel(cfg, P),
                            schedule=kind, stage_split="auto", workload=trace)
    step = planner.plan(batch, method="dynamic")
    window = [LeanWindow(min(fraction, 1.0))(s, P) for s in range(P)]
    peak = step.sim.peak_bytes
    peak_gib = "n/a" if peak is None else f"{max(peak) / 2**30:.2f}"
    return (f"| {model} | {P} | {limit} | {fraction:g} | {window} | {step.plan.schedule_kind} | "
            f"{step.plan.meta.get('grouping') or 'dynamic'} | {step.plan.num_microbatches} | {step.sim.makespan_s:.4f} | "
            f"{peak_gib} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama3.1-8b", help="model presets")
    ap.add_argument("--stages", default="8", help="pipeline depths P")
    ap.add_argument("--limit", default="24GiB", help="memory limit per GPU")
    ap.add_argument("--fractions", default="1,0.75", help="window fractions r (1: zb as it packs today)")
    args = ap.parse_args(argv)
    print("| model | P | limit | r | window | kind | grouping | mb | step s | peak GiB |\n|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        for P in map(int, args.stages.split(",")):
            for fraction in map(float, args.fractions.split(",")):
                print(row(model, P, args.limit, fraction), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
