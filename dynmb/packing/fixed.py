"""``fixed`` and ``sorted``: a fixed number of sequences per microbatch, padded to the longest.

``fixed`` takes ``mbs`` sequences per microbatch in batch order, ``sorted`` the same over
the sequences sorted by length, longest first (stable). Each microbatch runs at its longest
sequence rounded up to a multiple of ``round_to``. Without ``mbs`` the packer takes the
largest one whose worst case (every row at the batch's longest length, rounded) is
admissible (``PackContext.bmax``), at least 1.
"""

from __future__ import annotations

import numpy as np

from .context import PackContext
from .rows import Flat, fixed_groups, groups_to_flat, round_up

__all__ = ["fixed_flat"]


def fixed_flat(method: str, lens: np.ndarray, ctx: PackContext, mbs: int | None, round_to: int) -> tuple[Flat, int]:
    """(microbatches of ``fixed`` or ``sorted`` in flat form, the mbs used)."""
    longest_padded = round_up(int(lens.max()), round_to)
    rows_per_mb = max(1, mbs or int(ctx.bmax([longest_padded])[0]))
    pos = np.arange(len(lens)) if method == "fixed" else np.argsort(-lens, kind="stable")
    return groups_to_flat(fixed_groups(pos, lens, rows_per_mb, round_to)), rows_per_mb
