"""Helpers shared by the packers (numpy): row packing, microbatch groups, shape rounding,
the makespan estimate.

- ``next_fit_rows(lengths, cap)``: next-fit over lengths in the given (sorted) order into
  rows of at most ``cap`` tokens; one ``bisect`` per row over the prefix sums, so it costs
  O(rows log n) Python steps, not O(n).
- ``bfd_rows(lengths, cap)``: best-fit-decreasing (the Megatron-style packing baseline):
  each item, longest first, goes into the open row with the least room that still holds
  it (ties: the lowest row id), else opens a new row. O(n log rows) with a sorted list of
  (room, row) pairs.
- ``round_up(x, multiple)`` / ``round_down(x, multiple)``: shapes as multiples of ``round_to``.
- Microbatch groups: a ``Group`` is one microbatch (items, local rows, padded_len, rows);
  ``Flat`` is a whole plan as five arrays (``groups_to_flat`` / ``flat_to_groups``).
  ``fixed_groups`` (fixed rows per microbatch), ``packed_flat`` (``bfd_rows`` rows of
  ``pack_len``, a fixed number of rows per microbatch), ``token_budget_groups`` (fairseq's
  ``batch_by_size``), ``split_group`` and ``assign_replicas`` (data parallelism).
- Splits of rows sorted longest first into contiguous microbatches (cut points):
  ``greedy_cuts`` / ``greedy_cuts_from_short_end`` (each microbatch takes the most rows its
  start allows, by pointer doubling) and ``polish_cuts`` (a boundary-shift DP).
- ``makespan(F, B, comm_s, kind)``: THE makespan estimate of every packer, for per-stage,
  per-microbatch costs ``F[P, m]``, ``B[P, m]`` and a per-microbatch send time between
  neighbouring stages; ``makespans`` gives it for many pipelines at once. Two regimes:

  * exact (equal to ``dynmb.simulate``'s): the makespan of a GPipe or 1F1B schedule where
    every op starts when its stage is free and its input has arrived. 1F1B order on stage i:
    ``w = min(P-1-i, m)`` warm-up forwards, then F/B pairs, then the remaining backwards
    (torch's ``Schedule1F1B``). Used when ``exact_regime``: 2 * P * m <= ``EXACT_OPS`` or
    m <= ``EXACT_PER_STAGE`` * P. Evaluated level by level (``_levels``: ops that cannot
    depend on each other), one vectorised step per level over every pipeline of the batch
    (O(m + P) numpy steps); ``_exact_makespan``, a sweep over stages that advances each as
    far as its dependencies allow, when the levels would hold few ops.
  * bound (``pipeline_bound``): the busiest stage's work plus the fill of the first
    microbatch's forward up to that stage and the drain of the last one's backward
    (relative error O(P / m) for microbatches of similar cost in order); used for more
    microbatches, and by ``dynmb.packing.dynamic`` to score many splits from per-length sums.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
from typing import Any, Callable

import numpy as np

from dynmb.schedule.kinds import get_kind
from dynmb.schedule.order import stage_order

__all__ = ["next_fit_rows", "bfd_rows", "round_up", "round_down", "pipeline_bound", "makespan", "makespans",
           "exact_regime", "stage_order", "EXACT_OPS", "EXACT_PER_STAGE", "Flat", "Group", "groups_to_flat",
           "flat_to_groups", "fixed_groups", "packed_flat", "token_budget_groups", "split_group", "assign_replicas",
           "greedy_cuts", "greedy_cuts_from_short_end", "polish_cuts"]

EXACT_OPS = 6000
"""Up to this many ops (2 * P * m) ``makespan`` is exact."""
EXACT_PER_STAGE = 16
"""... and also up to this many microbatches per stage: with few microbatches per stage the
bound misses 1F1B's round trips (microbatch j + P cannot start before j's backward is back
on stage 0), up to 4x low at P = 64 with heavy-tailed lengths."""

Flat = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""Microbatches in execution order: (item positions grouped by microbatch, local row id per
item, items per microbatch, padded_len per microbatch, rows per microbatch)."""
Group = tuple[np.ndarray, np.ndarray, int, int]
"""One microbatch: (item positions, local row id per item, padded_len, rows)."""


