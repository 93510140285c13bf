"""The fast makespan estimate of the zero-bubble kinds ``zb-h1`` and ``zb`` (``estimate_as`` of the same names).

``dynmb.timing.makespan.makespans(F, B, comm_s, sizes, kind)`` comes here for a kind whose record says
``estimate_as="zb-h1"`` or ``"zb"``. The packers only have ``F`` and ``B``; the split backward
is derived from ``B`` by per-stage shares (``split_backward``): ``I / B`` and ``W / B`` as the cost
model predicts them for one row of the batch's token-weighted median length (``backward_shares``; the
packers pass them as ``shares``), else ``dynmb.costmodel.split``'s middle-stage shares
``W = W_SHARE * B``, ``I = (1 + SPLIT_OVERHEAD) * B - W`` (a split backward costs a few % more).

What the list scheduler (``dynmb.schedule.zerobubble``) does with ``k_s`` microbatches in flight on
stage s (ZB-H1: 1F1B's ``P - s``; ``zb`` adds up to ``max(ZB_ALPHAS) (P - s - 1)`` more where memory
allows and it pays; ``ESTIMATES``): a ``W`` counts as in flight until it ran, so in the steady state the forward after
``I_j`` is window-blocked and runs ``W_j`` first: ``I_j W_j`` back to back, the input gradient sent
at the end of ``I_j``, before ``W_j``. After a stage's last forward (its cool-down) nothing forces
a ``W``: they queue and fill the waits for the gradients from above; the rest run at the end. Stage s
also defers ``s`` weight gradients (ZB-H1's ``w_defer``, Qi et al. Table 2: worker s holds ``s``
``M_W`` more): its first ``s`` backwards are ``I`` only, their ``W`` queued like the cool-down's.

The estimate is that schedule's makespan (``zb_recurrence``; for ``zb`` with its largest window),
one regime for every m: each stage's
order of forwards and backwards for window ``k_s`` (``dynmb.schedule.order.windowed_order``) swept
with ``end = max(stage free, input + send) + duration``, where a steady-state backward is ``I``
then ``W`` (its dependants read the end of ``I``) and a cool-down backward (microbatch
``j >= m - k_s``) only ``I``, its ``W`` joining the stage's queue ``q``: a wait of ``g`` before a
cool-down ``I`` runs ``min(q, g)`` of the queue (fluid: a ``W`` may be cut), and the stage ends
at its last op + ``q``. Evaluated level by level (``_level_table``: ops that cannot depend on each
other, ``dynmb.timing.makespan_levels``' closed form for 1F1B's window, else each op's start under unit costs),
one vectorised step per level over every pipeline (all sizes in one loop, ``_merged``; O(m + P) numpy steps); the scalar
sweep (``_scalar``) for pipelines of few ops;
a lone larger pipeline op by op in its level order (``_single``, the same bits as the level loop); level-swept
pipelines already estimated are read back (``REMEMBERED``, bounded, keyed by every input). Left out: the memory limit (``zb`` runs its extra
warm-up only where it fits: its estimate is optimistic where the limit binds), the list scheduler's candidates
(unsplit backwards, 1F1B: never slower than the one modelled) and its exact tie rules.
Measured against ``dynmb.timing.simulate`` of the schedules the builders make:
``studies/zerobubble/estimate.py`` (docs/results.md); the tests hold ``TOLERANCE``.

The simulation layer, beside ``dynmb.timing.makespan``; the packers, one layer down, import it.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from dynmb.costmodel.split import SPLIT_OVERHEAD, W_SHARE
from dynmb.timing.estimators import Estimator, register_estimator
from dynmb.timing.makespan_levels import level_order
from dynmb.schedule.kinds import get_kind
from dynmb.schedule.order import windowed_order
from dynmb.schedule.zerobubble import ZB_ALPHAS

__all__ = ["ESTIMATES", "RANK_AS", "ranking_kind", "windows", "backward_shares", "split_backward", "zb_makespans", "zb_recurrence", "TOLERANCE", "SCALAR_OPS"]

TOLERANCE = {"zb-h1": 0.15, "zb": 0.25}
"""With the true ``I`` and ``W``, the estimate is within this relative margin of the simulated ``zb-h1``
/ ``zb`` (no memory limit) step on random pipelines (tests/test_makespan_zb.py, tests/test_estimators.py).
Measured on 500 pipelines of tests/test_estimators.py (P 2-8, m 1-24, split overhead 0-6%): zb-h1 -8.6% to
+14.2% (over 10% in 2 of 500, at P 2-3), zb -23.7% to +14.8% (over 10% in 20 of 500; below: where zb's extra
warm-up pays more than the fluid queue credits). zb-h1's low cases are equal microbatches with m <= P, where
the fluid queue lets deferred W fill parts of waits that the list scheduler leaves empty (it runs a W in a
wait only when all of it fits)."""
SCALAR_OPS = 2000
"""Pipelines of one size with at most this many ops in all are swept one by one (``_scalar``)."""


def backward_shares(cost_model: Any, lengths: Any, num_stages: int) -> np.ndarray | None:
    """``[2, P]``: ``I / B`` and ``W / B`` of every stage, from ``cost_model.stage_costs`` at one row of
    the token-weighted median length of ``lengths`` (its attention work that of one sequence); None
    where the model cannot answer (then ``split_backward`` uses ``dynmb.costmodel.split``'s shares)."""
    lens = np.sort(np.asarray(lengths, dtype=np.float64).ravel())
    if not lens.size or not hasattr(cost_model, "stage_costs"):
        return None
    s = float(lens[np.searchsorted(np.cumsum(lens), lens.sum() / 2)])
    try:
        c = cost_model.stage_costs(np.ones(1), np.array([s]), np.array([s * s]), ops=("B", "I", "W"))
        b = np.asarray(c["B"], dtype=np.float64).reshape(num_stages)
        out = np.stack([np.asarray(c[op], dtype=np.float64).reshape(num_stages) for op in ("I", "W")]) / b
    except (ValueError, KeyError, TypeError, ZeroDivisionError, FloatingPointError):
        return None
    return out if np.all(np.isfinite(out)) and np.all(out >= 0) else None


def split_backward(B: np.ndarray, shares: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(I, W)`` of backwards ``B`` ``[P, m]``: by the stages' ``shares`` (``backward_shares``), else by
    the middle stages' shares of ``dynmb.costmodel.split`` (``W = W_SHARE B``, ``I = (1 + overhead) B - W``)."""
    if shares is not None:
        return shares[0][:, None] * B, shares[1][:, None] * B
    W = W_SHARE["middle"] * B
    return (1.0 + SPLIT_OVERHEAD["middle"]) * B - W, W


ESTIMATES = {"zb-h1": 0.0, "zb": max(ZB_ALPHAS)}
"""The zero-bubble estimates (``estimate_as``) and their warm-up: stage s holds ``P - s + alpha (P - s - 1)``
microbatches in flight (``dynmb.schedule.zerobubble``'s rule): ZB-H1's alpha 0, and for ``zb`` the
largest it tries (``ZB_ALPHAS``; the memory limit may keep it lower)."""


RANK_AS = {"zb": "zb-h1", "zb-v": "interleaved"}
"""The packers rank candidates of a kind estimated as a key here with the value's estimate, and use the kind's
own only to choose among the finals (``dynmb.packing.dynamic.rank``) and to report the plan's: ``zb``'s level
tables are built op by op for every microbatch count (ZB-H1's, 1F1B's window, have a closed form), so ranking
dozens of candidates by it cost more than the rest of the packing; ZB-H1's estimate orders them alike. ``zb-v``'s
estimate runs its list scheduler per pipeline (``dynmb.timing.makespan_zbv``): its candidates are ranked by the
interleaved estimate on the same chunks (the packers' estimate of it before it had its own)."""


def ranking_kind(kind: str) -> str:
    """The kind whose estimate the packers rank ``kind``'s candidates with (``RANK_AS``; else ``kind``)."""
    return RANK_AS.get(get_kind(kind).estimate_as, kind)


def windows(num_stages: int, estimate_as: str) -> tuple[int, ...]:
    """Microbatches in flight per stage under the zero-bubble estimate ``estimate_as`` (``ESTIMATES``)."""
    alpha = ESTIMATES[estimate_as]
    return tuple(num_stages - s + int(round(alpha * (num_stages - s - 1))) for s in range(num_stages))


def _scalar(F: np.ndarray, I: np.ndarray, W: np.ndarray, comm: np.ndarray, win: tuple[int, ...]) -> float:  # noqa: E741
    """The recurrence (module doc) of one pipeline with ``win[s]`` in flight on stage s, swept stage by stage."""
    p, m = F.shape
    c, Fl, Il, Wl = comm.tolist(), F.tolist(), I.tolist(), W.tolist()
    seqs = [windowed_order(m, win[i]) for i in range(p)]
    cool = [max(m - win[i], 0) for i in range(p)]              # backwards j >= this: after the last forward
    endF = [[-1.0] * m for _ in range(p)]
    endI = [[-1.0] * m for _ in range(p)]
    pos, free, q = [0] * p, [0.0] * p, [0.0] * p
    done, total = 0, 2 * p * m
    while done < total:
        progressed = False
        for i in range(p):
            seq, k, t = seqs[i], pos[i], free[i]
            while k < len(seq):
                op, j = seq[k]
                if op == "F":
                    dep = 0.0
                    if i > 0:
                        if endF[i - 1][j] < 0:
                            break
                        dep = endF[i - 1][j] + c[j]
                    t = max(t, dep) + Fl[i][j]
                    endF[i][j] = t
                else:
                    dep = endF[i][j]
                    if i < p - 1:
                        if endI[i + 1][j] < 0:
                            break
                        dep = max(dep, endI[i + 1][j] + c[j])
                    if j >= cool[i] or j < i:                  # cool-down, or one of the W ZB-H1 defers
                        q[i] -= min(q[i], max(dep - t, 0.0))
                        t = max(t, dep) + Il[i][j]
                        endI[i][j] = t
                        q[i] += Wl[i][j]
                    else:
                        t = max(t, dep) + Il[i][j]
                        endI[i][j] = t
                        t += Wl[i][j]
                k += 1
                done += 1
                progressed = True
            pos[i], free[i] = k, t
        if not progressed:
            raise RuntimeError("zero-bubble estimate deadlocked (bad schedule order)")
    return float(max(f + x for f, x in zip(free, q)))


@functools.lru_cache(maxsize=128)
def _level_table(P: int, m: int, win: tuple[int, ...]) -> tuple:
    """``dynmb.timing.makespan_levels.level_order``'s table (stage, is backward, microbatch, previous op, dependency,
    level starts) of the windowed order (``windowed_order``): 1F1B's closed form for ``P - s``, else
    each op's start under unit costs and free sends, found level by level over all stages at once."""
    if win == tuple(P - s for s in range(P)):
        return level_order(P, m, "1f1b")
    seq = [windowed_order(m, k) for k in win]
    is_b = np.array([[op != "F" for op, _ in s] for s in seq])            # [P, 2m] in stage order
    mb = np.array([[j for _, j in s] for s in seq])
    lvl = np.full((2, P, m), np.iinfo(np.int64).max)                       # level of F / B per (stage, mb)
    ptr, rows, level = np.zeros(P, dtype=np.int64), np.arange(P), 0
    up, down = np.arange(P) - 1, np.arange(P) + 1
    while (live := ptr < 2 * m).any():
        at = np.minimum(ptr, 2 * m - 1)
        b, j = is_b[rows, at], mb[rows, at]
        dep = np.where(b, np.where(down < P, lvl[1, np.minimum(down, P - 1), j], -1),
                       np.where(up >= 0, lvl[0, np.maximum(up, 0), j], -1))
        go = live & (dep < level)
        lvl[b[go].astype(np.int64), rows[go], j[go]] = level
        ptr += go
        level += 1
    n = 2 * P * m
    st = np.repeat(np.arange(P), 2 * m)
    ib, jj = is_b.ravel(), mb.ravel()
    lv = lvl[ib.astype(np.int64), st, jj]
    slot = np.empty((2, P, m), dtype=np.int64)                             # natural id of each (op, stage, mb)
    slot[ib.astype(np.int64), st, jj] = np.arange(n)
    dep = np.where(ib, np.where(st < P - 1, slot[1, np.minimum(st + 1, P - 1), jj], -1),
                   np.where(st > 0, slot[0, np.maximum(st - 1, 0), jj], -1))
    order = np.argsort(lv, kind="stable")
    inv = np.empty(n + 1, dtype=np.int64)
    inv[order], inv[n] = np.arange(n), n
    prev = np.arange(-1, n - 1)
    prev[np.arange(P) * 2 * m] = n
    out = (st[order], ib[order], jj[order], inv[prev[order]], inv[np.where(dep >= 0, dep, n)[order]])
    for x in out:
        x.setflags(write=False)
    return (*out, np.searchsorted(lv[order], np.arange(int(lv.max()) + 2)).tolist())


def _merged(F: np.ndarray, I: np.ndarray, W: np.ndarray, comm: np.ndarray, sizes: np.ndarray,  # noqa: E741
            win: tuple[int, ...]) -> np.ndarray:
    """The recurrence (module doc) of pipelines of any sizes (one or several) in ONE level loop: their level
    tables side by side, sorted by level, each level one vectorised step over the ops of every pipeline;
    the queue per (pipeline, stage). The one vectorised implementation (``_scalar``: the op-by-op sweep)."""
    P, K = F.shape[0], len(sizes)
    offs = np.concatenate([[0], np.cumsum(sizes)])
    op_off = np.concatenate([[0], np.cumsum(2 * P * sizes)])
    N = int(op_off[-1])
    idx = np.int32 if N < 2**31 - 1 and F.size < 2**31 - 1 else np.int64     # halves the memory traffic
    level, stage, col, prev, dep, pipe = (np.empty(N, idx) for _ in range(6))
    is_b = np.empty(N, bool)
    last = np.empty(K * P, dtype=np.int64)                   # each (pipeline, stage)'s last op, unsorted
    for m in np.unique(sizes).tolist():
        st, ib, mb, pv, dp_, bounds = _level_table(P, m, win)
        n, ks = len(st), np.flatnonzero(sizes == m)
        last[(ks[:, None] * P + np.arange(P)).ravel()] = (op_off[ks][:, None] + _last_ops(P, m, win)).ravel()
        at = (op_off[ks][:, None] + np.arange(n)).ravel()
        base = np.repeat(op_off[ks], n)
        level[at] = np.tile(np.repeat(np.arange(len(bounds) - 1), np.diff(bounds)), len(ks))
        stage[at], is_b[at], pipe[at] = np.tile(st, len(ks)), np.tile(ib, len(ks)), np.repeat(ks, n)
        col[at] = (offs[ks][:, None] + mb).ravel()
        prev[at] = np.where(np.tile(pv, len(ks)) < n, base + np.tile(pv, len(ks)), N)
        dep[at] = np.where(np.tile(dp_, len(ks)) < n, base + np.tile(dp_, len(ks)), N)
    order = np.argsort(level.astype(np.int16) if level.max() < 2**15 else level, kind="stable")   # radix sort
    pos = np.empty(N + 1, dtype=idx)
    pos[order], pos[N] = np.arange(N), N
    stage, is_b, col, pipe = stage[order], is_b[order], col[order], pipe[order]
    prev, dep = pos[prev[order]], pos[dep[order]]
    bounds = np.searchsorted(level[order], np.arange(int(level.max()) + 2))
    cell = stage * F.shape[1] + col                           # flat (stage, column) of each op
    dur = np.where(is_b, np.take(I, cell), np.take(F, cell))
    cool = is_b & ((col - offs[pipe] >= np.maximum(sizes[pipe] - np.asarray(win)[stage], 0))
                   | (col - offs[pipe] < stage))                 # or one of the W ZB-H1 defers
    w_op = np.where(is_b, np.take(W, cell), 0.0)
    tail = np.where(cool, 0.0, w_op)
    cross = np.where(dep < N, np.take(comm, col), 0.0)
    qid = pipe * P + stage
    seen, fin, q = np.zeros(N + 1), np.zeros(N + 1), np.zeros(K * P)
    cum = np.concatenate([[0], np.cumsum(cool)])
    cools = (cum[bounds[1:]] > cum[bounds[:-1]]).tolist()    # levels with cool-down backwards
    for a, e, has_cool in zip(bounds[:-1].tolist(), bounds[1:].tolist(), cools):
        if e <= a:
            continue
        ready = seen[dep[a:e]]
        ready += cross[a:e]
        free = fin[prev[a:e]]
        end = np.maximum(ready, free)
        if has_cool:
            c = np.flatnonzero(cool[a:e])
            qi = qid[a + c]
            q[qi] -= np.minimum(q[qi], np.maximum(ready[c] - free[c], 0.0))
            q[qi] += w_op[a + c]
        end += dur[a:e]
        seen[a:e] = end
        end += tail[a:e]
        fin[a:e] = end
    out = np.maximum.reduceat(fin[pos[:N]], op_off[:-1])       # each pipeline's ops lie together unsorted
    return np.maximum(out, (fin[pos[last]] + q).reshape(K, P).max(axis=1))


@functools.lru_cache(maxsize=128)
def _last_ops(P: int, m: int, win: tuple[int, ...]) -> np.ndarray:
    """Each stage's last op, as a position in ``_level_table``'s level order (which keeps a stage's order)."""
    stage = _level_table(P, m, win)[0]
    last = np.zeros(P, dtype=np.int64)
    np.maximum.at(last, stage, np.arange(len(stage)))
    last.setflags(write=False)
    return last


SINGLE_SWEEP = True
"""``zb_recurrence`` sweeps a lone pipeline too large for ``_scalar`` op by op in its level order (``_single``: the
same arithmetic as ``_merged``, bit-equal, without a numpy call per level); False: ``_merged`` (the old path)."""


@functools.lru_cache(maxsize=128)
def _single_table(P: int, m: int, win: tuple[int, ...]) -> tuple[list, ...]:
    """``_level_table``'s ops of one pipeline as plain lists for ``_single``: stage, is backward, microbatch,
    previous op and dependency (``n``: none), is a queued-W backward (``_merged``'s ``cool``), and each stage's
    last op."""
    st, ib, mb, pv, dp_, _ = _level_table(P, m, win)
    cool = ib & ((mb >= np.maximum(m - np.asarray(win)[st], 0)) | (mb < st))
    return (st.tolist(), ib.tolist(), mb.tolist(), pv.tolist(), dp_.tolist(), cool.tolist(),
            _last_ops(P, m, win).tolist())


def _single(F: np.ndarray, I: np.ndarray, W: np.ndarray, comm: np.ndarray,  # noqa: E741
            win: tuple[int, ...]) -> float:
    """``_merged`` of one pipeline, op by op in its level order (each op's inputs are ops of earlier levels): the
    same operations on the same values in the same order per stage, so the same bits; no numpy call per level."""
    P, m = F.shape
    st, ib, mb, pv, dp_, cool, last = _single_table(P, m, win)
    n = len(st)
    Fl, Il, Wl, cl = F.tolist(), I.tolist(), W.tolist(), comm.tolist()
    seen, fin, q = [0.0] * (n + 1), [0.0] * (n + 1), [0.0] * P
    for x in range(n):
        s, j, d = st[x], mb[x], dp_[x]
        ready = seen[d] + cl[j] if d < n else 0.0
        free = fin[pv[x]]
        end = ready if ready >= free else free              # np.maximum: either when equal
        if ib[x]:
            if cool[x]:
                q[s] -= min(q[s], max(ready - free, 0.0))
                q[s] += Wl[s][j]
                end += Il[s][j]
                seen[x] = fin[x] = end + 0.0
                continue
            end += Il[s][j]
            seen[x] = end
            fin[x] = end + Wl[s][j]
        else:
            end += Fl[s][j]
            seen[x] = end
            fin[x] = end + 0.0
    return float(max(max(fin[:n]), max(fin[last[s]] + q[s] for s in range(P))))


def zb_recurrence(F: np.ndarray, B: np.ndarray, comm: np.ndarray, sizes: np.ndarray,
                  shares: np.ndarray | None = None, estimate_as: str = "zb-h1") -> np.ndarray:
    """The recurrence (module doc) of pipelines k (the next ``sizes[k] >= 1`` columns each): the
    scalar sweep for sizes of few ops, else level by level, one loop for all sizes (``_merged``)."""
    I, W = split_backward(B, shares)                           # noqa: E741
    P = F.shape[0]
    win = windows(P, estimate_as)
    offs = np.concatenate([[0], np.cumsum(sizes)])
    out = np.empty(len(sizes))
    rest = []
    for m in np.unique(sizes).tolist():
        ks = np.flatnonzero(sizes == m)
        if 2 * P * m * len(ks) <= SCALAR_OPS:
            for k in ks.tolist():
                a, e = offs[k], offs[k + 1]
                out[k] = _scalar(F[:, a:e], I[:, a:e], W[:, a:e], comm[a:e], win)
        else:
            rest.append(ks)
    if rest:
        ks = np.sort(np.concatenate(rest))
        out[ks] = _level_swept(F, I, W, comm, offs, ks, win)
    return out


REMEMBERED = 4096
"""Level-swept pipelines whose makespans ``_level_swept`` remembers (keyed by a digest of the pipeline's ``F``,
``I``, ``W``, sends and windows; 0: none, the old path). The packers estimate the same pipeline again and again
within one plan (``dynamic``'s ranking and final choice, ``lockstep``'s candidates per kind); a pipeline's value
does not depend on the others swept with it (``_merged`` of several gives each one's bits)."""
_swept: OrderedDict[bytes, float] = OrderedDict()
_swept_lock = threading.Lock()


def _level_swept(F: np.ndarray, I: np.ndarray, W: np.ndarray, comm: np.ndarray, offs: np.ndarray,  # noqa: E741
                 ks: np.ndarray, win: tuple[int, ...]) -> np.ndarray:
    """``_merged``'s makespan of pipelines ``ks`` (columns ``offs[k]:offs[k + 1]``), the ones remembered
    (``REMEMBERED``) read back; a lone pipeline left swept by ``_single`` (``SINGLE_SWEEP``)."""
    out, keys = np.empty(len(ks)), []
    todo = []
    for x, k in enumerate(ks.tolist()):
        a, e = int(offs[k]), int(offs[k + 1])
        key = b""
        if REMEMBERED > 0:
            digest = hashlib.blake2b(repr((F.shape[0], e - a, win)).encode(), digest_size=20)
            for part in (F[:, a:e], I[:, a:e], W[:, a:e], comm[a:e]):
                digest.update(np.ascontiguousarray(part, dtype=np.float64).tobytes())
            key = digest.digest()
            with _swept_lock:
                known = _swept.get(key)
                if known is not None:
                    _swept.move_to_end(key)
            if known is not None:
                out[x] = known
                continue
        todo.append(x)
        keys.append(key)
    if len(todo) == 1 and SINGLE_SWEEP:
        k = int(ks[todo[0]])
        a, e = offs[k], offs[k + 1]
        out[todo[0]] = _single(F[:, a:e], I[:, a:e], W[:, a:e], comm[a:e], win)
    elif todo:
        cols = np.concatenate([np.arange(offs[k], offs[k + 1]) for k in ks[todo].tolist()])
        out[todo] = _merged(F[:, cols], I[:, cols], W[:, cols], comm[cols], np.diff(offs)[ks[todo]], win)
    if REMEMBERED > 0:
        with _swept_lock:
            for x, key in zip(todo, keys):
                _swept[key] = float(out[x])
                _swept.move_to_end(key)
            while len(_swept) > REMEMBERED:
                _swept.popitem(last=False)
    return out


def zb_makespans(F: np.ndarray, B: np.ndarray, comm: Any, sizes: np.ndarray, shares: np.ndarray | None = None,
                 estimate_as: str = "zb-h1") -> np.ndarray:
    """The recurrence of each pipeline (``sizes[k] >= 0``; 0 for an empty one), ``shares`` as
    ``split_backward`` takes them."""
    out = np.zeros(len(sizes))
    live = np.flatnonzero(sizes > 0)
    if len(live):
        offs = np.concatenate([[0], np.cumsum(sizes)])
        cols = np.concatenate([np.arange(offs[k], offs[k + 1]) for k in live.tolist()])
        out[live] = zb_recurrence(F[:, cols], B[:, cols], comm[cols], sizes[live], shares, estimate_as)
    return out


def _estimate(F: np.ndarray, B: np.ndarray, comm: np.ndarray, sizes: np.ndarray, *, estimate_as: str,
              exact: bool | None = None, shares: np.ndarray | None = None, virtual: int = 1) -> np.ndarray:
    """The registry's callable (``dynmb.timing.estimators``): ``zb_makespans`` (``exact``, ``virtual`` not read)."""
    return zb_makespans(F, B, comm, sizes, shares, estimate_as)


for _name in ESTIMATES:        # approximate: the fluid W queue and the largest window (module doc, TOLERANCE)
    register_estimator(Estimator(name=_name, makespans=functools.partial(_estimate, estimate_as=_name),
                                 guarantee="approx", tolerance=TOLERANCE[_name], split_backward=True))
