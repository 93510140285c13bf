"""The fast makespan estimate of the interleaved schedule (``estimate_as="interleaved"``): R GPUs of v chunks.

``dynmb.timing.makespan.makespans(F, B, comm_s, sizes, kind, virtual=v)`` comes here for a kind whose record says
``estimate_as="interleaved"``. ``F`` / ``B`` are ``[S, m]`` with ``S = R v`` model chunks (stage ``s``
lives on GPU ``s % R``, ``dynmb.schedule.builders.interleaved``). Before this estimate the kind was
estimated as 1F1B over ``S`` stages, each its own GPU: a GPU's v chunks then ran in parallel (the work
term about ``1 / v`` of the real one) and the fill and drain crossed ``S - 1`` stages at a chunk's cost
(about ``v^2`` times the interleaved schedule's ``(R - 1) / v`` GPU-microbatches), so the packers
weighed the fill far above the work and ranked plans of fewer, larger microbatches too high
(``studies/interleaved/estimate.py``, docs/results.md "Interleaved stages at realistic load").

The estimate is the makespan of the op order the builder emits for ``(S, m, v)`` (an order-only
kind: it depends on no cost), swept with the simulator's recurrence ``end = max(GPU free, input +
send) + duration`` (a send paid where the input ran on another GPU; a chunk's backward follows its
forward on the same GPU): equal to ``dynmb.timing.simulate``'s makespan of that schedule up to float
rounding, one regime for every m. The order's level table (``level_table``, cached by ``(S, m, v)``:
each op's level, the longest chain of ops before it, so no op depends on another of its level; its
predecessor on its GPU, its input and whether that crossed GPUs) is built once from the schedule;
pipelines of every size are then evaluated together, one vectorised step per level
(``interleaved_makespans``), or swept one by one when they hold few ops (``SCALAR_OPS``). Plans with
slices of long sequences (their backward order) are estimated in the plain order.

The simulation layer, beside ``dynmb.timing.makespan``; the packers, one layer down, import it.
"""

from __future__ import annotations

import functools

import numpy as np

from dynmb.timing.estimators import Estimator, register_estimator
from dynmb.timing.makespan_levels import sweep_levels
from dynmb.schedule.kinds import build_schedule
from dynmb.schedule.validate import execution_order

__all__ = ["ESTIMATE", "level_table", "interleaved_makespans", "fold_chunks", "SCALAR_OPS", "TABLES"]

ESTIMATE = "interleaved"
"""The ``estimate_as`` value of this estimate."""
SCALAR_OPS = 4000
"""Up to this many ops in all the pipelines are swept one by one (cheaper than numpy steps per level)."""


TABLES = 32
"""Level tables kept (``level_table``'s cache): one per (chunks, microbatches, virtual), about 60 bytes per op."""


@functools.lru_cache(maxsize=TABLES)
def level_table(num_stages: int, m: int, virtual: int) -> tuple[np.ndarray, ...]:
    """``(row, mb, prev, dep, cross, level, topo)`` of the interleaved order of ``num_stages`` chunks,
    ``m`` microbatches, ``virtual`` chunks per GPU, one entry per op in the flat (GPU by GPU) order:
    ``row`` its row of ``[F; B]`` (``op * S + stage``), ``prev`` the op before it on its GPU and ``dep``
    its input (``n``: none), ``cross`` whether the input ran on another GPU, ``level`` (module doc),
    ``topo`` a topological order. Read-only arrays."""
    fl = execution_order(build_schedule("interleaved", num_stages, m, virtual=virtual))
    n = len(fl.stage)
    prev = np.arange(-1, n - 1, dtype=np.int64)
    prev[fl.start[:-1][np.diff(fl.start) > 0]] = n
    dep = np.where(fl.dep >= 0, fl.dep, n)
    cross = (fl.dep >= 0) & (fl.rank[np.maximum(fl.dep, 0)] != fl.rank)
    level = [0] * (n + 1)
    pl, dl = prev.tolist(), dep.tolist()
    for i in fl.order.tolist():
        a, b = level[pl[i]], level[dl[i]]
        level[i] = (a if a > b else b) + 1
    out = tuple(np.asarray(a, dtype=np.int32) for a in (fl.op * num_stages + fl.stage, fl.mb, prev, dep)) + (
        cross, np.asarray(level[:n], dtype=np.int32), fl.order.astype(np.int32))
    for a in out:
        a.setflags(write=False)
    return out


