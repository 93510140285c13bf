"""The ``dynamic`` packer: memory- and cost-aware microbatches planned for the schedule.

Algorithm:

1. Rows. For a row capacity R, a sequence longer than R/2 gets its own row; the shorter
   ones, in ascending length order, are packed next-fit into rows of at most R tokens (one
   ``bisect`` per row), so neighbouring rows have similar lengths and a row wastes less
   than one of its short documents. R runs over "no packing", up to three powers of two
   from 2x the median length up to the longest (rounded down to a multiple of
   ``round_to``) and ``max_len``, the longest admissible row. Batches of <= ``BFD_MAX``
   sequences also get rows of ``max_len`` filled best-fit-decreasing (``packed``'s rows).
2. Shapes and costs. A microbatch is a contiguous run of rows (sorted longest first); its
   ``padded_len`` is its first row's length rounded up to a multiple of ``round_to``, and
   memory and costs are evaluated at that rounded length. Its attention work is
   ``Microbatch.attention_work``: sum of s_i^2 over its documents when some row is packed
   (``attention="auto"``), else rows x padded_len^2. Its time per stage is taken from ONE
   cost lookup (``stage_costs`` at (1, s), (2, s) and (1, s, attention work 0) for every
   distinct padded length s): ``alpha_s + beta_s * rows - gamma_s * (rows * s^2 - work)``,
   affine in rows and attention work (exact for the analytic and polynomial cost models).
3. Own splits. The size is capped by memory (``bmax``, the per-microbatch budget of
   ``dynmb.packing``) and by a time target tau on the bottleneck stage's F + B. Greedy: each
   microbatch takes the most rows both caps allow, found for all rows at once by pointer
   doubling; tau sweeps a geometric grid per R. Also one best-fit row per microbatch.
4. Baselines. ``baselines(method)`` gives the plan each other method makes of the same batch
   (``BASELINES``; ``dynapipe`` up to ``SEED_DP_MAX`` sequences, ``packed`` up to ``BFD_MAX``):
   candidates as they stand. The splits of ``sorted`` and ``dynapipe`` (runs of the sorted
   rows) are own splits too; called without baselines, batches of <= ``SEED_DP_MAX`` sequences
   seed with the same two (the fixed-size and DP (``dynmb.packing.dynapipe``) splits).
5. Data parallelism (dp = D): an own split's slowest microbatches are halved until their number
   is a positive multiple of D (else it drops out); a baseline is balanced as ``dynmb.packing``
   balances it (halving, then merging).
6. Rank. Each candidate in several orders (as formed; reversed; slowest / fastest first; the
   two cheapest at the two ends, the rest as formed or reversed; best-fit rows also as opened), per replica when D > 1
   (replicas dealt boustrophedon by time, ``assign_replicas`` for baselines; estimated on the
   replica with the most work and the one with the longest round trip). A proxy orders them:
   the larger of ``pipeline_bound`` and the longest chain of round trips that 1F1B forces
   (microbatch j + P starts on stage 0 only after j's backward is back there; with m <= P
   every microbatch is its own chain). The value ``makespan`` reports (exact with few
   microbatches per stage, else the bound) is computed for the best by proxy within
   ``RANK_OPS`` ops per pass (``makespans``: all at once). Then tau is refined around the
   best, the best three are also filled from the short end and the best two get a
   boundary-shift DP (each cut moves by up to 4 rows to minimise the summed bottleneck
   time), and those are ranked too.
7. Choose. The ``keep`` best (and the fewest-microbatch ones within ``tol``) and every baseline
   are re-costed in one ``stage_costs`` lookup and estimated as ``dynmb.packing`` will run them:
   a baseline as it stands; D = 1, an own split in each order; D > 1, in its best order run
   globally (so that every replica keeps it, whichever of identical microbatches
   ``assign_replicas`` deals it), replicas assigned by ``assign_replicas`` on the order returned
   and each estimated with ``makespans``, the likeliest slowest first (a candidate drops out as
   soon as one is past the best). The fastest is returned (among those within ``tol``, the
   fewest microbatches): by the estimate ``dynmb.packing`` reports, dynamic is never slower
   than the plan of any method it was given.
Cost: O(n log n) for sorting plus O(n) vectorised work per (R, tau), O(rows) Python steps for
the next-fit rows, a per-sequence Python loop for the best-fit rows, the baselines' own costs
(``dynapipe``'s DP, about 0.1 ms per sequence), and the exact estimates (O(m + P) numpy steps
per batch of them).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from dynmb.costmodel.base import CostModelLike
from .dynapipe import dynapipe_split
from .rows import (Flat, assign_replicas, bfd_rows, exact_regime, flat_to_groups, greedy_cuts,
                        greedy_cuts_from_short_end, groups_to_flat, makespans, next_fit_rows, polish_cuts, round_down,
                        round_up, split_group)

SEED_DP_MAX = 2048
"""Batches up to this many sequences weigh ``dynapipe``'s plan (its DP costs O(n * w * K), about
0.1 ms per sequence), or seed with its DP split when ``dynamic_groups`` is called alone."""
RANK_EXACT = 400
"""Candidates with at most this many (stage, microbatch) cells are always ranked by ``makespan``'s value."""
RANK_OPS = 300_000
"""Per ranking pass, exact estimates (2 * P * m ops each) of the best by proxy stop at this many ops
(scaled by P / 16 below 16 stages: with few stages an op of the level-by-level recurrence costs more)."""
BFD_MAX = 16384
"""Batches up to this many sequences also try rows of the longest admissible length filled
best-fit-decreasing (the rows of ``packed``; a Python loop per sequence) and weigh ``packed``'s plan."""
LOOKUP_CELLS = 1 << 22
"""At most this many (stage, microbatch) cells are costed in one ``stage_costs`` lookup (memory)."""
BASELINES = ("fixed", "sorted", "token-budget", "packed", "dynapipe")
"""Methods whose plans (``baselines``) are candidates too, always weighed in the final choice."""

