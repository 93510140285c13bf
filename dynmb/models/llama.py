"""The Llama family: rotary positions, RMSNorm, SwiGLU, grouped-query attention, no biases.

Model: token embedding (first stage), then pre-norm blocks ``x + attn(RMSNorm(x))``,
``x + mlp(RMSNorm(x))``, then a final RMSNorm and the LM head (last stage; optionally the
embedding matrix itself, ``tie_embeddings``, on a single stage; or split by vocabulary over the
last stages, ``ModelConfig.head_split``, ``dynmb.models.head``). ``LlamaStage(cfg, s, P)``
holds the blocks ``cfg.stage_blocks(P)[s]`` (whole, or a half or a piece of one at a boundary inside a block,
``dynmb.models.pieces``); parameter names are global and each parameter is
seeded by ``(seed, global name)``: N(0, 0.02) matrices (the residual output projections
``attn.proj`` and ``mlp.down`` scaled by 1/sqrt(2 n_layers)), unit norm gains; the LM head's rows
N(0, 0.02) in blocks of rows (``dynmb.models.head.seed_head_rows_``, equal for every head split); a piece's
weights are its slice of the whole weight (``dynmb.models.pieces.seed_weight_``).

- Attention (``LlamaAttention``): one bias-free ``qkv`` projection to ``n_heads`` query heads
  and ``n_kv_heads`` key and value heads of ``head_dim`` (rows ``[q | k | v]``), rotary
  positions on q and k, attention on the microbatch's path (``dynmb.models.attention``: causal,
  bucketed document-causal, dense, or slices against a prefix; grouped-query natively), a
  bias-free output projection.
- Rotary positions: angle ``p * theta_i`` with ``theta_i = rope_theta ** (-2i / head_dim)`` for
  position ``p`` (``inputs.position_ids``: restarting at 0 in every document of a packed row,
  continuing across the slices of a sliced document), applied as ``x * cos + rotate_half(x) *
  sin`` with ``rotate_half([a, b]) = [-b, a]`` on the two halves of each head (the layout of
  Hugging Face's ``LlamaForCausalLM``). No position table, so no document-length cap. The
  cos/sin tables are computed once per stage forward in the layout of each attention call
  (``PositionTables``: rows, the gathered document buckets, the slice segments) in fp32 (fp64
  for a fp64 model) and cast to the activation dtype; every block of the stage shares them.
  The prefix store of slices holds post-rotary keys with ``n_kv_heads`` heads.
- RMSNorm: ``x / sqrt(mean(x^2) + 1e-5) * g`` (``LeanRMSNorm``: ``F.rms_norm``'s arithmetic, fp32 statistics).
- SwiGLU MLP: one bias-free ``gate_up`` projection to ``2 d_ff`` (rows ``[gate | up]``),
  ``down(silu(gate) * up)`` (``SwiGLUProduct``).

What the blocks save for backward (per token; ``e`` dtype bytes, ``k = n_kv_heads * head_dim``;
``dynmb.memory.coef`` counts it, the CPU meter checks it) is what the fused kernels of production stacks
save (Megatron / Transformer Engine, Liger, apex), with the same arithmetic:

- ``LeanRMSNorm`` (an ``autograd.Function``) saves its input and the fp32 ``rstd`` (``e d + 4``) and
  recomputes ``xhat = x * rstd`` in its backward; ``F.rms_norm`` composed on CPU saved ``xhat`` too
  (``2 e d + 4``; in a 16-bit model fp32 copies, ``8 d + 4``). Its forward equals ``F.rms_norm`` bit for
  bit; its gradients equal autograd's to rounding (fp64: 2e-16 relative).
- ``SwiGLUProduct`` saves the ``[gate | up]`` storage only (``2 f``) and recomputes ``silu(gate)`` in its
  backward, which then applies torch's own ``silu_backward`` (bit-identical gradients); with the down
  projection's input the MLP holds ``3 f`` (was ``4 f``: the SiLU output too).
- Attention copies ``v`` out of the fused q/k/v output (``LlamaAttention.project``), so no saved
  tensor is a view of it and its storage (``d + 2 k``) is freed: rotated q and k, v and the SDPA
  output, ``2 d + 2 k`` (was ``3 d + 3 k``). The prefix store of slices keeps ``2 k`` per layer.

Time: on a GPU these forms move no more bytes than the unfused ones: the recomputed ``x * rstd`` and SiLU
are elementwise work on tensors their backwards read anyway (as the fused kernels do), and each drops a
write and a read of a saved tensor (``d`` and ``f`` per token); the ``v`` copy reads and writes ``k`` per
token against the ``(d + 2 k)`` the q/k/v projection writes. Measured on CPU (not a GPU's figure;
``studies/shortdoc/lean_blocks_time.py``, one thread, paired and interleaved, median of the per-round
ratios, a loaded box): a block's forward + backward at 0.98-1.01 of the unfused time on ``llama-small``
(512 tokens, two runs), 0.96 at 2048 tokens, 1.06 on ``llama-tiny`` (512 tokens, 28 ms a block: the
three ``autograd.Function`` calls' Python overhead).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dynmb.core.config import ModelConfig
from dynmb.models.inputs import MicrobatchInputs

from dynmb.models.attention import CosSin, PositionTables, RoutedAttention
from dynmb.models.head import seed_head_rows_
from dynmb.models.pieces import WHOLE, PiecedBlock, chunk_width, store_key, whole_name
from dynmb.models.stage import DecoderStage

__all__ = ["LlamaStage", "LlamaBlock", "LlamaAttention", "SwiGLU", "RMSNorm", "LeanRMSNorm", "SwiGLUProduct",
           "position_tables", "rotate_half", "NORM_EPS"]

NORM_EPS = 1e-5
"""RMSNorm epsilon (the published Llama 2 and 3 configurations' ``rms_norm_eps``)."""


class LeanRMSNorm(torch.autograd.Function):
    """``x * rstd * g`` with ``rstd = 1 / sqrt(mean(x^2) + eps)`` over the last dimension, in fp32 (fp64 for a
    fp64 model; ``F.rms_norm``'s arithmetic, equal to it bit for bit), saving ``x`` and ``rstd`` only: the
    backward recomputes ``xhat = x * rstd`` (module docstring, "What the blocks save")."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd * weight).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        xhat = x.to(rstd.dtype) * rstd
        gf = grad.to(rstd.dtype)
        d_weight = None
        if ctx.needs_input_grad[1]:
            d_weight = (gf * xhat).reshape(-1, xhat.shape[-1]).sum(0).to(weight.dtype)
        d_xhat = gf * weight
        d_x = rstd * (d_xhat - xhat * (d_xhat * xhat).mean(-1, keepdim=True))
        return d_x.to(x.dtype), d_weight, None


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return LeanRMSNorm.apply(x, self.weight, NORM_EPS)


class SwiGLUProduct(torch.autograd.Function):
    """``silu(gate) * up`` of ``gate_up = [gate | up]``, saving ``gate_up`` only: the backward recomputes
    ``silu(gate)`` and applies torch's own SiLU backward, so its gradients equal autograd's through
    ``F.silu(gate) * up`` bit for bit (module docstring, "What the blocks save")."""

    @staticmethod
    def forward(ctx: Any, gate_up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        d_gate = torch.ops.aten.silu_backward(grad * up, gate)
        return torch.cat((d_gate, grad * F.silu(gate)), dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[a, b] -> [-b, a]`` on the two halves of the last dimension."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def position_tables(inputs: MicrobatchInputs, cfg: ModelConfig, dtype: torch.dtype) -> PositionTables:
    """Rotary cos/sin of ``inputs.position_ids`` in the layout of every attention call (module docstring)."""
    work = torch.promote_types(dtype, torch.float32)
    pos = inputs.position_ids
    half = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64, device=pos.device).to(work) / cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** half)

    def cos_sin(p: torch.Tensor) -> CosSin:
        ang = p.to(work)[..., None] * inv_freq
        emb = torch.cat((ang, ang), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    if inputs.buckets is None:
        return PositionTables(rows=cos_sin(pos))
    bk, flat = inputs.buckets, pos.reshape(-1)
    buckets: tuple[CosSin, ...] = ()
    if bk.shapes:
        parts = flat.index_select(0, bk.gather_index).split(bk.split_sizes())
        buckets = tuple(cos_sin(p.view(n, length)) for (n, length), p in zip(bk.shapes, parts))
    slices = tuple(cos_sin(flat.index_select(0, seg.index)) for seg in bk.slices)
    return PositionTables(buckets=buckets, slices=slices)


class LlamaAttention(RoutedAttention):
    """Grouped-query self-attention with rotary positions (module docstring); ``chunks``: the piece of
    it a stage holds (its K/V head group and the query heads reading it, ``dynmb.models.pieces``)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0, chunks: range = WHOLE) -> None:
        heads, kv_heads = chunk_width(cfg.n_heads, chunks), chunk_width(cfg.kv_heads, chunks)
        super().__init__(heads, kv_heads, cfg.head_dim, store_key(layer, chunks))
        q, kv = heads * cfg.head_dim, kv_heads * cfg.head_dim
        self._sizes = [q, kv, kv]
        self.qkv = nn.Linear(cfg.d_model, q + 2 * kv, bias=False)
        self.proj = nn.Linear(q, cfg.d_model, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv(x).split(self._sizes, dim=-1)
        lead = x.shape[:-1]
        return (q.view(*lead, self.n_heads, self.head_dim), k.view(*lead, self.n_kv_heads, self.head_dim),
                v.contiguous().view(*lead, self.n_kv_heads, self.head_dim))    # its own storage: qkv's is freed

    def output(self, y: torch.Tensor) -> torch.Tensor:
        return self.proj(y)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cs: CosSin) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cs[0].unsqueeze(-2), cs[1].unsqueeze(-2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class SwiGLU(nn.Module):
    """``down(silu(gate) * up)``; ``chunks``: the piece of its inner columns a stage holds."""

    def __init__(self, cfg: ModelConfig, chunks: range = WHOLE) -> None:
        super().__init__()
        f = chunk_width(cfg.d_ff, chunks)
        self.gate_up = nn.Linear(cfg.d_model, 2 * f, bias=False)
        self.down = nn.Linear(f, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(SwiGLUProduct.apply(self.gate_up(x)))


class LlamaBlock(PiecedBlock):
    """Pre-RMSNorm block; ``pos`` are the stage's rotary tables for this microbatch. ``pieces``: both
    halves, or one half or piece of one at a stage boundary inside the block (``dynmb.models.pieces``:
    the norm sits with chunk 0; a piece reads and sends ``[y | h]``)."""

    NORMS = {"attn": "attn_norm", "mlp": "mlp_norm"}

    def make_norm(self, d: int) -> nn.Module:
        return RMSNorm(d)

    def make_sublayer(self, cfg: ModelConfig, layer: int, part: str, chunks: range) -> nn.Module:
        return LlamaAttention(cfg, layer, chunks) if part == "attn" else SwiGLU(cfg, chunks)


class LlamaStage(DecoderStage):
    """Stage ``stage`` of ``num_stages`` of the Llama family (``dynmb.models.stage.DecoderStage``):
    ``embed`` on the first stage, ``norm_f`` on the head stage and the head's rows (``lm_head``, absent
    when tied, or a shard ``lm_head_<first row>``; ``DecoderStage.build_head``)."""

    def _build(self) -> None:
        cfg = self.cfg
        if cfg.tie_embeddings and self.num_stages > 1:
            raise ValueError(f"model {cfg.name!r}: tie_embeddings across {self.num_stages} pipeline stages needs an "
                             f"embedding-gradient all-reduce between the first and last stage, which dynmb's runtime "
                             f"does not run; use tie_embeddings=false (analytic models count the last stage's copy)")
        if self.is_first:
            self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleDict({str(i): LlamaBlock(cfg, i, pieces) for i, pieces in self.units})
        self.build_head(RMSNorm(cfg.d_model), tied=cfg.tie_embeddings)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.startswith("lm_head"):
                seed_head_rows_(p, seed, self.vocab, self.cfg.vocab_size, 0.02)
            else:
                whole = whole_name(name)
                resid = whole.endswith("attn.proj.weight") or whole.endswith("mlp.down.weight")
                self.seed_weight_(p, seed, name, resid_std if resid else 0.02)

    def embed_inputs(self, inputs: MicrobatchInputs) -> torch.Tensor:
        return self.embed(inputs.input_ids)

    def block_args(self, inputs: MicrobatchInputs) -> tuple[Any, ...]:
        dtype = next(self.parameters()).dtype
        return (position_tables(inputs, self.cfg, dtype),)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm_f(x)
        if self.cfg.tie_embeddings:
            return F.linear(h, self.embed.weight)      # not an nn.Linear: its gradient is eager under I/W
        return self.whole_head()(h)