def _scalar(FB: np.ndarray, comm: np.ndarray, table: tuple[np.ndarray, ...]) -> float:
    """The recurrence of one pipeline (``FB`` = ``[F; B]`` of its m columns), op by op in topological order."""
    row, mb, prev, dep, cross, _, topo = table
    dur = FB[row, mb].tolist()
    x = np.where(cross, comm[mb], 0.0).tolist()
    n = len(dur)
    end = [0.0] * (n + 1)
    pl, dl = prev.tolist(), dep.tolist()
    for i in topo.tolist():
        t, d = end[pl[i]], end[dl[i]] + x[i]
        end[i] = (t if t > d else d) + dur[i]
    return max(end[:n])


def interleaved_makespans(F: np.ndarray, B: np.ndarray, comm: np.ndarray, sizes: np.ndarray,
                          virtual: int) -> np.ndarray:
    """The makespan of each pipeline k (the next ``sizes[k]`` columns of ``F``, ``B`` [S, M] and ``comm`` [M],
    in their order) under the interleaved schedule with ``virtual`` chunks per GPU (module doc)."""
    S, M = F.shape
    v = int(virtual)
    if v < 1 or S % v:
        raise ValueError(f"interleaved estimate: {S} chunks are not a positive multiple of virtual {virtual}")
    sizes = np.asarray(sizes, dtype=np.int64)
    comm = np.broadcast_to(np.asarray(comm, dtype=np.float64), (M,))
    offs = np.concatenate([[0], np.cumsum(sizes)])
    out = np.zeros(len(sizes))
    live = np.flatnonzero(sizes > 0)
    if not len(live):
        return out
    FB = np.concatenate([F, B])
    tables = {m: level_table(S, m, v) for m in np.unique(sizes[live]).tolist()}
    if int(2 * S * sizes.sum()) <= SCALAR_OPS or len(live) == 1:
        for k in live.tolist():
            a, e = int(offs[k]), int(offs[k + 1])
            out[k] = _scalar(FB[:, a:e], comm[a:e], tables[int(sizes[k])])
        return out
    parts = [tables[int(sizes[k])] for k in live.tolist()]
    lens = np.array([len(t[0]) for t in parts])
    base = np.concatenate([[0], np.cumsum(lens)])
    N = int(base[-1])
    col = np.concatenate([t[1] + offs[k] for t, k in zip(parts, live.tolist())])
    row = np.concatenate([t[0] for t in parts])
    prev = np.concatenate([np.where(t[2] < len(t[0]), t[2] + b, N) for t, b in zip(parts, base[:-1].tolist())])
    dep = np.concatenate([np.where(t[3] < len(t[0]), t[3] + b, N) for t, b in zip(parts, base[:-1].tolist())])
    level = np.concatenate([t[5] for t in parts])
    dur = np.append(FB[row, col], 0.0)
    cross = np.append(np.where(np.concatenate([t[4] for t in parts]), comm[col], 0.0), 0.0)
    out[live] = np.maximum.reduceat(sweep_levels(level, prev, dep, cross, dur), base[:-1])
    return out


def fold_chunks(X: np.ndarray, virtual: int) -> np.ndarray:
    """``[S, ...]`` per-chunk values summed per GPU: ``[S / virtual, ...]`` (chunk ``s`` on GPU ``s % R``)."""
    v = int(virtual)
    if v <= 1:
        return X
    return X.reshape(v, X.shape[0] // v, *X.shape[1:]).sum(axis=0)


def _estimate(F: np.ndarray, B: np.ndarray, comm: np.ndarray, sizes: np.ndarray, *, exact: bool | None = None,
              shares: np.ndarray | None = None, virtual: int = 1) -> np.ndarray:
    """The registry's callable (``dynmb.timing.estimators``): ``interleaved_makespans`` (``exact``, ``shares``
    not read: one regime, whole backwards)."""
    return interleaved_makespans(F, B, comm, sizes, virtual)


register_estimator(Estimator(name=ESTIMATE, makespans=_estimate, guarantee="exact", tolerance=1e-9))
