"""The memory budget of one packing call: per-stage caps, in-flight counts, admissible rows.

Stage i may spend ``cap_i = limit - state_bytes_i`` on activations and holds ``k_i``
microbatches in flight: the kind's window (``dynmb.schedule.kinds``: ``P - i`` under 1F1B /
memory-aware / the zero-bubble kinds), 1 under a kind without a window (GPipe, whose whole
batch is checked afterwards), and under a kind with virtual stages (interleaved) with
``virtual`` > 1 chunks per GPU the kind's ``chunk_window`` of the GPU, whose stages' states
add up (before ``m`` is known, rounds of ``R``; ``for_microbatch_counts`` raises it to what a step
of ``m`` microbatches holds). A microbatch of b rows x s tokens is admissible under the
tight budget ``k_i * act_i(b, s) + transient_i(b, s) <= cap_i`` (exact for equal
microbatches) or the safe one ``k_i * (act_i + transient_i) <= cap_i`` (any mix, any order);
``PackContext.bmax(s)`` is the most rows admissible at each length s
(``MemoryModel.max_rows``, non-increasing in s), and ``max_len`` finds the longest
admissible one-row length by bisection on it. With activation offload the memory model is an ``offloading`` view
(``dynmb.planning.offload``): its ``max_rows`` charges the held bytes less the offloaded blocks' and the bytes in
transit beside the op, so the same budget admits more where a stage holds many microbatches in flight.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from dynmb.memory.model import MemoryModelLike
from dynmb.core.planspec import PlanSpec
from dynmb.schedule.kinds import ScheduleKind, get_kind
from dynmb.packing.rows import round_down, round_up

__all__ = ["PackingError", "PackContext", "max_fitting_length", "auto_mbs", "stage_windows"]


def stage_windows(kind: ScheduleKind, num_stages: int) -> np.ndarray:
    """Per-microbatch in-flight count of every stage for the admissibility budget: the kind's
    window, 1 without one (GPipe: its whole batch is checked afterwards)."""
    if kind.window is None:
        return np.ones(num_stages, dtype=np.int64)
    return np.array([kind.inflight(i, num_stages, 2**30) for i in range(num_stages)], dtype=np.int64)


class PackingError(ValueError):
    """The global batch cannot be packed under the memory limit (names the sequences / numbers)."""


class PackContext:
    """Per-call constants: caps, in-flight counts and the admissible-rows function."""

    row_cap: int | None = None
    """The longest one packed row may be (``balanced``'s rows hold several documents: the model's
    ``max_seq_len`` at most); None: memory alone decides."""

    def __init__(self, mm: Any, limit: int, p: int, kind: str | ScheduleKind, tight: bool = True,
                 virtual: int = 1, embedding: str = "first") -> None:
        rec = get_kind(kind)                 # a name resolved here once (a record as given): every packer reads rec
        self.mm, self.limit, self.p, self.kind, self.tight, self.virtual = mm, int(limit), p, rec.name, tight, virtual
        self.embedding = embedding
        """Where the token embedding runs (``PlanSpec.embedding``): ``last`` adds its work to the packers'
        estimates (``dynmb.packing.embedprice``)."""
        self.rec = rec
        """The schedule kind's record (``dynmb.schedule.kinds``): its window, placement and estimate."""
        state: np.ndarray = np.asarray(mm.state_bytes, dtype=np.float64)
        if rec.virtual_stages and virtual > 1 and rec.chunk_window is not None:
            # one GPU holds stages r, r + R, ...: their states add up, and at most `warm` chunk-
            # microbatches are in flight on it (the bound of memory.peak_from_matrix)
            if p % virtual:
                raise PackingError(f"{p} stages are not a multiple of virtual {virtual}")
            R = p // virtual
            rank = np.array([rec.rank_of(s, p, virtual) for s in range(p)])      # the kind's placement
            state = np.bincount(rank, weights=state, minlength=R)[rank]
            self.k = rec.chunk_window(rank, R, virtual)
        else:
            self.k = stage_windows(rec, p)
        self.caps = float(limit) - state
        if np.any(self.caps <= 0):
            i = int(np.argmin(self.caps))
            where = f"stage {i}" if virtual == 1 or not rec.virtual_stages else f"the GPU holding stage {i}"
            raise PackingError(
                f"memory limit {int(limit)} B is below the model states of {where}: "
                f"{int(state[i])} B (params + grads + optimizer); states per stage: "
                f"{[int(x) for x in mm.state_bytes]}")

    @classmethod
    def from_spec(cls, spec: PlanSpec, mm: Any, kind: ScheduleKind | None = None) -> "PackContext":
        """The context of a planning step's settings (tight budget; ``with_budget`` for the safe one); ``kind``:
        the record of ``spec.schedule_kind`` where the caller resolved it."""
        return cls(mm, spec.memory_limit_bytes, spec.num_stages, kind or spec.schedule_kind, virtual=spec.virtual,
                   embedding=spec.embedding)

    def with_budget(self, tight: bool) -> "PackContext":
        """This context under the tight or the safe budget (caps and in-flight counts shared)."""
        if tight == self.tight:
            return self
        other = copy.copy(self)
        other.tight = tight
        return other

    def for_microbatch_counts(self, counts: Any) -> "PackContext":
        """This context with every GPU's in-flight count at least what its kind holds with each of
        ``counts`` microbatches in a step (``chunk_window``'s ``m``: interleaved rounds that ``R`` does
        not split warm up more than packing assumed); itself for a kind without a chunk window."""
        rec = self.rec
        if not (rec.virtual_stages and self.virtual > 1 and rec.chunk_window is not None):
            return self
        R = self.p // self.virtual
        rank = np.array([rec.rank_of(s, self.p, self.virtual) for s in range(self.p)])
        other = copy.copy(self)
        for m in {int(c) for c in counts if int(c) > 0}:
            other.k = np.maximum(other.k, rec.chunk_window(rank, R, self.virtual, m))
        return other

    def with_row_cap(self, row_cap: int) -> "PackContext":
        """This context with every row longer than ``row_cap`` inadmissible (``balanced``'s rows
        hold several documents: the length cap, the model's ``max_seq_len`` at most)."""
        other = copy.copy(self)
        other.row_cap = int(row_cap)
        return other

    def bmax(self, s: Any) -> np.ndarray:
        """The most rows admissible at each padded length in ``s`` (0 where none, and where ``s``
        is over ``row_cap``)."""
        rows = self.mm.max_rows(self.caps, s, self.k, tight=self.tight)
        return rows if self.row_cap is None else np.where(np.asarray(s) > self.row_cap, 0, rows)

    def max_len(self, cap_len: int) -> int:
        """Largest s <= cap_len with one admissible row (bmax is non-increasing in s)."""
        if self.bmax([cap_len])[0] >= 1:
            return int(cap_len)
        lo, hi = 0, int(cap_len)                   # bmax(lo) >= 1 (or lo == 0), bmax(hi) == 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.bmax([mid])[0] >= 1 else (lo, mid)
        return lo

    def length_cap(self, upto: int, round_to: int = 1) -> int:
        """Largest multiple of ``round_to`` <= ``upto`` with one admissible row (0 if none)."""
        top = round_down(int(upto), round_to)
        return round_down(self.max_len(top), round_to) if top >= 1 else 0


def max_fitting_length(memory_model: MemoryModelLike, memory_limit_bytes: int, num_stages: int,
                       schedule_kind: str = "1f1b", upto: int = 1 << 16, round_to: int = 1) -> int:
    """The longest sequence (a multiple of ``round_to``, <= ``upto``) admissible alone (one row)."""
    return PackContext(memory_model, memory_limit_bytes, num_stages, schedule_kind).length_cap(upto, round_to)


def auto_mbs(memory_model: MemoryModelLike, memory_limit_bytes: int, num_stages: int, max_len: int,
             schedule_kind: str = "1f1b", round_to: int = 1) -> int:
    """The largest mbs whose worst case (every row ``max_len`` long, rounded up to a multiple
    of ``round_to``) is admissible (0 if none)."""
    ctx = PackContext(memory_model, memory_limit_bytes, num_stages, schedule_kind)
    return int(ctx.bmax([round_up(int(max_len), round_to)])[0])
