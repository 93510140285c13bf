"""``in-order``: rows of a fixed length in sample order, dealt round-robin -- a data loader with no planning.

What a distributed sampler and a concatenating loader give a static-shape engine (torchtitan-style), with
whole documents:

1. Rows: the documents in sample order fill rows of ``pack_len`` tokens next-fit (``rows.next_fit_rows``: a
   document that does not fit the open row opens the next one), so row ``k``'s documents follow row
   ``k - 1``'s in the batch.
2. Deal: row ``k`` goes to replica ``k mod D``, each replica's rows in order, ``b`` consecutive rows of a
   replica per microbatch: microbatch ``j`` of every replica holds rows ``j D b`` to ``(j + 1) D b - 1``.
3. Every replica runs the same number of microbatches (a plan's invariant; a loader pads the last round):
   while the last round holds fewer than ``D`` rows, the row of most documents (ties: the last) is cut in
   two, its later half (by sample order) becoming the row after it, so the rows stay in sample order.

Documents longer than ``pack_len`` follow ``--oversize`` first (``truncate``, ``drop``; ``split`` is refused
as for ``lockstep``: ``MethodRecord.lockstep``). ``pack`` keeps the replica-major order and the deal.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dynmb.packing.context import PackingError
from dynmb.packing.rows import Flat, next_fit_rows

__all__ = ["in_order_rows", "in_order_flat"]


def _short_last_round(num_rows: int, dp: int, rows_per_mb: int) -> bool:
    """Whether the last round of ``num_rows`` rows dealt ``dp x rows_per_mb`` at a time misses a replica."""
    return 0 < num_rows % (dp * rows_per_mb) < dp or num_rows < dp


def in_order_rows(lens: np.ndarray, pack_len: int, dp: int = 1, rows_per_mb: int = 1) -> np.ndarray:
    """Row of every document (steps 1 and 3): next-fit in sample order into rows of ``pack_len``, rows cut in
    two until every one of the ``dp`` replicas gets a row in the last round."""
    lens = np.asarray(lens, dtype=np.int64)
    if len(lens) and int(lens.max()) > pack_len:
        raise PackingError(f"in-order: a document of {int(lens.max())} tokens is longer than the row ({pack_len}); "
                           f"the oversize policy runs first")
    if not len(lens):
        raise PackingError("in-order: no documents to pack")
    row = next_fit_rows(lens, pack_len)
    while _short_last_round(int(row[-1]) + 1, dp, rows_per_mb):
        count = np.bincount(row)
        donor = len(count) - 1 - int(np.argmax(count[::-1]))          # most documents, ties: the last
        if count[donor] < 2:
            raise PackingError(f"in-order: {len(lens)} document(s) cannot give each of the {dp} replicas a row")
        docs = np.flatnonzero(row == donor)
        row[docs[len(docs) // 2:]] += 1
        row[docs[-1] + 1:] += 1
    return row


def in_order_flat(lens: np.ndarray, pack_len: int, dp: int = 1, rows_per_mb: int = 1) -> tuple[Flat, dict[str, Any]]:
    """The registry's form (step 2): microbatches replica-major (replica ``d``'s in order, then ``d + 1``'s),
    ``rows_per_mb`` rows of ``pack_len`` each (fewer in the last round), and the settings for ``plan.meta``."""
    row = in_order_rows(lens, pack_len, dp, rows_per_mb)
    num_rows = int(row[-1]) + 1
    per_call = dp * rows_per_mb
    M = -(-num_rows // per_call)
    replica, position = row % dp, row // dp
    mb = replica * M + position // rows_per_mb                 # replica-major microbatch index
    items = np.lexsort((np.arange(len(row)), mb))
    every_row = np.arange(num_rows)
    rows_of_mb = np.bincount(every_row % dp * M + every_row // dp // rows_per_mb, minlength=dp * M)
    flat = Flat(items.astype(np.int64), (position % rows_per_mb)[items].astype(np.int64),
                np.bincount(mb, minlength=dp * M).astype(np.int64), np.full(dp * M, pack_len, np.int64),
                rows_of_mb.astype(np.int64))
    return flat, {"mbs": rows_per_mb, "microbatches": M}
