"""One planning step: pack a global batch, order it, build and validate the schedule, simulate.

``plan_step`` is what ``dynmb plan``, ``dynmb run`` (on every rank, deterministically)
and ``dynmb compare`` call, so the plan that is simulated is the plan that runs:

    lengths --pack--> Plan --reorder--> Plan --build_schedule--> Schedule --simulate--> SimResult

It takes the settings as one ``PlanSpec`` (``dynmb.planspec``), which the plan records.
Each data-parallel replica is reordered, scheduled and simulated by the helpers of
``dynmb.planning.replicas``, which stitch the replicas back into one plan.

The plan's ``predictions`` are filled from the simulator (``pred_step_s``,
``pred_peak_bytes`` per stage, ``mean_bubble``) and the wall time of packing +
reordering + scheduling (``plan_s``). With data parallelism each replica's
schedule is the same shape (same microbatch count); the step's predicted time is
the slowest replica's.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import numpy as np

from dynmb.costmodel.base import CostModelLike
from dynmb.memory import MemoryModelLike
from ..config import ModelConfig
from ..costmodel import get_cost_model
from ..memory import get_memory_model
from ..packing import pack
from ..planspec import PlanSpec
from ..simulate import SimResult
from ..types import Plan, Schedule
from .defaults import reorder_for
from .reorder import reorder as reorder_plan
from .replicas import make_schedule, predict_replicas, replica_schedules, replicas_of, stitch
from .slicing import longest_row, plan_split

__all__ = ["plan_step", "make_schedule"]


def plan_step(lengths: np.ndarray, spec: PlanSpec | None = None, *, model_cfg: ModelConfig,
              cost_model: CostModelLike | None = None, memory_model: MemoryModelLike | None = None,
              meta: dict[str, Any] | None = None, **legacy: Any) -> tuple[Plan, Schedule, SimResult]:
    """Pack, reorder, schedule and simulate one global batch under the settings ``spec``.

    Returns ``(plan, schedule, sim)``; for ``dp > 1`` the schedule and simulation
    are replica 0's and the plan's predictions hold the slowest replica's time.
    ``cost_model``/``memory_model`` default to the analytic stand-ins; ``meta`` is added to the
    plan's. The plan records ``spec`` (``Plan.spec``). The earlier keyword form (the ``PlanSpec``
    fields as keywords, ``plan_step(lengths, method=..., num_stages=..., ...)``) still works.
    """
    if spec is None:
        spec = PlanSpec(**legacy)
    elif legacy:
        raise TypeError(f"pass the settings in the PlanSpec, not as keywords too: {sorted(legacy)}")
    cost_model = cost_model or get_cost_model(None, model_cfg, spec.num_stages)
    memory_model = memory_model or get_memory_model(None, model_cfg, spec.num_stages)
    t0 = time.perf_counter()
    lengths = np.asarray(lengths, dtype=np.int64)
    if spec.oversize == "split" and lengths.size and lengths.max() > longest_row(spec, model_cfg, memory_model):
        if spec.reorder not in ("none", "auto"):
            raise ValueError(f"reorder {spec.reorder!r}: a plan with slices of long sequences runs in its planned "
                             f"order (reorder 'none' or 'auto')")
        plan, sched, sim = plan_split(lengths, spec, model_cfg=model_cfg, memory_model=memory_model,
                                      cost_model=cost_model, make_schedule=make_schedule)
        preds = plan.predictions.updated(pred_step_s=sim.makespan_s, mean_bubble=sim.mean_bubble,
                                         plan_s=time.perf_counter() - t0)
        return replace(plan, predictions=preds, spec=spec,
                       meta={**plan.meta, **(meta or {}), "reorder": "none"}), sched, sim
    plan = pack(lengths, spec.with_(oversize="error") if spec.oversize == "split" else spec,
                memory_model=memory_model, cost_model=cost_model)
    replicas = replicas_of(plan)
    reorder = reorder_for(spec.method, spec.reorder)          # "auto": the method's own order
    if reorder != "none":
        replicas = [reorder_plan(p, reorder, cost_model=cost_model, memory_model=memory_model,
                                 schedule_kind=spec.schedule_kind, virtual=spec.virtual) for p in replicas]
    scheds = replica_schedules(replicas, spec, memory_model=memory_model, cost_model=cost_model)
    plan_s = time.perf_counter() - t0
    predicted = predict_replicas(replicas, scheds, cost_model, memory_model, plan.predictions)
    plan = stitch(plan, replicas, {"reorder": reorder, "virtual": spec.virtual, **(meta or {})})
    plan = replace(plan, schedule_kind=spec.schedule_kind, spec=spec,
                   predictions=predicted.predictions.updated(plan_s=plan_s))
    return plan, scheds[0], predicted.sims[0]
