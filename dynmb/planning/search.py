"""The candidate search of a planning step: ``dynmb.timing.search`` with whole planned steps as candidates.

1. Generate: a ``Candidate`` (``dynmb.timing.search``) whose ``make`` returns a whole ``(plan, schedule,
   sim)`` of the batch (packed, ordered, scheduled and simulated by ``dynmb.planning.planner``) and, for
   ``dynamic``'s final check, whose ``floor`` is ``step_floor`` of its packed and ordered plan.
2. Simulate: ``evaluate`` makes every candidate (``prune``: only those whose floor is not above the best
   step that fits found so far, in ascending floor); one that cannot take the batch (a ``ValueError``,
   ``PackingError`` among them) drops out with its error. Each ``Outcome``'s ``Verdict`` holds the
   predicted step (``score``: ``pred_step_s``) and whether the simulated peak fits the memory limit (``fits``).
3. Choose, by one of two rules:
   - ``fastest`` (``dynmb.timing.search``): the fastest outcome that fits, the first listed among equals;
     when none fits, the fastest of all (``--schedule auto``: as a fixed kind would return it). No outcome
     at all: the first candidate's error is raised.
   - ``robust``: ``dynamic``'s rule (``dynmb.planning.choice.choose_robust``): the packer's own plan
     against the best-predicted alternative that fits, kept only when predicted faster by more than the
     cost model's residuals resolve; the plan kept is therefore never predicted slower than any
     alternative that fits. A pruned alternative is slower than one made that fits, so it is never the
     best alternative: pruning changes no choice.

``step_floor``, a lower bound of a plan's simulated step on a kind's schedule before it is built: the larger
of the kind's fast estimate (``dynmb.timing.estimators``) divided by ``1 + tolerance`` (its stated margin
against the simulator: exact, upper or approximate, ``sim >= estimate / (1 + tolerance)``; for GPipe / 1F1B
above their exact regime the estimate is itself a lower bound) and the dependency bound's head + work
(``dynmb.timing.bounds.dependency_terms``, on the kind's rank map; each backward at ``min(B, I + W)``, and
the drain term only for kinds that never split a backward), the slowest replica's. The zero-bubble estimates
read per-stage ``I / B``, ``W / B`` shares, here the plan's own (its summed ``I``, ``W`` over its ``B``).

Users: ``--schedule auto`` (a candidate per kind of ``auto_kinds``, rule ``fastest``, no pruning: every
kind's step is recorded) and ``dynamic``'s final check (``balanced`` and ``token-budget`` at their best
budgets and every other registered method under the step's own settings, pruned, rule ``robust``).
The per-run searches (``virtual="auto"``, ``--stage-split auto``) choose a layout once per run and stay in
``virtual_search`` / ``stage_split``; fitting slices, ``recompute="auto"`` and the reorder searches use
``dynmb.timing.search`` directly.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from dynmb.core.types import Plan, Schedule
from dynmb.costmodel.base import CostModelLike
from dynmb.planning.choice import Choice, choose_robust
from dynmb.schedule.kinds import get_kind
from dynmb.timing.bounds import dependency_terms
from dynmb.timing.estimators import estimator_of
from dynmb.timing.makespan import makespans
from dynmb.timing.search import Candidate, Outcome, Verdict, fastest
from dynmb.timing.search import evaluate as evaluate_with
from dynmb.timing.simulate import SimResult, comm_times

__all__ = ["Candidate", "Outcome", "Planned", "evaluate", "fastest", "fits", "robust", "step_floor", "verdict"]

log = logging.getLogger(__name__)

Planned = tuple[Plan, Schedule, SimResult]
"""A whole planned step: the plan, replica 0's schedule and its simulation."""


def fits(plan: Plan, sched: Schedule, sim: SimResult) -> bool:
    """The simulated peak is under the limit: replica 0's per GPU, every replica's per stage."""
    peak = plan.predictions.get("pred_peak_bytes")
    return bool(sim.fits) and (peak is None or bool(np.all(np.asarray(peak) <= plan.memory_limit_bytes)))


def verdict(planned: Planned) -> Verdict:
    """A planned step judged: its predicted step and whether it fits."""
    return Verdict(float(planned[0].predictions["pred_step_s"]), fits(*planned))


def evaluate(candidates: Sequence[Candidate[Planned]], *, prune: bool = False) -> list[Outcome[Planned]]:
    """Every candidate made (or pruned, or dropped out), in order (module doc, step 2)."""
    return evaluate_with(candidates, verdict, prune=prune)


def robust(own: Planned | None, outcomes: Sequence[Outcome[Planned]], cost_model: Any) -> tuple[Planned, Choice]:
    """``dynamic``'s choice between its own plan (None: the packer could not make one; then an alternative
    must fit) and the alternatives that fit (module doc, rule 2)."""
    alternatives = {o.name: o.made for o in outcomes if o.fits and o.made is not None}
    mine = own if own is not None and (fits(*own) or not alternatives) else None
    planned, choice = choose_robust(mine, alternatives, cost_model)
    return planned, choice


def _replica_floor(replica: Plan, cost_model: CostModelLike, kind: str, virtual: int, order_free: bool) -> float:
    """``step_floor`` of one replica's plan (module doc)."""
    est, rec = estimator_of(kind), get_kind(kind)
    split = est.split_backward or rec.split_backward
    costs = cost_model.plan_costs(replica, ops=("F", "B", "I", "W") if split else ("F", "B"))
    F, B = (np.asarray(costs[op], dtype=np.float64) for op in ("F", "B"))
    comm = comm_times(cost_model, replica)
    grad = np.minimum(B, np.asarray(costs["I"]) + np.asarray(costs["W"])) if split else B
    rank = [rec.rank_of(s, replica.num_stages, virtual) for s in range(replica.num_stages)]
    terms = dependency_terms({"F": F, "B": grad}, comm, rank).values()
    bound = max(t.head + t.work + (0.0 if rec.split_backward else t.tail) for t in terms)
    if order_free:
        return bound
    shares = None
    if est.split_backward:
        shares = np.stack([np.asarray(costs[op], dtype=np.float64).sum(axis=1) for op in ("I", "W")]) / B.sum(axis=1)
    fast = float(makespans(F, B, comm, [replica.num_microbatches], kind, shares=shares, virtual=virtual)[0])
    return max(fast / (1.0 + est.tolerance), bound)


ROUNDING = 1e-9
"""``step_floor`` is lowered by this relative margin: the bound and the simulator add the same seconds in other
orders (where the bound is tight, GPipe, it may come out a rounding error above the simulated step)."""


def step_floor(replicas: Sequence[Plan], cost_model: CostModelLike, kind: str, virtual: int = 1,
               order_free: bool = False) -> float:
    """A lower bound of the simulated step of the plan of ``replicas`` (each in its order) on a ``kind``
    schedule, before the schedule is built (module doc): the slowest replica's, less ``ROUNDING``.
    ``order_free``: the dependency bound alone, which holds for any order of the microbatches (plans with
    slices, whose schedules run a chain's backwards in reverse, where the fast estimate of the plan's order
    need not bound the step)."""
    floors = [_replica_floor(p, cost_model, kind, virtual, order_free) for p in replicas if p.num_microbatches]
    return max([0.0, *floors]) * (1.0 - ROUNDING)
