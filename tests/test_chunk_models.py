"""Stage boundaries inside a half-block (``dynmb.models.pieces``): pieces of attention (K/V head groups) and
of the MLP (inner columns), the ``[y | h]`` message.

Random chunk splits of both families (valid boundaries only) must equal the single-stage model of the same
seed: the pieces hold the whole model's weights (``full_weights`` joins them), the loss is the same and the
joined gradients are the reference's, for padded and packed rows, slices of a long sequence (a piece keeps
only its K/V heads in the prefix store), full recomputation and the I/W split (``tests.plan_runner``), fp64
(1e-10) and fp32 (1e-5); bf16 within its rounding. Refusals: transformers stages, a model of one's own. Real
gloo ranks: the end of this module (``--verify`` runs, dynmb's runtime) and ``tests/test_torch_pipelining.py``.
"""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest
import torch

from dynmb.core.config import ModelConfig, PipelineConfig, RunConfig
from dynmb.core.model_sizes import SUB_CHUNKS, UNITS_PER_LAYER
from dynmb.models import build_stages, hidden_shape, make_inputs, reference_grads, synthetic_tokens
from dynmb.models.pieces import full_weights, whole_name
from dynmb.core.types import Microbatch
from tests.gloo_jobs import register
from tests.plan_runner import mixed_plan, run_plan, sliced_plan

F64 = torch.float64
SEED = 3
FAMILIES = {"llama": ModelConfig.preset("llama-tiny", n_heads=8, n_kv_heads=4),   # grouped: 2 query heads a K/V head
            "gpt2": ModelConfig.preset("tiny", n_heads=8)}
"""4 layers each; attention boundaries at every chunk (gpt2: 8 heads) or every other (llama: 4 K/V heads)."""


def random_chunk_split(base: ModelConfig, num_stages: int, rng: np.random.Generator) -> ModelConfig:
    """``base`` with a random split of ``num_stages`` stages on the 1/16 grid, one boundary at least inside a
    half-block, every boundary on whole K/V heads and columns."""
    total = UNITS_PER_LAYER * base.n_layers
    while True:
        cuts = np.sort(rng.choice(np.arange(1, total), num_stages - 1, replace=False))
        if not any(c % SUB_CHUNKS for c in cuts):
            continue
        units = np.diff([0, *cuts, total])
        try:
            return replace(base, layer_split=tuple(float(u) / UNITS_PER_LAYER for u in units))
        except ValueError:                          # a boundary off whole K/V heads
            continue


def _check(stages, cfg: ModelConfig, P: int, ref: dict[str, torch.Tensor], tol: float) -> None:
    """The stages' gradients, joined into the whole model's names, are the reference's."""
    named = {n: p for st in stages for n, p in st.named_parameters()}
    got = full_weights({n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in named.items()}, cfg, P)
    assert set(got) == set(ref)
    for name, r in ref.items():
        err = float((got[name].to(F64) - r.to(F64)).norm() / r.to(F64).norm().clamp_min(1e-30))
        assert err <= tol, (name, err)


def _cases(n: int, seed: int) -> list[tuple[str, int, int]]:
    """``(family, stages, split seed)``: ``n`` random splits a family, 2 to 5 stages."""
    rng = np.random.default_rng(seed)
    return [(fam, int(rng.integers(2, 6)), int(rng.integers(1 << 30))) for fam in FAMILIES for _ in range(n)]


# --------------------------------------------------------------------------- structure
@pytest.mark.parametrize("family, P, split_seed", _cases(4, 0))
def test_pieces_hold_the_whole_models_weights_under_unique_names(family, P, split_seed):
    base = FAMILIES[family]
    cfg = random_chunk_split(base, P, np.random.default_rng(split_seed))
    whole = dict(build_stages(base, 1, SEED)[0].named_parameters())
    stages = build_stages(cfg, P, SEED)
    names = [n for st in stages for n, _ in st.named_parameters()]
    assert len(names) == len(set(names))
    assert any(re.search(r"\.(attn|mlp)_c\d\.", n) for n in names), cfg.layer_split
    joined = full_weights({n: p for st in stages for n, p in st.named_parameters()}, cfg, P)
    assert set(joined) == set(whole) and all(torch.equal(joined[n], whole[n]) for n in whole)
    partial = {n: p for st in stages[1:] for n, p in st.named_parameters()}
    if any(pc.chunks.start for pc in cfg.stage_pieces(P)[1][:1]):        # stage 1 starts inside a half
        with pytest.raises(ValueError, match=r"full_weights: blocks\.\d+\.[\w.]+ has the chunks"):
            full_weights(partial, cfg, P)
    assert sum(p.numel() for st in stages for p in st.parameters()) == sum(p.numel() for p in whole.values())
    assert [sum(p.numel() for p in st.parameters()) for st in stages] == [cfg.stage_params(s, P) for s in range(P)]
    for s, st in enumerate(stages):            # a norm (and an output bias) only where a half's chunk 0 is
        norms = {int(n.split(".")[1]) * 2 + (n.split(".")[2] in ("mlp_norm", "ln2"))
                 for n in dict(st.named_parameters()) if re.match(r"blocks\.\d+\.(attn_norm|mlp_norm|ln1|ln2)\.", n)}
        assert norms == {2 * pc.layer + (pc.part == "mlp") for pc in cfg.stage_pieces(P)[s] if pc.chunks.start == 0}


