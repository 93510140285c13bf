"""Discrete-event simulation of a pipeline schedule.

Model: each rank runs its actions in list order, one at a time. An action
starts when (a) its rank is free and (b) the action it depends on has ended
plus, when that action ran on another rank, the P2P time of the message:
``F`` of stage ``s`` waits for ``F`` of ``s - 1`` (the activation), ``B`` of
``s`` for ``B`` of ``s + 1`` (the gradient). Sends do not block the sender
(P2P overlaps compute). So ``start[a] = max(end[prev on rank], end[dep] +
comm[mb])`` and ``end[a] = start[a] + cost[op][stage, mb]``. A split backward's ``I`` waits
like ``B`` (for the ``B``/``I`` of ``s + 1``) and sends the input gradient at its end; its
``W`` depends on nothing across stages (its own ``I`` precedes it on the rank).

The recurrence is evaluated once, in a topological order of the (rank order
+ dependency) graph that ``dynmb.schedule.validate.execution_order`` produces
with a worklist over the ranks' queues; a deadlock there raises
``ScheduleError``. Slices of a long sequence add a dependency on the stage itself: a slice's
forward needs its earlier slices' keys and values (their forwards on that stage first), and
its backward (``B``/``I``) produces the gradients of those keys and values, which the earlier
slice's backward on that stage needs (reverse slice order). A stage lives on one rank, so the
rank's list order enforces both and adds no waiting of its own; ``simulate`` refuses a
schedule whose lists break it (``dynmb.schedule.validate.check_slice_order``), so no
simulated step ever runs an earlier slice's backward before a later one's. Arrays, one pass: O(actions) (P = 64, m = 1,024: well under
a second, see ``benchmarks/bench_simulate.py``).

Memory (DESIGN.md's one definition): a stage holds the activation bytes ``a`` of a
microbatch from its ``F`` until the end of its ``B``; while an op runs, the
transient bytes of that op's microbatch (buffers not kept for backward) come
on top. A split backward frees ``a`` at the end of ``I`` but keeps ``w`` (the layer
inputs and output gradients ``W`` needs) until the end of ``W``; while ``I`` runs it
holds ``max(a, w)`` plus the transient bytes, while ``W`` runs ``w``. Peak per stage = state bytes + max over the stage's action sequence of
(held + transient of the running op); per rank likewise, summing the stages
on it. ``bubble_fraction`` per rank = 1 - busy / makespan.

``simulate(schedule, plan, cost_model, memory_model)`` gets the costs from the
one cost lookup ``cost_model.stage_costs(rows, padded_len)`` and the message
time from ``cost_model.comm.time(model_cfg.link_bytes(rows, padded_len, P))`` (the widest link's message).

The timeline evaluator is public for the planning passes that score many orders of one
schedule (``dynmb.planning.reorder``, ``dynmb.planning.zerobubble``): ``cross_mask(flat)``
(the actions that pay the P2P time) and ``action_times(flat, dur, cross, num_ranks)`` (the
recurrence above, ``(start, end)`` per action), with ``peaks`` for the memory rule.

Fast path (``estimate_makespan``): the makespan alone of a GPipe or 1F1B schedule with one
stage per rank, without building a timeline: ``dynmb.timing.makespan.makespan``, the packers'
estimate (the same recurrence swept stage by stage over ``dynmb.schedule.order.stage_order``,
the op order the schedule builders emit; the pipeline bound above ``dynmb.timing.makespan.EXACT_OPS``
ops), in this layer beside the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np
import pandas as pd

from dynmb.timing.bounds import dependency_bound, plan_ideal, split_mask, stage_ranks
from dynmb.costmodel.base import CostModelLike
from dynmb.memory.model import MemoryModelLike
from dynmb.timing.makespan import embed_terms, makespan
from dynmb.schedule.embedlast import dropped, is_lifted
from dynmb.schedule.validate import ScheduleError, check_slice_order, execution_order
from dynmb.timing.embedding import embed_costs, lifted_costs, lifted_memory
from dynmb.timing.offload import CopyWaits, OffloadCopies, offload_view, plan_copies
from dynmb.core.types import Plan, Schedule

__all__ = ["SimResult", "MemoryInputs", "simulate", "simulate_costs", "estimate_makespan", "action_times", "ActionWaits", "cross_mask", "memory_inputs", "w_inputs", "plan_op_costs",
           "SliceGrads", "slice_grad_inputs",
           "comm_times", "peaks", "op_memory", "ScheduleError"]

_OPS = np.array(["F", "B", "I", "W"])


@dataclass
class SimResult:
    """The predicted step: timeline, makespan, bubbles and memory."""

    timeline: pd.DataFrame
    """One row per action: rank, stage, op, mb, start_s, end_s."""
    makespan_s: float
    busy_s: np.ndarray
    """Compute seconds per rank."""
    bubble_fraction: np.ndarray
    """1 - busy / makespan per rank."""
    peak_bytes: np.ndarray | None = None
    """Predicted peak bytes per stage (state + held activations), None without memory inputs."""
    peak_bytes_rank: np.ndarray | None = None
    """Predicted peak bytes per rank (stages on one rank summed over time)."""
    memory_timeline: pd.DataFrame | None = None
    """stage, t_s, bytes after each change of held activation bytes."""
    limit_bytes: int | None = None
    """The memory limit the plan was made for, when known."""
    kind: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    bound_s: float | None = None
    """The dependency bound of the plan's own microbatch costs (``dynmb.timing.bounds``); None from ``simulate_costs``."""
    ideal_s: float | None = None
    """The batch's limit: real tokens only, busiest stage, shortest fill and drain (``dynmb.timing.bounds``)."""

    @property
    def mean_bubble(self) -> float:
        return float(np.mean(self.bubble_fraction)) if len(self.bubble_fraction) else 0.0

    @property
    def fits(self) -> bool:
        """True when no stage's predicted peak exceeds the limit (or either is unknown)."""
        if self.peak_bytes is None or self.limit_bytes is None:
            return True
        peak = self.peak_bytes_rank if self.peak_bytes_rank is not None else self.peak_bytes
        return bool(np.all(peak <= self.limit_bytes))

    def to_summary(self) -> dict[str, Any]:
        """JSON-able one-line summary."""
        d: dict[str, Any] = {
            "kind": self.kind,
            "makespan_s": float(self.makespan_s),
            "mean_bubble": self.mean_bubble,
            "bubble_fraction": [float(x) for x in self.bubble_fraction],
            "busy_s": [float(x) for x in self.busy_s],
            "peak_bytes": None if self.peak_bytes is None else [int(round(x)) for x in self.peak_bytes],
            "limit_bytes": None if self.limit_bytes is None else int(self.limit_bytes),
            "bound_s": self.bound_s, "ideal_s": self.ideal_s,
        }
        if self.peak_bytes is not None:
            d["fits"] = self.fits
        d.update(self.extra)
        return d


