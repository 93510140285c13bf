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
other, ``dynmb.timing.makespan_levels``' closed form for 1F1B's window, else each op's start under unit costs, the
longest chain before it, swept on plain lists), one vectorised step per level over every pipeline (all sizes in one
loop, ``_merged``; O(m + P) numpy steps: the ops laid out level by level, a size's table beside itself for each of
its pipelines, ``_layout``; the queue never moves an op's end, so the queues run after the sweep on the waits it
left, ``_queues``); the scalar sweep (``_scalar``) for pipelines of few ops;
a lone larger pipeline op by op in its level order (``_single``, the same bits as the level loop); level-swept
pipelines already estimated are read back (``REMEMBERED``, bounded, keyed by every input). Left out: the memory limit (``zb`` runs its extra
warm-up only where it fits: its estimate is optimistic where the limit binds), the list scheduler's candidates
(unsplit backwards, 1F1B and the pumped ones, ``zerobubble.PUMPED``: never slower than the one modelled; the
pumped ones up to 30% faster on a random pipeline, so the tests hold ``TOLERANCE`` without them) and its exact tie rules.
Measured against ``dynmb.timing.simulate`` of the schedules the builders make:
``studies/zerobubble/estimate.py`` (docs/results.md); the tests hold ``TOLERANCE``.

The simulation layer, beside ``dynmb.timing.makespan``; the packers, one layer down, import it.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
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


