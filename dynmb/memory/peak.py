"""The memory peak rule of a schedule kind: peak activation + transient bytes per stage.

``peak_from_matrix(act, tr, kind, virtual)`` (what ``MemoryModel.peak_bytes`` adds the states
to, ``rank_state``) is the exact peak of ``dynmb.memory.model``'s definition over the op sequence of
each stage: GPipe holds every microbatch (F_j sees 0..j live, B_j sees
j..m-1); 1F1B (and memory-aware) stage i holds a window of at most ``k = P - i``
consecutive microbatches (F_j sees j-k+1..j, B_j sees j..j+k-1). Interleaved (virtual > 1)
uses a conservative bound per rank: its warm-up count of the largest chunk activations.
The zero-bubble kinds keep 1F1B's window: ``zb-h1`` never holds more than 1F1B does (its
builder caps every stage at 1F1B's peak), ``zb`` adds warm-up forwards only while the simulated
peak stays under the limit, so packing for either is packing for 1F1B.

Each kind's window (and, with virtual stages, its chunk window) comes from its record in
``dynmb.schedule.kinds``; nothing here compares kind names.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dynmb.schedule.kinds import get_kind

__all__ = ["inflight_limit", "peak_from_matrix", "rank_state"]


def rank_state(state_bytes: Any, schedule_kind: str = "1f1b", virtual: int = 1) -> np.ndarray:
    """State bytes per stage of the GPU that holds it: under a kind with virtual stages
    (interleaved) and ``virtual`` > 1, stage i sits on rank i % (P / virtual) with the rank's
    other chunks, whose states add up."""
    state = np.asarray(state_bytes, dtype=np.float64).reshape(-1)
    kind = get_kind(schedule_kind)
    if not kind.virtual_stages or virtual <= 1:
        return state.copy()
    rank = np.array([kind.rank_of(s, len(state), virtual) for s in range(len(state))])   # its placement
    return np.bincount(rank, weights=state)[rank]


def inflight_limit(stage: int, num_stages: int, schedule_kind: str, m: int) -> int:
    """Most microbatches a stage holds at once under the kind's window (``dynmb.schedule.kinds``):
    m (gpipe) or min(m, P - stage) (1f1b and the kinds that keep its window)."""
    return get_kind(schedule_kind).inflight(stage, num_stages, m)


def peak_from_matrix(act: np.ndarray, tr: np.ndarray, schedule_kind: str = "1f1b", virtual: int = 1) -> np.ndarray:
    """Peak activation + transient bytes per stage (no states) for ``act[P, m]``, ``tr[P, m]``
    of microbatches in execution order (see the module docstring)."""
    kind = get_kind(schedule_kind)
    p, m = act.shape
    if kind.virtual_stages and virtual > 1:
        return _chunk_bound(act, tr, virtual, kind)
    cs = np.concatenate([np.zeros((p, 1)), np.cumsum(act, axis=1)], axis=1)
    j = np.arange(m)
    out = np.empty(p)
    for i in range(p):
        k = kind.inflight(i, p, m)
        lo = np.maximum(j - k + 1, 0)
        hi = np.minimum(j + k, m)
        fwd = cs[i, j + 1] - cs[i, lo]
        bwd = cs[i, hi] - cs[i, j]
        out[i] = np.max(np.maximum(fwd, bwd) + tr[i])
    return out


def _chunk_bound(act: np.ndarray, tr: np.ndarray, virtual: int, kind: Any) -> np.ndarray:
    """Per GPU of a kind with virtual stages (its placement's): its ``chunk_window`` largest chunk
    activations plus its largest buffer (a conservative bound)."""
    p, m = act.shape
    ranks = p // virtual
    rank_of = np.array([kind.rank_of(s, p, virtual) for s in range(p)])
    out = np.empty(p)
    for r in range(ranks):
        stages = np.flatnonzero(rank_of == r)
        warm = min(m * virtual, int(kind.chunk_window(r, ranks, virtual, m)))
        top = np.sort(act[stages].ravel())[::-1][:warm].sum()
        out[stages] = top + tr[stages].max()
    return out
