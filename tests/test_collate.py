"""dynmb.api.collate: token tensors of a sampled microbatch and the token-weighted loss helpers.

Properties (hypothesis) over random row layouts: every document's tokens where the layout puts
them (a length n document: n input ids, labels its ids 1..n, the last its end-of-text), positions
restarting at 0 per document, labels IGNORE at every pad,
doc_ids/cu_seqlens describing the documents; the document mask is document-causal; the loss of
a document-causal model is the same in both layouts and equals the documents' own losses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import dynmb
from dynmb.api.collate import (IGNORE_INDEX, CollateError, MicrobatchDataset, collate, collate_packed, collate_padded,
                           global_loss_tokens, planned_loss_tokens, token_loss_sum)

pytestmark = pytest.mark.filterwarnings("ignore::dynmb.planning.defaults.StandInModelWarning")


@st.composite
def _microbatch(draw):
    """A random layout: documents of random lengths dealt to rows in a random order."""
    docs = draw(st.integers(1, 8))
    lengths = draw(st.lists(st.integers(1, 12), min_size=docs, max_size=docs))
    rows = draw(st.integers(1, docs))
    row_ids = np.array(draw(st.permutations(list(range(rows)) + draw(
        st.lists(st.integers(0, rows - 1), min_size=docs - rows, max_size=docs - rows)))))
    padded = int(np.bincount(row_ids, weights=lengths, minlength=rows).max()) + draw(st.integers(0, 3))
    indices = draw(st.lists(st.integers(0, 29), min_size=docs, max_size=docs, unique=True))
    return dynmb.SampledMicrobatch(indices=indices, lengths=lengths, row_ids=row_ids, rows=rows, padded_len=padded,
                                   epoch=0, global_batch=0, microbatch=0, local_index=0, local_count=1,
                                   batch_tokens=sum(lengths), batch_documents=docs)


def _tokens(seed: int = 0, n: int = 30, extra: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50, (13 + extra,), generator=g) for _ in range(n)]


@settings(max_examples=60, deadline=None)
@given(mb=_microbatch(), pad_id=st.integers(0, 99))
def test_every_document_where_its_layout_puts_it(mb, pad_id):
    tokens = _tokens()
    padded, packed = collate_padded(tokens, mb, pad_id=pad_id), collate_packed(tokens, mb)
    assert padded.input_ids.shape == mb.shape and packed.input_ids.shape == (1, mb.tokens)
    order = np.argsort(mb.row_ids, kind="stable")
    assert torch.equal(packed.cu_seqlens, torch.tensor(np.concatenate([[0], np.cumsum(mb.lengths[order])]),
                                                        dtype=torch.int32))
    assert packed.max_seqlen == padded.max_seqlen == int(mb.lengths.max())
    assert torch.equal(padded.cu_seqlens, packed.cu_seqlens)
    for b in (padded, packed):
        seen = torch.zeros_like(b.input_ids, dtype=torch.bool)
        for k in range(len(mb)):
            where = b.doc_ids == k
            r, c = where.nonzero(as_tuple=True)
            n = int(mb.lengths[k])
            assert len(c) == n and len(set(r.tolist())) == 1 and torch.equal(c, c[0] + torch.arange(n))  # contiguous
            if b.layout == "padded":
                assert int(r[0]) == int(mb.row_ids[k])
            doc = tokens[int(mb.indices[k])][:n + 1]                                    # n tokens, then end-of-text
            assert torch.equal(b.input_ids[where], doc[:-1])
            assert torch.equal(b.position_ids[where], torch.arange(n))                  # restart per document
            assert torch.equal(b.labels[where], doc[1:])                                # the ids they predict
            seen |= where
        pads = ~seen
        assert torch.all(b.doc_ids[pads] == -1) and torch.all(b.labels[pads] == IGNORE_INDEX)
        assert torch.all(b.position_ids[pads] == 0)
        if all(len(set(row[row >= 0].tolist())) <= 1 for row in b.doc_ids):
            assert torch.equal(b.attention_mask.bool(), seen)
        else:                                                    # packed rows: the padding mask is refused
            with pytest.raises(CollateError, match="cross-document attention"):
                b.attention_mask
        assert b.loss_tokens == int(mb.lengths.sum()) == planned_loss_tokens(mb)
    assert torch.all(padded.input_ids[padded.doc_ids < 0] == pad_id)


@settings(max_examples=30, deadline=None)
@given(mb=_microbatch())
def test_document_mask_is_document_causal(mb):
    b = collate_padded(_tokens(), mb)
    m = b.document_mask()[:, 0]
    d = b.doc_ids
    i, j = torch.meshgrid(torch.arange(mb.padded_len), torch.arange(mb.padded_len), indexing="ij")
    want = (d[:, :, None] == d[:, None, :]) & (d[:, :, None] >= 0) & (j <= i)
    assert torch.equal(m & (d[:, :, None] >= 0), want)              # real queries: same document, causal
    assert torch.all(m.diagonal(dim1=1, dim2=2))                     # pads attend to themselves only
    assert not torch.any(m & (d[:, :, None] < 0) & ~torch.eye(mb.padded_len, dtype=torch.bool))


@settings(max_examples=25, deadline=None)
@given(mb=_microbatch(), seed=st.integers(0, 1000))
def test_token_loss_sum_is_the_documents_own_next_token_loss(mb, seed):
    """A document-causal stand-in for a model: logits depend on (token, position, document) only, so each
    document's loss does not depend on the layout; the summed loss equals the documents' own, both layouts."""
    tokens = _tokens(seed)
    table = torch.randn(50, 20, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))

    def logits(ids, pos):
        return table[ids, pos.clamp(max=19)]

    ref = torch.tensor(0.0, dtype=torch.float64)
    for k in range(len(mb)):
        doc = tokens[int(mb.indices[k])][: int(mb.lengths[k]) + 1]
        ref += torch.nn.functional.cross_entropy(logits(doc[:-1], torch.arange(len(doc) - 1)), doc[1:] % 7,
                                                 reduction="sum")
    for b in (collate_padded(tokens, mb), collate_packed(tokens, mb)):
        labels = torch.where(b.labels >= 0, b.labels % 7, b.labels)
        got = token_loss_sum(logits(b.input_ids, b.position_ids), labels)
        assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12)


def test_errors_name_the_dataset_index():
    mb = dynmb.SampledMicrobatch(indices=[4, 9], lengths=[3, 5], row_ids=[0, 1], rows=2, padded_len=5, epoch=0,
                                 global_batch=0, microbatch=0, local_index=0, local_count=1, batch_tokens=8,
                                 batch_documents=2)
    tokens = _tokens()
    tokens[9] = tokens[9][:5]
    with pytest.raises(CollateError, match="dataset index 9 has 5 ids, its length 5 needs 6"):
        collate_padded(tokens, mb)
    with pytest.raises(CollateError, match="dataset index 9 has no token sequence"):
        collate_padded(tokens[:5], mb)
    tokens[9] = torch.rand(6)
    with pytest.raises(CollateError, match="dataset index 9 holds torch.float32 values"):
        collate_packed(tokens, mb)
    with pytest.raises(CollateError, match="unknown layout 'rows'"):
        collate(_tokens(), mb, layout="rows")
    with pytest.raises(CollateError, match="indexed by the sampler's SampledMicrobatch"):
        MicrobatchDataset(_tokens())[3]
    with pytest.raises(CollateError, match=r"logits \(2, 4, 7\) do not match labels \(2, 5\)"):
        token_loss_sum(torch.zeros(2, 4, 7), torch.zeros(2, 5, dtype=torch.int64))


def _sampler(lengths, rank=0, replicas=1):
    return dynmb.DynamicBatchSampler(lengths, 12, model="tiny", num_stages=1, memory_limit="12MiB",
                                     num_replicas=replicas, rank=rank, seed=3)


@pytest.mark.parametrize("workers", [0, 1])
def test_dataloader_collates_records(workers):
    lengths = np.random.default_rng(1).integers(2, 90, size=30)
    tokens = [torch.arange(int(n) + 1) + 1000 * i for i, n in enumerate(lengths)]
    sampler = _sampler(lengths)
    loader = DataLoader(MicrobatchDataset(tokens, layout="packed"), sampler=sampler, batch_size=None,
                        num_workers=workers)
    got = list(loader)
    want = [collate_packed(tokens, mb) for mb in sampler]
    assert len(got) == len(want) == len(sampler)
    for g, w in zip(got, want):
        assert torch.equal(g.input_ids, w.input_ids) and torch.equal(g.labels, w.labels)
        assert g.microbatch.indices.tolist() == w.microbatch.indices.tolist()


def test_planned_loss_tokens_count_the_whole_global_batch_over_replicas():
    lengths = np.random.default_rng(2).integers(1, 90, size=40)
    tokens = [torch.zeros(int(n) + 1, dtype=torch.int64) for n in lengths]
    per_batch: dict[int, int] = {}
    planned: dict[int, int] = {}
    for rank in range(2):
        for mb in _sampler(lengths, rank, 2):
            per_batch[mb.global_batch] = per_batch.get(mb.global_batch, 0) + collate_padded(tokens, mb).loss_tokens
            planned.setdefault(mb.global_batch, planned_loss_tokens(mb))
            assert planned[mb.global_batch] == planned_loss_tokens(mb)
    assert per_batch == planned and sum(planned.values()) == int(lengths.sum())
    assert global_loss_tokens(7) == 7                                   # no group: the local count
