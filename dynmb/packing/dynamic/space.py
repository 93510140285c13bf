"""The estimate-free part of a ``dynamic`` packing (``dynmb.packing.dynamic.pack`` steps 1-5), remembered
across calls.

``--schedule auto`` packs a batch once per packing key (``1f1b``, ``zb-h1``, ``zb``): the calls differ only in
the makespan estimate that ranks and chooses the candidates (steps 6-7). What comes before depends on
the batch, the memory budget (``ctx.bmax``), the cost model, ``round_to``, ``max_len``, ``attention``,
``dp`` and the search settings, never on the estimate: the row sets and their affine costs
(``SplitSetup``), the time-target grids, the first splits, every candidate built from a split (cut
points balanced over dp, its shapes), the other methods' plans and their candidates (balanced over dp
as ``dynmb.packing`` balances them). ``Space`` holds them; the candidates and plans are built on first
use (``own``: per (row set, cuts, tau); ``given`` / ``baseline``: per method name; ``divisors``: the
``balanced`` budgets per ranking estimate) and handed out as fresh copies, so a ranking never sees
another's values.

``space_for`` returns the call's space: the one remembered (the last ``MEMO`` used) when the call's key
matches, else a new one. The key: the lengths (length and a digest), every setting above, the cost and
memory models as objects (``is``: another model object is another space) and, as a fingerprint of what
the models say, the affine costs and the admissible rows of every padded length of the row sets
(evaluated on every call: one cost lookup). Each part is a deterministic function of the key, so a
remembered space gives what a new one would: a plan does not depend on what was packed before it
(every rank of a run recomputes the same plan). ``clear()`` forgets every space.

Row sets (``row_set``) are remembered by the lengths, ``round_to`` and ``max_len`` alone (they read no model).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import heapq
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from dynmb.costmodel.base import CostModelLike
from dynmb.packing.context import PackContext
from dynmb.packing.dynamic.rank import Candidate, RankMemo
from dynmb.packing.dynamic.setup import RowSet, SplitSetup, affine_costs, row_caps, row_set, split_to_flat
from dynmb.packing.dynapipe import dynapipe_split
from dynmb.packing.rows import Flat, Group, flat_to_groups, groups_to_flat, merge_groups, split_group

__all__ = ["Space", "PackCall", "space_for", "clear", "MEMO", "BFD_MAX", "SEED_DP_MAX"]

MEMO = 2
"""Spaces remembered (the last used); row sets likewise."""
BFD_MAX = 16384
"""Batches up to this many sequences also try rows of the longest admissible length filled
best-fit-decreasing (the rows of ``packed``; a Python loop per sequence) and weigh ``packed``'s plan."""
SEED_DP_MAX = 2048
"""Batches up to this many sequences seed the own splits with ``dynapipe``'s DP split (its plan is
weighed as a baseline at any size), or with its DP split when ``dynamic_groups`` is called alone."""

_SPACES: dict[tuple, "Space"] = {}
_ROWS: dict[tuple, list[RowSet]] = {}


def clear() -> None:
    """Forget every remembered space and row set."""
    _SPACES.clear()
    _ROWS.clear()


def _remember(memo: dict, key: tuple, value: Any) -> Any:
    memo.pop(key, None)
    memo[key] = value
    while len(memo) > MEMO:
        memo.pop(next(iter(memo)))
    return value


def _digest(*arrays: np.ndarray) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.digest()


def row_sets(lengths: np.ndarray, round_to: int, top: int) -> list[RowSet]:
    """Step 1's row sets (``dynmb.packing.dynamic.pack``): no packing, next-fit at ``row_caps``, best-fit rows of
    ``top`` for batches of <= ``BFD_MAX``; those that packed nothing dropped. Remembered."""
    key = (len(lengths), _digest(lengths), int(round_to), int(top))
    if key in _ROWS:
        return _remember(_ROWS, key, _ROWS[key])
    n = len(lengths)
    asc = np.argsort(lengths, kind="stable")
    sets = [row_set(lengths, asc, None, round_to)]
    caps = row_caps(lengths, top, round_to)[1:]
    for cap in caps:
        sets.append(row_set(lengths, asc, cap, round_to))
    if caps and caps[-1] == top and n <= BFD_MAX:
        sets.append(row_set(lengths, asc, top, round_to, best_fit=True))
    return _remember(_ROWS, key, [r for r in sets if r.key == "none" or len(r.tokens) < n])


