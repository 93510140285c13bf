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
3. Microbatches. The size is capped by memory (``bmax``, the per-microbatch budget of
   ``dynmb.packing``) and by a time target tau on the bottleneck stage's F + B (each
   start row's line, its own attention saving taken for every row). Greedy: each
   microbatch takes the most rows both caps allow, found for all rows at once by pointer
   doubling. tau sweeps a geometric grid per R, then a finer grid around the best; the
   best few are also filled from the short end.
4. Score: ``dynmb._packutil.pipeline_bound`` (busiest stage's work + warm-up of the cheapest
   microbatch + cool-down of the next cheapest), from per-length sums (O(P * lengths) per split).
5. Polish: the two best splits (m <= 256) get a boundary-shift DP (each cut moves by up
   to 4 rows to minimise the summed bottleneck time). Also candidates: the fixed-size
   split of the sorted rows (``sorted``'s), one best-fit row per microbatch (``packed``'s),
   and for batches of <= ``SEED_DP_MAX`` sequences the DP split of ``dynmb._dynapipe``.
6. Choose: the best candidates are re-costed in one ``stage_costs`` lookup with each
   microbatch's attention work and estimated in three orders (longest first, shortest
   first, the two cheapest at the two ends; best-fit rows also as opened, ``packed``'s
   order) on the value ``dynmb._packutil.makespan`` reports: the bound for large plans,
   else the simulator's recurrence (run for the small ones and the ``EXACT_TOP`` best by
   the bound of the rest, the others drop out); the fastest is returned.
Cost: O(n log n) for sorting plus O(n) vectorised work per (R, tau) and O(rows) Python
steps for the next-fit rows; a per-sequence Python loop only for the best-fit rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .dynapipe import dynapipe_split
from .rows import (EXACT_OPS, Flat, bfd_rows, greedy_cuts, greedy_cuts_from_short_end, makespan, next_fit_rows,
                        pipeline_bound, polish_cuts, round_down, round_up)

SEED_DP_MAX = 512
"""Batches up to this many sequences also try the DP split of ``dynmb._dynapipe`` as a candidate."""
EXACT_TOP = 2
"""Of the candidates ``makespan`` simulates exactly (2 * P * m <= EXACT_OPS) but larger than
RANK_EXACT cells, the EXACT_TOP best by the bound are simulated; the others drop out."""
RANK_EXACT = 400
"""Candidates with at most this many (stage, microbatch) cells are ranked by the exact simulation."""
BFD_MAX = 16384
"""Batches up to this many sequences also try rows of the longest admissible length filled
best-fit-decreasing (the rows of ``packed``; a Python loop per sequence)."""

__all__ = ["dynamic_groups"]


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


def _affine_costs(cost_model: Any, padded: np.ndarray) -> dict[str, np.ndarray]:
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


def _orders(t: np.ndarray) -> list[np.ndarray]:
    """Longest first (as formed), shortest first, and the two cheapest at the two ends."""
    m = len(t)
    desc = np.arange(m)
    outs = [desc, desc[::-1].copy()]
    if m >= 3:
        outs.append(_ends(t))
    return outs


