"""The analytic memory coefficients per model family: bytes a stage keeps per token and per row * s^2.

Counted from what ``dynmb.models`` saves for backward (``torch.autograd`` saved tensors, each storage
once), per family (gpt2, llama), for the activations held from a microbatch's F to its B
(``block_act_coef``, per half-block ``half_act_coef``, ``stage_act_per_token``, ``head_act_per_token``),
the bytes held from a split backward's I to its W (``w_coef``) and what full recomputation saves and
re-creates (``recompute_saved_coef``, ``recompute_transient_coef``), counted per half-block (attention
half, MLP half: a stage may start or end between them, ``ModelConfig.stage_blocks``) and per piece of one
(``piece_act_coef``, ``stage_blocks_act``: a boundary inside a half, ``dynmb.models.pieces``). ``dynmb.memory.model.MemoryModel.analytic``
assembles them per stage; the CPU meter checks them (tests/test_memory.py, tests/test_llama.py).
"""

from __future__ import annotations

import numpy as np

from dynmb.core.config import ModelConfig
from dynmb.core.model_sizes import HEAD_STATS, SUB_CHUNKS, HalfPiece, leading_layers

__all__ = ["BUCKET_PADDING", "block_act_coef", "half_act_coef", "piece_act_coef", "stage_blocks_act",
           "stage_act_per_token", "head_act_per_token", "w_coef", "recompute_saved_coef", "recompute_transient_coef",
           "recompute_kv_kept_coef", "slice_recompute_coef",
           "block_recompute_saved_coef", "block_recompute_transient_coef"]

BUCKET_PADDING = 1 / 16
"""Bound on the pad tokens of bucketed document attention (``dynmb.models.bucket_documents``),
as a fraction of the microbatch's real tokens; the ``auto`` memory model charges it."""


def block_act_coef(c: ModelConfig) -> np.ndarray:
    """``(a1, a2)`` of one block: bytes saved for backward per token and per row * s^2.

    gpt2. Outside attention: both LayerNorm inputs and the MLP's fc input (3d), the GELU input
    and the MLP-proj input (2f) at ``e`` bytes, and 2 x 2 fp32 LayerNorm statistics. The
    attention sublayer saves its input (d: qkv's input), the shared q/k/v storage (3d), the SDPA
    output (d: also proj's input) and the per-head fp32 logsumexp.

    llama (``k = n_kv_heads * head_dim``; the lean blocks of ``dynmb.models.llama``, "What the blocks
    save"). Outside attention: each RMSNorm's input (2d: ``LeanRMSNorm`` recomputes the normalised
    input in its backward) and its fp32 rstd (2 x 4 bytes), the SwiGLU input (d), the gate/up storage
    (2f: ``SwiGLUProduct`` recomputes the SiLU) and the down projection's input (f). The attention
    sublayer saves its input (d), the rotated q and k (d + k), the value (k: its own copy, so the
    fused q/k/v output is freed), the SDPA output (d: also the output projection's input) and the
    per-head fp32 logsumexp. The rotary cos/sin tables are per stage (``stage_act_per_token``).
    (Before the lean blocks: ``2 e d + 4`` per norm, ``4 f`` in the MLP and ``3 d + 3 k`` in attention.)

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
    llama: attention half ``e d + 4`` (RMSNorm input, fp32 rstd) plus the sublayer (``e (d + 2d +
    2k) + 4 h``: input, rotated q and k, own v, SDPA output, logsumexp); MLP half ``e (2d + 3f) + 4``
    (the same for its RMSNorm, the SwiGLU input, gate/up and down input)."""
    attn, mlp = (piece_act_coef(c, HalfPiece(0, part, range(SUB_CHUNKS))) for part in ("attn", "mlp"))
    return attn, mlp


