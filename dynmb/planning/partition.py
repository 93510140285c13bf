"""The min-max contiguous partition of a row of work units over pipeline stages (dynamic programming).

``min_max_partition(units, p, first, last, extras)``: split ``units`` (each unit's work, in order) into ``p``
non-empty contiguous segments, ``first`` / ``last`` added to the segments at the two ends and ``extras[k]`` (optional)
to segment ``k`` (a stage's own fixed work, e.g. the forward its recomputed blocks rerun), minimising the busiest
segment's work: ``best[k][j] = min over i of max(best[k-1][i], cost(i, j))`` over (segments used,
units covered), ties (the optimum is rarely unique) broken by the smallest sum of squared segment work, so
spare work spreads evenly instead of leaving a near-empty segment. ``O(p N^2)`` with the inner minimum
vectorised (numpy) over every (start, end) pair of a segment count at once. Used by the layer split (``stage_split``) and the head's vocabulary shards
(``head_split``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["min_max_partition"]


def min_max_partition(units: np.ndarray, p: int, first: float, last: float,
                      extras: Sequence[float] | None = None) -> tuple[list[int], float, float]:
    """(units per stage, max, sum of squares) of the min-max contiguous partition of ``units`` into
    ``p`` non-empty segments, ``first`` / ``last`` added to the segments at the ends and ``extras[k]`` to segment
    ``k`` (None: nothing; module docstring)."""
    n = units.size
    add = np.zeros(p) if extras is None else np.asarray(extras, dtype=np.float64)
    if add.shape != (p,):
        raise ValueError(f"min_max_partition extras must hold {p} numbers, one per segment, got {add.size}")
    prefix = np.concatenate([[0.0], np.cumsum(units)])               # work of units [0, j)
    best_max = np.full((p, n + 1), np.inf)
    best_sq = np.full((p, n + 1), np.inf)
    arg = np.zeros((p, n + 1), dtype=np.int64)
    j = np.arange(n + 1)
    seg0 = prefix + first + add[0] + np.where(j == n, last, 0.0)
    best_max[0, 1:], best_sq[0, 1:] = seg0[1:], seg0[1:] ** 2
    starts = np.arange(n)[:, None]                                   # a segment [start, end): rows start, cols end
    at_end = np.where(j == n, last, 0.0)
    for k in range(1, p):
        seg = prefix[None, :] - prefix[:n, None] + add[k] + at_end[None, :]
        valid = (starts >= k) & (starts < j[None, :])
        mx = np.where(valid, np.maximum(best_max[k - 1, :n, None], seg), np.inf)
        sq = best_sq[k - 1, :n, None] + seg ** 2
        lo = mx.min(axis=0)
        ties = valid & (mx <= lo * (1 + 1e-12))
        pick = np.argmin(np.where(ties, sq, np.inf), axis=0)
        ends = np.arange(k + 1, n + 1)
        best_max[k, ends] = mx[pick[ends], ends]
        best_sq[k, ends] = sq[pick[ends], ends]
        arg[k, ends] = pick[ends]
    split, end = [], n
    for k in range(p - 1, 0, -1):
        start = int(arg[k, end])
        split.append(end - start)
        end = start
    split.append(end)
    return list(reversed(split)), float(best_max[p - 1, n]), float(best_sq[p - 1, n])
