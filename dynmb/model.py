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

Loss: the last stage returns the SUM of per-token cross-entropy over real tokens;
the caller divides by the real tokens of the whole global batch, so the gradient
does not depend on how sequences are grouped into microbatches.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dynmb.config import ModelConfig
from dynmb.memory import BUCKET_PADDING
from dynmb.types import Microbatch, Plan

__all__ = [
    "GPT", "GPTStage", "Block", "MicrobatchInputs", "DocumentBuckets", "InputError", "build_stage", "build_stages",
    "synthetic_tokens", "full_microbatch", "make_inputs", "attention_mask", "bucket_documents", "hidden_shape",
    "torch_dtype", "global_named_parameters", "count_params", "reference_grads", "IGNORE_INDEX", "INPUT_ATTENTION",
    "RecomputedBlock",
]

IGNORE_INDEX = -100
"""Label of pad positions (``F.cross_entropy``'s ignore_index)."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class InputError(ValueError):
    """A microbatch cannot be turned into model inputs (row overflow, too long, bad tokens)."""


def torch_dtype(cfg: ModelConfig) -> torch.dtype:
    """The torch dtype of ``cfg.dtype`` (parameters and the hidden states sent between stages)."""
    return _DTYPES[cfg.dtype]


def hidden_shape(mb: Microbatch, cfg: ModelConfig) -> tuple[int, int, int]:
    """Shape of the hidden state a stage sends for ``mb``: ``(batch, padded_len, d_model)``."""
    return (mb.batch, mb.padded_len, cfg.d_model)


# --- data --------------------------------------------------------------------
def synthetic_tokens(lengths: Sequence[int] | np.ndarray, vocab_size: int, seed: int = 0) -> list[torch.Tensor]:
    """Random token ids: sequence i gets ``lengths[i] + 1`` int64 ids (inputs ``t[:-1]``,
    labels ``t[1:]``), drawn from a generator seeded by ``(seed, i)`` so it depends only
    on the seed, its index and its length."""
    out = []
    for i, n in enumerate(np.asarray(lengths, dtype=np.int64).reshape(-1)):
        if n < 1:
            raise InputError(f"sequence {i} has non-positive length {int(n)}")
        rng = np.random.default_rng([int(seed), i])
        out.append(torch.from_numpy(rng.integers(0, vocab_size, size=int(n) + 1, dtype=np.int64)))
    return out


def full_microbatch(rows: int, padded_len: int, docs_per_row: int = 1) -> Microbatch:
    """A microbatch with no padding: ``rows`` rows, each ``docs_per_row`` documents that
    split ``padded_len`` as evenly as possible (for profiling a (rows, padded_len) shape)."""
    if not 1 <= docs_per_row <= padded_len:
        raise InputError(f"docs_per_row must lie in [1, padded_len={padded_len}], got {docs_per_row}")
    base, extra = divmod(padded_len, docs_per_row)
    per_row = np.array([base + 1] * extra + [base] * (docs_per_row - extra), dtype=np.int64)
    return Microbatch(seq_ids=np.arange(rows * docs_per_row), lengths=np.tile(per_row, rows), padded_len=padded_len,
                      batch=rows, row_ids=np.repeat(np.arange(rows), docs_per_row))


@dataclass(frozen=True, eq=False)
class DocumentBuckets:
    """Where the documents of a packed microbatch go for bucketed attention.

    Bucket j holds ``shapes[j] = (n, L)``: n documents, each padded on the right to L
    tokens; the buckets lie back to back in one ``(bucket_tokens, d)`` tensor.
    ``gather_index[t]`` is the flat position (``row * padded_len + col``) that bucket
    slot t copies (a pad slot copies its document's last token); ``scatter_index[p]`` is
    the bucket slot of flat position p, or ``bucket_tokens`` (a zero row) at pads.
    """

    gather_index: torch.Tensor
    scatter_index: torch.Tensor
    shapes: tuple[tuple[int, int], ...]

    @property
    def bucket_tokens(self) -> int:
        return int(self.gather_index.numel())

    def split_sizes(self) -> list[int]:
        return [n * length for n, length in self.shapes]

    def to(self, device: torch.device | str) -> "DocumentBuckets":
        return replace(self, gather_index=self.gather_index.to(device, non_blocking=True),
                       scatter_index=self.scatter_index.to(device, non_blocking=True))


@dataclass(frozen=True, eq=False)
class MicrobatchInputs:
    """Model inputs of one microbatch; every tensor is ``(batch, padded_len)`` except the mask.

    ``labels`` hold ``IGNORE_INDEX`` and ``doc_ids`` hold -1 at pad positions.
    ``attention`` is the microbatch's attention path: ``causal`` (auto, one document
    per row), ``document`` (auto, packed rows: ``buckets`` is set) or ``dense``
    (``attn_mask`` is set, ``(batch, 1, padded_len, padded_len)`` bool, True = may attend).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor
    loss_mask: torch.Tensor
    num_real_tokens: int
    max_doc_len: int
    attention: str = "causal"
    attn_mask: torch.Tensor | None = None
    buckets: DocumentBuckets | None = None

    def __post_init__(self) -> None:
        if self.attention not in INPUT_ATTENTION:
            raise ValueError(f"unknown attention path {self.attention!r}; expected one of {INPUT_ATTENTION}")
        if (self.attn_mask is not None) != (self.attention == "dense"):
            raise ValueError("attn_mask must be given exactly for the dense path")
        if (self.buckets is not None) != (self.attention == "document"):
            raise ValueError("buckets must be given exactly for the document path")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the inputs hold (the mask and bucket indices included)."""
        out = [getattr(self, n) for n in _ROW_TENSORS]
        out += [] if self.attn_mask is None else [self.attn_mask]
        out += [] if self.buckets is None else [self.buckets.gather_index, self.buckets.scatter_index]
        return out

    def to(self, device: torch.device | str) -> "MicrobatchInputs":
        """A copy on ``device`` (a dense mask is rebuilt there from ``doc_ids``, not copied)."""
        moved = {n: getattr(self, n).to(device, non_blocking=True) for n in _ROW_TENSORS}
        mask = None if self.attn_mask is None else attention_mask(moved["doc_ids"])
        buckets = None if self.buckets is None else self.buckets.to(device)
        return replace(self, **moved, attn_mask=mask, buckets=buckets)


INPUT_ATTENTION = ("causal", "document", "dense")
"""``MicrobatchInputs.attention``: the path a microbatch runs (see the module docstring)."""
_ROW_TENSORS = ("input_ids", "labels", "position_ids", "doc_ids", "loss_mask")


def attention_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """``(batch, 1, s, s)`` bool: query i sees key j iff same document (>= 0) and j <= i;
    the diagonal is always True so pad rows stay finite."""
    b, s = doc_ids.shape
    m = doc_ids[:, :, None] == doc_ids[:, None, :]
    m &= torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril_()
    m &= (doc_ids >= 0)[:, None, :]
    m.diagonal(dim1=1, dim2=2).fill_(True)
    return m[:, None]


def bucket_documents(lengths: Sequence[int] | np.ndarray, max_padding: float = BUCKET_PADDING
                     ) -> tuple[np.ndarray, np.ndarray]:
    """``(bucket of each document, length of each bucket)``, buckets shortest first.

    Greedy: one bucket per distinct length (no padding), then repeatedly merge the two
    neighbouring buckets whose merge adds the fewest pad tokens (the shorter bucket's
    documents padded to the longer's length) while the pad tokens stay within
    ``max_padding * sum(lengths)``. Fewer buckets mean fewer, larger SDPA calls; the
    budget bounds the extra tokens (memory) and the extra work.
    """
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    distinct, which, counts = np.unique(lengths, return_inverse=True, return_counts=True)
    budget, used = max_padding * float(lengths.sum()), 0
    top, docs, first = distinct.copy(), counts.copy(), np.arange(len(distinct))
    while len(top) > 1:
        added = docs[:-1] * (top[1:] - top[:-1])     # pad tokens of merging bucket j into j + 1
        j = int(added.argmin())
        if used + added[j] > budget:
            break
        used += int(added[j])
        docs[j + 1] += docs[j]
        first[j + 1] = first[j]
        top, docs, first = np.delete(top, j), np.delete(docs, j), np.delete(first, j)
    bucket_of_distinct = np.searchsorted(first, np.arange(len(distinct)), side="right") - 1
    return bucket_of_distinct[which.reshape(-1)], top


def _document_buckets(lens: np.ndarray, doc_start: np.ndarray, seg: np.ndarray, pos: np.ndarray,
                      flat: np.ndarray, num_positions: int) -> DocumentBuckets:
    """Index tensors of ``bucket_documents(lens)`` for documents beginning at flat
    positions ``doc_start``; ``seg``/``pos``/``flat``: document, position inside it and
    flat position of every real token."""
    bucket, top = bucket_documents(lens)
    by_bucket = np.argsort(bucket, kind="stable")              # documents in slot order
    slot_len = top[bucket[by_bucket]]                          # padded length of each, in that order
    doc_offset = np.empty(len(lens), dtype=np.int64)           # first bucket slot of each document
    doc_offset[by_bucket] = np.cumsum(slot_len) - slot_len
    slot_doc = np.repeat(by_bucket, slot_len)
    slot_pos = np.arange(int(slot_len.sum())) - doc_offset[slot_doc]
    gather = doc_start[slot_doc] + np.minimum(slot_pos, lens[slot_doc] - 1)
    scatter = np.full(num_positions, len(gather), dtype=np.int64)
    scatter[flat] = doc_offset[seg] + pos
    shapes = tuple((int(n), int(length)) for n, length in zip(np.bincount(bucket, minlength=len(top)), top))
    return DocumentBuckets(torch.from_numpy(gather), torch.from_numpy(scatter), shapes)


def make_inputs(mb: Microbatch, tokens: Sequence[torch.Tensor | np.ndarray], *, cfg: ModelConfig | None = None,
                device: torch.device | str | None = None) -> MicrobatchInputs:
    """Lay out ``mb``'s sequences in ``mb.batch`` rows of ``mb.padded_len`` tokens.

    ``tokens[seq_id]`` holds at least ``length + 1`` ids (see ``synthetic_tokens``; a
    truncated sequence uses its first ``length + 1``). Sequences sharing a row are
    concatenated in order and the row is padded on the right. With ``cfg`` the
    lengths are checked against ``cfg.max_seq_len`` and the ids against the vocabulary,
    and ``cfg.attention`` picks the attention path (``auto`` without ``cfg``): the dense
    mask is built only for ``dense``, the bucket indices only for packed rows under ``auto``.
    Vectorised: one Python step per sequence, none per token.
    """
    b, s = mb.batch, mb.padded_len
    lens_all = mb.lengths
    if cfg is not None and lens_all.max() > cfg.max_seq_len:
        bad = mb.seq_ids[lens_all > cfg.max_seq_len]
        raise InputError(f"sequences {bad[:10].tolist()} are longer than max_seq_len {cfg.max_seq_len} "
                         f"(lengths {lens_all[lens_all > cfg.max_seq_len][:10].tolist()})")
    row_len = np.bincount(mb.row_ids, weights=lens_all, minlength=b).astype(np.int64)
    if row_len.max() > s:
        r = int(row_len.argmax())
        raise InputError(f"row {r} holds {int(row_len[r])} tokens (sequences "
                         f"{mb.seq_ids[mb.row_ids == r].tolist()}) > padded_len {s}")
    order = np.argsort(mb.row_ids, kind="stable")        # sequences grouped by row, in order
    rows, lens = mb.row_ids[order], lens_all[order]
    chunks = []
    for k in order:
        sid, n = int(mb.seq_ids[k]), int(lens_all[k])
        if sid >= len(tokens):
            raise InputError(f"sequence {sid} has no tokens ({len(tokens)} given)")
        t = torch.as_tensor(tokens[sid], dtype=torch.int64).reshape(-1)
        if t.numel() < n + 1:
            raise InputError(f"sequence {sid} has {t.numel()} tokens, needs length + 1 = {n + 1}")
        chunks.append(t[: n + 1])
    stream = torch.cat(chunks)                            # each sequence's n + 1 ids back to back
    if cfg is not None and (stream.min() < 0 or stream.max() >= cfg.vocab_size):
        raise InputError(f"token ids must lie in [0, {cfg.vocab_size}), got [{int(stream.min())}, {int(stream.max())}]")

    start = np.cumsum(lens) - lens                        # start of each sequence among real tokens
    first_in_row = np.searchsorted(rows, rows, side="left")
    doc_start = rows * s + start - start[first_in_row]    # flat position where each sequence begins
    seg = np.repeat(np.arange(len(order)), lens)          # sequence (in `order`) of each real token
    pos = np.arange(int(lens.sum())) - start[seg]         # position inside its document
    flat = doc_start[seg] + pos
    src = torch.from_numpy((start + np.arange(len(order)))[seg] + pos)  # index into `stream`

    def fill(value: int, data: torch.Tensor) -> torch.Tensor:
        out = torch.full((b * s,), value, dtype=torch.int64)
        out[torch.from_numpy(flat)] = data
        return out.view(b, s)

    t = dict(input_ids=fill(0, stream[src]), labels=fill(IGNORE_INDEX, stream[src + 1]),
             position_ids=fill(0, torch.from_numpy(pos)), doc_ids=fill(-1, torch.from_numpy(order[seg])))
    mode = "auto" if cfg is None else cfg.attention
    path = "dense" if mode == "dense" else "document" if mb.is_packed else "causal"
    buckets = _document_buckets(lens, doc_start, seg, pos, flat, b * s) if path == "document" else None
    if device is not None:
        t = {k: v.to(device) for k, v in t.items()}
        buckets = None if buckets is None else buckets.to(device)
    return MicrobatchInputs(**t, loss_mask=t["doc_ids"] >= 0, num_real_tokens=int(lens.sum()),
                            max_doc_len=int(lens.max()), attention=path, buckets=buckets,
                            attn_mask=attention_mask(t["doc_ids"]) if path == "dense" else None)


# --- model -------------------------------------------------------------------
class Attention(nn.Module):
    """Multi-head self-attention on the path ``inputs.attention`` names (module docstring)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, inputs: MicrobatchInputs) -> torch.Tensor:
        if inputs.buckets is not None:
            return self._bucketed(x, inputs.buckets)
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

    def _bucketed(self, x: torch.Tensor, buckets: DocumentBuckets) -> torch.Tensor:
        """Document-causal attention: gather the documents into length buckets, run the
        sublayer per bucket, scatter back (zeros at pads)."""
        b, s, d = x.shape
        gathered = x.reshape(b * s, d).index_select(0, buckets.gather_index)
        outs = [self.proj(self._attend(part.view(n, length, d), None).reshape(n * length, d))
                for (n, length), part in zip(buckets.shapes, gathered.split(buckets.split_sizes()))]
        outs.append(x.new_zeros(1, d))
        return torch.cat(outs).index_select(0, buckets.scatter_index).view(b, s, d)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LN transformer block."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.d_model), Attention(cfg)
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
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in self.layers})
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
        """``recompute``: full activation recomputation per block (see ``RecomputedBlock``)."""
        if self.is_first:
            if inputs.max_doc_len > self.cfg.max_seq_len:
                raise InputError(f"a document of {inputs.max_doc_len} tokens exceeds max_seq_len {self.cfg.max_seq_len}")
            x = self.embed(inputs.input_ids) + self.pos(inputs.position_ids)
        elif x is None:
            raise ValueError(f"stage {self.stage} needs the hidden state from stage {self.stage - 1}")
        for blk in self.blocks.values():
            x = RecomputedBlock.apply(x, blk, inputs) if recompute and torch.is_grad_enabled() else blk(x, inputs)
        if not self.is_last:
            return x
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


def reference_grads(cfg: ModelConfig, num_stages: int, plan: Plan, tokens: Sequence[torch.Tensor], seed: int = 0, *,
                    dtype: torch.dtype | None = None, device: torch.device | str | None = None
                    ) -> tuple[float, dict[str, torch.Tensor]]:
    """Single-process reference for one step: every microbatch of ``plan`` (all replicas)
    runs through the composed stages; returns the token-weighted loss
    (sum CE / real tokens of the global batch) and ``{global name: grad}``."""
    stages = build_stages(cfg, num_stages, seed, dtype=dtype, device=device)
    total = plan.real_tokens
    loss_sum = 0.0
    for mb in plan.microbatches:
        inputs = make_inputs(mb, tokens, cfg=cfg, device=device)
        x = None
        for st in stages:
            x = st(x, inputs)
        (x / total).backward()
        loss_sum += float(x.detach())
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
             for st in stages for n, p in st.named_parameters()}
    return loss_sum / total, grads
