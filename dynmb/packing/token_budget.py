"""``token-budget``: fairseq's ``batch_by_size`` (as DeepSpeed users run it) under the memory limit.

Sequences in ascending length order; a microbatch grows while rows x padded_len <= T
(``padded_len`` its longest sequence rounded up to a multiple of ``round_to``). T is the
largest token count admissible at the batch's longest (rounded) length s: the largest
T with b = T / s rows (fractional) admissible there, from the memory model's coefficients
under the context's budget (``k_i * act_i + transient_i`` tight, ``k_i * (act_i +
transient_i)`` safe).
"""

from __future__ import annotations

import numpy as np

from dynmb.packing.context import PackContext
from dynmb.packing.rows import Flat, groups_to_flat, round_up, token_budget_groups

__all__ = ["max_tokens", "token_budget_flat"]


def max_tokens(ctx: PackContext, s: int) -> int:
    """Largest T with b = T / s (fractional) admissible at length s."""
    w = ctx.k[:, None] * ctx.mm.act_coef + (1 if ctx.tight else ctx.k[:, None]) * ctx.mm.transient_coef
    per_tok = w[:, 1] + w[:, 2] * s
    return int(max(0.0, np.min((ctx.caps - w[:, 0]) / np.maximum(per_tok, 1e-300))))


def token_budget_flat(lens: np.ndarray, ctx: PackContext, round_to: int, divisor: int | None = None) -> tuple[Flat, int]:
    """(microbatches of ``token-budget`` in flat form, the token budget T used: the memory maximum,
    divided by ``divisor`` when given, the budgets ``cap / 2^j`` of ``dynmb compare``'s best in hindsight)."""
    budget = max_tokens(ctx, round_up(int(lens.max()), round_to)) // int(divisor or 1)
    return groups_to_flat(token_budget_groups(lens, budget, round_to)), budget
