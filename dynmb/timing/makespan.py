"""The fast makespan estimate of a GPipe / 1F1B pipeline: what the packers score plans with.

``makespan(F, B, comm_s, kind)`` for per-stage, per-microbatch costs ``F[P, m]``, ``B[P, m]``
and a per-microbatch send time between neighbouring stages; ``makespans`` gives it for many
pipelines at once. ``kind`` is a schedule kind; its record's ``estimate_as`` names its entry in the
estimator registry (``dynmb.timing.estimators``), whose callable ``makespans`` calls: this module's
``gpipe`` and ``1f1b`` (the op order swept; below), the zero-bubble kinds' (``dynmb.timing.makespan_zb``),
the interleaved one (``dynmb.timing.makespan_interleaved``: ``virtual`` chunks per GPU, ``F`` / ``B``
one row per model chunk) and ZB-V's (``dynmb.timing.makespan_zbv``). The GPipe / 1F1B estimate has two
regimes:

* exact (equal to ``dynmb.timing.simulate``'s): the makespan of a GPipe or 1F1B schedule where every op
  starts when its stage is free and its input has arrived, over the op order the builders emit
  (``dynmb.schedule.order.stage_order``; 1F1B on stage i: ``w = min(P-1-i, m)`` warm-up
  forwards, then F/B pairs, then the remaining backwards, torch's ``Schedule1F1B``). Used when
  ``exact_regime``: 2 * P * m <= ``EXACT_OPS`` or m <= ``EXACT_PER_STAGE`` * P. Evaluated
  level by level (``dynmb.timing.makespan_levels``: ops that cannot depend on each other), one vectorised step per
  level over every pipeline of the batch (O(m + P) numpy steps); ``_exact_makespan``, a sweep
  over stages that advances each as far as its dependencies allow, when the levels would hold
  few ops.
* bound: the larger of two lower bounds of the exact value, used for more microbatches:
  the pipeline bound, the busiest stage's work plus the fill of the first microbatch's forward up
  to that stage and the drain of the last one's backward (relative error O(P / m) for
  microbatches of similar cost in order), and the round-trip bound (``round_trip_bound``):
  stage 0's own ops in their order, each backward starting no earlier than its forward's end on
  stage 0 plus its round trip above stage 0 (its forwards and backwards on stages 1 .. P-1 and
  2 (P - 1) sends), every other stage's contention dropped. The pipeline bound alone misses
  1F1B's round trips when costs are heavy-tailed: with a long microbatch in flight stage 0 may
  run only P - 1 others, then waits for it (longtail, 4M tokens, P 32, 1,636 microbatches per
  replica: 2.31 s by the pipeline bound, 16.5 s by the round trips, 18.6 s exact). O(m) steps
  per pipeline (numpy over many pipelines at once).

This is the simulation layer (beside ``dynmb.timing.simulate``, whose ``estimate_makespan`` it is);
the packers, one layer down, import it.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import numpy as np

import dynmb.timing.makespan_interleaved  # noqa: F401  (registers the interleaved estimator)
import dynmb.timing.makespan_zb  # noqa: F401  (registers zb-h1, zb)
import dynmb.timing.makespan_zbv  # noqa: F401  (registers zb-v)
from dynmb.timing.estimators import Estimator, estimator_of, register_estimator
from dynmb.timing.makespan_levels import level_order as _level_order
from dynmb.timing.makespan_levels import levels as _levels
from dynmb.timing.makespan_levels import sweep_levels
from dynmb.schedule.order import stage_order

__all__ = ["makespan", "makespans", "embed_terms", "order_makespans", "exact_regime", "round_trip_bound", "has_bound_regime", "EXACT_OPS",
           "EXACT_PER_STAGE"]

EXACT_OPS = 6000
"""Up to this many ops (2 * P * m) ``makespan`` is exact."""
EXACT_PER_STAGE = 16
"""... and also up to this many microbatches per stage: with few microbatches per stage the
bound misses 1F1B's round trips (microbatch j + P cannot start before j's backward is back
on stage 0), up to 4x low at P = 64 with heavy-tailed lengths."""


def _exact_makespan(F: np.ndarray, B: np.ndarray, comm_s: Any = 0.0, kind: str = "1f1b") -> float:
    """Makespan of the op order ``kind`` (gpipe or 1f1b) for costs ``F``, ``B``."""
    p, m = F.shape
    if m == 0:
        return 0.0
    c = np.broadcast_to(np.asarray(comm_s, dtype=np.float64), (m,)).tolist()
    Fl, Bl = F.tolist(), B.tolist()
    seqs = [stage_order(i, p, m, kind) for i in range(p)]
    endF = [[-1.0] * m for _ in range(p)]
    endB = [[-1.0] * m for _ in range(p)]
    pos = [0] * p
    free = [0.0] * p
    total = 2 * m * p
    done = 0
    while done < total:
        progressed = False
        for i in range(p):
            seq, k, t = seqs[i], pos[i], free[i]
            fi, bi = Fl[i], Bl[i]
            ef, eb = endF[i], endB[i]
            while k < len(seq):
                op, j = seq[k]
                if op == "F":
                    if i > 0:
                        dep = endF[i - 1][j]
                        if dep < 0:
                            break
                        dep += c[j]
                        if dep > t:
                            t = dep
                    t += fi[j]
                    ef[j] = t
                else:
                    if i < p - 1:
                        dep = endB[i + 1][j]
                        if dep < 0:
                            break
                        dep += c[j]
                        if dep > t:
                            t = dep
                    if ef[j] > t:
                        t = ef[j]
                    t += bi[j]
                    eb[j] = t
                k += 1
                done += 1
                progressed = True
            pos[i], free[i] = k, t
        if not progressed:
            raise RuntimeError("makespan estimate deadlocked (bad schedule order)")
    return float(max(free))


def round_trip_bound(F0: np.ndarray, B0: np.ndarray, up: np.ndarray, warmup: int) -> np.ndarray:
    """The round-trip bound (module doc) of n pipelines: ``F0``, ``B0`` [n, m] the stage-0 forward
    and backward times in execution order, ``up`` [n, m] each microbatch's round trip above stage 0,
    ``warmup`` stage 0's warm-up forwards (1F1B: min(P - 1, m); GPipe: m). Pipelines of fewer
    microbatches are padded with zeros at the end (the value is unchanged: a zero-cost forward or
    backward never delays another). A lower bound of the exact makespan: stage 0's chain of ops with
    the round-trip edges is a subgraph of the schedule's dependency graph."""
    n, m = F0.shape
    w = min(int(warmup), m)
    if n <= 4:                                    # scalar recurrence per pipeline (cheaper than numpy steps)
        out = np.empty(n)
        for r in range(n):
            f0, b0, u = F0[r].tolist(), B0[r].tolist(), up[r].tolist()
            eF, t = [0.0] * m, 0.0
            for j in range(w):
                t += f0[j]
                eF[j] = t
            for j in range(m):
                if j + w < m:
                    t += f0[j + w]
                    eF[j + w] = t
                rel = eF[j] + u[j]
                t = (rel if rel > t else t) + b0[j]
            out[r] = t
        return out
    f0, b0, u = (np.ascontiguousarray(x.T) for x in (F0, B0, up))        # [m, n]: one row per step
    eF_v = np.cumsum(f0[:w], axis=0)
    rel = np.empty_like(f0)
    rel[:w] = eF_v + u[:w]
    t_v = eF_v[-1].copy() if w else np.zeros(n)
    for j in range(m):
        if j + w < m:
            t_v += f0[j + w]
            rel[j + w] = t_v + u[j + w]
        np.maximum(t_v, rel[j], out=t_v)
        t_v += b0[j]
    return t_v


