"""The ``dynmb.Planner``'s final check for ``studies/scaling/scaling.py``'s ``dynamic`` rows.

The library's Planner (``dynmb.planning.planner._plan_final``) weighs ``dynamic``'s plan against the alternatives
``planner.final_settings`` lists: ``FINAL_METHODS`` (``balanced``, verl's dynamic batching, and ``token-budget``)
at the ``FINAL_CHECK`` token budgets (memory-maximum budget / d) that the fast estimate ranks best and their
neighbours (d x 2, d / 2), then every other registered method at its own settings (``dynapipe``, ``packed``,
``fixed``, ...). The study's rule plans the same list on the study's own path:

- after the ``dynamic`` row's own packing and kind choice (``plan_once``), ``final_settings`` is asked with the
  row's settings (P V chunks, V, the kind the row chose, the limit, ``dp``, ``--oversize``, ``round_to`` 1: the
  study packs at 1, the Planner's default) and models (the row's split's GPU cost and memory models);
- each alternative (method, mbs) is planned the way the study's rows plan that method (``plan_once``: one packing
  per packing key, the ``--sim-replicas`` slowest replicas reordered in the method's own order, scheduled and
  simulated under each kind of ``--schedule``, the fastest kind that fits kept). One that cannot take the batch
  (``PackingError``, ``ValueError``) drops out;
- the alternative replaces the row's plan if its step (the slowest simulated replica) is strictly shorter
  (by more than 1e-9 relative) and its chosen kind fits the memory limit.
  The row stays ``dynamic``, and ``grouping`` names the winner (``balanced/d``, ``token-budget/d``, ``dynapipe``,
  ...; "" when dynamic's own packing stays). If several alternatives beat it, the shortest is kept.

Differences from the Planner: under ``--schedule auto`` the Planner checks each kind separately (that kind's
divisors, then the choice among kinds); here the divisors are those of the kind the row chose, and each
alternative weighs every kind, as the ``-best`` rows do. The Planner keeps its own plan only where it is faster
than the best alternative by more than the cost model's residuals can resolve (``search.robust``); here strictly
faster. Until scaling27 the list was ``FINAL_METHODS`` at the ranked budgets alone (no neighbours, no other
method): the rows of earlier folders.

Columns: ``grouping``; ``final_alternatives`` (every alternative planned, ``name:step``, ``(over)`` where its kind
does not fit); ``own_step_s`` (the step of dynamic's own packing, before the check);
``final_check_s`` (CPU s of the whole check: the ranking and every alternative's packing, reordering,
scheduling and simulation). The row's ``pack_s`` / ``reorder_s`` / ``sched_s`` stay those of dynamic's own
plan; ``plan_s`` = their sum + ``final_check_s`` (the Planner's ``plan_s`` counts its check too).
With ``--sim-replicas`` > 1 the check counts every simulated replica, so it is an upper bound. The other
columns (step, bubble, microbatches, schedule, ...) are those of the plan kept.
"""

from __future__ import annotations

import time
from typing import Callable

from dynmb.core.planspec import PlanSpec
from dynmb.costmodel.loader import Models
from dynmb.packing import PackingError
from dynmb.planning.planner import final_settings
from dynmb.schedule.kinds import get_kind

__all__ = ["TIMING", "final_check", "fits"]

TIMING = ("pack_s", "reorder_s", "sched_s", "plan_s", "plan_over_step", "row_wall_s", "split_choice_s",
          "virtual_cpu_s")
"""Columns of dynamic's own planning, kept in the row whichever plan is kept (``plan_s`` then adds the check)."""


def fits(row: dict) -> bool:
    """The kind the row runs fits the memory limit (it is not among ``kinds_over_limit``)."""
    return str(row["schedule"]) not in str(row.get("kinds_over_limit") or "").split()


def alternatives(cell, c: dict, kind: str) -> dict[str, PlanSpec]:
    """``planner.final_settings`` for the row settings ``c`` of ``cell`` under the kind the row chose (module doc)."""
    _, cm, _, mm = cell.models(c["stage_split"], c)
    spec = PlanSpec(method="dynamic", num_stages=c["num_stages"] * cell.V, virtual=cell.V, schedule_kind=kind,
                    memory_limit_bytes=int(c["memory_limit_bytes"]), dp=int(c["dp"]), oversize=c["oversize"])
    return final_settings(cell.batch, spec, get_kind(kind), Models(cm, mm))


def final_check(cell, c: dict, own: dict, plan_once: Callable[..., dict]) -> dict:
    """``own`` (``plan_once``'s columns of the ``dynamic`` row), or the fastest alternative that fits and is faster, with
    ``grouping``, ``own_step_s``, ``final_check_s``, ``final_alternatives`` (module doc). ``plan_once(cell, c, base,
    mbs)`` plans one method at one size as the study's rows do."""
    t0, w0 = time.process_time(), time.perf_counter()
    best, chosen, steps = own, None, []
    for name, alt_spec in alternatives(cell, c, str(own["schedule"])).items():
        try:
            alt = plan_once(cell, c, alt_spec.method, alt_spec.mbs)
        except (PackingError, ValueError):    # this method or budget cannot take the batch
            continue
        steps.append(f"{name}:{alt['pred_step_s']:.6f}{'' if fits(alt) else '(over)'}")
        if fits(alt) and alt["pred_step_s"] < best["pred_step_s"] * (1 - 1e-9):
            best, chosen = alt, name
    check_s = time.process_time() - t0
    row = {**best, **{k: own[k] for k in TIMING if k in own}, "base_method": own["base_method"]}
    row["plan_s"] = own["pack_s"] + own["reorder_s"] + own["sched_s"] + check_s
    row["plan_over_step"] = row["plan_s"] / row["pred_step_s"]
    row["row_wall_s"] = own["row_wall_s"] + time.perf_counter() - w0
    return {**row, "grouping": chosen or "", "own_step_s": own["pred_step_s"],
            "final_check_s": check_s, "final_alternatives": " ".join(steps)}
