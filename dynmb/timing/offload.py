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
So per action ``start = max(rank free, dependency + P2P, previous copy out done [F], reload done [B/I])``: the
simulator's recurrence (``dynmb.timing.simulate.action_times``) with two more terms, which ``CopyWaits`` adds as its
optional ``waits`` (one loop; without copies it runs as it did); ``stall`` is what they add. A cost model without a host
link (the CPU models: a CPU's host is its device) prices no copies: ``host_link`` is None and the planner offloads
nothing (``dynmb.planning.offload``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dynmb.costmodel.gpu import GPUSpec
from dynmb.core.types import Plan

__all__ = ["HostLink", "OffloadCopies", "host_link", "offload_view", "plan_copies", "CopyWaits", "in_transit",
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


class CopyWaits:
    """The copies' two waits as ``dynmb.timing.simulate.action_times``' optional terms (module doc). ``deps``: the
    schedule's dependencies with each waiting action's (an offloading ``F``, a reloading ``B`` / ``I``) stored as
    ``-3 - dependency`` (``<= -2``), the mark ``action_times`` tests only where it found no dependency, so its plain
    path pays nothing; ``start(i, free, start, end)``: such an action's start; ``stall``: the seconds the waits
    added over all actions."""

    def __init__(self, flat: Any, dur: np.ndarray, cross: np.ndarray, copies: OffloadCopies) -> None:
        op, d2h_a, h2d_a = flat.op, copies.d2h[flat.stage, flat.mb], copies.h2d[flat.stage, flat.mb]
        waits = ((op == 0) & (d2h_a > 0)) | (((op == 1) | (op == 2)) & (h2d_a > 0))
        self.deps: list[int] = np.where(waits, -3 - flat.dep, flat.dep).tolist()
        self.dep, self.dur, self.cross = flat.dep.tolist(), dur.tolist(), cross.tolist()
        self.rank, self.stage, self.op, self.mb = flat.rank.tolist(), flat.stage.tolist(), op.tolist(), flat.mb.tolist()
        self.d2h, self.h2d = copies.d2h.tolist(), copies.h2d.tolist()
        self.lead, self.depth = max(int(copies.lead), 0), max(int(copies.out_depth), 1)
        self.first = flat.start.tolist()
        ranks = len(self.first) - 1
        self.in_free = [0.0] * ranks                  # each rank's reload engine free at
        self.outs = [[0.0] * self.depth for _ in range(ranks)]   # each rank's last copies out, done at
        self.out_done: dict[tuple[int, int], float] = {}
        self.stall = 0.0

    def start(self, i: int, free: float, start: list[float], end: list[float]) -> float:
        """Action ``i``'s start: its rank ``free`` at, its dependency's message, then the copies' wait."""
        r, s, op, j, d = self.rank[i], self.stage[i], self.op[i], self.mb[i], self.dep[i]
        ready = free if d < 0 or end[d] + self.cross[i] <= free else end[d] + self.cross[i]
        t = ready
        outs = self.outs[r]
        if op == 0:
            t = max(t, outs[-self.depth])                           # at most ``depth`` copies out in flight
            done = max(t + self.dur[i], outs[-1]) + self.d2h[s][j]  # its own copy out, at the forward's end
            self.outs[r] = outs[1:] + [done]
            self.out_done[(s, j)] = done
        else:
            lead = self.lead
            issued = ready if lead == 0 else start[i - lead] if i - lead >= self.first[r] else 0.0
            back = max(issued, self.in_free[r], self.out_done.get((s, j), 0.0)) + self.h2d[s][j]
            self.in_free[r] = back
            t = max(t, back)
        self.stall += t - ready
        return t
