"""Helpers shared by the packers (numpy): row packing, microbatch groups, shape rounding.

- ``next_fit_rows(lengths, cap)``: next-fit over lengths in the given (sorted) order into
  rows of at most ``cap`` tokens; one ``bisect`` per row over the prefix sums, so it costs
  O(rows log n) Python steps, not O(n).
- ``bfd_rows(lengths, cap)``: best-fit-decreasing (the Megatron-style packing baseline):
  each item, longest first, goes into the open row with the least room that still holds
  it (ties: the lowest row id), else opens a new row. O(n log rows) with a sorted list of
  (room, row) pairs.
- ``round_up(x, multiple)`` / ``round_down(x, multiple)``: shapes as multiples of ``round_to``.
- Microbatch groups: a ``Group`` (named tuple) is one microbatch (items, local rows, padded_len,
  rows); ``Flat`` (named tuple) is a whole plan as five arrays (``groups_to_flat`` /
  ``flat_to_groups``); ``merge_groups`` joins two microbatches.
  ``fixed_groups`` (fixed rows per microbatch), ``packed_flat`` (``bfd_rows`` rows of
  ``pack_len``, a fixed number of rows per microbatch), ``token_budget_groups`` (fairseq's
  ``batch_by_size``), ``split_group`` and ``assign_replicas`` (data parallelism).
- Splits of rows sorted longest first into contiguous microbatches (cut points):
  ``greedy_cuts`` / ``greedy_cuts_from_short_end`` (each microbatch takes the most rows its
  start allows, by pointer doubling) and ``polish_cuts`` (a boundary-shift DP).
"""

from __future__ import annotations

import bisect
import heapq
from typing import Any, Callable, NamedTuple

import numpy as np

__all__ = ["next_fit_rows", "bfd_rows", "round_up", "round_down", "Flat", "Group", "merge_groups", "groups_to_flat",
           "flat_to_groups", "fixed_groups", "packed_flat", "token_budget_groups", "split_group", "assign_replicas",
           "greedy_cuts", "greedy_cuts_from_short_end", "polish_cuts"]

class Flat(NamedTuple):
    """Microbatches in execution order, as five arrays."""

    items: np.ndarray
    """Item positions, grouped by microbatch."""
    local_row: np.ndarray
    """Row of each item within its microbatch."""
    nseq: np.ndarray
    """Items per microbatch."""
    padded_len: np.ndarray
    """padded_len per microbatch."""
    batch: np.ndarray
    """Rows per microbatch."""


class Group(NamedTuple):
    """One microbatch."""

    items: np.ndarray
    """Item positions."""
    local_row: np.ndarray
    """Row of each item within the microbatch."""
    padded_len: int
    """The row length it runs at."""
    batch: int
    """Rows."""


def merge_groups(a: Group, b: Group) -> Group:
    """One microbatch of ``a``'s rows then ``b``'s, at the longer padded_len."""
    return Group(np.concatenate([a.items, b.items]), np.concatenate([a.local_row, b.local_row + a.batch]),
                 max(a.padded_len, b.padded_len), a.batch + b.batch)


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
    return [Group(positions[a:a + z], local[z], s, z) for a, s, z in zip(starts.tolist(), longest, sizes)]


def packed_flat(lens: np.ndarray, pack_len: int, rows_per_mb: int) -> Flat:
    """Rows of ``pack_len`` filled best-fit-decreasing, ``rows_per_mb`` consecutive rows per microbatch."""
    row = bfd_rows(lens, pack_len)
    num_rows = int(row.max()) + 1
    mb_of_item = row // rows_per_mb
    items = np.argsort(mb_of_item, kind="stable")
    num_mb = int(mb_of_item.max()) + 1
    rows = np.minimum(rows_per_mb, num_rows - np.arange(num_mb) * rows_per_mb)
    local_row = row[items] - mb_of_item[items] * rows_per_mb
    return Flat(items, local_row, np.bincount(mb_of_item, minlength=num_mb), np.full(num_mb, pack_len, np.int64), rows)


def token_budget_groups(lens: np.ndarray, max_tokens: int, round_to: int) -> list[Group]:
    """fairseq ``batch_by_size``: length-ascending, grow while rows x padded_len <= max_tokens."""
    pos = np.argsort(lens, kind="stable")
    padded = round_up(lens[pos], round_to).tolist()
    groups, a = [], 0
    for e in range(1, len(padded) + 1):
        if e == len(padded) or (e + 1 - a) * padded[e] > max_tokens:
            groups.append(Group(pos[a:e], np.arange(e - a), padded[e - 1], e - a))
            a = e
    return groups


def split_group(g: Group) -> list[Group]:
    """Halve a microbatch by rows, or a one-row packed microbatch by documents."""
    items, rows, plen, b = g
    if b >= 2:
        h = b // 2
        lo = rows < h
        return [Group(items[lo], rows[lo], plen, h), Group(items[~lo], rows[~lo] - h, plen, b - h)]
    if len(items) >= 2:                      # a packed row: split its documents
        h = len(items) // 2
        return [Group(items[:h], np.zeros(h, np.int64), plen, 1),
                Group(items[h:], np.zeros(len(items) - h, np.int64), plen, 1)]
    return [g]


def groups_to_flat(groups: list[Group]) -> Flat:
    """Groups -> the flat form."""
    return Flat(np.concatenate([g.items for g in groups]).astype(np.int64),
                np.concatenate([g.local_row for g in groups]).astype(np.int64),
                np.array([len(g.items) for g in groups], dtype=np.int64),
                np.array([g.padded_len for g in groups], dtype=np.int64),
                np.array([g.batch for g in groups], dtype=np.int64))


def flat_to_groups(flat: Flat) -> list[Group]:
    """The flat form -> groups."""
    cut = np.cumsum(flat.nseq)[:-1]
    return [Group(*g) for g in zip(np.split(flat.items, cut), np.split(flat.local_row, cut), flat.padded_len.tolist(),
                                   flat.batch.tolist())]


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
    values = np.asarray(busy, dtype=np.float64)
    vals = values.tolist()                  # Python floats: the same IEEE sums, without numpy scalars
    rep = [0] * m
    for j in np.argsort(-values, kind="stable").tolist():
        load, r = heapq.heappop(heap)
        rep[j] = r
        count[r] += 1
        if count[r] < per:
            heapq.heappush(heap, (load + vals[j], r))
    replica = np.array(rep, dtype=np.int64)
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
    polished = np.array(out[::-1], dtype=np.int64)
    return polished if np.all(np.diff(polished) >= 1) else cuts
