"""The interleaved layer split balanced per GPU: chunks sized so that every GPU's total work is even.

With the interleaved schedule (``virtual = V`` > 1) the model is cut into ``S = P V`` contiguous chunks,
chunk ``s`` on GPU ``s % P`` (``dynmb.schedule.builders.interleaved``). Its steady state is bound by each
GPU's total work, the sum of its V chunks, not by each chunk's: the per-chunk min-max split
(``stage_split._min_max_partition``) wastes that freedom where one chunk is heavy. With Llama-3's 128k
head (about 2.3 layers of work) at P 16 V 2 the head's chunk 31 shares GPU 15 with chunk 15, and the
per-chunk split gives chunk 15 as many layers as any other chunk, so GPU 15 carries about 1 + 2.3 layers
while the mean GPU carries about 2.1; balanced per GPU, chunk 15 gets fewer layers (half-blocks allowed)
and the other chunks take them.

Objective: the busiest GPU's total work; then, among splits of the same GPU loads (the sum of their
squares held: the spare work spread evenly), the busiest chunk's work; then the largest and the sum of a
chunk's work times its GPU's in-flight count (``in_flight``); then the sum of squared chunk work.

Bounds (``chunk_caps``, from the reference split: the per-chunk min-max one), every chunk within both:

- **Per round**: no chunk does more than the reference's busiest chunk of its round (chunks ``vP ..
  (v + 1) P - 1``). The interleaved 1F1B schedule runs its microbatches in rounds of P, every GPU on its
  round-v chunk together, so a chunk heavier than its round's busiest stalls the round (the lower GPU
  total does not buy it back). Measured (docs/results.md "Interleaved split balanced per GPU"): with the
  memory bound alone the exact optimum of the GPU total made Llama-2-7B wikitext2 P 16 V 2 8% slower at
  equal tokens (chunks of 0.5 and 1.5 layers); with this bound that split stays the per-chunk one.
- **Memory**: no chunk's work times its GPU's in-flight count above the reference's largest such product.
  The packer budgets every chunk's activations that many times against its GPU's memory
  (``dynmb.packing.context``: ``2 (P - 1 - r) + (V - 1) P + 1`` on GPU r), so a bigger chunk on an early
  GPU shortens the longest sequence that fits and truncates more (measured without either bound: 13% fewer
  tokens trained in the same cell).

Algorithm, for ``N`` units (whole layers or half-blocks; ``units`` their work, ``first`` / ``last`` the
embedding and head extras of the end chunks):

1. **Local search** from each of the given starts (the per-chunk min-max split, the even one). A move
   shifts a run of consecutive chunk boundaries ``b_i .. b_j`` by ``d`` units (``d`` = +-1, +-2): chunk
   ``i - 1`` gains ``d`` units at its end, chunk ``j`` loses them at its start, the chunks between slide
   (a two-unit slide keeps their work exactly; a one-unit slide swaps an attention half for an MLP
   half); every chunk keeps >= 1 unit and its cap; all ``O(S^2)`` moves are priced at once (numpy).
   Phase 1: steepest descent on (busiest GPU, sum of squared GPU work), the squares walking the plateaus where GPUs tie at
   the maximum. Phase 2: with the busiest GPU and the sum of squares held, steepest descent on the rest of
   the objective (a tie-break among splits of the same GPU loads). The best result over the starts wins.
2. **Exact, V = 2** (``_exact_two``): is there a partition whose busiest GPU does at most ``B``? With
   round 0 covering ``[0, c)``, GPU g's state after its two chunks is the pair of ends ``(x, y)``; from
   the reachable pairs of GPU ``g - 1`` a pair is reachable when some reachable ``(x', y') < (x, y)`` has
   ``X[x'] + X[y'] >= X[x] + X[y] + extra - B`` (``X`` the prefix sums) and both chunks within their caps
   (``x'`` and ``y'`` at least the first starts that keep them: a box below ``(x, y)``): a 2-D window
   maximum (sparse tables of power-of-two windows, ``_window_max``), so one check is ``O(P x C x N^2 log
   N)`` for the ``C`` split points, vectorised. Bisection on ``B`` below the local
   search's value (one check when local search was already optimal); when it finds a lower one, the
   partition walked back from the check is polished by both phases of step 1. Skipped past
   ``EXACT_CELLS`` grid cells (past about 50 layers in half-blocks: local search alone).

A DP over chunks for any V would carry every GPU's load so far (exponential in P); the pair state above
grows as ``N^(2V - 1)``, so V > 2 is local search alone: against exhaustive search on small random cases
(``tests/test_gpu_split.py``) V = 2 is exact and V = 3 within a few percent where it misses (the tests
allow 10%), never worse than the per-chunk split it starts from. Cost for Llama's 32 layers in half-blocks:
about 0.1 s, up to about 2 s where the bisection runs (P 4). Only
the split changes: the memory model, the cost models and the runtime read uneven chunk splits already
(``ModelConfig.layer_split``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynmb.schedule.kinds import interleaved_inflight

__all__ = ["ChunkLoads", "chunk_loads", "chunk_caps", "gpu_balanced_partition", "in_flight"]

_TOL = 1e-9

EXACT_CELLS = 1_000_000
"""The largest V = 2 feasibility grid (split points x (units + 1)^2) solved exactly; past it local search only."""


@dataclass(frozen=True)
class ChunkLoads:
    """The work of every chunk, of every GPU (chunk ``s`` on GPU ``s % P``) and the objective's key."""

    chunks: np.ndarray
    gpus: np.ndarray

    @property
    def key(self) -> tuple[float, float, float]:
        """(busiest GPU, busiest chunk, sum of squared chunk work): smaller is better."""
        return float(self.gpus.max()), float(self.chunks.max()), float(np.sum(self.chunks ** 2))