def has_bound_regime(kind: str) -> bool:
    """Whether ``kind``'s estimator has the bound regime (``Estimator.bound_regime``: GPipe / 1F1B orders;
    the others are one recurrence for every m)."""
    return estimator_of(kind).bound_regime


def exact_regime(num_stages: int, m: Any) -> Any:
    """Whether ``makespan`` is exact for ``m`` microbatches on ``num_stages`` stages (broadcast)."""
    m = np.asarray(m)
    return (2 * num_stages * m <= EXACT_OPS) | (m <= EXACT_PER_STAGE * num_stages)


def _exact_same(F: np.ndarray, B: np.ndarray, comm: np.ndarray, K: int, m: int, kind: str) -> np.ndarray:
    """Exact makespans of K pipelines of m microbatches each (columns k*m .. k*m + m - 1): one
    [ops, K] array in level order, a level a block of rows."""
    P = F.shape[0]
    stage, is_b, mb, prev, dep, bounds = _level_order(P, m, kind)
    n = len(stage)
    row = np.where(is_b, P * m, 0) + stage * m + mb                  # rows of [F; B] as [(op, stage, mb), K]
    dur = np.concatenate([F, B]).reshape(2 * P, K, m).transpose(0, 2, 1).reshape(2 * P * m, K)[row]
    cross = np.where((dep < n)[:, None], np.ascontiguousarray(comm.reshape(K, m).T)[mb], 0.0)
    end = np.zeros((n + 1, K))
    for a, e in itertools.pairwise(bounds):
        if e > a:
            t = np.take(end, dep[a:e], axis=0)
            t += cross[a:e]
            np.maximum(t, np.take(end, prev[a:e], axis=0), out=t)
            t += dur[a:e]
            end[a:e] = t
    return end[:n].max(axis=0)