def _half_terms(c: ModelConfig, part: str) -> tuple[float, float, float, float]:
    """``(norm, input, scaled, a2)`` per token of a half (``half_act_coef``): its norm's saved tensors, the
    sublayer's input (the normalised hidden state), what scales with its chunks (heads, columns) and the
    per row * s^2 bytes (the dense mask); attention's input and scaled terms times ``1 + BUCKET_PADDING``
    under ``auto``."""
    e, d, f, h = c.dtype_bytes, c.d_model, c.d_ff, c.n_heads
    g = 1.0 if c.attention == "dense" else 1.0 + BUCKET_PADDING
    norm = e * d + 4 if c.family == "llama" else e * d + 8
    if part == "mlp":
        return norm, e * d, e * (3 if c.family == "llama" else 2) * f, 0.0
    k = c.kv_heads * c.head_dim
    scaled = e * (2 * d + 2 * k) + 4 * h if c.family == "llama" else 4 * d * e + 4 * h
    return norm, g * e * d, g * scaled, e if c.attention == "dense" else 0.0


def piece_act_coef(c: ModelConfig, piece: HalfPiece) -> np.ndarray:
    """``(a1, a2)`` of a half-block or piece of one (``dynmb.models.pieces``): chunk 0's piece (or the whole
    half) holds the norm's saved tensors and the normalised input, a later piece the message ``[y | h]`` it
    received (``2 d``, held from its forward to its backward: its sublayer reads ``h`` as a view of it) and
    for attention the gathered copy of ``h`` that packed rows' document buckets make (an upper bound: one
    document a row reads the view); every piece its share of the heads' or columns' tensors."""
    norm, inp, scaled, a2 = _half_terms(c, piece.part)
    r = len(piece.chunks) / SUB_CHUNKS
    if piece.chunks.start == 0:
        return np.array([norm + inp + r * scaled, a2])
    return np.array([2 * c.dtype_bytes * c.d_model + (inp if piece.part == "attn" else 0.0) + r * scaled, a2])


def stage_blocks_act(c: ModelConfig, num_stages: int) -> np.ndarray:
    """``[P, 2]``: ``(a1, a2)`` of each stage's half-blocks and pieces (``piece_act_coef``)."""
    return np.array([sum((piece_act_coef(c, pc) for pc in pieces), np.zeros(2))
                     for pieces in c.stage_pieces(num_stages)])