def _cost_cube(costs: dict[str, np.ndarray], S: int, m: int, used: Any = "FB") -> np.ndarray:
    """``[4, S, m]`` seconds of F, B, I, W; the ops in ``used`` must be in ``costs``."""
    cube = np.zeros((4, S, m), dtype=np.float64)
    for k, op in enumerate("FBIW"):
        if op not in costs:
            if op not in used:
                continue
            raise ValueError(f"costs lack op {op!r}; got {sorted(costs)}")
        c = np.asarray(costs[op], dtype=np.float64)
        if c.shape != (S, m):
            raise ValueError(f"costs[{op!r}] must be [num_stages={S}, m={m}], got {c.shape}")
        if np.any(c < 0) or not np.all(np.isfinite(c)):
            raise ValueError(f"costs[{op!r}] has negative or non-finite entries")
        cube[k] = c
    return cube


class ActionWaits(Protocol):
    """Optional terms of ``action_times``' recurrence (activation offload's copies, ``dynmb.timing.offload.CopyWaits``):
    ``deps``, the schedule's dependencies with each action that waits on more stored as ``-3 - dependency``, and
    ``start(i, free, start, end)``, such an action's start from its rank's free time and the times so far."""

    deps: list[int]

    def start(self, i: int, free: float, start: list[float], end: list[float]) -> float: ...


