"""The LM head split by vocabulary over the last stages (``ModelConfig.head_split``, ``dynmb.models.head``).

A pipeline whose head is split into shards must equal the single-stage model of the same seed: the
shards hold the whole head's rows, the loss is the same and every parameter's gradient is the
reference's (a shard's against the reference head's rows), for both families, padded and packed
rows, slices of a long sequence, full recomputation, the I/W split and ``reduction="none"``; a 16-bit
model sends the fp32 statistics as high and low parts. Refusals: transformers stages, a model of the
user's own. Real gloo ranks: ``tests/test_stage_split.py`` (dynmb's runtime) and
``tests/test_torch_pipelining.py`` (torch's).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import dynmb.models.head as head_mod
from dynmb.core.config import ModelConfig
from dynmb.core.model_sizes import HEAD_STATS
from dynmb.models import build_stages, hidden_shape, make_inputs, reference_grads, synthetic_tokens
from dynmb.models.head import decode_stats, encode_stats, full_head_weight, head_name
from dynmb.core.types import Microbatch, Plan
from tests.plan_runner import mixed_plan, run_plan, sliced_plan

F64 = torch.float64
SEED = 3
# (layer_split, head_split) for vocab 512: a shard beside all layers on the first stage; two row-only
# stages; a shard on a stage ending in half a block; three shards, the first beside a layer
SPLITS = {"4-0": ((4, 0), (200, 312)),
          "2-2-0-0": ((2, 2, 0, 0), (0, 0, 200, 312)),
          "2-1.5-0.5-0": ((2, 1.5, 0.5, 0), (0, 0, 100, 412)),
          "3-1-0-0": ((3, 1, 0, 0), (0, 5, 300, 207))}


def _cfg(preset: str, split: str, **kw) -> tuple[ModelConfig, ModelConfig]:
    base = ModelConfig.preset(preset, max_seq_len=256, **kw)
    layers, rows = SPLITS[split]
    return base, replace(base, layer_split=layers, head_split=rows)


def _run(plan: Plan, tokens, cfg: ModelConfig, P: int, dtype=F64, *, recompute: bool = False, split: bool = False):
    """``plan`` through the ``P`` stages of ``cfg`` as the runtime runs it (``tests.plan_runner``): the stages
    and the token-weighted loss."""
    return run_plan(plan, tokens, cfg, P, dtype, seed=SEED, recompute=recompute, split=split)


def _check_against_reference(stages, base: ModelConfig, cfg: ModelConfig, P: int, ref: dict[str, torch.Tensor],
                             tol: float) -> None:
    """Every parameter's gradient is the reference's; a shard's is the reference head's rows."""
    seen = set()
    for st, rows in zip(stages, cfg.stage_vocab(P)):
        for name, p in st.named_parameters():
            r = ref[name] if name in ref else ref["lm_head.weight"][rows.start:rows.stop]
            assert name in ref or name == f"{head_name(rows, cfg.vocab_size)}.weight", name
            g = torch.zeros_like(p) if p.grad is None else p.grad
            err = float((g.to(F64) - r.to(F64)).norm() / r.to(F64).norm().clamp_min(1e-30))
            assert err <= tol, (name, err)
            seen.add(name if name in ref else "lm_head.weight")
    assert seen == set(ref)


# --------------------------------------------------------------------------- structure
@pytest.mark.parametrize("preset", ["llama-tiny", "tiny"])
@pytest.mark.parametrize("split", list(SPLITS))
def test_shards_hold_the_whole_heads_rows_under_unique_names(preset, split):
    base, cfg = _cfg(preset, split)
    P = len(cfg.head_split)
    whole = dict(build_stages(base, 1, SEED)[0].named_parameters())
    stages = build_stages(cfg, P, SEED)
    names = [n for st in stages for n, _ in st.named_parameters()]
    assert len(names) == len(set(names))
    got = {n: p for st in stages for n, p in st.named_parameters()}
    assert torch.equal(full_head_weight(got, cfg, P), whole["lm_head.weight"])
    assert all(torch.equal(got[n], whole[n]) for n in whole if n != "lm_head.weight")
    for s, st in enumerate(stages):
        assert sum(p.numel() for p in st.parameters()) == cfg.stage_params(s, P)
        assert hasattr(st, "norm_f") == (s == cfg.head_stage(P))
        lin = st.head_linear()
        assert (lin is None) == (not len(cfg.stage_vocab(P)[s]))
        assert lin is None or lin.weight.shape == (len(cfg.stage_vocab(P)[s]), cfg.d_model)


def test_rows_are_seeded_per_block_so_any_split_gets_the_same_rows(monkeypatch):
    monkeypatch.setattr(head_mod, "ROW_BLOCK", 64)          # shards crossing block boundaries
    base, cfg = _cfg("llama-tiny", "3-1-0-0")
    whole = build_stages(base, 1, SEED)[0].lm_head.weight
    got = {n: p for st in build_stages(cfg, 4, SEED) for n, p in st.named_parameters()}
    assert torch.equal(full_head_weight(got, cfg, 4), whole)
    assert not torch.equal(whole[:64], whole[64:128])


def test_message_shapes_follow_the_stage():
    _, cfg = _cfg("llama-tiny", "2-2-0-0")
    mb = Microbatch(seq_ids=[0, 1], lengths=[5, 7], padded_len=8, batch=2)
    assert [hidden_shape(mb, cfg, s, 4) for s in range(4)] == [(2, 8, 64), (2, 8, 64), (2, 8, 64 + HEAD_STATS),
                                                                (2, 8, 64)]
    assert hidden_shape(mb, cfg) == (2, 8, 64)
    bf16 = replace(cfg, dtype="bfloat16")
    assert hidden_shape(mb, bf16, 2, 4) == (2, 8, 64 + 2 * HEAD_STATS)


# --------------------------------------------------------------------------- exact gradients
@pytest.mark.parametrize("preset", ["llama-tiny", "tiny"])
@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("mode", ["plain", "recompute", "split-backward"])
def test_sharded_pipelines_give_the_single_stage_gradients(preset, split, mode):
    base, cfg = _cfg(preset, split)
    P = len(cfg.head_split)
    plan, lengths = mixed_plan()
    tokens = synthetic_tokens(lengths, cfg.vocab_size, seed=1)
    stages, loss = _run(plan, tokens, cfg, P, recompute=mode == "recompute", split=mode == "split-backward")
    ref_loss, ref = reference_grads(base, 1, plan, tokens, SEED, dtype=F64)
    assert abs(loss - ref_loss) <= 1e-12 * ref_loss
    _check_against_reference(stages, base, cfg, P, ref, 1e-10)


@pytest.mark.parametrize("preset", ["llama-tiny", "tiny"])
@pytest.mark.parametrize("mode", ["plain", "recompute", "split-backward"])
def test_slices_of_a_long_sequence_through_a_sharded_head(preset, mode):
    base, cfg = _cfg(preset, "2-1.5-0.5-0")
    plan, lengths = sliced_plan()
    tokens = synthetic_tokens(lengths, cfg.vocab_size, seed=2)
    stages, loss = _run(plan, tokens, cfg, 4, recompute=mode == "recompute", split=mode == "split-backward")
    ref_loss, ref = reference_grads(base, 1, plan, tokens, SEED, dtype=F64)
    assert abs(loss - ref_loss) <= 1e-12 * ref_loss
    _check_against_reference(stages, base, cfg, 4, ref, 1e-10)


@pytest.mark.parametrize("preset", ["llama-tiny", "tiny"])
def test_fp32_sharded_gradients_within_1e5(preset):
    base, cfg = _cfg(preset, "2-2-0-0")
    plan, lengths = mixed_plan()
    tokens = synthetic_tokens(lengths, cfg.vocab_size, seed=4)
    stages, loss = _run(plan, tokens, cfg, 4, dtype=torch.float32, split=True)
    ref_loss, ref = reference_grads(base, 1, plan, tokens, SEED, dtype=torch.float32)
    assert abs(loss - ref_loss) <= 1e-5 * ref_loss
    _check_against_reference(stages, base, cfg, 4, ref, 1e-5)


@pytest.mark.parametrize("preset", ["llama-tiny", "tiny"])
def test_reduction_none_gives_the_per_token_loss_and_its_gradients(preset):
    base, cfg = _cfg(preset, "3-1-0-0")
    plan, lengths = mixed_plan()
    tokens = synthetic_tokens(lengths, cfg.vocab_size, seed=5)
    mb = plan.microbatches[1]
    inp = make_inputs(mb, tokens, cfg=cfg)
    weights = torch.rand(inp.labels.shape, dtype=F64, generator=torch.Generator().manual_seed(0))
    whole, stages = build_stages(base, 1, SEED, dtype=F64)[0], build_stages(cfg, 4, SEED, dtype=F64)
    ref = whole(None, inp, reduction="none")
    x = None
    for st in stages:
        x = st(x, inp, reduction="none")
    assert x.shape == inp.labels.shape and bool((x[~inp.loss_mask] == 0).all())
    assert float((x - ref).detach().abs().max()) <= 1e-12 * float(ref.detach().abs().max())
    (ref * weights).sum().backward()
    (x * weights).sum().backward()
    grads = {n: p.grad for n, p in whole.named_parameters()}
    _check_against_reference(stages, base, cfg, 4, grads, 1e-10)


# --------------------------------------------------------------------------- 16-bit models
def test_hi_lo_parts_keep_the_statistics_and_pass_gradients():
    x = (torch.randn(1000, HEAD_STATS, generator=torch.Generator().manual_seed(1), dtype=F64) * 10).float()
    for dtype, bits in ((torch.bfloat16, 15), (torch.float16, 20)):
        enc = encode_stats(x, dtype, 2)
        assert enc.dtype == dtype and enc.shape == (1000, 2 * HEAD_STATS)
        scale = x.abs().clamp_min(1.0)       # float16's low part of a value near 0 is subnormal: absolute there
        err = float(((decode_stats(enc, 2, torch.float32) - x).abs() / scale).max())
        one_part = float(((x.to(dtype).float() - x).abs() / scale).max())
        assert err <= 2.0 ** -bits and err < one_part / 50, (dtype, err, one_part)
    leaf = x.clone().requires_grad_(True)
    g = torch.randn(1000, HEAD_STATS)
    decode_stats(encode_stats(leaf, torch.bfloat16, 2), 2, torch.float32).backward(g)
    assert torch.equal(leaf.grad, g.to(torch.bfloat16).float())
    assert torch.equal(encode_stats(x, torch.float32, 1), x)


@pytest.mark.parametrize("preset", ["llama-tiny", "tiny"])
def test_bfloat16_shards_give_the_unsharded_loss_and_fp32_statistics(preset):
    base, cfg = _cfg(preset, "2-2-0-0", dtype="bfloat16")
    plan, lengths = mixed_plan()
    tokens = synthetic_tokens(lengths, cfg.vocab_size, seed=6)
    whole, stages = build_stages(base, 1, SEED)[0], build_stages(cfg, 4, SEED)
    for mb in plan.microbatches:
        inp = make_inputs(mb, tokens, cfg=cfg)
        ref = float(whole(None, inp).detach())
        x, msgs = None, []
        for st in stages:
            x = st(x, inp)
            msgs.append(x)
        assert msgs[2].dtype == torch.bfloat16 and msgs[2].shape[-1] == cfg.d_model + 2 * HEAD_STATS
        assert abs(float(x.detach()) - ref) <= 2e-3 * ref, (float(x.detach()), ref)
        # the statistics stage 2 sent are its shard's fp32 log-sum-exp and target logit, to ~2^-16
        with torch.no_grad():
            z = msgs[2][..., :cfg.d_model]
            lse = torch.logsumexp(stages[2].head_linear()(z).float(), -1)
            sent = decode_stats(msgs[2][..., cfg.d_model:], 2, torch.float32)
        assert float(((sent[..., 0] - lse).abs() / lse.abs()).max()) <= 2.0 ** -15
        assert float(((lse.to(torch.bfloat16).float() - lse).abs() / lse.abs()).max()) > 2.0 ** -12
        x.backward()
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for st in stages for p in st.parameters())


# --------------------------------------------------------------------------- refusals
def test_models_that_cannot_shard_the_head_are_refused():
    from dynmb.runtime.spec import refuse_foreign_head_split

    _, cfg = _cfg("llama-tiny", "2-2-0-0")
    with pytest.raises(ValueError, match=r"--model pkg.mod:factory: the LM head split by vocabulary \(head_split"):
        refuse_foreign_head_split(cfg, "--model pkg.mod:factory")
    refuse_foreign_head_split(replace(cfg, layer_split=None, head_split=None), "x")      # no split: fine


def test_transformers_stages_refuse_a_head_split():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    from dynmb.models.hf import HFStageFactory

    hf = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=2, tie_word_embeddings=False)
    factory = HFStageFactory.from_config(hf)
    factory.config = replace(factory.config, layer_split=(2, 0, 0), head_split=(0, 30, 34))
    with pytest.raises(ValueError, match="head split by vocabulary .* dynmb's own model families only"):
        factory.build_stage(1, 3)


def test_a_sharded_llama_converts_to_transformers_with_the_whole_head():
    pytest.importorskip("transformers")
    from dynmb.models.hf import llama_to_hf

    base, cfg = _cfg("llama-tiny", "3-1-0-0")
    hf = llama_to_hf(build_stages(cfg, 4, SEED), cfg)
    assert torch.equal(hf.lm_head.weight, build_stages(base, 1, SEED)[0].lm_head.weight)
