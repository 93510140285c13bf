"""``CostFeatures``: what the one cost lookup prices, per microbatch, built in one place.

A microbatch's time on a stage depends on its shape (``rows`` x ``padded_len``), its attention
work (``Microbatch.attention_work``: rows x padded_len^2 for one document per row, the sum of
s_i^2 over the documents of packed rows under ``attention="auto"``), the prefix work of slices
of long sequences (``Plan.prefix_cross_work``) and whether it recomputes. ``CostFeatures.of``
computes them from microbatches (the only place the packers do), ``of_shapes`` takes them as
given (probe points, candidate shapes), and ``costs(cost_model, ops)`` makes the one lookup
``cost_model.stage_costs(rows, padded_len, attn, ops=, recompute=)``.

Prefix work is priced by the cost model's ``plan_costs`` (each op its own ``prefix_scale``):
``costs`` refuses features that carry some, so no caller drops it silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from dynmb.core.microbatch import Microbatch
from dynmb.core.planspec import ATTENTION_KINDS

__all__ = ["CostFeatures"]


def _f64(x: Any, m: int) -> np.ndarray:
    return np.broadcast_to(np.asarray(x, dtype=np.float64), (m,)).copy()


@dataclass(frozen=True)
class CostFeatures:
    """Per-microbatch inputs of the cost lookup (``[m]`` arrays)."""

    rows: np.ndarray
    """Rows of each microbatch."""
    padded_len: np.ndarray
    """Row length each runs at."""
    attn: np.ndarray
    """Attention work (sum over attention segments of length^2)."""
    prefix: np.ndarray
    """Prefix work of slices against their earlier slices (0 for whole sequences)."""
    recompute: np.ndarray
    """Whether each runs with full activation recomputation."""

    def __post_init__(self) -> None:
        m = len(np.atleast_1d(self.rows))
        for name in ("rows", "padded_len", "attn", "prefix"):
            object.__setattr__(self, name, _f64(np.atleast_1d(getattr(self, name)), m))
        object.__setattr__(self, "recompute", np.broadcast_to(np.asarray(self.recompute, dtype=bool), (m,)).copy())

    @property
    def size(self) -> int:
        return len(self.rows)

    @classmethod
    def of_shapes(cls, rows: Any, padded_len: Any, attn: Any = None, recompute: Any = False) -> "CostFeatures":
        """Features of given shapes; ``attn`` None: one document per row (rows x padded_len^2)."""
        b, s = np.broadcast_arrays(np.atleast_1d(np.asarray(rows, dtype=np.float64)),
                                   np.atleast_1d(np.asarray(padded_len, dtype=np.float64)))
        a = b * s * s if attn is None else np.asarray(attn, dtype=np.float64)
        return cls(b, s, a, np.zeros(b.shape), np.asarray(recompute, dtype=bool))

    @classmethod
    def of(cls, microbatches: Sequence[Microbatch], attention: str = "auto") -> "CostFeatures":
        """Features of ``microbatches`` under the model's ``attention`` setting: rows x padded_len^2
        where every row holds one document, ``Microbatch.attention_work`` elsewhere."""
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"unknown attention {attention!r}; expected one of {', '.join(ATTENTION_KINDS)}")
        m = len(microbatches)
        rows = np.fromiter((mb.batch for mb in microbatches), dtype=np.float64, count=m)
        plen = np.fromiter((mb.padded_len for mb in microbatches), dtype=np.float64, count=m)
        attn = rows * plen ** 2                                 # one document per row (the usual case)
        prefix = np.zeros(m)
        for j, mb in enumerate(microbatches):
            if mb.num_seqs > mb.batch or mb.has_slices:         # packed rows or slices: their own work
                attn[j] = mb.attention_work(attention)
            if mb.has_slices:                                   # slices' queries against their prefix keys
                offsets = np.asarray(mb.offsets)
                n, p = mb.lengths[mb.slice_mask].astype(np.float64), offsets[mb.slice_mask].astype(np.float64)
                prefix[j] = float(np.sum(2 * n * p))
        recompute = np.fromiter((bool(mb.recompute) for mb in microbatches), dtype=bool, count=m)
        return cls(rows, plen, attn, prefix, recompute)

    def take(self, idx: Any) -> "CostFeatures":
        """The features of microbatches ``idx`` (an index array or mask), in that order."""
        return CostFeatures(self.rows[idx], self.padded_len[idx], self.attn[idx], self.prefix[idx],
                            self.recompute[idx])

    @staticmethod
    def concat(parts: Sequence["CostFeatures"]) -> "CostFeatures":
        """The features of ``parts`` one after another."""
        return CostFeatures(*(np.concatenate([getattr(p, k) for p in parts])
                              for k in ("rows", "padded_len", "attn", "prefix", "recompute")))

    def costs(self, cost_model: Any, ops: tuple[str, ...] = ("F", "B")) -> dict[str, np.ndarray]:
        """``{op: [P, m] seconds}`` from the one lookup ``cost_model.stage_costs`` (called as
        ``stage_costs(rows, padded_len, attn)`` for F and B without recomputation, the least a
        cost model must take; ``ops`` and ``recompute`` are passed only when they matter)."""
        if np.any(self.prefix):
            raise ValueError("features with prefix work of slices: price them with cost_model.plan_costs, "
                             "which applies each op's prefix_scale")
        if tuple(ops) == ("F", "B") and not self.recompute.any():
            return cost_model.stage_costs(self.rows, self.padded_len, self.attn)
        return cost_model.stage_costs(self.rows, self.padded_len, self.attn, ops=ops,
                                      recompute=self.recompute if self.recompute.any() else None)
