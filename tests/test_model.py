"""dynmb.models: stage split == full model, attention paths == the dense-mask reference, grouping-invariant gradients."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynmb.core.config import ModelConfig
from dynmb.memory.model import BUCKET_PADDING
from dynmb.models import (
    GPT, IGNORE_INDEX, Block, InputError, LlamaBlock, attention_mask, bucket_documents, build_stages, count_params,
    global_named_parameters, hidden_shape, make_inputs, reference_grads, synthetic_tokens, torch_dtype,
)
from dynmb.core.types import Microbatch, Plan, PlanError
from tests.plan_runner import packed_microbatch

CFG = ModelConfig.preset("tiny", max_seq_len=128)
DENSE = replace(CFG, attention="dense")


def _plan(mbs: list[Microbatch], n: int) -> Plan:
    plan = Plan(microbatches=tuple(mbs), method="test", num_stages=1, memory_limit_bytes=1, num_sequences=n)
    plan.validate()
    return plan


def _padded(ids, lengths, extra: int = 0) -> Microbatch:
    ids = np.asarray(ids)
    return Microbatch(seq_ids=ids, lengths=lengths[ids], padded_len=int(lengths[ids].max()) + extra, batch=len(ids))


_packed = packed_microbatch


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _run(stages, inputs, **kw):
    x = None
    for s in stages:
        x = s(x, inputs, **kw) if s.is_last else s(x, inputs)
    return x


def _per_seq_loss(stages, mb: Microbatch, tokens) -> dict[int, float]:
    inp = make_inputs(mb, tokens, cfg=CFG)
    ce = _run(stages, inp, reduction="none")
    m = inp.loss_mask
    sums = torch.zeros(mb.num_seqs, dtype=ce.dtype).index_add_(0, inp.doc_ids[m], ce[m])
    return {int(sid): float(v) for sid, v in zip(mb.seq_ids, sums.detach())}


# --- structure -----------------------------------------------------------------------
@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_stage_names_global_weights_equal_and_counts_match_config(P):
    full = global_named_parameters(GPT(CFG, seed=3))
    stages = build_stages(CFG, P, seed=3)
    seen: dict[str, torch.Tensor] = {}
    for s, stage in enumerate(stages):
        names = global_named_parameters(stage)
        assert not set(names) & set(seen), "a parameter lives on two stages"
        seen.update(names)
        assert count_params(stage) == CFG.stage_params(s, P)
        assert {int(k.split(".")[1]) for k in names if k.startswith("blocks.")} == set(CFG.stage_layers(P)[s])
    assert set(seen) == set(full)
    assert all(torch.equal(seen[n], full[n]) for n in full)
    assert count_params(GPT(CFG)) == CFG.param_count()
    assert {"embed.weight", "pos.weight", "blocks.3.attn.qkv.weight", "norm_f.weight", "lm_head.weight"} <= set(full)
    assert "lm_head.bias" not in full  # untied, bias-free head as in config arithmetic


@pytest.mark.parametrize("name", ["small", "gpt2", "gpt2-1b", "llama-small", "llama3.1-8b"])
def test_block_arithmetic_matches_modules(name):
    cfg = ModelConfig.preset(name)
    with torch.device("meta"):  # no memory for the big presets
        blk = (LlamaBlock if cfg.family == "llama" else Block)(cfg)
    assert count_params(blk) == cfg.block_params()
    if name == "small":
        assert count_params(GPT(cfg)) == cfg.param_count()


def test_seed_changes_weights_and_is_deterministic():
    a, b, c = GPT(CFG, seed=0), GPT(CFG, seed=0), GPT(CFG, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.embed.weight, c.embed.weight)


# --- composition -------------------------------------------------------------------
@pytest.mark.parametrize("P", [1, 2, 4])
def test_composed_stages_equal_full_model_fp32(P):
    lengths = np.array([7, 19, 3, 12, 25, 9])
    tokens = synthetic_tokens(lengths, CFG.vocab_size, seed=1)
    for mb in (_padded([0, 1, 2], lengths, extra=2), _packed(np.arange(6), lengths, rows=2, extra=1)):
        inp = make_inputs(mb, tokens, cfg=CFG)
        full, stages = GPT(CFG, seed=5), build_stages(CFG, P, seed=5)
        lf, ls = full(inp), _run(stages, inp)
        lf.backward()
        ls.backward()
        assert abs(float(lf.detach() - ls.detach())) <= 1e-5 * abs(float(lf.detach()))
        gs = {n: p.grad for s in stages for n, p in s.named_parameters()}
        for n, p in full.named_parameters():
            assert _rel(gs[n], p.grad) <= 1e-5, n
        assert ls.dim() == 0 and ls.dtype == torch.float32


@pytest.mark.parametrize("split", [(1.5, 2.5), (0.5, 2, 1.5), (1, 1.5, 1, 0.5), (4, 0), (1.5, 2.5, 0)])
@pytest.mark.parametrize("recompute", [False, True])
def test_half_block_splits_equal_full_model_fp32(split, recompute):
    """Stages that start and end between a block's attention and MLP halves compose to the whole
    model: same loss, same gradients under the same global names (the MLP half of a block on the
    stage after its attention half); a last stage of 0 layers holds the final norm and head alone."""
    lengths = np.array([7, 19, 3, 12, 25, 9])
    tokens = synthetic_tokens(lengths, CFG.vocab_size, seed=1)
    cfg = replace(CFG, layer_split=split)
    P = len(split)
    for mb in (_padded([0, 1, 2], lengths, extra=2), _packed(np.arange(6), lengths, rows=2, extra=1)):
        inp = make_inputs(mb, tokens, cfg=CFG)
        full, stages = GPT(CFG, seed=5), build_stages(cfg, P, seed=5)
        x = None
        for s in stages:
            x = s(x, inp, recompute=recompute)
        lf = full(inp)
        lf.backward()
        x.backward()
        assert abs(float(lf.detach() - x.detach())) <= 1e-5 * abs(float(lf.detach()))
        gs = {n: p.grad for s in stages for n, p in s.named_parameters()}
        assert set(gs) == {n for n, _ in full.named_parameters()}
        for n, p in full.named_parameters():
            assert _rel(gs[n], p.grad) <= 1e-5, n
    units = [(i, parts) for s in stages for i, parts in s.units]
    if any(v % 1 for v in split):
        assert [u for u in units if len(u[1]) == 1], units      # some stage holds half a block
    if split[-1] == 0:
        assert stages[-1].units == [] and any(n.startswith("lm_head") for n, _ in stages[-1].named_parameters())


# --- masking forms -------------------------------------------------------------------
def test_padded_packed_unpadded_give_same_per_sequence_loss():
    lengths = np.array([5, 17, 9, 30, 1, 12])
    n = len(lengths)
    tokens = synthetic_tokens(lengths, CFG.vocab_size, seed=2)
    stages = build_stages(CFG, 2, seed=0, dtype=torch.float64)
    alone = {}
    for i in range(n):
        alone.update(_per_seq_loss(stages, _padded([i], lengths), tokens))
    forms = [_padded(np.arange(n), lengths, extra=4)]                 # padded batch
    forms += [_padded([i], lengths, extra=11) for i in range(n)]       # one row, right padding
    forms += [_packed(np.arange(n), lengths, rows=1),                  # all documents in one row
              _packed(np.arange(n)[::-1], lengths, rows=2, extra=3),   # packed + padded rows
              _packed(np.arange(n), lengths, rows=4, extra=0)]
    for mb in forms:
        for sid, v in _per_seq_loss(stages, mb, tokens).items():
            assert abs(v - alone[sid]) <= 1e-9 * abs(alone[sid]), (mb, sid)
    # fp32 agrees too at the contract's tolerance
    s32 = build_stages(CFG, 2, seed=0)
    ref = {}
    for i in range(n):
        ref.update(_per_seq_loss(s32, _padded([i], lengths), tokens))
    for sid, v in _per_seq_loss(s32, _packed(np.arange(n), lengths, rows=2, extra=3), tokens).items():
        assert abs(v - ref[sid]) <= 1e-5 * abs(ref[sid])


def test_padding_never_produces_nan_and_pads_get_no_gradient():
    lengths = np.array([4, 1, 6])
    tokens = synthetic_tokens(lengths, CFG.vocab_size, seed=0)
    # row 1 is completely empty; all rows have padding
    mb = Microbatch(seq_ids=[0, 1, 2], lengths=lengths, padded_len=9, batch=3, row_ids=[0, 0, 2])
    inp = make_inputs(mb, tokens, cfg=CFG)
    stages = build_stages(CFG, 2)
    h = stages[0](None, inp)
    assert torch.isfinite(h).all()
    loss = stages[1](h, inp)
    loss.backward()
    assert torch.isfinite(loss)
    for s in stages:
        for n, p in s.named_parameters():
            assert torch.isfinite(p.grad).all(), n
    # changing pad token ids does not change anything real
    inp2 = make_inputs(mb, tokens, cfg=CFG)
    ids = inp2.input_ids.clone()
    ids[~inp2.loss_mask] = 7
    assert torch.allclose(_run(stages, replace(inp2, input_ids=ids)), loss.detach(), rtol=1e-6)


def test_mask_rules():
    doc = torch.tensor([[0, 0, 1, 1, 1, -1, -1]])
    m = attention_mask(doc)[0, 0]
    assert m.shape == (7, 7)
    assert m[1, 0] and not m[0, 1]                 # causal
    assert not m[2, 1] and m[4, 2]                 # document boundary
    assert not m[:5, 5:].any() and not m[5:, :5].any()  # pads neither attend nor are attended to
    assert m[5, 5] and m[6, 6] and not m[6, 5]     # a pad query sees only itself
    assert m.any(dim=-1).all()


# --- attention paths == the dense-mask reference ----------------------------------------
def _loss_and_grads(cfg: ModelConfig, mb: Microbatch, tokens, dtype=torch.float32):
    inp = make_inputs(mb, tokens, cfg=cfg)
    model = GPT(cfg, seed=4, dtype=dtype)
    loss = model(inp)
    loss.backward()
    return inp, loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _assert_matches_dense(mb: Microbatch, tokens, path: str, dtype=torch.float32, tol: float = 1e-5) -> None:
    inp, loss, grads = _loss_and_grads(CFG, mb, tokens, dtype)
    ref_inp, ref_loss, ref_grads = _loss_and_grads(DENSE, mb, tokens, dtype)
    assert inp.attention == path and inp.attn_mask is None and ref_inp.attention == "dense"
    assert abs(float(loss - ref_loss)) <= tol * abs(float(ref_loss))
    for n, g in ref_grads.items():
        assert _rel(grads[n], g) <= tol, n


def _rows_of(docs_per_row: int, rows: int, rng: np.random.Generator, extra: int = 3) -> Microbatch:
    """``rows`` rows of ``docs_per_row`` documents of uneven lengths, rows padded unevenly."""
    lengths = rng.integers(1, 24, size=rows * docs_per_row)
    row_ids = np.repeat(np.arange(rows), docs_per_row)
    fill = np.bincount(row_ids, weights=lengths, minlength=rows)
    return Microbatch(seq_ids=np.arange(len(lengths)), lengths=lengths, padded_len=int(fill.max()) + extra,
                      batch=rows, row_ids=row_ids)


def test_padded_rows_causal_without_mask_equal_dense():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 60, size=5)
    tokens = synthetic_tokens(lengths, CFG.vocab_size, seed=0)
    _assert_matches_dense(_padded(np.arange(5), lengths, extra=5), tokens, "causal")
    _assert_matches_dense(_padded([2], lengths), tokens, "causal")               # one row, no padding


@pytest.mark.parametrize("docs_per_row", [1, 4, 16, 64])
def test_packed_rows_equal_dense(docs_per_row):
    mb = _rows_of(docs_per_row, rows=2, rng=np.random.default_rng(docs_per_row))
    tokens = synthetic_tokens(mb.lengths, CFG.vocab_size, seed=1)
    _assert_matches_dense(mb, tokens, "document" if docs_per_row > 1 else "causal")
    if docs_per_row > 1:
        _assert_matches_dense(mb, tokens, "document", dtype=torch.float64, tol=1e-10)


def test_mixed_microbatch_equal_dense():
    """Rows with one document, rows with several, an empty row, uneven lengths, equal lengths."""
    lengths = np.array([40, 3, 17, 1, 9, 9, 9, 22, 5, 31, 2])
    row_ids = np.array([0, 1, 1, 1, 2, 2, 2, 4, 4, 5, 5])
    mb = Microbatch(seq_ids=np.arange(len(lengths)), lengths=lengths, padded_len=44, batch=6, row_ids=row_ids)
    tokens = synthetic_tokens(lengths, CFG.vocab_size, seed=3)
    _assert_matches_dense(mb, tokens, "document")
    _assert_matches_dense(mb, tokens, "document", dtype=torch.float64, tol=1e-10)


def test_bucketed_path_in_pipeline_stages_equals_full_model():
    mb = _rows_of(16, rows=3, rng=np.random.default_rng(5), extra=0)
    tokens = synthetic_tokens(mb.lengths, CFG.vocab_size, seed=5)
    inp = make_inputs(mb, tokens, cfg=CFG)
    assert inp.attention == "document" and len(inp.buckets.shapes) >= 1
    full, stages = GPT(CFG, seed=2), build_stages(CFG, 3, seed=2)
    lf, ls = full(inp), _run(stages, inp)
    lf.backward()
    ls.backward()
    assert abs(float(lf.detach() - ls.detach())) <= 1e-5 * abs(float(lf.detach()))
    gs = {n: p.grad for s in stages for n, p in s.named_parameters()}
    for n, p in full.named_parameters():
        assert _rel(gs[n], p.grad) <= 1e-5, n


PROP = ModelConfig(name="prop", vocab_size=64, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=64)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=14), st.integers(1, 4), st.integers(0, 3), st.randoms())
def test_any_document_layout_matches_dense_per_token(lens, rows, extra, rnd):
    """Per-token loss at real tokens and gradients of the auto paths equal the dense mask's (float64)."""
    lengths = np.array(lens)
    row_ids = [rnd.randrange(rows) for _ in lens]
    fill = np.bincount(row_ids, weights=lengths, minlength=rows)
    mb = Microbatch(seq_ids=np.arange(len(lens)), lengths=lengths, padded_len=int(fill.max()) + extra,
                    batch=rows, row_ids=row_ids)
    tokens = synthetic_tokens(lengths, PROP.vocab_size, seed=0)
    out = {}
    for attention in ("auto", "dense"):
        cfg = replace(PROP, attention=attention)
        inp = make_inputs(mb, tokens, cfg=cfg)
        model = GPT(cfg, seed=1, dtype=torch.float64)
        ce = model(inp, reduction="none")
        ce.sum().backward()
        out[attention] = (ce.detach()[inp.loss_mask], [p.grad for p in model.parameters()])
    torch.testing.assert_close(out["auto"][0], out["dense"][0], rtol=1e-10, atol=1e-12)
    for g, ref in zip(out["auto"][1], out["dense"][1]):
        torch.testing.assert_close(g, ref, rtol=1e-9, atol=1e-12)


