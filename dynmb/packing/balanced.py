"""``balanced``: verl's dynamic batching (``rearrange_micro_batches``) as its users run it, under
the memory limit.

Given a token budget T (verl's ``max_token_len``):

1. ``k = ceil(total tokens / T)`` microbatches (at most one per sequence; with ``dp`` replicas
   rounded up to a multiple of ``dp``, so the dispatcher need not split any to deal them out);
2. the sequences are partitioned into k sets of balanced *workload* by the Karmarkar-Karp
   largest differencing method, k-way (``karmarkar_karp``): every sequence starts as a
   partition of k sets (itself in one, the others empty); the two partitions with the largest
   spread (largest minus smallest set) are repeatedly merged, the largest set of one with the
   smallest of the other and so on, until one partition remains;
3. each set is one microbatch of ONE packed row (its documents side by side, document-causal
   attention), ``padded_len`` its tokens rounded up to a multiple of ``round_to``;
4. never over the memory limit: a microbatch whose row is not admissible (``PackContext.bmax``)
   is split in two by the same partitioner (k = 2) until every part is (then there are more
   than k microbatches); a sequence alone always fits (the dispatcher's length cap);
5. order: microbatches sorted by workload, largest first, then the even positions reversed
   followed by the odd ones: small microbatches at both ends of the order, the largest in the
   middle (verl's ``use_dynamic_bsz_balance``), which shortens the pipeline's fill and drain.

Workload of a sequence of length l: the cost model's time of that sequence alone, one row,
``F + B`` summed over the stages, minus the zero-length intercept (the per-op fixed cost does not
grow with the sequences a packed row holds). Without a cost model, verl's estimate
``24576 l + l^2`` (its FLOP proxy: a linear term per token and the attention's quadratic one).

``budget_divisors`` ranks the budgets cap / 2^j without partitioning: each as k equal
microbatches (``tokens / k`` tokens, ``1 / k`` of the batch's attention work) by the fast makespan
estimate ``dynmb.timing.makespan``; the ``dynamic`` packer weighs ``balanced`` at the best few of them
and at the memory maximum.

Budget T: by default the memory maximum as ``token-budget`` takes it (``token_budget.max_tokens``
at the batch's longest rounded length); ``divisor`` d > 1 gives ``T // d`` (the budgets
``cap / 2^j`` that ``dynmb compare`` tries for the best budget in hindsight).
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import math
from typing import Any

import numpy as np

from dynmb.timing.makespan import makespans
from dynmb.timing.makespan_zb import ESTIMATES as ZB_ESTIMATES
from dynmb.timing.makespan_zb import backward_shares, ranking_kind, windows
from dynmb.schedule.kinds import ScheduleKind, get_kind
from dynmb.packing.context import PackContext
from dynmb.packing.embedprice import EmbedPricing
from dynmb.packing.rows import Flat, Group, groups_to_flat, round_up
from dynmb.packing.token_budget import max_tokens

__all__ = ["karmarkar_karp", "greedy_partition", "sequence_workload", "ends_order", "balanced_flat",
           "budget_divisors", "NEAR_BEST", "VERL_LINEAR_COEF"]

NEAR_BEST = 0.03
"""``budget_divisors`` keeps a neighbour of the best-estimated budget only within this margin of it."""
VERL_LINEAR_COEF = 24576
"""verl's workload estimate per token (``24576 l + l^2``), used without a cost model."""


KK_MEMO = 8
"""``karmarkar_karp`` keeps the sets of its last this many large calls (``KK_MEMO_MIN`` items or more):
``--schedule auto`` packs a batch once per kind, and each packing weighs the same ``balanced`` budgets."""
KK_MEMO_MIN = 4096
_KK_MEMO: dict[tuple, list[list[int]]] = {}


def karmarkar_karp(weights: Any, k: int) -> list[list[int]]:
    """``_karmarkar_karp``, remembered for the last ``KK_MEMO`` calls of ``KK_MEMO_MIN`` items or more."""
    w = np.ascontiguousarray(weights, dtype=np.float64).reshape(-1)
    if len(w) < KK_MEMO_MIN:
        return _karmarkar_karp(w, k)
    key = (int(k), len(w), hashlib.blake2b(w.tobytes(), digest_size=16).digest())
    sets = _KK_MEMO.pop(key, None)
    if sets is None:
        sets = _karmarkar_karp(w, k)
    _KK_MEMO[key] = sets
    while len(_KK_MEMO) > KK_MEMO:
        _KK_MEMO.pop(next(iter(_KK_MEMO)))
    return [list(s) for s in sets]


