"""Zero-bubble schedules for a plan: the list scheduler fed by the one cost lookup and memory model,
checked by the simulator.

``build_zb(plan, kind, models=)`` gathers, for every (stage, microbatch) of
the plan, the predicted seconds of F, B, I and W (``cost_model.plan_costs(plan, ops=...)``, each
microbatch's attention work and recompute flag included), its P2P time and, with a memory model,
its activation, I-to-W and transient bytes (``dynmb.timing.simulate.memory_inputs`` / ``w_inputs``),
and builds ``zb-h1`` or ``zb`` (``dynmb.schedule.zerobubble``) with the simulator as the
judge (``evaluate``: predicted makespan and per-stage peak, states included). Recomputed
microbatches run a full ``B`` (``split`` False): their backward holds no more than one block,
so deferring their weight gradients would hold what recomputation saved.
This is the planning layer: the schedule package does not import the simulator.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dynmb.costmodel.loader import Models
from dynmb.memory.model import MemoryModelLike
from dynmb.schedule.kinds import build_schedule, get_kind, kinds_with
from dynmb.schedule.validate import execution_order
from dynmb.schedule.zerobubble import ZBInputs
from dynmb.timing.simulate import action_times, cross_mask, comm_times, memory_inputs, peaks, w_inputs
from dynmb.core.types import Plan, Schedule

__all__ = ["zb_inputs", "zb_evaluator", "build_zb"]


def zb_inputs(plan: Plan, models: Models[MemoryModelLike | None]) -> ZBInputs:
    """Per (stage, microbatch) times, P2P times and (with ``models.memory``) bytes of ``plan``."""
    cost_model, memory_model = models.cost, models.memory
    costs = cost_model.plan_costs(plan, ops=("F", "B", "I", "W"))
    m = plan.num_microbatches
    comm = np.broadcast_to(np.asarray(comm_times(cost_model, plan), dtype=np.float64), (m,)).copy()
    split = np.broadcast_to(~plan.recompute_mask(), (plan.num_stages, m)).copy()
    act, tr, _ = memory_inputs(memory_model, plan)
    w = w_inputs(memory_model, plan) if act is not None else None
    if act is not None and tr is None:
        tr = np.zeros_like(act)
    if act is not None and w is None:
        w = act.copy()             # a memory model without I-to-W bytes: assume W holds what F did
    return ZBInputs(costs["F"], costs["B"], costs["I"], costs["W"], comm, split, act, w, tr)


def zb_evaluator(plan: Plan, models: Models[MemoryModelLike | None], inp: ZBInputs):
    """``schedule -> (makespan, peak bytes per stage)``: the simulator's recurrence and memory rule
    (``dynmb.timing.simulate``, without building its timeline tables) on ``inp``'s numbers."""
    memory_model = models.memory
    S = plan.num_stages
    state = np.zeros(S) if memory_model is None else np.asarray(memory_model.state_bytes, dtype=np.float64)
    cube = np.stack([inp.F, inp.B, inp.I, inp.W])             # the simulator's op codes F, B, I, W

    def evaluate(schedule: Schedule) -> tuple[float, np.ndarray]:
        flat = execution_order(schedule)
        dur = cube[flat.op, flat.stage, flat.mb]
        cross = np.zeros(len(dur))
        xi = cross_mask(flat)
        cross[xi] = inp.comm[flat.mb[xi]]
        _, end = action_times(flat, dur, cross, schedule.num_ranks)
        if inp.act is None:
            return float(max(end, default=0.0)), np.zeros(S)
        peak, _, _ = peaks(flat, S, schedule.num_ranks, inp.act, inp.tr, state, inp.w)
        return float(max(end, default=0.0)), peak
    evaluate.judge = ("makespan", state.tobytes())  # type: ignore[attr-defined]  # the builders may cache by it
    return evaluate


def build_zb(plan: Plan, kind: str, *, models: Models[MemoryModelLike | None]) -> Schedule:
    """The ``kind`` (``zb-h1`` or ``zb``) schedule of one pipeline replica's plan (``models.memory`` None: without
    a memory limit)."""
    memory_model = models.memory
    if not get_kind(kind).costs:
        raise ValueError(f"not a cost-driven (zero-bubble) kind: {kind!r}; expected one of {kinds_with('costs')}")
    if models.cost is None:
        raise ValueError(f"the {kind} schedule needs a cost model (it places W by predicted times)")
    inp = zb_inputs(plan, models)
    evaluate = zb_evaluator(plan, models, inp)
    kw: dict[str, Any] = {}
    if memory_model is not None:
        kw = dict(limit_bytes=plan.memory_limit_bytes, state_bytes=memory_model.state_bytes)
    return build_schedule(kind, plan.num_stages, plan.num_microbatches, zb_inputs=inp, evaluate=evaluate, **kw)
