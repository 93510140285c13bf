"""Core frozen types shared by every part of dynmb: Microbatch, Plan, Action, Schedule.

numpy only. A *global batch* is an ``np.ndarray[int64]`` of sequence lengths; a
sequence is identified by its index in that array.

- ``Microbatch``: the sequences it holds, the row each sits in, and the shape it runs at (``batch``
  rows x ``padded_len`` columns). One sequence per row is the usual case; ``packed`` puts several in a row.
- Slices: a sequence longer than any row that fits may be cut into consecutive slices (``--oversize
  split``), each an entry of a different microbatch with its token ``offset`` in the sequence and
  ``continued`` (a later slice follows). In execution order the slices of one sequence cover ``[0,
  length)`` back to back; slice j attends to the keys and values of slices 0..j-1 on every stage, so
  their forwards run in slice order and their backwards in reverse (``Plan.slice_groups``).
- ``Plan``: microbatches in execution order plus the method, memory limit and the
  planner's predictions. Invariant (``Plan.validate``): every sequence of the
  global batch appears exactly once, or as one chain of slices (or is listed in
  ``meta.dropped`` / ``meta.truncated`` by an explicit policy).
  ``Plan.spec`` is the ``PlanSpec`` it was planned with (its JSON's ``"spec"``),
  ``Plan.predictions`` a ``Predictions`` record and ``Plan.meta`` a ``PlanMeta`` record
  (``dynmb.core.planmeta``: what the packer and planner chose, and the run context).
- ``Action``: ``(stage, op, mb)`` printed ``2F7`` like torch.distributed.pipelining's
  ``_Action`` (``F`` forward, ``B`` full backward; a split backward is ``I``, the input
  gradient, then ``W``, the weight gradients: torch's BACKWARD_INPUT / BACKWARD_WEIGHT).
- ``Schedule``: one tuple of Actions per rank; the single schedule IR.

This module holds ``Plan``; ``Microbatch`` (``dynmb.core.microbatch``), ``Action`` and ``Schedule``
(``dynmb.core.actions``), ``Predictions`` (``dynmb.core.predictions``) and ``PlanSpec``
(``dynmb.core.planspec``) live in their own modules and are re-exported here.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dynmb.core.actions import OPS, Action, Schedule
from dynmb.io.atomic import write_text_atomic
from dynmb.core.microbatch import Microbatch, PlanError
from dynmb.core.planmeta import PlanMeta
from dynmb.core.planspec import ATTENTION_KINDS, PlanSpec
from dynmb.core.predictions import Predictions

__all__ = ["Microbatch", "Plan", "Action", "Schedule", "OPS", "ATTENTION_KINDS", "PlanError", "Predictions",
           "PlanSpec", "PlanMeta"]


@dataclass(frozen=True, eq=False)
class Plan:
    """Microbatches of one global batch, in execution order.

    ``replica_ids[i]`` is the data-parallel pipeline that runs microbatch ``i``
    (all zero without data parallelism). ``predictions`` holds what the planner
    predicted (``Predictions``: ``pred_step_s``, ``pred_peak_bytes`` per stage, ``plan_s``, ...;
    a mapping given here is converted); ``spec`` the settings it was planned with (None for a
    plan made by hand or read from an older file); ``meta`` holds what the packer chose and
    run context (``PlanMeta``: ``mbs``, ``dataset``, ``seed``, ``dropped``, ``truncated``, ...; a
    mapping given here is converted).
    ``dataset_ids[i]``, when known, is the row of the trace (or corpus) that sequence ``i`` of
    the global batch was drawn from; the JSON form lists them per microbatch (``dataset_ids``,
    one per ``seq_ids`` entry) and for the whole batch, and the digest covers them.
    """

    microbatches: tuple[Microbatch, ...]
    method: str
    num_stages: int
    memory_limit_bytes: int
    num_sequences: int
    schedule_kind: str = "1f1b"
    dp: int = 1
    replica_ids: tuple[int, ...] | None = None
    predictions: Predictions = field(default_factory=Predictions)
    meta: PlanMeta = field(default_factory=PlanMeta)
    spec: PlanSpec | None = None
    dataset_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "microbatches", tuple(self.microbatches))
        if not isinstance(self.predictions, Predictions):
            object.__setattr__(self, "predictions", Predictions.from_dict(self.predictions))
        if not isinstance(self.meta, PlanMeta):
            object.__setattr__(self, "meta", PlanMeta.from_dict(self.meta))
        if self.dataset_ids is not None:
            object.__setattr__(self, "dataset_ids", tuple(int(i) for i in self.dataset_ids))
            if len(self.dataset_ids) != self.num_sequences:
                raise PlanError(f"dataset_ids has {len(self.dataset_ids)} entries for {self.num_sequences} sequences")
        rids = (0,) * len(self.microbatches) if self.replica_ids is None else tuple(int(r) for r in self.replica_ids)
        object.__setattr__(self, "replica_ids", rids)
        if len(rids) != len(self.microbatches):
            raise PlanError("replica_ids and microbatches differ in length")
        if self.num_stages < 1 or self.dp < 1:
            raise PlanError(f"num_stages and dp must be >= 1, got {self.num_stages}, {self.dp}")

    # --- derived quantities -------------------------------------------------
    @property
    def replica_of(self) -> tuple[int, ...]:
        """Each microbatch's data-parallel replica: ``replica_ids`` as construction completed it (never None)."""
        return self.replica_ids if self.replica_ids is not None else (0,) * len(self.microbatches)

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
        mbs = tuple(mb for mb, rid in zip(self.microbatches, self.replica_of) if rid == r)
        return replace(self, microbatches=mbs, dp=1, replica_ids=None, predictions=self.predictions,
                       meta=self.meta.with_(replica=r, dp=self.dp))

    def with_order(self, order: Sequence[int], **meta: Any) -> "Plan":
        """The same plan with microbatches permuted: new position i runs old ``order[i]``."""
        order = [int(i) for i in order]
        if sorted(order) != list(range(self.num_microbatches)):
            raise PlanError(f"order is not a permutation of 0..{self.num_microbatches - 1}: {order}")
        return replace(self, microbatches=tuple(self.microbatches[i] for i in order),
                       replica_ids=tuple(self.replica_of[i] for i in order), predictions=self.predictions,
                       meta=self.meta.merged(meta))

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
        for i, later in enumerate(after):
            for j in later:
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
        data-parallel replica. With ``dp > 1`` every replica runs at least one microbatch, all the
        same number unless the plan holds slices (a chain runs whole on one replica).

        Sequences listed in ``meta['dropped']`` must be absent; those in
        ``meta['truncated']`` may appear with a shorter length (whole or sliced). With ``lengths``
        (the global batch) each sequence's length (its slices' sum) is checked too.
        """
        if not self.microbatches:
            raise PlanError("plan has no microbatch")
        groups = self.slice_groups()
        self._check_each_once(groups)
        total = self._check_chains(groups)
        if lengths is not None:
            self._check_lengths(np.asarray(lengths, dtype=np.int64), total)
        if self.dp > 1:
            per = np.bincount(np.asarray(self.replica_ids), minlength=self.dp)
            if len(per) != self.dp or np.any(per == 0):
                raise PlanError(f"each of the {self.dp} replicas must run at least one microbatch, got {per.tolist()}")
            if not groups and np.any(per != per[0]):
                raise PlanError(f"data-parallel replicas must run the same number of microbatches, got {per.tolist()}")

    def _check_each_once(self, groups: dict[int, tuple[int, ...]]) -> None:
        """Every sequence of the batch exactly once: whole, as one chain of slices, or dropped."""
        ids = np.concatenate([mb.seq_ids for mb in self.microbatches])
        sliced = np.fromiter(groups, dtype=np.int64, count=len(groups))
        whole = ids[~np.concatenate([mb.slice_mask for mb in self.microbatches])]
        dropped = np.asarray(self.meta.dropped or [], dtype=np.int64)
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

    def _check_chains(self, groups: dict[int, tuple[int, ...]]) -> dict[int, int]:
        """Each chain's slices in order, back to back, all but the last ``continued``, on one replica;
        returns each sliced sequence's length (its slices' sum)."""
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
            if len({self.replica_of[i] for i in where}) > 1:
                raise PlanError(f"sequence {sid}: its slices run on different data-parallel replicas")
            total[sid] = expect
        return total

    def _check_lengths(self, lengths: np.ndarray, total: dict[int, int]) -> None:
        """Every whole sequence's length, and every chain's sum, is the batch's (shorter only if truncated)."""
        ids = np.concatenate([mb.seq_ids for mb in self.microbatches])
        got = np.concatenate([mb.lengths for mb in self.microbatches])
        keep = ~np.concatenate([mb.slice_mask for mb in self.microbatches])
        wid, got = ids[keep], got[keep]
        want = lengths[wid]
        truncated = set(int(i) for i in self.meta.truncated or [])
        bad = [int(i) for i, g, w in zip(wid, got, want) if g != w and not (int(i) in truncated and g < w)]
        bad += [sid for sid, n in total.items() if n != lengths[sid] and not (sid in truncated and n < lengths[sid])]
        if bad:
            raise PlanError(f"sequences {bad[:10]} have lengths that differ from the global batch")

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
            "replica_ids": list(self.replica_of),
            "predictions": _jsonable(self.predictions.to_dict()),
            "meta": _jsonable(self.meta.to_dict()),
            "spec": None if self.spec is None else self.spec.to_dict(),
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
            replica_ids=d.get("replica_ids"), predictions=d.get("predictions", {}),
            meta=PlanMeta.from_dict(d.get("meta")),
            spec=None if d.get("spec") is None else PlanSpec.from_dict(d["spec"]),
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
        for mb, r in zip(self.microbatches, self.replica_of):
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
    if isinstance(x, (np.ndarray, np.generic)):
        return x.tolist()
    return x