# --- document buckets ------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=200), st.sampled_from([0.0, 1 / 16, 0.25]))
def test_bucket_padding_stays_within_budget(lens, max_padding):
    lengths = np.array(lens)
    bucket, top = bucket_documents(lengths, max_padding)
    assert np.all(np.diff(top) > 0)                                   # shortest first, distinct
    assert np.all(lengths <= top[bucket])
    assert np.all(top == [lengths[bucket == j].max() for j in range(len(top))])
    assert (top[bucket] - lengths).sum() <= max_padding * lengths.sum() + 1e-9
    if max_padding == 0:
        assert len(top) == len(np.unique(lengths))


def test_bucket_counts_examples():
    assert len(bucket_documents(np.full(64, 64))[1]) == 1                          # equal documents: one bucket
    assert len(bucket_documents(np.array([100] * 30 + [101] * 30))[1]) == 1        # nearly equal: merged
    assert len(bucket_documents(np.array([1, 1000]))[1]) == 2                       # too much padding: kept apart
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5, 1, size=64).astype(int), 1, 4096)
    bucket, top = bucket_documents(lengths)
    assert len(top) <= 16 and (top[bucket] - lengths).sum() <= BUCKET_PADDING * lengths.sum()


def test_bucket_indices_round_trip():
    lengths = np.array([5, 3, 3, 7, 1, 2, 6])
    mb = Microbatch(seq_ids=np.arange(7), lengths=lengths, padded_len=12, batch=3, row_ids=[0, 0, 1, 1, 2, 2, 2])
    inp = make_inputs(mb, synthetic_tokens(lengths, CFG.vocab_size), cfg=CFG)
    bk = inp.buckets
    assert sum(bk.split_sizes()) == bk.bucket_tokens and bk.scatter_index.shape == (3 * 12,)
    flat = torch.arange(3 * 12)
    slots = bk.scatter_index
    real = inp.loss_mask.flatten()
    assert torch.equal(bk.gather_index[slots[real]], flat[real])      # every real token comes back to itself
    assert bool((slots[~real] == bk.bucket_tokens).all())             # pads read the zero row
    doc = inp.doc_ids.flatten()
    assert bool((doc[bk.gather_index] >= 0).all())                    # bucket pad slots copy a real token


