"""Pieces of a half-block: a pipeline-stage boundary inside an attention or MLP half.

``ModelConfig.layer_split`` on the 1/16-layer grid (``dynmb.core.model_sizes``) cuts a half-block into
``SUB_CHUNKS`` (8) chunks; ``cfg.stage_pieces(P)[s]`` lists the ``HalfPiece(layer, part, chunks)`` stage
``s`` holds. Chunks ``[c0, c1)`` of an attention half are the K/V heads ``[kv c0/8, kv c1/8)`` and the
query heads that read them, ``[H c0/8, H c1/8)``: the piece's rows of ``qkv`` (in each of the q, k and v
segments) and columns of the output projection; of an MLP half the inner columns ``[f c0/8, f c1/8)``:
rows of ``gate_up`` (in the gate and the up segment) and columns of ``down`` (Llama), rows of ``fc`` and
its bias and columns of ``proj`` (gpt2). An output bias (gpt2's ``attn.proj.bias``, ``mlp.proj.bias``)
and the half's norm belong to the piece holding chunk 0.

The message (``run_half``): a piece that holds chunk 0 reads the residual stream ``x`` and computes
``h = norm(x)``; a later piece reads ``[y | h]`` (``2 d`` channels, ``cfg.message_channels``). Each adds
its partial output, ``y = y + sub(h)`` (the partial sums of a row-parallel matmul); a piece ending
before chunk 8 sends ``[y | h]`` on, the one ending the half sends ``y`` alone. Autograd through the
message is exact: its gradient carries d/dy and d/dh, and d/dh reaches the norm on the chunk-0 stage.

Names (``piece_name``): a whole half keeps its module name (``blocks.3.mlp.gate_up.weight``); a piece is
named by its first chunk, ``blocks.3.mlp_c4.gate_up.weight`` (``mlp_c0`` for a piece from chunk 0 that
does not end the half), so names are unique across the stages. The prefix store of sliced sequences
(``dynmb.models.prefix``) keys a piece's keys and values by ``store_key``: the layer, plus ``c0 / 8`` for a piece
starting at chunk ``c0 > 0`` (only its K/V heads are kept).

Initial values (``seed_weight_``): a piece's weight is its slice of the whole weight seeded by
``(seed, whole name)`` (``dynmb.models.seeding``), so every split holds the whole model's values.
``full_weights`` joins the pieces of ``{global name: tensor}`` (weights or gradients of every stage)
back into the whole model's names and shapes (the LM head's shards too: ``head.full_head_weight``).
"""

from __future__ import annotations

import re
from typing import Callable, Mapping

import torch
from torch import nn

from dynmb.core.config import ModelConfig
from dynmb.models.inputs import MicrobatchInputs
from dynmb.core.model_sizes import SUB_CHUNKS, HalfPiece

from dynmb.models.attention import PositionTables
from dynmb.models.head import full_head_weight, head_name
from dynmb.models.seeding import fill_normal_, param_seed

__all__ = ["PiecedBlock", "WHOLE", "piece_name", "store_key", "chunk_width", "cut", "piece_cutter", "seed_weight_", "whole_name", "full_weights", "run_half",
           "CUT_AXIS"]

WHOLE = range(SUB_CHUNKS)
"""The chunks of a whole half-block."""

CUT_AXIS = {("attn", "qkv"): 0, ("attn", "proj"): 1, ("mlp", "gate_up"): 0, ("mlp", "down"): 1,
            ("mlp", "fc"): 0, ("mlp", "proj"): 1}
"""The weight axis along which each Linear of a half is cut into chunks (0: output rows; 1: input
columns, whose bias is not cut and sits with chunk 0)."""

_PIECE = re.compile(r"^blocks\.(\d+)\.(attn|mlp)_c(\d+)\.(\w+)\.(weight|bias)$")


def piece_name(part: str, chunks: range) -> str:
    """The module name of a half's piece in its block: ``attn``/``mlp`` when whole, else ``<part>_c<first chunk>``."""
    return part if len(chunks) == SUB_CHUNKS else f"{part}_c{chunks.start}"


def store_key(layer: int, chunks: range) -> int | float:
    """The prefix-store key of an attention piece's keys and values (module docstring)."""
    return layer if chunks.start == 0 else layer + chunks.start / SUB_CHUNKS


