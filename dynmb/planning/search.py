"""The one candidate search of a planning step: generate candidates, plan and simulate each, choose.

1. Generate: a ``Candidate`` is a name and a function that makes it, a whole ``(plan, schedule, sim)``
   of the batch (packed, ordered, scheduled and simulated by ``dynmb.planning.planner``).
2. Simulate: ``evaluate`` makes every candidate in order; one that cannot take the batch (a
   ``ValueError``, ``PackingError`` among them) drops out with its error. Each ``Outcome`` holds the
   predicted step (``pred_step_s``) and whether the simulated peak fits the memory limit (``fits``).
3. Choose, by one of two rules:
   - ``fastest``: the fastest outcome that fits, the first listed among equals; when none fits, the
     fastest of all (``--schedule auto``: as a fixed kind would return it). No outcome at all: the
     first candidate's error is raised.
   - ``robust``: ``dynamic``'s rule (``dynmb.planning.choice.choose_robust``): the packer's own plan
     against the best-predicted alternative that fits, kept only when predicted faster by more than the
     cost model's residuals resolve; the plan kept is therefore never predicted slower than any
     alternative that fits.

Users: ``--schedule auto`` (a candidate per kind of ``auto_kinds``, rule ``fastest``) and ``dynamic``'s
final check (``balanced`` and ``token-budget`` at their best budgets and every other registered method under
the step's own settings, rule ``robust``). The per-run searches (``virtual="auto"``, ``--stage-split
auto``) choose a layout once per run and stay in ``virtual_search`` / ``stage_split``; the searches
inside one packing (``recompute="auto"``, a reorder's order search) rank by the fast estimate within
``dynmb.packing`` and ``planning.reorder``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from dynmb.core.types import Plan, Schedule
from dynmb.planning.choice import Choice, choose_robust
from dynmb.timing.simulate import SimResult

__all__ = ["Candidate", "Outcome", "Planned", "evaluate", "fastest", "fits", "robust"]

log = logging.getLogger(__name__)

Planned = tuple[Plan, Schedule, SimResult]
"""A whole planned step: the plan, replica 0's schedule and its simulation."""


@dataclass(frozen=True)
class Candidate:
    """One option of a search: ``name`` (a kind, ``balanced/4``, a method) and ``make``, which plans it."""

    name: str
    make: Callable[[], Planned]


@dataclass(frozen=True)
class Outcome:
    """A candidate made: its ``planned`` step (None: it could not take the batch, ``error`` says why),
    predicted step ``step_s`` and whether its simulated peak ``fits`` the memory limit."""

    name: str
    planned: Planned | None
    step_s: float | None
    fits: bool
    error: ValueError | None = None


def fits(plan: Plan, sched: Schedule, sim: SimResult) -> bool:
    """The simulated peak is under the limit: replica 0's per GPU, every replica's per stage."""
    peak = plan.predictions.get("pred_peak_bytes")
    return bool(sim.fits) and (peak is None or bool(np.all(np.asarray(peak) <= plan.memory_limit_bytes)))


def evaluate(candidates: Sequence[Candidate]) -> list[Outcome]:
    """Every candidate made, in order (module doc, step 2)."""
    out = []
    for cand in candidates:
        try:
            planned = cand.make()
        except ValueError as e:         # PackingError is one: this candidate cannot take the batch
            log.debug("search: candidate %s drops out: %s", cand.name, e)
            out.append(Outcome(cand.name, None, None, False, e))
            continue
        out.append(Outcome(cand.name, planned, float(planned[0].predictions["pred_step_s"]), fits(*planned)))
    return out


def fastest(outcomes: Sequence[Outcome]) -> Outcome:
    """The fastest outcome that fits, else the fastest; the first among equals (module doc, rule 1)."""
    made = [o for o in outcomes if o.planned is not None]
    if not made:
        errors = [o.error for o in outcomes if o.error is not None]
        raise errors[0] if errors else ValueError("search: no candidate")
    fitting = [o for o in made if o.fits] or made
    if len(fitting) < len(made):
        log.info("search: %d of %d candidates over the memory limit", len(made) - len(fitting), len(made))
    return min(fitting, key=lambda o: float(o.step_s or 0.0))


def robust(own: Planned | None, outcomes: Sequence[Outcome], cost_model: Any) -> tuple[Planned, Choice]:
    """``dynamic``'s choice between its own plan (None: the packer could not make one; then an alternative
    must fit) and the alternatives that fit (module doc, rule 2)."""
    alternatives = {o.name: o.planned for o in outcomes if o.fits and o.planned is not None}
    mine = own if own is not None and (fits(*own) or not alternatives) else None
    planned, choice = choose_robust(mine, alternatives, cost_model)
    return planned, choice
