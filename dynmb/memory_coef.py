"""The analytic memory coefficients per model family: bytes a stage keeps per token and per row * s^2.

Counted from what ``dynmb.models`` saves for backward (``torch.autograd`` saved tensors, each storage
once), per family (gpt2, llama), for the activations held from a microbatch's F to its B
(``block_act_coef``, per half-block ``half_act_coef``, ``stage_act_per_token``, ``head_act_per_token``),
the bytes held from a split backward's I to its W (``w_coef``) and what full recomputation saves and
re-creates (``recompute_saved_coef``, ``recompute_transient_coef``), counted per half-block (attention
half, MLP half: a stage may start or end between them, ``ModelConfig.stage_blocks``). ``dynmb.memory.MemoryModel.analytic``
assembles them per stage; the CPU meter checks them (tests/test_memory.py, tests/test_llama.py).
"""

from __future__ import annotations

import numpy as np

from .config import ModelConfig
from .model_sizes import HEAD_STATS

__all__ = ["BUCKET_PADDING", "block_act_coef", "half_act_coef", "stage_act_per_token", "head_act_per_token", "w_coef",
           "recompute_saved_coef", "recompute_transient_coef"]

BUCKET_PADDING = 1 / 16
"""Bound on the pad tokens of bucketed document attention (``dynmb.models.bucket_documents``),
as a fraction of the microbatch's real tokens; the ``auto`` memory model charges it."""


def block_act_coef(c: ModelConfig) -> np.ndarray:
    """``(a1, a2)`` of one block: bytes saved for backward per token and per row * s^2.

    gpt2. Outside attention: both LayerNorm inputs and the MLP's fc input (3d), the GELU input
    and the MLP-proj input (2f) at ``e`` bytes, and 2 x 2 fp32 LayerNorm statistics. The
    attention sublayer saves its input (d: qkv's input), the shared q/k/v storage (3d), the SDPA
    output (d: also proj's input) and the per-head fp32 logsumexp.

    llama (``k = n_kv_heads * head_dim``). Outside attention: each RMSNorm's input and its
    normalised input before the gain (``F.rms_norm``'s decomposition saves both: 4d), the SwiGLU
    input (d), the gate/up storage (2f, saved whole through the gate and up views), the SiLU
    output and the down projection's input (2f), and 2 fp32 RMSNorm statistics. The attention
    sublayer saves its input (d), the q/k/v storage (d + 2k: the value view keeps it), the
    rotated q and k (d + k), the SDPA output (d: also the output projection's input) and the
    per-head fp32 logsumexp. The rotary cos/sin tables are per stage (``stage_act_per_token``).

    ``dense`` adds the additive (s, s) mask; ``auto`` saves no mask, and its packed path runs the
    sublayer on the documents gathered into buckets, at most ``1 + BUCKET_PADDING`` times the real
    tokens, which is charged to every microbatch (an upper bound, exact for padded ones up to it).
    """
    attn, mlp = half_act_coef(c)
    return attn + mlp


