"""Activation offload's copies in the timeline: when a reload is late, the backward waits (the stall).

A stage whose first blocks offload (``PlanMeta.offload_blocks``, bytes from ``MemoryModel.offloading``) copies
each microbatch's offloaded bytes to host memory after its forward and back before its backward, on the rank's two
copy engines (one per direction, beside compute; ``HostLink``: ``GPUSpec.host_d2h_bytes_per_s`` /
``host_h2d_bytes_per_s``). The rules, which the runtime (``dynmb.runtime.offload``) follows:

- **copy out**: issued when the forward ends, behind the rank's earlier copy out; a rank keeps at most one in
  flight, so an offloading forward starts only once the rank's previous copy out is done (the memory model's
  ``in_transit`` counts it once);
- **reload**: issued when the rank starts the op ``lead`` places before the backward in its list (the prefetch;
  the runtime's is 1), behind the rank's earlier reload and after the microbatch's own copy out; the backward
  (``B`` or ``I``; ``W`` reads what ``I`` kept) starts only when it is back.

So per action ``start = max(rank free, dependency + P2P, previous copy out done [F], reload done [B/I])``, the
simulator's recurrence (``dynmb.timing.simulate.action_times``) with two more terms; ``stall`` is what they add.
Without copies (``OffloadCopies`` None) the simulator runs its own recurrence unchanged. A cost model without a host
link (the CPU models: a CPU's host is its device) prices no copies: ``host_link`` is None and the planner offloads
nothing (``dynmb.planning.offload``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dynmb.costmodel.gpu import GPUSpec
from dynmb.core.types import Plan

__all__ = ["HostLink", "OffloadCopies", "host_link", "offload_view", "plan_copies", "offload_times", "PREFETCH_LEAD"]

PREFETCH_LEAD = 1
"""How many ops before a backward its reload is issued (the runtime's prefetch: the op before it)."""


@dataclass(frozen=True)
class HostLink:
    """Copy rates between a GPU and its host's pinned memory, bytes/s each way."""

    d2h_bytes_per_s: float
    h2d_bytes_per_s: float


@dataclass(frozen=True)
class OffloadCopies:
    """Seconds of each microbatch's copy out (``d2h[stage, mb]``) and reload (``h2d``); ``lead``: ops before its
    backward that a reload is issued."""

    d2h: np.ndarray
    h2d: np.ndarray
    lead: int = PREFETCH_LEAD

    def lifted(self) -> "OffloadCopies":
        """These copies with the embedding stage's row first (``dynmb.schedule.embedlast``: it offloads nothing)."""
        def up(c: np.ndarray) -> np.ndarray:
            return np.vstack([np.zeros((1, c.shape[1])), c])
        return OffloadCopies(up(self.d2h), up(self.h2d), self.lead)


def host_link(cost_model: Any) -> HostLink | None:
    """The host link of ``cost_model`` (a ``GPUCostModel``'s spec), None where it has none (CPU models)."""
    spec = getattr(cost_model, "spec", None)
    if not isinstance(spec, GPUSpec) or spec.host_d2h_bytes_per_s <= 0 or spec.host_h2d_bytes_per_s <= 0:
        return None
    return HostLink(spec.host_d2h_bytes_per_s, spec.host_h2d_bytes_per_s)


def offload_view(memory_model: Any, plan: Plan) -> Any:
    """``memory_model`` as ``plan`` runs: offloading the plan's ``meta.offload_blocks`` where it records any (the
    model itself otherwise, or where it cannot offload)."""
    blocks = plan.meta.offload_blocks
    if memory_model is None or not blocks or not any(blocks) or not hasattr(memory_model, "offloading"):
        return memory_model
    return memory_model.offloading(blocks, lead=PREFETCH_LEAD)


def plan_copies(memory_model: Any, plan: Plan, cost_model: Any) -> OffloadCopies | None:
    """The copies of ``plan`` on ``memory_model`` (an ``offloading`` view; ``offload_view``) over the host link of
    ``cost_model``; None where nothing is offloaded or there is no host link (no copies priced)."""
    if memory_model is None or not getattr(memory_model, "in_transit", 0):
        return None
    link = host_link(cost_model)
    if link is None:
        return None
    shapes = plan.shapes()
    moved = np.asarray(memory_model.offload_matrix(shapes[:, 0], shapes[:, 1], plan.recompute_mask()),
                       dtype=np.float64)
    if not moved.any():
        return None
    return OffloadCopies(moved / link.d2h_bytes_per_s, moved / link.h2d_bytes_per_s,
                         int(memory_model.in_transit) - 1)


def offload_times(flat: Any, dur: np.ndarray, cross: np.ndarray, num_ranks: int,
                  copies: OffloadCopies) -> tuple[list[float], list[float], float]:
    """``(start, end, stall)``: ``dynmb.timing.simulate.action_times`` with the copies' two waits (module doc);
    ``stall``: the seconds they add over all actions."""
    n = len(dur)
    durl, depl, crossl = dur.tolist(), flat.dep.tolist(), cross.tolist()
    rankl, stagel, opl, mbl = flat.rank.tolist(), flat.stage.tolist(), flat.op.tolist(), flat.mb.tolist()
    d2h, h2d, lead = copies.d2h.tolist(), copies.h2d.tolist(), max(int(copies.lead), 0)
    first = flat.start.tolist()
    end, start = [0.0] * n, [0.0] * n
    free, out_free, in_free = [0.0] * num_ranks, [0.0] * num_ranks, [0.0] * num_ranks
    out_done: dict[tuple[int, int], float] = {}
    stall = 0.0
    for i in flat.order.tolist():
        r, s, op, j = rankl[i], stagel[i], opl[i], mbl[i]
        t = free[r]
        d = depl[i]
        if d >= 0 and end[d] + crossl[i] > t:
            t = end[d] + crossl[i]
        ready = t
        if op == 0 and d2h[s][j] > 0 and out_free[r] > t:          # one copy out in flight per rank
            t = out_free[r]
        elif op in (1, 2) and h2d[s][j] > 0:
            issued = ready if lead == 0 else start[i - lead] if i - lead >= first[r] else 0.0
            back = max(issued, in_free[r], out_done.get((s, j), 0.0)) + h2d[s][j]
            in_free[r] = back
            t = max(t, back)
        stall += t - ready
        start[i] = t
        end[i] = e = t + durl[i]
        free[r] = e
        if op == 0 and d2h[s][j] > 0:
            out_free[r] = out_done[(s, j)] = e + d2h[s][j]
    return start, end, stall
