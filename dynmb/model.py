"""The torch workload: a GPT-style decoder split into pipeline stage modules.

Model: token embedding + learned position embedding (first stage), then pre-LN
blocks ``x + attn(LN(x))``, ``x + mlp(LN(x))`` with causal self-attention through
``torch.nn.functional.scaled_dot_product_attention`` and a GELU MLP, then a final
LayerNorm, an untied LM head and the loss (last stage). ``GPT`` is the whole model
as one stage; ``GPTStage(cfg, s, P)`` holds the blocks ``cfg.stage_layers(P)[s]``.
Parameter names are global ("blocks.3.attn.qkv.weight") and every parameter is
initialised from a seed derived from ``(seed, name)``, so stages built separately
on different ranks have exactly the weights of the full model.

Documents: every token carries a document id (pad = -1) and a position that restarts
at 0 in each document; rows are padded on the right. Attention follows
``cfg.attention`` (``dynmb.types.ATTENTION_KINDS``), chosen once per microbatch by
``make_inputs``:

- ``auto``, one document per row (``not mb.is_packed``): SDPA with ``is_causal=True``
  and no mask tensor. A real query only sees keys at or before it, all real; pad
  outputs are ignored by the loss and get no gradient. Work ``b * s**2``.
- ``auto``, packed rows (some row holds several documents): bucketed document-causal
  attention. ``make_inputs`` sorts the documents by length and groups them
  (``bucket_documents``: starting from one bucket per distinct length, merge the two
  neighbouring buckets that add the fewest pad tokens while the pad tokens stay within
  ``BUCKET_PADDING`` (1/16) of the real tokens); a bucket of n documents of at most L
  tokens is an (n, L) batch, each document padded on the right. The attention sublayer
  (qkv projection, causal SDPA, output projection) runs per bucket on the LN output
  gathered by one ``index_select`` (``DocumentBuckets.gather_index``); one
  ``index_select`` over the bucket outputs plus a zero row (``scatter_index``) puts the
  result back in the (b, s) layout, zeros at pads. Work ``sum(n_j * L_j**2)``: the sum
  of s_i**2 plus the bucket padding. Bucket pad slots copy their document's last token,
  sit after it (causal) and get an exactly zero gradient, so the result is exact.
  Measured (``benchmarks/bench_attention.py``: torch 2.13 CPU, 1 thread, ``small``
  preset, forward + backward, median of 5, stage 0 of 2 / whole model): a 4096-token
  row of 64 documents of 64 runs at 0.80x / 1.07x the tokens/s of 64 rows of 64 (the
  dense mask: 0.22x / 0.31x); one SDPA call per document (a loop) ran at 0.90-0.98x
  the bucketed path on rows of 4, 16 and 64 documents, so the buckets stay.
- ``dense``: one boolean ``(b, 1, s, s)`` mask (query i sees key j iff same document and
  j <= i; the diagonal is always on, so a pad query row is never fully masked), built
  only in this mode. A mask skips no work in SDPA: ``b * s**2`` for every layout. Kept
  as an ablation and as the reference the tests compare the other paths to.

No FlexAttention: the bucketed path runs unchanged on CUDA (its index tensors move
with ``MicrobatchInputs.to``).

Slices of long sequences (``Microbatch.offsets``/``continued``) run on the ``document`` path:
each slice segment's attention sublayer runs on its own tokens with
``dynmb.prefix.PrefixAttention`` over the keys and values its earlier slices kept at that
layer (``MicrobatchInputs.prefix``, a ``PrefixStore``); a continued slice keeps its own.
Positions continue across slices (learned positions cover ``max_seq_len``: size it from
the trace). ``reference_grads`` runs a sliced document whole, in one pass.

Loss: the last stage returns the SUM of per-token cross-entropy over real tokens;
the caller divides by the real tokens of the whole global batch, so the gradient
does not depend on how sequences are grouped into microbatches.
"""

from __future__ import annotations

import hashlib
import math
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dynmb.config import ModelConfig
from dynmb.prefix import prefix_attention
from dynmb.inputs import (IGNORE_INDEX, INPUT_ATTENTION, DocumentBuckets, InputError, MicrobatchInputs, SliceSegment,
                          attention_mask, bucket_documents, full_microbatch, hidden_shape, make_inputs,
                          synthetic_tokens, torch_dtype)
