"""Replicas of a plan and their schedules: the one place that splits a plan by data-parallel
replica, builds each replica's schedule, predicts the step from their simulations and stitches
reordered replicas back into one plan.

- ``make_schedule(plan, kind, ...)``: build and validate one replica's schedule; the kind's
  record (``dynmb.schedule.kinds``) says which inputs its builder takes.
- ``replica_of(plan, r)`` / ``replicas_of(plan)``: replica ``r``'s plan (the plan itself without
  data parallelism), all of them.
- ``replica_schedules(replicas, spec, ...)``: every replica's schedule (replica 0's may be given:
  a schedule file).
- ``predict_replicas(...)``: every replica simulated; the step's predictions are the slowest
  replica's time and bubbles, every stage's highest peak and each replica's peak per GPU (what the runtime's
  memory rows set beside the measured peak).
- ``stitch(plan, replicas)``: (reordered) replicas back into one plan, replica-major.

Used by ``plan_step`` (``dynmb.planning.planner``), ``dynmb.runtime.state`` (a plan file) and
``dynmb.runtime.step`` (each rank's replica).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import numpy as np

from dynmb.costmodel.loader import Models
from dynmb.memory.model import MemoryModelLike
from dynmb.core.planspec import PlanSpec
from dynmb.core.predictions import Predictions
from dynmb.schedule import build_schedule, validate
from dynmb.schedule.kinds import get_kind, resolve_kind, slice_kinds
from dynmb.schedule.order import ChainOrder
from dynmb.schedule.embedlast import embed_last
from dynmb.timing.embedding import embed_costs
from dynmb.timing.embedplace import embed_times
from dynmb.timing.simulate import SimResult, comm_times, memory_inputs, plan_op_costs, simulate
from dynmb.core.types import Microbatch, Plan, Schedule
from dynmb.planning.zerobubble import zb_evaluator, zb_inputs

__all__ = ["make_schedule", "replica_of", "replicas_of", "replica_schedules", "predict_replicas", "stitch",
           "ReplicaPrediction"]


def make_schedule(plan: Plan, kind: str, *, virtual: int = 1,
                  models: Models[MemoryModelLike | None] | None = None) -> Schedule:
    """Build and validate the schedule of one pipeline replica's plan (``plan.dp == 1``; ``kind``
    ``"auto"``: the kind the plan records, ``resolve_kind``): the kind's record
    (``dynmb.schedule.kinds``) says which inputs its builder takes (the plan's backward order for
    slices, with its ``slice_lookahead``, its bytes and limit from ``models.memory``, its times from ``models.cost``
    and the simulator as judge)."""
    memory_model = models.memory if models is not None else None
    kind = resolve_kind(kind, plan)            # "auto": the kind the plan was planned for
    rec = get_kind(kind)
    order: Sequence[int] | None = plan.backward_order() if plan.has_slices else None
    if order is not None and plan.meta.get("slice_lookahead"):     # the planner's chain lookahead (slicing)
        order = ChainOrder(order, int(plan.meta["slice_lookahead"]))
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
        if models is None:
            raise ValueError(f"the {kind} schedule needs a cost model (it places its ops by predicted times)")
        inputs["zb_inputs"] = zb_inputs(plan, models)
        inputs["evaluate"] = zb_evaluator(plan, models, inputs["zb_inputs"])
    sched = build_schedule(kind, plan.num_stages, plan.num_microbatches, **inputs)
    validate(sched, plan)
    if plan.spec is not None and plan.spec.embedding == "last":
        sched = embedding_on_last_rank(sched, plan, models)
        validate(sched, plan)
    return sched


def embedding_on_last_rank(schedule: Schedule, plan: Plan, models: Models[MemoryModelLike | None] | None) -> Schedule:
    """``schedule`` with the embedding stage on the last rank (``dynmb.schedule.embedlast``), its ops merged by
    the schedule's timeline with ``models'`` costs (unit times without them, ``dynmb.timing.embedplace``)."""
    if models is None:
        return embed_last(schedule, embed_times(schedule, None))
    costs = plan_op_costs(models.cost, plan, schedule)
    return embed_last(schedule, embed_times(schedule, costs, comm_times(models.cost, plan),
                                            embed_costs(models.cost, plan)))


def replica_of(plan: Plan, r: int) -> Plan:
    """Replica ``r``'s share of ``plan`` (the plan itself without data parallelism)."""
    return plan.replica(r) if plan.dp > 1 else plan


def replicas_of(plan: Plan) -> list[Plan]:
    """Every replica's share of ``plan``, in replica order."""
    return [replica_of(plan, r) for r in range(plan.dp)]


def replica_schedules(replicas: Sequence[Plan], spec: PlanSpec, *, models: Models[MemoryModelLike | None] | None,
                      first: Schedule | None = None) -> list[Schedule]:
    """Each replica's validated schedule of kind ``spec.schedule_kind`` (``first``: replica 0's, given)."""
    return [first if r == 0 and first is not None else
            make_schedule(p, spec.schedule_kind, virtual=spec.virtual, models=models) for r, p in enumerate(replicas)]


@dataclass(frozen=True)
class ReplicaPrediction:
    """Every replica's simulation and the step's predictions from them."""

    sims: list[SimResult]
    """One per replica, in replica order."""
    predictions: Predictions
    """The slowest replica's ``pred_step_s`` and ``mean_bubble``, every stage's highest ``pred_peak_bytes``, each
    replica's ``pred_rank_peak_bytes``."""


def predict_replicas(replicas: Sequence[Plan], schedules: Sequence[Schedule], models: Models[MemoryModelLike | None],
                     base: Predictions) -> ReplicaPrediction:
    """Simulate every replica under its schedule; ``base``'s fields are kept where the simulator
    gives none (the packer's peaks without a memory model)."""
    sims = [simulate(s, p, models.cost, models.memory) for s, p in zip(schedules, replicas)]
    worst = max(sims, key=lambda sim: sim.makespan_s)
    peaks = tuple(int(x) for x in np.max([np.asarray(sim.peak_bytes) for sim in sims], axis=0)) \
        if sims[0].peak_bytes is not None else base.pred_peak_bytes
    ranks = [sim.peak_bytes_rank for sim in sims if sim.peak_bytes_rank is not None]
    gpus = tuple(tuple(np.ceil(r)) for r in ranks) if len(ranks) == len(sims) else base.pred_rank_peak_bytes
    return ReplicaPrediction(sims, base.updated(pred_step_s=worst.makespan_s, mean_bubble=worst.mean_bubble,
                                                pred_peak_bytes=peaks, pred_rank_peak_bytes=gpus))


def stitch(plan: Plan, replicas: Sequence[Plan], meta: Mapping[str, Any] | None = None) -> Plan:
    """``plan`` with the microbatches of ``replicas`` (each possibly reordered), replica-major, and
    ``meta`` added to its meta (one replica: that replica itself)."""
    if len(replicas) == 1 and plan.dp == 1:
        return replace(replicas[0], meta=replicas[0].meta.merged(meta))
    mbs_all: list[Microbatch] = []
    rids: list[int] = []
    for r, p in enumerate(replicas):
        mbs_all.extend(p.microbatches)
        rids.extend([r] * p.num_microbatches)
    return replace(plan, microbatches=tuple(mbs_all), dp=len(replicas), replica_ids=tuple(rids),
                   meta=plan.meta.merged(meta))
