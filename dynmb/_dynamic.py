"""The ``dynamic`` packer: memory- and cost-aware microbatches planned for the schedule.

Algorithm:

1. Rows. For a row capacity R, a sequence longer than R/2 gets its own row; the shorter
   ones, in ascending length order, are packed next-fit into rows of at most R tokens (one
   ``bisect`` per row), so neighbouring rows have similar lengths and a row wastes less
   than one of its short documents. R runs over "no packing" and up to three powers of two
   from 2x the median length up to the longest.
2. Microbatches. Rows sorted longest first; a microbatch is a contiguous run of rows padded
   to its longest. Its size is capped by memory (``bmax``, the per-microbatch budget of
   ``dynmb.packing``) and by a time target tau on the bottleneck stage's F + B, taken
   affine in rows from ONE cost lookup (``stage_costs`` at b = 1, 2 for every distinct row
   length). Greedy: each microbatch takes the most rows both caps allow, found for all
   rows at once by pointer doubling. tau sweeps a geometric grid per R, then a finer grid
   around the best; the best few are also filled from the short end.
3. Score: ``approx_makespan`` (busiest stage's work + warm-up of the cheapest microbatch
   + cool-down of the next cheapest), from per-length sums (O(P * lengths) per split).
4. Polish: the two best splits (m <= 256) get a boundary-shift DP (each cut moves by up
   to 4 rows to minimise the summed bottleneck time). The fixed-size split of the sorted
   rows is a candidate, and batches of <= ``SEED_DP_MAX`` sequences also add the DP split
   of ``dynmb._dynapipe``.
5. Choose: the best candidates are simulated exactly (``est_makespan``, the simulator's
   recurrence) when small, else by the estimate, in three orders (longest first,
   shortest first, the two cheapest at the two ends); the fastest is returned.
Cost: O(n log n) for sorting plus O(n) vectorised work per (R, tau) and O(rows) Python
steps for the row packing; no per-sequence Python loop.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ._packutil import approx_makespan, est_makespan, next_fit_rows

from ._dynapipe import dynapipe_split

SEED_DP_MAX = 512
"""Batches up to this many sequences also try the DP split of ``dynmb._dynapipe`` as a candidate."""
EXACT_TOP, EXACT_MAX = 3, 3000
"""The EXACT_TOP best larger candidates (by the estimate) are simulated exactly up to EXACT_MAX cells."""
RANK_EXACT = 400
"""Candidates with at most this many (stage, microbatch) cells are ranked by the exact simulation."""

__all__ = ["dynamic_groups"]

Flat = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""Microbatches in execution order: (item positions grouped by microbatch, local row id per
item, items per microbatch, padded_len per microbatch, rows per microbatch)."""