def action_times(flat: Any, dur: np.ndarray, cross: np.ndarray, num_ranks: int,
                 waits: ActionWaits | None = None) -> tuple[list[float], list[float]]:
    """``(start, end)`` of every action of a flattened schedule (``execution_order``) with durations
    ``dur`` and P2P times ``cross`` (0 where the dependency ran on the same rank, ``cross_mask``):
    the recurrence start = max(rank free, dep end + comm), in topological order, on Python lists.
    ``waits``: more terms for some actions (``ActionWaits``); they are told apart by their dependency's mark, which
    only an action without a dependency tests, so the path without them runs no extra step for the others."""
    n = len(dur)
    durl, crossl, rankl = dur.tolist(), cross.tolist(), flat.rank.tolist()
    depl = flat.dep.tolist() if waits is None else waits.deps
    end = [0.0] * n
    start = [0.0] * n
    free = [0.0] * num_ranks
    for i in flat.order.tolist():
        r = rankl[i]
        t = free[r]
        d = depl[i]
        if d >= 0:
            td = end[d] + crossl[i]
            if td > t:
                t = td
        elif d < -1 and waits is not None:      # -3 - dependency: the waits' own action
            t = waits.start(i, t, start, end)
        start[i] = t
        e = t + durl[i]
        end[i] = e
        free[r] = e
    return start, end


def cross_mask(flat: Any) -> np.ndarray:
    """Indices of actions whose dependency ran on another rank (they pay the P2P time)."""
    xi = np.flatnonzero(flat.dep >= 0)
    return xi[flat.rank[flat.dep[xi]] != flat.rank[xi]]


@dataclass(frozen=True)
class MemoryInputs:
    """The memory side of ``simulate_costs`` (all optional): ``act_bytes[stage, mb]``, ``state_bytes[stage]``,
    the limit, ``transient_bytes[stage, mb]``, ``w_bytes[stage, mb]`` (held from I to W) and ``slice_grads`` (the
    gradients of slices' keys and values, ``slice_grad_inputs``)."""

    act_bytes: np.ndarray | None = None
    state_bytes: np.ndarray | None = None
    limit_bytes: int | None = None
    transient_bytes: np.ndarray | None = None
    w_bytes: np.ndarray | None = None
    slice_grads: SliceGrads | None = None