def test_names_keys_and_messages_of_a_boundary_inside_the_mlp():
    cfg = replace(FAMILIES["llama"], layer_split=(2.75, 1.25))
    s0, s1 = build_stages(cfg, 2, SEED)
    assert "blocks.2.mlp_c0.gate_up.weight" in dict(s0.named_parameters())
    assert "blocks.2.mlp_norm.weight" in dict(s0.named_parameters())
    p1 = dict(s1.named_parameters())
    assert p1["blocks.2.mlp_c4.gate_up.weight"].shape == (2 * 88, 64) and p1["blocks.2.mlp_c4.down.weight"].shape == (64, 88)
    assert "blocks.2.mlp_norm.weight" not in p1 and whole_name("blocks.2.mlp_c4.down.weight") == "blocks.2.mlp.down.weight"
    mb = Microbatch(seq_ids=[0, 1], lengths=[5, 7], padded_len=8, batch=2)
    assert hidden_shape(mb, cfg, 0, 2) == (2, 8, 128) and s1.in_channels == 128
    with pytest.raises(ValueError, match=r"receives messages of 128 channels .*\[y \| h\].*got 64"):
        s1(torch.zeros(2, 8, 64), make_inputs(mb, synthetic_tokens([5, 7], cfg.vocab_size), cfg=cfg))
    att = replace(FAMILIES["gpt2"], layer_split=(1.125, 0.25, 2.625))     # layer 1's heads 0..1, 2..5, 6..7
    stages = build_stages(att, 3, SEED)
    assert [st.layers for st in stages] == [[0, 1], [1.25], [1.75, 2, 3]]
    a = stages[1].blocks["1"].attn_c2
    assert (a.n_heads, a.n_kv_heads, a.proj.bias) == (4, 4, None) and stages[0].blocks["1"].attn_c0.proj.bias is not None


# --------------------------------------------------------------------------- exact gradients
@pytest.mark.parametrize("mode", ["plain", "recompute", "split-backward"])
@pytest.mark.parametrize("family, P, split_seed", _cases(2, 1))
def test_random_chunk_splits_give_the_single_stage_gradients(family, P, split_seed, mode):
    base = FAMILIES[family]
    cfg = random_chunk_split(base, P, np.random.default_rng(split_seed))
    plan, lengths = mixed_plan()
    tokens = synthetic_tokens(lengths, cfg.vocab_size, seed=1)
    stages, loss = run_plan(plan, tokens, cfg, P, F64, seed=SEED, recompute=mode == "recompute",
                            split=mode == "split-backward")
    ref_loss, ref = reference_grads(base, 1, plan, tokens, SEED, dtype=F64)
    assert abs(loss - ref_loss) <= 1e-12 * ref_loss, cfg.layer_split
    _check(stages, cfg, P, ref, 1e-10)


@pytest.mark.parametrize("mode", ["plain", "recompute", "split-backward"])
@pytest.mark.parametrize("family, split", [("gpt2", (1.25, 0.125, 0.125, 2.5)), ("llama", (0.25, 0.5, 3.25)),
                                           ("llama", (1.75, 0.0625, 2.1875))])
