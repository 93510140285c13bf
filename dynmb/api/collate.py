"""Collate a sampled microbatch into token tensors, and normalise its loss by the global batch.

One length convention (docs/design.md "Lengths"), the one of ``dynmb plan``, ``dynmb run``,
``make_inputs`` and the torch-pipelining adapter: a document of length ``n`` fills ``n`` positions
of a row and trains ``n`` tokens; its ids are ``n + 1``, its tokens then the end-of-text id (the
last id is only ever a label). ``dynmb lengths`` writes each record's token count ``n``; append the
tokenizer's end-of-text id (``dynmb.data.CorpusTokens.document`` and ``synthetic_tokens`` give
exactly ``n + 1`` ids) and the sampler, the plan and the runtime train the same ``n`` tokens.

``collate_padded(tokens, mb)`` and ``collate_packed(tokens, mb)`` turn a
``dynmb.api.sampler.SampledMicrobatch`` and the dataset's token sequences (``tokens[i]``:
the ids of dataset index ``i``, at least ``mb.lengths[k] + 1`` of them; a truncated document uses
its first ones) into a ``TokenBatch``:

- ``padded``: the plan's own shape, ``mb.rows`` rows of ``mb.padded_len`` tokens (the shape
  the memory model budgeted); documents sharing a row are concatenated in entry order and
  the row is padded on the right with ``pad_id``.
- ``packed``: one row of every real token, the documents back to back in the same order (no
  padding; the layout of variable-length attention kernels).

In both, ``input_ids`` hold each document's first ``n`` ids and ``labels`` the ids each position
predicts (already shifted, as dynmb's own ``MicrobatchInputs.labels``: ``labels[t]`` is the
document's id ``t + 1``; ``IGNORE_INDEX`` at pads), so no document predicts across a boundary and
a document of length n gives n loss tokens. Score a model's logits with ``token_loss_sum``; never
pass them as a transformers model's ``labels=``, which shifts them again.
``position_ids`` restart at 0 in every document; ``doc_ids`` name each token's entry (an index
into ``mb.indices``), -1 at pads; ``cu_seqlens`` (int32) are the cumulative document lengths over
the real tokens in row-major order and ``max_seqlen`` the longest document: what
document-causal attention needs. **The mask rule for packed rows**: a row holding several
documents needs ``TokenBatch.document_mask()`` (document-causal, 4-D, for SDPA / eager
attention); a padding mask with ``position_ids`` lets a transformers model attend across the
documents, so ``TokenBatch.attention_mask`` refuses such a batch (``CollateError``).

Token-weighted loss: the loss of a global batch is the sum of token cross-entropies over
all its loss tokens divided by their number, whatever the grouping into microbatches and
replicas. Per microbatch, ``token_loss_sum(logits, labels)`` (the summed cross-entropy)
divided by the global batch's loss-token count, then backward; the accumulated
gradient is the global batch's, and replicas sum (never average) their gradients. The count:
``planned_loss_tokens(mb)`` from the sampler's plan (every rank plans all replicas: no
communication), or ``global_loss_tokens(batches, group)`` counted from the labels themselves (a
``torch.distributed`` all-reduce over the data-parallel ``group`` when one is given; use it when
your labels mask more than pads, e.g. prompts). The naive mean of per-microbatch mean losses
weights every microbatch equally instead and gives a different gradient.
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
        """``(rows, cols)`` int64: 1 at real tokens, 0 at pads (Hugging Face's padding mask), for rows of
        one document each; refused (``CollateError``) when a row holds several: use ``document_mask()``."""
        per_row = [len(set(row[row >= 0].tolist())) for row in self.doc_ids]
        packed = [r for r, k in enumerate(per_row) if k > 1]
        if packed:
            raise CollateError(f"TokenBatch.attention_mask: row {packed[0]} holds {per_row[packed[0]]} documents; a "
                               "padding mask lets them attend to each other (cross-document attention): pass "
                               "document_mask() as the attention mask instead")
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
    """The first ``need + 1`` ids of document ``index`` (its ``need`` tokens trained, then the id the last
    predicts); ``given``: the length the sampler was given for it, whose ``given + 1`` ids the list must hold."""
    try:
        t = torch.as_tensor(tokens[index]).reshape(-1)
    except (IndexError, KeyError) as e:
        raise CollateError(f"collate: dataset index {index} has no token sequence ({type(e).__name__}: {e})") from None
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.dtype.is_complex:
        raise CollateError(f"collate: dataset index {index} holds {t.dtype} values, not integer token ids")
    if t.numel() < need + 1:
        raise CollateError(f"collate: dataset index {index} has {t.numel()} ids, its length {need} needs {need + 1} "
                           f"(its tokens then the end-of-text id: a length counts the tokens trained)")
    if given is not None and t.numel() != given + 1:
        raise CollateError(f"collate: dataset index {index} has {t.numel()} ids, the sampler was given length "
                           f"{given}, which needs {given + 1} (its tokens then the end-of-text id); a longer list "
                           "would be cut silently")
    return t[:need + 1].to(torch.int64)


def collate(tokens: Sequence[Any], mb: SampledMicrobatch, *, layout: str = "padded", pad_id: int = 0) -> TokenBatch:
    """The ``TokenBatch`` of ``mb`` in ``layout`` (``padded``: the plan's rows; ``packed``: one row)."""
    if layout not in LAYOUTS:
        raise CollateError(f"collate: unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    order = np.argsort(mb.row_ids, kind="stable")          # entries grouped by row, in entry order
    lens, rows = mb.lengths[order], mb.row_ids[order]
    given = getattr(mb, "dataset_lengths", None)
    docs = [_document_ids(tokens, int(mb.indices[k]), int(mb.lengths[k]), None if given is None else int(given[k]))
            for k in order]
    stream = torch.cat([d[:-1] for d in docs])             # inputs: each document's first n ids
    targets = torch.cat([d[1:] for d in docs])             # labels: the id each position predicts
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

    cu = np.concatenate([[0], np.cumsum(lens)])
    return TokenBatch(input_ids=fill(pad_id, stream), labels=fill(IGNORE_INDEX, targets), position_ids=fill(0, pos_t),
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
    """Summed next-token cross-entropy: position t's logits against ``labels[:, t]`` (the collate's
    labels are already shifted) over labels that are not ``IGNORE_INDEX`` (0-dim; half-precision
    logits are upcast to float32). Divide by the global batch's loss tokens for the token-weighted loss."""
    if logits.shape[:2] != labels.shape:
        raise CollateError(f"token_loss_sum: logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def planned_loss_tokens(mb: SampledMicrobatch) -> int:
    """Loss tokens of ``mb``'s whole global batch (all replicas) under the collate's labels: its real
    tokens (a document of length n trains n tokens, the last predicting its end-of-text). No communication."""
    return int(mb.batch_tokens)


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