from dynmb.types import Microbatch, Plan

__all__ = [
    "GPT", "GPTStage", "Block", "MicrobatchInputs", "DocumentBuckets", "InputError", "build_stage", "build_stages",
    "synthetic_tokens", "full_microbatch", "make_inputs", "attention_mask", "bucket_documents", "hidden_shape",
    "torch_dtype", "global_named_parameters", "count_params", "reference_grads", "IGNORE_INDEX", "INPUT_ATTENTION",
    "RecomputedBlock", "RecomputedHead", "whole_documents",
]

# --- model -------------------------------------------------------------------
class Attention(nn.Module):
    """Multi-head self-attention on the path ``inputs.attention`` names (module docstring)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.layer = cfg.n_heads, cfg.head_dim, layer
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, inputs: MicrobatchInputs) -> torch.Tensor:
        if inputs.buckets is not None:
            return self._bucketed(x, inputs)
        b, s, d = x.shape
        return self.proj(self._attend(x, inputs.attn_mask).reshape(b, s, d))

    def _attend(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``(n, L, d)`` -> SDPA output ``(n, L, heads, head_dim)``: causal without a mask."""
        n, length, _ = x.shape
        q, k, v = self.qkv(x).view(n, length, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return y.transpose(1, 2)

    def _bucketed(self, x: torch.Tensor, inputs: MicrobatchInputs) -> torch.Tensor:
        """Document-causal attention: gather the documents into length buckets, run the
        sublayer per bucket and per slice segment, scatter back (zeros at pads)."""
        buckets = inputs.buckets
        assert buckets is not None
        b, s, d = x.shape
        flat = x.reshape(b * s, d)
        outs = []
        if buckets.shapes:
            gathered = flat.index_select(0, buckets.gather_index)
            outs = [self.proj(self._attend(part.view(n, length, d), None).reshape(n * length, d))
                    for (n, length), part in zip(buckets.shapes, gathered.split(buckets.split_sizes()))]
        for seg in buckets.slices:
            outs.append(self._slice(flat.index_select(0, seg.index), seg, inputs))
        outs.append(x.new_zeros(1, d))
        return torch.cat(outs).index_select(0, buckets.scatter_index).view(b, s, d)

    def _slice(self, x: torch.Tensor, seg: SliceSegment, inputs: MicrobatchInputs) -> torch.Tensor:
        """``(n, d)`` tokens of one slice -> the attention sublayer's output, attending to the
        keys and values earlier slices kept in ``inputs.prefix`` (``dynmb.prefix``)."""
        store = inputs.prefix
        if store is None:
            raise InputError(f"microbatch {inputs.microbatch} holds a slice of sequence {seg.seq_id} but runs "
                             f"without a PrefixStore (MicrobatchInputs.prefix)")
        n, d = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.n_heads, self.head_dim).permute(1, 2, 0, 3)
        pk, pv = store.prefix(self.layer, seg.seq_id, seg.offset, inputs.microbatch)
        y = prefix_attention(q, k, v, pk, pv)
        if seg.continued:
            store.keep(self.layer, seg.seq_id, seg.offset, k, v, inputs.microbatch)
        return self.proj(y.transpose(0, 1).reshape(n, d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LN transformer block."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.d_model), Attention(cfg, layer)
        self.ln2, self.mlp = nn.LayerNorm(cfg.d_model), MLP(cfg)

    def forward(self, x: torch.Tensor, inputs: MicrobatchInputs) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), inputs)
        return x + self.mlp(self.ln2(x))