def _karmarkar_karp(weights: Any, k: int) -> list[list[int]]:
    """Indices of ``weights`` in ``k`` sets of balanced sums (largest differencing, module doc).
    Sets are returned largest sum first; a set is empty only when there are fewer than k items.
    A partition's sets are recorded as nodes of a merge forest (a new node per pair of non-empty
    sets joined, ``_Forest``); the items of every final set are read off the forest at the end by pointer
    jumping (no per-set Python work per merge). One item into a partition (most merges) is an
    O(k) list edit in place (``_add_item``: the set with the smallest sum takes it and moves to its
    sorted place); two partitions of several items merge in numpy, O(k): the sums of one added to
    the other's reversed and re-sorted (stable), or, with positive weights and no two non-empty
    sets meeting, by sorting their non-empty sets only (``_side_by_side``: what that stable sort gives).
    A partition is a list or an array, whichever its last merge made. Node storage grows with the
    nodes made (not the worst case n + (n - 1) k)."""
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    n = len(w)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if n == 0:
        return [[] for _ in range(k)]
    wl = w.tolist()
    pending, forest = _Pending(w, k), _Forest(n, k)
    positive = bool(np.all(w > 0))            # then a set is non-empty iff its sum is: the first `count` hold items
    pop, take, push = pending.pop, pending.take, pending.push           # bound once: the loop runs n - 1 times
    for _ in range(n - 1):                    # every merge makes one partition of two
        a = take(pop())
        pb = pop()
        if pb < n:                            # one item into the smallest set of the other (the common case)
            push(_add_item(a, pb, wl[pb], forest))
            continue
        b = take(pb)
        push(_side_by_side(a, b, k, pending) if positive and a[2] + b[2] <= k else forest.merge(a, b))
    _, final, _ = pending.take(pending.pop())
    return forest.sets(np.asarray(final, dtype=np.int64), w)


class _Pending:
    """The partitions still to merge, popped by -spread then id: the items alone (an item's own id, in
    weight order) and a heap of partitions of several items (ids n and up, in order of making). A partition
    is (negated sums ascending, its sets' nodes aligned with them, how many are non-empty)."""

    def __init__(self, w: np.ndarray, k: int) -> None:
        self.n = n = len(w)
        self.wl = w.tolist()
        self.alone = np.lexsort((np.arange(n), -w)).tolist()
        self.neg_alone = [-self.wl[i] for i in self.alone]
        self.nxt_alone = 0
        self.heap: list[tuple[float, int]] = []
        self.parts: dict[int, tuple[Any, Any, int]] = {}
        self.tie = n
        self.zeros, self.empties = [0.0] * (k - 1), [-1] * (k - 1)

    def __len__(self) -> int:
        return len(self.heap) + self.n - self.nxt_alone

    def pop(self) -> int:
        """The id with the largest spread (the smallest (-spread, id)) of the items alone and the heap."""
        i = self.nxt_alone
        if i < self.n and (not self.heap or (self.neg_alone[i], self.alone[i]) < self.heap[0]):
            self.nxt_alone = i + 1
            return self.alone[i]
        return heapq.heappop(self.heap)[1]

    def take(self, pid: int) -> tuple[Any, Any, int]:
        if pid < self.n:                                   # one item alone: built when first merged
            return [-self.wl[pid], *self.zeros], [pid, *self.empties], 1
        return self.parts.pop(pid)

    def push(self, part: tuple[Any, Any, int]) -> None:
        neg = part[0]
        self.parts[self.tie] = part
        heapq.heappush(self.heap, (float(neg[0] - neg[-1]), self.tie))
        self.tie += 1