class Space:
    """The estimate-free part of one packing call (module doc)."""

    models: tuple = ()
    """The cost and memory model and the baselines callback it was built for (held: their ids are in its key)."""

    def __init__(self, lengths: np.ndarray, sets: list[RowSet], inv: np.ndarray, costs: dict, bmax_u: np.ndarray,
                 cost_model: CostModelLike, num_stages: int, doc_causal: bool, dp: int, num_tau: int,
                 seeded: bool) -> None:
        self.lengths, self.doc_causal, self.dp = lengths, doc_causal, dp
        self.setups: dict[str, SplitSetup] = {}
        offset = 0
        for rows in sets:
            self.setups[rows.key] = SplitSetup(rows, inv[offset:offset + len(rows.tokens)], costs, bmax_u, doc_causal)
            offset += len(rows.tokens)
        self.grids = {key: st.tau_grid(num_tau) for key, st in self.setups.items()}
        self.first = [(key, st.greedy_cuts(tau), tau) for key, st in self.setups.items() for tau in self.grids[key]]
        for key, st in self.setups.items():
            if st.rows.opened is not None:                                  # one best-fit row per microbatch
                self.first.append((key, np.arange(len(st.pos) + 1), np.nan))
        if not seeded and len(lengths) <= SEED_DP_MAX:   # no baselines: the fixed-size and DP splits of the sorted rows
            unpacked = self.setups["none"]
            m0 = len(unpacked.pos)
            self.first.append(("none", np.append(np.arange(0, m0, max(1, int(unpacked.bmax[0]))), m0), np.nan))
            dp_cuts = dynapipe_split(unpacked.rows.padded[::-1], unpacked.bmax[::-1], cost_model, num_stages)
            self.first.append(("none", m0 - dp_cuts[::-1], np.nan))
        self.memo = RankMemo()                       # what the rankings share (looked-up costs, assignments, calls)
        self._own: dict[tuple, Candidate] = {}
        self._given: dict[str, Flat] = {}
        self._divisors: dict[str, list[int]] = {}
        self._base: dict[str, Candidate | None] = {}

    def own(self, key: str, cuts: np.ndarray, tau: float, balance: bool = True) -> Candidate:
        """A split of row set ``key``, its slowest microbatches halved until dp divides their number (empty
        if they run out), as a fresh candidate."""
        memo = (key, cuts.tobytes(), float(tau), balance)
        if memo not in self._own:
            st = self.setups[key]
            bal = _balance_cuts(cuts, st.bottleneck, self.dp) if balance else cuts
            if bal is None:
                c = Candidate(np.zeros(0, np.int64), np.zeros(0), np.zeros(0), lambda o: None,  # type: ignore[arg-type,return-value]
                              source=(key, cuts, tau),
                              key=("own",) + memo)
            else:
                rows, padded, attn = st.shapes(bal)
                c = Candidate(rows, padded, attn, functools.partial(split_to_flat, st.rows, bal),
                              source=(key, cuts, tau), opened=st.rows.opened if len(bal) - 1 == len(st.pos) else None,
                              split=(key, bal), key=("own",) + memo)
            self._own[memo] = c
        return copy.copy(self._own[memo])

    def divisors(self, rank_kind: str, make: Callable[[], list[int]]) -> list[int]:
        """``balanced``'s budget divisors ranked by ``rank_kind``'s estimate (``make()``), found once per estimate."""
        if rank_kind not in self._divisors:
            self._divisors[rank_kind] = make()
        return list(self._divisors[rank_kind])

    def given(self, method: str, make: Callable[[str], Flat]) -> Flat:
        """``method``'s plan of the batch (``make(method)``, the ``baselines`` callback), made once."""
        if method not in self._given:
            self._given[method] = make(method)
        return self._given[method]

    def baseline(self, method: str, make: Callable[[str], Flat], bmax_fn: Callable) -> Candidate | None:
        """``method``'s plan balanced over dp as ``dynmb.packing`` does (None if it cannot), as a fresh candidate."""
        if method not in self._base:
            flat = _balance_like_packing(self.given(method, make), self.dp, bmax_fn)
            c = None
            if flat is not None:
                items, _, nseq, plen, batch = flat
                attn = batch * plen.astype(np.float64) ** 2
                if self.doc_causal:
                    docs2 = np.add.reduceat(self.lengths[items].astype(np.float64) ** 2, np.cumsum(nseq) - nseq)
                    attn = np.where(nseq > batch, docs2, attn)
                c = Candidate(batch, plen, attn, functools.partial(_reorder, flat), baseline=method,
                              key=("base", method))
            self._base[method] = c
        c = self._base[method]
        return None if c is None else copy.copy(c)


@dataclass(frozen=True, kw_only=True)
class PackCall:
    """A dynamic packing call's settings (``dynamic_groups``' keywords, documented there)."""

    round_to: int = 1
    max_len: int | None = None
    attention: str = "auto"
    dp: int = 1
    baselines: Callable | None = None


