"""Simulating many microbatch orders of one flattened schedule at once (the reorder search's batches).

``batch_makespans(flat, cube, comm, perms)`` is ``dynmb.timing.simulate.action_times``' makespan for every
order (row of ``perms``) together: the actions are laid out once per schedule level by level
(``levels``: an action's dependency and the previous action on its rank lie in earlier levels), then
the recurrence ``end = max(previous action on the rank ends, dependency ends + P2P) + duration`` runs
level by level (a level a block of rows), every order a column. The same sums in the same order: the
same floats as one order at a time, for O(levels) numpy steps instead of O(actions) Python steps per order.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

__all__ = ["levels", "batch_makespans"]


def levels(flat: Any) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The actions of a flattened schedule laid out level by level (computed once per schedule): an action's
    dependency and the previous action on its rank lie in earlier levels. Returns the level starts (``n`` last),
    the action at each place (``by``), each action's place, and per place the places of the previous action on
    its rank and of its dependency (``n``, a zero row, for none)."""
    cached = getattr(flat, "levels", None)
    if cached is not None:
        return cached
    n = len(flat.rank)
    rank, dep = flat.rank.tolist(), flat.dep.tolist()
    prev, lev, last = [n] * n, [0] * n, [-1] * flat.num_ranks
    for i in flat.order.tolist():
        r, d, p = rank[i], dep[i], last[rank[i]]
        v = lev[p] + 1 if p >= 0 else 0
        if d >= 0 and lev[d] + 1 > v:
            v = lev[d] + 1
        lev[i], last[r] = v, i
        if p >= 0:
            prev[i] = p
    lv = np.asarray(lev, dtype=np.int64)
    by = np.argsort(lv, kind="stable")
    place = np.empty(n + 1, dtype=np.int64)
    place[by], place[n] = np.arange(n), n
    cuts = np.searchsorted(lv[by], np.arange(int(lv.max()) + 2 if n else 1)).tolist()
    out = (cuts, by, place[:n], place[np.asarray(prev, dtype=np.int64)[by]],
           place[np.where(flat.dep >= 0, flat.dep, n)[by]])
    flat.levels = out
    return out


def batch_makespans(flat: Any, cube: np.ndarray, comm: np.ndarray, perms: np.ndarray) -> np.ndarray:
    """``action_times``' makespan of the flattened schedule for each order (rows of ``perms``) at
    once: the same recurrence (start = max(previous action on the rank ends, dependency ends + P2P))
    evaluated level by level (``levels``: each level a block of rows), every order a column: the same sums, so
    the same floats."""
    cuts, by, place, prev, dep = levels(flat)
    n, K = len(flat.rank), len(perms)
    j = perms[:, flat.mb[by]].T                                        # [n, K] microbatch of each place
    dur = cube[flat.op[by][:, None], flat.stage[by][:, None], j]
    cross = np.zeros((n, K))
    xi = place[flat.xi]
    cross[xi] = comm[j[xi]]
    end = np.zeros((n + 1, K))
    for a, e in itertools.pairwise(cuts):
        t = end[dep[a:e]]
        t += cross[a:e]
        np.maximum(t, end[prev[a:e]], out=t)
        np.add(t, dur[a:e], out=end[a:e])
    return end[:n].max(axis=0) if n else np.zeros(K)
