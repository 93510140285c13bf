"""``Microbatch``: the sequences one microbatch holds and the shape it runs at (numpy only).

The sequences it holds, the row each sits in, and the shape it runs at (``batch`` rows x
``padded_len`` columns). One sequence per row is the usual case; the ``packed`` method puts
several documents in one row. Slices: a sequence longer than any row that fits may be cut into
consecutive slices (``--oversize split``), each an entry of a different microbatch with its
token ``offset`` in the sequence and ``continued`` (a later slice follows); ``Plan`` checks
that the slices of one sequence cover ``[0, length)`` back to back in execution order.
``dynmb.core.types`` re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np
import numpy.typing as npt

from dynmb.core.planspec import ATTENTION_KINDS

__all__ = ["Microbatch", "PlanError"]


class PlanError(ValueError):
    """A plan breaks an invariant (a sequence missing or repeated, bad shapes)."""


def _as_i64(x: Iterable[int]) -> np.ndarray:
    a = np.asarray(x, dtype=np.int64).reshape(-1)
    a.setflags(write=False)
    return a


@dataclass(frozen=True, eq=False)
class Microbatch:
    """One microbatch: ``batch`` rows of ``padded_len`` tokens.

    ``seq_ids[k]`` (index into the global batch) has length ``lengths[k]`` and sits
    in row ``row_ids[k]``; sequences sharing a row are concatenated in the order
    given (document-causal masking keeps them apart). ``row_ids`` defaults to one
    sequence per row, in order. ``recompute``: the microbatch runs every stage with full
    activation recomputation (only each block's input is kept from F to B).
    ``offsets[k]``: where entry k starts in its sequence (0 unless it is a slice);
    ``continued[k]``: a later slice of that sequence follows in another microbatch. An
    entry with an offset or a continuation is a *slice segment* (``slice_mask``).
    """

    seq_ids: np.ndarray
    lengths: np.ndarray
    padded_len: int
    batch: int
    row_ids: np.ndarray = None  # type: ignore[assignment]  # None: one sequence per row (set in __post_init__)
    recompute: bool = False
    offsets: np.ndarray = None  # type: ignore[assignment]  # None: zeros
    continued: np.ndarray = None  # type: ignore[assignment]  # None: all False

    if TYPE_CHECKING:  # the constructor takes any int / bool sequence; __post_init__ makes the arrays
        def __init__(self, seq_ids: npt.ArrayLike, lengths: npt.ArrayLike, padded_len: int, batch: int,
                     row_ids: npt.ArrayLike | None = None, recompute: bool = False,
                     offsets: npt.ArrayLike | None = None, continued: npt.ArrayLike | None = None) -> None: ...

    def __post_init__(self) -> None:
        object.__setattr__(self, "seq_ids", _as_i64(self.seq_ids))
        object.__setattr__(self, "lengths", _as_i64(self.lengths))
        object.__setattr__(self, "padded_len", int(self.padded_len))
        object.__setattr__(self, "batch", int(self.batch))
        object.__setattr__(self, "recompute", bool(self.recompute))
        n = len(self.seq_ids)
        rows = np.arange(n, dtype=np.int64) if self.row_ids is None else self.row_ids
        object.__setattr__(self, "row_ids", _as_i64(rows))
        object.__setattr__(self, "offsets", _as_i64(np.zeros(n, np.int64) if self.offsets is None else self.offsets))
        cont = np.zeros(n, bool) if self.continued is None else np.asarray(self.continued, dtype=bool).reshape(-1)
        cont.setflags(write=False)
        object.__setattr__(self, "continued", cont)
        if len(self.offsets) != n or len(self.continued) != n:
            raise PlanError(f"microbatch: offsets ({len(self.offsets)}) and continued ({len(self.continued)}) "
                            f"must have one entry per sequence ({n})")
        if np.any(self.offsets < 0):
            raise PlanError(f"microbatch has negative slice offsets: {self.offsets[self.offsets < 0].tolist()}")
        if len(np.unique(self.seq_ids)) < n:
            raise PlanError(f"microbatch holds a sequence twice: {self.seq_ids.tolist()}")
        if len(self.lengths) != n or len(self.row_ids) != n:
            raise PlanError(f"microbatch: seq_ids ({n}), lengths ({len(self.lengths)}) and row_ids ({len(self.row_ids)}) differ in size")
        if n == 0:
            raise PlanError("microbatch holds no sequence")
        if self.batch < 1 or self.padded_len < 1:
            raise PlanError(f"microbatch shape must be positive, got batch={self.batch} padded_len={self.padded_len}")
        if np.any(self.lengths < 1):
            raise PlanError(f"microbatch has non-positive lengths: {self.lengths[self.lengths < 1].tolist()}")
        if self.row_ids.min() < 0 or self.row_ids.max() >= self.batch:
            raise PlanError(f"row_ids out of range [0, {self.batch}): {self.row_ids.tolist()}")
        per_row = np.bincount(self.row_ids, weights=self.lengths, minlength=self.batch)
        if per_row.max() > self.padded_len:
            r = int(per_row.argmax())
            raise PlanError(f"row {r} holds {int(per_row[r])} tokens > padded_len {self.padded_len}")

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def computed_tokens(self) -> int:
        return self.batch * self.padded_len

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.real_tokens / self.computed_tokens

    @cached_property
    def is_packed(self) -> bool:
        """True when some row holds more than one sequence (computed once, as ``slice_mask``)."""
        return len(np.unique(self.row_ids)) < self.num_seqs

    @cached_property
    def slice_mask(self) -> np.ndarray:
        """``(num_seqs,)`` bool, read-only: which entries are slice segments (offset > 0 or continued);
        computed once (the fields are frozen; not a field: equality, hash, JSON unchanged)."""
        mask = (self.offsets > 0) | self.continued
        mask.setflags(write=False)
        return mask

    @cached_property
    def has_slices(self) -> bool:
        """Whether some entry is a slice segment (computed once, as ``slice_mask``)."""
        return bool(self.slice_mask.any())

    @property
    def continued_tokens(self) -> int:
        """Tokens of the slices whose keys and values later slices attend to (held until this
        microbatch's backward, with their gradients)."""
        return int(self.lengths[self.continued].sum())

    def attention_work(self, attention: str = "auto") -> int:
        """Sum over attention segments of segment_length**2: the attention term of the cost.

        ``auto`` (attention as trainers run it): a row holding one document runs causal
        attention over its whole padded row (pads included), ``batch * padded_len**2``;
        a microbatch with packed rows or slices runs document-causal attention,
        ``sum(s_i**2)`` over its documents that are not slice segments, plus the slices'
        ``prefix_work``. ``dense`` (the (s, s) mask ablation): ``batch * padded_len**2``.
        Computed once per setting (the fields are frozen; the planner asks for it of every candidate plan).
        """
        works = self.__dict__.setdefault("_attention_works", {})   # computed once per setting (fields frozen)
        work = works.get(attention)
        if work is None:
            if attention not in ATTENTION_KINDS:
                raise ValueError(f"unknown attention {attention!r}; expected one of {', '.join(ATTENTION_KINDS)}")
            if attention == "auto" and (self.is_packed or self.has_slices):
                whole = self.lengths[~self.slice_mask].astype(np.int64)
                work = int(np.sum(whole ** 2)) + self.prefix_work()
            else:
                work = self.batch * self.padded_len ** 2
            works[attention] = work
        return work

    _DERIVED = ("slice_mask", "has_slices", "is_packed", "_attention_works")
    """What a microbatch computes once from its fields and keeps beside them: not part of its pickled state, so
    that two pickles of equal microbatches are equal whatever either was asked before."""

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in self._DERIVED}

    def prefix_work(self) -> int:
        """Attention work of the slice segments: a slice of n tokens at offset p attends to
        its p prefix keys and causally to itself, ``sum(n * (p + n))`` (the same scale as
        ``attention_work``'s ``s**2``: a causal segment of s tokens counts s**2)."""
        m = self.slice_mask
        n, p = self.lengths[m].astype(np.int64), self.offsets[m].astype(np.int64)
        return int(np.sum(n * (2 * p + n)))

    def rows(self) -> list[np.ndarray]:
        """Positions (into ``seq_ids``) of the sequences in each row, in order."""
        return [np.flatnonzero(self.row_ids == r) for r in range(self.batch)]

    def to_dict(self) -> dict[str, Any]:
        d = {
            "seq_ids": self.seq_ids.tolist(),
            "lengths": self.lengths.tolist(),
            "padded_len": self.padded_len,
            "batch": self.batch,
        }
        if not np.array_equal(self.row_ids, np.arange(self.num_seqs)):
            d["row_ids"] = self.row_ids.tolist()
        if self.recompute:
            d["recompute"] = True
        if self.has_slices:
            m = self.slice_mask
            d["slices"] = [[int(i), int(o), int(o + n)] for i, o, n in
                           zip(self.seq_ids[m], self.offsets[m], self.lengths[m])]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Microbatch":
        """The JSON form; ``slices`` (``[seq_id, start, end]`` token ranges) give the slice entries'
        offsets and mark them ``continued`` (``Plan.from_dict`` then clears it on each sequence's
        last slice, which only the whole plan knows)."""
        seq_ids = np.asarray(d["seq_ids"], dtype=np.int64).reshape(-1)
        lengths = np.asarray(d["lengths"], dtype=np.int64).reshape(-1)
        offsets, continued = np.zeros(len(seq_ids), np.int64), np.zeros(len(seq_ids), bool)
        for sid, start, end in d.get("slices", []):
            k = np.flatnonzero(seq_ids == int(sid))
            if len(k) != 1 or int(end) - int(start) != int(lengths[k[0]]) or int(start) < 0:
                raise PlanError(f"slice [{sid}, {start}, {end}] does not match an entry of the microbatch "
                                f"(seq_ids {seq_ids.tolist()}, lengths {lengths.tolist()})")
            offsets[k[0]], continued[k[0]] = int(start), True
        return cls(seq_ids=seq_ids, lengths=lengths, padded_len=d["padded_len"], batch=d["batch"],
                   row_ids=d.get("row_ids"), recompute=bool(d.get("recompute", False)), offsets=offsets,
                   continued=continued)