def test_slices_of_a_long_sequence_keep_each_pieces_heads(family, split, mode):
    """Pieces of one layer's attention on several stages (one prefix store here, as interleaved chunks on
    one rank share one): each keeps its own K/V heads under its own key."""
    base = FAMILIES[family]
    cfg = replace(base, layer_split=split)
    plan, lengths = sliced_plan()
    tokens = synthetic_tokens(lengths, cfg.vocab_size, seed=2)
    stages, loss = run_plan(plan, tokens, cfg, len(split), F64, seed=SEED, recompute=mode == "recompute",
                            split=mode == "split-backward")
    ref_loss, ref = reference_grads(base, 1, plan, tokens, SEED, dtype=F64)
    assert abs(loss - ref_loss) <= 1e-12 * ref_loss
    _check(stages, cfg, len(split), ref, 1e-10)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_pieces_beside_head_shards(family, split):
    """A stage ending inside layer 2's MLP, the next holding its other columns, layer 3 and a head shard."""
    base = FAMILIES[family]
    cfg = replace(base, layer_split=(2.75, 1.25, 0), head_split=(0, 200, 312))
    plan, lengths = mixed_plan()
    tokens = synthetic_tokens(lengths, cfg.vocab_size, seed=1)
    stages, loss = run_plan(plan, tokens, cfg, 3, F64, seed=SEED, split=split)
    ref_loss, ref = reference_grads(base, 1, plan, tokens, SEED, dtype=F64)
    assert abs(loss - ref_loss) <= 1e-12 * ref_loss
    _check(stages, cfg, 3, ref, 1e-10)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fp32_chunk_split_gradients_within_1e5(family):
    cfg = replace(FAMILIES[family], layer_split=(0.75, 1.125, 2.125))
    plan, lengths = mixed_plan()
    tokens = synthetic_tokens(lengths, cfg.vocab_size, seed=4)
    stages, loss = run_plan(plan, tokens, cfg, 3, torch.float32, seed=SEED, split=True)
    ref_loss, ref = reference_grads(FAMILIES[family], 1, plan, tokens, SEED, dtype=torch.float32)
    assert abs(loss - ref_loss) <= 1e-5 * ref_loss
    _check(stages, cfg, 3, ref, 1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bfloat16_pieces_are_as_close_to_fp64_as_the_whole_bf16_model(family):
    """bf16 sums the partial outputs in another order than the whole matmul: the loss within bf16 rounding
    of the whole bf16 model's, the joined gradients as close to the fp64 model's as the whole bf16 model's
    (measured: 1.2e-2 and 1.5e-2 relative, the whole model's 1.1e-2 and 1.6e-2)."""
    base = replace(FAMILIES[family], dtype="bfloat16")
    cfg = replace(base, layer_split=(1.75, 0.25, 2))
    plan, lengths = mixed_plan()
    tokens = synthetic_tokens(lengths, cfg.vocab_size, seed=6)
    ref = build_stages(FAMILIES[family], 1, SEED, dtype=F64)[0]
    whole, stages = build_stages(base, 1, SEED)[0], build_stages(cfg, 3, SEED)
    for mb in plan.microbatches:
        inp = make_inputs(mb, tokens, cfg=cfg)
        ref(None, inp).backward()
        loss = whole(None, inp)
        loss.backward()
        x = None
        for st in stages:
            x = st(x, inp)
            assert x.dtype == torch.bfloat16 or st.is_last
        assert abs(float(x.detach()) - float(loss.detach())) <= 2e-3 * float(loss.detach())
        x.backward()
    got = full_weights({n: p.grad for st in stages for n, p in st.named_parameters()}, cfg, 3)
    for name, r in ref.named_parameters():
        err = float((got[name].to(F64) - r.grad).norm() / r.grad.norm())
        err_whole = float((dict(whole.named_parameters())[name].grad.to(F64) - r.grad).norm() / r.grad.norm())
        assert err <= 2 * err_whole + 1e-3, (name, err, err_whole)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_reduction_none_through_pieces(family):
    base = FAMILIES[family]
    cfg = replace(base, layer_split=(2.5, 0.375, 1.125))
    plan, lengths = mixed_plan()
    tokens = synthetic_tokens(lengths, cfg.vocab_size, seed=5)
    inp = make_inputs(plan.microbatches[1], tokens, cfg=cfg)
    weights = torch.rand(inp.labels.shape, dtype=F64, generator=torch.Generator().manual_seed(0))
    whole, stages = build_stages(base, 1, SEED, dtype=F64)[0], build_stages(cfg, 3, SEED, dtype=F64)
    ref = whole(None, inp, reduction="none")
    x = None
    for st in stages:
        x = st(x, inp, reduction="none")
    assert float((x - ref).detach().abs().max()) <= 1e-12 * float(ref.detach().abs().max())
    (ref * weights).sum().backward()
    (x * weights).sum().backward()
    _check(stages, cfg, 3, {n: p.grad for n, p in whole.named_parameters()}, 1e-10)


# --------------------------------------------------------------------------- refusals
def test_models_of_ones_own_refuse_a_chunk_split_naming_it():
    cfg = replace(FAMILIES["llama"], layer_split=(2.75, 1.25))
    with pytest.raises(ValueError, match=r"cuts blocks in half \(and halves into K/V heads or MLP columns\)") as e:
        cfg.stage_layers(2)
    assert len(str(e.value).splitlines()) == 1


def test_transformers_stages_refuse_a_chunk_split():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    from dynmb.models.hf import HFStageFactory, llama_to_hf

    hf = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=2, tie_word_embeddings=False)
    factory = HFStageFactory.from_config(hf)
    factory.config = replace(factory.config, layer_split=(1.25, 0.75))
    with pytest.raises(ValueError, match=r"boundary inside a block .* dynmb's own model families") as e:
        factory.build_stage(0, 2)
    assert len(str(e.value).splitlines()) == 1
    base = FAMILIES["llama"]                          # the reverse direction joins the pieces
    cfg = replace(base, layer_split=(1.25, 0.5, 2.25))
    model = llama_to_hf(build_stages(cfg, 3, SEED), cfg)
    ref = llama_to_hf(build_stages(base, 1, SEED), base)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))