class RecomputedBlock(torch.autograd.Function):
    """A block run with full activation recomputation (Megatron's ``full`` granularity).

    Forward: the block runs without building a graph; only its input is saved for backward
    (``save_for_backward``, so saved-tensor hooks such as the CPU memory meter see it). Backward:
    the block's forward is recomputed from that input with autograd on, then back-propagated
    at once (a nested ``torch.autograd.backward``: the block's parameter gradients accumulate in
    ``.grad``, the input's gradient is returned), so one block's activations are live at a time.
    The recomputation runs under whatever saved-tensor hooks the caller's backward has, which is
    why this is not ``torch.utils.checkpoint(use_reentrant=False)``: that one saves the
    recomputed activations under its own hooks, where the CPU meter cannot account them.
    Deterministic kernels recompute bit-identical activations, so gradients are exact."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, block: nn.Module, inputs: "MicrobatchInputs") -> torch.Tensor:  # type: ignore[override]
        ctx.block, ctx.inputs = block, inputs
        ctx.save_for_backward(x)
        return block(x, inputs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        leaf = x.detach().requires_grad_(x.requires_grad)
        with torch.enable_grad():
            y = ctx.block(leaf, ctx.inputs)
        roots = ctx.inputs.prefix.pop_pending() if ctx.inputs.prefix is not None else []
        torch.autograd.backward([y, *(t for t, _ in roots)], [grad, *(g for _, g in roots)])
        return leaf.grad, None, None


class RecomputedHead(torch.autograd.Function):
    """The last stage's head (final LayerNorm, LM head, summed cross-entropy) under full
    recomputation: only its input is saved; the backward recomputes the logits and runs
    their backward at once, so the fp32 logits and log-softmax of a recomputed microbatch
    live only during its backward (the lever that lets a chain of slices of a long sequence
    stay in flight on the last stage). Same exactness argument as ``RecomputedBlock``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, stage: "GPTStage", inputs: "MicrobatchInputs") -> torch.Tensor:  # type: ignore[override]
        ctx.stage, ctx.inputs = stage, inputs
        ctx.save_for_backward(x)
        return stage.head(x, inputs, "sum")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        leaf = x.detach().requires_grad_(x.requires_grad)
        with torch.enable_grad():
            y = ctx.stage.head(leaf, ctx.inputs, "sum")
        torch.autograd.backward(y, grad)
        return leaf.grad, None, None


def _param_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") & (2**63 - 1)