def _segments(cfg: ModelConfig, part: str, linear: str) -> list[int]:
    """Widths of the segments of the cut dimension of a whole Linear, each cut into ``SUB_CHUNKS`` equal chunks."""
    if part == "attn":
        q, kv = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        return [q, kv, kv] if linear == "qkv" else [q]
    return [cfg.d_ff, cfg.d_ff] if linear == "gate_up" else [cfg.d_ff]


def chunk_width(width: int, chunks: range) -> int:
    """Rows (or columns) of a segment of ``width`` that chunks ``chunks`` hold."""
    return width * chunks.stop // SUB_CHUNKS - width * chunks.start // SUB_CHUNKS


def cut(whole: torch.Tensor, cfg: ModelConfig, part: str, linear: str, chunks: range) -> torch.Tensor:
    """The piece ``chunks`` of a whole Linear's weight or cut bias (a 1-D bias of a row-cut Linear)."""
    axis = CUT_AXIS[(part, linear)] if whole.dim() == 2 else 0
    out, at = [], 0
    for w in _segments(cfg, part, linear):
        lo, hi = w * chunks.start // SUB_CHUNKS, w * chunks.stop // SUB_CHUNKS
        out.append(whole.narrow(axis, at + lo, hi - lo))
        at += w
    return torch.cat(out, dim=axis)


def _join(pieces: list[tuple[range, torch.Tensor]], cfg: ModelConfig, part: str, linear: str) -> torch.Tensor:
    """The whole tensor from its pieces (``cut``'s inverse), ``pieces`` in chunk order."""
    axis = CUT_AXIS[(part, linear)] if pieces[0][1].dim() == 2 else 0
    segs = _segments(cfg, part, linear)
    split = [t.split([chunk_width(w, c) for w in segs], dim=axis) for c, t in pieces]
    return torch.cat([t for j in range(len(segs)) for t in (s[j] for s in split)], dim=axis)


def whole_name(name: str) -> str:
    """The whole model's name of a (piece) parameter: ``blocks.3.mlp_c4.down.weight`` -> ``blocks.3.mlp.down.weight``."""
    m = _PIECE.match(name)
    return name if m is None else f"blocks.{m[1]}.{m[2]}.{m[4]}.{m[5]}"


def piece_cutter(name: str, cfg: ModelConfig,
                 chunks_of: Callable[[int, str], range]) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """How parameter ``name``'s values come out of the whole model's ``whole_name(name)``: ``cut`` for a
    piece, None when it is the whole tensor (a whole half, or a piece's uncut output bias)."""
    m = _PIECE.match(name)
    if m is None or (CUT_AXIS[(m[2], m[4])] == 1 and m[5] == "bias"):
        return None
    layer, part, linear = int(m[1]), m[2], m[4]
    return lambda whole: cut(whole, cfg, part, linear, chunks_of(layer, part))


@torch.no_grad()
def seed_weight_(p: torch.Tensor, seed: int, name: str, std: float, cfg: ModelConfig,
                 chunks_of: Callable[[int, str], range]) -> None:
    """Fill ``p`` (parameter ``name``) with N(0, std) of generator ``(seed, whole name)``: a whole parameter
    drawn as it is (``seeding.seeded_normal_``), a piece's as its slice of the whole draw; ``chunks_of(layer,
    part)`` gives the piece's chunks."""
    m = _PIECE.match(name)
    g = torch.Generator().manual_seed(param_seed(seed, whole_name(name)))
    if m is None:
        fill_normal_(p, g, std)
        return
    layer, part, linear = int(m[1]), m[2], m[4]
    width = sum(_segments(cfg, part, linear))
    axis = CUT_AXIS[(part, linear)] if p.dim() == 2 else 0
    shape = (width,) if p.dim() == 1 else ((width, cfg.d_model) if axis == 0 else (cfg.d_model, width))
    whole = torch.randn(shape, generator=g, dtype=torch.float32) * std
    p.copy_(cut(whole, cfg, part, linear, chunks_of(layer, part)))