def simulate_costs(schedule: Schedule, costs: dict[str, np.ndarray], comm_s: float | np.ndarray = 0.0,
                   act_bytes: np.ndarray | None = None, state_bytes: np.ndarray | None = None,
                   offload: OffloadCopies | None = None, **memory: Any) -> SimResult:
    """Simulate ``schedule`` with ``costs[op][stage, mb]`` seconds and ``comm_s`` (scalar or per mb) per P2P message.

    ``act_bytes[stage, mb]``, ``state_bytes[stage]`` and ``memory``, the other fields of ``MemoryInputs``
    (``limit_bytes``, ``transient_bytes``, ``w_bytes``, ``slice_grads``; all optional) give the memory
    prediction. Costs must hold every op the schedule uses. ``offload``: the seconds of activation offload's
    copies (``dynmb.timing.offload``), whose late reloads the step waits for (``extra["offload_stall_s"]``).
    Raises ``ScheduleError`` if the schedule is invalid or deadlocks.
    """
    mem = MemoryInputs(act_bytes, state_bytes, **memory)
    S, m = schedule.num_stages, schedule.num_microbatches
    flat = execution_order(schedule)
    cube = _cost_cube(costs, S, m, used="".join(_OPS[np.unique(flat.op)]))
    stage, op, mb, rank = flat.stage, flat.op, flat.mb, flat.rank
    n = len(stage)
    dur = cube[op, stage, mb]
    comm = np.broadcast_to(np.asarray(comm_s, dtype=np.float64), (m,)) if np.ndim(comm_s) else np.full(m, float(comm_s))
    if comm.shape != (m,):
        raise ValueError(f"comm_s must be a scalar or have one entry per microbatch ({m}), got {np.shape(comm_s)}")
    cross = np.zeros(n, dtype=np.float64)
    xi = cross_mask(flat)
    cross[xi] = comm[mb[xi]]
    waits = None if offload is None else CopyWaits(flat, dur, cross, offload)
    start, end = action_times(flat, dur, cross, schedule.num_ranks, waits)
    start_a, end_a = np.asarray(start), np.asarray(end)
    makespan = float(end_a.max()) if n else 0.0
    busy = np.bincount(rank, weights=dur, minlength=schedule.num_ranks)
    bubble = 1.0 - busy / makespan if makespan > 0 else np.zeros(schedule.num_ranks)
    timeline = pd.DataFrame({"rank": rank, "stage": stage, "op": _OPS[op], "mb": mb,
                             "start_s": start_a, "end_s": end_a})
    res = SimResult(timeline=timeline, makespan_s=makespan, busy_s=busy, bubble_fraction=bubble,
                    limit_bytes=None if mem.limit_bytes is None else int(mem.limit_bytes), kind=schedule.kind)
    if waits is not None:
        res.extra["offload_stall_s"] = waits.stall
    if mem.act_bytes is not None:
        _memory(res, flat, schedule, mem, end_a)
    return res


def _memory(res: SimResult, flat: Any, schedule: Schedule, mem: MemoryInputs, end: np.ndarray) -> None:
    S, m = schedule.num_stages, schedule.num_microbatches
    act = np.asarray(mem.act_bytes, dtype=np.float64)
    if act.shape != (S, m):
        raise ValueError(f"act_bytes must be [num_stages={S}, m={m}], got {act.shape}")
    state = np.zeros(S) if mem.state_bytes is None else np.asarray(mem.state_bytes, dtype=np.float64).reshape(-1)
    if state.shape != (S,):
        raise ValueError(f"state_bytes must have one entry per stage ({S}), got {state.shape}")
    tr = None if mem.transient_bytes is None else np.asarray(mem.transient_bytes, dtype=np.float64)
    if tr is not None and tr.shape != (S, m):
        raise ValueError(f"transient_bytes must be [num_stages={S}, m={m}], got {tr.shape}")
    w = None if mem.w_bytes is None else np.asarray(mem.w_bytes, dtype=np.float64)
    if w is not None and w.shape != (S, m):
        raise ValueError(f"w_bytes must be [num_stages={S}, m={m}], got {w.shape}")
    res.peak_bytes, res.peak_bytes_rank, (o, st, held) = peaks(flat, S, schedule.num_ranks, act, tr, state, w,
                                                               mem.slice_grads)
    res.memory_timeline = pd.DataFrame({"stage": st, "t_s": end[o], "bytes": held + state[st]})


class SliceGrads(NamedTuple):
    """Gradients of slices' keys and values (``dynmb.models.prefix``), ``[P, m]`` bytes each: ``alloc``
    appear during a microbatch's backward (the first backward of a chain, its last slice's,
    creates the gradients of every earlier slice), ``free`` go with its backward (its own);
    ``recomputed``: held during a recomputed continued slice's backward only (its recomputed keys and
    values, ``MemoryModel.slice_recompute_coef``)."""

    alloc: np.ndarray
    free: np.ndarray
    recomputed: np.ndarray | None = None


def _lifted_grads(grads: SliceGrads) -> SliceGrads:
    """``grads`` with the embedding stage's row first (``dynmb.schedule.embedlast``): it holds no keys or values."""
    def up(g: np.ndarray) -> np.ndarray:
        return np.vstack([np.zeros((1, g.shape[1])), g])
    return SliceGrads(up(grads.alloc), up(grads.free), None if grads.recomputed is None else up(grads.recomputed))


