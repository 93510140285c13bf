"""Configuration: ``ModelConfig``, ``PipelineConfig``, ``RunConfig`` (and ``PlanSpec``, re-exported
from ``dynmb.core.planspec``: ``RunConfig.plan_spec`` is the settings a run plans every step with).

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

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from dynmb.core.planspec import PlanSpec

from dynmb.core.model_sizes import UNITS_PER_LAYER, ModelSizes, normalise_head_split, normalise_layer_split, split_layers
from dynmb.core.units import format_bytes, parse_bytes

__all__ = ["MODEL_FAMILIES", "ModelConfig", "PipelineConfig", "RunConfig", "PlanSpec", "parse_bytes", "format_bytes", "MODEL_PRESETS", "split_layers",
           "model_config"]

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
        """This config with ``other``'s split over the stages (``layer_split`` and ``head_split``)."""
        return replace(self, layer_split=other.layer_split, head_split=other.head_split)

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


@dataclass(kw_only=True, frozen=True)
class PipelineConfig:
    """How the model is pipelined."""

    num_stages: int = 2
    """Pipeline stages (model chunks); with ``virtual`` > 1, ranks = num_stages / virtual."""
    virtual: int = 1
    """Model chunks per rank (interleaved 1F1B); 1 otherwise."""
    schedule: str = "1f1b"
    """Schedule kind: gpipe, 1f1b, interleaved, memory-aware, zb-h1, zb (zero bubble)."""
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
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"unknown optimizer {self.optimizer!r}; expected adam or sgd")

    @property
    def num_ranks(self) -> int:
        return self.num_stages // self.virtual


@dataclass(kw_only=True, frozen=True)
class RunConfig:
    """One experiment: data, packing, model, pipeline and how many steps to run."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig.preset("small"))
    """The model."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """The pipeline."""
    dataset: str = "sharegpt"
    """Shipped trace name or a path to a length-trace CSV."""
    global_batch: int = 64
    """Sequences per global batch (per optimizer step, over all data-parallel replicas)."""
    method: str = "dynamic"
    """Packing method: fixed, sorted, packed, token-budget, dynapipe, dynamic."""
    mbs: int | None = None
    """Microbatch size for fixed-size methods; None picks the largest that fits."""
    dp: int = 1
    """Data-parallel pipelines."""
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
    pack_len: int | None = None
    """Row length of the ``packed`` method (None: the longest row that fits under the limit)."""
    round_to: int = 1
    """Every microbatch's padded_len (and packed row length) is a multiple of this."""
    oversize: str = "error"
    """A sequence that cannot fit alone: error, truncate or drop (truncated/dropped are counted)."""
    recompute: str = "never"
    """Per-microbatch full activation recomputation: never, always, or auto (the packer recomputes
    the microbatches for which it pays; ``dynmb.packing.recompute``)."""
    slice_fitting: str = "never"
    """Slices of sequences that fit: never, or auto (where predicted faster; ``dynmb.planning.slice_fitting``)."""
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
        if self.global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {self.global_batch}")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"steps must be >= 1 and warmup >= 0, got {self.steps}, {self.warmup}")
        if self.dp < 1:
            raise ValueError(f"dp must be >= 1, got {self.dp}")
        if self.shard and self.dp < 2:
            raise ValueError(f"--shard needs --dp 2 or more (replicas to shard over), got dp {self.dp}")
        if not 0 <= self.plan_ahead <= 64:
            raise ValueError(f"plan_ahead must be 0-64 steps, got {self.plan_ahead}")
        if self.mbs is not None and self.mbs < 1:
            raise ValueError(f"mbs must be >= 1, got {self.mbs}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"unknown backend {self.backend!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"unknown device {self.device!r}")
        if self.round_to < 1:
            raise ValueError(f"round_to must be >= 1, got {self.round_to}")
        if self.pack_len is not None and self.pack_len < 1:
            raise ValueError(f"pack_len must be >= 1, got {self.pack_len}")
        PlanSpec(oversize=self.oversize, recompute=self.recompute, slice_fitting=self.slice_fitting)   # their checks
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.checkpoint_every < 0 or (self.checkpoint_every and not self.checkpoint):
            raise ValueError(f"checkpoint_every {self.checkpoint_every} needs a checkpoint folder and must be >= 0")

    @property
    def plan_spec(self) -> PlanSpec:
        """The settings every step of this run is planned with (``dynmb.planning.plan_step``)."""
        p = self.pipeline
        return PlanSpec(method=self.method, num_stages=p.num_stages, virtual=p.virtual, schedule_kind=p.schedule,
                        reorder=p.reorder, memory_limit_bytes=p.memory_limit_bytes, dp=self.dp, mbs=self.mbs,
                        pack_len=self.pack_len, round_to=self.round_to, oversize=self.oversize,
                        recompute=self.recompute, attention=self.model.attention, slice_fitting=self.slice_fitting)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunConfig":
        d = dict(d)
        d["model"] = ModelConfig.from_dict(d.get("model", {}))
        d["pipeline"] = PipelineConfig(**d.get("pipeline", {}))
        return cls(**d)

    def flat(self) -> dict[str, Any]:
        """Flattened ``{'model.d_model': 256, ...}`` for the ``runs`` table; tuples (the layer and head splits)
        as their text ``"(4, 0)"``, as the CSV keeps them (a column of tuples does not always convert to parquet)."""
        out: dict[str, Any] = {}
        for k, v in self.to_dict().items():
            if isinstance(v, dict):
                out.update({f"{k}.{kk}": vv for kk, vv in v.items()})
            else:
                out[k] = v
        return {k: str(tuple(v)) if isinstance(v, (list, tuple)) else v for k, v in out.items()}


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
