"""Self-attention on the path a microbatch names, shared by the model families.

``RoutedAttention`` is the attention sublayer (projection to q/k/v, optional position
rotation, attention, output projection) of every family; a family supplies ``project``
(``x -> q, k, v``, ``(..., L, heads, head_dim)``, k and v with ``n_kv_heads`` heads),
``output`` and, for rotary positions, ``rotate``. Grouped-query attention (fewer K/V heads)
runs natively: SDPA with ``enable_gqa`` (query head h uses K/V head ``h // (heads / kv_heads)``)
and ``dynmb.models.prefix.PrefixAttention`` on the compact K/V. The path is chosen once per
microbatch by ``dynmb.models.inputs.make_inputs`` (``MicrobatchInputs.attention``):

- ``causal`` (``auto``, one document per row): SDPA with ``is_causal=True`` and no mask tensor.
  A real query only sees keys at or before it, all real; pad outputs are ignored by the loss
  and get no gradient. Work ``b * s**2``.
- ``document`` (``auto``, packed rows): bucketed document-causal attention. ``make_inputs``
  sorts the documents by length and groups them (``bucket_documents``: from one bucket per
  distinct length, merge the two neighbouring buckets that add the fewest pad tokens while
  they stay within ``BUCKET_PADDING`` (1/16) of the real tokens); a bucket of n documents of at
  most L tokens is an (n, L) batch, each document padded on the right. The sublayer runs per
  bucket on the normed input gathered by one ``index_select`` (``DocumentBuckets.gather_index``);
  one ``index_select`` over the bucket outputs plus a zero row (``scatter_index``) puts the
  result back in the (b, s) layout, zeros at pads. Work ``sum(n_j * L_j**2)``: the sum of
  s_i**2 plus the bucket padding. Bucket pad slots copy their document's last token, sit after
  it (causal) and get an exactly zero gradient, so the result is exact. Measured
  (``benchmarks/bench_attention.py``: torch 2.13 CPU, 1 thread, ``small`` preset, forward +
  backward, median of 5, stage 0 of 2 / whole model): a 4096-token row of 64 documents of 64
  runs at 0.80x / 1.07x the tokens/s of 64 rows of 64 (the dense mask: 0.22x / 0.31x); one
  SDPA call per document ran at 0.90-0.98x the bucketed path on rows of 4, 16 and 64
  documents, so the buckets stay.
- ``dense``: one boolean ``(b, 1, s, s)`` mask (query i sees key j iff same document and
  j <= i; the diagonal is always on), built only in this mode. A mask skips no work in SDPA:
  ``b * s**2`` for every layout. Kept as an ablation and as a reference for the tests.

Slices of long sequences (``Microbatch.offsets``/``continued``) run on the ``document`` path:
each slice segment's sublayer runs on its own tokens with ``PrefixAttention`` over the keys and
values its earlier slices kept at that layer (``MicrobatchInputs.prefix``); a continued slice
keeps its own (after rotation: the store holds post-rotary keys, with ``n_kv_heads`` heads).

No FlexAttention: the bucketed path runs unchanged on CUDA (its index tensors move with
``MicrobatchInputs.to``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dynmb.models.inputs import InputError, MicrobatchInputs, SliceSegment
from dynmb.models.prefix import prefix_attention

__all__ = ["RoutedAttention", "PositionTables", "CosSin"]

CosSin = tuple[torch.Tensor, torch.Tensor]
"""Rotary ``(cos, sin)``, each ``(..., L, head_dim)`` matching the tokens they rotate."""


@dataclass(frozen=True, eq=False)
class PositionTables:
    """Per-microbatch rotary tables in the layout of each attention call (computed once per
    stage forward and shared by its blocks): ``rows`` for the causal and dense paths
    ``(b, s, head_dim)``; ``buckets[j]`` ``(n_j, L_j, head_dim)``; ``slices[k]`` ``(n_k, head_dim)``."""

    rows: CosSin | None = None
    buckets: tuple[CosSin, ...] = ()
    slices: tuple[CosSin, ...] = ()

    def tensors(self) -> list[torch.Tensor]:
        out = [] if self.rows is None else list(self.rows)
        for cs in (*self.buckets, *self.slices):
            out += list(cs)
        return out


class RoutedAttention(nn.Module):
    """Attention sublayer; subclasses define ``project``, ``output`` and optionally ``rotate``."""

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, layer: float) -> None:
        """``layer``: the key of its keys and values in the prefix store (the layer index; a piece of a half:
        ``dynmb.models.pieces.store_key``)."""
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.layer = n_heads, n_kv_heads, head_dim, layer

    # --- family hooks ---------------------------------------------------------
    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(..., L, d)`` -> q ``(..., L, heads, hd)``, k, v ``(..., L, kv_heads, hd)``."""
        raise NotImplementedError

    def output(self, y: torch.Tensor) -> torch.Tensor:
        """``(..., heads * hd)`` -> ``(..., d)``."""
        raise NotImplementedError

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cs: CosSin) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary positions on q, k ``(..., L, heads, hd)`` with cos/sin ``(..., L, hd)``."""
        raise NotImplementedError(f"{type(self).__name__} has no rotary positions")

    # --- routing ----------------------------------------------------------------
    def forward(self, x: torch.Tensor, inputs: MicrobatchInputs, pos: PositionTables | None = None) -> torch.Tensor:
        if inputs.buckets is not None:
            return self._bucketed(x, inputs, pos)
        b, s, _ = x.shape
        y = self._attend(x, inputs.attn_mask, None if pos is None else pos.rows)
        return self.output(y.reshape(b, s, -1))

    def _qkv(self, x: torch.Tensor, cs: CosSin | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.project(x)
        if cs is not None:
            q, k = self.rotate(q, k, cs)
        return q, k, v

    def _attend(self, x: torch.Tensor, mask: torch.Tensor | None, cs: CosSin | None) -> torch.Tensor:
        """``(n, L, d)`` -> SDPA output ``(n, L, heads, head_dim)``: causal without a mask."""
        q, k, v = (t.transpose(1, 2) for t in self._qkv(x, cs))
        gqa: dict[str, Any] = {"enable_gqa": True} if self.n_kv_heads != self.n_heads else {}
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)
        return y.transpose(1, 2)

    def _bucketed(self, x: torch.Tensor, inputs: MicrobatchInputs, pos: PositionTables | None) -> torch.Tensor:
        """Document-causal attention: gather the documents into length buckets, run the
        sublayer per bucket and per slice segment, scatter back (zeros at pads)."""
        buckets = inputs.buckets
        assert buckets is not None
        b, s, d = x.shape
        flat = x.reshape(b * s, d)
        outs = []
        if buckets.shapes:
            gathered = flat.index_select(0, buckets.gather_index)
            for j, ((n, length), part) in enumerate(zip(buckets.shapes, gathered.split(buckets.split_sizes()))):
                y = self._attend(part.view(n, length, d), None, None if pos is None else pos.buckets[j])
                outs.append(self.output(y.reshape(n * length, -1)))
        for j, seg in enumerate(buckets.slices):
            outs.append(self._slice(flat.index_select(0, seg.index), seg, inputs, None if pos is None else pos.slices[j]))
        outs.append(x.new_zeros(1, d))
        return torch.cat(outs).index_select(0, buckets.scatter_index).view(b, s, d)

    def _slice(self, x: torch.Tensor, seg: SliceSegment, inputs: MicrobatchInputs, cs: CosSin | None) -> torch.Tensor:
        """``(n, d)`` tokens of one slice -> the sublayer's output, attending to the keys and
        values earlier slices kept in ``inputs.prefix`` (``dynmb.models.prefix``)."""
        store = inputs.prefix
        if store is None:
            raise InputError(f"microbatch {inputs.microbatch} holds a slice of sequence {seg.seq_id} but runs "
                             f"without a PrefixStore (MicrobatchInputs.prefix)")
        n = x.shape[0]
        q, k, v = (t.transpose(0, 1) for t in self._qkv(x, cs))
        pk, pv = store.prefix(self.layer, seg.seq_id, seg.offset, inputs.microbatch)
        y = prefix_attention(q, k, v, pk, pv)
        if seg.continued:
            store.keep(self.layer, seg.seq_id, seg.offset, k, v, inputs.microbatch)
        return self.output(y.transpose(0, 1).reshape(n, -1))