def _exact_batch(F: np.ndarray, B: np.ndarray, comm: np.ndarray, sizes: np.ndarray, kind: str) -> np.ndarray:
    """Exact makespans of pipelines k (the next ``sizes[k] >= 1`` columns each), all at once:
    ops are processed level by level (``dynmb.timing.makespan_levels``), each level one vectorised step
    ``end = max(end of the previous op on the stage, end of the dependency + send) + duration``
    over every pipeline (``_exact_same`` for each size shared by enough pipelines, one merged
    pass for the rest); the scalar recurrence when levels would hold few ops."""
    P = F.shape[0]
    offs = np.concatenate([[0], np.cumsum(sizes)])
    out = np.empty(len(sizes))
    uniq, which, count = np.unique(sizes, return_inverse=True, return_counts=True)
    shared = (count >= 4) & (count * P >= 256)                  # enough ops per level to pay for a loop of its own
    for g in np.flatnonzero(shared).tolist():
        ks = np.flatnonzero(which == g)
        cols = (offs[ks][:, None] + np.arange(uniq[g])).ravel()
        out[ks] = _exact_same(F[:, cols], B[:, cols], comm[cols], len(ks), int(uniq[g]), kind)
    rest = np.flatnonzero(~shared[which])
    if not len(rest):
        return out
    sizes, cols = sizes[rest], np.concatenate([np.arange(offs[k], offs[k + 1]) for k in rest])
    F, B, comm = F[:, cols], B[:, cols], comm[cols]
    M = F.shape[1]
    offs = np.concatenate([[0], np.cumsum(sizes)])
    ops, num_levels = 2 * P * sizes, 2 * (int(sizes.max()) + P)
    if ops.sum() < 3 * num_levels:
        out[rest] = [_exact_makespan(F[:, a:e], B[:, a:e], comm[a:e], kind) for a, e in itertools.pairwise(offs)]
        return out
    op_off = np.concatenate([[0], np.cumsum(ops)])
    N = int(op_off[-1])
    level = np.empty(N, np.int16 if num_levels < 32000 else np.int64)
    stage, is_b, col, dep = np.empty(N, np.int64), np.empty(N, bool), np.empty(N, np.int64), np.empty(N, np.int64)
    uniq, which = np.unique(sizes, return_inverse=True)
    for g, m in enumerate(uniq.tolist()):
        lv, st, ib, mb, dp = _levels(P, m, kind)
        ks = np.flatnonzero(which == g)
        base = op_off[ks][:, None]
        at = (base + np.arange(2 * P * m)).ravel()
        level[at], stage[at], is_b[at] = np.tile(lv, len(ks)), np.tile(st, len(ks)), np.tile(ib, len(ks))
        col[at] = (offs[ks][:, None] + mb).ravel()
        dep[at] = np.where(dp >= 0, base + dp, N).ravel()
    prev = np.arange(-1, N - 1)
    prev[(np.repeat(op_off[:-1], P) + np.tile(np.arange(P), len(sizes)) * np.repeat(2 * sizes, P))] = N
    flat_ix = stage * M + col
    dur = np.append(np.where(is_b, B.ravel()[flat_ix], F.ravel()[flat_ix]), 0.0)
    cross = np.append(np.where(dep < N, comm[col], 0.0), 0.0)
    out[rest] = np.maximum.reduceat(sweep_levels(level, prev, dep, cross, dur), op_off[:-1])
    return out


def makespans(F: np.ndarray, B: np.ndarray, comm_s: Any, sizes: Any, kind: str = "1f1b",
              exact: bool | None = None, shares: np.ndarray | None = None, virtual: int = 1) -> np.ndarray:
    """``makespan`` of several pipelines at once: pipeline k runs the next ``sizes[k]`` columns
    of ``F``/``B`` (and of ``comm_s``, scalar or per column) in their order, estimated by the entry of
    ``dynmb.timing.estimators`` that ``kind``'s record names. GPipe / 1F1B: with ``exact=None`` each is exact
    iff ``exact_regime``, else the bound (module doc). ``shares``: ``I / B``, ``W / B`` per stage for the
    estimators with ``split_backward`` (``dynmb.timing.makespan_zb.backward_shares``); ``virtual``: chunks per
    GPU for the estimators of virtual stages (the rows of ``F`` chunks)."""
    M = F.shape[1]
    sizes = np.asarray(sizes, dtype=np.int64)
    comm = np.broadcast_to(np.asarray(comm_s, dtype=np.float64), (M,))
    return estimator_of(kind).makespans(F, B, comm, sizes, exact=exact, shares=shares, virtual=virtual)


