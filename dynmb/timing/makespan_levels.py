"""The level tables of the fast makespan estimates (``dynmb.timing.makespan``, ``dynmb.timing.makespan_zb``).

A GPipe or 1F1B schedule's ops of P stages and m microbatches, each at its level: its start under
unit costs and free sends (the longest chain of ops before it), so that no op depends on another of
its own level and the makespan recurrence ``end = max(stage free, input + send) + duration`` can be
evaluated one level at a time, vectorised over the level's ops and over many pipelines. Closed forms
(``levels``), and the table sorted by level with each op's predecessor on its stage and its
dependency as positions (``level_order``, cached); ``sweep_levels`` evaluates the recurrence on any
such table (the 1F1B / GPipe estimate of many pipelines at once, the interleaved one).
"""

from __future__ import annotations

import functools
import itertools

import numpy as np

__all__ = ["levels", "level_order", "sweep_levels"]


def levels(P: int, m: int, kind: str) -> tuple[np.ndarray, ...]:
    """The ops of a P x m GPipe / 1F1B schedule in natural order (op id = stage * 2m + slot, the
    slot its position in ``stage_order``): (level, stage, is backward, microbatch, dependency id
    or -1). The level is the op's start under unit costs and free sends (the longest chain of
    ops before it), so no op depends on one of its own level: 1F1B warm-up F_j(i) at i + j
    (j <= w_i = min(P-1-i, m)), later F_j(i) at i + 2j, B_j(i) at 2P-1-i+2j; GPipe F_j(i) at
    i + j, B_j(i) at 2P-2-i+m+j."""
    i, j = np.arange(P)[:, None], np.arange(m)[None, :]
    if kind == "gpipe":
        slot_f, slot_b, lev_f, lev_b = j + 0 * i, m + j + 0 * i, i + j, 2 * P - 2 - i + m + j
    else:
        w = np.minimum(P - 1 - i, m)
        slot_f, slot_b = np.where(j < w, j, 2 * j - w), np.where(j < m - w, w + 2 * j + 1, m + j)
        lev_f, lev_b = np.where(j <= w, i + j, 2 * j + i), 2 * P - 1 - i + 2 * j + 0 * i
    id_f, id_b = i * 2 * m + slot_f, i * 2 * m + slot_b
    n = 2 * P * m
    level, is_b, mb, dep = np.empty(n, np.int64), np.zeros(n, bool), np.empty(n, np.int64), np.full(n, -1, np.int64)
    level[id_f], level[id_b], is_b[id_b] = lev_f, lev_b, True
    mb[id_f] = mb[id_b] = np.broadcast_to(j, (P, m))
    dep[id_f[1:]], dep[id_b[:-1]] = id_f[:-1], id_b[1:]      # F from the stage below, B from the one above
    return level, np.repeat(np.arange(P), 2 * m), is_b, mb, dep


@functools.lru_cache(maxsize=16)
def level_order(P: int, m: int, kind: str) -> tuple:
    """``levels`` sorted by level: (stage, is backward, microbatch, previous op on the stage,
    dependency; both as positions in that order, n for none), and the start of each level."""
    level, stage, is_b, mb, dep = levels(P, m, kind)
    n = len(level)
    order = np.argsort(level, kind="stable")
    inv = np.empty(n + 1, dtype=np.int64)
    inv[order], inv[n] = np.arange(n), n
    prev = np.arange(-1, n - 1)
    prev[np.arange(P) * 2 * m] = n
    out = (stage[order], is_b[order], mb[order], inv[prev[order]], inv[np.where(dep >= 0, dep, n)[order]])
    for x in out:
        x.setflags(write=False)
    return (*out, np.searchsorted(level[order], np.arange(2 * (m + P) + 1)).tolist())


def sweep_levels(level: np.ndarray, prev: np.ndarray, dep: np.ndarray, cross: np.ndarray,
                 dur: np.ndarray) -> np.ndarray:
    """End of each of the ``N`` ops (``level[N]``; ``prev`` / ``dep``: positions of its predecessor on its
    stage and of its dependency, ``N`` for none; ``cross`` / ``dur``: ``N + 1`` seconds, the last 0):
    ``end = max(end[prev], end[dep] + cross) + dur``, one level at a time, vectorised over its ops."""
    N = len(level)
    order = np.argsort(level, kind="stable")
    bounds = np.searchsorted(level[order], np.arange(int(level.max()) + 2)).tolist()
    end = np.zeros(N + 1)
    for a, e in itertools.pairwise(bounds):
        if e > a:
            ids = order[a:e]
            end[ids] = np.maximum(end[prev[ids]], end[dep[ids]] + cross[ids]) + dur[ids]
    return end[:N]
