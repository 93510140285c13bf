"""``PlanMeta``: the typed record of what a plan's packer and planner chose, and its run context.

A plan's JSON keeps it under ``"meta"`` as a flat object; this record has one field per key that
dynmb writes (the packers, the planner's searches, ``dynmb plan``, the sampler), each typed and
documented, and keeps the JSON the same: ``to_dict`` lists exactly the keys that were given (a key
given as None is listed with null; a key never given is absent), ``from_dict`` reads them back.

Keys dynmb does not know (a caller's own run context passed as ``plan_step(meta=...)`` /
``Planner.plan(meta=...)``, or a key of an older or newer file) are kept, not refused: they live in
``extra`` and round-trip unchanged, so a plan file read and written again is the same file.

Updates make a new record: ``meta.with_(reorder="ends", candidate="dynamic")``. The record is also a
read-only ``Mapping`` over its keys (``meta["mbs"]``, ``meta.get("mbs")``, ``{**meta}``), the form code
and plan files used before it existed; new code reads the fields (``meta.mbs``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Sequence

__all__ = ["PlanMeta"]


@dataclass(frozen=True, eq=False, kw_only=True)
class PlanMeta(Mapping[str, Any]):
    """What a plan's packer and planner chose and the run context it was made in (module doc)."""

    # --- packing (dynmb.packing.dispatch and the methods) -----------------------------------------
    mbs: int | None = None
    """Rows per microbatch of a fixed-size method (fixed, sorted, packed, lockstep)."""
    max_tokens: int | None = None
    """The token budget of token-budget / balanced (the memory-maximum budget / ``budget_divisor``)."""
    budget_divisor: int | None = None
    """The divisor of the memory-maximum token budget (``PlanSpec.mbs`` of a budget method, else 1)."""
    budget: str | None = None
    """Which packing budget fitted: ``tight`` (k x activation + transients) or ``safe``."""
    longest_fitting_length: int | None = None
    """The longest one-row length that fits under the limit (a multiple of ``round_to``)."""
    oversize: str | None = None
    """The oversize policy the plan was packed under (error, truncate, drop, split)."""
    round_to: int | None = None
    """Every ``padded_len`` is a multiple of this."""
    pack_len: int | None = None
    """The row length of ``packed`` (None for the other methods)."""
    truncated: Sequence[int] | None = None
    """Sequences cut to ``longest_fitting_length`` (``oversize="truncate"``)."""
    dropped: Sequence[int] | None = None
    """Sequences left out (``oversize="drop"``); ``Plan.validate`` expects them absent."""
    recompute: str | None = None
    """The recomputation mode the plan was packed under (``always`` or ``auto``)."""
    recomputed: int | None = None
    """How many microbatches run with full recomputation."""
    recompute_choice: str | None = None
    """``recompute="auto"``: the candidate kept (``dynmb.packing.recompute``)."""
    offload_blocks: Sequence[int] | None = None
    """``offload="auto"``: per stage (model chunk), how many of its leading blocks keep their saved activations in
    host memory between each microbatch's forward and backward (absent or all 0: none offloaded)."""
    # --- lockstep (dynmb.packing.lockstep) --------------------------------------------------------
    microbatches: int | None = None
    """lockstep: microbatches per replica and group."""
    groups: int | None = None
    """lockstep: groups of microbatches run together."""
    step_pred_s: float | None = None
    """lockstep: the layout's predicted step."""
    replica_spread_s: float | None = None
    """lockstep: the worst spread (s) of a slot's replicas' busiest-stage time."""
    replica_spread: float | None = None
    """lockstep: ``replica_spread_s`` relative to the slot's slowest."""
    microbatch_spread_s: float | None = None
    """lockstep: the worst spread (s) of a group's slot maxima."""
    microbatch_spread: float | None = None
    """lockstep: ``microbatch_spread_s`` relative to the group's slowest."""
    order: str | None = None
    """lockstep: the slot order of the layout kept."""
    # --- slices of sequences (dynmb.planning.slicing, slice_fitting) ------------------------------
    sliced: Mapping[Any, int] | None = None
    """``{seq_id: number of slices}`` of the sliced sequences (JSON keys are strings)."""
    slice_len: int | None = None
    """The slice length of the sliced sequences."""
    slice_placement: str | None = None
    """How the slices were placed among the microbatches."""
    slice_recompute: bool | None = None
    """Whether the slices' microbatches recompute."""
    slice_fill: bool | None = None
    """Whether short sequences fill the rows of slices."""
    slice_threshold: int | None = None
    """``slice_fitting="auto"``: the length above which fitting sequences were sliced (None: none)."""
    slice_fitting: Mapping[str, float | None] | None = None
    """``slice_fitting="auto"``: each option's predicted step (``"none"``: no fitting slices)."""
    # --- planning (dynmb.planning) ----------------------------------------------------------------
    reorder: str | None = None
    """The microbatch order applied (``none``, ``ends``, ``search``, ...)."""
    virtual: int | None = None
    """Model chunks per GPU the plan was scheduled for."""
    models: Mapping[str, Any] | None = None
    """The cost and memory models' digests, calibration and refit version (``costmodel.loader``)."""
    candidate: str | None = None
    """The candidate that planned the step (``dynamic``: the packer's own; ``balanced/d`` ...)."""
    pred_margin_s: float | None = None
    """The robust candidate's predicted step minus the own plan's (``planning.choice``)."""
    error_bound_s: float | None = None
    """The margin the own plan needed to be kept (``planning.choice``)."""
    robust_candidate: str | None = None
    """The best tuned baseline of the robust choice."""
    grouping: str | None = None
    """The baseline grouping a ``dynamic`` plan took (absent: the packer's own)."""
    schedule_auto: Mapping[str, float | None] | None = None
    """``--schedule auto``: each kind's predicted step (None: the kind could not plan the step)."""
    replica: int | None = None
    """A replica's sub-plan (``Plan.replica``): its index."""
    dp: int | None = None
    """A replica's sub-plan: the data-parallel degree of the plan it came from."""
    # --- run context (dynmb plan, the sampler) ----------------------------------------------------
    dataset: str | None = None
    """The trace or lengths file the batch was drawn from."""
    seed: int | None = None
    """The sampling seed."""
    step: int | None = None
    """The step (global batch index) of the trace sampled."""
    model: Any = None
    """The model configuration (``ModelConfig.to_dict``; a preset name in older files)."""
    cost_model: Any = None
    """The cost-model file's identity (``dynmb plan``)."""
    memory_model: Any = None
    """The memory-model file's identity (``dynmb plan``)."""
    model_factory: str | None = None
    """The ``package.module:factory`` of a model of the user's own."""
    epoch: int | None = None
    """``DynamicBatchSampler``: the epoch."""
    global_batch_index: int | None = None
    """``DynamicBatchSampler``: the global batch's index in the epoch."""
    # --- bookkeeping ------------------------------------------------------------------------------
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Keys dynmb does not know, kept as given (module doc)."""
    given: frozenset[str] = frozenset()
    """The fields that were set (the JSON lists these); empty at construction: every field not None."""

    def __post_init__(self) -> None:
        if not self.given:
            object.__setattr__(self, "given", frozenset(n for n in FIELD_NAMES if getattr(self, n) is not None))
        elif not self.given <= _FIELD_SET:
            raise ValueError(f"PlanMeta.given names unknown fields {sorted(self.given - _FIELD_SET)}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "PlanMeta":
        """The record of a plan JSON's ``"meta"`` object (or any mapping; a ``PlanMeta`` is returned as is)."""
        if isinstance(d, PlanMeta):
            return d
        d = dict(d or {})
        known = {k: v for k, v in d.items() if k in _FIELD_SET}
        return cls(**known, extra={k: v for k, v in d.items() if k not in _FIELD_SET}, given=frozenset(known))

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: every key given, in field order, then ``extra``'s."""
        return {**{n: getattr(self, n) for n in FIELD_NAMES if n in self.given}, **self.extra}

    def with_(self, **changes: Any) -> "PlanMeta":
        """A copy with ``changes`` set (known keys as fields, the rest into ``extra``)."""
        return self.merged(changes)

    def merged(self, changes: Mapping[str, Any] | None) -> "PlanMeta":
        """``with_`` for a mapping of changes (a ``PlanMeta``'s given keys, a dict); None: ``self``."""
        if not changes:
            return self
        items = dict(changes.items())
        known = {k: v for k, v in items.items() if k in _FIELD_SET}
        unknown = {k: v for k, v in items.items() if k not in _FIELD_SET}
        return replace(self, **known, extra={**self.extra, **unknown} if unknown else self.extra,
                       given=self.given | frozenset(known))

    def without(self, *keys: str) -> "PlanMeta":
        """A copy with ``keys`` unset (absent from the JSON)."""
        drop = set(keys)
        return replace(self, **{k: None for k in drop & _FIELD_SET},
                       extra={k: v for k, v in self.extra.items() if k not in drop}, given=self.given - drop)

    # --- the read-only mapping view (module doc) ---------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        if key in self.given:
            return getattr(self, key)
        return self.extra[key]

    def __iter__(self) -> Iterator[str]:
        yield from (n for n in FIELD_NAMES if n in self.given)
        yield from self.extra

    def __len__(self) -> int:
        return len(self.given) + len(self.extra)

    def __repr__(self) -> str:
        return f"PlanMeta({self.to_dict()!r})"


FIELD_NAMES = tuple(f.name for f in fields(PlanMeta) if f.name not in ("extra", "given"))
"""The keys ``PlanMeta`` has a field for, in JSON order."""
_FIELD_SET = frozenset(FIELD_NAMES)