def round_up(x: Any, multiple: int) -> Any:
    """``x`` rounded up to a multiple of ``multiple`` (ints or int arrays)."""
    return -(-x // multiple) * multiple


def round_down(x: Any, multiple: int) -> Any:
    """``x`` rounded down to a multiple of ``multiple`` (ints or int arrays)."""
    return x // multiple * multiple


def next_fit_rows(lengths: np.ndarray, cap: int) -> np.ndarray:
    """Row id per item (items in the given order, each <= cap), next-fit into rows of ``cap``."""
    n = len(lengths)
    cum = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    row = np.empty(n, dtype=np.int64)
    a, r = 0, 0
    while a < n:
        e = bisect.bisect_right(cum, cum[a] + cap, lo=a + 1) - 1
        e = max(e, a + 1)
        row[a:e] = r
        a, r = e, r + 1
    return row


def bfd_rows(lengths: np.ndarray, cap: int) -> np.ndarray:
    """Row id per item (each <= cap): best-fit-decreasing into rows of ``cap`` tokens.

    Items longest first (ties: lower index first); each goes into the open row with the
    least room that still holds it (ties: the lowest row id), else into a new row. Rows
    are numbered in the order they are opened."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    row = np.empty(len(lengths), dtype=np.int64)
    open_rows: list[tuple[int, int]] = []     # sorted (room left, row id)
    num_rows = 0
    for i in order.tolist():
        size = int(lengths[i])
        k = bisect.bisect_left(open_rows, (size, -1))
        if k < len(open_rows):
            room, r = open_rows.pop(k)
            room -= size
        else:
            r, room = num_rows, cap - size
            num_rows += 1
        row[i] = r
        if room > 0:
            bisect.insort(open_rows, (room, r))
    return row


def fixed_groups(positions: np.ndarray, lens: np.ndarray, rows_per_mb: int, round_to: int) -> list[Group]:
    """``rows_per_mb`` consecutive ``positions`` per microbatch, padded to the longest (rounded up)."""
    starts = np.arange(0, len(positions), rows_per_mb)
    if not len(starts):
        return []
    longest = round_up(np.maximum.reduceat(lens[positions], starts), round_to).tolist()
    sizes = np.minimum(rows_per_mb, len(positions) - starts).tolist()
    local = {z: np.arange(z) for z in set(sizes)}           # shared by the groups: read-only
    for x in local.values():
        x.setflags(write=False)
    return [(positions[a:a + z], local[z], s, z) for a, s, z in zip(starts.tolist(), longest, sizes)]


def packed_flat(lens: np.ndarray, pack_len: int, rows_per_mb: int) -> Flat:
    """Rows of ``pack_len`` filled best-fit-decreasing, ``rows_per_mb`` consecutive rows per microbatch."""
    row = bfd_rows(lens, pack_len)
    num_rows = int(row.max()) + 1
    mb_of_item = row // rows_per_mb
    items = np.argsort(mb_of_item, kind="stable")
    num_mb = int(mb_of_item.max()) + 1
    rows = np.minimum(rows_per_mb, num_rows - np.arange(num_mb) * rows_per_mb)
    local_row = row[items] - mb_of_item[items] * rows_per_mb
    return (items, local_row, np.bincount(mb_of_item, minlength=num_mb), np.full(num_mb, pack_len, np.int64), rows)


def token_budget_groups(lens: np.ndarray, max_tokens: int, round_to: int) -> list[Group]:
    """fairseq ``batch_by_size``: length-ascending, grow while rows x padded_len <= max_tokens."""
    pos = np.argsort(lens, kind="stable")
    padded = round_up(lens[pos], round_to).tolist()
    groups, a = [], 0
    for e in range(1, len(padded) + 1):
        if e == len(padded) or (e + 1 - a) * padded[e] > max_tokens:
            groups.append((pos[a:e], np.arange(e - a), padded[e - 1], e - a))
            a = e
    return groups


def split_group(g: Group) -> list[Group]:
    """Halve a microbatch by rows, or a one-row packed microbatch by documents."""
    items, rows, plen, b = g
    if b >= 2:
        h = b // 2
        lo = rows < h
        return [(items[lo], rows[lo], plen, h), (items[~lo], rows[~lo] - h, plen, b - h)]
    if len(items) >= 2:                      # a packed row: split its documents
        h = len(items) // 2
        return [(items[:h], np.zeros(h, np.int64), plen, 1), (items[h:], np.zeros(len(items) - h, np.int64), plen, 1)]
    return [g]


def groups_to_flat(groups: list[Group]) -> Flat:
    """Groups -> the flat form."""
    return (np.concatenate([g[0] for g in groups]).astype(np.int64),
            np.concatenate([g[1] for g in groups]).astype(np.int64),
            np.array([len(g[0]) for g in groups], dtype=np.int64),
            np.array([g[2] for g in groups], dtype=np.int64), np.array([g[3] for g in groups], dtype=np.int64))


def flat_to_groups(flat: tuple) -> list[Group]:
    items, rows, nseq, plen, batch = flat
    cut = np.cumsum(nseq)[:-1]
    return list(zip(np.split(items, cut), np.split(rows, cut), plen.tolist(), batch.tolist()))


def assign_replicas(busy: np.ndarray, dp: int) -> tuple[list[int], list[int]]:
    """(microbatch order, replica of each in that order): largest ``busy`` first, each to the
    least-loaded replica with room (ties: the lowest id), every replica getting m / dp (m a
    multiple of dp); replica by replica, each keeping the original order. A heap of (load,
    replica) over the replicas with room: O(m log dp)."""
    m = len(busy)
    per = m // dp
    if per < 1:
        raise ValueError(f"{m} microbatches cannot fill {dp} replicas")
    heap = [(0.0, r) for r in range(dp)]
    count = [0] * dp
    replica = np.zeros(m, dtype=np.int64)
    values = np.asarray(busy, dtype=np.float64)
    for j in np.argsort(-values, kind="stable").tolist():
        load, r = heapq.heappop(heap)
        replica[j] = r
        count[r] += 1
        if count[r] < per:
            heapq.heappush(heap, (float(np.float64(load) + values[j]), r))
    order = np.argsort(replica, kind="stable")
    return order.tolist(), replica[order].tolist()


def greedy_cuts(b_cap: np.ndarray) -> np.ndarray:
    """Cut points of the greedy split (from row a take ``b_cap[a] >= 1`` rows), found by
    pointer doubling: the path prefix doubles each round, O(n log m) vectorised work."""
    n = len(b_cap)
    jump = np.append(np.minimum(np.arange(n) + np.maximum(b_cap, 1), n), n)
    path = np.zeros(1, dtype=np.int64)
    while path[-1] < n:
        path = np.concatenate([path, jump[path]])
        jump = jump[jump]
    return np.append(path[path < n], n)


def greedy_cuts_from_short_end(b_cap: np.ndarray) -> np.ndarray:
    """Cut points of the greedy split from the short end: a microbatch ending at row e
    starts at the smallest a with a + b_cap[a] >= e (b_cap of its longest row a); the
    chain of starts from n is followed by pointer doubling like ``greedy_cuts``."""
    n = len(b_cap)
    h = np.minimum.accumulate((np.arange(n) + np.maximum(b_cap, 1))[::-1])[::-1]
    e = np.arange(n + 1)
    back = np.minimum(np.searchsorted(h, e, side="left"), np.maximum(e - 1, 0))   # start of the mb ending at e
    path = np.array([n], dtype=np.int64)
    while path[-1] > 0:
        path = np.concatenate([path, back[path]])
        back = back[back]
    return np.append(path[path > 0], 0)[::-1].copy()


def polish_cuts(cuts: np.ndarray, bottleneck: Callable[[np.ndarray, np.ndarray], np.ndarray], bmax: np.ndarray,
            w: int = 4) -> np.ndarray:
    """Move each inner cut by up to ``w`` rows to minimise the summed bottleneck time
    ``sum_k bottleneck(a_k, a_{k+1})`` (the time of the microbatch of rows [a_k, a_{k+1}),
    broadcast over arrays): a DP over the m cuts with 2w + 1 positions each, O(P m w^2)
    vectorised work."""
    n, m = int(cuts[-1]), len(cuts) - 1
    if m < 2:
        return cuts
    d = np.arange(-w, w + 1)
    pos = np.clip(cuts[:, None] + d[None, :], 0, n)            # [m+1, W] candidate positions
    pos[0], pos[-1] = 0, n
    start = np.minimum(pos[:-1], n - 1)                         # [m, W]
    rows = pos[1:, None, :] - pos[:-1, :, None]                 # [m, W(start), W(end)]
    t = bottleneck(start[..., None], pos[1:, None, :])
    cost = np.where((rows >= 1) & (rows <= bmax[start][..., None]), t, np.inf)
    W = pos.shape[1]
    best = np.full(W, np.inf)
    best[0] = 0.0                                               # cut 0 sits at 0 (first column)
    arg = np.zeros((m, W), dtype=np.int64)
    cols = np.arange(W)
    for k in range(m):
        tot = best[:, None] + cost[k]
        arg[k] = tot.argmin(axis=0)
        best = tot[arg[k], cols]
    j = int(np.argmin(best))
    if not np.isfinite(best[j]):
        return cuts
    out = [n]
    for k in range(m - 1, -1, -1):
        j = int(arg[k, j])
        out.append(int(pos[k, j]))
    out = np.array(out[::-1], dtype=np.int64)
    return out if np.all(np.diff(out) >= 1) else cuts


def _exact_makespan(F: np.ndarray, B: np.ndarray, comm_s: Any = 0.0, kind: str = "1f1b") -> float:
    """Makespan of the schedule ``kind`` (gpipe or 1f1b; others use 1f1b) for costs ``F``, ``B``."""
    p, m = F.shape
    if m == 0:
        return 0.0
    kind = get_kind(kind).estimate_as
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


def pipeline_bound(work: np.ndarray, first_F: np.ndarray, last_B: np.ndarray, comm_s: float = 0.0) -> float:
    """Makespan estimate for m >> P: ``max_i work[i] + fill_i + drain_i``, with ``work[i]``
    stage i's total busy time, fill_i the forwards of the first microbatch (``first_F[P]``)
    on stages 0..i-1 plus their sends, drain_i the backwards of the last one (``last_B[P]``)."""
    fill = np.concatenate([[0.0], np.cumsum(first_F[:-1] + comm_s)])
    drain = np.concatenate([[0.0], np.cumsum(last_B[:-1] + comm_s)])
    return float(np.max(work + fill + drain))


def exact_regime(num_stages: int, m: Any) -> Any:
    """Whether ``makespan`` is exact for ``m`` microbatches on ``num_stages`` stages (broadcast)."""
    m = np.asarray(m)
    return (2 * num_stages * m <= EXACT_OPS) | (m <= EXACT_PER_STAGE * num_stages)


def _levels(P: int, m: int, kind: str) -> tuple[np.ndarray, ...]:
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
def _level_order(P: int, m: int, kind: str) -> tuple:
    """``_levels`` sorted by level: (stage, is backward, microbatch, previous op on the stage,
    dependency; both as positions in that order, n for none), and the start of each level."""
    level, stage, is_b, mb, dep = _levels(P, m, kind)
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
    ops are processed level by level (``_levels``), each level one vectorised step
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
    order = np.argsort(level, kind="stable")
    bounds = np.searchsorted(level[order], np.arange(num_levels + 1)).tolist()
    end = np.zeros(N + 1)
    for a, e in itertools.pairwise(bounds):
        if e > a:
            ids = order[a:e]
            end[ids] = np.maximum(end[prev[ids]], end[dep[ids]] + cross[ids]) + dur[ids]
    out[rest] = np.maximum.reduceat(end[:N], op_off[:-1])
    return out


def makespans(F: np.ndarray, B: np.ndarray, comm_s: Any, sizes: Any, kind: str = "1f1b",
              exact: bool | None = None) -> np.ndarray:
    """``makespan`` of several pipelines at once: pipeline k runs the next ``sizes[k]`` columns
    of ``F``/``B`` (and of ``comm_s``, scalar or per column) in their order. With ``exact=None``
    each is exact iff ``exact_regime``, else ``pipeline_bound`` (mean send time)."""
    P, M = F.shape
    sizes = np.asarray(sizes, dtype=np.int64)
    comm = np.broadcast_to(np.asarray(comm_s, dtype=np.float64), (M,))
    kind = get_kind(kind).estimate_as
    ex = exact_regime(P, sizes) if exact is None else np.full(len(sizes), bool(exact))
    ex &= sizes > 0
    out = np.zeros(len(sizes))
    offs = np.concatenate([[0], np.cumsum(sizes)])
    if np.any(ex):
        cols = np.concatenate([np.arange(a, e) for a, e in zip(offs[:-1][ex], offs[1:][ex])])
        out[ex] = _exact_batch(F[:, cols], B[:, cols], comm[cols], sizes[ex], kind)
    rest = np.flatnonzero(~ex & (sizes > 0))
    if len(rest):
        a, e = offs[rest], offs[rest + 1]
        work = np.add.reduceat(F + B, offs[:-1][sizes > 0], axis=1)[:, np.searchsorted(np.flatnonzero(sizes > 0), rest)]
        c = np.add.reduceat(comm, offs[:-1][sizes > 0])[np.searchsorted(np.flatnonzero(sizes > 0), rest)] / sizes[rest]
        zero = np.zeros((1, len(rest)))
        fill = np.concatenate([zero, np.cumsum(F[:-1, a] + c, axis=0)])
        drain = np.concatenate([zero, np.cumsum(B[:-1, e - 1] + c, axis=0)])
        out[rest] = (work + fill + drain).max(axis=0)
    return out


def makespan(F: np.ndarray, B: np.ndarray, comm_s: Any = 0.0, kind: str = "1f1b",
             exact: bool | None = None) -> float:
    """The packers' makespan estimate: the exact recurrence when ``exact`` or, with
    ``exact=None``, when ``exact_regime(P, m)``; else ``pipeline_bound`` over the columns
    in their order (mean send time)."""
    return float(makespans(F, B, comm_s, [F.shape[1]], kind, exact)[0])
