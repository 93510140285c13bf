"""``packed``: Megatron-style sequence packing, as its users configure it.

Rows of a fixed ``pack_len`` tokens are filled best-fit-decreasing with whole documents
(``rows.bfd_rows``: each document, longest first, into the open row with the least room
that still holds it, else a new row), attention is document-causal, and a microbatch is
``mbs`` consecutive rows (default 1: Megatron's micro-batch-size 1 with packing, the
pipeline gets one microbatch per row). Default ``pack_len``: the longest row admissible as
a one-row microbatch, capped at the model's ``max_seq_len`` (a multiple of ``round_to``).
An explicit ``pack_len`` is rounded up to a multiple of ``round_to`` and must lie in [1,
that default]. Documents longer than ``pack_len`` follow the packer's ``oversize`` policy.
"""

from __future__ import annotations

import numpy as np

from dynmb.packing.context import PackContext, PackingError
from dynmb.packing.rows import Flat, packed_flat, round_up

__all__ = ["packed_row_len", "packed_rows_flat"]


def packed_row_len(ctx: PackContext, max_seq_len: int, pack_len: int | None, round_to: int) -> tuple[int, int]:
    """(row length of ``packed``, the longest row that fits): ``pack_len`` rounded up to a
    multiple of ``round_to``, by default the longest admissible one-row microbatch."""
    longest_row = ctx.length_cap(max_seq_len, round_to)
    if longest_row < 1:
        raise PackingError(f"no row fits under {ctx.limit} B at {ctx.p} stages ({ctx.kind})"
                           f"{f' at a multiple of round_to {round_to}' if round_to > 1 else ''}")
    if pack_len is None:
        return longest_row, longest_row
    if int(pack_len) != pack_len or pack_len < 1 or round_up(int(pack_len), round_to) > longest_row:
        raise PackingError(f"pack_len {pack_len!r} is out of range: rows must hold 1 to {longest_row} tokens "
                           f"(the longest one-row microbatch under {ctx.limit} B at {ctx.p} stages ({ctx.kind}), "
                           f"model max_seq_len {max_seq_len}{f', round_to {round_to}' if round_to > 1 else ''})")
    return round_up(int(pack_len), round_to), longest_row


def packed_rows_flat(lens: np.ndarray, pack_len: int, mbs: int | None) -> tuple[Flat, int]:
    """(microbatches of ``packed`` in flat form, the rows per microbatch used)."""
    rows_per_mb = mbs or 1
    return packed_flat(lens, pack_len, rows_per_mb), rows_per_mb
