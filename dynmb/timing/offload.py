"""Activation offload's copies in the timeline: when a reload is late, the backward waits (the stall).

A stage whose first blocks offload (``PlanMeta.offload_blocks``, bytes from ``MemoryModel.offloading``) copies
each microbatch's offloaded bytes to host memory after its forward and back before its backward, on the rank's two
copy engines (one per direction, beside compute; ``HostLink``: ``GPUSpec.host_d2h_bytes_per_s`` /
``host_h2d_bytes_per_s``). The rules (the runtime, ``dynmb.runtime.offload``, issues its reloads so; it starts its
copies out earlier, block by block, which this model does not credit):

- **copy out**: issued when the forward ends, behind the rank's earlier copies out (one engine); a rank keeps at
  most ``COPY_OUT_DEPTH`` (2) in flight, so an offloading forward starts only once the copy out issued
  ``COPY_OUT_DEPTH`` forwards before it is done (beside it at most the previous one runs);
- **reload**: issued when the rank starts the op ``PREFETCH_LEAD`` (1) places before the backward in its list (the
  prefetch, as the runtime issues it), behind the rank's earlier reload and after the microbatch's own copy out;
  the backward (``B`` or ``I``; ``W`` reads what ``I`` kept) starts only when it is back.

Beside any op, then, at most ``in_transit() = COPY_OUT_DEPTH + PREFETCH_LEAD`` other microbatches' offloaded bytes
are on the device (the memory view's ``in_transit``: ``MemoryModel.offloading``).
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

__all__ = ["HostLink", "OffloadCopies", "host_link", "offload_view", "plan_copies", "offload_times", "in_transit",
           "PREFETCH_LEAD", "COPY_OUT_DEPTH"]

PREFETCH_LEAD = 1
"""How many ops before a backward its reload is issued (the runtime's prefetch: the op before it)."""
COPY_OUT_DEPTH = 2
"""Copies out a rank keeps in flight at most (an offloading forward waits for the one this many forwards back)."""


def in_transit() -> int:
    """Other microbatches' offloaded bytes on a stage's device beside any op: copies out and reloads in flight."""
    return COPY_OUT_DEPTH + PREFETCH_LEAD


@dataclass(frozen=True)
class HostLink:
    """Copy rates between a GPU and its host's pinned memory, bytes/s each way."""

    d2h_bytes_per_s: float
    h2d_bytes_per_s: float


@dataclass(frozen=True)
class OffloadCopies:
    """Seconds of each microbatch's copy out (``d2h[stage, mb]``) and reload (``h2d``); ``lead``: ops before its
    backward that a reload is issued; ``out_depth``: copies out a rank keeps in flight."""

    d2h: np.ndarray
    h2d: np.ndarray
    lead: int = PREFETCH_LEAD
    out_depth: int = COPY_OUT_DEPTH

    def lifted(self) -> "OffloadCopies":
        """These copies with the embedding stage's row first (``dynmb.schedule.embedlast``: it offloads nothing)."""
        def up(c: np.ndarray) -> np.ndarray:
            return np.vstack([np.zeros((1, c.shape[1])), c])
        return OffloadCopies(up(self.d2h), up(self.h2d), self.lead, self.out_depth)


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
    return memory_model.offloading(blocks, in_transit())


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
    return OffloadCopies(moved / link.d2h_bytes_per_s, moved / link.h2d_bytes_per_s)


def offload_times(flat: Any, dur: np.ndarray, cross: np.ndarray, num_ranks: int,
                  copies: OffloadCopies) -> tuple[list[float], list[float], float]:
    """``(start, end, stall)``: ``dynmb.timing.simulate.action_times`` with the copies' two waits (module doc);
    ``stall``: the seconds they add over all actions."""
    n = len(dur)
    durl, depl, crossl = dur.tolist(), flat.dep.tolist(), cross.tolist()
    rankl, stagel, opl, mbl = flat.rank.tolist(), flat.stage.tolist(), flat.op.tolist(), flat.mb.tolist()
    d2h, h2d, lead, depth = copies.d2h.tolist(), copies.h2d.tolist(), max(int(copies.lead), 0), \
        max(int(copies.out_depth), 1)
    first = flat.start.tolist()
    end, start = [0.0] * n, [0.0] * n
    free, in_free = [0.0] * num_ranks, [0.0] * num_ranks
    outs: list[list[float]] = [[0.0] * depth for _ in range(num_ranks)]     # each rank's last copies out, done at
    out_done: dict[tuple[int, int], float] = {}
    stall = 0.0
    for i in flat.order.tolist():
        r, s, op, j = rankl[i], stagel[i], opl[i], mbl[i]
        t = free[r]
        d = depl[i]
        if d >= 0 and end[d] + crossl[i] > t:
            t = end[d] + crossl[i]
        ready = t
        if op == 0 and d2h[s][j] > 0 and outs[r][-depth] > t:      # at most ``depth`` copies out in flight
            t = outs[r][-depth]
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
            done = max(e, outs[r][-1]) + d2h[s][j]
            outs[r] = outs[r][1:] + [done]
            out_done[(s, j)] = done
    return start, end, stall