def _bounds(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def _loads(bounds: np.ndarray, prefix: np.ndarray, first: float, last: float, virtual: int) -> tuple[np.ndarray, np.ndarray]:
    """(chunk work, GPU work) of the rows of ``bounds`` (M x (S + 1) unit offsets)."""
    w = prefix[bounds[:, 1:]] - prefix[bounds[:, :-1]]
    w[:, 0] += first
    w[:, -1] += last
    m, s = w.shape
    return w, w.reshape(m, virtual, s // virtual).sum(axis=1)


def chunk_loads(counts, units: np.ndarray, first: float, last: float, virtual: int) -> ChunkLoads:
    """The loads of the partition ``counts`` (units per chunk) of ``units`` (module docstring)."""
    prefix = np.concatenate([[0.0], np.cumsum(units)])
    w, g = _loads(_bounds(np.asarray(counts))[None, :], prefix, first, last, virtual)
    return ChunkLoads(chunks=w[0], gpus=g[0])


def in_flight(num_gpus: int, virtual: int) -> np.ndarray:
    """Chunk-microbatches in flight on each GPU, the packer's count (``kinds.interleaved_inflight`` before
    ``m`` is known: ``2 (P - 1 - r) + (V - 1) P + 1``): a chunk's activations count that many times against
    its GPU's budget (``dynmb.packing.context``), so a large chunk on an early GPU shortens the longest
    sequence that fits."""
    return np.asarray(interleaved_inflight(np.arange(int(num_gpus)), int(num_gpus), int(virtual)), dtype=np.float64)


def chunk_caps(counts, units: np.ndarray, first: float, last: float, virtual: int) -> np.ndarray:
    """The most work each chunk may do (module docstring, "Bounds") given the reference partition ``counts``:
    within its round, the reference's busiest chunk of that round; times its GPU's in-flight count, the
    reference's largest such product."""
    w = chunk_loads(counts, units, first, last, virtual).chunks
    held = np.tile(in_flight(w.size // virtual, virtual), virtual)
    per_round = np.repeat(w.reshape(virtual, -1).max(axis=1), w.size // virtual)
    return np.minimum(per_round, float(np.max(held * w)) / held)


def _pick(keys: np.ndarray) -> int:
    """The row of ``keys`` (M x K) smallest lexicographically, ties within ``_TOL`` (relative)."""
    rows = np.arange(keys.shape[0])
    for k in range(keys.shape[1]):
        col = keys[rows, k]
        rows = rows[col <= col.min() + _TOL * abs(col.min())]
    return int(rows[0])


def _better(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether key ``a`` is strictly below ``b`` (lexicographic, relative tolerance)."""
    for x, y in zip(a, b):
        if x < y - _TOL * abs(y):
            return True
        if x > y + _TOL * abs(y):
            return False
    return False


def _keys(w: np.ndarray, g: np.ndarray, phase: int, held: np.ndarray) -> np.ndarray:
    """Phase 1: (busiest GPU, sum of squared GPU work); phase 2: (busiest chunk, the largest and the sum of
    chunk work x its GPU's in-flight count, sum of squared chunk work)."""
    if phase == 1:
        return np.stack([g.max(axis=1), np.sum(g ** 2, axis=1)], axis=1)
    act = w * np.tile(held, w.shape[1] // held.size)[None, :]
    return np.stack([w.max(axis=1), act.max(axis=1), act.sum(axis=1), np.sum(w ** 2, axis=1)], axis=1)


@dataclass(frozen=True)
class _Row:
    """The row of work units a partition cuts: its prefix sums, the first and last chunks' extra work (embedding,
    head), the chunks per GPU, every chunk's most work and the descent's step limit."""

    prefix: np.ndarray
    first: float
    last: float
    virtual: int
    chunk_cap: np.ndarray
    max_steps: int

    def loads(self, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return _loads(bounds, self.prefix, self.first, self.last, self.virtual)


def _descend(bounds: np.ndarray, row: _Row, phase: int, caps: tuple[float, float]) -> np.ndarray:
    """Steepest descent from ``bounds`` (phase 1 or 2 of the module docstring; ``caps``: phase 2's bounds on
    the busiest GPU's work and the sum of squared GPU work; ``row.chunk_cap``: every chunk's most work)."""
    virtual, chunk_cap = row.virtual, row.chunk_cap
    s = bounds.size - 1
    idx = np.arange(s + 1)
    ii, jj = np.triu_indices(s - 1)
    masks = ((idx[None, :] >= ii[:, None] + 1) & (idx[None, :] <= jj[:, None] + 1)).astype(np.int64)
    moves = np.concatenate([d * masks for d in (1, -1, 2, -2)])
    held = in_flight(s // virtual, virtual)
    cur = _keys(*row.loads(bounds[None, :]), phase, held)[0]
    for _ in range(row.max_steps):
        cand = bounds[None, :] + moves
        cand = cand[np.all(np.diff(cand, axis=1) >= 1, axis=1)]
        w, g = row.loads(cand)
        ok = np.all(w <= chunk_cap[None, :] * (1 + _TOL), axis=1)
        if phase == 2:
            ok &= (g.max(axis=1) <= caps[0] * (1 + _TOL)) & (np.sum(g ** 2, axis=1) <= caps[1] * (1 + _TOL))
        cand, w, g = cand[ok], w[ok], g[ok]
        if cand.shape[0] == 0:
            break
        keys = _keys(w, g, phase, held)
        pick = _pick(keys)
        if not _better(keys[pick], cur):
            break
        bounds, cur = cand[pick], keys[pick]
    return bounds


def _window_max(a: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """Along the last axis, ``out[..., i] = max(a[..., lo[i]:i])`` (-inf where empty): a sparse table of
    power-of-two windows, each query the larger of two that cover it."""
    n = a.shape[-1]
    table, k = [a], 1
    while 2 * k <= n:
        nxt = table[-1].copy()
        nxt[..., : n - k] = np.maximum(table[-1][..., : n - k], table[-1][..., k:])
        table.append(nxt)
        k *= 2
    i = np.arange(n)
    length = i - lo
    out = np.full(a.shape, -np.inf)
    level = np.where(length >= 1, np.floor(np.log2(np.maximum(length, 1))).astype(np.int64), -1)
    for lv in range(len(table)):
        at = np.flatnonzero(level == lv)
        if at.size:
            out[..., at] = np.maximum(table[lv][..., lo[at]], table[lv][..., at - (1 << lv)])
    return out


def _lows(prefix: np.ndarray, extra: float, cap: float) -> np.ndarray:
    """For every end x, the first start x' whose chunk ``[x', x)`` does at most ``cap`` work (with ``extra``)."""
    need = prefix + extra - cap
    return np.searchsorted(prefix, need - _TOL * np.abs(need), side="left").astype(np.int64)


def _reach(prefix: np.ndarray, p: int, budget: float, first: float, last: float, cap: np.ndarray,
           cs: np.ndarray) -> list[np.ndarray]:
    """V = 2 feasibility (module docstring, "Exact"): per GPU g, (C, N + 1, N + 1) booleans, whether chunk g
    can end at x and chunk g + P at y with GPUs 0..g within ``budget`` and every chunk within ``cap``
    (per chunk), round 0 covering ``[0, c)``."""
    n = prefix.size - 1
    both = prefix[:, None] + prefix[None, :]
    reach = np.zeros((cs.size, n + 1, n + 1), dtype=bool)
    reach[np.arange(cs.size), 0, cs] = True
    inside = np.arange(n + 1)[None, :, None] <= cs[:, None, None]
    out = []
    for g in range(p):
        e0, e1 = (first if g == 0 else 0.0), (last if g == p - 1 else 0.0)
        best = _window_max(np.where(reach, both[None], -np.inf), _lows(prefix, e1, cap[g + p]))
        best = _window_max(best.transpose(0, 2, 1), _lows(prefix, e0, cap[g])).transpose(0, 2, 1)
        reach = (best >= both[None] + e0 + e1 - budget) & inside
        out.append(reach)
    return out


def _exact_two(prefix: np.ndarray, p: int, first: float, last: float, cap: np.ndarray, known: float) -> np.ndarray | None:
    """V = 2: the chunk bounds of a partition whose busiest GPU does less than ``known``, every chunk within
    ``cap`` (bisection on the budget, ``_reach``); None when none does or the grid is too large."""
    n = prefix.size - 1
    cs = np.arange(p, n - p + 1)
    if cs.size == 0 or cs.size * (n + 1) ** 2 > EXACT_CELLS:
        return None

    def feasible(budget: float) -> np.ndarray:
        return _reach(prefix, p, budget, first, last, cap, cs)[-1][np.arange(cs.size), cs, n]

    lo, hi = (prefix[-1] + first + last) / p, known * (1 - _TOL)
    if not feasible(hi).any():
        return None
    while hi - lo > _TOL * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if feasible(mid).any() else (mid, hi)
    c = cs[int(np.flatnonzero(feasible(hi))[0])]
    reach = _reach(prefix, p, hi, first, last, cap, np.array([c]))
    x, y, ends = c, n, [(c, n)]
    for g in range(p - 1, 0, -1):                          # walk back: a reachable predecessor that fits
        e1 = last if g == p - 1 else 0.0
        both = prefix[:x, None] + prefix[None, :y]
        ok = reach[g - 1][0, :x, :y] & (both >= prefix[x] + prefix[y] + e1 - hi)
        ok[: _lows(prefix, 0.0, cap[g])[x]] = False
        ok[:, : _lows(prefix, e1, cap[g + p])[y]] = False
        i = int(np.argmax(np.where(ok, both, -np.inf)))
        x, y = divmod(i, y)
        ends.append((x, y))
    ends.reverse()
    return np.array([0, *(e[0] for e in ends), *(e[1] for e in ends)], dtype=np.int64)


def gpu_balanced_partition(units: np.ndarray, num_chunks: int, virtual: int, first: float, last: float,
                           starts: list, *, bound_by: int | None = 0,
                           max_steps: int = 10000) -> tuple[list[int], ChunkLoads]:
    """(units per chunk, its loads): the partition of ``units`` into ``num_chunks`` contiguous non-empty
    chunks, chunk ``s`` on GPU ``s % (num_chunks / virtual)``, with the smallest busiest GPU's work, then
    busiest chunk's (module docstring), by local search from each of ``starts`` (units per chunk) and, at
    V = 2, exactly; every chunk within ``chunk_caps`` of the start ``bound_by`` (None: unbounded; starts
    past the caps are skipped)."""
    units = np.asarray(units, dtype=np.float64)
    s, v = int(num_chunks), int(virtual)
    if v < 1 or s % v or not 1 <= s <= units.size:
        raise ValueError(f"cannot cut {units.size} units into {s} chunks over {s // max(v, 1)} GPUs of {v} chunks")
    prefix = np.concatenate([[0.0], np.cumsum(units)])
    if s == 1:
        counts = [int(units.size)]
        return counts, chunk_loads(counts, units, first, last, v)
    chunk_cap = np.full(s, np.inf) if bound_by is None else chunk_caps(starts[bound_by], units, first, last, v)

    row = _Row(prefix, first, last, v, chunk_cap, max_steps)

    def polish(b: np.ndarray) -> tuple[list[int], ChunkLoads]:
        b = _descend(b, row, 1, (np.inf, np.inf))
        g = row.loads(b[None, :])[1]
        b = _descend(b, row, 2, (float(g.max()), float(np.sum(g ** 2))))
        counts = [int(c) for c in np.diff(b)]
        return counts, chunk_loads(counts, units, first, last, v)

    best: tuple[list[int], ChunkLoads] | None = None
    for start in starts:
        b = _bounds(np.asarray(start, dtype=np.int64))
        if b.size != s + 1 or b[-1] != units.size or np.any(np.diff(b) < 1):
            raise ValueError(f"start {list(start)} is not a partition of {units.size} units into {s} chunks")
        if np.any(chunk_loads(start, units, first, last, v).chunks > chunk_cap * (1 + _TOL)):
            continue
        counts, loads = polish(b)
        if best is None or _better(np.asarray(loads.key), np.asarray(best[1].key)):
            best = (counts, loads)
    if best is None:
        raise ValueError("gpu_balanced_partition needs a start within the chunk caps")
    exact = _exact_two(prefix, s // v, first, last, chunk_cap, best[1].key[0]) if v == 2 else None
    if exact is not None:                                  # local search missed the optimum: polish the exact one
        best = polish(exact)
    return best
