"""Core frozen types shared by every part of dynmb: Microbatch, Plan, Action, Schedule.

numpy only. A *global batch* is an ``np.ndarray[int64]`` of sequence lengths; a
sequence is identified by its index in that array.

- ``Microbatch``: the sequences it holds, the row each sits in, and the shape it
  runs at (``batch`` rows x ``padded_len`` columns). One sequence per row is the
  usual case; the ``packed`` method puts several documents in one row.
- Slices: a sequence longer than any row that fits may be cut into consecutive
  slices (``--oversize split``), each an entry of a different microbatch with its
  token ``offset`` in the sequence and ``continued`` (a later slice follows). In
  execution order the slices of one sequence cover ``[0, length)`` back to back;
  slice j attends to the keys and values of slices 0..j-1 on every stage, so their
  forwards run in slice order and their backwards in reverse (``Plan.slice_groups``).
- ``Plan``: microbatches in execution order plus the method, memory limit and the
  planner's predictions. Invariant (``Plan.validate``): every sequence of the
  global batch appears exactly once, or as one chain of slices (or is listed in
  ``meta['dropped']`` / ``meta['truncated']`` by an explicit policy).
- ``Action``: ``(stage, op, mb)`` printed ``2F7`` like torch.distributed.pipelining's
  ``_Action`` (``F`` forward, ``B`` full backward; a split backward is ``I``, the input
  gradient, then ``W``, the weight gradients: torch's BACKWARD_INPUT / BACKWARD_WEIGHT).
- ``Schedule``: one tuple of Actions per rank; the single schedule IR.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from dynmb.atomic import write_text_atomic

__all__ = ["Microbatch", "Plan", "Action", "Schedule", "OPS", "ATTENTION_KINDS", "PlanError"]

OPS = ("F", "B", "I", "W")
"""Action ops, torch's ``_ComputationType`` letters: forward, full backward, backward input, backward weight."""

