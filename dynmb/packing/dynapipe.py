"""DynaPipe's microbatch construction (Jiang et al., EuroSys'24), re-implemented from the paper.

Algorithm (paper Sec. "micro-batch construction"): sort the samples of the global batch
by length; a microbatch is a contiguous run of sorted samples, padded to its longest;
for a cap ``t_max`` on the per-microbatch time, a dynamic program over prefixes finds the
split minimising ``sum_i t_i`` subject to ``t_i <= t_max`` and the memory cap of every
microbatch; ``t_max`` is swept over candidate values and the split minimising the
pipeline-time estimate ``(P - 1) * max_i t_i + sum_i t_i`` is kept.

Samples are one document per row at their padded length (rounded up to a multiple of
``round_to``; the DP evaluates the rounded lengths). ``t_i`` is the bottleneck stage's
F + B time of the microbatch from the one cost lookup (``cost_model.stage_costs``, one
document per row), the memory cap is the per-microbatch budget
``k_i * (act_i + transient_i) <= limit - states_i`` (k_i the microbatches stage i holds
in flight), and every ``t_max`` candidate is solved in the same pass over prefixes (the
DP state is a ``[K, n+1]`` array). Inside the DP the time of ``b`` rows at length ``s``
is taken affine in ``b`` from the lookup at b = 1 and 2 per stage (exact for the
analytic and polynomial cost models); the chosen split is then re-costed exactly.
O(n * w * K) work for n samples, w the largest feasible microbatch, K candidates; each padded length's
microbatch times and cap masks are computed once for its run of sorted samples.
Splits are remembered by a digest of what the DP reads (``REMEMBERED``; one plan asks for the same one
several times).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Callable

import numpy as np

from dynmb.costmodel.base import CostModelLike
from dynmb.core.features import CostFeatures
from dynmb.packing.rows import Group, round_up

__all__ = ["dynapipe_split", "dynapipe_groups"]


def _affine_costs(cost_model: CostModelLike, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(alpha[P, n], beta[P, n]) with F+B(b, s) ~= alpha + beta * b per stage."""
    c1 = CostFeatures.of_shapes(np.ones_like(s), s).costs(cost_model)
    c2 = CostFeatures.of_shapes(np.full_like(s, 2), s).costs(cost_model)
    t1, t2 = c1["F"] + c1["B"], c2["F"] + c2["B"]
    beta = np.maximum(t2 - t1, 0.0)
    return t1 - beta, beta


def dynapipe_split(lengths_sorted: np.ndarray, bmax: np.ndarray, cost_model: CostModelLike, num_stages: int,
                   num_candidates: int = 24) -> np.ndarray:
    """Start index of each microbatch (plus n at the end) over ``lengths_sorted`` (ascending
    padded lengths). ``bmax[j]`` is the most rows a microbatch padded to ``lengths_sorted[j]`` may hold.
    """
    s = np.asarray(lengths_sorted, dtype=np.float64)
    alpha, beta = _affine_costs(cost_model, s)
    bmax = np.asarray(bmax)
    if REMEMBERED <= 0:
        return _split(s, bmax, alpha, beta, num_stages, num_candidates)
    digest = hashlib.blake2b(repr((num_stages, num_candidates, len(s), alpha.shape, bmax.dtype.str)).encode(),
                             digest_size=20)
    for part in (s, bmax, alpha, beta):
        digest.update(np.ascontiguousarray(part).tobytes())
    key = digest.digest()
    with _splits_lock:
        known = _splits.get(key)
        if known is not None:
            _splits.move_to_end(key)
    if known is None:
        known = _split(s, bmax, alpha, beta, num_stages, num_candidates)
        with _splits_lock:
            _splits[key] = known
            while len(_splits) > REMEMBERED:
                _splits.popitem(last=False)
    return known.copy()


REMEMBERED = 64
"""Splits ``dynapipe_split`` remembers, keyed by a digest of everything the DP reads (sorted lengths, row caps, the
affine costs, P, candidates); 0: none (the old path). One plan asks for the same split several times (the
``dynapipe`` baseline of the planner's final check and of ``dynamic``'s candidate space)."""
_splits: OrderedDict[bytes, np.ndarray] = OrderedDict()
_splits_lock = threading.Lock()


def _split(s: np.ndarray, bmax: np.ndarray, alpha: np.ndarray, beta: np.ndarray, num_stages: int,
           num_candidates: int) -> np.ndarray:
    """The DP of ``dynapipe_split`` (module doc) on the affine costs ``alpha + beta b`` of every sample."""
    n = len(s)
    wmax = np.minimum(bmax, np.arange(1, n + 1)).astype(np.int64)   # rows of a mb ending at j
    # per-sample single-row time and the largest feasible microbatch time bound the candidates
    t_one = (alpha + beta).max(axis=0)
    t_big = (alpha + beta * wmax).max(axis=0)
    lo, hi = float(t_one.max()), float(t_big.max())
    cands = np.unique(np.geomspace(lo, max(hi, lo) * (1 + 1e-9), num_candidates)) if hi > lo else np.array([lo])
    K = len(cands)
    inf = np.inf
    dp = np.full((K, n + 1), inf)
    dp[:, 0] = 0.0
    tmx = np.zeros((K, n + 1))            # max t_i along the chosen path
    choice = np.zeros((K, n + 1), dtype=np.int64)
    ks = np.arange(K)
    shape = None
    for j in range(1, n + 1):
        w = int(wmax[j - 1])
        if shape != (s[j - 1], bmax[j - 1]):        # a new padded length: its times and masks, once per run
            shape = (s[j - 1], bmax[j - 1])
            b = np.arange(1, min(int(bmax[j - 1]), n) + 1)
            t_all = (alpha[:, j - 1:j] + beta[:, j - 1:j] * b).max(axis=0)     # mb = samples j-b .. j-1
            add_all = np.where(t_all[None, :] <= cands[:, None], t_all[None, :], inf)   # [K, b]: over a cap: inf
        tj, val = t_all[:w], dp[:, j - w:j][:, ::-1] + add_all[:, :w]         # dp[j - b] + t_b
        k = val.argmin(axis=1)
        dp[:, j] = val[ks, k]
        choice[:, j] = k + 1
        tmx[:, j] = np.maximum(tmx[ks, j - 1 - k], tj[k])
    obj = (num_stages - 1) * tmx[:, n] + dp[:, n]
    best = int(np.argmin(obj))
    if not np.isfinite(obj[best]):
        raise RuntimeError("dynapipe DP found no feasible split")
    cuts = [n]
    j = n
    while j > 0:
        j -= int(choice[best, j])
        cuts.append(j)
    return np.array(cuts[::-1], dtype=np.int64)


def dynapipe_groups(lengths: np.ndarray, bmax_fn: Callable[[np.ndarray], np.ndarray], cost_model: CostModelLike,
                    num_stages: int, round_to: int = 1) -> list[Group]:
    """The DP split of the length-sorted sequences at their lengths rounded up to ``round_to``."""
    pos = np.argsort(lengths, kind="stable")
    padded = round_up(lengths[pos], round_to)
    cuts = dynapipe_split(padded, np.maximum(bmax_fn(padded), 1), cost_model, num_stages)
    return [Group(pos[a:e], np.arange(e - a), int(padded[e - 1]), e - a) for a, e in zip(cuts[:-1], cuts[1:])]
