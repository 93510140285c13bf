"""``PlanSpec``: the settings of one planning step, built once and passed whole.

Every planning entry point takes it: ``dynmb.planning.plan_step``, ``dynmb.packing.pack``,
``dynmb.planning.slicing.plan_split``, and the packers' ``PackContext`` is built from it once.
The settings are declared here only: ``RunConfig`` holds one (``RunConfig.spec``; ``plan_spec`` adds the
model's attention), ``CompareSettings`` a ``RunConfig`` template. Who builds one: the command line in one
function (``dynmb.cli.flags.spec_from_flags``: plan, run, compare), ``Planner`` (its keywords, in one place,
or ``Planner.from_spec``), and a run's ``RunConfig`` (the rank plans every step with ``plan_spec``).
A plan records the spec it was planned with (``Plan.spec``; its JSON carries it under
``"spec"``), so later work can take the settings from the plan.

The checks here are those that need no registry (numbers, the fixed option sets); the method,
schedule kind and reorder names are checked by their registries where they are used
(``dynmb.packing.METHODS``, ``dynmb.schedule.kinds``, ``dynmb.planning.REORDER_METHODS``).
"""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping

__all__ = ["PlanSpec", "ATTENTION_KINDS", "EMBEDDING_PLACES", "EMBEDDING_SETTINGS", "embedding_setting", "OVERSIZE_POLICIES", "OFFLOAD_MODES", "RECOMPUTE_MODES", "SLICE_FITTING"]

ATTENTION_KINDS = ("auto", "dense")
"""``ModelConfig.attention`` values: causal/document-causal without a mask tensor, or the dense mask."""
OVERSIZE_POLICIES = ("error", "truncate", "drop", "split")
"""What happens to a sequence that cannot fit alone."""
RECOMPUTE_MODES = ("never", "always", "auto")
"""Per-microbatch activation recomputation."""
SLICE_FITTING = ("never", "auto")
"""Whether sequences that fit may be sliced too (``dynmb.planning.slice_fitting``)."""
EMBEDDING_PLACES = ("first", "last")
"""Which pipeline rank holds the token embedding (``dynmb.schedule.embedlast``)."""
EMBEDDING_SETTINGS = (*EMBEDDING_PLACES, "auto")
"""What ``Planner(embedding=...)`` and ``--embedding`` take: a place, or ``auto`` (chosen once per run by simulated
step, ``dynmb.planning.embedding_choice``); a plan's spec holds the place."""


def embedding_setting(embedding: str | None, stage_split: Any) -> str:
    """The embedding setting in effect (the one place its default is resolved): ``embedding`` as given, else (None)
    ``auto`` where the stage split is ``"auto"`` (the layout is searched), else ``first`` (plans as before)."""
    if embedding is None:
        return "auto" if str(stage_split).strip() == "auto" else "first"
    if embedding not in EMBEDDING_SETTINGS:
        raise ValueError(f"embedding must be first, last or auto, got {embedding!r}")
    return str(embedding)
OFFLOAD_MODES = ("never", "auto")
"""Activation offload to host memory between a microbatch's forward and backward (``PlanMeta.offload_blocks``)."""


