"""Analytic sizes of a ``dynmb.config.ModelConfig`` per model family: parameters, FLOPs, message bytes.

``ModelSizes`` is a mixin of ``ModelConfig`` (it reads the config's fields through ``self`` and
imports nothing from dynmb): ``block_params``, ``stage_params``, ``param_count``, ``message_bytes``
and ``stage_flops``. gpt2: a block holds QKV + out projection and a two-matrix MLP, all with biases,
and two LayerNorms; the first stage a token and a position table. llama: Q and out projections
``d x d``, K and V ``d x n_kv_heads * head_dim``, SwiGLU's three ``d x d_ff`` matrices, two RMSNorm
gains, no biases; the first stage a token table only (rotary positions); a tied LM head adds nothing
on one stage, and a copy on the last of several (as Megatron keeps it).
"""

from __future__ import annotations

from typing import Any

__all__ = ["ModelSizes", "split_layers"]


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

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.dtype == "float32" else 2

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

    def _layers(self, num_stages: int) -> list[range]:
        return self.stage_layers(num_stages)  # type: ignore[attr-defined]

    def block_params(self) -> int:
        """Parameters of one block. gpt2: QKV + out proj (with biases), fc + proj MLP (with biases),
        two LayerNorms (gain and bias). llama: Q, K, V (``kv_heads`` heads each) and out proj,
        gate/up/down, two RMSNorm gains; no biases."""
        d, f = self.d_model, self.d_ff
        if self.family == "llama":
            kv = self.kv_heads * self.head_dim
            return (2 * d * d + 2 * d * kv) + 3 * d * f + 2 * d
        return (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d) + 4 * d

    def stage_params(self, stage: int, num_stages: int) -> int:
        """Parameters held by ``stage``: its blocks, plus the embeddings on the first (gpt2: token
        and position tables; llama: token table) and the final norm + LM head on the last. A tied
        head adds nothing on a single stage; across stages the last holds a copy (as Megatron does)."""
        d = self.d_model
        n = len(self._layers(num_stages)[stage]) * self.block_params()
        if stage == 0:
            n += self.vocab_size * d + (self.max_seq_len * d if self.learned_positions else 0)
        if stage == num_stages - 1:
            n += (2 * d if self.family == "gpt2" else d)
            if not (self.tie_embeddings and num_stages == 1):
                n += d * self.vocab_size
        return n

    def param_count(self) -> int:
        """Parameters of the whole model (a tied embedding counted once)."""
        return self.stage_params(0, 1)

    def message_bytes(self, rows: int, padded_len: int) -> int:
        """Bytes of the hidden state sent between neighbouring stages for one microbatch."""
        return rows * padded_len * self.d_model * self.dtype_bytes

    def stage_flops(self, stage: int, num_stages: int, rows: Any, padded_len: Any) -> Any:
        """Forward FLOPs of ``stage`` on a (rows, padded_len) microbatch (vectorised).

        2 FLOPs per multiply-add in every matmul (gpt2: qkv + out ``4 d^2`` and MLP ``2 d f`` per
        token; llama: q + out ``2 d^2``, k + v ``2 d kv`` with ``kv = kv_heads * head_dim``, SwiGLU
        ``3 d f``), plus the s^2 attention terms (QK^T and AV over the full row: masks do not skip
        work in dense SDPA; K/V heads shared by a group still meet every query head).
        """
        d, f = self.d_model, self.d_ff
        tokens = rows * padded_len
        nl = len(self._layers(num_stages)[stage])
        if self.family == "llama":
            kv = self.kv_heads * self.head_dim
            per_tok_block = 2 * (2 * d * d + 2 * d * kv + 3 * d * f)
        else:
            per_tok_block = 2 * (4 * d * d + 2 * d * f)
        attn = 2 * 2 * rows * padded_len * padded_len * d
        fl = nl * (tokens * per_tok_block + attn)
        if stage == num_stages - 1:
            fl = fl + tokens * 2 * d * self.vocab_size
        return fl


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
