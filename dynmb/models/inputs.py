"""Model inputs of a microbatch: token rows, labels, positions, document ids and the index
tensors of its attention (see ``dynmb.models.attention`` for the attention algorithm it feeds).

``make_inputs(mb, tokens, cfg=)`` lays a microbatch's sequences out in ``mb.batch`` rows of
``mb.padded_len`` tokens (sequences sharing a row concatenated, the row padded on the right),
positions restarting at each document. Which attention the stage runs is decided here from
``cfg.attention`` and the microbatch: ``causal`` (one document per row, no mask tensor),
``document`` (packed rows: ``DocumentBuckets`` gather each document into length buckets whose
padding stays within ``BUCKET_PADDING`` of the real tokens) or ``dense`` (the (s, s) mask).
A microbatch holding slices of long sequences (``Microbatch.slice_mask``) runs the
``document`` path: its other documents in buckets, each slice segment on its own
(``SliceSegment``: ``dynmb.models.prefix.PrefixAttention`` against the keys and values its earlier
slices left in the step's ``dynmb.models.prefix.PrefixStore``, ``MicrobatchInputs.prefix``).
A slice at offset o of n tokens takes the sequence's ids ``o .. o + n`` (inputs and
labels) and positions ``o .. o + n - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence, cast

import numpy as np
import torch

from dynmb.core.config import ModelConfig
from dynmb.core.contract import IGNORE_INDEX
from dynmb.memory.model import BUCKET_PADDING
from dynmb.models.prefix import PrefixStore
from dynmb.core.types import Microbatch

if TYPE_CHECKING:
    from dynmb.data.tokens import CorpusTokens

__all__ = [
    "MicrobatchInputs", "DocumentBuckets", "SliceSegment", "InputError", "synthetic_tokens", "corpus_tokens",
    "full_microbatch", "make_inputs",
    "attention_mask", "bucket_documents", "hidden_shape", "torch_dtype", "IGNORE_INDEX", "INPUT_ATTENTION",
]

"""Label of pad positions (``F.cross_entropy``'s ignore_index)."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class InputError(ValueError):
    """A microbatch cannot be turned into model inputs (row overflow, too long, bad tokens)."""


def torch_dtype(cfg: ModelConfig) -> torch.dtype:
    """The torch dtype of ``cfg.dtype`` (parameters and the hidden states sent between stages)."""
    return _DTYPES[cfg.dtype]


def hidden_shape(mb: Microbatch, cfg: ModelConfig, stage: int | None = None,
                 num_stages: int | None = None) -> tuple[int, int, int]:
    """Shape of the message stage ``stage`` of ``num_stages`` sends on for ``mb`` (and of its gradient):
    ``(batch, padded_len, cfg.message_channels(stage, num_stages))``, ``d_model`` channels but after a
    head shard (``ModelConfig.head_split``); without a stage, the hidden state ``(batch, padded_len, d_model)``."""
    if stage is None:
        return (mb.batch, mb.padded_len, cfg.d_model)
    if num_stages is None:
        raise ValueError("hidden_shape: a stage's message shape needs num_stages")
    return (mb.batch, mb.padded_len, cfg.message_channels(stage, num_stages))


# --- data --------------------------------------------------------------------
def synthetic_tokens(lengths: Sequence[int] | np.ndarray, vocab_size: int, seed: int = 0) -> list[torch.Tensor]:
    """Random token ids: sequence i gets ``lengths[i] + 1`` int64 ids (inputs ``t[:-1]``,
    labels ``t[1:]``), drawn from a generator seeded by ``(seed, i)`` so it depends only
    on the seed, its index and its length. Real text: ``corpus_tokens``."""
    out = []
    for i, n in enumerate(np.asarray(lengths, dtype=np.int64).reshape(-1)):
        if n < 1:
            raise InputError(f"sequence {i} has non-positive length {int(n)}")
        rng = np.random.default_rng([int(seed), i])
        out.append(torch.from_numpy(rng.integers(0, vocab_size, size=int(n) + 1, dtype=np.int64)))
    return out


def corpus_tokens(corpus: CorpusTokens, rows: Sequence[int] | np.ndarray,
                  lengths: Sequence[int] | np.ndarray | None = None) -> list[torch.Tensor]:
    """Real token ids: sequence i of a global batch drawn from the corpus rows ``rows`` gets
    document ``rows[i]``'s ids (its tokens and the end-of-text id, ``dynmb.data.tokens``), the
    same on every rank. ``lengths`` (the batch as planned) are checked against them."""
    out = [torch.from_numpy(corpus.document(int(r))) for r in np.asarray(rows, dtype=np.int64).reshape(-1)]
    if lengths is not None:
        for i, (t, n) in enumerate(zip(out, np.asarray(lengths, dtype=np.int64).reshape(-1))):
            if t.numel() < int(n) + 1:
                raise InputError(f"sequence {i} (corpus row {int(rows[i])}) has {t.numel() - 1} tokens, the plan "
                                 f"runs {int(n)}")
    return out


def full_microbatch(rows: int, padded_len: int, docs_per_row: int = 1) -> Microbatch:
    """A microbatch with no padding: ``rows`` rows, each ``docs_per_row`` documents that
    split ``padded_len`` as evenly as possible (for profiling a (rows, padded_len) shape)."""
    if not 1 <= docs_per_row <= padded_len:
        raise InputError(f"docs_per_row must lie in [1, padded_len={padded_len}], got {docs_per_row}")
    base, extra = divmod(padded_len, docs_per_row)
    per_row = np.array([base + 1] * extra + [base] * (docs_per_row - extra), dtype=np.int64)
    return Microbatch(seq_ids=np.arange(rows * docs_per_row), lengths=np.tile(per_row, rows), padded_len=padded_len,
                      batch=rows, row_ids=np.repeat(np.arange(rows), docs_per_row))


@dataclass(frozen=True, eq=False)
class SliceSegment:
    """One slice of a long sequence in a microbatch: ``length`` tokens from ``offset`` of
    sequence ``seq_id``, at flat positions ``index`` (``row * padded_len + col``);
    ``continued``: later slices attend to its keys and values."""

    seq_id: int
    offset: int
    length: int
    continued: bool
    index: torch.Tensor

    def to(self, device: torch.device | str) -> "SliceSegment":
        return replace(self, index=self.index.to(device, non_blocking=True))


@dataclass(frozen=True, eq=False)
class DocumentBuckets:
    """Where the documents of a packed microbatch go for bucketed attention.

    Bucket j holds ``shapes[j] = (n, L)``: n documents, each padded on the right to L
    tokens; the buckets lie back to back in one ``(bucket_tokens, d)`` tensor, followed by
    the outputs of the ``slices`` (their tokens in order) and one zero row.
    ``gather_index[t]`` is the flat position (``row * padded_len + col``) that bucket
    slot t copies (a pad slot copies its document's last token); ``scatter_index[p]`` is
    the output slot of flat position p, or the zero row at pads.
    """

    gather_index: torch.Tensor
    scatter_index: torch.Tensor
    shapes: tuple[tuple[int, int], ...]
    slices: tuple[SliceSegment, ...] = ()

    @property
    def bucket_tokens(self) -> int:
        return int(self.gather_index.numel())

    def split_sizes(self) -> list[int]:
        return [n * length for n, length in self.shapes]

    def to(self, device: torch.device | str) -> "DocumentBuckets":
        return replace(self, gather_index=self.gather_index.to(device, non_blocking=True),
                       scatter_index=self.scatter_index.to(device, non_blocking=True),
                       slices=tuple(sl.to(device) for sl in self.slices))


@dataclass(frozen=True, eq=False)
class MicrobatchInputs:
    """Model inputs of one microbatch; every tensor is ``(batch, padded_len)`` except the mask.

    ``labels`` hold ``IGNORE_INDEX`` and ``doc_ids`` hold -1 at pad positions.
    ``attention`` is the microbatch's attention path: ``causal`` (auto, one document
    per row), ``document`` (auto, packed rows: ``buckets`` is set) or ``dense``
    (``attn_mask`` is set, ``(batch, 1, padded_len, padded_len)`` bool, True = may attend).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor
    loss_mask: torch.Tensor
    num_real_tokens: int
    max_doc_len: int
    attention: str = "causal"
    attn_mask: torch.Tensor | None = None
    buckets: DocumentBuckets | None = None
    prefix: PrefixStore | None = None
    """The step's store of earlier slices' keys and values (set by the runtime when the
    microbatch holds slices; see ``dynmb.models.prefix``)."""
    microbatch: int = 0
    """The microbatch's index in its plan (the store records which microbatch kept or used what)."""

    def __post_init__(self) -> None:
        if self.attention not in INPUT_ATTENTION:
            raise ValueError(f"unknown attention path {self.attention!r}; expected one of {INPUT_ATTENTION}")
        if (self.attn_mask is not None) != (self.attention == "dense"):
            raise ValueError("attn_mask must be given exactly for the dense path")
        if (self.buckets is not None) != (self.attention == "document"):
            raise ValueError("buckets must be given exactly for the document path")

    @property
    def has_slices(self) -> bool:
        return self.buckets is not None and bool(self.buckets.slices)

    @property
    def shape(self) -> tuple[int, int]:
        return cast("tuple[int, int]", tuple(self.input_ids.shape))    # input_ids is [rows, columns]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the inputs hold (the mask and bucket indices included)."""
        out = [getattr(self, n) for n in _ROW_TENSORS]
        out += [] if self.attn_mask is None else [self.attn_mask]
        if self.buckets is not None:
            out += [self.buckets.gather_index, self.buckets.scatter_index] + [sl.index for sl in self.buckets.slices]
        return out

    def to(self, device: torch.device | str) -> "MicrobatchInputs":
        """A copy on ``device`` (a dense mask is rebuilt there from ``doc_ids``, not copied)."""
        moved = {n: getattr(self, n).to(device, non_blocking=True) for n in _ROW_TENSORS}
        mask = None if self.attn_mask is None else attention_mask(moved["doc_ids"])
        buckets = None if self.buckets is None else self.buckets.to(device)
        return replace(self, **moved, attn_mask=mask, buckets=buckets)


INPUT_ATTENTION = ("causal", "document", "dense")
"""``MicrobatchInputs.attention``: the path a microbatch runs (see the module docstring)."""
_ROW_TENSORS = ("input_ids", "labels", "position_ids", "doc_ids", "loss_mask")


def attention_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """``(batch, 1, s, s)`` bool: query i sees key j iff same document (>= 0) and j <= i;
    the diagonal is always True so pad rows stay finite."""
    b, s = doc_ids.shape
    m = doc_ids[:, :, None] == doc_ids[:, None, :]
    m &= torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril_()
    m &= (doc_ids >= 0)[:, None, :]
    m.diagonal(dim1=1, dim2=2).fill_(True)
    return m[:, None]


def bucket_documents(lengths: Sequence[int] | np.ndarray, max_padding: float = BUCKET_PADDING
                     ) -> tuple[np.ndarray, np.ndarray]:
    """``(bucket of each document, length of each bucket)``, buckets shortest first.

    Greedy: one bucket per distinct length (no padding), then repeatedly merge the two
    neighbouring buckets whose merge adds the fewest pad tokens (the shorter bucket's
    documents padded to the longer's length) while the pad tokens stay within
    ``max_padding * sum(lengths)``. Fewer buckets mean fewer, larger SDPA calls; the
    budget bounds the extra tokens (memory) and the extra work.
    """
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    distinct, which, counts = np.unique(lengths, return_inverse=True, return_counts=True)
    budget, used = max_padding * float(lengths.sum()), 0
    top, docs, first = distinct.copy(), counts.copy(), np.arange(len(distinct))
    while len(top) > 1:
        added = docs[:-1] * (top[1:] - top[:-1])     # pad tokens of merging bucket j into j + 1
        j = int(added.argmin())
        if used + added[j] > budget:
            break
        used += int(added[j])
        docs[j + 1] += docs[j]
        first[j + 1] = first[j]
        top, docs, first = np.delete(top, j), np.delete(docs, j), np.delete(first, j)
    bucket_of_distinct = np.searchsorted(first, np.arange(len(distinct)), side="right") - 1
    return bucket_of_distinct[which.reshape(-1)], top


def _document_buckets(lens: np.ndarray, doc_start: np.ndarray, seg: np.ndarray, pos: np.ndarray,
                      flat: np.ndarray, num_positions: int, sliced: np.ndarray, slices: list[SliceSegment]
                      ) -> DocumentBuckets:
    """Index tensors of ``bucket_documents`` over the documents that are not slice segments
    (``sliced`` False), beginning at flat positions ``doc_start``; ``seg``/``pos``/``flat``:
    document, position inside it and flat position of every real token. The slice
    segments' outputs follow the buckets, in the order of ``slices``."""
    whole = np.flatnonzero(~sliced)
    bucket_local, top = bucket_documents(lens[whole])
    bucket = np.full(len(lens), -1, dtype=np.int64)
    bucket[whole] = bucket_local
    counts = np.bincount(bucket_local, minlength=len(top))
    by_bucket = whole[np.argsort(bucket_local, kind="stable")]   # documents in slot order
    slot_len = top[bucket[by_bucket]]                          # padded length of each, in that order
    doc_offset = np.empty(len(lens), dtype=np.int64)           # first output slot of each document
    doc_offset[by_bucket] = np.cumsum(slot_len) - slot_len
    slot_doc = np.repeat(by_bucket, slot_len)
    slot_pos = np.arange(int(slot_len.sum())) - doc_offset[slot_doc]
    gather = doc_start[slot_doc] + np.minimum(slot_pos, lens[slot_doc] - 1)
    end = len(gather)
    for k in np.flatnonzero(sliced):                           # slice outputs follow the buckets
        doc_offset[k] = end
        end += int(lens[k])
    scatter = np.full(num_positions, end, dtype=np.int64)
    scatter[flat] = doc_offset[seg] + pos
    shapes = tuple((int(n), int(length)) for n, length in zip(counts, top))
    return DocumentBuckets(torch.from_numpy(gather), torch.from_numpy(scatter), shapes, tuple(slices))


def _check_lengths(mb: Microbatch, cfg: ModelConfig | None) -> np.ndarray:
    """The last position + 1 of each of ``mb``'s entries in its sequence, after checking them against
    ``cfg.max_seq_len`` (learned positions) and each row's tokens against ``mb.padded_len``."""
    ends_all = mb.offsets + mb.lengths
    if cfg is not None and cfg.learned_positions and ends_all.max() > cfg.max_seq_len:
        bad = mb.seq_ids[ends_all > cfg.max_seq_len]
        raise InputError(f"sequences {bad[:10].tolist()} are longer than max_seq_len {cfg.max_seq_len} (they reach "
                         f"position {int(ends_all.max())}; learned positions: size them from the trace, e.g. "
                         f"--model {cfg.name.split(':')[0]}:max_seq_len={int(ends_all.max())})")
    row_len = np.bincount(mb.row_ids, weights=mb.lengths, minlength=mb.batch).astype(np.int64)
    if row_len.max() > mb.padded_len:
        r = int(row_len.argmax())
        raise InputError(f"row {r} holds {int(row_len[r])} tokens (sequences "
                         f"{mb.seq_ids[mb.row_ids == r].tolist()}) > padded_len {mb.padded_len}")
    return ends_all


def _token_stream(mb: Microbatch, tokens: Sequence[torch.Tensor | np.ndarray], order: np.ndarray,
                  cfg: ModelConfig | None) -> torch.Tensor:
    """Each of ``mb``'s entries' ``length + 1`` ids (from its offset) back to back, in ``order``; the ids
    checked against ``cfg``'s vocabulary."""
    chunks = []
    for k in order:
        sid, n, off = int(mb.seq_ids[k]), int(mb.lengths[k]), int(mb.offsets[k])
        if sid >= len(tokens):
            raise InputError(f"sequence {sid} has no tokens ({len(tokens)} given)")
        t = torch.as_tensor(tokens[sid], dtype=torch.int64).reshape(-1)
        if t.numel() < off + n + 1:
            raise InputError(f"sequence {sid} has {t.numel()} tokens, needs length + 1 = {off + n + 1} (offset {off})")
        chunks.append(t[off: off + n + 1])
    stream = torch.cat(chunks)
    if cfg is not None and (stream.min() < 0 or stream.max() >= cfg.vocab_size):
        raise InputError(f"token ids must lie in [0, {cfg.vocab_size}), got [{int(stream.min())}, {int(stream.max())}]")
    return stream


def _attention_path(mb: Microbatch, cfg: ModelConfig | None) -> str:
    """The attention path of ``mb``: ``dense`` (the mask ablation), ``document`` (packed rows or slices
    under ``auto``) or ``causal``."""
    mode = "auto" if cfg is None else cfg.attention
    if mb.has_slices and mode == "dense":
        raise InputError("slices of long sequences need --attention auto (the dense mask ablation has no prefix)")
    return "dense" if mode == "dense" else "document" if (mb.is_packed or mb.has_slices) else "causal"


def make_inputs(mb: Microbatch, tokens: Sequence[torch.Tensor | np.ndarray], *, cfg: ModelConfig | None = None,
                device: torch.device | str | None = None) -> MicrobatchInputs:
    """Lay out ``mb``'s sequences in ``mb.batch`` rows of ``mb.padded_len`` tokens.

    ``tokens[seq_id]`` holds at least ``length + 1`` ids (see ``synthetic_tokens``; a
    truncated sequence uses its first ``length + 1``). Sequences sharing a row are
    concatenated in order and the row is padded on the right. With ``cfg`` the
    lengths are checked against ``cfg.max_seq_len`` (learned positions only) and the ids against the vocabulary,
    and ``cfg.attention`` picks the attention path (``auto`` without ``cfg``): the dense
    mask is built only for ``dense``, the bucket indices only for packed rows under ``auto``.
    Vectorised: one Python step per sequence, none per token.
    """
    b, s = mb.batch, mb.padded_len
    ends_all = _check_lengths(mb, cfg)
    order = np.argsort(mb.row_ids, kind="stable")        # sequences grouped by row, in order
    rows, lens = mb.row_ids[order], mb.lengths[order]
    stream = _token_stream(mb, tokens, order, cfg)

    start = np.cumsum(lens) - lens                        # start of each sequence among real tokens
    first_in_row = np.searchsorted(rows, rows, side="left")
    doc_start = rows * s + start - start[first_in_row]    # flat position where each sequence begins
    seg = np.repeat(np.arange(len(order)), lens)          # sequence (in `order`) of each real token
    pos = np.arange(int(lens.sum())) - start[seg]         # position inside its document
    flat = doc_start[seg] + pos
    src = torch.from_numpy((start + np.arange(len(order)))[seg] + pos)  # index into `stream`

    def fill(value: int, data: torch.Tensor) -> torch.Tensor:
        out = torch.full((b * s,), value, dtype=torch.int64)
        out[torch.from_numpy(flat)] = data
        return out.view(b, s)

    offs = mb.offsets[order]
    named = dict(input_ids=fill(0, stream[src]), labels=fill(IGNORE_INDEX, stream[src + 1]),
                 position_ids=fill(0, torch.from_numpy(offs[seg] + pos)),
                 doc_ids=fill(-1, torch.from_numpy(order[seg])))
    path = _attention_path(mb, cfg)
    buckets = None
    if path == "document":
        sliced = mb.slice_mask[order]
        slices = [SliceSegment(int(mb.seq_ids[order[k]]), int(offs[k]), int(lens[k]), bool(mb.continued[order[k]]),
                               torch.from_numpy(doc_start[k] + np.arange(int(lens[k]))))
                  for k in np.flatnonzero(sliced)]
        buckets = _document_buckets(lens, doc_start, seg, pos, flat, b * s, sliced, slices)
    if device is not None:
        named = {k: v.to(device) for k, v in named.items()}
        buckets = None if buckets is None else buckets.to(device)
    return MicrobatchInputs(input_ids=named["input_ids"], labels=named["labels"], position_ids=named["position_ids"],
                            doc_ids=named["doc_ids"], loss_mask=named["doc_ids"] >= 0, num_real_tokens=int(lens.sum()),
                            max_doc_len=int(ends_all.max()), attention=path, buckets=buckets,
                            attn_mask=attention_mask(named["doc_ids"]) if path == "dense" else None)
