"""The LM head of a stage: whole, or one shard of it split by vocabulary over the last stages.

``ModelConfig.head_split`` gives the head's vocabulary rows per stage on a suffix of the stages
(``cfg.stage_vocab(P)``); by default all rows sit on the last stage. A stage holding rows has one
bias-free ``nn.Linear(d_model, rows)``: ``lm_head`` when it holds every row, else
``lm_head_<first row>`` (``head_name``; global names stay unique across stages, e.g.
``lm_head_200.weight`` holds rows 200.. of the head). The first stage holding rows
(``cfg.head_stage(P)``) also runs the final norm.

Seeding (``seed_head_rows_``): the head's rows are drawn in fixed blocks of ``ROW_BLOCK`` rows, block
``b`` from the generator of ``(seed, "lm_head.weight/<b * ROW_BLOCK>")`` (``dynmb.models.seeding``), and
a stage copies the rows it holds out of the blocks they fall in, so a shard's rows equal those rows of
the whole head of the same seed for any split.

Shards (``shard_loss``), point-to-point only (no collective, so every schedule kind runs them as
they are): the head stage computes ``z = norm_f(h)``; every shard computes its logits ``z W_s^T`` in
fp32 (or wider), their log-sum-exp ``lse_s`` and the target's logit ``tgt_s`` (0 where the label is
outside its rows or ``IGNORE_INDEX``) per token, and combines them with the running statistics it
received: ``lse = logaddexp(lse_prev, lse_s)``, ``tgt = tgt_prev + tgt_s``. A non-last shard sends
``[z | statistics]`` on (``cfg.message_channels(stage, P)`` channels); the last returns the
cross-entropy ``lse - tgt`` at real tokens, summed (``reduction="sum"``) or per token (``"none"``,
zeros at pads). Autograd through it is exact: the backward message carries d/dz and d/d(statistics).
The ``HEAD_STATS`` statistics are fp32 (fp64 in a float64 model): in a model of 4- or 8-byte dtype
they are the message's last ``HEAD_STATS`` channels; in a 16-bit model each travels as a high part
``hi = x.to(dtype)`` and a low part ``lo = (x - hi.float()).to(dtype)`` (``encode_stats``; layout
``[z | hi | lo]``), recombined as ``hi.float() + lo.float()`` (``decode_stats``): two bfloat16 parts keep
16 significant bits (relative error <= 2^-16), two float16 parts 22; gradients flow through both parts.

Saved for backward per token by a shard stage (besides the message it sends, held until its
backward): the shard's fp32 logits (``4 * rows`` bytes: ``logsumexp`` saves its input), the gather
index (8 bytes) and a few fp32/bool per-token values (lse, the masks, the statistics), and ``z`` (the
Linear's input, ``d_model`` x dtype bytes; on the head stage also the norm's input and statistics).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from dynmb.core.config import ModelConfig
from dynmb.models.inputs import IGNORE_INDEX, MicrobatchInputs
from dynmb.core.model_sizes import HEAD_STATS

from dynmb.models.seeding import param_seed

__all__ = ["ROW_BLOCK", "head_name", "seed_head_rows_", "stat_parts", "encode_stats", "decode_stats", "shard_loss",
           "full_head_weight"]

ROW_BLOCK = 1024
"""Rows of the head drawn from one generator (``seed_head_rows_``)."""


def head_name(rows: range, vocab_size: int) -> str:
    """The module name of a stage's head rows: ``lm_head`` for every row, else ``lm_head_<first row>``."""
    return "lm_head" if (rows.start, rows.stop) == (0, vocab_size) else f"lm_head_{rows.start}"