def half_act_coef(c: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """``(attention half, MLP half)`` of ``block_act_coef``, each ``(a1, a2)``: the attention half
    holds its norm's saved tensors and the attention sublayer's, the MLP half its norm's and the MLP's.

    gpt2: attention half ``e d + 8`` (LayerNorm input, fp32 mean and rstd) plus the sublayer;
    MLP half ``e (2d + 2f) + 8`` (LayerNorm input, fc input, GELU input, proj input, statistics).
    llama: attention half ``2 e d + 4`` (RMSNorm input and normalised input, rstd) plus the
    sublayer; MLP half ``e (3d + 4f) + 4`` (the same for its RMSNorm, the SwiGLU input, gate/up,
    SiLU output and down input)."""
    e, d, f, h = c.dtype_bytes, c.d_model, c.d_ff, c.n_heads
    if c.family == "llama":
        k = c.kv_heads * c.head_dim
        attn_norm, mlp_half, attention = 2 * e * d + 4, e * (3 * d + 4 * f) + 4, e * (4 * d + 3 * k) + 4 * h
    else:
        attn_norm, mlp_half, attention = e * d + 8, e * (2 * d + 2 * f) + 8, 5 * d * e + 4 * h
    if c.attention == "dense":
        return np.array([attn_norm + attention, e]), np.array([mlp_half, 0.0])
    return np.array([attn_norm + (1 + BUCKET_PADDING) * attention, 0.0]), np.array([mlp_half, 0.0])


def stage_act_per_token(c: ModelConfig, first: bool, attention: bool = True) -> float:
    """Per-token bytes a stage saves outside its blocks and head: on the first stage the token ids
    (int64) and, for learned positions, the position ids (int64); for rotary positions the cos and
    sin tables (``2 * head_dim`` at ``e`` bytes, in the bucket layout under ``auto``), shared by the
    stage's blocks, when it holds an attention half (``attention``)."""
    out = (16.0 if c.learned_positions else 8.0) if first else 0.0
    if not c.learned_positions and attention:
        g = 1.0 if c.attention == "dense" else 1.0 + BUCKET_PADDING
        out += 2 * c.head_dim * c.dtype_bytes * g
    return out


# --- split backward and recomputation -------------------------------------------------------------
# Memory of a split backward and of full recomputation, per stage, as ``[P, 3]`` coefficients.
#
# Same form as the activation model above: bytes of a (b rows x s) microbatch = ``c0 + c1*b*s + c2*b*s^2``.
# Counted from what ``dynmb.models`` and ``dynmb.runtime.splitbackward`` keep (``e`` the model's
# dtype bytes, ``d`` d_model, ``f`` d_ff, ``V`` the vocabulary, ``L`` the stage's blocks, ``g = 1 +
# BUCKET_PADDING`` under ``attention="auto"`` (bucketed documents, an upper bound) else 1):
#
# - ``w_coef``: held from ``I`` to ``W`` (each Linear call's input and output gradient). Per block
#   and token ``e * (2d + 2f + 6d g)``: qkv (input d, gradient 3d), attention projection (d, d),
#   MLP fc (d, f), MLP projection (f, d); the last stage adds the LM head's (d, V). Measured with the
#   CPU meter on the small preset (2 and 4 stages, padded and packed rows): exact for one document per
#   row (16,384 B per block and token), within the bucket padding for packed rows.
# - ``recompute_saved_coef``: what a recomputed microbatch does not hold from F to B: each
#   block's saved activations except its input, which the recomputation keeps (``e d`` per token).
# - ``recompute_transient_coef``: one block's activations, live while that block is recomputed
#   and back-propagated (added to the op's transient bytes; an upper bound, since on the last
#   stage the logits gradient is gone by then).
#
# Measured peak of one microbatch through a stage with recomputation (small preset, 1 x 512,
# stage 0 of 2): 1.58 MB held after the forward (17.3 MB without), 9.46 MB during its backward.


def w_coef(cfg: ModelConfig, num_stages: int) -> np.ndarray:
    """``[P, 3]``: bytes held from a microbatch's ``I`` to its ``W`` on each stage: every Linear
    call's input and output gradient. Per block and token, gpt2: ``e (2d + 2f + 6d g)`` (qkv d + 3d,
    proj d + d, fc d + f, proj f + d); llama (``k = n_kv_heads * head_dim``): ``e (2d + 3f + (4d +
    2k) g)`` (qkv d + d + 2k, proj d + d, gate_up d + 2f, down f + d), the attention half's the terms
    with ``g``, the MLP half's the rest; a stage holding LM-head rows adds the head's (d, its rows)."""
    e, d, f = cfg.dtype_bytes, cfg.d_model, cfg.d_ff
    g = 1.0 if cfg.attention == "dense" else 1.0 + BUCKET_PADDING
    if cfg.family == "llama":
        k = cfg.kv_heads * cfg.head_dim
        attn, mlp = e * (4 * d + 2 * k) * g, e * (2 * d + 3 * f)
    else:
        attn, mlp = e * 6 * d * g, e * (2 * d + 2 * f)
    out = np.zeros((num_stages, 3))
    for i, (na, nm) in enumerate(cfg.stage_parts(num_stages)):
        out[i, 1] = na * attn + nm * mlp
        rows = len(cfg.stage_vocab(num_stages)[i])
        if rows and not cfg.tie_embeddings:
            out[i, 1] += e * (d + rows)
    return out


def head_act_per_token(cfg: ModelConfig, stage: int | None = None, num_stages: int = 1) -> float:
    """Bytes per token the head saves for backward on ``stage`` (None: the whole head on one stage):
    on the head's first stage norm_f input and output (RMSNorm also its normalised input before the
    gain, and in a 16-bit model an fp32 copy of it, as the CPU meter shows) and its fp32 statistics (LayerNorm: mean and rstd; RMSNorm: rstd); on a stage holding
    ``rows`` of the LM head the fp32 log-softmax (a shard: its logits) of its rows and the int64
    labels, and on a shard stage after the first its input, the normalised hidden state, plus the
    running fp32 statistics (``dynmb.model_sizes.HEAD_STATS``); 0 on a stage without head rows."""
    e, d = cfg.dtype_bytes, cfg.d_model
    rows = cfg.vocab_size if stage is None else len(cfg.stage_vocab(num_stages)[stage])
    if not rows:
        return 0.0
    norm = 3 * d * e + d * (4 - e) + 4 if cfg.family == "llama" else 2 * d * e + 8   # a 16-bit RMSNorm keeps an fp32 copy too
    if stage is None or stage == cfg.head_stage(num_stages):
        return norm + 4 * rows + 8
    return d * e + 4 * HEAD_STATS + 4 * rows + 8


def recompute_saved_coef(cfg: ModelConfig, num_stages: int) -> np.ndarray:
    """``[P, 3]``: activation bytes a recomputed microbatch does not hold: all its blocks' (whole or
    half) but their inputs, and on the stages holding LM-head rows the head's but its input
    (``dynmb.models.RecomputedHead``)."""
    out = np.zeros((num_stages, 3))
    attn, mlp = half_act_coef(cfg)
    for i, ((na, nm), blocks) in enumerate(zip(cfg.stage_parts(num_stages), cfg.stage_blocks(num_stages))):
        out[i, 1:] = na * attn + nm * mlp
        out[i, 1] -= len(blocks) * cfg.dtype_bytes * cfg.d_model
    for i in range(num_stages):
        if len(cfg.stage_vocab(num_stages)[i]):
            out[i, 1] += head_act_per_token(cfg, i, num_stages) - cfg.dtype_bytes * cfg.d_model
    return out


def recompute_transient_coef(cfg: ModelConfig, num_stages: int) -> np.ndarray:
    """``[P, 3]``: what a recomputed backward re-creates at a time, on top of the stage's
    transient bytes: one block's activation bytes (its largest block, whole or half); on a stage holding
    LM-head rows, whose transient is the fp32 logits gradient of its rows (4 per token and row), the head's
    re-created activations while that gradient lives, or one block's after it is gone (the head's backward
    runs first), whichever is larger: ``max(block - 4 rows, head)``."""
    out = np.zeros((num_stages, 3))
    halves = dict(zip(("attn", "mlp"), half_act_coef(cfg)))
    for i, blocks in enumerate(cfg.stage_blocks(num_stages)):
        for _, parts in blocks:
            out[i, 1:] = np.maximum(out[i, 1:], sum(halves[p] for p in parts))
    for i, rows in enumerate(cfg.stage_vocab(num_stages)):
        if len(rows):
            out[i, 1] = max(out[i, 1] - 4 * len(rows), head_act_per_token(cfg, i, num_stages))
    return out
