"""Row sets and their affine costs for the ``dynamic`` packer (``dynmb.packing.dynamic.pack``, steps 1-3).

- ``row_set(lengths, asc, cap, round_to, best_fit)``: the rows of one capacity (None: one
  sequence per row; else sequences longer than cap/2 alone and the rest next-fit in ascending
  order, or best-fit-decreasing), numbered longest first (``RowSet``).
- ``row_caps``: the capacities tried (no packing, up to three powers of two from 2x the median,
  the longest admissible row).
- ``affine_costs``: every op's time per stage as ``alpha + beta * rows - gamma * (rows * s^2 -
  work) + delta * rows * [packed]`` per padded length s, from one cost lookup at four probe points,
  checked at two more (a warning, or ``AffineCostError`` when strict, names where a cost model breaks the
  affine property the packer relies on).
- ``SplitSetup``: one row set with its per-row affine costs; scores splits (cut points over its
  rows, longest first): bottleneck time, time-target grid, greedy cuts, costs and shapes.
- ``split_to_flat``: a split run in a given order, in ``rows.Flat`` form.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from dynmb.costmodel.base import CostModelLike
from dynmb.core.features import CostFeatures
from dynmb.packing.rows import Flat, bfd_rows, greedy_cuts, greedy_cuts_from_short_end, next_fit_rows, round_down, round_up

__all__ = ["RowSet", "row_set", "row_caps", "affine_costs", "AffineCostError", "AFFINE_TOL", "SplitSetup",
           "split_to_flat"]

logger = logging.getLogger(__name__)


@dataclass
class RowSet:
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


def row_set(lengths: np.ndarray, asc: np.ndarray, cap: int | None, round_to: int, best_fit: bool = False) -> RowSet:
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
    return RowSet(key, row, tokens, round_up(tokens, round_to), np.concatenate([[0.0], np.cumsum(work)]),
                   np.concatenate([[0], np.cumsum(docs > 1)]), opened)


def row_caps(lengths: np.ndarray, max_len: int, round_to: int) -> list[int | None]:
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


AFFINE_TOL = 1e-6
"""Relative deviation of the cost model from its affine fit at the check points above which
``affine_costs`` says the model breaks the affine property the packer relies on."""


def affine_costs(cost_model: CostModelLike, padded: np.ndarray, *,
                 strict: bool = False) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Per op ``F`` / ``B``: (alpha, beta, gamma, delta)[P, u] with time(b, s, work) = alpha + beta * b
    - gamma * (b * s^2 - work) + delta * b * [packed] per padded length s, where a microbatch is packed
    when its attention work is below b * s^2 (its document-causal path gathers and scatters the rows,
    a cost per computed token that one-document rows do not pay: the poly model's ``c4_packed_tok``).
    From one ``stage_costs`` lookup at (1, s, s^2), (2, s, 2 s^2), (1, s, 0) and (1, s, s^2 / 2).

    The packer scores splits with this form, which holds when the cost model is affine in rows and in
    attention work on each side of the packed flag (the analytic and polynomial models are). The same
    lookup also evaluates the model at two check points per length, (3, s, 3 s^2) and the packed
    (2, s, s^2); where the form misses the model by more than ``AFFINE_TOL`` (relative), it logs a
    warning naming the model, op, stage, point and deviation (``strict``: raises ``AffineCostError``);
    the packer's estimates are then approximations, and ``dynmb.packing`` still re-costs the chosen
    plans with the model itself."""
    u = len(padded)
    s = padded.astype(np.float64)
    ones, s2 = np.ones(u), s * s
    probes = CostFeatures.of_shapes(np.concatenate([ones, 2 * ones, ones, ones, 3 * ones, 2 * ones]), np.tile(s, 6),
                                    np.concatenate([s2, 2 * s2, 0 * s2, s2 / 2, 3 * s2, s2]))
    cc = probes.costs(cost_model)
    out = {}
    for op in ("F", "B"):
        one, two, no_attn, half_attn, three, packed_two = (cc[op][:, k * u:(k + 1) * u] for k in range(6))
        beta = np.maximum(two - one, 0.0)
        gamma = np.maximum(half_attn - no_attn, 0.0) / np.maximum(s2 / 2, 0.5)
        delta = np.maximum(no_attn + gamma * s2 - one, 0.0)
        out[op] = (one - beta, beta, gamma, delta)
        for name, b, saving, packed, got in (("3 rows", 3, 0.0, 0.0, three),
                                             ("2 packed rows, half the attention work", 2, 1.0, 1.0, packed_two)):
            fit = one - beta + beta * b - gamma * saving * s2 + delta * b * packed
            dev = np.abs(fit - got) / np.maximum(np.abs(got), 1e-12)
            if dev.max() > AFFINE_TOL:
                stage, j = (int(x) for x in np.unravel_index(np.argmax(dev), dev.shape))
                msg = (f"cost model {type(cost_model).__name__} is not affine in rows and attention work, which the "
                       f"dynamic packer's split scoring assumes: op {op} on stage {stage} at padded_len "
                       f"{int(s[j])}, {name}: model {got[stage, j]:.6g} s, affine fit {fit[stage, j]:.6g} s "
                       f"({dev.max():.1%} off); its estimates are approximate (the chosen plans are re-costed "
                       f"with the model)")
                if strict:
                    raise AffineCostError(msg)
                _warn_once(cost_model, msg)
    return out