# --- grouping invariance ---------------------------------------------------------------
def _random_grouping(lengths: np.ndarray, rng: np.random.Generator) -> list[Microbatch]:
    perm = rng.permutation(len(lengths))
    cuts = np.sort(rng.choice(np.arange(1, len(lengths)), size=rng.integers(1, 5), replace=False))
    mbs = []
    for part in np.split(perm, cuts):
        if rng.random() < 0.5:
            mbs.append(_padded(part, lengths, extra=int(rng.integers(0, 4))))
        else:
            mbs.append(_packed(part, lengths, rows=int(rng.integers(1, len(part) + 1)), extra=int(rng.integers(0, 3))))
    return mbs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_any_grouping_gives_the_same_gradient(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 40, size=10)
    n = len(lengths)
    tokens = synthetic_tokens(lengths, CFG.vocab_size, seed=seed)
    one_loss, one = reference_grads(CFG, 1, _plan([_padded(np.arange(n), lengths)], n), tokens, dtype=torch.float64)
    for trial in range(2):
        plan = _plan(_random_grouping(lengths, rng), n)
        loss, grads = reference_grads(CFG, 2, plan, tokens, dtype=torch.float64)
        assert abs(loss - one_loss) <= 1e-10 * one_loss
        assert set(grads) == set(one)
        for k in one:
            if one[k].norm() > 0:
                assert _rel(grads[k], one[k]) <= 1e-5, (trial, k)
            else:
                assert grads[k].norm() == 0


