"""The reorder search's start orders of one pipeline's microbatches, by work (pure numpy).

``dynmb.planning.reorder``'s ``search`` starts from the best of the cheap orders (``START_ORDERS``): as
packed, descending and ascending by work (``sum over stages of F + B``, stable), ``ends`` (ascending,
dealt alternately to the front and the back: small at both ends) and DynaPipe's cluster search (the
works in ``k <= 4`` clusters by 1-D k-means from quantile seeds, every permutation of the clusters,
the original order inside a cluster). The search never ends above its start, so the best of these
orders bounds what it runs. ``dynmb.packing.dynamic.rank`` weighs its finals by the same orders,
so that it chooses among plans as they will be run after the search (and a baseline's plan as
its own method's reorder, one of these orders, runs it); the reorder pass takes them from here.
"""

from __future__ import annotations

import itertools
from typing import Callable

import numpy as np

__all__ = ["START_ORDERS", "ends_order", "kmeans_1d", "cluster_orders", "start_orders", "best_start_orders", "blocked_order"]

START_ORDERS = ("none", "descending", "ascending", "ends", "dynapipe")
"""The reorder methods the search starts from (``dynapipe``: each of its cluster permutations)."""


def ends_order(work: np.ndarray) -> list[int]:
    """Small at both ends, large in the middle: ascending, dealt alternately to front and back."""
    asc = np.argsort(work, kind="stable").tolist()
    return asc[0::2] + asc[1::2][::-1]


def kmeans_1d(x: np.ndarray, k: int, iters: int = 50) -> np.ndarray:
    """Cluster labels (0 = smallest centre) of 1-D values, Lloyd's iterations from quantile seeds."""
    centres = np.quantile(x, (np.arange(k) + 0.5) / k)
    labels = np.zeros(len(x), dtype=np.int64)
    for it in range(iters):
        new = np.abs(x[:, None] - centres[None, :]).argmin(axis=1)
        if np.array_equal(new, labels) and it:
            break
        labels = new
        for c in range(k):
            if np.any(labels == c):
                centres[c] = x[labels == c].mean()
    rank = np.argsort(np.argsort(centres, kind="stable"), kind="stable")
    return rank[labels]


def cluster_orders(work: np.ndarray, k: int = 4) -> list[list[int]]:
    """DynaPipe's candidate orders: the microbatches clustered by work into ``min(k, m, distinct works)``
    clusters, one order per permutation of the clusters (the original order inside each); one cluster:
    the original order alone."""
    m = len(work)
    k = min(k, m, len(np.unique(work)))
    if k <= 1:
        return [list(range(m))]
    labels = kmeans_1d(np.asarray(work, dtype=np.float64), k)
    groups = [g for g in (np.flatnonzero(labels == c).tolist() for c in range(k)) if g]
    return [[i for c in perm for i in groups[c]] for perm in itertools.permutations(range(len(groups)))]


def start_orders(work: np.ndarray, clusters: bool = True) -> list[list[int]]:
    """Every start order of the search (``START_ORDERS``; ``dynapipe``'s permutations each unless not
    ``clusters``), repeats dropped."""
    m = len(work)
    cands = [list(range(m)), np.argsort(-work, kind="stable").tolist(), np.argsort(work, kind="stable").tolist(),
             ends_order(work), *(cluster_orders(work) if clusters else [])]
    return list({tuple(o): o for o in cands}.values())


def best_start_orders(cols: np.ndarray, work: np.ndarray, estimate: Callable[[np.ndarray], np.ndarray],
                      limit: float, clusters: bool = True, first: int = 0) -> tuple[np.ndarray, float, float]:
    """Each pipeline of ``cols`` ([n, k]: its microbatches as run) in its best start order (``start_orders``
    of its ``work``) by ``estimate`` (pipelines [N, k] -> their values, all at once), as far as that can
    lower the slowest: pipeline ``first`` (the likeliest slowest), then the others as run, slowest first,
    until the next is no slower than the best reached (the rest keep their order). Returns the orders
    [n, k], the slowest pipeline's value in them and as run; (``cols``, inf, inf) as soon as a pipeline's
    best is at or past ``limit``."""
    out, slowest = cols.copy(), 0.0

    def improve(r: int) -> float:
        starts = cols[r][np.array(start_orders(work[cols[r]], clusters), dtype=np.int64)]
        vals = estimate(starts)
        j = int(np.argmin(vals))
        out[r] = starts[j]
        return float(vals[j])

    slowest = improve(first)
    if slowest >= limit:
        return cols, np.inf, np.inf
    ran = estimate(cols)
    for r in np.argsort(-ran, kind="stable").tolist():
        if ran[r] <= slowest:
            break
        slowest = max(slowest, improve(r)) if r != first else slowest
        if slowest >= limit:
            return cols, np.inf, np.inf
    return out, slowest, float(ran.max())


def blocked_order(starts: np.ndarray, cols: np.ndarray, ran: np.ndarray, busy: np.ndarray) -> np.ndarray | None:
    """A global order that ``rows.assign_replicas`` deals as replica ``r`` running ``starts[r]``, given how it
    dealt the order ``ran``: ``cols`` ([dp, k], replica r's microbatches in row r), ``starts[r]`` holding the
    microbatches of ``cols[r]``; None if this merge finds none.

    ``assign_replicas`` deals by ``busy``, largest first, ties in order of position: the microbatches of one
    ``busy`` value go to the replicas in a sequence that the loads alone fix (the one they got in ``ran``).
    So the replicas' sequences are merged, each time taking the next microbatch of the first replica that
    is next in its value's sequence (O(m dp) steps); a merge that gets stuck gives None."""
    dp, k = starts.shape
    label = np.empty(dp * k, dtype=np.int64)
    label[cols.ravel()] = np.repeat(np.arange(dp), k)
    value = busy.tolist()
    seq: dict[float, list[int]] = {}
    for x in np.asarray(ran).tolist():
        seq.setdefault(value[x], []).append(int(label[x]))
    taken = dict.fromkeys(seq, 0)
    ptr, out, rows = [0] * dp, [], starts.tolist()
    for _ in range(dp * k):
        for r in range(dp):
            if ptr[r] < k and seq[value[rows[r][ptr[r]]]][taken[value[rows[r][ptr[r]]]]] == r:
                out.append(rows[r][ptr[r]])
                taken[value[out[-1]]] += 1
                ptr[r] += 1
                break
        else:
            return None
    return np.array(out, dtype=np.int64)
