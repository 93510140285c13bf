"""A stage is built alone: meta-device builds materialised in their final dtype, equal to the whole model's
stage of the same seed or read from the whole model's state dict / safetensors (only the stage's tensors),
and host memory of about the stage's bytes (``-m slow``: stage 0 of 8 of a 7B Llama, dynmb's and
transformers', measured in a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynmb.core.config import ModelConfig
from dynmb.core.types import Microbatch
from dynmb.models import build_stage, hidden_shape, make_inputs, synthetic_tokens
from dynmb.models import seeding
from dynmb.models.seeding import fill_normal_

REPO = Path(__file__).resolve().parents[1]
SEED = 11
CASES = [("llama-tiny", {}, 3), ("tiny", {}, 2), ("llama-tiny", {"layer_split": (1.25, 2.75)}, 2),
         ("tiny", {"layer_split": (4, 0), "head_split": (200, 312)}, 2)]
"""(preset, overrides, stages): whole layers, a cut inside a half-block (pieces), an LM head split by vocabulary."""


def _cfg(name: str, kw: dict) -> ModelConfig:
    return replace(ModelConfig.preset(name), **kw)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 300), piece=st.sampled_from([16, 32, 48, 64]), std=st.floats(1e-3, 1.0))
def test_drawing_in_pieces_gives_the_values_of_one_draw(n, piece, std):
    old, seeding.DRAW_ELEMENTS = seeding.DRAW_ELEMENTS, piece
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            got = torch.empty(n, dtype=dtype)
            fill_normal_(got, torch.Generator().manual_seed(n), std)
            want = (torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float32) * std).to(dtype)
            assert torch.equal(got, want), (n, piece, dtype)
    finally:
        seeding.DRAW_ELEMENTS = old


def _inputs(cfg: ModelConfig):
    lengths = np.array([9, 17, 5, 30])
    mb = Microbatch(np.arange(4), lengths, 40, 2, np.array([0, 0, 1, 1]))
    return mb, make_inputs(mb, synthetic_tokens(lengths, cfg.vocab_size, seed=2), cfg=cfg)


@pytest.mark.parametrize("name,kw,stages", CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_stage_built_alone_equals_the_whole_models_stage(name, kw, stages, dtype):
    """Seeded, and read from the whole model's state dict: same names, values and outputs as the stage cut
    out of the whole model (the whole model's weights loaded into that stage)."""
    cfg = _cfg(name, kw)
    whole = build_stage(replace(cfg, layer_split=None, head_split=None), 0, 1, SEED, dtype=dtype).state_dict()
    mb, inputs = _inputs(cfg)
    for k in range(stages):
        alone = build_stage(cfg, k, stages, SEED, dtype=dtype)
        assert next(alone.parameters()).dtype == dtype and not any(p.is_meta for p in alone.parameters())
        assert list(alone.state_dict()) == [n for n, _ in alone.named_parameters()]
        cut = build_stage(cfg, k, stages, dtype=dtype, weights=whole)
        x = None if k == 0 else torch.randn(hidden_shape(mb, cfg, k - 1, stages), generator=torch.Generator().manual_seed(k)).to(dtype)
        for (n, p), (m, q) in zip(alone.named_parameters(), cut.named_parameters()):
            assert n == m and torch.equal(p, q), n
        assert torch.equal(alone(x, inputs), cut(x, inputs))


def test_a_meta_stage_stays_on_meta_until_materialised():
    cfg = ModelConfig.preset("llama-tiny")
    stage = build_stage(cfg, 1, 2, SEED, device="meta")
    assert all(p.is_meta for p in stage.parameters())
    stage.materialise(seed=SEED)
    for (n, p), (_, q) in zip(stage.named_parameters(), build_stage(cfg, 1, 2, SEED).named_parameters()):
        assert torch.equal(p, q), n


def test_a_stage_reads_only_its_tensors_from_safetensors(tmp_path, monkeypatch):
    save_file = pytest.importorskip("safetensors.torch").save_file

    from dynmb.models import weights as weights_mod

    cfg = _cfg("tiny", {"layer_split": (4, 0), "head_split": (200, 312)})
    whole = build_stage(replace(cfg, layer_split=None, head_split=None), 0, 1, SEED)
    save_file({n: t.contiguous() for n, t in whole.state_dict().items()}, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(weights_mod, "BLOCK_BYTES", 4 * 256 * 7)       # several blocks of rows per tensor
    read: list[str] = []
    orig = weights_mod.TensorSource.blocks

    def spy(self, name, rows):
        read.append(name)
        return orig(self, name, rows)

    monkeypatch.setattr(weights_mod.TensorSource, "blocks", spy)
    for k in range(2):
        read.clear()
        stage = build_stage(cfg, k, 2, weights=tmp_path)
        seeded = build_stage(cfg, k, 2, SEED)
        for (n, p), (_, q) in zip(stage.named_parameters(), seeded.named_parameters()):
            assert torch.equal(p, q), n
        assert set(read) == {stage.weight_ref(n).name for n, _ in stage.named_parameters()}
    assert "embed.weight" not in read                   # stage 1 holds no embedding: never read


def test_missing_or_misshapen_weights_are_one_line():
    cfg = ModelConfig.preset("llama-tiny")
    whole = build_stage(cfg, 0, 1, SEED).state_dict()
    with pytest.raises(ValueError, match=r"no tensor 'norm_f.weight'"):
        build_stage(cfg, 1, 2, weights={k: v for k, v in whole.items() if k != "norm_f.weight"})
    bad = {**whole, "norm_f.weight": torch.ones(3)}
    with pytest.raises(ValueError, match=r"'norm_f.weight' of shape \[3\] does not fit"):
        build_stage(cfg, 1, 2, weights=bad)
    with pytest.raises(ValueError, match="no such file"):
        build_stage(cfg, 1, 2, weights="/nonexistent/model.safetensors")


# --------------------------------------------------------------------------- transformers
def _hf_config(**kw):
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                    tie_word_embeddings=False, **kw)


def test_transformers_stages_are_built_alone_with_transformers_names(tmp_path):
    from dynmb.models.hf import HFStageFactory

    factory = HFStageFactory.from_config(_hf_config(), seed=SEED)
    s2 = factory.build_stage(2, 4)
    assert all(p.is_meta for p in factory.model.model.layers[0].parameters())       # stage 0's layer: untouched
    assert [n for n, _ in s2.named_parameters()] == list(s2.state_dict())
    assert all(n.startswith("model.layers.2.") for n in s2.state_dict())
    whole = HFStageFactory.from_config(_hf_config(), seed=SEED).whole_model()
    whole.save_pretrained(tmp_path, safe_serialization=True)
    loaded = HFStageFactory.from_pretrained(tmp_path)
    ref = dict(whole.named_parameters())
    mb, inputs = _inputs(factory.config)
    for k in range(4):
        seeded, read = factory.build_stage(k, 4), loaded.build_stage(k, 4)
        for (n, p), (m, q) in zip(seeded.named_parameters(), read.named_parameters()):
            assert n == m and torch.equal(p, ref[n]) and torch.equal(q, ref[n]), n
        x = None if k == 0 else torch.randn(mb.batch, mb.padded_len, 64, generator=torch.Generator().manual_seed(k))
        assert torch.equal(seeded(x, inputs), read(x, inputs))


def test_dynmb_llama_state_dict_loads_into_transformers_strictly():
    LlamaForCausalLM = pytest.importorskip("transformers").LlamaForCausalLM

    from dynmb.models.hf import hf_llama_config, llama_state_dict_to_hf

    cfg = ModelConfig.preset("llama-tiny")
    stages = [build_stage(cfg, k, 2, SEED) for k in range(2)]
    sd = {n: t for s in stages for n, t in s.state_dict().items()}
    model = LlamaForCausalLM(hf_llama_config(cfg))
    model.load_state_dict(llama_state_dict_to_hf(sd, cfg), strict=True)
    mb, inputs = _inputs(cfg)
    from dynmb.models.hf import HFStageFactory

    hf_stage = HFStageFactory(model).build_stage(0, 1)
    with torch.no_grad():
        x = stages[1](stages[0](None, inputs), inputs)
        assert float(hf_stage(None, inputs)) == pytest.approx(float(x), rel=1e-5)


# --------------------------------------------------------------------------- host memory (7B)
_MEASURE = textwrap.dedent("""
    import json, resource, sys, torch
    which = sys.argv[1]
    if which == "hf":
        import transformers
        from dynmb.models.hf import HFStageFactory
        cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                       tie_word_embeddings=False)
    else:
        from dynmb.core.config import ModelConfig
        from dynmb.models import build_stage
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if which == "hf":
        stage = HFStageFactory.from_config(cfg, dtype=torch.bfloat16).build_stage(0, 8)
    else:
        stage = build_stage(ModelConfig.preset("llama2-7b"), 0, 8, dtype=torch.bfloat16)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    params = sum(p.numel() * p.element_size() for p in stage.parameters())
    print(json.dumps({"grown": grown, "params": params, "dtype": str(next(stage.parameters()).dtype)}))
""")


@pytest.mark.slow
@pytest.mark.parametrize("which", ["dynmb", "hf"])
def test_stage_0_of_8_of_a_7b_llama_takes_about_its_own_bytes(which):
    """Peak RSS growth of building stage 0 of 8 in bf16 (1.9 GiB of parameters) within 1.3x of its bytes."""
    if which == "hf":
        pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, "-c", _MEASURE, which], capture_output=True, text=True, timeout=900,
                         cwd=REPO, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["dtype"] == "torch.bfloat16"
    assert got["grown"] <= 1.3 * got["params"], got