ATTENTION_KINDS = ("auto", "dense")
"""``auto``: causal attention without a mask for one document per row, document-causal
(sum of s_i^2) for packed rows; ``dense``: the (s, s) mask tensor on every row (ablation)."""


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
    row_ids: np.ndarray | None = None
    recompute: bool = False
    offsets: np.ndarray | None = None
    continued: np.ndarray | None = None

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

    @property
    def is_packed(self) -> bool:
        """True when some row holds more than one sequence."""
        return len(np.unique(self.row_ids)) < self.num_seqs

    @property
    def slice_mask(self) -> np.ndarray:
        """``(num_seqs,)`` bool: which entries are slice segments (offset > 0 or continued)."""
        return (self.offsets > 0) | self.continued

    @property
    def has_slices(self) -> bool:
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
        """
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"unknown attention {attention!r}; expected one of {', '.join(ATTENTION_KINDS)}")
        if attention == "auto" and (self.is_packed or self.has_slices):
            whole = self.lengths[~self.slice_mask].astype(np.int64)
            return int(np.sum(whole ** 2)) + self.prefix_work()
        return self.batch * self.padded_len ** 2

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


@dataclass(frozen=True, eq=False)
class Plan:
    """Microbatches of one global batch, in execution order.

    ``replica_ids[i]`` is the data-parallel pipeline that runs microbatch ``i``
    (all zero without data parallelism). ``predictions`` holds what the planner
    predicted (``pred_step_s``, ``pred_peak_bytes`` per stage, ``plan_s``);
    ``meta`` holds settings (``mbs``, ``dataset``, ``seed``, ``dropped``,
    ``truncated``, ...). ``dataset_ids[i]``, when known, is the row of the trace (or
    corpus) that sequence ``i`` of the global batch was drawn from; the JSON form lists
    them per microbatch (``dataset_ids``, one per ``seq_ids`` entry) and for the whole
    batch, and the digest covers them.
    """

    microbatches: tuple[Microbatch, ...]
    method: str
    num_stages: int
    memory_limit_bytes: int
    num_sequences: int
    schedule_kind: str = "1f1b"
    dp: int = 1
    replica_ids: tuple[int, ...] | None = None
    predictions: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    dataset_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "microbatches", tuple(self.microbatches))
        if self.dataset_ids is not None:
            object.__setattr__(self, "dataset_ids", tuple(int(i) for i in self.dataset_ids))
            if len(self.dataset_ids) != self.num_sequences:
                raise PlanError(f"dataset_ids has {len(self.dataset_ids)} entries for {self.num_sequences} sequences")
        if self.replica_ids is None:
            object.__setattr__(self, "replica_ids", (0,) * len(self.microbatches))
        object.__setattr__(self, "replica_ids", tuple(int(r) for r in self.replica_ids))
        if len(self.replica_ids) != len(self.microbatches):
            raise PlanError("replica_ids and microbatches differ in length")
        if self.num_stages < 1 or self.dp < 1:
            raise PlanError(f"num_stages and dp must be >= 1, got {self.num_stages}, {self.dp}")

    # --- derived quantities -------------------------------------------------
    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches)

    @property
    def real_tokens(self) -> int:
        return sum(mb.real_tokens for mb in self.microbatches)

    @property
    def computed_tokens(self) -> int:
        return sum(mb.computed_tokens for mb in self.microbatches)

    @property
    def padding_fraction(self) -> float:
        c = self.computed_tokens
        return 1.0 - self.real_tokens / c if c else 0.0

    def shapes(self) -> np.ndarray:
        """``(num_microbatches, 2)`` int64 array of (batch, padded_len)."""
        return np.array([[mb.batch, mb.padded_len] for mb in self.microbatches], dtype=np.int64).reshape(-1, 2)

    def recompute_mask(self) -> np.ndarray:
        """``(num_microbatches,)`` bool: which microbatches run with full recomputation."""
        return np.array([bool(getattr(mb, "recompute", False)) for mb in self.microbatches], dtype=bool)

    def attention_work(self, attention: str = "auto") -> np.ndarray:
        """``(num_microbatches,)`` float64: each microbatch's ``Microbatch.attention_work``."""
        return np.array([mb.attention_work(attention) for mb in self.microbatches], dtype=np.float64)

    def prefix_cross_work(self) -> np.ndarray:
        """``(num_microbatches,)`` float64: the part of ``prefix_work`` that is slices' queries
        against their prefix keys, ``sum(2 n p)`` (a slice's own tokens are ``n**2``)."""
        return np.array([float(np.sum(2 * mb.lengths[mb.slice_mask].astype(np.int64)
                                      * mb.offsets[mb.slice_mask].astype(np.int64))) for mb in self.microbatches])

    def replica(self, r: int) -> "Plan":
        """The sub-plan data-parallel pipeline ``r`` runs (microbatches renumbered from 0)."""
        mbs = tuple(mb for mb, rid in zip(self.microbatches, self.replica_ids) if rid == r)
        return replace(self, microbatches=mbs, dp=1, replica_ids=None, predictions=dict(self.predictions),
                       meta={**self.meta, "replica": r, "dp": self.dp})

    def with_order(self, order: Sequence[int], **meta: Any) -> "Plan":
        """The same plan with microbatches permuted: new position i runs old ``order[i]``."""
        order = [int(i) for i in order]
        if sorted(order) != list(range(self.num_microbatches)):
            raise PlanError(f"order is not a permutation of 0..{self.num_microbatches - 1}: {order}")
        return replace(self, microbatches=tuple(self.microbatches[i] for i in order),
                       replica_ids=tuple(self.replica_ids[i] for i in order), predictions=dict(self.predictions),
                       meta={**self.meta, **meta})

    def slice_groups(self) -> dict[int, tuple[int, ...]]:
        """Sliced sequences: ``{seq_id: (microbatch index of slice 0, of slice 1, ...)}``, the
        microbatches in execution order (forwards must follow it on every stage, backwards
        run in reverse). Empty when no sequence is sliced."""
        where: dict[int, list[int]] = {}
        for i, mb in enumerate(self.microbatches):
            if mb.has_slices:
                for sid in mb.seq_ids[mb.slice_mask].tolist():
                    where.setdefault(int(sid), []).append(i)
        return {sid: tuple(ix) for sid, ix in where.items()}

    @property
    def has_slices(self) -> bool:
        return any(mb.has_slices for mb in self.microbatches)

    def backward_order(self) -> list[int]:
        """Microbatches in the order their backwards run on every stage: microbatch order,
        except that a microbatch waits for the backwards of the later slices of every
        sequence it holds a slice of (slices backward in reverse). Among the microbatches
        ready, the lowest index goes first; without slices it is ``0..m-1``."""
        m = self.num_microbatches
        after: list[set[int]] = [set() for _ in range(m)]     # after[i]: later slices i waits for
        for where in self.slice_groups().values():
            for a, b in zip(where, where[1:]):
                after[a].add(b)
        waiting = [len(a) for a in after]
        before: list[list[int]] = [[] for _ in range(m)]
        for i, a in enumerate(after):
            for j in a:
                before[j].append(i)
        ready = [i for i in range(m) if waiting[i] == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            i = heapq.heappop(ready)
            order.append(i)
            for j in before[i]:
                waiting[j] -= 1
                if waiting[j] == 0:
                    heapq.heappush(ready, j)
        if len(order) != m:
            raise PlanError("slices of long sequences wait on each other in a cycle")
        return order

    # --- invariants ---------------------------------------------------------
    def validate(self, lengths: np.ndarray | None = None) -> None:
        """Raise ``PlanError`` unless every sequence appears exactly once, or as one chain of
        slices: entries in distinct microbatches, in execution order, whose offsets run
        0, l0, l0 + l1, ... back to back, every one but the last ``continued``, all in one
        data-parallel replica.

        Sequences listed in ``meta['dropped']`` must be absent; those in
        ``meta['truncated']`` may appear with a shorter length. With ``lengths``
        (the global batch) each sequence's length (its slices' sum) is checked too.
        """
        if not self.microbatches:
            raise PlanError("plan has no microbatch")
        ids = np.concatenate([mb.seq_ids for mb in self.microbatches])
        groups = self.slice_groups()
        sliced = np.fromiter(groups, dtype=np.int64, count=len(groups))
        whole = ids[~np.concatenate([mb.slice_mask for mb in self.microbatches])]
        dropped = np.asarray(self.meta.get("dropped", []), dtype=np.int64)
        counts = np.bincount(np.concatenate([whole, sliced, dropped]), minlength=self.num_sequences)
        if len(counts) > self.num_sequences:
            bad = np.flatnonzero(np.arange(len(counts)) >= self.num_sequences)
            raise PlanError(f"sequence ids beyond the global batch of {self.num_sequences}: {bad[:10].tolist()}")
        if np.any(counts != 1):
            missing = np.flatnonzero(counts == 0)
            repeated = np.flatnonzero(counts > 1)
            raise PlanError(
                f"every sequence must appear exactly once: missing {missing[:10].tolist()}"
                f"{'...' if len(missing) > 10 else ''} ({len(missing)}), repeated {repeated[:10].tolist()} ({len(repeated)})"
            )
        total: dict[int, int] = {}
        for sid, where in groups.items():
            expect = 0
            for j, i in enumerate(where):
                mb = self.microbatches[i]
                k = int(np.flatnonzero(mb.seq_ids == sid)[0])
                off, n, cont = int(mb.offsets[k]), int(mb.lengths[k]), bool(mb.continued[k])
                if off != expect:
                    raise PlanError(f"sequence {sid}: slice {j} (microbatch {i}) starts at token {off}, expected {expect} "
                                    f"(slices must run in order, back to back)")
                if cont != (j < len(where) - 1):
                    raise PlanError(f"sequence {sid}: slice {j} (microbatch {i}) has continued={cont}, but it is "
                                    f"slice {j} of {len(where)}")
                expect += n
            if len({self.replica_ids[i] for i in where}) > 1:
                raise PlanError(f"sequence {sid}: its slices run on different data-parallel replicas")
            total[sid] = expect
        if lengths is not None:
            lengths = np.asarray(lengths, dtype=np.int64)
            got = np.concatenate([mb.lengths for mb in self.microbatches])
            keep = ~np.concatenate([mb.slice_mask for mb in self.microbatches])
            wid, got = ids[keep], got[keep]
            want = lengths[wid]
            truncated = set(int(i) for i in self.meta.get("truncated", []))
            bad = [int(i) for i, g, w in zip(wid, got, want) if g != w and not (int(i) in truncated and g < w)]
            bad += [sid for sid, n in total.items() if n != lengths[sid]]
            if bad:
                raise PlanError(f"sequences {bad[:10]} have lengths that differ from the global batch")
        if self.dp > 1:
            per = np.bincount(np.asarray(self.replica_ids), minlength=self.dp)
            if len(per) != self.dp or np.any(per != per[0]):
                raise PlanError(f"data-parallel replicas must run the same number of microbatches, got {per.tolist()}")

    # --- I/O ----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        mbs = [mb.to_dict() for mb in self.microbatches]
        if self.dataset_ids is not None:
            for d, mb in zip(mbs, self.microbatches):
                d["dataset_ids"] = [self.dataset_ids[i] for i in mb.seq_ids.tolist()]
        return {
            "method": self.method,
            "num_stages": self.num_stages,
            "memory_limit_bytes": int(self.memory_limit_bytes),
            "num_sequences": int(self.num_sequences),
            "schedule_kind": self.schedule_kind,
            "dp": self.dp,
            "replica_ids": list(self.replica_ids),
            "predictions": _jsonable(self.predictions),
            "meta": _jsonable(self.meta),
            "microbatches": mbs,
            **({} if self.dataset_ids is None else {"dataset_ids": list(self.dataset_ids)}),
            "digest": self.digest(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        for k in ("method", "num_stages", "memory_limit_bytes", "microbatches"):
            if k not in d:
                raise PlanError(f"plan JSON lacks the field {k!r}")
        mbs = _last_slices_end(tuple(Microbatch.from_dict(m) for m in d["microbatches"]))
        n = d.get("num_sequences")
        if n is None:
            n = int(max(int(m.seq_ids.max()) for m in mbs) + 1)
        return cls(
            microbatches=mbs, method=d["method"], num_stages=int(d["num_stages"]),
            memory_limit_bytes=int(d["memory_limit_bytes"]), num_sequences=int(n),
            schedule_kind=d.get("schedule_kind", "1f1b"), dp=int(d.get("dp", 1)),
            replica_ids=d.get("replica_ids"), predictions=d.get("predictions", {}), meta=d.get("meta", {}),
            dataset_ids=_dataset_ids(d, int(n)),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, s: str) -> "Plan":
        return cls.from_dict(json.loads(s))

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path, *, allow_over_limit: bool = False) -> "Plan":
        """Read and validate a plan file: every sequence exactly once, each row holding its
        sequences, and (unless ``allow_over_limit``) every stage's ``pred_peak_bytes`` within
        ``memory_limit_bytes``; a ``digest`` field, when present, must be the plan's ``digest()``
        (the microbatches were not edited after it was written). A bad file raises ``PlanError``
        (one line) naming it."""
        path = Path(path)
        text = path.read_text()
        try:
            raw = json.loads(text)
            plan = cls.from_dict(raw)
            plan.validate()
        except json.JSONDecodeError as e:
            raise PlanError(f"{path}: not a plan JSON file ({e})") from None
        except (PlanError, KeyError, TypeError, ValueError) as e:
            raise PlanError(f"{path}: invalid plan: {e}") from None
        if isinstance(raw.get("digest"), str) and raw["digest"] != plan.digest():
            raise PlanError(f"{path}: its digest {raw['digest'][:12]}... does not match its microbatches "
                            f"({plan.digest()[:12]}...): the plan was edited after it was written; delete the "
                            f"digest field to run the edited plan")
        peaks = [float(x) for x in plan.predictions.get("pred_peak_bytes", []) or []]
        if not allow_over_limit and peaks and max(peaks) > plan.memory_limit_bytes:
            stage = int(np.argmax(peaks))
            raise PlanError(f"{path}: stage {stage}'s predicted peak {int(peaks[stage])} bytes exceeds the plan's "
                            f"memory limit {int(plan.memory_limit_bytes)} bytes (pass allow_over_limit / "
                            f"--allow-over-limit to use it anyway)")
        return plan

    def digest(self) -> str:
        """sha256 of what the runtime executes (shapes, sequences, order, replicas)."""
        h = hashlib.sha256()
        for mb, r in zip(self.microbatches, self.replica_ids):
            h.update(np.array([r, mb.batch, mb.padded_len], dtype=np.int64).tobytes())
            h.update(mb.seq_ids.tobytes())
            h.update(mb.lengths.tobytes())
            h.update(mb.row_ids.tobytes())
            if mb.has_slices:
                h.update(mb.offsets.tobytes())
                h.update(mb.continued.tobytes())
            if mb.recompute:
                h.update(b"recompute")
        if self.dataset_ids is not None:
            h.update(np.asarray(self.dataset_ids, dtype=np.int64).tobytes())
        return h.hexdigest()


def _dataset_ids(d: dict[str, Any], num_sequences: int) -> tuple[int, ...] | None:
    """A plan JSON's ``dataset_ids``: the batch's list, else assembled from the microbatches'
    (every sequence must be given one); the microbatches' must agree with the batch's."""
    whole = d.get("dataset_ids")
    if whole is not None and len(whole) != num_sequences:
        raise PlanError(f"dataset_ids has {len(whole)} entries for {num_sequences} sequences")
    per: dict[int, int] = {}
    for k, m in enumerate(d["microbatches"]):
        if "dataset_ids" not in m:
            continue
        if len(m["dataset_ids"]) != len(m["seq_ids"]):
            raise PlanError(f"microbatch {k}: {len(m['dataset_ids'])} dataset_ids for {len(m['seq_ids'])} seq_ids")
        for sid, row in zip(m["seq_ids"], m["dataset_ids"]):
            if per.setdefault(int(sid), int(row)) != int(row) or (whole is not None and int(whole[int(sid)]) != int(row)):
                raise PlanError(f"microbatch {k}: sequence {sid} has dataset id {row}, elsewhere "
                                f"{whole[int(sid)] if whole is not None else per[int(sid)]}")
    if whole is not None:
        return tuple(int(i) for i in whole)
    if not per:
        return None
    if len(per) != num_sequences:
        missing = sorted(set(range(num_sequences)) - set(per))
        raise PlanError(f"dataset_ids given for some sequences but not {missing[:10]}")
    return tuple(per[i] for i in range(num_sequences))


def _last_slices_end(mbs: tuple[Microbatch, ...]) -> tuple[Microbatch, ...]:
    """Microbatches read from JSON with ``continued`` cleared on each sliced sequence's last slice
    (in execution order): ``Microbatch.from_dict`` marks every listed slice continued."""
    last: dict[int, int] = {}
    for i, mb in enumerate(mbs):
        for sid in mb.seq_ids[mb.continued].tolist():
            last[int(sid)] = i
    out = list(mbs)
    for sid, i in last.items():
        mb = out[i]
        cont = mb.continued.copy()
        cont[mb.seq_ids == sid] = False
        out[i] = replace(mb, continued=cont)
    return tuple(out)


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    return x


_ACTION_RE = re.compile(r"^\s*(\d+)([FBIW])(\d+)\s*$")


@dataclass(frozen=True, order=True)
class Action:
    """``(stage, op, mb)``; ``str(Action(2, 'F', 7)) == '2F7'`` as torch prints ``_Action``."""

    stage: int
    op: str
    mb: int

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r}; expected one of {OPS}")
        if self.stage < 0 or self.mb < 0:
            raise ValueError(f"stage and mb must be >= 0, got {self.stage}, {self.mb}")

    def __str__(self) -> str:
        return f"{self.stage}{self.op}{self.mb}"

    __repr__ = __str__

    @classmethod
    def parse(cls, s: str) -> "Action":
        m = _ACTION_RE.match(s)
        if not m:
            raise ValueError(f"malformed action {s!r}; expected e.g. '2F7' (stage, F/B/I/W, microbatch)")
        return cls(int(m.group(1)), m.group(2), int(m.group(3)))


@dataclass(frozen=True, eq=False)
class Schedule:
    """One ordered tuple of Actions per rank.

    Stage ``s`` lives on the rank whose list holds its actions; the builders use
    torch's loop placement (stage ``s`` on rank ``s % num_ranks``) for
    interleaved schedules. ``kind`` names the builder (``gpipe``, ``1f1b``, ...).
    """

    ranks: tuple[tuple[Action, ...], ...]
    num_stages: int
    num_microbatches: int
    kind: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(tuple(r) for r in self.ranks))

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def stage_to_rank(self) -> dict[int, int]:
        """Map stage -> rank, read off the actions."""
        out: dict[int, int] = {}
        for r, acts in enumerate(self.ranks):
            for a in acts:
                out.setdefault(a.stage, r)
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schedule) and self.ranks == other.ranks and self.num_stages == other.num_stages

    def __hash__(self) -> int:
        return hash(self.ranks)

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.ranks))