def full_weights(named: Mapping[str, torch.Tensor], cfg: ModelConfig, num_stages: int) -> dict[str, torch.Tensor]:
    """``{whole-model name: tensor}`` from ``{global name: tensor}`` of all ``num_stages`` stages (weights or
    gradients): every half's pieces joined in chunk order, the LM head's shards joined (module docstring)."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, list[tuple[range, torch.Tensor]]] = {}
    starts = {(pc.layer, pc.part, pc.chunks.start): pc.chunks for pieces in cfg.stage_pieces(num_stages)
              for pc in pieces}
    shards = {f"{head_name(r, cfg.vocab_size)}.weight" for r in cfg.stage_vocab(num_stages) if len(r)}
    for name, t in named.items():
        m = _PIECE.match(name)
        if m is None:
            if name not in shards or name == "lm_head.weight":
                out[name] = t
            continue
        key = whole_name(name)
        if CUT_AXIS[(m[2], m[4])] == 1 and m[5] == "bias":      # an output bias: chunk 0's alone
            out[key] = t
            continue
        groups.setdefault(key, []).append((starts[(int(m[1]), m[2], int(m[3]))], t))
    for key, pieces in groups.items():
        _, layer, part, linear, _ = key.split(".")
        pieces.sort(key=lambda x: x[0].start)
        if [c for r, _ in pieces for c in r] != list(WHOLE):
            raise ValueError(f"full_weights: {key} has the chunks {[list(r) for r, _ in pieces]} of {SUB_CHUNKS} only")
        out[key] = _join(pieces, cfg, part, linear)
    if "lm_head.weight" not in out and shards and all(s in named for s in shards):
        out["lm_head.weight"] = full_head_weight(named, cfg, num_stages)
    return out


def run_half(x: torch.Tensor, chunks: range, norm: Callable[[torch.Tensor], torch.Tensor] | None,
             sub: Callable[[torch.Tensor], torch.Tensor], d: int) -> torch.Tensor:
    """One half-block or piece of one on the running tensor ``x`` (module docstring): ``x + sub(norm(x))``
    for a whole half; a piece reads ``x`` (from chunk 0, through ``norm``) or ``[y | h]`` and returns ``y``
    (ending the half) or ``[y | h]``."""
    if chunks.start == 0:
        assert norm is not None
        y, h = x, norm(x)
    else:
        y, h = x[..., :d], x[..., d:]
    y = y + sub(h)
    return y if chunks.stop == SUB_CHUNKS else torch.cat([y, h], dim=-1)


class PiecedBlock(nn.Module):
    """A pre-norm block of a family, built from the pieces a stage holds (both halves whole by default): the
    half's norm (named ``NORMS[part]``) with the piece holding chunk 0, each piece's sublayer named
    ``piece_name``, run in order by ``run_half``. A family gives ``NORMS``, ``make_norm`` and ``make_sublayer``
    (attention called ``sub(h, inputs, pos)``, the MLP ``sub(h)``)."""

    NORMS: dict[str, str]

    def __init__(self, cfg: ModelConfig, layer: int = 0, pieces: tuple[HalfPiece, ...] | None = None) -> None:
        super().__init__()
        self.pieces = pieces or (HalfPiece(layer, "attn", WHOLE), HalfPiece(layer, "mlp", WHOLE))
        self.parts = tuple(pc.part for pc in self.pieces)
        self.d = cfg.d_model
        for pc in self.pieces:
            if pc.chunks.start == 0:
                self.add_module(self.NORMS[pc.part], self.make_norm(cfg.d_model))
            self.add_module(piece_name(pc.part, pc.chunks), self.make_sublayer(cfg, layer, pc.part, pc.chunks))

    def make_norm(self, d: int) -> nn.Module:
        raise NotImplementedError

    def make_sublayer(self, cfg: ModelConfig, layer: int, part: str, chunks: range) -> nn.Module:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, inputs: MicrobatchInputs, pos: PositionTables | None = None) -> torch.Tensor:
        for pc in self.pieces:
            norm, sub = getattr(self, self.NORMS[pc.part], None), getattr(self, piece_name(pc.part, pc.chunks))
            fn = (lambda h, sub=sub: sub(h, inputs, pos)) if pc.part == "attn" else sub
            x = run_half(x, pc.chunks, norm, fn, self.d)
        return x