__all__ = ["dynamic_groups", "BASELINES"]


@dataclass
class _RowSet:
    """The rows of one row capacity ``cap`` (None: one sequence per row), numbered longest first."""

    key: str                  # how the rows were formed: "none", "next-fit R" or "bfd R"
    row: np.ndarray           # row of each item
    tokens: np.ndarray        # tokens per row (non-increasing)
    padded: np.ndarray        # tokens rounded up to round_to: padded_len of a microbatch starting there
    work_cum: np.ndarray      # prefix sums of each row's attention work (sum of its documents' s^2)
    packed_cum: np.ndarray    # prefix counts of rows holding more than one document
    opened: np.ndarray | None = None   # best-fit rows: the order they were opened in (``packed``'s order)

    def attention(self, start: np.ndarray, end: np.ndarray, doc_causal: bool) -> np.ndarray:
        """``Microbatch.attention_work`` of the microbatches of rows [start, end) (broadcast)."""
        rows = end - start
        full = rows * self.padded[np.minimum(start, len(self.padded) - 1)].astype(np.float64) ** 2
        if not doc_causal:
            return full
        packed = self.packed_cum[end] - self.packed_cum[start] > 0
        return np.where(packed, self.work_cum[end] - self.work_cum[start], full)


def _rows(lengths: np.ndarray, asc: np.ndarray, cap: int | None, round_to: int, best_fit: bool = False) -> _RowSet:
    """Rows for capacity ``cap`` (``best_fit``: filled best-fit-decreasing, as ``packed`` does);
    ``asc`` sorts ``lengths`` ascending."""
    n = len(lengths)
    if cap is None:
        row = np.empty(n, dtype=np.int64)
        row[asc[::-1]] = np.arange(n)
    elif best_fit:
        row = bfd_rows(lengths, cap)
    else:
        k = int(np.searchsorted(lengths[asc], cap // 2, side="right"))
        short, long_ = asc[:k], asc[k:][::-1]
        row = np.empty(n, dtype=np.int64)
        row[long_] = np.arange(len(long_))
        if k:
            row[short] = len(long_) + next_fit_rows(lengths[short], cap)
    opened = None
    if cap is not None:
        tokens = np.bincount(row, weights=lengths).astype(np.int64)
        by_tokens = np.argsort(-tokens, kind="stable")
        rank = np.empty(len(tokens), dtype=np.int64)
        rank[by_tokens] = np.arange(len(tokens))
        row = rank[row]
        opened = by_tokens if best_fit else None
    tokens = np.bincount(row, weights=lengths).astype(np.int64)
    work = np.bincount(row, weights=lengths.astype(np.float64) ** 2)
    docs = np.bincount(row)
    key = "none" if cap is None else f"{'bfd' if best_fit else 'next-fit'} {cap}"
    return _RowSet(key, row, tokens, round_up(tokens, round_to), np.concatenate([[0.0], np.cumsum(work)]),
                   np.concatenate([[0], np.cumsum(docs > 1)]), opened)


def _caps(lengths: np.ndarray, max_len: int, round_to: int) -> list[int | None]:
    """No packing, then powers of two from 2x the median up to the longest (at most 3), each
    rounded down to a multiple of ``round_to`` and capped at ``max_len``, then ``max_len``
    itself (the longest admissible row: the fewest, largest microbatches of packed rows)."""
    lmax = int(lengths.max())
    floor_len = 2 * max(float(np.median(lengths)), float(np.percentile(lengths, 25)))
    caps: list[int | None] = [None]
    r = 64
    while r < 2 * lmax and len(caps) < 4:
        cap = min(round_down(r, round_to), max_len)
        if cap >= floor_len and cap >= 1 and cap not in caps:
            caps.append(cap)
        r *= 2
    if max_len >= floor_len and max_len not in caps:
        caps.append(max_len)
    return caps


def _affine_costs(cost_model: CostModelLike, padded: np.ndarray) -> dict[str, np.ndarray]:
    """Per op ``F`` / ``B``: (alpha, beta, gamma)[P, u] with time(b, s, work) = alpha + beta * b
    - gamma * (b * s^2 - work), from one ``stage_costs`` lookup at (1, s), (2, s), (1, s, 0)."""
    u = len(padded)
    s = padded.astype(np.float64)
    rows = np.concatenate([np.ones(u), np.full(u, 2.0), np.ones(u)])
    cc = cost_model.stage_costs(rows, np.tile(s, 3), np.concatenate([s * s, 2 * s * s, np.zeros(u)]))
    out = {}
    for op in ("F", "B"):
        one, two, no_attn = cc[op][:, :u], cc[op][:, u:2 * u], cc[op][:, 2 * u:]
        beta = np.maximum(two - one, 0.0)
        out[op] = (one - beta, beta, np.maximum(one - no_attn, 0.0) / np.maximum(s * s, 1.0))
    return out


class _Setup:
    """One row set with its affine costs per row: scores splits (cut points over its rows)."""

    def __init__(self, rows: _RowSet, length_ix: np.ndarray, costs: dict[str, tuple], bmax_by_length: np.ndarray,
                 doc_causal: bool) -> None:
        self.rows, self.doc_causal = rows, doc_causal
        self.used, self.pos = np.unique(length_ix, return_inverse=True)     # distinct padded lengths, row -> index
        self.fwd = tuple(c[:, self.used] for c in costs["F"])              # (alpha, beta, gamma) of F
        self.bwd = tuple(c[:, self.used] for c in costs["B"])
        self.alpha, self.beta, self.gamma = (f + b for f, b in zip(self.fwd, self.bwd))
        self.bmax = bmax_by_length[length_ix]
        # per start row, the bottleneck time affine in rows, taking every row as packed as the first:
        # rows of one document share their length's line; each packed row has its own (classes)
        saving = np.where((np.diff(rows.packed_cum) > 0) & doc_causal,
                          rows.padded.astype(np.float64) ** 2 - np.diff(rows.work_cum), 0.0)
        packed = np.flatnonzero(saving > 0)
        self.row_class = self.pos.copy()
        self.row_class[packed] = len(self.used) + np.arange(len(packed))
        p_ix = self.pos[packed]
        self.alpha_cls = np.concatenate([self.alpha, self.alpha[:, p_ix]], axis=1)
        beta_packed = self.beta[:, p_ix] - self.gamma[:, p_ix] * saving[packed]
        self.beta_cls = np.maximum(np.concatenate([self.beta, beta_packed], axis=1), 1e-15)
        self.bmax_cls = np.concatenate([bmax_by_length[self.used], bmax_by_length[self.used][p_ix]])
        present = np.zeros(self.alpha_cls.shape[1], dtype=bool)
        present[self.row_class] = True                          # classes some row belongs to
        self.present = np.flatnonzero(present)

    def saving(self, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """rows x padded_len^2 minus the attention work of the microbatches [start, end)."""
        full = (end - start) * self.rows.padded[np.minimum(start, len(self.pos) - 1)].astype(np.float64) ** 2
        return full - self.rows.attention(start, end, self.doc_causal)

    def bottleneck(self, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """Bottleneck-stage F + B of the microbatches of rows [start, end) (broadcast)."""
        p = self.pos[start]
        saving = self.saving(start, end)
        return (self.alpha[:, p] + self.beta[:, p] * (end - start) - self.gamma[:, p] * saving).max(axis=0)

    def tau_grid(self, num_tau: int) -> np.ndarray:
        """Geometric time targets from one row's to the largest microbatch's bottleneck time, then inf."""
        a, b = self.alpha_cls[:, self.present], self.beta_cls[:, self.present]
        most = np.minimum(self.bmax_cls[self.present], len(self.pos))
        lo = float((a + b).max(axis=0).min())
        hi = float((a + b * most).max(axis=0).max())
        return np.append(np.geomspace(lo, hi, num_tau) if hi > lo * 1.0001 else [hi], np.inf)

    def greedy_cuts(self, tau: float, from_short_end: bool = False) -> np.ndarray:
        """The greedy split under the memory cap and the time target ``tau``."""
        bcap = self.bmax
        if np.isfinite(tau):
            with np.errstate(divide="ignore", invalid="ignore"):
                by_time = np.floor(((tau - self.alpha_cls) / self.beta_cls).min(axis=0))
            bcap = np.minimum(bcap, np.clip(by_time, 1, len(self.pos)).astype(np.int64)[self.row_class])
        return greedy_cuts_from_short_end(bcap) if from_short_end else greedy_cuts(bcap)

    def costs(self, cuts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(F, B)[P, m] of the microbatches of the split from the affine costs, in split order."""
        start, end = cuts[:-1], cuts[1:]
        first, rows, saving = self.pos[start], np.diff(cuts), self.saving(start, end)
        return tuple(c[0][:, first] + c[1][:, first] * rows - c[2][:, first] * saving for c in (self.fwd, self.bwd))

    def shapes(self, cuts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, padded_len, attention work) of each microbatch of the split, in split order."""
        start, end = cuts[:-1], cuts[1:]
        return np.diff(cuts), self.rows.padded[start], self.rows.attention(start, end, self.doc_causal)



@dataclass(eq=False)
class _Cand:
    """One candidate plan: per-microbatch shapes in its own order, how to emit it, its ranking."""

    rows: np.ndarray
    padded: np.ndarray
    attn: np.ndarray
    emit: Callable[[np.ndarray], Flat]      # the flat form run in the given order
    source: tuple | None = None             # own splits: (row set, cuts before balancing, tau)
    baseline: str = ""                      # the method whose plan this is, as that method makes it
    opened: np.ndarray | None = None        # one best-fit row per microbatch: the order they were opened in
    split: tuple | None = None              # own splits: (row set, cuts after balancing)
    F: np.ndarray | None = None             # costs, while it is being estimated
    B: np.ndarray | None = None
    comm: np.ndarray | None = None
    value: float = np.inf                   # best estimate found (ranking: on the probe replicas)
    order: str = ""                         # the order that gave it


def dynamic_groups(lengths: np.ndarray, bmax_fn: Callable[[np.ndarray], np.ndarray], cost_model: CostModelLike,
                   num_stages: int, schedule_kind: str = "1f1b", comm: Any = None, *, round_to: int = 1,
                   max_len: int | None = None, attention: str = "auto", dp: int = 1,
                   baselines: Callable[[str], Flat] | None = None, num_tau: int = 4, keep: int = 3,
                   tol: float = 0.0) -> tuple[Flat, float]:
    """Microbatches (in execution order) of the global batch ``lengths`` and their estimated makespan
    (the slowest of ``dp`` replicas, as ``dynmb.packing`` assigns them).

    ``bmax_fn(padded_lens)``: the most rows admissible per padded length. Every padded_len is
    a multiple of ``round_to``; packed rows hold at most ``max_len`` tokens (a multiple of
    ``round_to``; default: no cap beyond the longest length). ``attention``: the model's
    attention setting (``auto``: packed microbatches cost sum(s_i^2)). ``baselines(method)``:
    the plan (flat form, in its order) ``method`` makes of the same batch, for the methods of
    ``BASELINES``. Among plans whose estimate is within ``tol`` (relative) of the best, the one
    with the fewest microbatches is kept (less per-microbatch runtime overhead the cost model may miss).
    """
    doc_causal = attention == "auto"
    n = len(lengths)
    top = round_up(int(lengths.max()), round_to) if max_len is None else int(max_len)
    asc = np.argsort(lengths, kind="stable")
    row_sets = [_rows(lengths, asc, None, round_to)]
    caps = _caps(lengths, top, round_to)[1:]
    for cap in caps:
        row_sets.append(_rows(lengths, asc, cap, round_to))
    if caps and caps[-1] == top and n <= BFD_MAX:
        row_sets.append(_rows(lengths, asc, top, round_to, best_fit=True))
    row_sets = [r for r in row_sets if r.key == "none" or len(r.tokens) < n]   # packing changed something
    uniq, inv = np.unique(np.concatenate([r.padded for r in row_sets]), return_inverse=True)
    costs = _affine_costs(cost_model, uniq)
    bmax_u = np.maximum(bmax_fn(uniq), 1)
    setups: dict[str, _Setup] = {}
    offset = 0
    for rows in row_sets:
        setups[rows.key] = _Setup(rows, inv[offset:offset + len(rows.tokens)], costs, bmax_u, doc_causal)
        offset += len(rows.tokens)
    rk = _Ranker(cost_model, num_stages, schedule_kind, comm, dp, setups, lengths, doc_causal, bmax_fn)
    grids = {key: st.tau_grid(num_tau if n > 1024 else num_tau + 3) for key, st in setups.items()}
    first = [(key, st.greedy_cuts(tau), tau) for key, st in setups.items() for tau in grids[key]]
    for key, st in setups.items():
        if st.rows.opened is not None:                                  # one best-fit row per microbatch
            first.append((key, np.arange(len(st.pos) + 1), np.nan))
    given: dict[str, Flat] = {}
    if baselines is not None:
        given = {m: baselines(m) for m in BASELINES
                 if not (m == "dynapipe" and n > SEED_DP_MAX) and not (m == "packed" and n > BFD_MAX)}
    elif n <= SEED_DP_MAX:        # called alone: the fixed-size and DP splits of the sorted rows
        unpacked = setups["none"]
        m0 = len(unpacked.pos)
        first.append(("none", np.append(np.arange(0, m0, max(1, int(unpacked.bmax[0]))), m0), np.nan))
        dp_cuts = dynapipe_split(unpacked.rows.padded[::-1], unpacked.bmax[::-1], cost_model, num_stages)
        first.append(("none", m0 - dp_cuts[::-1], np.nan))
    for m in ("sorted", "dynapipe"):            # the seeds above, as those methods made them
        cuts = _sorted_cuts(given[m], setups["none"].rows.padded, m == "dynapipe") if m in given else None
        if cuts is not None:
            first.append(("none", cuts, np.nan))
    own = rk.rank([rk.own(*x) for x in {(x[0], x[1].tobytes()): x for x in first}.values()])
    base = rk.rank([c for c in (rk.baseline(m, f) for m, f in given.items()) if c is not None])
    own += rk.rank(_refined(own, setups, grids, num_tau, rk))
    best = sorted((c for c in own if np.isfinite(c.value)), key=lambda c: c.value)
    finals = best[:keep] + sorted((c for c in best if c.value <= best[0].value * (1 + tol)),
                                  key=lambda c: len(c.rows))[:keep] if best else []
    if not finals and not base:                      # nothing balances over dp: leave it to dynmb.packing
        c = rk.own(*first[0], balance=False)
        return c.emit(np.arange(len(c.rows))), np.inf
    return rk.choose(list({id(c): c for c in finals + base}.values()), tol)


def _sorted_cuts(flat: Flat, padded: np.ndarray, reverse: bool) -> np.ndarray | None:
    """Cut points over the unpacked rows (longest first, padded to ``padded``) of a plan of
    one sequence per row, its microbatches (reversed if ``reverse``) taking the rows in turn, if
    that gives each microbatch its own shape (runs of the sorted sequences, longest first);
    else None."""
    _, _, nseq, plen, batch = flat
    order = np.arange(len(nseq))[::-1] if reverse else np.arange(len(nseq))
    cuts = np.concatenate([[0], np.cumsum(batch[order])])
    return cuts if np.all(nseq == batch) and np.array_equal(padded[cuts[:-1]], plen[order]) else None


def _refined(own: list[_Cand], setups: dict[str, _Setup], grids: dict[str, np.ndarray], num_tau: int,
             rk: _Ranker) -> list[_Cand]:
    """Second-pass splits around the best ranked: tau refined between the grid neighbours of the
    best's, the best three's targets filled from the short end, the best two polished."""
    ranked = sorted((c for c in own if np.isfinite(c.value) and c.source is not None), key=lambda c: c.value)
    out: list[tuple] = []
    if ranked and np.isfinite(ranked[0].source[2]):
        key, _, tau = ranked[0].source
        grid = grids[key]
        k = int(np.searchsorted(grid, tau))
        lo_t, hi_t = grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 2)]
        if hi_t > lo_t:
            for t in np.geomspace(lo_t, hi_t, num_tau + 2)[1:-1]:
                out.append((key, setups[key].greedy_cuts(t), t))
    for c in ranked[:3]:
        key, _, tau = c.source
        if not np.isnan(tau):
            out.append((key, setups[key].greedy_cuts(tau, from_short_end=True), tau))
    for c in ranked[:2]:
        key, cuts, tau = c.source
        if len(cuts) - 1 <= 256:
            st = setups[key]
            out.append((key, polish_cuts(cuts, st.bottleneck, st.bmax), tau))
    seen = {(c.source[0], c.source[1].tobytes()) for c in own if c.source is not None}
    fresh = {(x[0], x[1].tobytes()): x for x in out if (x[0], x[1].tobytes()) not in seen}
    return [rk.own(*x) for x in fresh.values()]


class _Ranker:
    """Costs, orders and estimates candidates for ``num_stages`` stages and ``dp`` replicas."""

    def __init__(self, cost_model: CostModelLike, num_stages: int, kind: str, comm: Any, dp: int,
                 setups: dict[str, _Setup], lengths: np.ndarray, doc_causal: bool, bmax_fn: Callable) -> None:
        self.cm, self.P, self.kind, self.comm_fn, self.dp = cost_model, num_stages, kind, comm, dp
        self.setups, self.lengths, self.doc_causal, self.bmax_fn = setups, lengths, doc_causal, bmax_fn

    def _send(self, rows: np.ndarray, padded: np.ndarray) -> np.ndarray:
        sends = self.comm_fn(rows, padded) if self.comm_fn is not None else 0.0
        return np.broadcast_to(np.asarray(sends, dtype=np.float64), rows.shape).copy()

    def own(self, key: str, cuts: np.ndarray, tau: float, balance: bool = True) -> _Cand:
        """A split of row set ``key``, its slowest microbatches halved until dp divides their number."""
        st = self.setups[key]
        bal = _balance_cuts(cuts, st.bottleneck, self.dp) if balance else cuts
        if bal is None:
            return _Cand(np.zeros(0, np.int64), np.zeros(0), np.zeros(0), lambda o: None, source=(key, cuts, tau))
        rows, padded, attn = st.shapes(bal)
        return _Cand(rows, padded, attn, lambda o, r=st.rows, c=bal: _to_flat(r, c, o), source=(key, cuts, tau),
                     opened=st.rows.opened if len(bal) - 1 == len(st.pos) else None, split=(key, bal))

    def baseline(self, method: str, flat: Flat) -> _Cand | None:
        """``method``'s plan (flat form) balanced over dp as ``dynmb.packing`` does (None if it cannot)."""
        flat = _balance_like_packing(flat, self.dp, self.bmax_fn)
        if flat is None:
            return None
        items, _, nseq, plen, batch = flat
        attn = batch * plen.astype(np.float64) ** 2
        if self.doc_causal:
            docs2 = np.add.reduceat(self.lengths[items].astype(np.float64) ** 2, np.cumsum(nseq) - nseq)
            attn = np.where(nseq > batch, docs2, attn)
        return _Cand(batch, plen, attn, lambda o, f=flat: _reorder(f, o), baseline=method)

    def costed(self, cands: list[_Cand], affine: bool) -> Iterator[_Cand]:
        """``cands`` in turn with their costs set while they are used: an own split's affine costs
        when ``affine``, else ``stage_costs`` with each microbatch's attention work, one lookup
        for as many candidates in a row as fit ``LOOKUP_CELLS`` (stage, microbatch) cells."""
        todo, i = [c for c in cands if len(c.rows)], 0
        while i < len(todo):
            chunk, cells = [todo[i]], len(todo[i].rows) * self.P
            if affine and todo[i].split is not None:
                c = todo[i]
                (c.F, c.B), c.comm = self.setups[c.split[0]].costs(c.split[1]), self._send(c.rows, c.padded)
            else:
                while (i + len(chunk) < len(todo) and not (affine and todo[i + len(chunk)].split is not None)
                       and cells + len(todo[i + len(chunk)].rows) * self.P <= LOOKUP_CELLS):
                    chunk.append(todo[i + len(chunk)])
                    cells += len(chunk[-1].rows) * self.P
                rows, padded, attn = (np.concatenate(a) for a in zip(*((x.rows, x.padded, x.attn) for x in chunk)))
                cc, sends = self.cm.stage_costs(rows, padded, attn), self._send(rows, padded)
                bounds = np.cumsum([0] + [len(x.rows) for x in chunk])
                for x, a, e in zip(chunk, bounds[:-1], bounds[1:]):
                    x.F, x.B, x.comm = cc["F"][:, a:e], cc["B"][:, a:e], sends[a:e]
            for x in chunk:
                yield x
                x.F = x.B = x.comm = None
            i += len(chunk)

    def _members(self, c: _Cand, exact_assignment: bool) -> tuple[np.ndarray, np.ndarray]:
        """(replicas x microbatches in split order, busy time of each microbatch)."""
        busy = (c.F + c.B).max(axis=0)
        if self.dp == 1:
            return np.arange(len(busy))[None, :], busy
        if exact_assignment:
            order, _ = assign_replicas(busy, self.dp)
            return np.asarray(order).reshape(self.dp, -1), busy
        return np.argsort(_deal(busy, self.dp), kind="stable").reshape(self.dp, -1), busy

    def _probes(self, c: _Cand, members: np.ndarray) -> np.ndarray:
        """The replica with the most work on its busiest stage and the one with the longest round trip."""
        if len(members) == 1:
            return members
        T = c.F + c.B
        work = T[:, members].sum(axis=2).max(axis=0)
        trip = (T.sum(axis=0) + 2 * (self.P - 1) * c.comm)[members].max(axis=1)
        return members[np.unique([int(np.argmax(work)), int(np.argmax(trip))])]

    def rank(self, cands: list[_Cand]) -> list[_Cand]:
        """Each candidate's best estimate over its orders on its probe replicas: exact (``makespans``)
        for the best by proxy within ``RANK_OPS`` ops (baselines and small ones always). Only the
        probe replicas' costs are kept."""
        cands = [c for c in cands if len(c.rows)]
        jobs = []                        # (candidate, order, (F, B, sends) of its probe replicas, columns)
        for c in self.costed(cands, affine=True):
            members, busy = self._members(c, exact_assignment=bool(c.baseline))
            used, local = (np.unique(self._probes(c, members), return_inverse=True) if self.dp > 1
                           else (np.arange(members.shape[1]), members))
            sub, local = (c.F[:, used], c.B[:, used], c.comm[used]), local.reshape(-1, members.shape[1])
            opened = c.opened[used] if c.opened is not None else None
            if exact_regime(self.P, members.shape[1]):
                jobs += [(c, name, sub, cols) for name, cols in _orders(local, busy[used], opened).items()]
                continue
            # the bound: the same work in every order, only the first and last microbatches differ
            work, sends = (sub[0] + sub[1])[:, local].sum(axis=2), sub[2][local].mean(axis=1)
            for name, (first, last) in _order_ends(local, busy[used], opened).items():
                v = float(_bound(work, sub[0][:, first], sub[1][:, last], sends).max())
                if v < c.value:
                    c.value, c.order = v, name
        proxy = np.array([_proxy(*sub, cols).max() for _, _, sub, cols in jobs])
        chosen, spent, budget = [], 0, RANK_OPS * min(1.0, self.P / 16)
        for j in np.argsort(proxy, kind="stable").tolist():
            c, _, _, cols = jobs[j]
            cells = self.P * cols.shape[1]
            ops = 2 * cells * len(cols)
            if c.baseline or cells <= RANK_EXACT or spent + ops <= budget:
                chosen.append(j)
                spent += ops
        for j, v in zip(chosen, self._estimate([jobs[j][2:] for j in chosen])):
            c, name = jobs[j][:2]
            if v < c.value:
                c.value, c.order = v, name
        return cands

    def _estimate(self, jobs: list[tuple]) -> list[float]:
        """Per job ``((F, B, sends), [pipelines, k] columns)``: the slowest of its pipelines by
        ``makespans``, all in one call."""
        if not jobs:
            return []
        F = np.concatenate([s[0][:, cols.ravel()] for s, cols in jobs], axis=1)
        B = np.concatenate([s[1][:, cols.ravel()] for s, cols in jobs], axis=1)
        sends = np.concatenate([s[2][cols.ravel()] for s, cols in jobs])
        sizes = np.concatenate([np.full(len(cols), cols.shape[1]) for _, cols in jobs])
        per = makespans(F, B, sends, sizes, self.kind)
        bounds = np.cumsum([0] + [len(cols) for _, cols in jobs])
        return [float(per[a:e].max()) for a, e in itertools.pairwise(bounds)]

    def _slowest(self, costs: tuple, cols: np.ndarray, limit: float, inclusive: bool) -> float:
        """The slowest replica's estimate (replicas: rows of ``cols``), the likeliest by proxy
        first: past ``limit`` (or at it, unless ``inclusive``) already, the others are left out
        (the value is then a lower bound)."""
        likely = np.argsort(-_proxy(*costs, cols), kind="stable")
        head = self._estimate([(costs, cols[likely[:max(2, len(cols) // 8)]])])[0]
        if head > limit or (head == limit and not inclusive) or len(likely) <= 2:
            return head
        return max(head, self._estimate([(costs, cols[likely[max(2, len(cols) // 8):]])])[0])

    def choose(self, finals: list[_Cand], tol: float) -> tuple[Flat, float]:
        """The plan and estimate of the fastest of ``finals``, re-costed in one lookup and
        estimated on every replica as ``dynmb.packing`` will run them."""
        results = []                                   # (value, microbatches, candidate, order returned)
        if self.dp == 1:
            jobs = [(c, (c.F, c.B, c.comm), cols) for c in self.costed(finals, affine=False)
                    for cols in ([np.arange(len(c.rows))[None]] if c.baseline else
                                 _orders(*self._members(c, True), c.opened).values())]
            for (c, _, cols), v in zip(jobs, self._estimate([job[1:] for job in jobs])):
                results.append((v, len(c.rows), c, cols[0]))
        else:
            best, best_m, seen = np.inf, np.inf, set()
            for c in self.costed(sorted(finals, key=lambda c: c.value), affine=False):
                sig = (c.baseline, c.order, c.rows.tobytes(), c.padded.tobytes(), c.attn.tobytes())
                if sig in seen:
                    continue                            # the same plan run the same way
                seen.add(sig)
                busy, m = (c.F + c.B).max(axis=0), len(c.rows)
                # what dynmb.packing will run: a baseline as given, else its order (each replica keeps it)
                out = np.arange(m) if c.baseline else _global_order(c.order, busy, self._members(c, True)[0], c.opened)
                order, _ = assign_replicas(busy[out], self.dp)
                fewer = m < best_m                      # it may also win by tying (or within tol)
                limit = best * (1 + tol) if fewer else best
                v = self._slowest((c.F, c.B, c.comm), out[np.asarray(order)].reshape(self.dp, -1), limit, fewer)
                if v < limit or (v == limit and fewer):
                    results.append((v, m, c, out))
                    best, best_m = (v, m) if v < best else (best, min(best_m, m))
        best_t = min(r[0] for r in results)
        v, _, c, out = min((r for r in results if r[0] <= best_t * (1 + tol)), key=lambda r: (r[1], r[0]))
        return c.emit(out), float(v)


def _deal(busy: np.ndarray, dp: int) -> np.ndarray:
    """Replica of each microbatch while ranking: slowest first, dealt boustrophedon (m / dp each)."""
    pos = np.empty(len(busy), dtype=np.int64)
    pos[np.argsort(-busy, kind="stable")] = np.arange(len(busy))
    r = pos % (2 * dp)
    return np.where(r < dp, r, 2 * dp - 1 - r)


def _orders(members: np.ndarray, t: np.ndarray, opened: np.ndarray | None) -> dict[str, np.ndarray]:
    """Execution orders of each row of ``members`` (a replica's microbatches, as formed): as
    formed, reversed, slowest / fastest first (by ``t``), the two cheapest at the two ends (the
    rest as formed or reversed); best-fit rows also as opened. Repeats dropped."""
    k = members.shape[1]
    by_t = np.take_along_axis(members, np.argsort(-t[members], axis=1, kind="stable"), axis=1)
    out = {"as formed": members, "reversed": members[:, ::-1], "slowest first": by_t, "fastest first": by_t[:, ::-1]}
    if k >= 3:
        cheap = np.argpartition(t[members], 1, axis=1)[:, :2]
        mid = np.ones(members.shape, dtype=bool)
        np.put_along_axis(mid, cheap, False, axis=1)
        ends, rest = np.take_along_axis(members, cheap, axis=1), members[mid].reshape(-1, k - 2)
        out["ends"] = np.concatenate([ends[:, :1], rest, ends[:, 1:]], axis=1)
        out["ends, reversed"] = np.concatenate([ends[:, :1], rest[:, ::-1], ends[:, 1:]], axis=1)
    if opened is not None:
        out["as opened"] = np.take_along_axis(members, np.argsort(opened[members], axis=1, kind="stable"), axis=1)
    unique: dict[bytes, tuple[str, np.ndarray]] = {}
    for name, cols in out.items():
        unique.setdefault(cols.tobytes(), (name, cols))
    return dict(unique.values())


def _order_ends(members: np.ndarray, t: np.ndarray, opened: np.ndarray | None) -> dict[str, tuple]:
    """(first, last) microbatch of each row of ``members`` in each order of ``_orders``."""
    rows = np.arange(len(members))
    tm = t[members]
    slow, fast = np.argmax(tm, axis=1), members.shape[1] - 1 - np.argmin(tm[:, ::-1], axis=1)
    out = {"as formed": (members[:, 0], members[:, -1]), "reversed": (members[:, -1], members[:, 0]),
           "slowest first": (members[rows, slow], members[rows, fast]),
           "fastest first": (members[rows, fast], members[rows, slow])}
    if members.shape[1] >= 3:
        cheap = np.take_along_axis(members, np.argpartition(tm, 1, axis=1)[:, :2], axis=1)
        out["ends"] = (cheap[:, 0], cheap[:, 1])
    if opened is not None:
        om = opened[members]
        out["as opened"] = (members[rows, np.argmin(om, axis=1)], members[rows, np.argmax(om, axis=1)])
    return out


def _global_order(name: str, busy: np.ndarray, members: np.ndarray, opened: np.ndarray | None) -> np.ndarray:
    """The order ``name`` of ``_orders`` for all microbatches at once, so that every replica keeps
    it whichever identical microbatches ``assign_replicas`` deals it (it breaks ties by position):
    as formed, reversed, by time, as opened; the two cheapest of each replica of ``members`` first
    and last, the rest as formed or reversed ("ends")."""
    m = len(busy)
    by_t = np.argsort(-busy, kind="stable")
    if name.startswith("ends") and members.shape[1] >= 3:
        ends = np.take_along_axis(members, np.argpartition(busy[members], 1, axis=1)[:, :2], axis=1)
        mid = np.ones(m, dtype=bool)
        mid[ends.ravel()] = False
        rest = np.flatnonzero(mid)
        return np.concatenate([ends[:, 0], rest[::-1] if name == "ends, reversed" else rest, ends[:, 1]])
    if name == "as opened" and opened is not None:
        return np.argsort(opened, kind="stable")
    return {"reversed": np.arange(m)[::-1], "slowest first": by_t, "fastest first": by_t[::-1]}.get(name, np.arange(m))


def _bound(work: np.ndarray, first_F: np.ndarray, last_B: np.ndarray, sends: np.ndarray) -> np.ndarray:
    """``pipeline_bound`` of pipelines side by side: ``work``, ``first_F``, ``last_B`` [P, n],
    ``sends`` [n] (mean send time of each)."""
    zero = np.zeros((1, work.shape[1]))
    fill = np.concatenate([zero, np.cumsum(first_F[:-1] + sends, axis=0)])
    drain = np.concatenate([zero, np.cumsum(last_B[:-1] + sends, axis=0)])
    return (work + fill + drain).max(axis=0)


def _proxy(F: np.ndarray, B: np.ndarray, comm: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Ranking proxy of each pipeline of ``cols`` ([pipelines, k] columns in order): the larger
    of ``pipeline_bound`` and the longest chain of round trips of microbatches P apart."""
    P, k = F.shape[0], cols.shape[1]
    Fo, Bo, c = F[:, cols], B[:, cols], comm[cols]                   # [P, n, k], [n, k]
    bound = _bound((Fo + Bo).sum(axis=2), Fo[:, :, 0], Bo[:, :, -1], c.mean(axis=1))
    trip = (Fo + Bo).sum(axis=0) + 2 * (P - 1) * c                    # [n, k]
    pad = -k % P
    chains = np.concatenate([trip, np.zeros((len(cols), pad))], axis=1).reshape(len(cols), -1, P).sum(axis=1)
    return np.maximum(bound, chains.max(axis=1))


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
    count = len(flat[2])
    if not (count % dp or count < dp):
        return flat
    heap = [(-g[3], -len(g[0]), (j,), g) for j, g in enumerate(flat_to_groups(flat))]
    heapq.heapify(heap)
    while (count % dp or count < dp) and (heap[0][0] <= -2 or heap[0][1] <= -2):
        _, _, key, g = heapq.heappop(heap)
        for half, part in enumerate(split_group(g)):
            heapq.heappush(heap, (-part[3], -len(part[0]), key + (half,), part))
        count += 1
    groups = [g for *_, g in sorted(heap, key=lambda x: x[2])]
    while len(groups) % dp:
        plen, rows = np.array([g[2] for g in groups]), np.array([g[3] for g in groups])
        bm = bmax_fn(plen)
        i, j = np.triu_indices(len(groups), 1)
        ok = rows[i] + rows[j] <= np.minimum(bm[i], bm[j])
        if not np.any(ok) or len(groups) <= dp:
            return None
        k = int(np.argmin(np.where(ok, np.maximum(plen[i], plen[j]) * (rows[i] + rows[j]), np.inf)))
        a, b = groups[i[k]], groups[j[k]]
        merged = (np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1] + a[3]]), max(a[2], b[2]), a[3] + b[3])
        groups = [g for q, g in enumerate(groups) if q not in (i[k], j[k])] + [merged]
    return groups_to_flat(groups)


def _reorder(flat: Flat, order: np.ndarray) -> Flat:
    """The flat form with its microbatches run in ``order``."""
    items, local, nseq, plen, batch = flat
    order = np.asarray(order, dtype=np.int64)
    start = np.cumsum(nseq) - nseq
    counts = nseq[order]
    idx = np.repeat(start[order] - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))
    return items[idx], local[idx], counts, plen[order], batch[order]


def _to_flat(rows: _RowSet, cuts: np.ndarray, order: np.ndarray) -> Flat:
    """The flat form of the split ``cuts`` of ``rows`` run in ``order``."""
    mb_of_item = np.searchsorted(cuts, rows.row, side="right") - 1
    pos_of_mb = np.empty(len(order), dtype=np.int64)
    pos_of_mb[order] = np.arange(len(order))
    items = np.argsort(pos_of_mb[mb_of_item], kind="stable")
    local = rows.row[items] - cuts[mb_of_item[items]]
    nseq = np.bincount(pos_of_mb[mb_of_item], minlength=len(order))
    return items, local, nseq, rows.padded[cuts[:-1]][order], np.diff(cuts)[order]