def order_makespans(F: np.ndarray, B: np.ndarray, comm: np.ndarray, sizes: np.ndarray, *, order: str,
                    exact: bool | None = None, shares: np.ndarray | None = None, virtual: int = 1) -> np.ndarray:
    """The GPipe / 1F1B estimate (``order``; module doc) of pipelines of ``sizes`` columns each: exact where
    ``exact`` (or ``exact_regime`` with ``exact=None``), else the pipeline and round-trip bounds.
    ``shares`` and ``virtual`` are not read (one stage per GPU, whole backwards)."""
    P = F.shape[0]
    ex = exact_regime(P, sizes) if exact is None else np.full(len(sizes), bool(exact))
    ex &= sizes > 0
    out = np.zeros(len(sizes))
    offs = np.concatenate([[0], np.cumsum(sizes)])
    if np.any(ex):
        cols = np.concatenate([np.arange(a, e) for a, e in zip(offs[:-1][ex], offs[1:][ex])])
        out[ex] = _exact_batch(F[:, cols], B[:, cols], comm[cols], sizes[ex], order)
    rest = np.flatnonzero(~ex & (sizes > 0))
    if len(rest):
        a, e = offs[rest], offs[rest + 1]
        work = np.add.reduceat(F + B, offs[:-1][sizes > 0], axis=1)[:, np.searchsorted(np.flatnonzero(sizes > 0), rest)]
        zero = np.zeros((1, len(rest)))
        fill = np.concatenate([zero, np.cumsum(F[:-1, a] + comm[a], axis=0)])
        drain = np.concatenate([zero, np.cumsum(B[:-1, e - 1] + comm[e - 1], axis=0)])
        out[rest] = np.maximum((work + fill + drain).max(axis=0), _round_trips(F, B, comm, offs, rest, order))
    return out


def _round_trips(F: np.ndarray, B: np.ndarray, comm: np.ndarray, offs: np.ndarray, which: np.ndarray,
                 kind: str) -> np.ndarray:
    """``round_trip_bound`` of the pipelines ``which`` (columns ``offs[k] .. offs[k + 1] - 1``), at once."""
    P = F.shape[0]
    sizes = offs[which + 1] - offs[which]
    m = int(sizes.max())
    up = (F[1:] + B[1:]).sum(axis=0) + 2 * (P - 1) * comm
    F0, B0, U = (np.zeros((len(which), m)) for _ in range(3))
    for r, (a, k) in enumerate(zip(offs[which].tolist(), sizes.tolist())):
        F0[r, :k], B0[r, :k], U[r, :k] = F[0, a:a + k], B[0, a:a + k], up[a:a + k]
    return round_trip_bound(F0, B0, U, m if kind == "gpipe" else P - 1)


def embed_terms(embed: tuple[np.ndarray, np.ndarray], comm_s: Any, sizes: Any) -> np.ndarray:
    """What the embedding on the last rank (``PlanSpec.embedding = "last"``, ``dynmb.schedule.embedlast``) adds to
    the ``makespans`` of the same pipelines: per pipeline (the next ``sizes[k]`` columns) the work of its embeds and
    embedding-backwards, ``embed = (F[M], B[M])`` seconds (``dynmb.timing.embedding.embed_seconds``), plus two of
    its longest messages. Why that bounds the step (``dynmb.timing.estimators``, "embedding last"): the embeds are
    merged into the last rank's list where that rank's timeline without them has them done, and sent, by the time
    stage 0 needs them, and the backwards' after their input gradient is there; so a path of the lifted schedule
    runs at most each embed's own seconds longer than the timeline without them, and at its ends at most the first
    embed's message and the last embedding-backward's."""
    sizes = np.asarray(sizes, dtype=np.int64)
    fe, be = (np.asarray(x, dtype=np.float64).reshape(-1) for x in embed)
    out = np.zeros(len(sizes))
    some = np.flatnonzero(sizes > 0)
    if not len(some):
        return out
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])[some]
    comm = np.broadcast_to(np.asarray(comm_s, dtype=np.float64), fe.shape)
    out[some] = np.add.reduceat(fe + be, starts) + 2 * np.maximum.reduceat(comm, starts)
    return out


def makespan(F: np.ndarray, B: np.ndarray, comm_s: Any = 0.0, kind: str = "1f1b",
             exact: bool | None = None, shares: np.ndarray | None = None, virtual: int = 1) -> float:
    """The packers' makespan estimate: the exact recurrence when ``exact`` or, with
    ``exact=None``, when ``exact_regime(P, m)``; else the pipeline bound over the columns
    in their order and the round trips (``virtual``: chunks per GPU of the interleaved estimate)."""
    return float(makespans(F, B, comm_s, [F.shape[1]], kind, exact, shares, virtual)[0])


for _order in ("gpipe", "1f1b"):        # exact below the regime's limit (up to float rounding), a lower bound above
    register_estimator(Estimator(name=_order, makespans=functools.partial(order_makespans, order=_order),
                                 guarantee="exact", tolerance=1e-9, bound_regime=True))