# --- inputs ------------------------------------------------------------------
def test_make_inputs_layout():
    lengths = np.array([3, 2, 4])
    tokens = synthetic_tokens(lengths, CFG.vocab_size, seed=9)
    mb = Microbatch(seq_ids=[2, 0, 1], lengths=lengths[[2, 0, 1]], padded_len=8, batch=2, row_ids=[1, 0, 0])
    inp = make_inputs(mb, tokens, cfg=CFG)
    assert inp.input_ids.shape == inp.labels.shape == inp.position_ids.shape == (2, 8)
    assert inp.attention == "document" and inp.attn_mask is None      # packed under auto: no (s, s) mask
    assert inp.num_real_tokens == 9 and int(inp.loss_mask.sum()) == 9
    t0, t1, t2 = tokens
    assert inp.input_ids[0, :5].tolist() == t0[:-1].tolist() + t1[:-1].tolist()
    assert inp.labels[0, :5].tolist() == t0[1:].tolist() + t1[1:].tolist()
    assert inp.input_ids[1, :4].tolist() == t2[:-1].tolist()
    assert inp.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 0, 0], [0, 1, 2, 3, 0, 0, 0, 0]]
    assert inp.doc_ids.tolist() == [[1, 1, 1, 2, 2, -1, -1, -1], [0, 0, 0, 0, -1, -1, -1, -1]]
    assert (inp.labels[~inp.loss_mask] == IGNORE_INDEX).all()
    assert hidden_shape(mb, CFG) == (2, 8, CFG.d_model)
    dense = make_inputs(mb, tokens, cfg=DENSE)
    assert dense.attn_mask.shape == (2, 1, 8, 8) and dense.attn_mask.dtype == torch.bool
    assert torch.equal(dense.to("cpu").attn_mask, dense.attn_mask)
    moved = inp.to("cpu")
    assert moved.buckets.shapes == inp.buckets.shapes
    assert torch.equal(moved.buckets.gather_index, inp.buckets.gather_index)