@torch.no_grad()
def seed_head_rows_(weight: torch.Tensor, seed: int, rows: range, vocab_size: int, std: float) -> None:
    """Fill ``weight`` (``len(rows) x d_model``) with rows ``rows`` of the whole head of ``seed``: N(0, std)
    drawn in fp32, ``ROW_BLOCK`` rows per generator (module docstring)."""
    d = weight.shape[1]
    for lo in range(rows.start // ROW_BLOCK * ROW_BLOCK, rows.stop, ROW_BLOCK):
        hi = min(lo + ROW_BLOCK, vocab_size)
        g = torch.Generator().manual_seed(param_seed(seed, f"lm_head.weight/{lo}"))
        block = torch.randn((hi - lo, d), generator=g, dtype=torch.float32) * std
        a, b = max(rows.start, lo), min(rows.stop, hi)
        weight[a - rows.start:b - rows.start].copy_(block[a - lo:b - lo])


def stat_parts(cfg: ModelConfig) -> int:
    """Parts each fp32 statistic travels as: 1 in a model of 4- or 8-byte dtype, 2 (high, low) in a 16-bit one."""
    return 1 if cfg.dtype_bytes >= 4 else 2


def encode_stats(stats: torch.Tensor, dtype: torch.dtype, parts: int) -> torch.Tensor:
    """``(..., HEAD_STATS)`` statistics as ``(..., HEAD_STATS * parts)`` channels of ``dtype`` (``[hi | lo]``)."""
    if parts == 1:
        return stats.to(dtype)
    hi = stats.to(dtype)
    lo = (stats - hi.to(stats.dtype)).to(dtype)
    return torch.cat([hi, lo], dim=-1)


def decode_stats(channels: torch.Tensor, parts: int, work: torch.dtype) -> torch.Tensor:
    """The ``(..., HEAD_STATS)`` statistics in ``work`` dtype from their channels (``encode_stats``)."""
    if parts == 1:
        return channels.to(work)
    hi, lo = channels.split(HEAD_STATS, dim=-1)
    return hi.to(work) + lo.to(work)


def shard_loss(stage: Any, x: torch.Tensor, inputs: MicrobatchInputs, reduction: str) -> torch.Tensor:
    """A head shard's forward on ``stage`` (a ``DecoderStage`` holding rows ``stage.vocab``): the message
    ``[z | statistics]`` on a non-last shard, the cross-entropy on the last (module docstring)."""
    if reduction not in ("sum", "none"):
        raise ValueError(f"reduction must be 'sum' or 'none', got {reduction!r}")
    cfg: ModelConfig = stage.cfg
    d, rows, parts = cfg.d_model, stage.vocab, stat_parts(cfg)
    if stage.is_head_stage:
        z, prev = stage.norm_f(x), None
    else:
        z, prev = x[..., :d], x[..., d:]
    logits = stage.head_linear()(z)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lse = torch.logsumexp(logits, dim=-1)
    labels = inputs.labels
    local = labels - rows.start
    mine = (local >= 0) & (local < len(rows))
    tgt = logits.gather(-1, local.clamp(0, len(rows) - 1).unsqueeze(-1)).squeeze(-1)
    tgt = torch.where(mine, tgt, torch.zeros((), dtype=tgt.dtype, device=tgt.device))
    if prev is not None:
        before = decode_stats(prev, parts, logits.dtype)
        lse, tgt = torch.logaddexp(before[..., 0], lse), before[..., 1] + tgt
    if not stage.is_last:
        return torch.cat([z, encode_stats(torch.stack([lse, tgt], dim=-1), z.dtype, parts)], dim=-1)
    ce = torch.where(labels != IGNORE_INDEX, lse - tgt, torch.zeros((), dtype=lse.dtype, device=lse.device))
    return ce.sum() if reduction == "sum" else ce


def full_head_weight(weights: Mapping[str, torch.Tensor], cfg: ModelConfig, num_stages: int) -> torch.Tensor:
    """The whole head's weight from ``{global name: tensor}`` of ``num_stages`` stages (its shards in order)."""
    parts = [weights[f"{head_name(r, cfg.vocab_size)}.weight"] for r in cfg.stage_vocab(num_stages) if len(r)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
