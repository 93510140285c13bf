"""The schedule of ``studies/scaling/scaling.py``'s rows (``--schedule 1f1b|auto``): pack, then for each kind
reorder, schedule and simulate the slowest replicas, and keep the fastest kind that fits.

``--schedule 1f1b`` (the default) weighs 1F1B alone: the study as it ran before the flag; ``interleaved``
that kind alone (with ``--virtual`` > 1, ``_scaling_virtual``). ``--schedule
auto`` weighs every kind of ``dynmb.schedule.kinds.auto_kinds(virtual=V)`` (V = 1: 1f1b, zb-h1, zb; V > 1:
interleaved), for EVERY method,
so each method gets the same schedule choice. The rule is ``dynmb.planning.planner.plan_auto``'s:

- the batch is packed once per ``packing_key`` (kinds of equal key get the same packing, since the
  packers read nothing else of a kind; each auto kind has its own: three packings, whose estimate-free work
  ``dynmb.packing.dynamic.space`` does once), with ``schedule_kind`` that kind;
- for each kind, each simulated replica is reordered for that kind (``reorder(..., schedule_kind=kind)``:
  ``search`` judges orders under the kind's own schedule), given the kind's schedule by
  ``dynmb.planning.make_schedule`` (the zero-bubble kinds get the cost model, which prices I and W from
  B) and simulated (``dynmb.timing.simulate``); the kind's step is its slowest simulated replica;
- the fastest kind whose every simulated replica fits the memory limit (``SimResult.fits``) is kept,
  ties to the kind registered first; none fits: the fastest (as a fixed kind would run).

Why not ``plan_auto`` itself: it plans every DP replica (all reordered, scheduled and simulated, eight
or 256 per kind here); the study packs once with ``dynmb.packing.pack`` and simulates only the
``--sim-replicas`` slowest, so calling ``plan_auto`` would change more than the schedule between the
``1f1b`` and ``auto`` rows. The planner's final check of ``dynamic`` against ``balanced`` runs on this
same path after the kind choice (``_scaling_final``). The
choice itself is three lines of the same rule; the building and simulating is the library's.

Columns: ``schedule`` (the kind run), ``step_<kind>_s`` for every kind weighed (its slowest simulated
replica), ``kinds_over_limit`` (the kinds whose simulated peak did not fit, space-separated). The row's
``reorder_s`` / ``sched_s`` count every kind weighed (the choice is part of planning).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

import dynmb
from dynmb.planning import make_schedule
from dynmb.planning.reorder import reorder as reorder_plan
from dynmb.schedule.kinds import AUTO, auto_kinds, get_kind
from dynmb.costmodel.loader import Models

__all__ = ["SCHEDULES", "KindRun", "kinds_for", "packing_groups", "run_kind", "choose", "kind_columns"]

SCHEDULES = ("1f1b", "interleaved", AUTO)
"""The ``--schedule`` settings: 1F1B alone (the study's default), interleaved alone (``--virtual``), or the
per-step choice."""


@dataclass
class KindRun:
    """One schedule kind on the simulated replicas of one packing."""

    kind: str
    plan: object
    """The packed plan (every replica)."""
    sims: list = field(default_factory=list)
    subs: list = field(default_factory=list)
    """The simulated replicas' plans as reordered, and their ``schedules`` (``_scaling_gap``)."""
    schedules: list = field(default_factory=list)
    reorder_s: list[float] = field(default_factory=list)
    sched_s: list[float] = field(default_factory=list)

    @property
    def step_s(self) -> float:
        return max(s.makespan_s for s in self.sims)

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.sims)

    @property
    def worst(self):
        return max(self.sims, key=lambda s: s.makespan_s)


def kinds_for(setting: str, virtual: int = 1) -> tuple[str, ...]:
    """The kinds a ``--schedule`` setting weighs with ``virtual`` chunks per GPU (``auto``:
    ``auto_kinds(virtual=virtual)`` in registration order)."""
    if setting not in SCHEDULES:
        raise ValueError(f"--schedule: {setting!r}; expected one of {', '.join(SCHEDULES)}")
    return auto_kinds(virtual=virtual) if setting == AUTO else (setting,)


def packing_groups(kinds: tuple[str, ...]) -> list[list[str]]:
    """``kinds`` grouped by ``packing_key`` (one packing per group), in order of first appearance."""
    groups: dict[tuple, list[str]] = {}
    for k in kinds:
        groups.setdefault(get_kind(k).packing_key, []).append(k)
    return list(groups.values())


def run_kind(plan, replicas: list[int], kind: str, how: str, cm, mm, virtual: int = 1) -> KindRun:
    """Reorder (``how``, for ``kind``), schedule and simulate ``replicas`` of ``plan`` under ``kind``
    (``virtual`` chunks per GPU)."""
    run = KindRun(kind, plan)
    for r in replicas:
        sub = plan.replica(r) if plan.dp > 1 else plan
        t1 = time.process_time()
        if how != "none":
            sub = reorder_plan(sub, how, models=Models(cm, mm), schedule_kind=kind, virtual=virtual)
        t2 = time.process_time()
        sched = make_schedule(sub, kind, virtual=virtual, models=Models(cm, mm))
        t3 = time.process_time()
        run.reorder_s.append(t2 - t1)
        run.sched_s.append(t3 - t2)
        run.sims.append(dynmb.simulate(sched, sub, cm, mm))
        run.subs.append(sub)
        run.schedules.append(sched)
    return run


def choose(runs: list[KindRun]) -> KindRun:
    """``plan_auto``'s rule: the fastest run that fits (ties: the first), or the fastest if none fits."""
    fitting = [r for r in runs if r.fits] or runs
    return min(fitting, key=lambda r: r.step_s)


def kind_columns(runs: list[KindRun]) -> dict:
    """The row's schedule columns (module doc); ``reorder_s`` / ``sched_s`` summed over the kinds."""
    chosen = choose(runs)
    cols: dict = {"schedule": chosen.kind, "kinds_over_limit": " ".join(r.kind for r in runs if not r.fits)}
    cols.update({f"step_{r.kind}_s": r.step_s for r in runs})
    cols["reorder_s"] = float(sum(np.mean(r.reorder_s) for r in runs))
    cols["sched_s"] = float(sum(np.mean(r.sched_s) for r in runs))
    return cols