def _block_inputs(c: ModelConfig, num_stages: int) -> np.ndarray:
    """``[P]``: bytes per token of the inputs of each stage's blocks (``d``, ``2 d`` for a first block that
    starts inside a half, whose input is ``[y | h]``): what full recomputation keeps of them."""
    out = np.zeros(num_stages)
    for i, pieces in enumerate(c.stage_pieces(num_stages)):
        layers = {pc.layer for pc in pieces}
        out[i] = c.dtype_bytes * c.d_model * (len(layers) + (1 if pieces and pieces[0].chunks.start else 0))
    return out


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
    with ``g``, the MLP half's the rest; a stage holding LM-head rows adds the head's (d, its rows). A piece
    of a half (``dynmb.models.pieces``) holds its first Linear's whole input (``d``; ``2 d``, the message
    ``[y | h]`` it is a view of, on a piece after chunk 0) and its last Linear's whole output gradient
    (``d``; ``2 d``, a view of the gradient of the ``[y | h]`` it sent, on a piece ending before chunk 8),
    and its share of the rest. The blocks a stage recomputes (``ModelConfig.recompute_blocks``) hold none: their nested
    backward, in ``I``, computes their weight gradients too."""
    e, d, f = cfg.dtype_bytes, cfg.d_model, cfg.d_ff
    g = 1.0 if cfg.attention == "dense" else 1.0 + BUCKET_PADDING
    k = cfg.kv_heads * cfg.head_dim
    scaled = {"attn": (2 * d + 2 * k) * g if cfg.family == "llama" else 4 * d * g,
              "mlp": 3 * f if cfg.family == "llama" else 2 * f}
    out = np.zeros((num_stages, 3))
    for i, pieces in enumerate(cfg.stage_pieces(num_stages)):
        recomputed = set(leading_layers(pieces, cfg.stage_recompute_blocks(num_stages)[i]))
        for pc in pieces:
            if pc.layer in recomputed:                          # its weight gradients are computed in I
                continue
            one = g if pc.part == "attn" else 1.0              # a view of [y | h] or its gradient: 2 d, not g d
            whole = d * ((2 if pc.chunks.start else one) + (2 if pc.chunks.stop < SUB_CHUNKS else one))
            out[i, 1] += e * (whole + len(pc.chunks) / SUB_CHUNKS * scaled[pc.part])
        rows = len(cfg.stage_vocab(num_stages)[i])
        if rows and not cfg.tie_embeddings:
            out[i, 1] += e * (d + rows)
    return out


def head_act_per_token(cfg: ModelConfig, stage: int | None = None, num_stages: int = 1) -> float:
    """Bytes per token the head saves for backward on ``stage`` (None: the whole head on one stage):
    on the head's first stage norm_f input and output (the LM head's input) and its fp32 statistics
    (LayerNorm: mean and rstd; RMSNorm: rstd, ``LeanRMSNorm``); on a stage holding
    ``rows`` of the LM head the fp32 log-softmax (a shard: its logits) of its rows and the int64
    labels, and on a shard stage after the first its input, the normalised hidden state, plus the
    running fp32 statistics (``dynmb.core.model_sizes.HEAD_STATS``); 0 on a stage without head rows."""
    e, d = cfg.dtype_bytes, cfg.d_model
    rows = cfg.vocab_size if stage is None else len(cfg.stage_vocab(num_stages)[stage])
    if not rows:
        return 0.0
    norm = 2 * d * e + 4 if cfg.family == "llama" else 2 * d * e + 8
    if stage is None or stage == cfg.head_stage(num_stages):
        return norm + 4 * rows + 8
    return d * e + 4 * HEAD_STATS + 4 * rows + 8


def recompute_saved_coef(cfg: ModelConfig, num_stages: int) -> np.ndarray:
    """``[P, 3]``: activation bytes a recomputed microbatch does not hold: all its blocks' (whole, halves or
    pieces) but their inputs (``[y | h]`` for a first block that starts inside a half), and on the stages holding LM-head rows the head's but its input
    (``dynmb.models.RecomputedHead``); less what the layout's recomputed blocks drop already
    (``block_recompute_saved_coef``: the layout's activations do not hold it), so ``act - saved`` is the same
    full-recompute count on every layout."""
    out = np.zeros((num_stages, 3))
    out[:, 1:] = stage_blocks_act(cfg, num_stages)
    out[:, 1] -= _block_inputs(cfg, num_stages)
    out -= block_recompute_saved_coef(cfg, num_stages)
    for i in range(num_stages):
        if len(cfg.stage_vocab(num_stages)[i]):
            out[i, 1] += head_act_per_token(cfg, i, num_stages) - cfg.dtype_bytes * cfg.d_model
    return out


def _largest_block_coef(cfg: ModelConfig, num_stages: int) -> np.ndarray:
    """``[P, 2]``: ``(a1, a2)`` of each stage's largest block (whole, half or pieces of one layer)."""
    out = np.zeros((num_stages, 2))
    for i, pieces in enumerate(cfg.stage_pieces(num_stages)):
        for layer in {pc.layer for pc in pieces}:
            out[i] = np.maximum(out[i], sum(piece_act_coef(cfg, pc) for pc in pieces if pc.layer == layer))
    return out


def recompute_transient_coef(cfg: ModelConfig, num_stages: int) -> np.ndarray:
    """``[P, 3]``: what a recomputed backward re-creates at a time, on top of the stage's
    transient bytes: one block's activation bytes (its largest block, whole or half); on a stage holding
    LM-head rows, whose transient is the fp32 logits gradient of its rows (4 per token and row), the head's
    re-created activations while that gradient lives, or one block's after it is gone (the head's backward
    runs first), whichever is larger: ``max(block - 4 rows, head)``; less what the layout's recomputed blocks add
    to the stage's transient already (``block_recompute_transient_coef``, never more than this)."""
    out = np.zeros((num_stages, 3))
    out[:, 1:] = _largest_block_coef(cfg, num_stages)
    for i, rows in enumerate(cfg.stage_vocab(num_stages)):
        if len(rows):
            out[i, 1] = max(out[i, 1] - 4 * len(rows), head_act_per_token(cfg, i, num_stages))
    return out - block_recompute_transient_coef(cfg, num_stages)


# --- recomputation of a stage's leading blocks (``ModelConfig.recompute_blocks``) ---------------------------
# Stage i's first ``k_i`` blocks (``stage_blocks`` entries: the pieces of one layer) run under checkpointing in
# every microbatch: their forward keeps only each block's input (``e d`` per token; ``2 e d``, the message
# ``[y | h]``, for a block that starts inside a half), and the backward re-creates one block at a time before
# back-propagating it, weight gradients included (so nothing of theirs is held from I to W, ``w_coef``). The
# layout's ``MemoryModel.analytic`` takes ``block_recompute_saved_coef`` off the activations and adds
# ``block_recompute_transient_coef`` to the transient bytes; a microbatch that recomputes every block
# (``rc_act_coef``, ``rc_transient_coef``) counts what it did before (``recompute_saved_coef`` and
# ``recompute_transient_coef`` are the rest).


def block_recompute_saved_coef(cfg: ModelConfig, num_stages: int) -> np.ndarray:
    """``[P, 3]``: bytes the recomputed blocks of each stage (``ModelConfig.recompute_blocks``) do not hold from a
    microbatch's F to its B: their pieces' ``piece_act_coef`` less their inputs (``e d`` a block, ``2 e d`` for one
    that starts inside a half); 0 where none is recomputed."""
    out = np.zeros((num_stages, 3))
    for i, (pieces, k) in enumerate(zip(cfg.stage_pieces(num_stages), cfg.stage_recompute_blocks(num_stages))):
        layers = set(leading_layers(pieces, k))
        for pc in pieces:
            if pc.layer in layers:
                out[i, 1:] += piece_act_coef(cfg, pc)
        starts_inside = bool(pieces) and pieces[0].layer in layers and pieces[0].chunks.start > 0
        out[i, 1] -= cfg.dtype_bytes * cfg.d_model * (len(layers) + (1 if starts_inside else 0))
    return out


def block_recompute_transient_coef(cfg: ModelConfig, num_stages: int) -> np.ndarray:
    """``[P, 3]``: what re-creating the largest of a stage's recomputed blocks adds to its backward's transient
    bytes: that block's ``piece_act_coef``; on a stage holding LM-head rows less their fp32 logits gradient (the
    head's backward, not recomputed, runs first and frees it), never below 0."""
    out = np.zeros((num_stages, 3))
    for i, (pieces, k) in enumerate(zip(cfg.stage_pieces(num_stages), cfg.stage_recompute_blocks(num_stages))):
        for layer in leading_layers(pieces, k):
            out[i, 1:] = np.maximum(out[i, 1:], sum(piece_act_coef(cfg, pc) for pc in pieces if pc.layer == layer))
        rows = len(cfg.stage_vocab(num_stages)[i])
        if rows and out[i, 1]:
            out[i, 1] = max(out[i, 1] - 4 * rows, 0.0)
    return out


def recompute_kv_kept_coef(cfg: ModelConfig) -> float:
    """Bytes per token and attention layer that a continued slice's recomputed backward keeps once that layer's
    block is done (``dynmb.models.prefix.PrefixStore.keep``: the recomputed keys and values replace the kept ones
    as the backward's roots and stay referenced until the slice's entries are released after its whole backward):
    the storages of ``k`` and ``v``. gpt2: both are views of the fused q/k/v projection's output (``3 d`` at ``e``
    bytes); llama (``k = n_kv_heads * head_dim``): the rotated keys and the value's own copy (``2 k``; the fused
    output is freed, ``dynmb.models.llama``). The CPU meter: 768 B per token and layer on ``tiny``, 256 on
    ``llama-tiny`` (``tests/test_slices_memory.py``)."""
    e, k = cfg.dtype_bytes, cfg.kv_heads * cfg.head_dim
    if cfg.family == "llama":
        return float(e * 2 * k)
    return float(e * (cfg.d_model + 2 * k + (0 if cfg.learned_positions else k)))


def slice_recompute_coef(cfg: ModelConfig, num_stages: int) -> np.ndarray:
    """``[P]``: bytes per continued token (``Microbatch.continued_tokens``) that a recomputed slice's backward
    holds on top of its transient bytes (``recompute_transient_coef``). Its blocks are recomputed and
    back-propagated last to first; after each, ``recompute_kv_kept_coef`` stays held, so while its stage's first
    block is recomputed, ``n - 1`` layers' keys and values are kept (``n`` attention layers on the stage) beside
    that block's activations: ``(n - 1) R + block - 4 rows - (recompute transient)`` over the stage's transient,
    that is ``(n - 1) R`` on a stage without LM-head rows and ``max(0, (n - 1) R + min(0, block - 4 rows -
    head))`` on one with ``rows`` of them (where the head's phase, with the logits gradient, was the larger).
    Charged per continued token: a row filled with short sequences is over-counted (their share of the
    negative term), never under."""
    layers = np.array([na for na, _ in cfg.stage_parts(num_stages)], dtype=np.float64)
    kept = np.maximum(np.ceil(layers) - 1.0, 0.0) * recompute_kv_kept_coef(cfg)
    block = _largest_block_coef(cfg, num_stages)[:, 0]
    slack = np.zeros(num_stages)
    for i, rows in enumerate(cfg.stage_vocab(num_stages)):
        if len(rows):
            slack[i] = min(0.0, block[i] - 4 * len(rows) - head_act_per_token(cfg, i, num_stages))
    return np.maximum(kept + slack, 0.0)


# --- activation offload to host memory ------------------------------------------------------------
# ``PlanMeta.offload_blocks[i] = n``: stage i's first ``n`` blocks (layers, whole, halves or pieces of one,
# in the order the stage runs them) keep what they save for backward in host memory between a microbatch's
# forward and its backward. What moves per token and row * s^2 is those blocks' share of ``stage_blocks_act``
# (``piece_act_coef`` of their pieces); a recomputed microbatch saves only its blocks' inputs
# (``_block_inputs``), so it moves those. The stage's input (``d`` per token, ``[y | h]`` for a first block that
# starts inside a half: what the stage received, kept for its backward, so the copy would free nothing), its own
# per-token tensors (ids, rotary tables), the head's and the output kept for the backward stay on the device (the
# runtime, ``dynmb.runtime.offload``, leaves a storage still held elsewhere where it is); on stage 0 with the
# embedding first the input is not kept: counting it on the device there is an over-count, the safe side.


def stage_block_count(c: ModelConfig, num_stages: int) -> np.ndarray:
    """``[P]``: how many blocks (distinct layers, whole or in part) each stage runs: the most it can offload."""
    return np.array([len({pc.layer for pc in pieces}) for pieces in c.stage_pieces(num_stages)], dtype=np.int64)


def offload_coef(c: ModelConfig, num_stages: int, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``([P, 3], [P, 3])``: bytes a microbatch moves to host memory on each stage when its first ``blocks[i]``
    blocks offload (module comment above): without recomputation their saved activations, with it their
    inputs (``d`` per token and block; ``2 d`` for a first block that starts inside a half), the stage's input
    left out of both."""
    plain, rc = np.zeros((num_stages, 3)), np.zeros((num_stages, 3))
    for i, pieces in enumerate(c.stage_pieces(num_stages)):
        layers = leading_layers(pieces, int(blocks[i]))
        if not layers:
            continue
        kept = c.dtype_bytes * c.d_model * (2 if pieces[0].chunks.start else 1)      # the stage's input
        plain[i, 1:] = sum((piece_act_coef(c, pc) for pc in pieces if pc.layer in layers), np.zeros(2))
        plain[i, 1] -= kept
        rc[i, 1] = c.dtype_bytes * c.d_model * (len(layers) + (1 if pieces[0].chunks.start else 0)) - kept
    return plain, rc
