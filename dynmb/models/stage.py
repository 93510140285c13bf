"""``DecoderStage``: what every dynmb family's pipeline stage shares.

Stage ``stage`` of ``num_stages`` holds the blocks ``cfg.stage_blocks(num_stages)[stage]``
(a ``ModuleDict`` keyed by the global layer index, so parameter names are global:
"blocks.3.attn.qkv.weight"), plus the embedding on the first stage, the final norm on the head
stage (``cfg.head_stage(P)``: the last by default) and the LM head's rows ``cfg.stage_vocab(P)[stage]``
on the stages holding them (all on the last by default; split by vocabulary over the last stages with
``ModelConfig.head_split``, ``dynmb.models.head``: ``lm_head`` whole, ``lm_head_<first row>`` a shard). A split between half-blocks (``ModelConfig.layer_split`` such as ``(2.5,
1.5)``) gives a stage that starts mid-block a first block holding only the MLP half
(``blocks.3.mlp_norm``/``blocks.3.mlp``) and one that ends mid-block a last block holding only
the attention half (``blocks.3.attn_norm``/``blocks.3.attn``): the two residual sub-blocks are
functions of the hidden state alone, so only the hidden state crosses the boundary. A boundary
inside a half-block (the 1/16-layer grid, ``ModelConfig.stage_pieces``) gives the stages pieces of it
(``dynmb.models.pieces``: K/V head groups of attention, inner columns of the MLP, e.g.
``blocks.3.mlp_c4``), and the message across it is ``[y | h]`` (``2 d`` channels: the residual stream
with the chunks so far added, and the half's normalised input). ``layers`` are the prefix-store keys of
the attention halves or pieces (and so keys and values, ``dynmb.models.prefix``) the stage holds. ``forward(x, inputs, *, reduction, recompute)`` keeps the stage contract
(``dynmb.models.contract``): ``x`` is ignored on the first stage (``embed_inputs`` turns
``inputs.input_ids`` into the hidden state), otherwise the hidden state
``(batch, padded_len, d_model)`` (after a head shard the message ``[z | statistics]``, inside a
half-block ``[y | h]``, of
``cfg.message_channels(stage - 1, P)`` channels); non-last stages return the hidden state (a
non-last head shard its message), the last the summed
cross-entropy over real tokens (0-dim, float32 or wider), or per-token CE ``(batch,
padded_len)`` with zeros at pads when ``reduction="none"``. Each block is called
``block(x, inputs, *self.block_args(inputs))`` (a family passes per-microbatch tables, such as
the Llama family's rotary cos/sin, computed once per stage forward). With grad enabled the stage's first
``recomputed_blocks`` blocks (``ModelConfig.recompute_blocks``, per stage: AdaPipe-style recomputation of only
some blocks; every block when the microbatch is flagged ``recompute``) run under ``RecomputedBlock``: each keeps
only its input for the backward, which recomputes it and back-propagates through it at once (its weight
gradients included, so a split backward's ``W`` has only the other blocks' Linear calls to do).

A family subclasses it and defines ``_build`` (the modules; ``build_head`` adds the final norm and the
head's rows), ``embed_inputs``, ``logits`` (the whole head) and ``reset_parameters`` (each parameter
seeded by ``(seed, global name)``, ``dynmb.models.seeding``; the head's rows by ``seed_head_rows_``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from dynmb.core.config import ModelConfig
from dynmb.models.inputs import IGNORE_INDEX, MicrobatchInputs, torch_dtype
from dynmb.core.model_sizes import HalfPiece

from dynmb.models.head import head_name, shard_loss
from dynmb.models.pieces import piece_cutter, seed_weight_, store_key, whole_name
from dynmb.models.recompute import RecomputedBlock, RecomputedHead
from dynmb.models.weights import WeightRef

__all__ = ["DecoderStage"]


class DecoderStage(nn.Module):
    """One pipeline stage of a pre-norm decoder (module docstring)."""

    blocks: nn.ModuleDict          # set by the family's ``_build``
    block_scope: Callable[[int], AbstractContextManager[Any]] | None = None
    """Set by the runtime around one forward (``dynmb.runtime.offload``): a context entered around the call of
    block ``i`` (its position in ``blocks``), a recomputed block's ``RecomputedBlock.apply`` included, so the
    saved-tensor hooks it installs see what that block saves for backward; None: no context."""

    def __init__(self, cfg: ModelConfig, stage: int = 0, num_stages: int = 1, *, seed: int = 0,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage {stage} out of range for {num_stages} stages")
        self.cfg, self.stage, self.num_stages = cfg, stage, num_stages
        self.pieces: list[HalfPiece] = cfg.stage_pieces(num_stages)[stage]
        """The half-blocks (whole, or chunks of one: ``dynmb.models.pieces``) of this stage, in order."""
        blocks: dict[int, tuple[HalfPiece, ...]] = {}
        for piece in self.pieces:
            blocks[piece.layer] = blocks.get(piece.layer, ()) + (piece,)
        self.units: list[tuple[int, tuple[HalfPiece, ...]]] = list(blocks.items())
        """``(layer, pieces)`` of each block, in order (both halves, or one half or piece at a boundary)."""
        self.layers: list[int | float] = [store_key(pc.layer, pc.chunks) for pc in self.pieces if pc.part == "attn"]
        """The prefix-store keys (``dynmb.models.prefix``) of the attention halves or pieces it holds: the layer
        index, plus ``c0 / 8`` for a piece from chunk ``c0 > 0`` (``dynmb.models.pieces.store_key``)."""
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.in_channels = cfg.message_channels(stage - 1, num_stages) if stage else cfg.d_model
        """Channels of the message it receives (``[y | h]``: ``2 d`` when the stage starts inside a half)."""
        self.vocab: range = cfg.stage_vocab(num_stages)[stage]
        """The LM head's vocabulary rows this stage holds (empty: none)."""
        self.is_head_stage = stage == cfg.head_stage(num_stages)
        """Whether this stage runs the final norm (the first stage holding head rows)."""
        self.is_shard = len(self.vocab) not in (0, cfg.vocab_size)
        """Whether this stage holds a shard of a head split by vocabulary (``dynmb.models.head``)."""
        self.recomputed_blocks = _recomputed_blocks(cfg, stage, num_stages)
        """How many of its leading blocks recompute in every microbatch's backward (``ModelConfig.recompute_blocks``:
        each entry of ``units`` counts one); a microbatch's ``recompute`` recomputes them all."""
        with torch.device("meta"):
            self._build()
        self.to(dtype=dtype or torch_dtype(cfg))
        if torch.device(device if device is not None else "cpu").type != "meta":
            self.materialise(device, seed)

    def materialise(self, device: torch.device | str | None = None, seed: int = 0,
                    weights: Any = None) -> "DecoderStage":
        """Give the meta-device stage storage on ``device`` (default CPU) in its dtype and fill it: the whole
        model's initial values of ``seed`` (``reset_parameters``), or the stage's tensors of ``weights``, a
        whole model's state dict or safetensors file (``dynmb.models.weights.load_stage_weights``)."""
        from dynmb.models.weights import load_stage_weights

        self.to_empty(device=device if device is not None else "cpu")
        if weights is None:
            self.reset_parameters(seed)
        else:
            load_stage_weights(self, weights)
        return self

    # --- family hooks -------------------------------------------------------------
    def _build(self) -> None:
        """Create ``embed`` (first stage), ``blocks``, ``norm_f`` and the head (``build_head``)."""
        raise NotImplementedError

    def build_head(self, norm: nn.Module, tied: bool = False) -> None:
        """``norm_f`` (``norm``) on the head stage and a bias-free Linear of this stage's vocabulary rows
        (``head_name``: ``lm_head`` or ``lm_head_<first row>``), none when ``tied`` (the embedding is the head)."""
        if self.is_head_stage:
            self.norm_f = norm
        if len(self.vocab) and not tied:
            self.add_module(head_name(self.vocab, self.cfg.vocab_size),
                            nn.Linear(self.cfg.d_model, len(self.vocab), bias=False))

    def whole_head(self) -> nn.Module:
        """The Linear of the whole head (``logits``: a stage holding every row)."""
        head = self.head_linear()
        if head is None or self.is_shard:
            raise ValueError(f"stage {self.stage} does not hold the whole LM head")
        return head

    def head_linear(self) -> nn.Module | None:
        """The Linear holding this stage's vocabulary rows (None: no rows, or a tied head)."""
        return getattr(self, head_name(self.vocab, self.cfg.vocab_size), None) if len(self.vocab) else None

    def reset_parameters(self, seed: int = 0) -> None:
        raise NotImplementedError

    def chunks_of(self, layer: int, part: str) -> range:
        """The chunks of layer ``layer``'s half ``part`` this stage holds."""
        return next(pc.chunks for pc in self.pieces if (pc.layer, pc.part) == (layer, part))

    def seed_weight_(self, p: torch.Tensor, seed: int, name: str, std: float) -> None:
        """N(0, std) of generator ``(seed, whole name)``, a piece's as its slice (``dynmb.models.pieces``)."""
        seed_weight_(p, seed, name, std, self.cfg, self.chunks_of)

    def weight_ref(self, name: str) -> WeightRef:
        """Where parameter ``name`` lives in the whole model (``dynmb.models.weights``): a head shard's rows of
        ``lm_head.weight``, a piece's cut of its whole weight, else the same name."""
        if name.startswith("lm_head_"):
            return WeightRef("lm_head.weight", rows=self.vocab)
        return WeightRef(whole_name(name), cut=piece_cutter(name, self.cfg, self.chunks_of))

    def embed_inputs(self, inputs: MicrobatchInputs) -> torch.Tensor:
        """First stage: token ids -> hidden state ``(batch, padded_len, d_model)``."""
        raise NotImplementedError

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Last stage: final norm and LM head."""
        raise NotImplementedError

    def block_args(self, inputs: MicrobatchInputs) -> tuple[Any, ...]:
        """Extra arguments of every block call for this microbatch (none by default)."""
        return ()

    # --- the contract ---------------------------------------------------------------
    def forward(self, x: torch.Tensor | None, inputs: MicrobatchInputs, *, reduction: str = "sum",
                recompute: bool = False) -> torch.Tensor:
        """``recompute``: full activation recomputation per block (``RecomputedBlock``) and of the
        head or head shard (``RecomputedHead``; on the last stage for ``reduction="sum"``); without it the
        stage's ``recomputed_blocks`` leading blocks recompute (the head does not). Only with grad enabled."""
        if self.is_first:
            x = self.embed_inputs(inputs)
        elif x is None:
            raise ValueError(f"stage {self.stage} needs the hidden state from stage {self.stage - 1}")
        elif x.shape[-1] != self.in_channels:
            raise ValueError(f"stage {self.stage} of {self.num_stages} receives messages of {self.in_channels} channels "
                             f"(config.message_channels; [y | h] inside a half-block), got {x.shape[-1]}")
        recomputing = recompute and torch.is_grad_enabled()
        leading = (len(self.blocks) if recompute else self.recomputed_blocks) if torch.is_grad_enabled() else 0
        extra = self.block_args(inputs) if self.layers else ()     # tables for the attention halves
        scope = self.block_scope
        for i, blk in enumerate(self.blocks.values()):
            with scope(i) if scope is not None else nullcontext():
                x = RecomputedBlock.apply(x, blk, inputs, *extra) if i < leading else blk(x, inputs, *extra)
        if not len(self.vocab):
            return x
        if recomputing and (reduction == "sum" or not self.is_last):
            return RecomputedHead.apply(x, self, inputs, reduction)
        return self.head(x, inputs, reduction)

    def head(self, x: torch.Tensor, inputs: MicrobatchInputs, reduction: str = "sum") -> torch.Tensor:
        """Final norm, LM head and cross-entropy over real tokens (``reduction``: sum or none); a head
        shard: its message, or on the last stage the cross-entropy (``dynmb.models.head.shard_loss``)."""
        if self.is_shard:
            return shard_loss(self, x, inputs, reduction)
        logits = self.logits(x)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if reduction not in ("sum", "none"):
            raise ValueError(f"reduction must be 'sum' or 'none', got {reduction!r}")
        ce = F.cross_entropy(logits.flatten(0, 1), inputs.labels.flatten(), ignore_index=IGNORE_INDEX,
                             reduction=reduction)
        return ce if reduction == "sum" else ce.view(inputs.labels.shape)


def _recomputed_blocks(cfg: ModelConfig, stage: int, num_stages: int) -> int:
    """Stage ``stage``'s entry of ``cfg.recompute_blocks`` (0 where None); none for the whole model in one stage
    of a config split over several (its layout, as ``layer_split``'s, is of the split)."""
    if cfg.recompute_blocks is None or (num_stages == 1 and len(cfg.recompute_blocks) != 1):
        return 0
    return cfg.stage_recompute_blocks(num_stages)[stage]
