"""Collate a sampled microbatch into token tensors, and normalise its loss by the global batch.

``collate_padded(tokens, mb)`` and ``collate_packed(tokens, mb)`` turn a
``dynmb.api.sampler.SampledMicrobatch`` and the dataset's token sequences (``tokens[i]``:
the ids of dataset index ``i``, at least ``mb.lengths[k]`` of them; a truncated document uses
its first ones) into a ``TokenBatch``:

- ``padded``: the plan's own shape, ``mb.rows`` rows of ``mb.padded_len`` tokens (the shape
  the memory model budgeted); documents sharing a row are concatenated in entry order and
  the row is padded on the right with ``pad_id``.
- ``packed``: one row of every real token, the documents back to back in the same order (no
  padding; the layout of variable-length attention kernels).

In both, ``position_ids`` restart at 0 in every document; ``doc_ids`` name each token's
entry (an index into ``mb.indices``), -1 at pads; ``cu_seqlens`` (int32) are the cumulative
document lengths over the real tokens in row-major order and ``max_seqlen`` the longest
document: what document-causal attention needs (``TokenBatch.document_mask()`` builds the
dense mask from ``doc_ids`` for SDPA). ``labels`` follow Hugging Face's convention: aligned
with ``input_ids`` (a model shifts them: position t predicts ``labels[t + 1]``), and
``IGNORE_INDEX`` at pads and at every document's first token, so no document predicts across
a boundary. A document of n tokens gives n - 1 loss tokens.

Token-weighted loss: the loss of a global batch is the sum of token cross-entropies over
all its loss tokens divided by their number, whatever the grouping into microbatches and
replicas. Per microbatch, ``token_loss_sum(logits, labels)`` (the shifted, summed cross-
entropy) divided by the global batch's loss-token count, then backward; the accumulated
gradient is the global batch's. The count: ``planned_loss_tokens(mb)`` from the sampler's
plan (every rank plans all replicas: no communication), or ``global_loss_tokens(batches,
group)`` counted from the labels themselves (a ``torch.distributed`` all-reduce over the
data-parallel ``group`` when one is given; use it when your labels mask more than document
starts, e.g. prompts). The naive mean of per-microbatch mean losses weights every
microbatch equally instead and gives a different gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from dynmb.core.contract import IGNORE_INDEX
from dynmb.api.sampler import SampledMicrobatch

__all__ = ["TokenBatch", "CollateError", "collate_padded", "collate_packed", "collate", "MicrobatchDataset",
           "token_loss_sum", "planned_loss_tokens", "global_loss_tokens", "IGNORE_INDEX", "LAYOUTS"]

LAYOUTS = ("padded", "packed")


class CollateError(ValueError):
    """A sampled microbatch cannot be collated (a document with too few tokens, bad ids)."""


@dataclass(frozen=True, eq=False)
class TokenBatch:
    """Token tensors of one sampled microbatch (see the module docstring); all ``(rows, cols)`` int64
    except ``cu_seqlens`` (int32, documents + 1)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    layout: str
    microbatch: SampledMicrobatch

    @property
    def attention_mask(self) -> torch.Tensor:
        """``(rows, cols)`` int64: 1 at real tokens, 0 at pads (Hugging Face's padding mask)."""
        return (self.doc_ids >= 0).long()

    @property
    def loss_tokens(self) -> int:
        """Tokens that get a loss in this microbatch (labels that are not ``IGNORE_INDEX``)."""
        return int((self.labels != IGNORE_INDEX).sum())

    def document_mask(self) -> torch.Tensor:
        """``(rows, 1, cols, cols)`` bool, True where query i may attend key j: same document and
        j <= i (document-causal); a pad attends to itself only, so every row of scores is finite."""
        d = self.doc_ids
        n = d.shape[1]
        m = (d[:, :, None] == d[:, None, :]) & (d[:, None, :] >= 0)
        m &= torch.ones(n, n, dtype=torch.bool, device=d.device).tril_()
        m |= torch.eye(n, dtype=torch.bool, device=d.device)
        return m[:, None]

    def to(self, device: torch.device | str) -> "TokenBatch":
        return replace(self, **{k: getattr(self, k).to(device) for k in
                                ("input_ids", "labels", "position_ids", "doc_ids", "cu_seqlens")})


def _document_ids(tokens: Sequence[Any], index: int, need: int, given: int | None = None) -> torch.Tensor:
    """The first ``need`` ids of document ``index``; ``given``: the length the sampler was given for it,
    which the token list must have (a longer list would be cut silently)."""
    try:
        t = torch.as_tensor(tokens[index]).reshape(-1)
    except (IndexError, KeyError) as e:
        raise CollateError(f"collate: dataset index {index} has no token sequence ({type(e).__name__}: {e})") from None
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.dtype.is_complex:
        raise CollateError(f"collate: dataset index {index} holds {t.dtype} values, not integer token ids")
    if t.numel() < need:
        raise CollateError(f"collate: dataset index {index} has {t.numel()} tokens, the plan needs {need} "
                           f"(the sampler's lengths must be the token counts of the dataset)")
    if given is not None and t.numel() != given:
        raise CollateError(f"collate: dataset index {index} has {t.numel()} tokens, the sampler was given length "
                           f"{given}; the sampler's lengths must be the token counts of the dataset")
    return t[:need].to(torch.int64)


