"""``DecoderStage``: what every dynmb family's pipeline stage shares.

Stage ``stage`` of ``num_stages`` holds the blocks ``cfg.stage_blocks(num_stages)[stage]``
(a ``ModuleDict`` keyed by the global layer index, so parameter names are global:
"blocks.3.attn.qkv.weight"), plus the embedding on the first stage and the final norm and
LM head on the last. A split between half-blocks (``ModelConfig.layer_split`` such as ``(2.5,
1.5)``) gives a stage that starts mid-block a first block holding only the MLP half
(``blocks.3.mlp_norm``/``blocks.3.mlp``) and one that ends mid-block a last block holding only
the attention half (``blocks.3.attn_norm``/``blocks.3.attn``): the two residual sub-blocks are
functions of the hidden state alone, so only the hidden state crosses the boundary. ``layers``
are the layers whose attention half (and so keys and values, ``dynmb.prefix``) the stage holds. ``forward(x, inputs, *, reduction, recompute)`` keeps the stage contract
(``dynmb.models.contract``): ``x`` is ignored on the first stage (``embed_inputs`` turns
``inputs.input_ids`` into the hidden state), otherwise the hidden state
``(batch, padded_len, d_model)``; non-last stages return the hidden state, the last the summed
cross-entropy over real tokens (0-dim, float32 or wider), or per-token CE ``(batch,
padded_len)`` with zeros at pads when ``reduction="none"``. Each block is called
``block(x, inputs, *self.block_args(inputs))`` (a family passes per-microbatch tables, such as
the Llama family's rotary cos/sin, computed once per stage forward).

A family subclasses it and defines ``_build`` (the modules), ``embed_inputs``, ``logits`` and
``reset_parameters`` (each parameter seeded by ``(seed, global name)``, ``dynmb.models.seeding``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dynmb.config import ModelConfig
from dynmb.inputs import IGNORE_INDEX, MicrobatchInputs, torch_dtype

from .recompute import RecomputedBlock, RecomputedHead

__all__ = ["DecoderStage"]


class DecoderStage(nn.Module):
    """One pipeline stage of a pre-norm decoder (module docstring)."""

    blocks: nn.ModuleDict          # set by the family's ``_build``

    def __init__(self, cfg: ModelConfig, stage: int = 0, num_stages: int = 1, *, seed: int = 0,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage {stage} out of range for {num_stages} stages")
        self.cfg, self.stage, self.num_stages = cfg, stage, num_stages
        self.units: list[tuple[int, tuple[str, ...]]] = cfg.stage_blocks(num_stages)[stage]
        """``(layer, parts)`` of each block, in order (``parts``: ``("attn", "mlp")`` or one half)."""
        self.layers = [i for i, parts in self.units if "attn" in parts]
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self._build()
        self.reset_parameters(seed)
        self.to(device=device, dtype=dtype or torch_dtype(cfg))

    # --- family hooks -------------------------------------------------------------
    def _build(self) -> None:
        """Create ``embed`` (first stage), ``blocks``, ``norm_f`` and the head (last stage)."""
        raise NotImplementedError

    def reset_parameters(self, seed: int = 0) -> None:
        raise NotImplementedError

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
        last stage's head (``RecomputedHead``)."""
        if self.is_first:
            x = self.embed_inputs(inputs)
        elif x is None:
            raise ValueError(f"stage {self.stage} needs the hidden state from stage {self.stage - 1}")
        recomputing = recompute and torch.is_grad_enabled()
        extra = self.block_args(inputs) if self.layers else ()     # tables for the attention halves
        for blk in self.blocks.values():
            x = RecomputedBlock.apply(x, blk, inputs, *extra) if recomputing else blk(x, inputs, *extra)
        if not self.is_last:
            return x
        if recomputing and reduction == "sum":
            return RecomputedHead.apply(x, self, inputs)
        return self.head(x, inputs, reduction)

    def head(self, x: torch.Tensor, inputs: MicrobatchInputs, reduction: str = "sum") -> torch.Tensor:
        """Final norm, LM head and cross-entropy over real tokens (``reduction``: sum or none)."""
        logits = self.logits(x)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if reduction not in ("sum", "none"):
            raise ValueError(f"reduction must be 'sum' or 'none', got {reduction!r}")
        ce = F.cross_entropy(logits.flatten(0, 1), inputs.labels.flatten(), ignore_index=IGNORE_INDEX,
                             reduction=reduction)
        return ce if reduction == "sum" else ce.view(inputs.labels.shape)