class AffineCostError(ValueError):
    """A cost model breaks the affine property ``affine_costs`` relies on (``strict``)."""


_WARNED: set[str] = set()


def _warn_once(cost_model: CostModelLike, msg: str) -> None:
    """Log ``msg`` once per process and cost-model class (a run makes a calibrated model every step)."""
    key = msg.split(":")[0]
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning("%s", msg)


class SplitSetup:
    """One row set with its affine costs per row: scores splits (cut points over its rows)."""

    def __init__(self, rows: RowSet, length_ix: np.ndarray, costs: dict[str, tuple], bmax_by_length: np.ndarray,
                 doc_causal: bool) -> None:
        self.rows, self.doc_causal = rows, doc_causal
        self.used, self.pos = np.unique(length_ix, return_inverse=True)     # distinct padded lengths, row -> index
        self.fwd = tuple(c[:, self.used] for c in costs["F"])              # (alpha, beta, gamma, delta) of F
        self.bwd = tuple(c[:, self.used] for c in costs["B"])
        self.alpha, self.beta, self.gamma, self.delta = (f + b for f, b in zip(self.fwd, self.bwd))
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
        beta_packed = self.beta[:, p_ix] - self.gamma[:, p_ix] * saving[packed] + self.delta[:, p_ix]
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
        return self._affine((self.alpha, self.beta, self.gamma, self.delta), start, end).max(axis=0)

    def _affine(self, coef: tuple, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """``alpha + beta * rows - gamma * saving + delta * rows * [packed]`` of the microbatches [start, end)
        per stage, ``coef`` that form's four arrays (a microbatch is packed when it saves attention work)."""
        p, rows, saving = self.pos[start], end - start, self.saving(start, end)
        return coef[0][:, p] + coef[1][:, p] * rows - coef[2][:, p] * saving + coef[3][:, p] * rows * (saving > 0)

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
        return self._affine(self.fwd, start, end), self._affine(self.bwd, start, end)

    def shapes(self, cuts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, padded_len, attention work) of each microbatch of the split, in split order."""
        start, end = cuts[:-1], cuts[1:]
        return np.diff(cuts), self.rows.padded[start], self.rows.attention(start, end, self.doc_causal)


def split_to_flat(rows: RowSet, cuts: np.ndarray, order: np.ndarray) -> Flat:
    """The flat form of the split ``cuts`` of ``rows`` run in ``order``."""
    mb_of_item = np.searchsorted(cuts, rows.row, side="right") - 1
    pos_of_mb = np.empty(len(order), dtype=np.int64)
    pos_of_mb[order] = np.arange(len(order))
    items = np.argsort(pos_of_mb[mb_of_item], kind="stable")
    local = rows.row[items] - cuts[mb_of_item[items]]
    nseq = np.bincount(pos_of_mb[mb_of_item], minlength=len(order))
    return Flat(items, local, nseq, rows.padded[cuts[:-1]][order], np.diff(cuts)[order])