def _ends(t: np.ndarray) -> np.ndarray:
    m = len(t)
    if m < 3:
        return np.arange(m)
    cheap = np.argpartition(t, 1)[:2]
    keep = np.ones(m, dtype=bool)
    keep[cheap] = False
    return np.concatenate([[cheap[0]], np.flatnonzero(keep), [cheap[1]]])


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

    def score(self, cuts: np.ndarray, comm: Any) -> float:
        """``pipeline_bound`` of the split from per-length sums: busiest stage's work, the
        cheapest microbatch's forwards first and the next cheapest's backwards last."""
        start, end = cuts[:-1], cuts[1:]
        rows, first = np.diff(cuts), self.pos[start]
        saving = self.saving(start, end)
        u = len(self.used)
        work = (self.alpha @ np.bincount(first, minlength=u) + self.beta @ np.bincount(first, rows, minlength=u)
                - self.gamma @ np.bincount(first, saving, minlength=u))
        padded = self.rows.padded[start]
        cheap = np.argpartition(rows * padded, 1)[:2] if len(rows) > 1 else np.array([0, 0])

        def op_time(coef: tuple, j: int) -> np.ndarray:
            return coef[0][:, first[j]] + coef[1][:, first[j]] * rows[j] - coef[2][:, first[j]] * saving[j]

        send = float(np.mean(comm(rows, padded))) if comm is not None else 0.0
        return pipeline_bound(work, op_time(self.fwd, cheap[0]), op_time(self.bwd, cheap[1]), send)

    def shapes(self, cuts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, padded_len, attention work) of each microbatch of the split, in split order."""
        start, end = cuts[:-1], cuts[1:]
        return np.diff(cuts), self.rows.padded[start], self.rows.attention(start, end, self.doc_causal)


def dynamic_groups(lengths: np.ndarray, bmax_fn: Callable[[np.ndarray], np.ndarray], cost_model: Any,
                   num_stages: int, schedule_kind: str = "1f1b", comm: Any = None, *, round_to: int = 1,
                   max_len: int | None = None, attention: str = "auto", num_tau: int = 4, keep: int = 3,
                   tol: float = 0.0) -> tuple[Flat, float]:
    """Microbatches (in execution order) of the global batch ``lengths`` and their estimated makespan.

    ``bmax_fn(padded_lens)``: the most rows admissible per padded length. Every padded_len is
    a multiple of ``round_to``; packed rows hold at most ``max_len`` tokens (a multiple of
    ``round_to``; default: no cap beyond the longest length). ``attention``: the model's
    attention setting (``auto``: packed microbatches cost sum(s_i^2)). Among splits whose
    estimate is within ``tol`` (relative) of the best, the one with the fewest microbatches
    is kept (less per-microbatch runtime overhead the cost model may miss).
    """
    doc_causal = attention == "auto"
    top = round_up(int(lengths.max()), round_to) if max_len is None else int(max_len)
    asc = np.argsort(lengths, kind="stable")
    row_sets = [_rows(lengths, asc, None, round_to)]
    caps = _caps(lengths, top, round_to)[1:]
    for cap in caps:
        row_sets.append(_rows(lengths, asc, cap, round_to))
    if caps and caps[-1] == top and len(lengths) <= BFD_MAX:
        row_sets.append(_rows(lengths, asc, top, round_to, best_fit=True))
    row_sets = [r for r in row_sets if r.key == "none" or len(r.tokens) < len(lengths)]   # packing changed something
    uniq, inv = np.unique(np.concatenate([r.padded for r in row_sets]), return_inverse=True)
    costs = _affine_costs(cost_model, uniq)
    bmax_u = np.maximum(bmax_fn(uniq), 1)
    setups: dict[str, _Setup] = {}
    offset = 0
    for rows in row_sets:
        setups[rows.key] = _Setup(rows, inv[offset:offset + len(rows.tokens)], costs, bmax_u, doc_causal)
        offset += len(rows.tokens)
    scored = _search(setups, lengths, cost_model, num_stages, comm, num_tau)
    row_set, cuts, order, est = _choose(scored, setups, len(lengths), cost_model, num_stages, schedule_kind, comm,
                                        keep, tol)
    return _to_flat(setups[row_set].rows, cuts, order), est


def _search(setups: dict[str, _Setup], lengths: np.ndarray, cost_model: Any, num_stages: int, comm: Any,
            num_tau: int) -> list[tuple]:
    """Candidate splits ``(score, num_microbatches, row set, cuts, tau, forced)`` of every row
    set; ``forced`` ones always reach the final ranking (polished splits, the baselines' splits)."""
    scored: list[tuple] = []
    where: dict[tuple, int] = {}

    def add(row_set: str, cuts: np.ndarray, tau: float, forced: bool = False) -> None:
        key = (row_set, cuts.tobytes())
        if key in where:                                        # seen: only mark it forced
            if forced:
                scored[where[key]] = scored[where[key]][:5] + (True,)
            return
        where[key] = len(scored)
        scored.append((setups[row_set].score(cuts, comm), len(cuts) - 1, row_set, cuts, tau, forced))

    grids = {}
    for row_set, st in setups.items():
        grids[row_set] = st.tau_grid(num_tau if len(lengths) > 1024 else num_tau + 3)
        for tau in grids[row_set]:
            add(row_set, st.greedy_cuts(tau), tau)
    # refine tau around the best coarse point of the best row set
    best = min(scored, key=lambda x: x[0])
    grid = grids[best[2]]
    k = int(np.searchsorted(grid, best[4]))
    lo_t, hi_t = grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 2)]
    if np.isfinite(best[4]) and hi_t > lo_t:
        for tau in np.geomspace(lo_t, hi_t, num_tau + 2)[1:-1]:
            add(best[2], setups[best[2]].greedy_cuts(tau), tau)
    # the same targets filled from the short end (the remainder then falls on the long rows)
    for x in sorted(scored, key=lambda x: x[0])[:3]:
        add(x[2], setups[x[2]].greedy_cuts(x[4], from_short_end=True), x[4])
    # polish the best few splits (boundary-shift DP on the summed bottleneck time)
    for x in sorted(scored, key=lambda x: x[0])[:2]:
        if x[1] <= 256:
            st = setups[x[2]]
            add(x[2], polish_cuts(x[3], st.bottleneck, st.bmax), x[4], forced=True)
    unpacked = setups["none"]
    n = len(unpacked.pos)
    # the fixed-size split of the unpacked sorted rows (what ``sorted`` would do) is a candidate too
    add("none", np.append(np.arange(0, n, max(1, int(unpacked.bmax[0]))), n), np.nan, forced=True)
    # one best-fit row of the longest admissible length per microbatch (what ``packed`` does)
    for key, st in setups.items():
        if st.rows.opened is not None:
            add(key, np.arange(len(st.pos) + 1), np.nan, forced=True)
    # small batches: also seed with the DP split over unpacked rows (cheap at this size)
    if len(lengths) <= SEED_DP_MAX:
        dp_cuts = dynapipe_split(unpacked.rows.padded[::-1], unpacked.bmax[::-1], cost_model, num_stages)
        add("none", n - dp_cuts[::-1], np.nan, forced=True)
    return scored