def op_memory(flat: Any, act: np.ndarray, tr: np.ndarray | None, w: np.ndarray | None = None,
              slice_grads: SliceGrads | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(delta, during)`` per action: the change of held bytes when it ends, and what it holds
    on top of the held-after level while it runs (module doc): F +a; B -a, during +a; I +(w - a),
    during max(a - w, 0); W -w, during +w; every op but W also its transient bytes ``tr``. A
    backward (B or I) also adds ``slice_grads.alloc - slice_grads.free`` and holds the freed ones
    while it runs."""
    a = act[flat.stage, flat.mb]
    wb = np.zeros_like(a) if w is None else w[flat.stage, flat.mb]
    op = flat.op
    pick = op * len(a) + np.arange(len(a))                      # op codes F, B, I, W: one of four per action
    delta = np.take(np.concatenate((a, -a, wb - a, -wb)), pick)
    during = np.take(np.concatenate((np.zeros_like(a), a, np.maximum(a - wb, 0.0), wb)), pick)
    if tr is not None:
        during = during + np.where(op == 3, 0.0, tr[flat.stage, flat.mb])
    if slice_grads is not None:
        bwd = (op == 1) | (op == 2)
        alloc, free = slice_grads.alloc[flat.stage, flat.mb], slice_grads.free[flat.stage, flat.mb]
        delta = delta + np.where(bwd, alloc - free, 0.0)
        during = np.where(bwd, np.maximum(during + free - alloc, 0.0), during)
        if slice_grads.recomputed is not None:
            during = during + np.where(bwd, slice_grads.recomputed[flat.stage, flat.mb], 0.0)
    return delta, during


def peaks(flat: Any, S: int, R: int, act: np.ndarray, tr: np.ndarray | None,
          state: np.ndarray, w: np.ndarray | None = None, slice_grads: SliceGrads | None = None
          ) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Peak bytes per stage and per rank of a flattened schedule (see module doc), plus the
    per-stage sequence ``(order, stage, held bytes after each op)`` for the memory timeline."""
    delta, during = op_memory(flat, act, tr, w, slice_grads)
    # per stage: its actions in rank order (a stage lives on one rank); stage s alone on rank s: flat's order
    one_each = R == S and np.array_equal(flat.stage, flat.rank)
    o = np.arange(len(delta)) if one_each else np.lexsort((flat.step, flat.stage))
    st = flat.stage if one_each else flat.stage[o]
    d_o = delta if one_each else delta[o]
    cs = np.cumsum(d_o)
    first = np.r_[0, np.flatnonzero(st[1:] != st[:-1]) + 1]
    held = cs - np.repeat(cs[first] - d_o[first], np.diff(np.r_[first, len(st)]))
    peak_held = np.zeros(S)
    if len(st):
        peak_held[st[first]] = np.maximum(np.maximum.reduceat(held + (during if one_each else during[o]), first), 0.0)
    # per rank: its whole sequence (flat is rank-major, in step order); one stage each: the stage's
    rank_of = np.zeros(S, dtype=np.int64)
    rank_of[flat.stage] = flat.rank
    peak_r = peak_held.copy() if one_each else np.zeros(R)
    nonempty = np.flatnonzero(np.diff(flat.start) > 0)
    if len(nonempty) and not one_each:
        starts = flat.start[nonempty]
        csr = np.cumsum(delta)
        held_r = csr - np.repeat(csr[starts] - delta[starts], np.diff(np.r_[starts, len(delta)]))
        peak_r[nonempty] = np.maximum(np.maximum.reduceat(held_r + during, starts), 0.0)
    return state + peak_held, np.bincount(rank_of, weights=state, minlength=R) + peak_r, (o, st, held)


def memory_inputs(memory_model: MemoryModelLike | None, plan: Plan) -> tuple[Any, Any, Any]:
    """``(act[P, m], transient[P, m] or None, state[P])`` of ``plan`` from ``memory_model`` (Nones
    without one); recomputed microbatches (``Microbatch.recompute``) at their recomputed bytes, continued
    slices of long sequences with the bytes their keys and values hold for later slices
    (``MemoryModel.slice_matrix``)."""
    if memory_model is None:
        return None, None, None
    shapes = plan.shapes()
    rows, plen = shapes[:, 0], shapes[:, 1]
    rc = plan.recompute_mask()
    if hasattr(memory_model, "act_matrix"):
        act, tr = memory_model.act_matrix(rows, plen, rc) if rc.any() else memory_model.act_matrix(rows, plen)
    else:
        act = np.stack([np.asarray(memory_model.activation_bytes(s, rows, plen), dtype=np.float64).reshape(-1)
                        for s in range(plan.num_stages)])
        tr = None
    act = np.asarray(act, dtype=np.float64)
    if plan.has_slices and hasattr(memory_model, "slice_matrix"):
        act = act + memory_model.slice_matrix([mb.continued_tokens for mb in plan.microbatches], rc)
    return act, tr, np.asarray(memory_model.state_bytes, dtype=np.float64)


def slice_grad_inputs(memory_model: MemoryModelLike | None, plan: Plan) -> SliceGrads | None:
    """``SliceGrads`` of ``plan``'s chains of slices (None without slices or a memory model that
    knows them): each continued slice's key/value gradients (``MemoryModel.slice_grad_coef`` per
    token) appear in the backward of its chain's last slice and are freed by its own."""
    if memory_model is None or not plan.has_slices or not hasattr(memory_model, "slice_grad_coef"):
        return None
    S, m = plan.num_stages, plan.num_microbatches
    coef = np.asarray(memory_model.slice_grad_coef(), dtype=np.float64)
    alloc, free = np.zeros((S, m)), np.zeros((S, m))
    for sid, where in plan.slice_groups().items():
        for i in where[:-1]:
            mb = plan.microbatches[i]
            g = coef * float(mb.lengths[mb.seq_ids == sid][0])
            free[:, i] += g
            alloc[:, where[-1]] += g
    rc = plan.recompute_mask()
    held = None
    if rc.any() and hasattr(memory_model, "slice_recompute_coef"):
        n = np.array([mb.continued_tokens for mb in plan.microbatches], dtype=np.float64) * rc
        held = np.asarray(memory_model.slice_recompute_coef(), dtype=np.float64)[:, None] * n[None, :]
    return SliceGrads(alloc, free, held)


def w_inputs(memory_model: MemoryModelLike | None, plan: Plan) -> np.ndarray | None:
    """``w[P, m]``: bytes each microbatch of ``plan`` holds from its ``I`` to its ``W`` (None
    without a memory model that knows them)."""
    if memory_model is None or not hasattr(memory_model, "w_matrix"):
        return None
    shapes = plan.shapes()
    return np.asarray(memory_model.w_matrix(shapes[:, 0], shapes[:, 1], plan.recompute_mask()), dtype=np.float64)


def plan_op_costs(cost_model: CostModelLike, plan: Plan, schedule: Schedule) -> dict[str, np.ndarray]:
    """``cost_model.plan_costs(plan)`` with ``I`` and ``W`` added when ``schedule`` splits backwards."""
    used = {a.op for acts in schedule.ranks for a in acts}
    if used <= {"F", "B"}:
        return cost_model.plan_costs(plan)
    return cost_model.plan_costs(plan, ops=("F", "B", "I", "W"))


def comm_times(cost_model: CostModelLike, plan: Plan) -> np.ndarray | float:
    """P2P seconds per microbatch of ``plan`` from ``cost_model.comm`` (0 without one)."""
    comm_model = getattr(cost_model, "comm", None)
    if comm_model is None:
        return 0.0
    shapes = plan.shapes()
    nbytes = np.asarray(cost_model.model_cfg.link_bytes(shapes[:, 0], shapes[:, 1], plan.num_stages), dtype=np.float64)
    return np.asarray(comm_model.time(nbytes), dtype=np.float64).reshape(-1)


def simulate(schedule: Schedule, plan: Plan, cost_model: CostModelLike, memory_model: MemoryModelLike | None = None) -> SimResult:
    """Simulate ``plan`` (microbatch ``j`` = ``plan.microbatches[j]``) under ``schedule``.

    Costs from ``cost_model.plan_costs(plan)`` (rows, padded_len and attention work); P2P time from
    ``cost_model.comm.time(message bytes)``; memory from ``memory_model`` when given. A plan that offloads
    (``meta.offload_blocks``, or ``memory_model`` an ``offloading`` view) is simulated with its bytes and copies
    (``dynmb.timing.offload``).
    """
    lift = is_lifted(schedule, plan.num_stages)          # the embedding on the last rank (dynmb.schedule.embedlast)
    if schedule.num_stages != plan.num_stages and not lift:
        raise ValueError(f"schedule has {schedule.num_stages} stages but the plan was made for {plan.num_stages}")
    if schedule.num_microbatches != plan.num_microbatches:
        raise ValueError(f"schedule has {schedule.num_microbatches} microbatches but the plan {plan.num_microbatches}")
    if plan.has_slices:
        check_slice_order(schedule, plan)       # the same-stage slice dependency (module doc)
    shapes = plan.shapes()
    rows, plen = shapes[:, 0], shapes[:, 1]
    costs = plan_op_costs(cost_model, plan, schedule)
    comm = comm_times(cost_model, plan)
    memory_model = offload_view(memory_model, plan)      # the plan's offload_blocks (dynmb.timing.offload)
    copies = plan_copies(memory_model, plan, cost_model)
    act, tr, state = memory_inputs(memory_model, plan)
    w = w_inputs(memory_model, plan) if act is not None else None
    grads = slice_grad_inputs(memory_model, plan)
    if lift:
        costs = lifted_costs(costs, embed_costs(cost_model, plan))
        act, tr, state, w = lifted_memory(memory_model, plan, (act, tr, state, w))
        grads = None if grads is None else _lifted_grads(grads)
        copies = None if copies is None else copies.lifted()
    res = simulate_costs(schedule, costs, comm, act, state, offload=copies, limit_bytes=plan.memory_limit_bytes,
                         transient_bytes=tr, w_bytes=w, slice_grads=grads)
    res.bound_s = dependency_bound(costs, comm, stage_ranks(schedule.num_stages, schedule), split_mask(schedule))
    res.ideal_s = plan_ideal(plan, cost_model, dropped(schedule) if lift else schedule) \
        if hasattr(cost_model, "predict") else None
    tl = res.timeline
    tl["batch"] = rows[tl["mb"].to_numpy()]
    tl["padded_len"] = plen[tl["mb"].to_numpy()]
    return res


def estimate_makespan(costs: dict[str, np.ndarray], comm_s: float | np.ndarray = 0.0, kind: str = "1f1b",
                      virtual: int = 1, embed: tuple[np.ndarray, np.ndarray] | None = None) -> float:
    """The fast path: predicted makespan of the ``kind`` schedule (by the estimator its ``estimate_as`` names in
    ``dynmb.timing.estimators``: ``gpipe``, ``1f1b``, the zero-bubble ones with their default I / W shares, the
    interleaved or ZB-V one with ``virtual`` chunks per GPU) of
    ``costs["F"]``, ``costs["B"]`` (``[num_stages, m]`` seconds) with ``comm_s`` per message, without a
    timeline: ``dynmb.timing.makespan.makespan`` (module doc). ``embed``: ``(F[m], B[m])`` seconds of the embeds
    with the embedding on the last rank (``dynmb.timing.embedding.embed_seconds``), priced by
    ``dynmb.timing.makespan.embed_terms``."""
    F = np.asarray(costs["F"], dtype=np.float64)
    est = makespan(F, np.asarray(costs["B"], dtype=np.float64), comm_s, kind, virtual=virtual)
    return est if embed is None else est + float(embed_terms(embed, comm_s, [F.shape[1]])[0])
