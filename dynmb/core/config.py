"""Configuration: ``ModelConfig``, ``PipelineConfig``, ``RunConfig`` (and ``PlanSpec``, re-exported
from ``dynmb.core.planspec``). The planning settings are declared once, in ``PlanSpec``: ``RunConfig`` holds
one (``RunConfig.spec``; ``plan_spec`` is it with the model's attention, what a run plans every step with);
``PipelineConfig`` is the older form of its pipeline part, still taken as ``RunConfig(pipeline=...)`` and
read as ``RunConfig.pipeline``; ``with_aliases`` is how a record keeps its older keywords.

kw_only dataclasses with a docstring per field and checks in ``__post_init__``.
Model presets (``ModelConfig.preset(name)``, ``model_config(spec)``), named for their
architecture: GPT-2 family ``tiny`` for tests, ``small`` the CPU default (a 2-stage step on a
few thousand tokens takes about a second on one core per stage), ``gpt2``/``gpt2-medium`` and
GPT-2 blocks at Llama widths (``gpt2-1b``, ``gpt2-7b``, ``gpt2-deep-13b``); Llama family
``llama-tiny``/``llama-small`` (CPU-sized) and the published ``llama2-7b``, ``llama3.2-1b``,
``llama3.1-8b`` (sizes from their Hugging Face config.json, cited at ``MODEL_PRESETS``).

The analytic helpers (layer split here; parameter counts, FLOPs and the bytes of the activation
sent between stages in ``dynmb.core.model_sizes``, a mixin of ``ModelConfig``) are pure arithmetic so
that the memory model, cost model and packers can use them without importing torch.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable, TypeVar

from dynmb.core.planspec import PlanSpec

from dynmb.core.model_sizes import UNITS_PER_LAYER, ModelSizes, normalise_head_split, normalise_layer_split, split_layers
from dynmb.core.units import format_bytes, parse_bytes

__all__ = ["MODEL_FAMILIES", "ModelConfig", "PipelineConfig", "RunConfig", "PlanSpec", "parse_bytes", "format_bytes", "MODEL_PRESETS", "split_layers",
           "model_config", "with_aliases", "PIPELINE_FIELDS", "RUN_SPEC_KEYWORDS"]

MODEL_FAMILIES = ("gpt2", "llama")
"""``ModelConfig.family``: the architectures dynmb builds (``dynmb.models.families``)."""


@dataclass(kw_only=True, frozen=True)
class ModelConfig(ModelSizes):
    """A pre-norm decoder of one of dynmb's families (``dynmb.models``): the sizes every analytic
    model uses and the stage builder reads.

    ``family="gpt2"``: learned positions (a ``max_seq_len`` table), LayerNorm, a two-matrix GELU
    MLP, one K/V head per query head, biases, untied LM head. ``family="llama"``: rotary
    positions (``rope_theta``; no table, so no document-length cap), RMSNorm, a SwiGLU MLP
    (gate, up, down: three ``d_model x d_ff`` matrices), grouped-query attention
    (``n_kv_heads``), no biases, optionally tied embeddings."""

    name: str = "custom"
    """Preset name, recorded in results and cost-model files."""
    family: str = "gpt2"
    """Architecture: ``gpt2`` or ``llama`` (see the class docstring)."""
    vocab_size: int = 8192
    """Vocabulary size (token ids are synthetic unless a corpus is given)."""
    d_model: int = 256
    """Hidden size."""
    n_layers: int = 4
    """Number of transformer blocks, split contiguously over the pipeline stages."""
    n_heads: int = 4
    """Attention (query) heads; ``d_model`` must divide by it."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention, llama only); None: ``n_heads``. Must divide ``n_heads``."""
    d_ff: int = 1024
    """MLP inner size (SwiGLU: the width of the gate and up projections)."""
    max_seq_len: int = 8192
    """Largest row length the packers build; for ``gpt2`` also the size of the learned position
    table (no document may be longer). Rotary positions (``llama``) have no such cap: longer
    documents are sliced (``--oversize split``)."""
    rope_theta: float = 10000.0
    """Rotary base (llama): frequencies ``rope_theta ** (-2i / head_dim)``."""
    tie_embeddings: bool = False
    """LM head shares the token embedding (llama; one stage only at run time, since tying across
    stages needs an embedding-gradient all-reduce the runtime does not run)."""
    dtype: str = "float32"
    """Parameter and activation dtype: float32, bfloat16, float16, or float64 (exact-gradient checks:
    ``--verify`` then compares to 1e-10 relative; ``dynmb.runtime.checks``)."""
    attention: str = "auto"
    """``auto``: causal attention with no mask tensor for one document per row and
    document-causal attention costing sum(s_i^2) for packed rows (as trainers run it);
    ``dense``: the (batch, 1, s, s) mask on every row, kept only as an ablation."""
    layer_split: tuple[int | float, ...] | None = None
    """Layers per pipeline stage (model chunk), in order, e.g. ``(9, 8, 8, 7)``, in half-blocks,
    ``(2.5, 2, 2, 1.5)`` (a boundary between a block's attention and MLP halves), or on the 1/16 grid
    inside a half (``(2.75, 1.25)``; ``dynmb.core.model_sizes``: ``stage_pieces``); None: the even split (``split_layers``). Set by ``--stage-split`` (``dynmb.planning.stage_split``);
    a fitted cost or memory model is valid only for the split it was measured on."""
    head_split: tuple[int, ...] | None = None
    """The LM head's vocabulary rows per pipeline stage (model chunk), e.g. ``(0, 0, 9000, 23000)``:
    the head split by vocabulary over the last stages, which hold no layers after the first of them
    (``layer_split`` ``(16, 16, 0, 0)``); each shard passes the running log-sum-exp and target logit
    on with the normalised hidden state (``dynmb.models.head``). None: the whole head on the last
    stage. Set by ``--stage-split auto`` (``dynmb.planning.head_split``) or a JSON model file."""
    recompute_blocks: tuple[int, ...] | None = None
    """Per pipeline stage (model chunk), how many of its leading blocks recompute their activations in every
    microbatch's backward (per-stage recomputation, as AdaPipe, arXiv:2401.03146, chooses it with the split), e.g.
    ``(1, 0, 0, 0)``: the blocks are the stage's ``stage_blocks`` entries (a half-block or pieces of one at a
    boundary count one); a recomputed block keeps only its input from forward to backward. Needs ``layer_split``
    (the same stages); None (or all 0): none. A microbatch flagged ``recompute`` recomputes every block anyway.
    Set by ``--stage-split auto`` (``dynmb.planning.memory_split``) or a JSON model file."""

    def __post_init__(self) -> None:
        if self.layer_split is not None:
            object.__setattr__(self, "layer_split", normalise_layer_split(self.layer_split, self.n_layers))
        object.__setattr__(self, "head_split", normalise_head_split(self.head_split, self.vocab_size,
                                                                    self.layer_split, self.tie_embeddings))
        for f in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            if getattr(self, f) < 1:
                raise ValueError(f"ModelConfig.{f} must be >= 1, got {getattr(self, f)}")
        if self.family not in MODEL_FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; expected one of {', '.join(MODEL_FAMILIES)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.n_kv_heads is not None and (self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads):
            raise ValueError(f"n_kv_heads {self.n_kv_heads} must be >= 1 and divide n_heads {self.n_heads}")
        if self.family == "gpt2" and (self.kv_heads != self.n_heads or self.tie_embeddings):
            raise ValueError("the gpt2 family has one K/V head per query head and an untied LM head "
                             "(n_kv_heads and tie_embeddings are llama fields)")
        self.check_chunk_bounds()
        object.__setattr__(self, "recompute_blocks", self._checked_recompute_blocks())
        if self.family == "llama" and self.head_dim % 2:
            raise ValueError(f"rotary positions need an even head_dim, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        if self.dtype not in ("float32", "bfloat16", "float16", "float64"):
            raise ValueError(f"unknown dtype {self.dtype!r}; expected float32, bfloat16, float16 or float64")
        if self.attention not in ("auto", "dense"):
            raise ValueError(f"unknown attention {self.attention!r}; expected auto or dense")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "ModelConfig":
        if name not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known: {', '.join(MODEL_PRESETS)}")
        return replace(MODEL_PRESETS[name], **overrides)

    def stage_layers(self, num_stages: int) -> list[range]:
        """The (whole) layers of each of ``num_stages`` stages: ``layer_split`` (one stage: all), else the even
        split. A split inside blocks has none (ValueError; dynmb's families read ``stage_pieces``)."""
        units = self.stage_units(num_stages)
        if num_stages > 1 and self.half_split:
            cut = " (and halves into K/V heads or MLP columns)" if self.chunk_split else ""
            raise ValueError(f"model {self.name!r}: the layer split {list(self.layer_split or ())} cuts blocks in half"
                             f"{cut}, which only dynmb's own model families (gpt2, llama) can run; use whole layers")
        return [range(r.start // UNITS_PER_LAYER, r.stop // UNITS_PER_LAYER) for r in units]

    def with_layout_of(self, other: "ModelConfig") -> "ModelConfig":
        """This config with ``other``'s split over the stages (``layer_split``, ``head_split`` and
        ``recompute_blocks``)."""
        return replace(self, layer_split=other.layer_split, head_split=other.head_split,
                       recompute_blocks=other.recompute_blocks)

    def stage_recompute_blocks(self, num_stages: int) -> list[int]:
        """``recompute_blocks`` for ``num_stages`` stages (all 0 where None)."""
        if self.recompute_blocks is None:
            return [0] * int(num_stages)
        if len(self.recompute_blocks) != num_stages:
            raise ValueError(f"model {self.name!r} recomputes blocks on {len(self.recompute_blocks)} stages "
                             f"{list(self.recompute_blocks)}, not {num_stages}")
        return list(self.recompute_blocks)

    def _checked_recompute_blocks(self) -> tuple[int, ...] | None:
        """``recompute_blocks`` checked against the split (ValueError naming it), None where it recomputes none."""
        given = self.recompute_blocks
        if given is None:
            return None
        blocks = tuple(int(k) for k in given)
        if any(float(k) != int(k) for k in given) or min(blocks, default=0) < 0:
            raise ValueError(f"ModelConfig.recompute_blocks {list(given)}: not whole numbers of blocks >= 0")
        if not any(blocks):
            return None
        if self.layer_split is None or len(self.layer_split) != len(blocks):
            raise ValueError(f"ModelConfig.recompute_blocks {list(blocks)} needs a layer_split of the same "
                             f"{len(blocks)} stages, got {None if self.layer_split is None else list(self.layer_split)}")
        held = [len(b) for b in self.stage_blocks(len(blocks))]
        if any(k > n for k, n in zip(blocks, held)):
            raise ValueError(f"ModelConfig.recompute_blocks {list(blocks)}: more than the stages' blocks {held}")
        return blocks

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def architecture(self) -> dict[str, Any]:
        """Every field but the name: what a fitted cost or memory model is valid for."""
        d = self.to_dict()
        d.pop("name", None)
        return d

    def check_made_for(self, num_stages: int, other: "ModelConfig", other_stages: int, *, what: str,
                       remedy: str, ignore: tuple[str, ...] = ()) -> None:
        """Raise ValueError unless ``other`` at ``other_stages`` is this architecture at ``num_stages``;
        ``what`` names the fitted object (e.g. "poly cost model"), ``remedy`` how to make a matching one;
        ``ignore``: fields the object does not depend on (a cost model: ``max_seq_len``, the size
        of the learned position table, changes no stage's time)."""
        mine = {k: v for k, v in self.architecture().items() if k not in ignore}
        theirs = {k: v for k, v in other.architecture().items() if k not in ignore}
        if mine != theirs or int(other_stages) != int(num_stages):
            raise ValueError(f"{what} was made for model {self.name!r} {self.architecture()} at {num_stages} "
                             f"stages, not for model {other.name!r} {other.architecture()} at {other_stages} "
                             f"stages; {remedy}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


MODEL_PRESETS: dict[str, ModelConfig] = {
    # GPT-2 family: ``tiny`` for tests, ``small`` the CPU default, GPT-2 sizes, and GPT-2 blocks
    # at Llama widths (``gpt2-1b``/``gpt2-7b``/``gpt2-deep-13b``: learned positions, LayerNorm, a
    # two-matrix GELU MLP and biases at the widths of Llama-1B/7B; not Llamas).
    "tiny": ModelConfig(name="tiny", vocab_size=512, d_model=64, n_layers=4, n_heads=4, d_ff=256, max_seq_len=4096),
    "small": ModelConfig(name="small", vocab_size=2048, d_model=256, n_layers=4, n_heads=4, d_ff=1024, max_seq_len=8192),
    "gpt2": ModelConfig(name="gpt2", vocab_size=50304, d_model=768, n_layers=12, n_heads=12, d_ff=3072, max_seq_len=8192, dtype="bfloat16"),
    "gpt2-medium": ModelConfig(name="gpt2-medium", vocab_size=50304, d_model=1024, n_layers=24, n_heads=16, d_ff=4096, max_seq_len=8192, dtype="bfloat16"),
    "gpt2-1b": ModelConfig(name="gpt2-1b", vocab_size=32000, d_model=2048, n_layers=16, n_heads=32, d_ff=5632, max_seq_len=8192, dtype="bfloat16"),
    "gpt2-7b": ModelConfig(name="gpt2-7b", vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, d_ff=11008, max_seq_len=8192, dtype="bfloat16"),
    "gpt2-deep-13b": ModelConfig(name="gpt2-deep-13b", vocab_size=32000, d_model=4096, n_layers=64, n_heads=32, d_ff=11008, max_seq_len=8192, dtype="bfloat16"),
    # Llama family, CPU-sized like tiny/small (SwiGLU width about 8/3 d_model, 2 K/V heads).
    "llama-tiny": ModelConfig(name="llama-tiny", family="llama", vocab_size=512, d_model=64, n_layers=4, n_heads=4,
                              n_kv_heads=2, d_ff=176, max_seq_len=4096),
    "llama-small": ModelConfig(name="llama-small", family="llama", vocab_size=2048, d_model=256, n_layers=4, n_heads=4,
                               n_kv_heads=2, d_ff=688, max_seq_len=8192),
    # Published configurations, from each model's config.json on the Hugging Face Hub
    # (hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
    # vocab_size, rope_theta, tie_word_embeddings, max_position_embeddings):
    # meta-llama/Llama-2-7b-hf: 4096, 11008, 32, 32, 32, 32000, 10000, false, 4096 (6.74B parameters);
    # meta-llama/Llama-3.2-1B: 2048, 8192, 16, 32, 8, 128256, 500000, true, 131072 (1.24B);
    # meta-llama/Llama-3.1-8B: 4096, 14336, 32, 32, 8, 128256, 500000, false, 131072 (8.03B).
    # Llama 3.x's rope_scaling (rope_type llama3) rescales long-wavelength frequencies; it changes no
    # size, FLOP or byte count and is not modelled here.
    "llama2-7b": ModelConfig(name="llama2-7b", family="llama", vocab_size=32000, d_model=4096, n_layers=32, n_heads=32,
                             n_kv_heads=32, d_ff=11008, max_seq_len=4096, rope_theta=10000.0, dtype="bfloat16"),
    "llama3.2-1b": ModelConfig(name="llama3.2-1b", family="llama", vocab_size=128256, d_model=2048, n_layers=16,
                               n_heads=32, n_kv_heads=8, d_ff=8192, max_seq_len=131072, rope_theta=500000.0,
                               tie_embeddings=True, dtype="bfloat16"),
    "llama3.1-8b": ModelConfig(name="llama3.1-8b", family="llama", vocab_size=128256, d_model=4096, n_layers=32,
                               n_heads=32, n_kv_heads=8, d_ff=14336, max_seq_len=131072, rope_theta=500000.0,
                               dtype="bfloat16"),
}


_T = TypeVar("_T")


def with_aliases(fold: Callable[[dict[str, Any]], dict[str, Any]]) -> Callable[[type[_T]], type[_T]]:
    """Class decorator (above ``@dataclass``): the generated ``__init__`` also takes the keywords ``fold``
    turns into fields (the older spellings of a record kept as constructor aliases). ``dataclasses.replace``
    and ``from_dict`` go through it too."""
    def wrap(cls: type[_T]) -> type[_T]:
        generated = cls.__init__

        @functools.wraps(generated)
        def __init__(self: Any, **settings: Any) -> None:
            generated(self, **fold(dict(settings)))

        setattr(cls, "__init__", __init__)   # noqa: B010 - replaces the generated one (mypy keeps its signature)
        return cls
    return wrap


def _fold_pipeline(settings: dict[str, Any]) -> dict[str, Any]:
    """``PipelineConfig(schedule=...)``: the older name of ``schedule_kind``. Given both, the older name wins:
    ``dataclasses.replace(p, schedule=...)`` passes every field and the change, so there the change is it."""
    if "schedule" in settings:
        settings["schedule_kind"] = settings.pop("schedule")
    return settings


@with_aliases(_fold_pipeline)
@dataclass(kw_only=True, frozen=True)
class PipelineConfig:
    """How the model is pipelined: the pipeline's part of a ``PlanSpec`` and the optimizer. ``RunConfig``
    holds no ``PipelineConfig`` (its ``spec`` holds these settings); one is still taken by
    ``RunConfig(pipeline=...)`` and returned by ``RunConfig.pipeline`` (the ``runs`` table's
    ``pipeline.*`` columns). ``schedule`` is the older name of ``schedule_kind`` (keyword and property)."""

    num_stages: int = 2
    """Pipeline stages (model chunks); with ``virtual`` > 1, ranks = num_stages / virtual."""
    virtual: int = 1
    """Model chunks per rank (interleaved 1F1B); 1 otherwise."""
    schedule_kind: str = "1f1b"
    """Schedule kind: gpipe, 1f1b, interleaved, memory-aware, zb-h1, zb (zero bubble), auto."""
    reorder: str = "none"
    """Microbatch reordering pass applied before building the schedule."""
    memory_limit_bytes: int = 2 * 2**30
    """The per-GPU (per-rank) memory limit every stage must stay under."""
    optimizer: str = "adam"
    """Optimizer whose states count in memory: adam (2 fp32 states) or sgd (none)."""

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.virtual < 1 or self.num_stages % self.virtual:
            raise ValueError(f"num_stages ({self.num_stages}) must be a positive multiple of virtual ({self.virtual})")
        if self.memory_limit_bytes <= 0:
            raise ValueError(f"memory_limit_bytes must be positive, got {self.memory_limit_bytes}")
        _check_optimizer(self.optimizer)

    @property
    def schedule(self) -> str:
        """The older name of ``schedule_kind``."""
        return self.schedule_kind

    @property
    def num_ranks(self) -> int:
        return self.num_stages // self.virtual


def _check_optimizer(name: str) -> None:
    if name not in ("adam", "sgd"):
        raise ValueError(f"unknown optimizer {name!r}; expected adam or sgd")


PIPELINE_FIELDS = ("num_stages", "virtual", "schedule_kind", "reorder", "memory_limit_bytes")
"""The ``PlanSpec`` fields a ``PipelineConfig`` carries."""
RUN_SPEC_KEYWORDS = ("method", "mbs", "dp", "pack_len", "round_to", "oversize", "recompute", "slice_fitting")
"""The ``PlanSpec`` fields ``RunConfig`` once held itself: still taken as keywords and read as properties."""


def _fold_run(settings: dict[str, Any]) -> dict[str, Any]:
    """``RunConfig``'s older keywords (``pipeline=PipelineConfig(...)``, ``method=``, ``mbs=``, ...) and any other
    ``PlanSpec`` field (``num_stages=``, ``schedule=`` / ``schedule_kind=``, ``reorder=``, ...) folded into its
    ``spec`` (and ``optimizer``); they override the ``spec`` given with them (``pipeline``'s fields last)."""
    if "schedule" in settings:
        settings["schedule_kind"] = settings.pop("schedule")
    changes = {k: settings.pop(k) for k in _SPEC_FIELDS if k in settings}
    pipeline = settings.pop("pipeline", None)
    if isinstance(pipeline, dict):                    # the older spec.json shape
        pipeline = PipelineConfig(**pipeline)
    if pipeline is not None:
        changes.update({k: getattr(pipeline, k) for k in PIPELINE_FIELDS})
        settings["optimizer"] = pipeline.optimizer
    if changes:
        settings["spec"] = replace(settings.get("spec") or PlanSpec(), **changes)
    return settings


@with_aliases(_fold_run)
@dataclass(kw_only=True, frozen=True)
class RunConfig:
    """One experiment: model, planning settings (one ``PlanSpec``), data, and how many steps to run.

    The planning settings live once, in ``spec``. A keyword convenience: the constructor (and ``with_``,
    ``dataclasses.replace``) also takes any ``PlanSpec`` field by name (``method=``, ``num_stages=``,
    ``schedule=``, ...) and, for the callers written before ``spec``, ``pipeline=PipelineConfig(...)``; they
    are folded into ``spec``. The fields ``RunConfig`` once held (``cfg.method``, ``cfg.mbs``, ``cfg.dp``, ...
    ``RUN_SPEC_KEYWORDS``, and ``cfg.pipeline``) are read-only properties over ``spec``; new code reads
    ``cfg.spec``."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig.preset("small"))
    """The model (its ``attention`` is the one the plans count: ``plan_spec``)."""
    spec: PlanSpec = field(default_factory=PlanSpec)
    """How every step is planned: method, pipeline (stages, virtual, schedule kind, reorder, memory limit),
    dp, mbs, pack_len, round_to, oversize, recompute, slice_fitting. Its ``attention`` stays None: the
    model's."""
    optimizer: str = "adam"
    """Optimizer whose states count in memory: adam (2 fp32 states) or sgd (none)."""
    dataset: str = "sharegpt"
    """Shipped trace name or a path to a length-trace CSV."""
    global_batch: int = 64
    """Sequences per global batch (per optimizer step, over all data-parallel replicas)."""
    shard: bool = False
    """FSDP2 over the data-parallel replicas (``--shard``; ``dynmb.runtime.fsdp``): each rank keeps
    1/dp of its stages' weights, gradients and optimizer states between steps; gradients are summed."""
    seed: int = 0
    """Seed for sampling global batches and model init."""
    steps: int = 3
    """Measured optimizer steps."""
    warmup: int = 1
    """Unmeasured warm-up steps before them."""
    lr: float = 1e-3
    """Learning rate."""
    backend: str = "gloo"
    """torch.distributed backend: gloo or nccl."""
    device: str = "cpu"
    """cpu or cuda."""
    cost_model: str | None = None
    """Path to a fitted cost model JSON; None uses the analytic stand-in."""
    timeout_s: float = 120.0
    """Process-group and P2P timeout: a stuck run fails instead of hanging."""
    expandable_segments: bool = True
    """CUDA: run with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (less fragmentation
    when microbatch shapes vary), unless the variable is already set."""
    prewarm: bool = False
    """Run one forward+backward of every distinct microbatch shape of the planned steps before
    the first step (CUDA kernels and allocator pools are set up per shape)."""
    plan_ahead: int = 0
    """Planner processes per rank planning that many steps ahead of the step being trained
    (``dynmb.runtime.planahead``); 0 plans each step in line, on the critical path."""
    checkpoint: str | None = None
    """Folder of torch.distributed.checkpoint checkpoints, one ``step-<k>`` folder each
    (``dynmb.runtime.checkpoint``): saved after the last step and every ``checkpoint_every`` steps."""
    checkpoint_every: int = 0
    """Optimizer steps between checkpoints (0: after the last step only)."""
    resume: str | None = None
    """A checkpoint (or a folder of them: its latest) to start from, loaded at this run's layout; the run
    goes on from the checkpoint's step to ``warmup + steps``."""

    def __post_init__(self) -> None:
        if self.spec.attention is not None:
            if self.spec.attention != self.model.attention:
                raise ValueError(f"spec.attention {self.spec.attention!r} differs from the model's attention "
                                 f"{self.model.attention!r}; a run's attention is its model's (leave spec.attention None)")
            object.__setattr__(self, "spec", self.spec.with_(attention=None))     # declared once: the model's
        if self.global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {self.global_batch}")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"steps must be >= 1 and warmup >= 0, got {self.steps}, {self.warmup}")
        if self.shard and self.dp < 2:
            raise ValueError(f"--shard needs --dp 2 or more (replicas to shard over), got dp {self.dp}")
        if self.spec.state_shards > (self.dp if self.shard else 1):
            held = f"shards them over {self.dp}" if self.shard else "holds them whole"
            raise ValueError(f"state_shards {self.spec.state_shards}: the plans count model states sharded over "
                             f"{self.spec.state_shards} replicas, but this run {held}; run with --shard and --dp "
                             f"{self.spec.state_shards} or more")
        if not 0 <= self.plan_ahead <= 64:
            raise ValueError(f"plan_ahead must be 0-64 steps, got {self.plan_ahead}")
        _check_optimizer(self.optimizer)
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"unknown backend {self.backend!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"unknown device {self.device!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.checkpoint_every < 0 or (self.checkpoint_every and not self.checkpoint):
            raise ValueError(f"checkpoint_every {self.checkpoint_every} needs a checkpoint folder and must be >= 0")

    @property
    def plan_spec(self) -> PlanSpec:
        """The settings every step of this run is planned with (``dynmb.planning.plan_step``): ``spec`` with
        the model's attention."""
        return self.spec.with_(attention=self.model.attention)

    @property
    def pipeline(self) -> PipelineConfig:
        """The pipeline's settings (from ``spec``) and the optimizer, as the older ``PipelineConfig``."""
        return PipelineConfig(**{k: getattr(self.spec, k) for k in PIPELINE_FIELDS}, optimizer=self.optimizer)

    # the PlanSpec fields RunConfig once held itself, read from its spec
    method = property(lambda self: self.spec.method)
    mbs = property(lambda self: self.spec.mbs)
    dp = property(lambda self: self.spec.dp)
    pack_len = property(lambda self: self.spec.pack_len)
    round_to = property(lambda self: self.spec.round_to)
    oversize = property(lambda self: self.spec.oversize)
    recompute = property(lambda self: self.spec.recompute)
    slice_fitting = property(lambda self: self.spec.slice_fitting)

    def with_(self, **changes: Any) -> "RunConfig":
        """A copy with ``changes``: fields of the run, of its ``spec`` (``method=``, ``num_stages=``,
        ``schedule_kind=`` or its older name ``schedule=``, ...) or ``pipeline=`` (checked again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict, the spec's as ``PlanSpec.to_dict`` writes them."""
        return {**asdict(self), "spec": self.spec.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunConfig":
        """``to_dict``'s form, or the flat one of earlier versions (``pipeline`` and ``method``, ``mbs``, ...
        beside the model: their ``spec.json`` files)."""
        d = dict(d)
        d["model"] = ModelConfig.from_dict(d.get("model", {}))
        if isinstance(d.get("spec"), dict):
            d["spec"] = PlanSpec.from_dict(d["spec"])
        return cls(**d)

    def flat(self) -> dict[str, Any]:
        """Flattened ``{'model.d_model': 256, 'pipeline.num_stages': 2, 'method': 'dynamic', ...}`` for the ``runs``
        table: the columns of earlier versions (``pipeline.*`` and the spec's other fields by their own names);
        tuples (the layer and head splits) as their text ``"(4, 0)"``, as the CSV keeps them (a column of tuples
        does not always convert to parquet)."""
        pipeline = asdict(self.pipeline)
        pipeline["schedule"] = pipeline.pop("schedule_kind")     # the documented column pipeline.schedule
        out: dict[str, Any] = {f"model.{k}": v for k, v in self.model.to_dict().items()}
        out.update({f"pipeline.{k}": pipeline[k] for k in ("num_stages", "virtual", "schedule", "reorder",
                                                            "memory_limit_bytes", "optimizer")})
        for f in fields(self):
            if f.name not in ("model", "spec", "optimizer"):
                out[f.name] = getattr(self, f.name)
            out.update({k: getattr(self.spec, k) for k in _FLAT_AFTER.get(f.name, ())})
        return {k: str(tuple(v)) if isinstance(v, (list, tuple)) else v for k, v in out.items()}


_SPEC_FIELDS = frozenset(f.name for f in fields(PlanSpec))
_FLAT_AFTER = {"global_batch": ("method", "mbs", "dp"),
               "timeout_s": ("pack_len", "round_to", "oversize", "recompute", "slice_fitting")}
"""Where the ``runs`` table's spec columns stood among the run's own (their order of earlier versions)."""


def _field_value(name: str, text: str) -> Any:
    """``text`` as the type of ModelConfig field ``name`` (int, float, bool, or None for ``int | None``)."""
    kind = str({f.name: f.type for f in fields(ModelConfig)}[name])
    if kind.endswith("| None") and text.lower() in ("none", "null", ""):
        return None
    if kind.startswith("int"):
        return int(text)
    if kind.startswith("float"):
        return float(text)
    if kind.startswith("bool"):
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(text)
        return text.lower() in ("true", "1")
    return text


def model_config(spec: str, *, attention: str | None = None) -> ModelConfig:
    """The model named by ``spec``: a preset (``small``), a preset with overrides
    (``small:d_model=512,n_layers=8``) or a JSON file of ``ModelConfig`` fields
    (``path/to/model.json``; missing fields keep their defaults). ``attention``, when
    given, overrides the attention field. Errors name the spec and the bad field."""
    import json
    from pathlib import Path

    if spec.endswith(".json"):
        try:
            data = json.loads(Path(spec).read_text())
        except OSError as e:
            raise ValueError(f"cannot read model file {spec}: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"model file {spec} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"model file {spec} must hold a JSON object of ModelConfig fields")
        data = data.get("model", data)
        unknown = sorted(set(data) - {f.name for f in fields(ModelConfig)})
        if unknown:
            raise ValueError(f"model file {spec}: unknown ModelConfig field(s) {unknown}")
        try:
            cfg = ModelConfig(**{"name": Path(spec).stem, **data})
        except (TypeError, ValueError) as e:
            raise ValueError(f"model file {spec}: {e}") from None
    else:
        name, _, rest = spec.partition(":")
        overrides: dict[str, Any] = {}
        known = {f.name for f in fields(ModelConfig)}
        for item in filter(None, rest.split(",")):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or key not in known or key == "name":
                raise ValueError(f"--model {spec}: {item!r} is not field=value of a ModelConfig field "
                                 f"({', '.join(sorted(known - {'name'}))})")
            try:
                overrides[key] = _field_value(key, value.strip())
            except ValueError:
                kind = str({f.name: f.type for f in fields(ModelConfig)}[key]).split(" ")[0]
                raise ValueError(f"--model {spec}: {key} must be {kind}, got {value!r}") from None
        try:
            cfg = ModelConfig.preset(name, **overrides)
        except ValueError as e:
            raise ValueError(f"--model {spec}: {e}") from None
        if overrides:
            cfg = replace(cfg, name=spec)
    return cfg if attention is None else replace(cfg, attention=attention)
