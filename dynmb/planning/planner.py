"""One planning step: pack a global batch, order it, build and validate the schedule, simulate.

``plan_step`` is what ``dynmb plan``, ``dynmb run`` (on every rank, deterministically)
and ``dynmb compare`` call, so the plan that is simulated is the plan that runs:

    lengths --pack--> Plan --reorder--> Plan --build_schedule--> Schedule --simulate--> SimResult

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
from ..schedule import build_schedule, validate
from ..schedule.kinds import get_kind, slice_kinds
from ..simulate import SimResult, memory_inputs, simulate
from ..types import Plan, Schedule
from .defaults import reorder_for
from .reorder import reorder as reorder_plan
from .slicing import longest_row, plan_split
from .zerobubble import zb_evaluator, zb_inputs

__all__ = ["plan_step", "make_schedule"]


def make_schedule(plan: Plan, kind: str, *, virtual: int = 1, memory_model: MemoryModelLike | None = None,
                  cost_model: CostModelLike | None = None) -> Schedule:
    """Build and validate the schedule of one pipeline replica's plan (``plan.dp == 1``): the kind's
    record (``dynmb.schedule.kinds``) says which inputs its builder takes (the plan's backward
    order for slices, its bytes and limit, its times and the simulator as judge)."""
    rec = get_kind(kind)
    order = plan.backward_order() if plan.has_slices else None
    if order is not None and not rec.slices:
        raise ValueError(f"slices of long sequences run on the {' or '.join(slice_kinds())} schedule, not {kind!r} "
                         f"(its builder does not run their backwards in reverse)")
    inputs: dict[str, Any] = {"virtual": virtual, "backward_order": order}
    if rec.memory != "none" and memory_model is not None:
        inputs["act_bytes"], inputs["transient_bytes"], inputs["state_bytes"] = memory_inputs(memory_model, plan)
        inputs["limit_bytes"] = plan.memory_limit_bytes
    elif rec.memory == "required":
        raise ValueError(f"the {kind} schedule needs a memory model")
    if rec.costs:                        # cost-driven builders (dynmb.planning.zerobubble)
        if cost_model is None:
            raise ValueError(f"the {kind} schedule needs a cost model (it places its ops by predicted times)")
        inputs["zb_inputs"] = zb_inputs(plan, cost_model, memory_model)
        inputs["evaluate"] = zb_evaluator(plan, cost_model, memory_model, inputs["zb_inputs"])
    sched = build_schedule(kind, plan.num_stages, plan.num_microbatches, **inputs)
    validate(sched, plan)
    return sched


def plan_step(
    lengths: np.ndarray,
    *,
    method: str,
    model_cfg: ModelConfig,
    num_stages: int,
    memory_limit_bytes: int,
    schedule_kind: str = "1f1b",
    reorder: str = "none",
    mbs: int | None = None,
    dp: int = 1,
    virtual: int = 1,
    cost_model: CostModelLike | None = None,
    memory_model: MemoryModelLike | None = None,
    oversize: str = "error",
    pack_len: int | None = None,
    round_to: int = 1,
    meta: dict[str, Any] | None = None,
    recompute: str = "never",
) -> tuple[Plan, Schedule, SimResult]:
    """Pack, reorder, schedule and simulate one global batch.

    Returns ``(plan, schedule, sim)``; for ``dp > 1`` the schedule and simulation
    are replica 0's and the plan's predictions hold the slowest replica's time.
    ``cost_model``/``memory_model`` default to the analytic stand-ins.
    """
    cost_model = cost_model or get_cost_model(None, model_cfg, num_stages)
    memory_model = memory_model or get_memory_model(None, model_cfg, num_stages)
    t0 = time.perf_counter()
    lengths = np.asarray(lengths, dtype=np.int64)
    if oversize == "split" and lengths.size and lengths.max() > longest_row(method, model_cfg, memory_model,
                                                                        memory_limit_bytes, num_stages, schedule_kind,
                                                                        pack_len, round_to, virtual):
        if reorder not in ("none", "auto"):
            raise ValueError(f"reorder {reorder!r}: a plan with slices of long sequences runs in its planned order "
                             f"(reorder 'none' or 'auto')")
        plan, sched, sim = plan_split(lengths, method, model_cfg=model_cfg, num_stages=num_stages,
                                      memory_limit_bytes=memory_limit_bytes, memory_model=memory_model,
                                      cost_model=cost_model, schedule_kind=schedule_kind, mbs=mbs, dp=dp,
                                      pack_len=pack_len, round_to=round_to, virtual=virtual, recompute=recompute,
                                      make_schedule=make_schedule)
        preds = {**plan.predictions, "pred_step_s": float(sim.makespan_s), "mean_bubble": float(sim.mean_bubble),
                 "plan_s": time.perf_counter() - t0}
        return replace(plan, predictions=preds, meta={**plan.meta, **(meta or {}), "reorder": "none"}), sched, sim
    plan = pack(lengths, method, num_stages=num_stages,
                memory_limit_bytes=memory_limit_bytes, memory_model=memory_model, cost_model=cost_model,
                mbs=mbs, schedule_kind=schedule_kind, dp=dp, oversize="error" if oversize == "split" else oversize,
                virtual=virtual, pack_len=pack_len, round_to=round_to, recompute=recompute)
    replicas = [plan] if dp == 1 else [plan.replica(r) for r in range(dp)]
    reorder = reorder_for(method, reorder)          # "auto": the method's own order
    if reorder != "none":
        replicas = [reorder_plan(p, reorder, cost_model=cost_model, memory_model=memory_model,
                             schedule_kind=schedule_kind, virtual=virtual) for p in replicas]
    scheds = [make_schedule(p, schedule_kind, virtual=virtual, memory_model=memory_model, cost_model=cost_model)
              for p in replicas]
    plan_s = time.perf_counter() - t0
    sims = [simulate(s, p, cost_model, memory_model) for s, p in zip(scheds, replicas)]
    if dp > 1:
        # stitch the (possibly reordered) replicas back into one plan, replica-major
        mbs_all, rids = [], []
        for r, p in enumerate(replicas):
            mbs_all.extend(p.microbatches)
            rids.extend([r] * p.num_microbatches)
        plan = replace(plan, microbatches=tuple(mbs_all), schedule_kind=schedule_kind, dp=dp,
                       replica_ids=tuple(rids), predictions=dict(plan.predictions), meta=dict(plan.meta))
    else:
        plan = replicas[0]
    worst = max(range(len(sims)), key=lambda i: sims[i].makespan_s)
    peaks = np.max([np.asarray(s.peak_bytes) for s in sims if s.peak_bytes is not None], axis=0) \
        if sims[0].peak_bytes is not None else np.asarray(plan.predictions.get("pred_peak_bytes", []))
    preds = {
        **plan.predictions,
        "pred_step_s": float(sims[worst].makespan_s),
        "pred_peak_bytes": [int(x) for x in peaks],
        "mean_bubble": float(sims[worst].mean_bubble),
        "plan_s": plan_s,
    }
    plan = replace(plan, schedule_kind=schedule_kind, predictions=preds,
                   meta={**plan.meta, "reorder": reorder, "virtual": virtual, **(meta or {})})
    return plan, scheds[0], sims[0]