def _choose(scored: list[tuple], setups: dict[str, _Setup], num_seqs: int, cost_model: Any, num_stages: int,
            schedule_kind: str, comm: Any, keep: int, tol: float) -> tuple[str, np.ndarray, np.ndarray, float]:
    """(row set, cuts, execution order, estimated makespan) of the fastest of the best
    candidates, re-costed in one lookup and estimated with ``makespan`` in each order."""
    best_score = min(x[0] for x in scored)
    by_score = sorted(scored, key=lambda x: x[0])
    near = sorted((x for x in scored if x[0] <= best_score * (1 + tol)), key=lambda x: x[1])[:keep]
    near += by_score[:keep] + [x for x in scored if x[5]]
    if num_seqs <= SEED_DP_MAX:                                         # small batch: rank more exactly
        near += [x for x in by_score if x[1] * num_stages <= RANK_EXACT][:4 * keep]
    unique: dict[tuple, tuple] = {}
    for x in near:
        unique.setdefault((x[2], x[3].tobytes()), x)
    near = list(unique.values())
    # every candidate re-costed in one lookup with each microbatch's attention work
    rows, padded, attn = (np.concatenate(a) for a in zip(*(setups[x[2]].shapes(x[3]) for x in near)))
    costs = cost_model.stage_costs(rows, padded, attn)
    sends_all = np.broadcast_to(np.asarray(comm(rows, padded) if comm is not None else 0.0, dtype=np.float64),
                                rows.shape)
    bounds = np.cumsum([0] + [x[1] for x in near])
    results = []
    for (_score, m, row_set, cuts, _tau, _forced), a, e in zip(near, bounds[:-1], bounds[1:]):
        F, B, sends = costs["F"][:, a:e], costs["B"][:, a:e], sends_all[a:e]
        orders = _orders((F + B).max(axis=0))
        opened = setups[row_set].rows.opened
        if opened is not None and m == len(opened):                   # one row each: as opened too
            orders.append(np.argsort(opened, kind="stable"))
        for order in orders:
            c, Fo, Bo = sends[order], F[:, order], B[:, order]
            bound = makespan(Fo, Bo, c, schedule_kind, exact=False)
            # the value ``makespan`` will report: exact when small (computed now if cheap, else later)
            value = bound if 2 * Fo.size > EXACT_OPS else (
                makespan(Fo, Bo, c, schedule_kind, exact=True) if Fo.size <= RANK_EXACT else None)
            results.append([value, bound, m, row_set, cuts, order, Fo, Bo, c])
    # of those still to simulate exactly, the best few by the bound are; the rest drop out
    pending = sorted((r for r in results if r[0] is None), key=lambda r: r[1])
    for r in pending[:EXACT_TOP]:
        r[0] = makespan(r[6], r[7], r[8], schedule_kind, exact=True)
    pool = [r for r in results if r[0] is not None]
    best_t = min(r[0] for r in pool)
    sel = min((r for r in pool if r[0] <= best_t * (1 + tol)), key=lambda r: (r[2], r[0]))
    return sel[3], sel[4], sel[5], float(sel[0])


def _to_flat(rows: _RowSet, cuts: np.ndarray, order: np.ndarray) -> Flat:
    """The flat form of the split ``cuts`` of ``rows`` run in ``order``."""
    mb_of_item = np.searchsorted(cuts, rows.row, side="right") - 1
    pos_of_mb = np.empty(len(order), dtype=np.int64)
    pos_of_mb[order] = np.arange(len(order))
    items = np.argsort(pos_of_mb[mb_of_item], kind="stable")
    local = rows.row[items] - cuts[mb_of_item[items]]
    nseq = np.bincount(pos_of_mb[mb_of_item], minlength=len(order))
    return items, local, nseq, rows.padded[cuts[:-1]][order], np.diff(cuts)[order]