def space_for(lengths: np.ndarray, ctx: PackContext, cost_model: CostModelLike, call: PackCall, *, top: int,
              num_tau: int) -> Space:
    """The space of a packing call (module doc): remembered, or new; ``top``: its longest row. ``call.baselines``:
    the call's callback of the other methods' plans; one with a ``memo_key`` attribute (``dynmb.packing.methods``'
    own: its plans are functions of the rest of the key) shares a space with every call of the same ``memo_key``,
    any other only with calls given the same callback object."""
    round_to, attention, dp, baselines = call.round_to, call.attention, call.dp, call.baselines
    shared = baselines is None or hasattr(baselines, "memo_key")
    who = getattr(baselines, "memo_key", None) if shared else ("callback", id(baselines))
    sets = row_sets(lengths, round_to, top)
    uniq, inv = np.unique(np.concatenate([r.padded for r in sets]), return_inverse=True)
    costs = affine_costs(cost_model, uniq)
    bmax_u = np.maximum(ctx.bmax(uniq), 1)
    key = (len(lengths), _digest(lengths), int(round_to), int(top), attention, int(dp), int(num_tau),
           baselines is None, who, id(cost_model), id(ctx.mm), ctx.limit, ctx.p, ctx.tight, ctx.virtual, ctx.row_cap,
           ctx.embedding,
           _digest(np.asarray(ctx.k), np.asarray(ctx.caps), bmax_u, *(a for op in ("F", "B") for a in costs[op])))
    held = (cost_model, ctx.mm, None if shared else baselines)
    space = _SPACES.get(key)
    if space is None or any(a is not b for a, b in zip(space.models, held)):
        space = Space(lengths, sets, inv, costs, bmax_u, cost_model, ctx.p, attention == "auto", dp, num_tau,
                      baselines is not None)
        space.models = held            # held, so that the ids in its key stay theirs while it is remembered
    return _remember(_SPACES, key, space)


def _balance_cuts(cuts: np.ndarray, bottleneck: Callable, dp: int) -> np.ndarray | None:
    """Halve the slowest microbatches of >= 2 rows until their number is a positive multiple
    of ``dp`` (None if they run out)."""
    while True:
        m = len(cuts) - 1
        need = dp - m if m < dp else -m % dp
        if not need:
            return cuts
        rows = np.diff(cuts)
        can = np.flatnonzero(rows >= 2)
        if not len(can):
            return None
        t = bottleneck(cuts[:-1][can], cuts[1:][can])
        pick = can[np.argsort(-t, kind="stable")[:need]]
        cuts = np.sort(np.concatenate([cuts, cuts[pick] + rows[pick] // 2]))


def _balance_like_packing(flat: Flat, dp: int, bmax_fn: Callable) -> Flat | None:
    """``dynmb.packing``'s balancing of a plan over ``dp`` replicas: while their number is not a
    positive multiple of dp, split (``split_group``) the first splittable microbatch with the
    most (rows, documents) (a heap keyed by position paths); then, while it is not a multiple,
    merge the admissible pair with the fewest padded tokens. None where packing would refuse."""
    count = len(flat.nseq)
    if not (count % dp or count < dp):
        return flat
    heap: list[tuple[int, int, tuple[int, ...], Group]] = [(-g.batch, -len(g.items), (j,), g)
                                                            for j, g in enumerate(flat_to_groups(flat))]
    heapq.heapify(heap)
    while (count % dp or count < dp) and (heap[0][0] <= -2 or heap[0][1] <= -2):
        _, _, key, g = heapq.heappop(heap)
        for half, part in enumerate(split_group(g)):
            heapq.heappush(heap, (-part.batch, -len(part.items), key + (half,), part))
        count += 1
    groups = [g for *_, g in sorted(heap, key=lambda x: x[2])]
    while len(groups) % dp:
        plen, rows = np.array([g.padded_len for g in groups]), np.array([g.batch for g in groups])
        bm = bmax_fn(plen)
        i, j = np.triu_indices(len(groups), 1)
        ok = rows[i] + rows[j] <= np.minimum(bm[i], bm[j])
        if not np.any(ok) or len(groups) <= dp:
            return None
        k = int(np.argmin(np.where(ok, np.maximum(plen[i], plen[j]) * (rows[i] + rows[j]), np.inf)))
        merged = merge_groups(groups[i[k]], groups[j[k]])
        groups = [g for q, g in enumerate(groups) if q not in (i[k], j[k])] + [merged]
    return groups_to_flat(groups)


def _reorder(flat: Flat, order: np.ndarray) -> Flat:
    """The flat form with its microbatches run in ``order``."""
    items, local, nseq, plen, batch = flat
    order = np.asarray(order, dtype=np.int64)
    start = np.cumsum(nseq) - nseq
    counts = nseq[order]
    idx = np.repeat(start[order] - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))
    return Flat(items[idx], local[idx], counts, plen[order], batch[order])

