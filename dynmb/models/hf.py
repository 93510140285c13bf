"""Hugging Face transformers decoders as dynmb pipeline stages (the stage contract of ``docs/design.md``).

``HFStageFactory`` turns a transformers causal LM of the Llama layout (``LlamaForCausalLM`` and the
decoders that share it: Qwen2, Mistral; ``model.model.embed_tokens``, ``.layers``, ``.norm``,
``.rotary_emb`` and ``model.lm_head``) into dynmb stages that *share its modules*: no weight is
copied, so an optimizer over the stages trains the user's model, and a model loaded with
``from_pretrained`` keeps its weights.

Stage ``s`` of ``P`` holds the decoder layers ``config.stage_layers(P)[s]`` (the split dynmb's own
families use), the token embedding on the first stage and the final norm, the LM head and the loss on
the last. ``forward(x, inputs)`` keeps the contract:

- rotary positions come from ``inputs.position_ids``, which restart at 0 in every document of a packed
  row, so each document sees the positions it would see alone;
- one document per row (``inputs.attention == "causal"``): under ``sdpa`` the layers get no mask and
  transformers' SDPA path runs ``is_causal=True``; pads sit on the right, after every real token, and
  the loss ignores them, so the result is exact (``eager`` has no causal path: it gets the mask below);
- packed rows (``document``) and the dense ablation: a ``(rows, 1, s, s)`` document-causal mask
  (``dynmb.models.inputs.attention_mask``; additive ``-inf`` form for the ``eager`` implementation). A mask
  skips no work: transformers' attention pays ``rows * padded_len**2`` for a packed row, so the
  factory reports ``attention_work = "masked"`` and the cost model is fitted on that feature, not
  dynmb's document-causal ``sum s_i**2``;
- the last stage returns the summed cross-entropy over real tokens (labels are the next token of the
  same document, ``IGNORE_INDEX`` at pads), which equals transformers' own per-document loss times
  the document's predicted tokens;
- ``--recompute``: each decoder layer and the head under dynmb's full recomputation
  (``dynmb.models.recompute``: only a layer's input is kept for backward), gradients exact.

Not supported (refused with a one-line error): slices of long sequences (no prefix store in
transformers' attention), the LM head split by vocabulary (``head_split``), leading blocks recomputed per stage
(``recompute_blocks``), a
stage boundary inside a block (half-blocks or pieces of one, ``layer_split`` such as ``2.5`` or ``2.75``), and
tied input/output embeddings across more than one stage (the two copies would need their gradients summed between the first and last rank).
A stage is built alone: ``from_config`` / ``from_pretrained`` build the model on the meta device (no memory)
and ``build_stage(s, P)`` materialises only the stage's modules, each initialised by the model's own
``_init_weights`` with torch's generator seeded by ``(seed, global module name)`` or read from the whole
model's state dict / safetensors (``dynmb.models.weights``), so ranks that build separately hold exactly the
whole model's parameters. A stage's module tree is the model's cut to it (``model.embed_tokens``,
``model.layers.<global index>``, ``model.norm``, ``lm_head``): its ``named_parameters()`` and ``state_dict()``
are transformers' own names, what torch.distributed.checkpoint saves.

The reverse direction: ``llama_to_hf(weights, cfg)`` builds a transformers ``LlamaForCausalLM`` holding
the weights of a dynmb Llama (through ``llama_state_dict_to_hf``: the state dict in transformers' names, loaded with ``strict=True``;
``dynmb.models.llama`` names: ``embed.weight``, ``blocks.i.attn.qkv.weight``
split by rows into ``q_proj``/``k_proj``/``v_proj``, ``blocks.i.attn.proj`` -> ``o_proj``,
``blocks.i.mlp.gate_up`` split into ``gate_proj``/``up_proj``, ``blocks.i.mlp.down`` -> ``down_proj``,
``attn_norm``/``mlp_norm`` -> ``input_layernorm``/``post_attention_layernorm``, ``norm_f`` -> ``norm``,
``lm_head`` (or the shards ``lm_head_<first row>`` of a head split by vocabulary, joined; the pieces of a
split inside a half-block joined too, ``dynmb.models.pieces.full_weights``), tied when
``cfg.tie_embeddings``); ``weights`` is ``{global name: tensor}`` or the stages
themselves. ``hf_llama_config(cfg)`` is the matching ``LlamaConfig`` (RMSNorm eps 1e-5, no biases).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from dynmb.core.config import ModelConfig, split_layers
from dynmb.models.inputs import IGNORE_INDEX, InputError, MicrobatchInputs, attention_mask

from dynmb.models.pieces import full_weights
from dynmb.models.recompute import RecomputedBlock, RecomputedHead
from dynmb.models.seeding import param_seed
from dynmb.models.weights import load_stage_weights

__all__ = ["HFDecoderStage", "HFStageFactory", "model_config_from_hf", "hf_llama_config", "llama_to_hf",
           "llama_state_dict_to_hf"]

log = logging.getLogger(__name__)


def _parts(causal_lm: nn.Module) -> tuple[Any, nn.Module]:
    """The decoder (a transformers ``LlamaModel``-like module, untyped: transformers is optional) and the head."""
    base = getattr(causal_lm, "model", None)
    missing = [n for n in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(base, n)]
    if base is None or missing or not hasattr(causal_lm, "lm_head"):
        raise TypeError(f"{type(causal_lm).__name__} does not have the Llama decoder layout "
                        f"(model.embed_tokens/layers/norm/rotary_emb + lm_head); missing {missing or ['lm_head']}")
    return base, cast(nn.Module, causal_lm.lm_head)


class HFDecoderStage(nn.Module):
    """Stage ``stage`` of ``num_stages`` of a transformers causal LM; its modules are the model's own.

    Its module tree is the model's, cut to the stage (``model.embed_tokens``, ``model.layers`` keyed by the
    global layer index, ``model.norm``, ``lm_head``), so ``named_parameters()`` and ``state_dict()`` give
    transformers' own names: ``model.layers.3.self_attn.q_proj.weight``, ``lm_head.weight``.
    """

    def __init__(self, causal_lm: nn.Module, stage: int, num_stages: int, layers: range) -> None:
        super().__init__()
        base, head = _parts(causal_lm)
        self.stage, self.num_stages, self.layer_range = stage, num_stages, layers
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self._impl = getattr(causal_lm.config, "_attn_implementation", "sdpa") or "sdpa"
        if self._impl not in ("sdpa", "eager"):
            raise ValueError(f"attention implementation {self._impl!r} is not supported for transformers stages "
                             "(use attn_implementation='sdpa' or 'eager')")
        self.model = nn.Module()
        self.model.rotary_emb = base.rotary_emb          # non-persistent buffers only
        if self.is_first:
            self.model.embed_tokens = base.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): base.layers[i] for i in layers})
        if self.is_last:
            self.model.norm, self.lm_head = base.norm, head

    def _mask(self, inputs: MicrobatchInputs, dtype: torch.dtype) -> torch.Tensor | None:
        if inputs.attention == "causal" and self._impl == "sdpa":
            return None                                  # SDPA's is_causal path; eager has none, it needs the mask
        mask = inputs.attn_mask if inputs.attn_mask is not None else attention_mask(inputs.doc_ids)
        if self._impl == "eager":
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
        return mask

    def forward(self, x: torch.Tensor | None, inputs: MicrobatchInputs, *, reduction: str = "sum",
                recompute: bool = False) -> torch.Tensor:
        """The stage's layers (and, last, the head's loss); ``recompute``: each layer and the head under
        full recomputation (``dynmb.models.recompute``: only their inputs are kept for backward)."""
        if inputs.has_slices:
            raise InputError("slices of long sequences are not supported for transformers stages "
                             "(use --oversize error/truncate/drop)")
        if reduction not in ("sum", "none"):
            raise ValueError(f"reduction must be 'sum' or 'none', got {reduction!r}")
        model: Any = self.model                          # the cut trunk (transformers is untyped here)
        if self.is_first:
            x = model.embed_tokens(inputs.input_ids)
        elif x is None:
            raise ValueError(f"stage {self.stage} needs the hidden state from stage {self.stage - 1}")
        rotary = model.rotary_emb(x, inputs.position_ids)
        mask = self._mask(inputs, x.dtype)
        for layer in model.layers.values():
            call = _LayerCall(layer, mask, rotary)
            x = cast(torch.Tensor, RecomputedBlock.apply(x, call, inputs)) if recompute else call(x, inputs)
        if not self.is_last:
            return x
        if recompute:
            return cast(torch.Tensor, RecomputedHead.apply(x, self, inputs, reduction))
        return self.head(x, inputs, reduction)

    def head(self, x: torch.Tensor, inputs: MicrobatchInputs, reduction: str = "sum") -> torch.Tensor:
        """Final norm, LM head and cross-entropy (fp32 logits at least), summed or per token."""
        model: Any = self.model
        logits = self.lm_head(model.norm(x))
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        ce = F.cross_entropy(logits.flatten(0, 1), inputs.labels.flatten(), ignore_index=IGNORE_INDEX,
                             reduction="sum" if reduction == "sum" else "none")
        return ce if reduction == "sum" else ce.view(inputs.labels.shape)


class _LayerCall:
    """One transformers decoder layer called as a dynmb block: ``call(x, inputs)`` (what
    ``RecomputedBlock`` runs again in backward), with the stage's mask and rotary tables."""

    def __init__(self, layer: nn.Module, mask: torch.Tensor | None, rotary: Any) -> None:
        self.layer, self.mask, self.rotary = layer, mask, rotary

    def __call__(self, x: torch.Tensor, inputs: MicrobatchInputs) -> torch.Tensor:
        out = self.layer(x, attention_mask=self.mask, position_ids=inputs.position_ids,
                         position_embeddings=self.rotary)
        return out[0] if isinstance(out, tuple) else out