class _Forest:
    """The merge forest: nodes 0..n-1 are the items; node n + i joins ``left[i]`` and ``right[i]``; -1 is an
    empty set."""

    def __init__(self, n: int, k: int) -> None:
        self.n, self.k = n, k
        self.left: list[int] = []
        self.right: list[int] = []
        self.slots = np.arange(k)

    def merge(self, a: tuple[Any, Any, int], b: tuple[Any, Any, int]) -> tuple[Any, Any, int]:
        """Two partitions of several items: the largest set of one with the smallest of the other (numpy)."""
        (na, ta, ca), (nb, tb, cb) = a, b
        neg_a = np.asarray(na, dtype=np.float64) + np.asarray(nb, dtype=np.float64)[::-1]
        order = neg_a.argsort(kind="stable")
        x, y = np.asarray(ta, dtype=np.int64)[order], np.asarray(tb, dtype=np.int64)[::-1][order]
        nxt = self.n + len(self.left)
        if ca == self.k and cb == self.k:     # every set of both non-empty: every pair is a new node
            self.left.extend(x.tolist())
            self.right.extend(y.tolist())
            nodes = self.slots + nxt
        else:
            nodes = np.where(x < 0, y, x)
            both = np.flatnonzero((x >= 0) & (y >= 0))
            self.left.extend(x[both].tolist())
            self.right.extend(y[both].tolist())
            nodes[both] = np.arange(nxt, nxt + len(both))
        return neg_a[order], nodes, min(self.k, ca + cb)

    def sets(self, final: np.ndarray, w: np.ndarray) -> list[list[int]]:
        """The items of each final set (``final``: its nodes), read off the forest by pointer jumping."""
        n, k = self.n, self.k
        nxt = n + len(self.left)
        parent = np.arange(nxt)
        inner = np.arange(n, nxt)
        parent[np.asarray(self.left, dtype=np.int64)] = inner
        parent[np.asarray(self.right, dtype=np.int64)] = inner
        root = parent[:n].copy()
        while True:                           # pointer jumping: every item's root node
            up = parent[root]
            if np.array_equal(up, root):
                break
            root = up
            parent = parent[parent]
        slot = np.full(nxt, -1, dtype=np.int64)
        slot[final[final >= 0]] = np.flatnonzero(final >= 0)
        label = slot[root]
        by = np.argsort(label, kind="stable")
        cuts = np.searchsorted(label[by], np.arange(k + 1))
        sets = [by[a:e].tolist() for a, e in zip(cuts[:-1], cuts[1:])]
        for empty in [j for j, s in enumerate(sets) if not s] if n >= k else []:
            # ties among zero sums can leave an empty set beside a zero-sum one: it takes the lightest item
            # of the set holding the most (a zero-weight one, so no sum changes)
            donor = max(range(k), key=lambda j: len(sets[j]))
            item = min(sets[donor], key=lambda i: w[i])
            sets[donor].remove(item)
            sets[empty].append(item)
        return sets


def _add_item(a: tuple[Any, Any, int], item: int, weight: float, forest: _Forest) -> tuple[Any, Any, int]:
    """One item into the smallest set of partition ``a``: that set moves up, the rest keep their order."""
    na, ta, ca = a
    if not isinstance(na, list):
        na, ta = na.tolist(), ta.tolist()
    v = na.pop() - weight
    at = bisect.bisect_right(na, v)           # np.searchsorted(side="right"): argsort's stable place for it
    t = ta.pop()
    if t >= 0:
        forest.left.append(t)
        forest.right.append(item)
        t = forest.n + len(forest.left) - 1
    else:
        t = item
    na.insert(at, v)
    ta.insert(at, t)
    return na, ta, min(forest.k, ca + 1)


def _side_by_side(a: tuple[Any, Any, int], b: tuple[Any, Any, int], k: int, pending: _Pending) -> tuple[Any, Any, int]:
    """No non-empty set of ``a`` meets a non-empty one of ``b``: they stand side by side, in the stable sort's order."""
    (na, ta, ca), (nb, tb, cb) = a, b
    items = sorted([*zip(_head(na, ca), _head(ta, ca)), *zip(_head(nb, cb)[::-1], _head(tb, cb)[::-1])], key=_first)
    c = ca + cb
    return [v for v, _ in items] + pending.zeros[:k - c], [t for _, t in items] + pending.empties[:k - c], c


def _head(x: Any, c: int) -> list:
    """The first ``c`` entries of a partition's list or array, as a list."""
    return x[:c] if isinstance(x, list) else x[:c].tolist()


def _first(item: tuple) -> Any:
    return item[0]


def greedy_partition(weights: Any, k: int) -> list[list[int]]:
    """Longest-processing-time greedy: heaviest first, each to the lightest set (the baseline
    ``karmarkar_karp`` is tested against)."""
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    heap = [(0.0, j) for j in range(k)]
    sets: list[list[int]] = [[] for _ in range(k)]
    for i in np.argsort(-w, kind="stable").tolist():
        load, j = heapq.heappop(heap)
        sets[j].append(i)
        heapq.heappush(heap, (load + float(w[i]), j))
    return sets


