"""``fixed`` and ``sorted``: a fixed number of sequences per microbatch, padded to the longest.

``fixed`` takes ``mbs`` sequences per microbatch in batch order, ``sorted`` the same over
the sequences sorted by length, longest first (stable). Each microbatch runs at its longest
sequence rounded up to a multiple of ``round_to``. Without ``mbs`` the packer takes the
largest one whose worst case (every row at the batch's longest length, rounded) is
admissible (``PackContext.bmax``), at least 1.
"""

from __future__ import annotations

import numpy as np

from dynmb.packing.context import PackContext
from dynmb.packing.rows import Flat, round_up

__all__ = ["fixed_flat"]


def fixed_flat(method: str, lens: np.ndarray, ctx: PackContext, mbs: int | None, round_to: int) -> tuple[Flat, int]:
    """(microbatches of ``fixed`` or ``sorted`` in flat form, the mbs used)."""
    longest_padded = round_up(int(lens.max()), round_to)
    rows_per_mb = max(1, mbs or int(ctx.bmax([longest_padded])[0]))
    pos = np.arange(len(lens)) if method == "fixed" else np.argsort(-lens, kind="stable")
    # rows_per_mb consecutive positions per microbatch (rows.fixed_groups), built in flat form at once
    starts = np.arange(0, len(pos), rows_per_mb)
    sizes = np.minimum(rows_per_mb, len(pos) - starts).astype(np.int64)
    longest = round_up(np.maximum.reduceat(lens[pos], starts), round_to).astype(np.int64)
    local = np.arange(len(pos), dtype=np.int64) - np.repeat(starts, sizes)
    return Flat(pos.astype(np.int64), local, sizes, longest, sizes.copy()), rows_per_mb
