"""The ``dynmb.Planner``'s final check for ``studies/scaling/scaling.py``'s ``dynamic`` rows.

The library's Planner (``dynmb.planning.planner._plan_checked``) checks ``dynamic``'s plan against
``FINAL_METHODS`` (``balanced``, verl's dynamic batching, and ``token-budget``) at the ``FINAL_CHECK`` token
budgets (memory-maximum budget / d) that the fast estimate ranks best (``dynmb.packing.balanced.budget_divisors``).
It plans each one whole and keeps ``method/d`` if it predicts a strictly shorter step that fits. The plan stays ``dynamic``'s.
The study's rule is the same, on the study's own path:

- after the ``dynamic`` row's own packing and kind choice (``plan_once``), ``budget_divisors`` ranks the
  divisors d with the Planner's arguments: the row's ``PackContext`` (memory model of the row's split, the
  limit, P V chunks, the kind the row chose, V), the row's GPU cost model, ``dp`` and ``round_to`` 1 (the
  study packs at 1, the Planner's default), ``keep=FINAL_CHECK``;
- each (method, d) is planned the way the ``balanced-best`` / ``token-budget-best`` rows plan budget d:
  ``plan_once(cell, c, method, d)``
  on the row's own split (one packing per packing key, the ``--sim-replicas`` slowest replicas reordered
  (``balanced``: no reorder), scheduled and simulated under each kind of ``--schedule``, the fastest kind
  that fits kept). A budget that cannot take the batch (``PackingError``) drops out;
- the alternative replaces the row's plan if its step (the slowest simulated replica) is strictly shorter
  (by more than 1e-9 relative, the Planner's tolerance) and its chosen kind fits the memory limit.
  The row stays ``dynamic``, and ``grouping`` names the winner (``balanced/d`` or ``token-budget/d``; "" when dynamic's own
  packing stays). If several alternatives beat it, the shortest is kept (the Planner's loop does the same).

Difference from the Planner under ``--schedule auto``: the Planner checks each kind separately (that kind's
divisors, then the choice among kinds). Here the divisors are those of the kind the row chose, and each
alternative weighs every kind, as the ``balanced-best`` rows do.

Columns: ``grouping``; ``own_step_s`` (the step of dynamic's own packing, before the check);
``final_check_s`` (CPU s of the whole check: the ranking and every alternative's packing, reordering,
scheduling and simulation). The row's ``pack_s`` / ``reorder_s`` / ``sched_s`` stay those of dynamic's own
plan; ``plan_s`` = their sum + ``final_check_s`` (the Planner's ``plan_s`` counts its check too).
With ``--sim-replicas`` > 1 the check counts every simulated replica, so it is an upper bound. The other
columns (step, bubble, microbatches, schedule, ...) are those of the plan kept.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable

from dynmb.packing import PackingError
from dynmb.packing.balanced import budget_divisors
from dynmb.packing.context import PackContext
from dynmb.planning.planner import FINAL_CHECK, FINAL_METHODS

__all__ = ["TIMING", "final_check", "fits"]

TIMING = ("pack_s", "reorder_s", "sched_s", "plan_s", "plan_over_step", "row_wall_s", "split_choice_s",
          "virtual_cpu_s")
"""Columns of dynamic's own planning, kept in the row whichever plan is kept (``plan_s`` then adds the check)."""


def fits(row: dict) -> bool:
    """The kind the row runs fits the memory limit (it is not among ``kinds_over_limit``)."""
    return str(row["schedule"]) not in str(row.get("kinds_over_limit") or "").split()


def final_check(cell, c: dict, own: dict, plan_once: Callable[..., dict]) -> dict:
    """``own`` (``plan_once``'s columns of the ``dynamic`` row), or the faster ``balanced/d`` or ``token-budget/d`` that fits, with
    ``grouping``, ``own_step_s``, ``final_check_s`` (module doc). ``plan_once(cell, c, base, mbs)`` plans one
    budget as the study's rows do."""
    t0, w0 = time.process_time(), time.perf_counter()
    _, cm, _, mm = cell.models(c["stage_split"], c)
    ctx = PackContext(mm, c["memory_limit_bytes"], c["num_stages"] * cell.V, str(own["schedule"]), virtual=cell.V)
    best, chosen = own, None
    try:
        divisors = budget_divisors(cell.batch, ctx, cm, round_to=1, dp=c["dp"], keep=FINAL_CHECK)
    except ValueError:
        divisors = []
    for method, d in itertools.product(FINAL_METHODS, divisors):
        try:
            alt = plan_once(cell, c, method, d)
        except PackingError:                  # this budget cannot take the batch
            continue
        if fits(alt) and alt["pred_step_s"] < best["pred_step_s"] * (1 - 1e-9):
            best, chosen = alt, f"{method}/{d}"
    check_s = time.process_time() - t0
    row = {**best, **{k: own[k] for k in TIMING if k in own}, "base_method": own["base_method"]}
    row["plan_s"] = own["pack_s"] + own["reorder_s"] + own["sched_s"] + check_s
    row["plan_over_step"] = row["plan_s"] / row["pred_step_s"]
    row["row_wall_s"] = own["row_wall_s"] + time.perf_counter() - w0
    return {**row, "grouping": chosen or "", "own_step_s": own["pred_step_s"],
            "final_check_s": check_s, "final_divisors": " ".join(map(str, divisors))}
