"""The GPT-2 family: learned positions, LayerNorm, a GELU MLP, one K/V head per query head, biases.

Model: token embedding + learned position embedding (first stage), then pre-LN blocks
``x + attn(LN(x))``, ``x + mlp(LN(x))`` with causal self-attention on the microbatch's path
(``dynmb.models.attention``) and a tanh-GELU MLP, then a final LayerNorm, an untied LM head and
the loss (last stage; or the head split by vocabulary over the last stages,
``ModelConfig.head_split``, ``dynmb.models.head``). ``GPT`` is the whole model as one stage; ``GPTStage(cfg, s, P)`` holds the
blocks ``cfg.stage_blocks(P)[s]`` (whole, or a half or a piece of one at a boundary inside a block,
``dynmb.models.pieces``). GPT-2 init, each parameter seeded by ``(seed, global name)`` (a piece's weights:
their slice of the whole weight).

Positions come from ``inputs.position_ids`` (restarting at 0 in each document, continuing
across the slices of a sliced document), looked up in a table of ``max_seq_len`` rows: a
document (or the end of a slice) past ``max_seq_len`` is refused (size the table from the
trace, ``--model small:max_seq_len=N``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dynmb.core.config import ModelConfig
from dynmb.models.inputs import InputError, MicrobatchInputs

from dynmb.models.attention import RoutedAttention
from dynmb.models.head import seed_head_rows_
from dynmb.models.pieces import WHOLE, PiecedBlock, chunk_width, store_key
from dynmb.models.stage import DecoderStage

__all__ = ["GPT", "GPTStage", "Block", "Attention", "MLP"]


class Attention(RoutedAttention):
    """Multi-head self-attention with a fused, biased qkv projection; ``chunks``: the piece of its heads a
    stage holds (``dynmb.models.pieces``; the output bias sits with chunk 0)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0, chunks: range = WHOLE) -> None:
        heads = chunk_width(cfg.n_heads, chunks)
        super().__init__(heads, heads, cfg.head_dim, store_key(layer, chunks))
        self.qkv = nn.Linear(cfg.d_model, 3 * heads * cfg.head_dim)
        self.proj = nn.Linear(heads * cfg.head_dim, cfg.d_model, bias=chunks.start == 0)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv(x).view(*x.shape[:-1], 3, self.n_heads, self.head_dim).unbind(-3)
        return q, k, v

    def output(self, y: torch.Tensor) -> torch.Tensor:
        return self.proj(y)


class MLP(nn.Module):
    """``proj(gelu(fc(x)))``; ``chunks``: the piece of its inner columns a stage holds (output bias: chunk 0's)."""

    def __init__(self, cfg: ModelConfig, chunks: range = WHOLE) -> None:
        super().__init__()
        f = chunk_width(cfg.d_ff, chunks)
        self.fc = nn.Linear(cfg.d_model, f)
        self.proj = nn.Linear(f, cfg.d_model, bias=chunks.start == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(PiecedBlock):
    """Pre-LN transformer block. ``pieces``: both halves, or one half or piece of one at a stage boundary
    inside the block (``dynmb.models.pieces``: the LayerNorm sits with chunk 0; a piece reads and sends
    ``[y | h]``)."""

    NORMS = {"attn": "ln1", "mlp": "ln2"}

    def make_norm(self, d: int) -> nn.Module:
        return nn.LayerNorm(d)

    def make_sublayer(self, cfg: ModelConfig, layer: int, part: str, chunks: range) -> nn.Module:
        return Attention(cfg, layer, chunks) if part == "attn" else MLP(cfg, chunks)


class GPTStage(DecoderStage):
    """Stage ``stage`` of ``num_stages`` of the GPT-2 family (``dynmb.models.stage.DecoderStage``):
    ``embed``/``pos`` on the first stage, ``norm_f`` on the head stage and the head's rows (``lm_head``,
    or a shard ``lm_head_<first row>``; ``DecoderStage.build_head``)."""

    def _build(self) -> None:
        cfg = self.cfg
        if self.is_first:
            self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i, pieces) for i, pieces in self.units})
        self.build_head(nn.LayerNorm(cfg.d_model))

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """GPT-2 init, each parameter from its own generator seeded by ``(seed, global name)``:
        N(0, 0.02) weights, residual output projections scaled by 1/sqrt(2 n_layers),
        zero biases, unit LayerNorm gains; the LM head's rows in blocks of rows
        (``dynmb.models.head.seed_head_rows_``, equal for every head split)."""
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if ".ln" in name or name.startswith("norm_f"):
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            elif name.startswith("lm_head"):
                seed_head_rows_(p, seed, self.vocab, self.cfg.vocab_size, 0.02)
            else:
                self.seed_weight_(p, seed, name, resid_std if name.endswith("proj.weight") else 0.02)

    def embed_inputs(self, inputs: MicrobatchInputs) -> torch.Tensor:
        if inputs.max_doc_len > self.cfg.max_seq_len:
            raise InputError(f"a document of {inputs.max_doc_len} tokens exceeds max_seq_len {self.cfg.max_seq_len}")
        return self.embed(inputs.input_ids) + self.pos(inputs.position_ids)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.whole_head()(self.norm_f(x))


class GPT(GPTStage):
    """The whole model as a single stage; ``GPT(cfg, seed)(inputs)`` returns the summed CE."""

    def __init__(self, cfg: ModelConfig, seed: int = 0, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__(cfg, 0, 1, seed=seed, dtype=dtype, device=device)

    def forward(self, inputs: MicrobatchInputs, *, reduction: str = "sum") -> torch.Tensor:  # type: ignore[override]
        return super().forward(None, inputs, reduction=reduction)