# --------------------------------------------------------------------------- real gloo ranks
LONG = (40, 100, 700, 70, 300, 25, 90, 150)
"""A batch whose 700-token document is cut into slices under a 10 MiB limit (``--oversize split``)."""


def _run_cfg(split: tuple[float, ...], kind: str, family: str, method: str = "dynamic", recompute: str = "never",
             virtual: int = 1, trace: str = "gsm8k") -> RunConfig:
    model = replace(FAMILIES[family], layer_split=split)
    sliced = trace != "gsm8k"
    return RunConfig(model=model, pipeline=PipelineConfig(num_stages=len(split), schedule=kind, virtual=virtual,
                                                          memory_limit_bytes=10 << 20 if sliced else 2**30),
                     dataset=trace, global_batch=8, method=method, seed=0, steps=1, warmup=0, recompute=recompute,
                     backend="gloo", device="cpu", timeout_s=90.0, oversize="split" if sliced else "error")


GLOO_CASES = {2: {"chunk-llama-2.75-1.25-1f1b": ((2.75, 1.25), "1f1b", "llama"),
                  "chunk-1.125-2.875-zbh1-packed": ((1.125, 2.875), "zb-h1", "gpt2", "packed"),
                  "chunk-llama-1.25-1.5-0.0625-1.1875-interleaved": ((1.25, 1.5, 0.0625, 1.1875), "interleaved",
                                                                    "llama", "dynamic", "never", 2),
                  "chunk-0.375-3.625-recompute": ((0.375, 3.625), "1f1b", "gpt2", "dynamic", "always"),
                  "chunk-llama-1.25-2.75-slices-zbh1": ((1.25, 2.75), "zb-h1", "llama", "dynamic", "auto", 1, LONG)},
              4: {"chunk-llama-0.75-1.25-0.25-1.75-zbh1": ((0.75, 1.25, 0.25, 1.75), "zb-h1", "llama"),
                  "chunk-1.0625-0.9375-1.5-0.5-recompute": ((1.0625, 0.9375, 1.5, 0.5), "1f1b", "gpt2", "packed",
                                                           "always")}}


def _provider(nproc: int):
    def provide(out):
        from dynmb.runtime.spec import RunSpec
        trace = out / "long.csv"
        trace.write_text("length\n" + "\n".join(str(x) for x in LONG) + "\n")
        return [RunSpec.create(_run_cfg(*args[:6], **({"trace": str(trace)} if len(args) > 6 else {})), out / name,
                               verify=True, run_id=name) for name, args in GLOO_CASES[nproc].items()]
    return provide


register(2)(_provider(2))
register(4)(_provider(4))


@pytest.mark.dist
@pytest.mark.parametrize("nproc", [2, 4])
def test_chunk_splits_give_the_reference_gradients_on_gloo_ranks(gloo_job, nproc: int) -> None:
    """``--verify``: every rank's gradients equal the single-process reference of the same split."""
    from dynmb.io.results import load_results

    job = gloo_job(nproc)
    assert job.returncode == 0, job.errors
    for name, (split, *_) in GLOO_CASES[nproc].items():
        t = load_results(job.out / name)
        assert t["steps"]["verified"].all(), name
        recorded = str(t["runs"]["model.layer_split"].iloc[0])
        assert tuple(float(x) for x in re.findall(r"\d+(?:\.\d+)?", recorded)) == split, name
        if "slices" in name:
            assert (t["steps"]["sliced"] > 0).all() and (t["steps"]["real_tokens"] == sum(LONG)).all(), name