def test_synthetic_tokens_deterministic_and_per_sequence():
    a = synthetic_tokens([3, 5, 2], 100, seed=4)
    b = synthetic_tokens([3, 9, 2, 7], 100, seed=4)
    assert [len(t) for t in a] == [4, 6, 3] and a[0].dtype == torch.int64
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])
    assert not torch.equal(a[0], synthetic_tokens([3], 100, seed=5)[0])
    assert all(int(t.max()) < 100 and int(t.min()) >= 0 for t in b)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=8), st.integers(1, 4), st.integers(0, 3), st.randoms())
def test_make_inputs_places_every_token_once(lens, rows, extra, rnd):
    lengths = np.array(lens)
    row_ids = [rnd.randrange(rows) for _ in lens]
    fill = np.bincount(row_ids, weights=lengths, minlength=rows)
    mb = Microbatch(seq_ids=np.arange(len(lens)), lengths=lengths, padded_len=int(fill.max()) + extra,
                    batch=rows, row_ids=row_ids)
    tokens = synthetic_tokens(lengths, CFG.vocab_size, seed=0)
    inp = make_inputs(mb, tokens)
    for k, L in enumerate(lens):
        r, c = np.nonzero((inp.doc_ids == k).numpy())
        assert len(r) == L and (r == row_ids[k]).all() and (np.diff(c) == 1).all()
        assert inp.input_ids[r, c].tolist() == tokens[k][:-1].tolist()
        assert inp.labels[r, c].tolist() == tokens[k][1:].tolist()
        assert inp.position_ids[r, c].tolist() == list(range(L))
    assert inp.num_real_tokens == int(inp.loss_mask.sum()) == sum(lens)