@dataclass(frozen=True, kw_only=True)
class PlanSpec:
    """The settings of one planning step (module doc)."""

    method: str = "dynamic"
    """Packing method: fixed, sorted, packed, token-budget, dynapipe, dynamic."""
    num_stages: int = 2
    """Pipeline stages (model chunks); with ``virtual`` > 1 a GPU holds ``virtual`` of them."""
    virtual: int = 1
    """Model chunks per rank (kinds with virtual stages: interleaved)."""
    schedule_kind: str = "1f1b"
    """Schedule kind (``dynmb.schedule.kinds``): gpipe, 1f1b, interleaved, memory-aware, zb-h1, zb."""
    reorder: str = "none"
    """Microbatch reordering before the schedule is built (``auto``: each method's own order)."""
    memory_limit_bytes: int = 2 * 2**30
    """The per-GPU memory limit every stage must stay under."""
    dp: int = 1
    """Data-parallel pipeline replicas (each gets the same number of microbatches, except with
    slices of long sequences: a chain runs whole on one replica)."""
    mbs: int | None = None
    """Rows per microbatch of fixed-size methods (fixed, sorted, packed); None: the largest that fits."""
    pack_len: int | None = None
    """Row length of ``packed`` (None: the longest row that fits under the limit); checked by the
    packer against what fits (``dynmb.packing.packed.packed_row_len``), naming both."""
    round_to: int = 1
    """Every microbatch's padded_len (and packed row length) is a multiple of this."""
    oversize: str = "error"
    """A sequence that cannot fit alone: error, truncate, drop or split (slices of it)."""
    recompute: str = "never"
    """Per-microbatch full activation recomputation: never, always or auto."""
    attention: str | None = None
    """The attention the costs count (auto or dense); None: the model's ``ModelConfig.attention``."""
    slice_fitting: str = "never"
    """Slices of sequences that fit: never (only ``oversize="split"`` slices, what does not fit), or auto (the
    planner also tries slicing every sequence longer than the longest row / 2 or / 4 and keeps the fastest
    predicted plan within the limit: ``dynmb.planning.slice_fitting``)."""
    embedding: str = "first"
    """Where the token embedding (lookup, weight, gradient, optimizer states) lives: ``first`` (with stage 0, as
    always: the default, plans and gradients unchanged) or ``last``: on the last pipeline rank, which embeds each
    microbatch, sends the hidden state to stage 0 and takes stage 0's input gradient back for the embedding's
    weight gradient (``dynmb.schedule.embedlast``); stage 0 then holds blocks only, so its states shrink by the
    table's. Not with a tied embedding nor the V placement (there the last stage is on rank 0 already)."""
    offload: str = "never"
    """Activation offload to host memory: ``never`` (the default: plans unchanged) or ``auto``: the planner may
    move the saved activations of each stage's leading blocks to host memory between a microbatch's forward and
    its backward, where the copies hide behind compute, so a stage admits more tokens in flight; the choice is
    recorded per stage as ``PlanMeta.offload_blocks``."""
    state_shards: int = 1
    """How many data-parallel ranks share each stage's model states (FSDP2 over the replicas, ``dynmb run --shard``:
    its ``--dp``); 1 (the default: plans unchanged): every rank holds them whole. The memory model counts what the
    sharded runtime holds (``MemoryModel.sharded``); a run may shard over more ranks than its plans count, never
    fewer."""

    def __post_init__(self) -> None:
        for name in ("method", "schedule_kind", "reorder"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"PlanSpec.{name} must be a non-empty name, got {getattr(self, name)!r}")
        if int(self.num_stages) != self.num_stages or self.num_stages < 1:
            raise ValueError(f"num_stages must be a whole number >= 1, got {self.num_stages!r}")
        if int(self.virtual) != self.virtual or self.virtual < 1 or self.num_stages % self.virtual:
            raise ValueError(f"num_stages ({self.num_stages}) must be a positive multiple of virtual ({self.virtual})")
        if self.memory_limit_bytes <= 0:
            raise ValueError(f"memory_limit_bytes must be positive, got {self.memory_limit_bytes}")
        if self.dp < 1 or (self.mbs is not None and self.mbs < 1):
            raise ValueError(f"dp and mbs must be >= 1, got dp={self.dp}, mbs={self.mbs}")
        if int(self.round_to) != self.round_to or self.round_to < 1:
            raise ValueError(f"round_to must be a whole number >= 1, got {self.round_to!r}")
        if self.oversize not in OVERSIZE_POLICIES:
            raise ValueError(f"oversize must be error, truncate, drop or split, got {self.oversize!r}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be never, always or auto, got {self.recompute!r}")
        if self.slice_fitting not in SLICE_FITTING:
            raise ValueError(f"slice_fitting must be never or auto, got {self.slice_fitting!r}")
        if self.embedding not in EMBEDDING_PLACES:
            raise ValueError(f"embedding must be first or last, got {self.embedding!r}")
        if self.embedding == "last" and self.num_stages // self.virtual < 2:
            raise ValueError("embedding='last' needs at least 2 pipeline ranks")
        if self.offload not in OFFLOAD_MODES:
            raise ValueError(f"offload must be never or auto, got {self.offload!r}")
        if not isinstance(self.state_shards, numbers.Integral) or isinstance(self.state_shards, bool) \
                or self.state_shards < 1:
            raise ValueError(f"state_shards must be a whole number >= 1, got {self.state_shards!r}")
        if self.attention is not None and self.attention not in ATTENTION_KINDS:
            raise ValueError(f"unknown attention {self.attention!r}; expected one of {', '.join(ATTENTION_KINDS)}")

    @property
    def num_ranks(self) -> int:
        """GPUs per pipeline replica."""
        return self.num_stages // self.virtual

    def with_(self, **changes: Any) -> "PlanSpec":
        """A copy with ``changes`` (checked again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict; ``embedding`` / ``offload`` / ``state_shards`` only where not the default (plans keep
        their JSON and digest)."""
        out = asdict(self)
        if out["state_shards"] == 1:
            del out["state_shards"]
        if out["embedding"] == "first":
            del out["embedding"]
        if out["offload"] == "never":
            del out["offload"]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PlanSpec":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"plan spec: unknown field(s) {unknown}; expected some of {sorted(known)}")
        return cls(**dict(data))