def model_config_from_hf(hf_config: Any, name: str = "hf") -> ModelConfig:
    """The dynmb ``ModelConfig`` of a transformers Llama-layout config (sizes for the memory and cost models)."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    values = dict(name=name, vocab_size=hf_config.vocab_size, d_model=hf_config.hidden_size,
                  n_layers=hf_config.num_hidden_layers, n_heads=hf_config.num_attention_heads,
                  d_ff=hf_config.intermediate_size,
                  max_seq_len=getattr(hf_config, "max_position_embeddings", 2048),
                  family="llama", n_kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
                  rope_theta=float(getattr(hf_config, "rope_theta", None)
                                   or (getattr(hf_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
                  tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)))
    return ModelConfig(**{k: v for k, v in values.items() if k in fields})


class HFStageFactory:
    """A ``StageFactory`` over one transformers causal LM (built from a config, or the user's own model).

    ``build_stage(s, P)`` returns stage ``s`` of ``P`` sharing the model's modules; ``config`` is the
    dynmb ``ModelConfig`` of its sizes; ``attention_work`` is ``"masked"`` (see the module docstring).
    Modules still on the meta device (``from_config``, ``from_pretrained``, or a model of the user's own built
    under ``torch.device("meta")``) are materialised when a stage holding them is built, and only those
    (``materialise``): filled from ``weights`` (a whole model's state dict or safetensors, reading only the
    stage's tensors, ``dynmb.models.weights``), else initialised by the model's own ``_init_weights`` with
    torch's generator seeded per module by ``(seed, global module name)`` (``dynmb.models.seeding``), so a
    stage holds exactly what the whole model built with the same seed holds.
    """

    attention_work = "masked"

    def __init__(self, causal_lm: nn.Module, name: str = "hf", *, seed: int = 0, weights: Any = None) -> None:
        base, _ = _parts(causal_lm)
        self.model = causal_lm
        self.config = model_config_from_hf(causal_lm.config, name)
        self.num_layers = len(base.layers)
        self.seed, self.weights = seed, weights

    @classmethod
    def from_config(cls, hf_config: Any, *, seed: int = 0, dtype: torch.dtype | None = None, name: str = "hf",
                    weights: Any = None) -> "HFStageFactory":
        """``AutoModelForCausalLM.from_config(hf_config)`` on the meta device (no memory): every stage built
        materialises its own modules in ``dtype``, seeded by ``seed`` or read from ``weights`` (class docstring)."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
        return cls(model.to(dtype) if dtype is not None else model, name, seed=seed, weights=weights)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype | None = None, name: str | None = None
                        ) -> "HFStageFactory":
        """A transformers checkpoint folder (``config.json`` and safetensors): every stage reads only its tensors."""
        from transformers import AutoConfig

        return cls.from_config(AutoConfig.from_pretrained(str(path)), dtype=dtype, name=name or Path(path).name,
                               weights=Path(path))

    def stage_layers(self, num_stages: int) -> list[range]:
        return split_layers(self.num_layers, num_stages)

    def whole_model(self) -> nn.Module:
        """The whole causal LM, every module materialised (a single-process reference)."""
        self.materialise(HFDecoderStage(self.model, 0, 1, range(self.num_layers)))
        return self.model

    def materialise(self, stage: nn.Module) -> None:
        """Give ``stage``'s modules still on the meta device storage on the CPU and fill them (class docstring)."""
        fresh = [(n, m) for n, m in stage.named_modules()
                 if any(t.is_meta for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))]
        if not fresh:
            return
        init_weights = getattr(self.model, "_init_weights")
        with torch.random.fork_rng(devices=[]):
            for name, module in fresh:
                module.to_empty(device="cpu", recurse=False)
                if self.weights is None or any(True for _ in module.buffers(recurse=False)):
                    torch.manual_seed(param_seed(self.seed, name))
                    init_weights(module)
        if self.weights is not None:            # a tied head is the embedding (files often omit it): tied below
            names = {f"{n}.{k}" if n else k for n, m in fresh for k in m.state_dict(keep_vars=True) if "." not in k}
            load_stage_weights(stage, self.weights, names=names - ({"lm_head.weight"} if self.config_tied else set()))
        if self.config_tied:
            cast(Any, self.model).tie_weights()

    def build_stage(self, stage: int, num_stages: int, *, seed: int = 0, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> HFDecoderStage:
        """Stage ``stage`` of ``num_stages``. ``seed`` is unused (the factory's ``seed`` initialises modules still
        on the meta device); ``dtype`` and ``device`` move the shared modules (the whole model's, for one process
        holding every stage); ``device="meta"`` leaves modules not yet materialised on the meta device."""
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage {stage} out of range for {num_stages} stages")
        if self.config.half_split and num_stages > 1:
            raise ValueError(f"the layer split {list(self.config.layer_split or ())} puts a stage boundary inside a "
                             f"block (half-blocks, K/V heads or MLP columns), which runs on dynmb's own model families "
                             f"only; a transformers model splits whole layers")
        if self.config.head_split is not None:
            raise ValueError(f"the LM head split by vocabulary (head_split {list(self.config.head_split)}) runs on "
                             f"dynmb's own model families only; a transformers model keeps its head on the last stage")
        if self.config.recompute_blocks is not None:
            raise ValueError(f"model {self.config.name!r}: recomputing leading blocks per stage (recompute_blocks "
                             f"{list(self.config.recompute_blocks)}) runs on dynmb's own model families only; a "
                             f"transformers model recomputes whole microbatches or none")
        if num_stages > 1 and self.config_tied:
            raise ValueError("tied input/output embeddings across pipeline stages are not supported; "
                             "set tie_word_embeddings=False in the transformers config")
        built = HFDecoderStage(self.model, stage, num_stages, self.stage_layers(num_stages)[stage])
        if device is not None and torch.device(device).type == "meta":
            return built                          # left on the meta device: ``materialise(stage)`` later
        self.materialise(built)
        return built.to(device=device, dtype=dtype) if (device is not None or dtype is not None) else built

    @property
    def config_tied(self) -> bool:
        return bool(getattr(self.model.config, "tie_word_embeddings", False))


def hf_llama_config(cfg: ModelConfig) -> Any:
    """The transformers ``LlamaConfig`` of a dynmb Llama ``cfg`` (same sizes, RMSNorm eps 1e-5, no biases)."""
    from transformers import LlamaConfig

    if cfg.family != "llama":
        raise ValueError(f"model {cfg.name!r} is of the {cfg.family} family; llama_to_hf takes the llama family")
    # transformers 5 takes rope_theta as a legacy keyword (it lands in rope_parameters); its stubs do not list it
    return LlamaConfig(vocab_size=cfg.vocab_size,  # type: ignore[call-arg]
                       hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                       num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                       num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
                       rms_norm_eps=1e-5, max_position_embeddings=cfg.max_seq_len,
                       tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False)


def llama_state_dict_to_hf(weights: Any, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """transformers ``LlamaForCausalLM``'s state dict (its names, ``load_state_dict(strict=True)`` takes it) from
    a dynmb Llama's ``{global name: tensor}`` or its stages (every layer present once; module docstring)."""
    if not isinstance(weights, dict):
        weights = {n: t for stage in weights for n, t in stage.state_dict().items()}
    p = {n: t.detach() for n, t in weights.items()}
    if cfg.layer_split is not None:                # pieces of half-blocks, shards of the head: joined
        try:
            p = full_weights(p, cfg, len(cfg.layer_split))
        except (KeyError, ValueError):
            pass                                   # reported as missing below
    expected = {"embed.weight", "norm_f.weight"} | ({"lm_head.weight"} if not cfg.tie_embeddings else set())
    missing = sorted(n for n in expected if n not in p) + sorted(
        f"blocks.{i}" for i in range(cfg.n_layers) if f"blocks.{i}.attn.qkv.weight" not in p)
    if missing:
        raise ValueError(f"llama_to_hf: weights of model {cfg.name!r} lack {', '.join(missing[:5])}")
    h, kv, f = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.d_ff
    out = {"model.embed_tokens.weight": p["embed.weight"], "model.norm.weight": p["norm_f.weight"],
           "lm_head.weight": p["embed.weight" if cfg.tie_embeddings else "lm_head.weight"]}
    for i in range(cfg.n_layers):
        b, hf = f"blocks.{i}.", f"model.layers.{i}."
        qkv, gate_up = p[b + "attn.qkv.weight"], p[b + "mlp.gate_up.weight"]
        out.update({hf + "self_attn.q_proj.weight": qkv[:h], hf + "self_attn.k_proj.weight": qkv[h:h + kv],
                    hf + "self_attn.v_proj.weight": qkv[h + kv:], hf + "self_attn.o_proj.weight": p[b + "attn.proj.weight"],
                    hf + "mlp.gate_proj.weight": gate_up[:f], hf + "mlp.up_proj.weight": gate_up[f:],
                    hf + "mlp.down_proj.weight": p[b + "mlp.down.weight"],
                    hf + "input_layernorm.weight": p[b + "attn_norm.weight"],
                    hf + "post_attention_layernorm.weight": p[b + "mlp_norm.weight"]})
    return out


def llama_to_hf(weights: Any, cfg: ModelConfig) -> nn.Module:
    """A transformers ``LlamaForCausalLM`` (the weights' dtype) holding the dynmb Llama's weights
    (``llama_state_dict_to_hf``, loaded with ``strict=True``): ``weights`` is ``{global name: tensor}`` or an
    iterable of its stages (every layer present once)."""
    from transformers import LlamaForCausalLM

    state = llama_state_dict_to_hf(weights, cfg)
    model: Any = LlamaForCausalLM(hf_llama_config(cfg))
    model = model.to(state["model.embed_tokens.weight"].dtype)
    model.load_state_dict(state, strict=True)
    return model