def _rows(lengths: np.ndarray, asc: np.ndarray, cap: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(row of each item, row lengths): rows numbered longest first, for capacity ``cap``
    (None: one sequence per row). ``asc`` sorts ``lengths`` ascending."""
    n = len(lengths)
    if cap is None:
        row = np.empty(n, dtype=np.int64)
        row[asc[::-1]] = np.arange(n)
        return row, lengths[asc[::-1]]
    k = int(np.searchsorted(lengths[asc], cap // 2, side="right"))
    short, long_ = asc[:k], asc[k:][::-1]
    row = np.empty(n, dtype=np.int64)
    row[long_] = np.arange(len(long_))
    if k:
        row[short] = len(long_) + next_fit_rows(lengths[short], cap)
    row_len = np.bincount(row, weights=lengths).astype(np.int64)
    ro = np.argsort(-row_len, kind="stable")
    rank = np.empty(len(ro), dtype=np.int64)
    rank[ro] = np.arange(len(ro))
    return rank[row], row_len[ro]


def _greedy(b_cap: np.ndarray) -> np.ndarray:
    """Cut points of the greedy split (from row a take ``b_cap[a] >= 1`` rows), found by
    pointer doubling: the path prefix doubles each round, O(n log m) vectorised work."""
    n = len(b_cap)
    jump = np.append(np.minimum(np.arange(n) + np.maximum(b_cap, 1), n), n)
    path = np.zeros(1, dtype=np.int64)
    while path[-1] < n:
        path = np.concatenate([path, jump[path]])
        jump = jump[jump]
    return np.append(path[path < n], n)


def _greedy_asc(b_cap: np.ndarray) -> np.ndarray:
    """Cut points of the greedy split from the short end: a microbatch ending at row e
    starts at the smallest a with a + b_cap[a] >= e (b_cap of its longest row a); the
    chain of starts from n is followed by pointer doubling like ``_greedy``."""
    n = len(b_cap)
    h = np.minimum.accumulate((np.arange(n) + np.maximum(b_cap, 1))[::-1])[::-1]
    e = np.arange(n + 1)
    back = np.minimum(np.searchsorted(h, e, side="left"), np.maximum(e - 1, 0))   # start of the mb ending at e
    path = np.array([n], dtype=np.int64)
    while path[-1] > 0:
        path = np.concatenate([path, back[path]])
        back = back[back]
    return np.append(path[path > 0], 0)[::-1].copy()


def _polish(cuts: np.ndarray, alpha: np.ndarray, beta: np.ndarray, bmax: np.ndarray, w: int = 4) -> np.ndarray:
    """Move each inner cut by up to ``w`` rows to minimise the summed bottleneck time
    ``sum_k max_i (alpha[i, a_k] + beta[i, a_k] * rows_k)`` (alpha/beta per stage and start
    row): a DP over the m cuts with 2w + 1 positions each, O(P m w^2) vectorised work."""
    n, m = int(cuts[-1]), len(cuts) - 1
    if m < 2:
        return cuts
    d = np.arange(-w, w + 1)
    pos = np.clip(cuts[:, None] + d[None, :], 0, n)            # [m+1, W] candidate positions
    pos[0], pos[-1] = 0, n
    start = np.minimum(pos[:-1], n - 1)                         # [m, W]
    rows = pos[1:, None, :] - pos[:-1, :, None]                 # [m, W(start), W(end)]
    t = (alpha[:, start][..., None] + beta[:, start][..., None] * rows[None]).max(axis=0)
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


def _caps(lengths: np.ndarray) -> list[int | None]:
    """No packing, then powers of two from 2x the median up to the longest (at most 3)."""
    lmax = int(lengths.max())
    med = float(np.median(lengths))
    caps: list[int | None] = [None]
    r = 64
    while r < 2 * lmax and len(caps) < 4:
        if r >= 2 * med and r >= 2 * int(np.percentile(lengths, 25)):
            caps.append(r)
        r *= 2
    return caps


def dynamic_groups(lengths: np.ndarray, bmax_fn: Callable[[np.ndarray], np.ndarray], cost_model: Any,
                   num_stages: int, schedule_kind: str = "1f1b", comm: Any = None,
                   num_tau: int = 4, keep: int = 3, tol: float = 0.0) -> tuple[Flat, float]:
    """Microbatches (in execution order) of the global batch ``lengths`` and their estimated makespan.

    Among splits whose estimate is within ``tol`` (relative) of the best, the one with the
    fewest microbatches is kept (less per-microbatch runtime overhead the cost model may miss).
    """
    cands = []
    asc = np.argsort(lengths, kind="stable")
    for cap in _caps(lengths):
        row, rl = _rows(lengths, asc, cap)
        if cap is not None and len(rl) == len(lengths):
            continue                                              # packing changed nothing
        cands.append((cap, row, None, rl))
    # one cost lookup for every distinct row length at b = 1 and b = 2 (affine in b)
    uniq, inv = np.unique(np.concatenate([c[3] for c in cands]), return_inverse=True)
    cc = cost_model.stage_costs(np.concatenate([np.ones(len(uniq)), np.full(len(uniq), 2.0)]),
                                np.concatenate([uniq, uniq]).astype(np.float64))
    u = len(uniq)
    bF, bB = np.maximum(cc["F"][:, u:] - cc["F"][:, :u], 0), np.maximum(cc["B"][:, u:] - cc["B"][:, :u], 0)
    aF, aB = cc["F"][:, :u] - bF, cc["B"][:, :u] - bB
    bmax_u = np.maximum(bmax_fn(uniq), 1)
    scored = []
    off, offs, setups = 0, {}, {}
    for cap, row, ro, rl in cands:
        ix = inv[off:off + len(rl)]
        offs[cap] = off
        off += len(rl)
        used = np.unique(ix)                                      # distinct lengths of these rows
        alpha, beta = (aF + aB)[:, used], np.maximum((bF + bB)[:, used], 1e-15)
        setups[cap] = (row, ro, rl, ix, alpha, beta, bmax_u[ix], np.searchsorted(used, ix), set(), used,
                       aF[:, used], bF[:, used], aB[:, used], bB[:, used])

    def run(cap: Any, tau: float, asc: bool = False) -> None:
        row, ro, rl, ix, alpha, beta, bmax, pos, seen, used, aFu, bFu, aBu, bBu = setups[cap]
        if np.isfinite(tau):
            with np.errstate(divide="ignore", invalid="ignore"):
                bt = np.floor(((tau - alpha) / beta).min(axis=0))
            bcap = np.minimum(bmax, np.clip(bt, 1, len(rl)).astype(np.int64)[pos])
        else:
            bcap = bmax
        score_cuts(cap, _greedy_asc(bcap) if asc else _greedy(bcap), tau)

    def score_cuts(cap: Any, cuts: np.ndarray, tau: float) -> None:
        row, ro, rl, ix, alpha, beta, bmax, pos, seen, used, aFu, bFu, aBu, bBu = setups[cap]
        key = cuts.tobytes()
        if key in seen:
            return
        seen.add(key)
        b = np.diff(cuts)
        su = pos[cuts[:-1]]                                       # start row's length, as index into `used`
        w1 = np.bincount(su, minlength=len(used))
        wb = np.bincount(su, weights=b, minlength=len(used))
        work = alpha @ w1 + beta @ wb                             # busy time per stage
        tok = b * rl[cuts[:-1]]
        e = np.argpartition(tok, 1)[:2] if len(b) > 1 else np.array([0, 0])
        fF = aFu[:, su[e[0]]] + bFu[:, su[e[0]]] * b[e[0]]      # cheapest microbatch first ...
        lB = aBu[:, su[e[1]]] + bBu[:, su[e[1]]] * b[e[1]]      # ... and the next cheapest last
        c = float(np.mean(comm(b, rl[cuts[:-1]]))) if comm is not None else 0.0
        fill = np.concatenate([[0.0], np.cumsum(fF[:-1] + c)])
        drain = np.concatenate([[0.0], np.cumsum(lB[:-1] + c)])
        scored.append((float(np.max(work + fill + drain)), len(b), cap, ro, rl, row, cuts, tau))

    grids = {}
    for cap, (_, _, rl, _, alpha, beta, _b, _p, _s, used, *_rest) in setups.items():
        big = (alpha + beta * np.minimum(bmax_u[used], len(rl))).max(axis=0)
        lo, hi = float((alpha + beta).max(axis=0).min()), float(big.max())
        nt = num_tau if len(lengths) > 1024 else num_tau + 3
        grids[cap] = np.append(np.geomspace(lo, hi, nt) if hi > lo * 1.0001 else [hi], np.inf)
        for tau in grids[cap]:
            run(cap, tau)
    # refine tau around the best coarse point of the best row capacity
    best = min(scored, key=lambda x: x[0])
    g = grids[best[2]]
    k = int(np.searchsorted(g, best[7]))
    lo_t, hi_t = g[max(k - 1, 0)], g[min(k + 1, len(g) - 2)]
    if np.isfinite(best[7]) and hi_t > lo_t:
        for tau in np.geomspace(lo_t, hi_t, num_tau + 2)[1:-1]:
            run(best[2], tau)
    # the same caps filled from the short end (the remainder then falls on the long rows)
    for x in sorted(scored, key=lambda x: x[0])[:3]:
        run(x[2], x[7], asc=True)
    # polish the best few splits (boundary-shift DP on the summed bottleneck time)
    polished: list[tuple] = []
    for x in sorted(scored, key=lambda x: x[0])[:2]:
        if x[1] <= 256:
            _, _, cap, _, rl, _, cuts, tau = x
            ix, bm = setups[cap][3], setups[cap][6]
            new = _polish(cuts, (aF + aB)[:, ix], (bF + bB)[:, ix], bm)
            if not np.array_equal(new, cuts):
                score_cuts(cap, new, tau)
                polished.append(scored[-1])
    # the fixed-size split of the unpacked sorted rows (what ``sorted`` would do) is a candidate too
    if None in setups:
        rl, bm = setups[None][2], setups[None][6]
        cuts = np.append(np.arange(0, len(rl), max(1, int(bm[0]))), len(rl))
        score_cuts(None, cuts, np.nan)
        polished += [x for x in scored if x[2] is None and np.array_equal(x[6], cuts)][:1]
    # small batches: also seed with the DP split over unpacked rows (cheap at this size)
    if len(lengths) <= SEED_DP_MAX and None in setups:
        rl, bm = setups[None][2], setups[None][6]
        cuts = len(rl) - dynapipe_split(rl[::-1], bm[::-1], cost_model, num_stages)[::-1]
        score_cuts(None, cuts, np.nan)
        polished += [x for x in scored if x[2] is None and np.array_equal(x[6], cuts)][:1]
    best_obj = min(x[0] for x in scored)
    near = sorted((x for x in scored if x[0] <= best_obj * (1 + tol)), key=lambda x: x[1])[:keep]
    near += sorted(scored, key=lambda x: x[0])[:keep] + polished
    if len(lengths) <= SEED_DP_MAX:                                     # small batch: rank more exactly
        small = [x for x in scored if x[1] * num_stages <= RANK_EXACT]
        near += sorted(small, key=lambda x: x[0])[:4 * keep]
    results = []
    seen_near = set()
    for obj, m, cap, ro, rl, row, cuts, _tau in near:
        if (cap, cuts.tobytes()) in seen_near:
            continue
        seen_near.add((cap, cuts.tobytes()))
        ix = inv[offs[cap]:offs[cap] + len(rl)]
        st, rows_per, plen = ix[cuts[:-1]], np.diff(cuts), rl[cuts[:-1]]
        F, B = aF[:, st] + bF[:, st] * rows_per, aB[:, st] + bB[:, st] * rows_per
        cs = comm(rows_per, plen) if comm is not None else 0.0
        for order in _orders((F + B).max(axis=0)):
            c = np.asarray(cs)[order] if np.ndim(cs) else cs
            Fo, Bo = F[:, order], B[:, order]
            exact = est_makespan(Fo, Bo, c, schedule_kind) if Fo.size <= RANK_EXACT else None
            results.append((exact, approx_makespan(Fo, Bo, c), m, rl, row, cuts, order, Fo, Bo, c))
    # small ones were simulated exactly; of the rest, the best few by the estimate are simulated too
    rest = sorted((r for r in results if r[0] is None), key=lambda r: r[1])
    for k, r in enumerate(rest[:EXACT_TOP]):
        if r[7].size <= EXACT_MAX:
            rest[k] = (est_makespan(r[7], r[8], r[9], schedule_kind),) + r[1:]
    results = [r for r in results if r[0] is not None] + rest
    pool = [r for r in results if r[0] is not None] or results
    key = (lambda r: r[0]) if pool[0][0] is not None else (lambda r: r[1])
    best_t = min(key(r) for r in pool)
    t_sel = min((r for r in pool if key(r) <= best_t * (1 + tol)), key=lambda r: (r[2], key(r)))
    t, rl, row, cuts, order = key(t_sel), t_sel[3], t_sel[4], t_sel[5], t_sel[6]
    # row (numbered longest first) of each item -> microbatch (execution position) and local row
    item_rank = row
    mb_of_item = np.searchsorted(cuts, item_rank, side="right") - 1
    pos_of_mb = np.empty(len(order), dtype=np.int64)
    pos_of_mb[order] = np.arange(len(order))
    items = np.argsort(pos_of_mb[mb_of_item], kind="stable")
    mbi = mb_of_item[items]
    local = item_rank[items] - cuts[mbi]
    nseq = np.bincount(pos_of_mb[mb_of_item], minlength=len(order))
    return (items, local, nseq, rl[cuts[:-1]][order], np.diff(cuts)[order]), float(t)