class GPTStage(nn.Module):
    """Stage ``stage`` of ``num_stages``: the blocks ``cfg.stage_layers(num_stages)[stage]``,
    plus ``embed``/``pos`` on the first stage and ``norm_f``/``lm_head`` on the last.

    Weights depend only on ``(cfg, seed)`` and the global parameter name, never on
    the split. ``dtype`` overrides ``cfg.dtype`` (e.g. ``torch.float64`` in tests).
    ``forward(x, inputs)``: ``x`` is ignored on the first stage (``inputs.input_ids``
    are embedded), otherwise the hidden state ``(batch, padded_len, d_model)``.
    Non-last stages return the hidden state; the last returns the summed CE over real
    tokens (0-dim, float32 or wider), or per-token CE ``(batch, padded_len)`` with
    zeros at pads when ``reduction="none"``.
    """

    def __init__(self, cfg: ModelConfig, stage: int = 0, num_stages: int = 1, *, seed: int = 0,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage {stage} out of range for {num_stages} stages")
        self.cfg, self.stage, self.num_stages = cfg, stage, num_stages
        self.layers = cfg.stage_layers(num_stages)[stage]
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        if self.is_first:
            self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i) for i in self.layers})
        if self.is_last:
            self.norm_f = nn.LayerNorm(cfg.d_model)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters(seed)
        self.to(device=device, dtype=dtype or torch_dtype(cfg))

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """GPT-2 init, each parameter from its own generator seeded by ``(seed, global name)``:
        N(0, 0.02) weights, residual output projections scaled by 1/sqrt(2 n_layers),
        zero biases, unit LayerNorm gains."""
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if ".ln" in name or name.startswith("norm_f"):
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                std = resid_std if name.endswith("proj.weight") else 0.02
                g = torch.Generator().manual_seed(_param_seed(seed, name))
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)

    def forward(self, x: torch.Tensor | None, inputs: MicrobatchInputs, *, reduction: str = "sum",
                recompute: bool = False) -> torch.Tensor:
        """``recompute``: full activation recomputation per block (see ``RecomputedBlock``) and of
        the last stage's head (``RecomputedHead``)."""
        if self.is_first:
            if inputs.max_doc_len > self.cfg.max_seq_len:
                raise InputError(f"a document of {inputs.max_doc_len} tokens exceeds max_seq_len {self.cfg.max_seq_len}")
            x = self.embed(inputs.input_ids) + self.pos(inputs.position_ids)
        elif x is None:
            raise ValueError(f"stage {self.stage} needs the hidden state from stage {self.stage - 1}")
        recomputing = recompute and torch.is_grad_enabled()
        for blk in self.blocks.values():
            x = RecomputedBlock.apply(x, blk, inputs) if recomputing else blk(x, inputs)
        if not self.is_last:
            return x
        if recomputing and reduction == "sum":
            return RecomputedHead.apply(x, self, inputs)
        return self.head(x, inputs, reduction)

    def head(self, x: torch.Tensor, inputs: MicrobatchInputs, reduction: str = "sum") -> torch.Tensor:
        """Final norm, LM head and cross-entropy over real tokens (``reduction``: sum or none)."""
        logits = self.lm_head(self.norm_f(x))
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if reduction == "sum":
            return F.cross_entropy(logits.flatten(0, 1), inputs.labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        if reduction == "none":
            ce = F.cross_entropy(logits.flatten(0, 1), inputs.labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
            return ce.view(inputs.labels.shape)
        raise ValueError(f"reduction must be 'sum' or 'none', got {reduction!r}")


class GPT(GPTStage):
    """The whole model as a single stage; ``GPT(cfg, seed)(inputs)`` returns the summed CE."""

    def __init__(self, cfg: ModelConfig, seed: int = 0, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__(cfg, 0, 1, seed=seed, dtype=dtype, device=device)

    def forward(self, inputs: MicrobatchInputs, *, reduction: str = "sum") -> torch.Tensor:  # type: ignore[override]
        return super().forward(None, inputs, reduction=reduction)


def build_stage(cfg: ModelConfig, stage: int, num_stages: int, seed: int = 0, *, dtype: torch.dtype | None = None,
                device: torch.device | str | None = None) -> GPTStage:
    """One stage (what a pipeline rank builds); its weights equal ``GPT(cfg, seed)``'s."""
    return GPTStage(cfg, stage, num_stages, seed=seed, dtype=dtype, device=device)


def build_stages(cfg: ModelConfig, num_stages: int, seed: int = 0, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> list[GPTStage]:
    """All ``num_stages`` stages; composed they are ``GPT(cfg, seed)`` (same names, same weights)."""
    return [build_stage(cfg, s, num_stages, seed, dtype=dtype, device=device) for s in range(num_stages)]


def global_named_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """``{global name: parameter}``; names are already global, e.g. ``blocks.3.attn.qkv.weight``."""
    return dict(module.named_parameters())


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def whole_documents(plan: Plan) -> list[Microbatch]:
    """The plan's microbatches with every sliced sequence taken out of them and run whole,
    one single-row microbatch per sliced sequence (the reference a sliced plan must match)."""
    groups = plan.slice_groups()
    if not groups:
        return list(plan.microbatches)
    out = []
    for mb in plan.microbatches:
        keep = ~mb.slice_mask
        if keep.any():
            rows = np.unique(mb.row_ids[keep], return_inverse=True)[1]
            out.append(Microbatch(mb.seq_ids[keep], mb.lengths[keep], mb.padded_len, int(rows.max()) + 1, rows))
    for sid, where in groups.items():
        n = sum(int(plan.microbatches[i].lengths[plan.microbatches[i].seq_ids == sid][0]) for i in where)
        out.append(Microbatch([sid], [n], n, 1))
    return out


def reference_grads(cfg: ModelConfig, num_stages: int, plan: Plan, tokens: Sequence[torch.Tensor], seed: int = 0, *,
                    dtype: torch.dtype | None = None, device: torch.device | str | None = None
                    ) -> tuple[float, dict[str, torch.Tensor]]:
    """Single-process reference for one step: every microbatch of ``plan`` (all replicas)
    runs through the composed stages; returns the token-weighted loss
    (sum CE / real tokens of the global batch) and ``{global name: grad}``."""
    stages = build_stages(cfg, num_stages, seed, dtype=dtype, device=device)
    total = plan.real_tokens
    loss_sum = 0.0
    for mb in whole_documents(plan):
        inputs = make_inputs(mb, tokens, cfg=cfg, device=device)
        x = None
        for st in stages:
            x = st(x, inputs)
        (x / total).backward()
        loss_sum += float(x.detach())
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
             for st in stages for n, p in st.named_parameters()}
    return loss_sum / total, grads