def test_make_inputs_errors_are_clear():
    lengths = np.array([5, 6])
    tokens = synthetic_tokens(lengths, CFG.vocab_size, seed=0)
    with pytest.raises(PlanError, match="padded_len"):
        Microbatch(seq_ids=[0, 1], lengths=lengths, padded_len=8, batch=1, row_ids=[0, 0])
    mb = Microbatch(seq_ids=[0, 1], lengths=lengths, padded_len=11, batch=1, row_ids=[0, 0])
    object.__setattr__(mb, "padded_len", 8)  # bypass Microbatch's own check
    with pytest.raises(InputError, match=r"row 0 holds 11 tokens .* padded_len 8"):
        make_inputs(mb, tokens)
    short = ModelConfig.preset("tiny", max_seq_len=5)
    with pytest.raises(InputError, match=r"sequences \[1\] are longer than max_seq_len 5"):
        make_inputs(_padded([0, 1], lengths), tokens, cfg=short)
    with pytest.raises(InputError, match="needs length"):
        make_inputs(_padded([0, 1], lengths), [t[:3] for t in tokens])
    with pytest.raises(InputError, match="token ids must lie"):
        make_inputs(_padded([0], lengths), [t + 10**6 for t in tokens], cfg=CFG)
    with pytest.raises(InputError, match="max_seq_len"):
        GPT(short)(make_inputs(_padded([0, 1], lengths), tokens))


def test_dtypes_follow_config():
    cfg = ModelConfig.preset("tiny", dtype="bfloat16", max_seq_len=64)
    assert torch_dtype(cfg) == torch.bfloat16
    lengths = np.array([6, 3])
    mb = _packed(np.arange(2), lengths, rows=1, extra=1)
    inp = make_inputs(mb, synthetic_tokens(lengths, cfg.vocab_size, 0), cfg=cfg)
    s0, s1 = build_stages(cfg, 2)
    h = s0(None, inp)
    assert h.dtype == torch.bfloat16 and tuple(h.shape) == hidden_shape(mb, cfg)
    loss = s1(h, inp)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