def collate(tokens: Sequence[Any], mb: SampledMicrobatch, *, layout: str = "padded", pad_id: int = 0) -> TokenBatch:
    """The ``TokenBatch`` of ``mb`` in ``layout`` (``padded``: the plan's rows; ``packed``: one row)."""
    if layout not in LAYOUTS:
        raise CollateError(f"collate: unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    order = np.argsort(mb.row_ids, kind="stable")          # entries grouped by row, in entry order
    lens, rows = mb.lengths[order], mb.row_ids[order]
    given = getattr(mb, "dataset_lengths", None)
    stream = torch.cat([_document_ids(tokens, int(mb.indices[k]), int(mb.lengths[k]),
                                      None if given is None else int(given[k])) for k in order])
    start = np.cumsum(lens) - lens                          # each document's start among the real tokens
    seg = np.repeat(np.arange(len(order)), lens)            # document (in `order`) of each real token
    pos = np.arange(int(lens.sum())) - start[seg]           # position inside its document
    if layout == "padded":
        n_rows, cols = mb.rows, mb.padded_len
        first_in_row = np.searchsorted(rows, rows, side="left")
        flat = (rows * cols + start - start[first_in_row])[seg] + pos
    else:
        n_rows, cols = 1, int(lens.sum())
        flat = np.arange(cols)
    where = torch.from_numpy(flat)
    pos_t = torch.from_numpy(pos)

    def fill(value: int, data: torch.Tensor) -> torch.Tensor:
        out = torch.full((n_rows * cols,), value, dtype=torch.int64)
        out[where] = data
        return out.view(n_rows, cols)

    labels = torch.where(pos_t == 0, torch.full_like(stream, IGNORE_INDEX), stream)
    cu = np.concatenate([[0], np.cumsum(lens)])
    return TokenBatch(input_ids=fill(pad_id, stream), labels=fill(IGNORE_INDEX, labels), position_ids=fill(0, pos_t),
                      doc_ids=fill(-1, torch.from_numpy(order[seg])), cu_seqlens=torch.from_numpy(cu).to(torch.int32),
                      max_seqlen=int(lens.max()), layout=layout, microbatch=mb)


def collate_padded(tokens: Sequence[Any], mb: SampledMicrobatch, *, pad_id: int = 0) -> TokenBatch:
    """``mb`` in the plan's own shape, ``(mb.rows, mb.padded_len)``, padded with ``pad_id``."""
    return collate(tokens, mb, layout="padded", pad_id=pad_id)


def collate_packed(tokens: Sequence[Any], mb: SampledMicrobatch) -> TokenBatch:
    """``mb``'s documents back to back in one row, ``(1, mb.tokens)``, no padding."""
    return collate(tokens, mb, layout="packed")


class MicrobatchDataset(torch.utils.data.Dataset):
    """A map-style dataset keyed by ``SampledMicrobatch``: ``DataLoader(MicrobatchDataset(tokens),
    sampler=sampler, batch_size=None)`` yields collated ``TokenBatch``es (in worker processes
    when ``num_workers > 0``)."""

    def __init__(self, tokens: Sequence[Any], *, layout: str = "padded", pad_id: int = 0) -> None:
        if layout not in LAYOUTS:
            raise CollateError(f"MicrobatchDataset: unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
        self.tokens, self.layout, self.pad_id = tokens, layout, int(pad_id)

    def __getitem__(self, mb: SampledMicrobatch) -> TokenBatch:
        if not isinstance(mb, SampledMicrobatch):
            raise CollateError(f"MicrobatchDataset is indexed by the sampler's SampledMicrobatch records, got "
                               f"{type(mb).__name__} (use DataLoader(..., sampler=sampler, batch_size=None))")
        return collate(self.tokens, mb, layout=self.layout, pad_id=self.pad_id)

    def __len__(self) -> int:
        return len(self.tokens)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy: position t's logits against ``labels[:, t + 1]`` over
    labels that are not ``IGNORE_INDEX`` (0-dim; half-precision logits are upcast to float32).
    Divide by the global batch's loss tokens for the token-weighted loss."""
    if logits.shape[:2] != labels.shape:
        raise CollateError(f"token_loss_sum: logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def planned_loss_tokens(mb: SampledMicrobatch) -> int:
    """Loss tokens of ``mb``'s whole global batch (all replicas) under the collate's labels:
    real tokens minus documents (each document's first token predicts nothing). No communication."""
    return int(mb.batch_tokens - mb.batch_documents)


def global_loss_tokens(batches: Iterable[TokenBatch] | int, group: Any = None) -> int:
    """Loss tokens of this rank's ``batches`` (or a count), summed over the data-parallel ``group``
    by ``torch.distributed.all_reduce`` when a group is given (every rank of it must call this)."""
    local = int(batches) if isinstance(batches, (int, np.integer)) else sum(b.loss_tokens for b in batches)
    if group is None:
        return local
    device = "cuda" if torch.distributed.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor([local], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM, group=group)
    return int(t.item())
