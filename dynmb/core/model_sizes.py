"""Analytic sizes of a ``dynmb.core.config.ModelConfig`` per model family: parameters, FLOPs, message bytes.

``ModelSizes`` is a mixin of ``ModelConfig`` (it reads the config's fields through ``self`` and
imports nothing from dynmb): ``block_params``, ``stage_params``, ``param_count``, ``message_bytes``
and ``stage_flops``, counted per half-block (``half_params``, ``half_flops``: a pre-norm block is the
attention sub-block ``x + attn(norm1(x))`` then the MLP sub-block ``x + mlp(norm2(x))``, each with
its own norm), and the split of the layers into stages (``stage_units``, ``stage_pieces``, ``stage_parts``,
``stage_blocks``; ``normalise_layer_split``) in units of 1/16 layer: each half-block is cut into
``SUB_CHUNKS`` (8) equal chunks, unit ``u`` is chunk ``u % 8`` of layer ``u // 16``'s attention half
(``(u // 8) % 2 == 0``) or MLP half. An attention chunk is 1/8 of the K/V heads (and the query heads
that read them), an MLP chunk 1/8 of the inner columns (gate, up rows; down columns). A ``layer_split``
of whole layers (``(9, 8, 8, 7)``), of half layers (``(2.5, 2, 2, 1.5)``: the first stage ends after
layer 2's attention half, the second starts with its MLP half) or on the 1/16 grid (``(2.75, 1.25)``:
the boundary after three quarters of layer 2, i.e. its attention and half its MLP columns) gives each
stage a contiguous run of units. A boundary inside a half-block (``chunk_split``) sends two tensors on,
``[y | h]`` (``message_channels``: ``2 d``): ``y``, the residual stream with the chunks so far added
(``x + sum of their outputs``), and ``h``, the half's normalised input, which the next stage's chunks
read (so the norm runs once, on the stage holding the half's first chunk); the partial sums are those
of a row-parallel matmul (Megatron's tensor parallelism), split over pipeline stages instead of GPUs of
one stage. A boundary needs whole heads and columns: ``n_kv_heads * c / 8`` and ``d_ff * c / 8``
integers (``check_chunk_bounds``).

gpt2: a block holds QKV + out projection and a two-matrix MLP, all with biases, and two LayerNorms;
the first stage a token and a position table. llama: Q and out projections
``d x d``, K and V ``d x n_kv_heads * head_dim``, SwiGLU's three ``d x d_ff`` matrices, two RMSNorm
gains, no biases; the first stage a token table only (rotary positions); a tied LM head adds nothing
on one stage, and a copy on the last of several (as Megatron keeps it).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, NamedTuple

__all__ = ["leading_layers", "ModelSizes", "split_layers", "normalise_layer_split", "normalise_head_split", "PARTS", "HEAD_STATS",
           "SUB_CHUNKS", "UNITS_PER_LAYER", "HalfPiece"]

PARTS = ("attn", "mlp")
"""The two halves of a block, in order."""

SUB_CHUNKS = 8
"""Chunks of a half-block a stage boundary may fall between (attention: K/V head groups; MLP: inner columns)."""

UNITS_PER_LAYER = 2 * SUB_CHUNKS
"""Split units per layer (module docstring): unit ``u`` is chunk ``u % 8`` of layer ``u // 16``'s half
``PARTS[(u // 8) % 2]``."""


class HalfPiece(NamedTuple):
    """The chunks ``chunks`` (of ``SUB_CHUNKS``) of layer ``layer``'s half ``part`` a stage holds."""

    layer: int
    part: str
    chunks: range

    @property
    def whole(self) -> bool:
        return len(self.chunks) == SUB_CHUNKS

HEAD_STATS = 2
"""Running statistics a shard of a vocabulary-split LM head passes on per token: the log-sum-exp of the
logits so far and the target's logit (0 where the target lies in a later shard), fp32 each."""


class ModelSizes:
    """Analytic sizes (module docstring); mixed into ``ModelConfig``."""

    d_model: int
    d_ff: int
    vocab_size: int
    max_seq_len: int
    family: str
    tie_embeddings: bool
    dtype: str
    n_heads: int
    n_kv_heads: int | None
    n_layers: int
    layer_split: tuple[int | float, ...] | None
    head_split: tuple[int, ...] | None

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of ``dtype`` (float64 8, float32 4, the 16-bit types 2)."""
        return {"float64": 8, "float32": 4}.get(self.dtype, 2)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """K/V heads (``n_kv_heads``, or ``n_heads`` when None)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def learned_positions(self) -> bool:
        """Whether positions come from a ``max_seq_len`` table (gpt2), capping document length."""
        return self.family == "gpt2"

    # --- the split in units of 1/16 layer ---------------------------------------------
    @property
    def unit_split(self) -> tuple[int, ...] | None:
        """``layer_split`` in units (``(2.5, 2, 2, 1.5)`` -> ``(40, 32, 32, 24)``); None: even."""
        return None if self.layer_split is None else tuple(int(round(UNITS_PER_LAYER * v)) for v in self.layer_split)

    def _boundaries(self) -> list[int]:
        """The units at which a stage ends (cumulative ``unit_split``; empty: even split)."""
        return list(itertools.accumulate(self.unit_split or ()))

    @property
    def half_split(self) -> bool:
        """Whether a stage boundary falls inside a block (between its halves or inside one)."""
        return any(u % UNITS_PER_LAYER for u in self._boundaries())

    @property
    def chunk_split(self) -> bool:
        """Whether a stage boundary falls inside a half-block (between its chunks, module docstring)."""
        return any(u % SUB_CHUNKS for u in self._boundaries())

    def check_chunk_bounds(self) -> None:
        """ValueError naming the boundary where one inside a half-block does not fall on whole K/V heads
        (attention) or whole inner columns (MLP)."""
        for u in self._boundaries():
            c = u % SUB_CHUNKS
            if not c:
                continue
            part = PARTS[(u // SUB_CHUNKS) % 2]
            width, what = (self.kv_heads, "n_kv_heads") if part == "attn" else (self.d_ff, "d_ff")
            if width * c % SUB_CHUNKS:
                raise ValueError(f"ModelConfig.layer_split {list(self.layer_split or ())}: the boundary at "
                                 f"{u / UNITS_PER_LAYER:g} layers cuts layer {u // UNITS_PER_LAYER}'s {part} half "
                                 f"after {c}/{SUB_CHUNKS} of it, but {what} {width} is not divisible there")

    def stage_units(self, num_stages: int) -> list[range]:
        """The units of each stage (module docstring)."""
        units = self.unit_split
        if units is None or num_stages == 1:
            return [range(UNITS_PER_LAYER * r.start, UNITS_PER_LAYER * r.stop)
                    for r in split_layers(self.n_layers, num_stages)]
        if len(units) != num_stages:
            raise ValueError(f"model {getattr(self, 'name', '')!r} has a layer split for {len(units)} stages "
                             f"{list(self.layer_split or ())}, not {num_stages}")
        ends = list(itertools.accumulate(units))
        return [range(end - n, end) for n, end in zip(units, ends)]

    def stage_pieces(self, num_stages: int) -> list[list[HalfPiece]]:
        """Each stage's half-blocks in order, whole or the chunks it holds of one."""
        return [list(pieces) for pieces in _pieces_of(tuple(self.stage_units(num_stages)))]

    def stage_parts(self, num_stages: int) -> list[tuple[float, float]]:
        """``(attention halves, MLP halves)`` of each stage (a chunk counts 1/8)."""
        return list(_parts_of(tuple(self.stage_units(num_stages))))

    def stage_blocks(self, num_stages: int) -> list[list[tuple[int, tuple[str, ...]]]]:
        """Each stage's blocks as ``(layer, parts)``: whole blocks ``("attn", "mlp")``, and at a
        mid-block boundary the stage's ``("mlp",)`` first and/or ``("attn",)`` last (whole halves or
        chunks of them: ``stage_pieces``)."""
        out = []
        for pieces in self.stage_pieces(num_stages):
            blocks: dict[int, tuple[str, ...]] = {}
            for piece in pieces:
                blocks[piece.layer] = blocks.get(piece.layer, ()) + (piece.part,)
            out.append(list(blocks.items()))
        return out

    def stage_layer_counts(self, num_stages: int) -> list[float]:
        """Layers per stage (halves count 0.5, chunks 1/16), e.g. ``[2.5, 2.0, 2.0, 1.5]``."""
        return [len(r) / UNITS_PER_LAYER for r in self.stage_units(num_stages)]

    # --- the LM head's vocabulary over the stages ---------------------------------------
    def stage_vocab(self, num_stages: int) -> list[range]:
        """The LM head's vocabulary rows on each stage: ``head_split`` when set (a suffix of stages,
        contiguous row ranges in order), else all ``vocab_size`` rows on the last stage."""
        if self.head_split is None or num_stages == 1:
            return [range(0)] * (num_stages - 1) + [range(self.vocab_size)]
        if len(self.head_split) != num_stages:
            raise ValueError(f"model {getattr(self, 'name', '')!r} has a head split for {len(self.head_split)} "
                             f"stages {list(self.head_split)}, not {num_stages}")
        ends = list(itertools.accumulate(self.head_split))
        return [range(end - n, end) for n, end in zip(self.head_split, ends)]

    def head_stage(self, num_stages: int) -> int:
        """The first stage holding LM-head rows: it also runs the final norm."""
        return next(i for i, r in enumerate(self.stage_vocab(num_stages)) if len(r))

    def message_channels(self, stage: int, num_stages: int) -> int:
        """Width of the last dimension of the message ``stage`` sends on (to ``stage + 1``): ``d_model``;
        ``2 d_model`` (``[y | h]``, module docstring) when it ends inside a half-block; ``d_model`` plus the
        head's running statistics after a head shard (``HEAD_STATS`` fp32 values per token; in a 16-bit
        model each as a high and a low 16-bit part, so they keep fp32's precision)."""
        if stage >= num_stages - 1:
            return self.d_model
        if self.stage_units(num_stages)[stage].stop % SUB_CHUNKS:
            return 2 * self.d_model
        if not len(self.stage_vocab(num_stages)[stage]):
            return self.d_model
        return self.d_model + HEAD_STATS * (1 if self.dtype_bytes >= 4 else 2)

    # --- sizes ----------------------------------------------------------------------
    def half_params(self) -> tuple[int, int]:
        """Parameters of a block's ``(attention half, MLP half)``, each with its norm (module docstring)."""
        d, f = self.d_model, self.d_ff
        if self.family == "llama":
            kv = self.kv_heads * self.head_dim
            return 2 * d * d + 2 * d * kv + d, 3 * d * f + d
        return (3 * d * d + 3 * d) + (d * d + d) + 2 * d, (d * f + f) + (f * d + d) + 2 * d

    def block_params(self) -> int:
        """Parameters of one block. gpt2: QKV + out proj (with biases), fc + proj MLP (with biases),
        two LayerNorms (gain and bias). llama: Q, K, V (``kv_heads`` heads each) and out proj,
        gate/up/down, two RMSNorm gains; no biases."""
        return sum(self.half_params())

    def stage_params(self, stage: int, num_stages: int) -> int:
        """Parameters held by ``stage``: its blocks (or half-blocks, or pieces of one: a half's norm, and gpt2's
        output bias, with its chunk 0), plus the embeddings on the first (gpt2: token
        and position tables; llama: token table), the final norm on the head's first stage and the LM
        head's rows on the stages holding them (``stage_vocab``; all on the last by default). A tied
        head adds nothing on a single stage; across stages the last holds a copy (as Megatron does)."""
        d = self.d_model
        na, nm = self.stage_parts(num_stages)[stage]
        attn, mlp = self.half_params()
        n = na * attn + nm * mlp
        for pc in self.stage_pieces(num_stages)[stage]:      # a piece: the norm (gpt2: and output bias) on chunk 0's
            if not pc.whole:
                n += (d if self.family == "llama" else 3 * d) * ((pc.chunks.start == 0) - len(pc.chunks) / SUB_CHUNKS)
        n = int(round(n))
        if stage == 0:
            n += self.vocab_size * d + (self.max_seq_len * d if self.learned_positions else 0)
        if stage == self.head_stage(num_stages):
            n += (2 * d if self.family == "gpt2" else d)
        if not (self.tie_embeddings and num_stages == 1):
            n += d * len(self.stage_vocab(num_stages)[stage])
        return n

    def param_count(self) -> int:
        """Parameters of the whole model (a tied embedding counted once)."""
        return self.stage_params(0, 1)

    def message_bytes(self, rows: Any, padded_len: Any) -> Any:
        """Bytes of the hidden state sent between neighbouring stages for one microbatch (vectorised)."""
        return rows * padded_len * self.d_model * self.dtype_bytes

    def link_bytes(self, rows: Any, padded_len: Any, num_stages: int) -> Any:
        """Bytes of one microbatch's message on the widest link of ``num_stages`` stages (``message_channels``:
        ``[y | h]`` after a boundary inside a half-block, head statistics after a shard): what the simulator
        prices every P2P message of the pipeline at (one price per microbatch; an upper bound on the others)."""
        widest = max((self.message_channels(s, num_stages) for s in range(num_stages - 1)), default=self.d_model)
        return self.message_bytes(rows, padded_len) * (widest / self.d_model)

    def stage_flops(self, stage: int, num_stages: int, rows: Any, padded_len: Any) -> Any:
        """Forward FLOPs of ``stage`` on a (rows, padded_len) microbatch (vectorised).

        2 FLOPs per multiply-add in every matmul (gpt2: qkv + out ``4 d^2`` and MLP ``2 d f`` per
        token; llama: q + out ``2 d^2``, k + v ``2 d kv`` with ``kv = kv_heads * head_dim``, SwiGLU
        ``3 d f``), plus the s^2 attention terms (QK^T and AV over the full row: masks do not skip
        work in dense SDPA; K/V heads shared by a group still meet every query head), plus the LM
        head's ``2 d`` per token and vocabulary row the stage holds (``stage_vocab``).
        """
        na, nm = self.stage_parts(num_stages)[stage]
        attn, mlp = self.half_flops(rows, padded_len)
        fl = na * attn + nm * mlp
        vocab_rows = len(self.stage_vocab(num_stages)[stage])
        if vocab_rows:
            fl = fl + rows * padded_len * 2 * self.d_model * vocab_rows
        return fl

    def half_flops(self, rows: Any, padded_len: Any) -> tuple[Any, Any]:
        """Forward FLOPs of one block's ``(attention half, MLP half)`` on a (rows, padded_len)
        microbatch (the terms of ``stage_flops``; the s^2 attention terms in the attention half)."""
        d, f = self.d_model, self.d_ff
        tokens = rows * padded_len
        attn = 2 * 2 * rows * padded_len * padded_len * d
        if self.family == "llama":
            kv = self.kv_heads * self.head_dim
            return tokens * 2 * (2 * d * d + 2 * d * kv) + attn, tokens * 2 * 3 * d * f
        return tokens * 2 * 4 * d * d + attn, tokens * 2 * 2 * d * f


def normalise_layer_split(split: Any, n_layers: int) -> tuple[int | float, ...]:
    """``split`` as layers per stage: whole layers as ints, others as floats on the 1/16 grid (``x.5``: half
    a block; module docstring); every stage at least one unit except the last stages of several, which may
    hold none (the final norm and LM head alone, as Megatron's layout ``...|L`` allows, or the LM head's
    vocabulary shards: ``ModelConfig.head_split``); the total ``n_layers`` (ValueError naming the split
    otherwise)."""
    units = []
    for v in split:
        u = UNITS_PER_LAYER * float(v)
        if not abs(u) < float("inf") or abs(u - round(u)) > 1e-9:
            raise ValueError(f"ModelConfig.layer_split {list(split)}: {v} is not a whole number of layers, halves "
                             f"or 1/{UNITS_PER_LAYER}ths")
        units.append(int(round(u)))
    held = len(units) - next((i for i, u in enumerate(reversed(units)) if u), len(units))   # stages up to the last with layers
    if not units or min(units[:held] or [0]) < 1 or min(units) < 0 or sum(units) != UNITS_PER_LAYER * n_layers:
        raise ValueError(f"ModelConfig.layer_split {list(split)} must give every stage >= 1 layer (or a part of "
                         f"one; the last stages of several may hold none: the LM head alone or its shards) and "
                         f"sum to n_layers "
                         f"{n_layers}")
    return tuple(u // UNITS_PER_LAYER if u % UNITS_PER_LAYER == 0 else u / UNITS_PER_LAYER for u in units)


def normalise_head_split(split: Any, vocab_size: int, layer_split: tuple[int | float, ...] | None,
                         tied: bool = False) -> tuple[int, ...] | None:
    """``split`` as LM-head vocabulary rows per stage (None: all on the last stage): whole numbers summing
    to ``vocab_size``, held by a suffix of the stages (the first of them may also hold layers and runs the
    final norm; every later one holds head rows only, so ``layer_split`` must give it no layers). A split
    that leaves every row on the last stage is None; only stages holding head rows may hold no layers, only
    an untied head (``tied``) may be split (ValueError naming the split otherwise)."""
    out = None if split is None else _head_rows(split, vocab_size, layer_split)
    empty = [i for i, n in enumerate(layer_split or ()) if not n]
    if len(empty) > 1 and (out is None or any(not out[i] for i in empty)):
        raise ValueError(f"ModelConfig.layer_split {list(layer_split or ())}: stages {empty} hold no layers; "
                         f"only the last stage may, unless head_split gives each of them LM-head rows")
    if out is not None and tied:
        raise ValueError("ModelConfig.head_split needs an untied LM head (tie_embeddings=False)")
    return out


def _head_rows(split: Any, vocab_size: int, layer_split: tuple[int | float, ...] | None) -> tuple[int, ...] | None:
    """``normalise_head_split``'s rows (None: all on the last stage), checked against ``layer_split``."""
    rows = []
    for v in split:
        if float(v) != int(v) or int(v) < 0:
            raise ValueError(f"ModelConfig.head_split {list(split)}: {v} is not a whole number of vocabulary rows")
        rows.append(int(v))
    first = next((i for i, n in enumerate(rows) if n), len(rows))
    if not rows or sum(rows) != vocab_size or min(rows[first:]) < 1:
        raise ValueError(f"ModelConfig.head_split {list(split)} must give a suffix of the stages >= 1 vocabulary row "
                         f"each and sum to vocab_size {vocab_size}")
    if first == len(rows) - 1:
        return None
    if layer_split is None or len(layer_split) != len(rows) or any(layer_split[first + 1:]):
        raise ValueError(f"ModelConfig.head_split {rows} shards the LM head over stages {first}..{len(rows) - 1}: "
                         f"layer_split must give the same {len(rows)} stages and no layers after stage {first}, "
                         f"got {None if layer_split is None else list(layer_split)}")
    return tuple(rows)


def _count(chunks: int) -> int | float:
    """Half-blocks of ``chunks`` chunks (an int when whole)."""
    return chunks // SUB_CHUNKS if chunks % SUB_CHUNKS == 0 else chunks / SUB_CHUNKS


def split_layers(n_layers: int, num_stages: int) -> list[range]:
    """Contiguous, balanced layer ranges per stage (earlier stages take the remainder)."""
    if num_stages < 1 or n_layers < num_stages:
        raise ValueError(f"cannot split {n_layers} layers over {num_stages} stages (need 1 <= stages <= layers)")
    base, extra = divmod(n_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


@functools.lru_cache(maxsize=256)
def _pieces_of(units: tuple[range, ...]) -> tuple[tuple[HalfPiece, ...], ...]:
    """``ModelSizes.stage_pieces`` of the stages' units (``stage_units``), remembered: the cost models ask
    for it on every lookup."""
    out = []
    for r in units:
        pieces: list[HalfPiece] = []
        u = r.start
        while u < r.stop:
            half_end = (u // SUB_CHUNKS + 1) * SUB_CHUNKS
            end = min(half_end, r.stop)
            pieces.append(HalfPiece(u // UNITS_PER_LAYER, PARTS[(u // SUB_CHUNKS) % 2],
                                    range(u % SUB_CHUNKS, u % SUB_CHUNKS + end - u)))
            u = end
        out.append(tuple(pieces))
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _parts_of(units: tuple[range, ...]) -> tuple[tuple[float, float], ...]:
    """``ModelSizes.stage_parts`` of the stages' units, remembered (``_pieces_of``)."""
    out = []
    for pieces in _pieces_of(units):
        n = {p: 0 for p in PARTS}
        for piece in pieces:
            n[piece.part] += len(piece.chunks)
        out.append((_count(n["attn"]), _count(n["mlp"])))
    return tuple(out)


def leading_layers(pieces: list[HalfPiece] | tuple[HalfPiece, ...], k: int) -> list[int]:
    """The layers of a stage's first ``k`` blocks, in order (its pieces in order, one block a layer: a half or the
    pieces of one at a boundary count one): what ``recompute_blocks`` recomputes and offload moves."""
    return list(dict.fromkeys(pc.layer for pc in pieces))[:int(k)]