def _unit_levels(P: int, m: int, win: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(is backward, microbatch, level)`` ``[P, 2m]`` of each stage's windowed order: each op's start under unit
    costs and free sends, the longest chain before it, ``level = max(level of the stage's previous op, level of
    its dependency) + 1`` (a forward's on the stage below, a backward's on the stage above), swept stage by stage
    on plain lists as far as each stage's dependencies are known."""
    seq = [windowed_order(m, k) for k in win]
    lvl_f, lvl_b = [[-1] * m for _ in range(P)], [[-1] * m for _ in range(P)]
    pos, last, done = [0] * P, [-1] * P, 0
    while done < 2 * P * m:
        before = done
        for i in range(P):
            order, k, lv = seq[i], pos[i], last[i]
            up = lvl_f[i - 1] if i else None                  # forwards come from the stage below
            down = lvl_b[i + 1] if i < P - 1 else None        # backwards from the stage above
            own_f, own_b = lvl_f[i], lvl_b[i]
            while k < 2 * m:
                op, j = order[k]
                d = (-1 if up is None else up[j]) if op == "F" else (-1 if down is None else down[j])
                if d < 0 and (up if op == "F" else down) is not None:
                    break                                   # its dependency has no level yet
                lv = (lv if lv > d else d) + 1
                if op == "F":
                    own_f[j] = lv
                else:
                    own_b[j] = lv
                k += 1
            done += k - pos[i]
            pos[i], last[i] = k, lv
        if done == before:
            raise RuntimeError("zero-bubble estimate deadlocked (bad schedule order)")
    is_b = np.array([[op != "F" for op, _ in s] for s in seq])
    mb = np.array([[j for _, j in s] for s in seq])
    level = np.where(is_b, np.take_along_axis(np.array(lvl_b), mb, axis=1),
                     np.take_along_axis(np.array(lvl_f), mb, axis=1))
    return is_b, mb, level


@functools.lru_cache(maxsize=128)
def _level_table(P: int, m: int, win: tuple[int, ...]) -> tuple:
    """``dynmb.timing.makespan_levels.level_order``'s table (stage, is backward, microbatch, previous op, dependency,
    level starts) of the windowed order (``windowed_order``): 1F1B's closed form for ``P - s``, else
    each op's start under unit costs and free sends (``_unit_levels``)."""
    if win == tuple(P - s for s in range(P)):
        return level_order(P, m, "1f1b")
    is_b, mb, lv2 = _unit_levels(P, m, win)                                 # [P, 2m] in stage order
    n = 2 * P * m
    st = np.repeat(np.arange(P), 2 * m)
    ib, jj, lv = is_b.ravel(), mb.ravel(), lv2.ravel()
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


def _layout(P: int, sizes: np.ndarray, win: tuple[int, ...],
            idx: type) -> tuple[list[tuple[np.ndarray, tuple, np.ndarray]], np.ndarray]:
    """Where ``_merged`` puts each op of pipelines ``sizes``: level by level, within a level one size's ops after
    the other's, each op of its table beside itself for every pipeline of that size. Per size ``(pipelines,
    table, places [n + 1, pipelines])`` (the last row ``N``: none) and the level starts (``N`` last)."""
    groups = [(np.flatnonzero(sizes == m), _level_table(P, m, win)) for m in np.unique(sizes).tolist()]
    counts = np.zeros((len(groups), max(len(t[5]) for _, t in groups) - 1), dtype=np.int64)   # ops per level
    for g, (ks, table) in enumerate(groups):
        counts[g, :len(table[5]) - 1] = np.diff(table[5]) * len(ks)
    flat = counts.T.ravel()                                           # level-major, sizes in order
    start = (np.concatenate([[0], np.cumsum(flat)])[:-1]).reshape(counts.shape[1], len(groups)).T
    N, out = int(flat.sum()), []
    for g, (ks, table) in enumerate(groups):
        bounds = np.asarray(table[5])
        lvl = np.repeat(np.arange(len(bounds) - 1), np.diff(bounds))
        row = np.append(start[g, lvl] + (np.arange(len(lvl)) - bounds[lvl]) * len(ks), N)    # first pipeline's
        pos: np.ndarray = row.astype(idx)[:, None] + np.arange(len(ks), dtype=idx)[None, :]
        pos[-1] = N
        out.append((ks, table, pos))
    return out, np.concatenate([start[0], [N]])


def _merged(F: np.ndarray, I: np.ndarray, W: np.ndarray, comm: np.ndarray, sizes: np.ndarray,  # noqa: E741
            win: tuple[int, ...]) -> np.ndarray:
    """The recurrence (module doc) of pipelines of any sizes (one or several) in ONE level loop: their ops laid out
    level by level (``_layout``), each level one vectorised step over the ops of every pipeline; the W queue per
    (pipeline, stage) after it (``_queues``). The one vectorised implementation (``_scalar``: the op-by-op sweep)."""
    P, K, width = F.shape[0], len(sizes), F.shape[1]
    idx = np.int32 if 2 * F.size + 1 < 2**31 - 1 else np.int64               # halves the memory traffic
    groups, bounds = _layout(P, sizes, win, idx)
    N = int(bounds[-1])
    nat = np.empty((5, N), idx)          # per op as laid out by size: previous op, dependency, F / I, W, send
    perm, cools, at = np.empty(N, idx), [], 0
    offs = np.concatenate([[0], np.cumsum(sizes)]).astype(idx)
    for ks, table, pos in groups:
        n = len(table[0])
        block = nat[:, at:at + n * len(ks)].reshape(5, n, len(ks))
        perm[pos[:-1].ravel()] = np.arange(at, at + n * len(ks), dtype=idx)
        cools.append(_columns(P, width, win, ks, table, pos, offs[ks], block))
        at += n * len(ks)
    prev, dep, fi, w_at, send = np.take(nat, perm, axis=1)
    dur = np.take(np.concatenate([F.ravel(), I.ravel()]), fi)
    tail = np.take(np.append(W.ravel(), 0.0), w_at)
    cross = np.take(np.append(comm, 0.0), send)
    seen, fin = np.zeros(N + 1), np.zeros(N + 1)
    take_seen, take_fin, maximum, add = seen.take, fin.take, np.maximum, np.add     # no wrapper per level
    for a, e in itertools.pairwise(bounds.tolist()):
        end = take_seen(dep[a:e])
        end += cross[a:e]
        maximum(end, take_fin(prev[a:e]), out=end)
        add(end, dur[a:e], out=seen[a:e])
        add(seen[a:e], tail[a:e], out=fin[a:e])
    place, qid, cell = (np.concatenate(x) for x in zip(*cools))
    wait = np.maximum(np.take(seen, dep[place]) + cross[place] - np.take(fin, prev[place]), 0.0)   # as the loop saw
    q = _queues(K * P, place, qid, np.take(W, cell), wait)
    out = np.empty(K)
    for ks, table, pos in groups:
        lasts = pos[_last_ops(P, len(table[0]) // (2 * P), win)]             # [P, pipelines]
        out[ks] = np.maximum(fin[pos[:-1]].max(axis=0), (fin[lasts] + q.reshape(K, P)[ks].T).max(axis=0))
    return out


def _columns(P: int, width: int, win: tuple[int, ...], ks: np.ndarray, table: tuple, pos: np.ndarray,
             offs: np.ndarray, block: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``_merged``'s inputs of the pipelines ``ks`` of one size (first columns ``offs``; its level ``table``, places
    ``pos``) into ``block`` ``[5, n, pipelines]``: previous op and dependency (places; ``N`` none), F / I (flat
    index into F then I), the W right after (a steady-state backward; else past W's end: none) and the send (past
    the sends: none). Returns its queued-W backwards (a cool-down one, or one ZB-H1 defers): places, queue
    (pipeline, stage), flat (stage, column)."""
    st, ib, mb, pv, dp_, _ = table
    m = len(st) // (2 * P)
    cool = ib & ((mb >= np.maximum(m - np.asarray(win)[st], 0)) | (mb < st))
    cell = (st * width + mb).astype(block.dtype)
    np.take(pos, pv, axis=0, out=block[0])
    np.take(pos, dp_, axis=0, out=block[1])
    np.add((cell + ib * (P * width))[:, None], offs[None, :], out=block[2])
    np.add(cell[:, None], offs[None, :], out=block[3])
    block[3][~(ib & ~cool)] = P * width
    np.add(mb.astype(block.dtype)[:, None], offs[None, :], out=block[4])
    block[4][dp_ == len(st)] = width
    rows = np.flatnonzero(cool)
    return (pos[rows].ravel(), (ks[None, :] * P + st[rows][:, None]).ravel(),
            (cell[rows][:, None] + offs[None, :]).ravel())


def _queues(n_queues: int, at: np.ndarray, qid: np.ndarray, w_q: np.ndarray, wait: np.ndarray) -> np.ndarray:
    """Each (pipeline, stage)'s W queue at its end, of ``_merged``'s swept ops: the queued-W backwards at places
    ``at`` (queue ``qid``, W seconds ``w_q``, the wait before it ``wait``) in each queue's order, all queues a step
    at a time: a wait runs what it can of the queue, then the backward's W joins it (the queue never moves an op's
    end: the waits are the sweep's)."""
    o = np.argsort(qid.astype(np.int64) * (int(at.max(initial=0)) + 1) + at, kind="stable")   # per queue, in order
    qid, wait, w_q = qid[o], wait[o], w_q[o]
    first = np.flatnonzero(np.r_[True, qid[1:] != qid[:-1]])
    count = np.diff(np.r_[first, len(qid)])
    q = np.zeros(n_queues)
    for t in range(int(count.max(initial=0))):
        i = first[count > t] + t
        qi = qid[i]
        q[qi] -= np.minimum(q[qi], wait[i])
        q[qi] += w_q[i]
    return q


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
def _single_table(P: int, m: int, win: tuple[int, ...]) -> tuple[list, list]:
    """``_level_table``'s ops of one pipeline as plain lists for ``_single``, per op in level order: its dependency
    and previous op (``n``: none), its duration's place in F then I (flat ``[P, m]`` each), its W's right after it
    (a steady-state backward; else ``P m``, a zero), its send (``m``, a zero, without a dependency), and for a
    queued-W backward (``_merged``'s) its stage and its W's place (else -1, 0); and each stage's last op."""
    st, ib, mb, pv, dp_, _ = _level_table(P, m, win)
    n = len(st)
    cool = ib & ((mb >= np.maximum(m - np.asarray(win)[st], 0)) | (mb < st))
    cell = st * m + mb
    ops = zip(dp_.tolist(), pv.tolist(), (cell + ib * (P * m)).tolist(), np.where(ib & ~cool, cell, P * m).tolist(),
              np.where(dp_ < n, mb, m).tolist(), np.where(cool, st, -1).tolist(), np.where(cool, cell, 0).tolist())
    return list(ops), _last_ops(P, m, win).tolist()


def _single(F: np.ndarray, I: np.ndarray, W: np.ndarray, comm: np.ndarray,  # noqa: E741
            win: tuple[int, ...]) -> float:
    """``_merged`` of one pipeline, op by op in its level order (each op's inputs are ops of earlier levels): the
    same operations on the same values in the same order per stage, so the same bits; no numpy call per level."""
    P, m = F.shape
    ops, last = _single_table(P, m, win)
    n = len(ops)
    dur = np.concatenate([F.ravel(), I.ravel()]).tolist()
    w = W.ravel().tolist()
    tail, send = w + [0.0], comm.tolist() + [0.0]
    seen, fin, q = [0.0] * (n + 1), [0.0] * (n + 1), [0.0] * P
    for x, (d, p, di, wi, sj, qs, wq) in enumerate(ops):
        ready = seen[d] + send[sj]
        free = fin[p]
        end = ready if ready >= free else free              # np.maximum: either when equal
        if qs >= 0:                                         # its W queued: it fills the wait before it
            q[qs] -= min(q[qs], max(ready - free, 0.0))
            q[qs] += w[wq]
        end += dur[di]
        seen[x] = end
        fin[x] = end + tail[wi]
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
``I``, ``W``, sends (its columns) and windows; 0: none, the old path). The packers estimate the same pipeline
again and again
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
    cols = np.ascontiguousarray(np.concatenate([F, I, W, comm[None, :]]).T, dtype=np.float64) \
        if REMEMBERED > 0 else None                               # a pipeline's inputs: one contiguous block
    for x, k in enumerate(ks.tolist()):
        a, e = int(offs[k]), int(offs[k + 1])
        key = b""
        if cols is not None:
            digest = hashlib.blake2b(repr((F.shape[0], e - a, win)).encode(), digest_size=20)
            digest.update(cols[a:e].data)
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