def test_full_microbatch_has_no_padding():
    from dynmb.models import full_microbatch
    mb = full_microbatch(3, 10, docs_per_row=4)
    assert mb.batch == 3 and mb.padded_len == 10 and mb.real_tokens == 30 and mb.is_packed
    inp = make_inputs(mb, synthetic_tokens(mb.lengths, CFG.vocab_size, 0), cfg=CFG)
    assert bool(inp.loss_mask.all()) and inp.position_ids[0].tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 0, 1]
    with pytest.raises(InputError, match="docs_per_row"):
        full_microbatch(1, 4, docs_per_row=5)


def test_stage_boundary_detach_like_the_runtime_matches_reference():
    """What a pipeline rank does: detach at the boundary, send the input grad back."""
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 30, size=8)
    tokens = synthetic_tokens(lengths, CFG.vocab_size, seed=7)
    plan = _plan(_random_grouping(lengths, rng), len(lengths))
    ref_loss, ref = reference_grads(CFG, 1, plan, tokens, seed=2)
    stages = build_stages(CFG, 3, seed=2)
    total, loss_sum = plan.real_tokens, 0.0
    for mb in plan.microbatches:
        inp = make_inputs(mb, tokens, cfg=CFG)
        outs, ins, x = [], [], None
        for s in stages:  # forward, one "rank" at a time
            x_in = None if x is None else x.detach().requires_grad_()
            x = s(x_in, inp)
            ins.append(x_in)
            outs.append(x)
        loss_sum += float(outs[-1].detach())
        grad = None
        for s, out, x_in in zip(reversed(stages), reversed(outs), reversed(ins)):
            (out / total).backward() if grad is None else out.backward(grad)
            grad = None if x_in is None else x_in.grad
    assert abs(loss_sum / total - ref_loss) <= 1e-5 * ref_loss
    for s in stages:
        for n, p in s.named_parameters():
            if ref[n].norm() > 0:
                assert _rel(p.grad, ref[n]) <= 1e-5, n


# --- the stage contract ----------------------------------------------------------------
class _OwnFactory:
    """A StageFactory outside dynmb's families (wraps one, as a user's would)."""

    config = ModelConfig.preset("tiny", n_layers=2)
    attention_work = "masked"

    def build_stage(self, stage, num_stages, *, seed=0, dtype=None, device=None):
        return build_stages(self.config, num_stages, seed, dtype=dtype, device=device)[stage]


def own_factory() -> _OwnFactory:
    return _OwnFactory()


def test_resolve_model_takes_presets_files_and_factories(tmp_path):
    from dynmb.models import FamilyFactory, StageFactory, StageModule, resolve_model

    fam = resolve_model("llama-small:d_model=128")
    assert isinstance(fam, FamilyFactory) and fam.config.family == "llama" and fam.config.d_model == 128
    assert fam.attention_work == "document" and resolve_model("small", attention="dense").attention_work == "masked"
    path = tmp_path / "m.json"
    path.write_text('{"family": "llama", "d_model": 64, "n_heads": 4, "n_kv_heads": 1, "rope_theta": 1e4}')
    assert resolve_model(str(path)).config.n_kv_heads == 1
    own = resolve_model("tests.test_model:own_factory")
    assert isinstance(own, StageFactory) and own.attention_work == "masked"
    stage = own.build_stage(1, 2)
    assert isinstance(stage, StageModule) and stage.is_last and not stage.is_first
    assert resolve_model(own) is own and isinstance(resolve_model(own_factory), _OwnFactory)
    for bad, msg in [("tests.test_model:nothing", "no attribute 'nothing'"), ("nosuch_mod:f", "cannot import"),
                     ("tests.test_model:ModelConfig", "not a StageFactory"), ("zzz", "unknown model preset")]:
        with pytest.raises(ValueError, match=msg):
            resolve_model(bad)


def test_families_are_a_registry_and_fields_are_checked():
    from dynmb.models import FAMILIES, GPTStage, LlamaStage, build_stage

    assert FAMILIES == {"gpt2": GPTStage, "llama": LlamaStage}
    assert isinstance(build_stage(ModelConfig.preset("llama-tiny"), 0, 2), LlamaStage)
    with pytest.raises(ValueError, match="llama fields"):
        ModelConfig.preset("tiny", n_kv_heads=2)
    with pytest.raises(ValueError, match="unknown model family"):
        ModelConfig.preset("tiny", family="mamba")
