"""The Llama family equals a plain per-document Llama written here, on every path dynmb runs.

The reference (``_ref_doc_loss``) is a straightforward single-document forward in fp64 from the
stages' own parameters (by global name): embedding, per layer RMSNorm, q/k/v, rotary positions
0..n-1 rotating each pair (i, i + head_dim/2) by ``p * theta**(-2i/head_dim)``, causal softmax
attention with each K/V head shared by ``heads / kv_heads`` query heads, output projection,
RMSNorm, SwiGLU, final RMSNorm, LM head, summed cross-entropy. dynmb's stages must match it in
loss and every parameter gradient for padded rows, packed rows of 1-64 documents, the dense
ablation, 2-8 slices of a document (with and without recomputation) and the I/W split; a
document moved within a packed row keeps its loss; a tiny model equals transformers'
``LlamaForCausalLM`` with the same weights; 2 and 4 gloo ranks verify against the reference.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dynmb.models.prefix as prefix_mod
from dynmb.core.config import ModelConfig, PipelineConfig, RunConfig, model_config, parse_bytes
from dynmb.models import LlamaStage, build_stages, make_inputs, reference_grads, synthetic_tokens, whole_documents
from dynmb.models.prefix import prefix_attention
from dynmb.io.results import load_results
from dynmb.runtime.spec import RunSpec
from dynmb.core.types import Microbatch, Plan
from tests.gloo_jobs import register
from tests.meter_checks import check_w_held
from tests.plan_runner import run_plan

CFG = ModelConfig.preset("llama-tiny", n_layers=3, vocab_size=97, rope_theta=500.0)
MHA = replace(CFG, name="llama-tiny-mha", n_kv_heads=None)
F64 = torch.float64


# --------------------------------------------------------------------------- the plain reference
def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w


def _rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """``x`` (n, heads, hd): pair (i, i + hd/2) of position p rotated by ``p * theta**(-2i/hd)``."""
    n, _, hd = x.shape
    half = hd // 2
    angle = torch.arange(n, dtype=F64)[:, None] * theta ** (-2.0 * torch.arange(half, dtype=F64) / hd)[None, :]
    c, s = torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


def _ref_doc_loss(p: dict[str, torch.Tensor], cfg: ModelConfig, ids: torch.Tensor) -> torch.Tensor:
    """Summed CE of one document (``ids``: its n + 1 tokens) through the plain Llama."""
    inp, lab = ids[:-1], ids[1:]
    n, h, kv, hd, f = len(inp), cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.d_ff
    x = p["embed.weight"][inp]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for i in range(cfg.n_layers):
        b = f"blocks.{i}."
        a = _rms(x, p[b + "attn_norm.weight"])
        w = p[b + "attn.qkv.weight"]
        q = (a @ w[: h * hd].T).view(n, h, hd)
        k = (a @ w[h * hd: (h + kv) * hd].T).view(n, kv, hd)
        v = (a @ w[(h + kv) * hd:].T).view(n, kv, hd)
        q, k = _rotary(q, cfg.rope_theta), _rotary(k, cfg.rope_theta)
        heads = []
        for j in range(h):
            kj, vj = k[:, j * kv // h], v[:, j * kv // h]
            scores = (q[:, j] @ kj.T) / math.sqrt(hd)
            heads.append(torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ vj)
        x = x + torch.cat(heads, -1) @ p[b + "attn.proj.weight"].T
        m = _rms(x, p[b + "mlp_norm.weight"])
        gu = p[b + "mlp.gate_up.weight"]
        x = x + (F.silu(m @ gu[:f].T) * (m @ gu[f:].T)) @ p[b + "mlp.down.weight"].T
    logits = _rms(x, p["norm_f.weight"]) @ (p["embed.weight"] if cfg.tie_embeddings else p["lm_head.weight"]).T
    return F.cross_entropy(logits, lab, reduction="sum")


def _reference(stages, cfg: ModelConfig, seq_lengths: dict[int, int], tokens) -> tuple[float, dict[str, torch.Tensor]]:
    """Token-weighted loss and gradients of the documents ``seq_lengths`` ({seq id: length})."""
    params = {n: p.detach().to(F64).clone().requires_grad_(True) for st in stages for n, p in st.named_parameters()}
    total = sum(seq_lengths.values())
    loss = sum(_ref_doc_loss(params, cfg, tokens[s][: n + 1]) for s, n in seq_lengths.items()) / total
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in params.items()}


def _check(stages, ref: dict[str, torch.Tensor], tol: float) -> None:
    for st in stages:
        for name, p in st.named_parameters():
            r = ref[name]
            g = torch.zeros_like(p) if p.grad is None else p.grad
            err = float((g.to(F64) - r).norm() / r.norm().clamp_min(1e-30))
            assert err <= tol, (name, err)


def _plan(mbs: list[Microbatch], n: int, stages: int = 2) -> Plan:
    plan = Plan(microbatches=tuple(mbs), method="test", num_stages=stages, memory_limit_bytes=1, num_sequences=n)
    plan.validate()
    return plan


def _lengths_of(plan: Plan) -> dict[int, int]:
    out: dict[int, int] = {}
    for mb in plan.microbatches:
        for s, n in zip(mb.seq_ids, mb.lengths):
            out[int(s)] = out.get(int(s), 0) + int(n)
    return out


def _run_plan(plan: Plan, tokens, cfg: ModelConfig, num_stages: int, dtype=F64, *, recompute: bool = False,
              split: bool = False):
    """Run ``plan`` through ``num_stages`` stages in one process the way the runtime does
    (``tests.plan_runner``); the stages after the backwards."""
    return run_plan(plan, tokens, cfg, num_stages, dtype, recompute=recompute, split=split)[0]


def _packed(lengths: np.ndarray, rows: int, extra: int = 0) -> Microbatch:
    fill, row_ids = np.zeros(rows, dtype=np.int64), []
    for n in lengths:
        r = int(fill.argmin())
        row_ids.append(r)
        fill[r] += n
    return Microbatch(seq_ids=np.arange(len(lengths)), lengths=lengths, padded_len=int(fill.max()) + extra, batch=rows,
                      row_ids=row_ids)


# --------------------------------------------------------------------------- structure and presets
def test_stages_have_global_seeded_names_and_the_configs_sizes():
    whole = build_stages(CFG, 1, seed=4)[0]
    names = dict(whole.named_parameters())
    assert {"embed.weight", "blocks.2.attn.qkv.weight", "blocks.0.mlp.gate_up.weight", "norm_f.weight",
            "lm_head.weight"} <= set(names)
    assert not any(n.endswith("bias") for n in names) and "pos.weight" not in names
    for P in (2, 3):
        stages = build_stages(CFG, P, seed=4)
        split = {n: p for st in stages for n, p in st.named_parameters()}
        assert set(split) == set(names) and all(torch.equal(split[n], names[n]) for n in names)
        assert [sum(p.numel() for p in st.parameters()) for st in stages] == [CFG.stage_params(s, P) for s in range(P)]
    assert sum(p.numel() for p in whole.parameters()) == CFG.param_count()
    kv = CFG.kv_heads * CFG.head_dim
    assert names["blocks.0.attn.qkv.weight"].shape == (CFG.d_model + 2 * kv, CFG.d_model)


@pytest.mark.parametrize("name,published", [("llama2-7b", 6.74e9), ("llama3.2-1b", 1.24e9), ("llama3.1-8b", 8.03e9)])
def test_published_presets_count_the_published_parameters(name, published):
    cfg = model_config(name)
    assert cfg.family == "llama"
    assert abs(cfg.param_count() - published) <= 0.005 * published


def test_gpt2_blocks_at_llama_widths_are_named_so_and_count_fewer_parameters():
    gpt, llama = model_config("gpt2-7b"), model_config("llama2-7b")
    assert gpt.family == "gpt2" and (gpt.d_model, gpt.n_layers, gpt.d_ff) == (llama.d_model, llama.n_layers, llama.d_ff)
    assert gpt.block_params() < llama.block_params()        # SwiGLU's third matrix
    for old in ("llama-1b", "llama-7b", "deep-13b"):
        with pytest.raises(ValueError, match="unknown model preset"):
            model_config(old)


def test_llama_flops_count_swiglu_and_grouped_kv():
    d, f, kv = CFG.d_model, CFG.d_ff, CFG.kv_heads * CFG.head_dim
    per_token = 2 * (2 * d * d + 2 * d * kv + 3 * d * f)
    one = CFG.stage_flops(0, 3, 1, 1)                      # one token, one block, no head
    assert one == per_token + 4 * d
    assert MHA.stage_flops(0, 3, 1, 1) > one


def test_tied_embeddings_run_on_one_stage_and_are_refused_across_stages():
    tied = replace(CFG, tie_embeddings=True)
    stage = build_stages(tied, 1)[0]
    assert "lm_head.weight" not in dict(stage.named_parameters())
    assert sum(p.numel() for p in stage.parameters()) == tied.param_count()
    with pytest.raises(ValueError, match="tie_embeddings across 2 pipeline stages"):
        build_stages(tied, 2)


# --------------------------------------------------------------------------- exact against the plain Llama
@pytest.mark.parametrize("cfg", [CFG, MHA, replace(CFG, tie_embeddings=True)], ids=["gqa", "mha", "tied"])
def test_padded_rows_equal_the_plain_llama(cfg):
    lengths = np.array([13, 5, 21, 9])
    tokens = synthetic_tokens(lengths, cfg.vocab_size, seed=1)
    mbs = [Microbatch(seq_ids=[0, 1], lengths=lengths[[0, 1]], padded_len=16, batch=2),
           Microbatch(seq_ids=[2, 3], lengths=lengths[[2, 3]], padded_len=24, batch=2)]
    plan = _plan(mbs, 4)
    P = 1 if cfg.tie_embeddings else 2
    assert all(make_inputs(mb, tokens, cfg=cfg).attention == "causal" for mb in mbs)
    stages = _run_plan(plan, tokens, cfg, P)
    loss_ref, ref = _reference(stages, cfg, _lengths_of(plan), tokens)
    _check(stages, ref, 1e-10)
    loss, _ = reference_grads(cfg, P, plan, tokens, dtype=F64)
    assert abs(loss - loss_ref) <= 1e-12 * loss_ref


@pytest.mark.parametrize("docs,rows", [(1, 1), (7, 2), (64, 1), (64, 4)])
def test_packed_rows_equal_the_plain_llama(docs, rows):
    rng = np.random.default_rng(docs + rows)
    lengths = rng.integers(1, 24, size=docs)
    tokens = synthetic_tokens(lengths, CFG.vocab_size, seed=docs)
    mb = _packed(lengths, rows, extra=3)
    plan = _plan([mb], docs)
    expect = "document" if mb.is_packed else "causal"
    assert make_inputs(mb, tokens, cfg=CFG).attention == expect
    stages = _run_plan(plan, tokens, CFG, 2)
    _, ref = _reference(stages, CFG, _lengths_of(plan), tokens)
    _check(stages, ref, 1e-10)


def test_dense_ablation_equals_the_plain_llama():
    cfg = replace(CFG, attention="dense")
    lengths = np.array([6, 11, 3, 9, 14])
    tokens = synthetic_tokens(lengths, cfg.vocab_size, seed=2)
    plan = _plan([_packed(lengths, 2, extra=2)], 5)
    assert make_inputs(plan.microbatches[0], tokens, cfg=cfg).attention == "dense"
    stages = _run_plan(plan, tokens, cfg, 3)
    _, ref = _reference(stages, cfg, _lengths_of(plan), tokens)
    _check(stages, ref, 1e-10)


def _sliced_plan(splits: tuple[int, ...], packed: bool, recompute: bool = False) -> tuple[Plan, np.ndarray]:
    """Sequence 0 in ``len(splits)`` slices, one per microbatch, each beside two short documents
    (in rows of their own, or one sharing the slice's row)."""
    n = len(splits)
    lengths = np.array([sum(splits)] + [9 + 3 * i for i in range(2 * n)], dtype=np.int64)
    mbs, off = [], 0
    for j, s in enumerate(splits):
        a, b = 1 + 2 * j, 2 + 2 * j
        if packed:
            mbs.append(Microbatch([a, 0, b], [lengths[a], s, lengths[b]], max(s + lengths[a], lengths[b]), 2,
                                  row_ids=[0, 0, 1], offsets=[0, off, 0], continued=[False, j < n - 1, False],
                                  recompute=recompute))
        else:
            mbs.append(Microbatch([0, a, b], [s, lengths[a], lengths[b]], max(s, lengths[b]), 3, offsets=[off, 0, 0],
                                  continued=[j < n - 1, False, False], recompute=recompute))
        off += s
    plan = Plan(tuple(mbs), "dynamic", 2, 1 << 30, len(lengths))
    plan.validate(lengths)
    return plan, lengths


@pytest.mark.parametrize("splits,packed,recompute", [((30, 40), False, False), ((20, 35, 15), True, True),
                                                     ((12,) * 8, True, False), ((12,) * 8, False, True)])
def test_slices_equal_the_plain_llama(splits, packed, recompute):
    """Rotary positions continue across slices; the prefix store holds post-rotary, grouped K/V."""
    plan, lengths = _sliced_plan(splits, packed, recompute)
    tokens = synthetic_tokens(lengths, CFG.vocab_size, seed=5)
    stages = _run_plan(plan, tokens, CFG, 2)
    _, ref = _reference(stages, CFG, _lengths_of(plan), tokens)
    _check(stages, ref, 1e-10)
    assert len(whole_documents(plan)) == len(splits) + 1


def test_sliced_fp32_gradients_equal_the_whole_document_within_1e5():
    plan, lengths = _sliced_plan((25, 25, 25), True)
    tokens = synthetic_tokens(lengths, CFG.vocab_size, seed=6)
    stages = _run_plan(plan, tokens, CFG, 2, dtype=torch.float32)
    _, ref = reference_grads(CFG, 2, plan, tokens, dtype=torch.float32)
    _check(stages, {n: g.to(F64) for n, g in ref.items()}, 1e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_recomputation_equals_the_plain_llama(packed):
    lengths = np.array([15, 4, 22, 8, 11])
    tokens = synthetic_tokens(lengths, CFG.vocab_size, seed=7)
    mb = _packed(lengths, 2) if packed else Microbatch(seq_ids=np.arange(5), lengths=lengths, padded_len=22, batch=5)
    plan = _plan([mb], 5)
    stages = _run_plan(plan, tokens, CFG, 2, recompute=True)
    _, ref = _reference(stages, CFG, _lengths_of(plan), tokens)
    _check(stages, ref, 1e-10)


@pytest.mark.parametrize("P", [2, 3])
def test_split_backward_i_then_w_equals_the_plain_llama(P):
    lengths = np.array([10, 17, 6, 13, 9, 20])
    tokens = synthetic_tokens(lengths, CFG.vocab_size, seed=8)
    mbs = [_packed(lengths[:3], 1), Microbatch(seq_ids=[3, 4, 5], lengths=lengths[3:], padded_len=20, batch=3)]
    plan = _plan(mbs, 6, P)
    stages = _run_plan(plan, tokens, CFG, P, split=True)
    _, ref = _reference(stages, CFG, _lengths_of(plan), tokens)
    _check(stages, ref, 1e-10)


@pytest.mark.parametrize("split", [(1.5, 1.5), (0.5, 2, 0.5), (3, 0)])
@pytest.mark.parametrize("mode", ["slices", "slices-recompute", "recompute-packed", "split-backward"])
def test_half_block_splits_equal_the_plain_llama(split, mode):
    """Stages starting and/or ending between a block's attention and MLP halves (the first stage
    attention only, the last MLP only with ``(0.5, 2, 0.5)``), and a last stage of the final norm and
    LM head alone (``(3, 0)``): slices against a prefix (only
    attention halves keep keys and values), full recomputation, packed rows and I then W all give
    the plain Llama's gradients."""
    cfg = replace(CFG, layer_split=split)
    P = len(split)
    if mode.startswith("slices"):
        plan, lengths = _sliced_plan((20, 35, 15), True, recompute=mode.endswith("recompute"))
    else:
        lengths = np.array([10, 17, 6, 13, 9, 20])
        plan = _plan([_packed(lengths[:3], 1), Microbatch(seq_ids=[3, 4, 5], lengths=lengths[3:], padded_len=20,
                                                          batch=3)], 6, P)
    tokens = synthetic_tokens(lengths, CFG.vocab_size, seed=9)
    stages = _run_plan(plan, tokens, cfg, P, recompute=mode == "recompute-packed", split=mode == "split-backward")
    assert [s.layers for s in stages][-1] == ([] if split[-1] < 1 else [2])      # (3, 0): the head alone
    _, ref = _reference(stages, cfg, _lengths_of(plan), tokens)
    _check(stages, ref, 1e-10)


def test_grouped_prefix_attention_matches_causal_sdpa_in_both_kernels(monkeypatch):
    g = torch.Generator().manual_seed(0)
    h, kv, n, p, dh = 6, 2, 19, 23, 8
    q = torch.randn(h, p + n, dh, generator=g, dtype=F64, requires_grad=True)
    k, v = (torch.randn(kv, p + n, dh, generator=g, dtype=F64, requires_grad=True) for _ in range(2))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[:, p:]
    d_out = torch.randn(ref.shape, generator=g, dtype=F64)
    want = torch.autograd.grad(ref, (q, k, v), d_out)
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(prefix_mod, "_FLASH_CPU", None)
        out = prefix_attention(q[:, p:], k[:, p:], v[:, p:], [k[:, :9], k[:, 9:p]], [v[:, :9], v[:, 9:p]])
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        for a, b in zip(torch.autograd.grad(out, (q, k, v), d_out), want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_moving_a_document_within_a_packed_row_keeps_its_loss():
    """Positions restart per document: the same document at another place in the row, beside
    other documents, has the same per-token losses."""
    lengths = np.array([12, 7, 19, 5])
    tokens = synthetic_tokens(lengths, CFG.vocab_size, seed=9)
    stage = build_stages(CFG, 1, dtype=F64)[0]
    losses = []
    for order in ([0, 1, 2, 3], [1, 3, 2, 0], [2, 0, 3, 1]):
        mb = Microbatch(seq_ids=order, lengths=lengths[order], padded_len=int(lengths.sum()) + 4, batch=1,
                        row_ids=[0] * 4)
        inp = make_inputs(mb, tokens, cfg=CFG)
        ce = stage(None, inp, reduction="none")
        m = inp.loss_mask
        per_doc = torch.zeros(len(order), dtype=F64).index_add_(0, inp.doc_ids[m], ce[m])
        losses.append({int(s): float(v) for s, v in zip(mb.seq_ids, per_doc.detach())})
    for other in losses[1:]:
        for s in range(4):
            assert abs(other[s] - losses[0][s]) <= 1e-10 * losses[0][s]
    alone = stage(None, make_inputs(Microbatch([2], [19], 19, 1), tokens, cfg=CFG))
    assert abs(float(alone) - losses[0][2]) <= 1e-10 * losses[0][2]


# --------------------------------------------------------------------------- transformers
def test_equals_transformers_llama_with_the_same_weights():
    transformers = pytest.importorskip("transformers")
    cfg = replace(CFG, n_layers=2)
    stage = build_stages(cfg, 1, seed=3)[0]
    hf_cfg = transformers.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                                      num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                                      num_key_value_heads=cfg.kv_heads, rope_theta=cfg.rope_theta,
                                      rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False,
                                      attention_bias=False, mlp_bias=False)
    hf = transformers.LlamaForCausalLM(hf_cfg).float()
    p = dict(stage.named_parameters())
    h, kv, f = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.d_ff
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(p["embed.weight"])
        for i, layer in enumerate(hf.model.layers):
            qkv = p[f"blocks.{i}.attn.qkv.weight"]
            layer.self_attn.q_proj.weight.copy_(qkv[:h])
            layer.self_attn.k_proj.weight.copy_(qkv[h:h + kv])
            layer.self_attn.v_proj.weight.copy_(qkv[h + kv:])
            layer.self_attn.o_proj.weight.copy_(p[f"blocks.{i}.attn.proj.weight"])
            layer.mlp.gate_proj.weight.copy_(p[f"blocks.{i}.mlp.gate_up.weight"][:f])
            layer.mlp.up_proj.weight.copy_(p[f"blocks.{i}.mlp.gate_up.weight"][f:])
            layer.mlp.down_proj.weight.copy_(p[f"blocks.{i}.mlp.down.weight"])
            layer.input_layernorm.weight.copy_(p[f"blocks.{i}.attn_norm.weight"])
            layer.post_attention_layernorm.weight.copy_(p[f"blocks.{i}.mlp_norm.weight"])
        hf.model.norm.weight.copy_(p["norm_f.weight"])
        hf.lm_head.weight.copy_(p["lm_head.weight"])
    lengths = np.array([31, 9, 17, 24])
    tokens = synthetic_tokens(lengths, cfg.vocab_size, seed=11)
    ours = stage(None, make_inputs(_packed(lengths, 2), tokens, cfg=cfg))      # packed rows, document path
    ours.backward()
    theirs = 0
    for t in tokens:
        logits = hf(input_ids=t[:-1][None]).logits[0]
        theirs = theirs + F.cross_entropy(logits.float(), t[1:], reduction="sum")
    theirs.backward()
    assert abs(float(ours.detach()) - float(theirs.detach())) <= 1e-5 * float(theirs.detach())
    every = slice(None)
    pairs = [("embed.weight", every, hf.model.embed_tokens.weight), ("lm_head.weight", every, hf.lm_head.weight),
             ("blocks.1.attn.proj.weight", every, hf.model.layers[1].self_attn.o_proj.weight),
             ("blocks.0.attn.qkv.weight", slice(0, h), hf.model.layers[0].self_attn.q_proj.weight),
             ("blocks.0.attn.qkv.weight", slice(h, h + kv), hf.model.layers[0].self_attn.k_proj.weight),
             ("blocks.1.mlp.gate_up.weight", slice(0, f), hf.model.layers[1].mlp.gate_proj.weight),
             ("blocks.1.mlp.down.weight", every, hf.model.layers[1].mlp.down_proj.weight),
             ("blocks.1.attn_norm.weight", every, hf.model.layers[1].input_layernorm.weight),
             ("norm_f.weight", every, hf.model.norm.weight)]
    for name, rows, theirs_p in pairs:
        err = float((p[name].grad[rows] - theirs_p.grad).norm() / theirs_p.grad.norm())
        assert err <= 1e-5, (name, err)


# --------------------------------------------------------------------------- real gloo ranks
LLAMA_RUN = ModelConfig.preset("llama-tiny")


def _llama_cases(out: Path, ranks: int) -> list[RunSpec]:
    """llama-tiny with --verify: a packed method and dynamic; on 2 ranks also a sliced document with
    recomputation and ZB-H1 (I/W); on 4 ranks interleaved (2 chunks per rank, 8 stages)."""
    trace = out / f"llama{ranks}.csv"
    trace.write_text("length\n" + "\n".join(str(x) for x in (40, 100, 700, 70, 300, 25, 90, 150)) + "\n")
    cases = {"llama-packed": dict(method="packed"), "llama-dynamic": dict(method="dynamic")}
    if ranks == 2:
        cases["llama-split"] = dict(method="dynamic", oversize="split", recompute="auto", limit="10MiB")
        cases["llama-zbh1"] = dict(method="dynamic", schedule="zb-h1")
    else:
        cases["llama-virtual"] = dict(method="dynamic", schedule="interleaved", virtual=2)
    specs = []
    for name, kw in cases.items():
        virtual = kw.pop("virtual", 1)
        pipe = PipelineConfig(num_stages=ranks * virtual, virtual=virtual, schedule=kw.pop("schedule", "1f1b"),
                              memory_limit_bytes=parse_bytes(kw.pop("limit", "1GiB")))
        model = replace(LLAMA_RUN, n_layers=8) if virtual > 1 else LLAMA_RUN
        cfg = RunConfig(model=model, pipeline=pipe, dataset=str(trace), global_batch=8, seed=0, steps=1, warmup=0,
                        backend="gloo", device="cpu", timeout_s=90.0, **kw)
        specs.append(RunSpec.create(cfg, out / name, verify=True, run_id=name))
    return specs


register(2)(lambda out: _llama_cases(out, 2))
register(4)(lambda out: _llama_cases(out, 4))


@pytest.mark.dist
@pytest.mark.parametrize("ranks", [2, 4])
def test_llama_verifies_on_gloo(gloo_job, ranks):
    job = gloo_job(ranks)
    assert job.returncode == 0, job.errors
    names = ["llama-packed", "llama-dynamic"] + (["llama-split", "llama-zbh1"] if ranks == 2 else ["llama-virtual"])
    for name in names:
        t = load_results(job.out / name)
        assert t["steps"]["verified"].all(), name
        assert (t["memory"]["peak_bytes"] <= t["memory"]["limit_bytes"]).all(), name
    split = load_results(job.out / "llama-split")["steps"] if ranks == 2 else None
    assert split is None or (split["real_tokens"] == 1475).all()


def test_llama_stage_class_is_the_family_registry_choice():
    assert all(isinstance(st, LlamaStage) for st in build_stages(CFG, 2))


def test_w_later_holds_what_the_memory_model_says():
    """Bytes the CPU meter sees held from I to W (each Linear call's input and output gradient):
    at most ``MemoryModel.w_matrix``, within 3% for one document per row."""
    from dynmb.memory.model import get_memory_model

    cfg, P, b, s = ModelConfig.preset("llama-small"), 2, 2, 128
    mm = get_memory_model(None, cfg, P)
    mb = Microbatch(seq_ids=np.arange(b), lengths=[s] * b, padded_len=s, batch=b)
    inp = make_inputs(mb, synthetic_tokens(mb.lengths, cfg.vocab_size), cfg=cfg)
    for stage, stg in enumerate(build_stages(cfg, P)):
        check_w_held(stg, stage, P, cfg.d_model, inp, mm, b, s)


@pytest.mark.parametrize("stage", [0, 1])
def test_recompute_memory_is_what_the_model_says(stage):
    """Under recomputation a llama stage holds its blocks' inputs and the shared rotary tables:
    within 10% under the model's recomputed activation bytes, its backward under act + transient."""
    import warnings

    from dynmb.memory.model import get_memory_model
    from dynmb.runtime.meter import MemoryMeter

    cfg, P, b, s = ModelConfig.preset("llama-small"), 2, 1, 512
    mm = get_memory_model(None, cfg, P)
    st = build_stages(cfg, P)[stage]
    mb = Microbatch(seq_ids=[0], lengths=[s], padded_len=s, batch=1)
    inp = make_inputs(mb, synthetic_tokens(mb.lengths, cfg.vocab_size), cfg=cfg)
    meter = MemoryMeter("cpu", [st])
    x = None if stage == 0 else torch.randn(b, s, cfg.d_model, requires_grad=True)
    meter.reset_peak()
    with meter.saving(stage):
        y = st(x, inp, recompute=True)
    held = meter.current_bytes - meter.state_bytes
    with meter.saving(stage), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.autograd.backward(y, None if stage == P - 1 else torch.ones_like(y))
    peak = meter.peak_bytes - meter.state_bytes
    meter.close()
    act = float(mm.activation_bytes(stage, b, s, recompute=True)[0])
    assert 0.9 * act <= held <= act, (held, act)
    assert peak <= act + float(mm.transient_bytes(stage, b, s, recompute=True)[0])


def test_analytic_costs_and_memory_follow_the_family():
    """Same widths: the Llama block's three MLP matrices cost more FLOPs, time and saved bytes than
    GPT-2's two; grouped K/V cost less than full K/V."""
    from dynmb.costmodel import get_cost_model
    from dynmb.memory.model import get_memory_model

    gpt, llama = model_config("gpt2-7b"), model_config("llama2-7b")
    gqa = replace(llama, name="llama2-7b-gqa", n_kv_heads=8)
    times = {c.name: float(get_cost_model(None, c, 8).predict(3, "F", [1], [2048])[0]) for c in (gpt, llama, gqa)}
    assert times["gpt2-7b"] < times["llama2-7b"] and times["llama2-7b-gqa"] < times["llama2-7b"]
    ratio = llama.stage_flops(3, 8, 1, 1) / gpt.stage_flops(3, 8, 1, 1)
    assert abs(ratio - llama.block_params() / (gpt.block_params() - 9 * gpt.d_model - gpt.d_ff)) < 0.01
    acts = {c.name: float(get_memory_model(None, c, 8).activation_bytes(3, 1, 2048)[0]) for c in (gpt, llama, gqa)}
    assert acts["gpt2-7b"] < acts["llama2-7b"] and acts["llama2-7b-gqa"] < acts["llama2-7b"]


# --------------------------------------------------------------------------- the lean blocks
def _block_saved_bytes(cfg: ModelConfig, rows: int, s: int) -> int:
    """Bytes of the distinct storages one ``LlamaBlock`` saves for backward (dense attention, one document per
    row), parameters and the stage's shared rotary tables left out (counted per stage)."""
    from dynmb.models.llama import LlamaBlock, position_tables

    block = LlamaBlock(cfg, 0).to(torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32)
    mb = Microbatch(seq_ids=np.arange(rows), lengths=[s] * rows, padded_len=s, batch=rows)
    inp = make_inputs(mb, synthetic_tokens(mb.lengths, cfg.vocab_size), cfg=cfg)
    dtype = next(block.parameters()).dtype
    pos = position_tables(inp, cfg, dtype)
    skip = {t.untyped_storage().data_ptr() for t in [*block.parameters(), *pos.tensors()]}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            storages[st.data_ptr()] = st.nbytes()
        return t

    x = torch.randn(rows, s, cfg.d_model, dtype=dtype, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = block(x, inp, pos)
    del y
    return sum(storages.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kv", [2, None])
def test_a_block_saves_exactly_what_the_coefficients_count(dtype, kv):
    """One block's saved storages equal ``block_act_coef`` to the byte: each RMSNorm its input and fp32 rstd,
    SwiGLU the gate/up storage (no SiLU output), attention no view of the fused q/k/v output. Fails on the
    unfused blocks (``F.rms_norm``'s saved normalised input, the SiLU output, the q/k/v storage held by ``v``:
    1.42x these bytes on ``llama-tiny`` fp32) and on the old coefficients."""
    from dynmb.memory.coef import block_act_coef

    cfg = replace(ModelConfig.preset("llama-tiny", dtype=dtype), attention="dense", n_kv_heads=kv)
    for rows, s in [(1, 64), (3, 40)]:
        a1, a2 = block_act_coef(cfg)
        assert _block_saved_bytes(cfg, rows, s) == a1 * rows * s + a2 * rows * s * s, (dtype, kv, rows, s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, F64])
def test_lean_norm_and_swiglu_equal_torchs_unfused_forms(dtype):
    """``LeanRMSNorm`` equals ``F.rms_norm`` bit for bit forward, its gradients to rounding; ``SwiGLUProduct``
    equals autograd through ``F.silu(gate) * up`` bit for bit, forward and backward."""
    from dynmb.models.llama import NORM_EPS, LeanRMSNorm, SwiGLUProduct

    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(3, 5, 64, generator=gen)).to(dtype)
    w = (1 + 0.1 * torch.randn(64, generator=gen)).to(dtype)
    grad = torch.randn(3, 5, 64, generator=gen).to(dtype)
    xs, ws = [x.clone().requires_grad_() for _ in range(2)], [w.clone().requires_grad_() for _ in range(2)]
    ref, lean = F.rms_norm(xs[0], (64,), ws[0], NORM_EPS), LeanRMSNorm.apply(xs[1], ws[1], NORM_EPS)
    assert torch.equal(ref, lean)
    ref.backward(grad), lean.backward(grad)
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2, F64: 1e-14}[dtype]
    for a, b in ((xs[0].grad, xs[1].grad), (ws[0].grad, ws[1].grad)):
        assert float((a.double() - b.double()).abs().max()) <= tol * float(a.double().abs().max())
    gu = torch.randn(3, 5, 128, generator=gen).to(dtype)
    gus = [gu.clone().requires_grad_() for _ in range(2)]
    gate, up = gus[0].chunk(2, dim=-1)
    ref, lean = F.silu(gate) * up, SwiGLUProduct.apply(gus[1])
    assert torch.equal(ref, lean)
    g = torch.randn(ref.shape, generator=gen).to(dtype)
    ref.backward(g), lean.backward(g)
    assert torch.equal(gus[0].grad, gus[1].grad)
    if dtype == F64:
        assert torch.autograd.gradcheck(lambda a, b: LeanRMSNorm.apply(a, b, NORM_EPS), (x[:1, :2, :8].clone().requires_grad_(), w[:8].clone().requires_grad_()))
        assert torch.autograd.gradcheck(SwiGLUProduct.apply, (gu[:1, :2, :16].clone().requires_grad_(),))