def sequence_workload(lens: np.ndarray, cost_model: Any = None) -> np.ndarray:
    """Workload of each sequence (module doc): the cost model's one-row ``F + B`` over the stages
    minus its zero-length intercept, or verl's ``24576 l + l^2`` without a cost model."""
    L = np.asarray(lens, dtype=np.float64).reshape(-1)
    if cost_model is None or not hasattr(cost_model, "stage_costs"):
        return VERL_LINEAR_COEF * L + L * L
    uniq, inv = np.unique(L, return_inverse=True)
    full = cost_model.stage_costs(np.ones_like(uniq), uniq, uniq * uniq)
    base = cost_model.stage_costs(np.ones(1), np.zeros(1), np.zeros(1))
    per = sum(np.maximum(full[op] - base[op], 0.0).sum(axis=0) for op in ("F", "B"))
    return np.asarray(per, dtype=np.float64)[inv]


def ends_order(work: np.ndarray) -> list[int]:
    """Positions in execution order: sorted by ``work`` descending, the even ranks reversed then
    the odd ones (small at both ends, the largest in the middle)."""
    desc = np.argsort(-np.asarray(work, dtype=np.float64), kind="stable").tolist()
    return desc[::2][::-1] + desc[1::2]


def _round_up_all(x: np.ndarray, m: int) -> np.ndarray:
    """``round_up`` of every entry."""
    return -(-np.asarray(x, dtype=np.int64) // int(m)) * int(m)


def _admissible(ctx: PackContext, tokens: int, round_to: int) -> bool:
    return bool(ctx.bmax([round_up(int(tokens), round_to)])[0] >= 1)


def _fit(items: list[int], lens: np.ndarray, work: np.ndarray, ctx: PackContext, round_to: int) -> list[list[int]]:
    """``items`` as one microbatch, or split in two by ``karmarkar_karp`` until each part's row is admissible."""
    if len(items) <= 1 or _admissible(ctx, int(lens[items].sum()), round_to):
        return [items]
    halves = karmarkar_karp(work[items], 2)
    return [p for h in halves for p in _fit([items[i] for i in h], lens, work, ctx, round_to)]


def balanced_flat(lens: np.ndarray, ctx: PackContext, cost_model: Any = None, *, round_to: int = 1,
                  divisor: int | None = None, dp: int = 1) -> tuple[Flat, int]:
    """(microbatches of ``balanced`` in flat form, the token budget used); module doc. With ``dp``
    replicas the count is rounded up to a multiple of ``dp`` (the dispatcher deals them out)."""
    lens = np.asarray(lens, dtype=np.int64)
    if divisor is not None and (int(divisor) != divisor or divisor < 1):
        raise ValueError(f"balanced: the budget divisor must be a whole number >= 1, got {divisor!r}")
    budget = max(1, row_budget(ctx, lens, round_to) // int(divisor or 1))
    k = max(1, math.ceil(int(lens.sum()) / budget))
    k = min(len(lens), -(-k // dp) * dp)
    work = sequence_workload(lens, cost_model)
    sets = [s for s in karmarkar_karp(work, k) if s]
    tokens = np.array([int(lens[s_].sum()) for s_ in sets], dtype=np.int64)
    fits = ctx.bmax(_round_up_all(tokens, round_to)) >= 1          # every set's row checked at once
    sets = [p for s_, ok in zip(sets, fits.tolist()) for p in ([s_] if ok else _fit(s_, lens, work, ctx, round_to))]
    groups: list[Group] = []
    for s in sets:
        items = np.asarray(s, dtype=np.int64)
        groups.append(Group(items, np.zeros(len(items), np.int64), int(round_up(int(lens[items].sum()), round_to)), 1))
    order = ends_order(np.array([work[g.items].sum() for g in groups]))
    return groups_to_flat([groups[i] for i in order]), budget


def row_budget(ctx: PackContext, lens: np.ndarray, round_to: int) -> int:
    """The memory-maximum token budget of one packed row (``token_budget.max_tokens``), no longer
    than the row may be (``ctx.row_cap``): verl's ``max_token_len`` is a row's length too."""
    cap = max_tokens(ctx, round_up(int(lens.max()), round_to))
    return cap if ctx.row_cap is None else min(cap, int(ctx.row_cap))


def _equal_zb(F: np.ndarray, B: np.ndarray, comm: np.ndarray, per: np.ndarray, kind: ScheduleKind,
              shares: np.ndarray | None) -> np.ndarray:
    """The zero-bubble estimate of pipelines of ``per[j]`` equal microbatches (stage costs ``F[:, j]``, ``B[:, j]``,
    send ``comm[j]``): the recurrence of up to ``c`` = twice the largest window + 2 of them, then one period per
    microbatch more (the estimate of c and c - 1 apart): with equal microbatches the recurrence is periodic once
    every stage is in its steady state (affine in m from two microbatches on, to 1e-9, on the shipped models;
    ``tests/test_balanced.py``), and an O(m) recurrence of thousands of microbatches would cost more than the
    whole packing it ranks budgets for."""
    cap = 2 * max(windows(F.shape[0], kind.estimate_as)) + 2
    head = np.minimum(per, cap)
    prev = np.maximum(head - 1, 1)
    sizes = np.concatenate([head, prev])
    cols = np.repeat(np.concatenate([np.arange(len(per))] * 2), sizes)
    est = makespans(F[:, cols], B[:, cols], comm[cols], sizes, kind.name, shares=shares)
    a, b = est[:len(per)], est[len(per):]
    period = np.where(head > prev, (a - b) / np.maximum(head - prev, 1), 0.0)
    return a + (per - head) * period


def budget_divisors(lens: np.ndarray, ctx: PackContext, cost_model: Any, *, round_to: int = 1, dp: int = 1,
                    keep: int = 3, max_j: int = 12, neighbours: bool = False) -> list[int]:
    """The divisors d = 2^j (j = 0, 1, ... until every sequence is its own microbatch) of the memory-maximum
    budget whose ``balanced`` plans the fast estimate ranks best: each budget as k equal microbatches
    (one packed row of ``tokens / k`` tokens and ``1 / k`` of the attention work; per replica k / dp of
    them), estimated by ``dynmb.timing.makespan.makespans``; the best and its neighbours in j, ``keep`` in all.
    ``neighbours``: also each kept divisor's neighbours in j (the estimate's near misses: ``dynamic``'s final
    check weighs them, issue 39)."""
    divs, kept = _ranked_divisors(lens, ctx, cost_model, round_to, dp, keep, max_j)
    if neighbours:
        at = {divs.index(d) for d in kept}
        kept = [divs[i] for i in sorted({j for i in at for j in (i - 1, i, i + 1) if 0 <= j < len(divs)})]
    return kept


def _ranked_divisors(lens: np.ndarray, ctx: PackContext, cost_model: Any, round_to: int, dp: int, keep: int,
                     max_j: int) -> tuple[list[int], list[int]]:
    """``budget_divisors``' every distinct divisor and those it keeps (without the neighbours)."""
    lens = np.asarray(lens, dtype=np.int64)
    n, total = len(lens), int(lens.sum())
    cap = row_budget(ctx, lens, round_to)
    divs: list[int] = []
    ks: list[int] = []
    for j in range(max_j + 1):
        k = min(n, -(-math.ceil(total / max(1, cap >> j)) // dp) * dp)
        if ks and k == ks[-1]:
            continue                          # the same plan as a larger budget's
        divs.append(1 << j)
        ks.append(k)
        if k >= n:
            break
    if len(divs) <= keep or not hasattr(cost_model, "stage_costs"):
        return divs, divs[:keep]
    k_a = np.array(ks, dtype=np.float64)
    padded = np.ceil(total / k_a / round_to) * round_to
    cost = cost_model.stage_costs(np.ones(len(k_a)), padded, float(np.sum(lens.astype(np.float64) ** 2)) / k_a)
    comm = cost_model.comm_s(np.ones(len(k_a)), padded) if hasattr(cost_model, "comm_s") else np.zeros(len(k_a))
    per = np.maximum(np.array(ks) // dp, 1)
    comm = np.broadcast_to(np.asarray(comm, dtype=np.float64), (len(k_a),))
    rank = get_kind(ranking_kind(ctx.kind))        # the estimate the dynamic packer ranks with
    cols = np.repeat(np.arange(len(k_a)), per)
    if rank.estimate_as in ZB_ESTIMATES:
        est = _equal_zb(cost["F"], cost["B"], comm, per, rank, backward_shares(cost_model, lens, ctx.p))
    else:
        est = makespans(cost["F"][:, cols], cost["B"][:, cols], comm[cols], per, rank.name, virtual=ctx.virtual)
    embeds = EmbedPricing.of(ctx.embedding, cost_model)
    if embeds is not None:                 # each budget's k equal rows of ``padded`` tokens
        est = embeds.added(est, embeds.seconds(np.ones(len(cols)), padded[cols]), comm[cols], per)
    best = int(np.argmin(est))
    lo = min(max(0, best - (keep - 1) // 2), len(divs) - keep)
    near = [divs[i] for i in range(lo, lo + keep) if est[i] <= est[best] * (1 + NEAR_BEST)]
    return divs, sorted({divs[0], *near})       # the budget users set always (the fewest microbatches)
