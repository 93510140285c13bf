"""transformers decoders as dynmb stages: loss and gradients equal transformers' own forward of
each document alone (the ``[hf]`` extra; skipped where transformers is not installed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from dynmb.models.inputs import make_inputs  # noqa: E402
from dynmb.models.hf import HFStageFactory, model_config_from_hf  # noqa: E402
from dynmb.core.types import Microbatch  # noqa: E402

VOCAB = 97


def _config(attn: str = "sdpa", **kw) -> "transformers.LlamaConfig":
    kw = {"tie_word_embeddings": False, **kw}
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, **kw)
    cfg._attn_implementation = attn
    return cfg


def _packed(lengths: list[int], docs_per_row: int) -> Microbatch:
    rows = np.arange(len(lengths)) // docs_per_row
    per_row = np.bincount(rows, weights=lengths).astype(int)
    return Microbatch(np.arange(len(lengths)), lengths, int(per_row.max()) + 3, int(rows.max()) + 1, rows)


def _hf_reference(model, tokens: list[torch.Tensor], lengths: list[int]) -> tuple[float, dict[str, torch.Tensor]]:
    """transformers' own loss of each document alone (its mean CE x predicted tokens), token-weighted."""
    model.zero_grad(set_to_none=True)
    total, loss_sum = sum(lengths), 0.0
    for t, n in zip(tokens, lengths):
        ids = t[: n + 1][None]
        out = model(input_ids=ids, labels=ids)
        (out.loss * n / total).backward()
        loss_sum += float(out.loss.detach()) * n
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss_sum / total, grads


def _dynmb(factory: HFStageFactory, num_stages: int, microbatches: list[Microbatch], tokens, total: int):
    stages = [factory.build_stage(s, num_stages) for s in range(num_stages)]
    loss_sum = 0.0
    for mb in microbatches:
        inputs = make_inputs(mb, tokens)
        x = None
        for st in stages:
            x = st(x, inputs)
        (x / total).backward()
        loss_sum += float(x.detach())
    grads = {n: p.grad.detach().clone() for st in stages for n, p in st.named_parameters() if p.grad is not None}
    factory.model.zero_grad(set_to_none=True)
    return loss_sum / total, grads


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("docs,docs_per_row,num_stages", [(1, 1, 1), (6, 1, 2), (16, 16, 2), (12, 4, 4)])
def test_stages_equal_transformers_per_document(attn: str, docs: int, docs_per_row: int, num_stages: int) -> None:
    factory = HFStageFactory.from_config(_config(attn), seed=3, dtype=torch.float64)
    rng = np.random.default_rng(docs * 7 + num_stages)
    lengths = rng.integers(3, 40, docs).tolist()
    tokens = [torch.as_tensor(rng.integers(0, VOCAB, n + 1)) for n in lengths]
    # two microbatches: the documents split in halves (packed or one per row)
    half = max(1, docs // 2)
    mbs = [_packed(lengths[:half], docs_per_row)]
    if docs > half:
        rest = _packed(lengths[half:], docs_per_row)
        mbs.append(Microbatch(np.arange(half, docs), rest.lengths, rest.padded_len, rest.batch, rest.row_ids))
    ref_loss, ref = _hf_reference(factory.whole_model(), tokens, lengths)
    loss, got = _dynmb(factory, num_stages, mbs, tokens, sum(lengths))
    # transformers computes its loss on float32 logits, so even an fp64 model agrees to fp32 precision
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    names = got                      # a stage's names are transformers' own
    assert set(names) == set(ref)
    for n, g in ref.items():
        assert float((names[n] - g).norm() / g.norm()) <= 1e-5, n


def _two_stages_equal_transformers(factory: HFStageFactory, *, seed: int, docs: int, longest: int,
                                   docs_per_row: int) -> None:
    """fp32, 2 stages, one packed microbatch: loss and every gradient within 1e-5 of transformers'."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, longest, docs).tolist()
    tokens = [torch.as_tensor(rng.integers(0, VOCAB, n + 1)) for n in lengths]
    ref_loss, ref = _hf_reference(factory.whole_model(), tokens, lengths)
    loss, got = _dynmb(factory, 2, [_packed(lengths, docs_per_row)], tokens, sum(lengths))
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for n, g in got.items():
        r = ref[n]
        assert float((g - r).norm() / r.norm()) <= 1e-5, n


def test_fp32_within_1e5() -> None:
    _two_stages_equal_transformers(HFStageFactory.from_config(_config(), seed=0), seed=0, docs=10, longest=60,
                                   docs_per_row=5)


def test_same_weights_on_every_rank_and_moving_a_document_keeps_its_loss() -> None:
    a = HFStageFactory.from_config(_config(), seed=5, dtype=torch.float64)
    b = HFStageFactory.from_config(_config(), seed=5, dtype=torch.float64)
    for (n, p), (_, q) in zip(a.whole_model().named_parameters(), b.whole_model().named_parameters()):
        assert torch.equal(p, q), n
    stage = a.build_stage(0, 1)
    tokens = [torch.arange(1, 12) % VOCAB, torch.arange(20, 40) % VOCAB, torch.arange(50, 58) % VOCAB]
    lengths = [10, 18, 7]

    def per_doc(order: list[int]) -> dict[int, float]:
        mb = Microbatch(order, [lengths[i] for i in order], 40, 1, [0, 0, 0])
        inputs = make_inputs(mb, tokens)
        ce = stage(None, inputs, reduction="none").detach()
        return {d: float(ce[inputs.doc_ids == k].sum()) for k, d in enumerate(order)}

    first, moved = per_doc([0, 1, 2]), per_doc([2, 0, 1])
    for d in range(3):
        assert moved[d] == pytest.approx(first[d], rel=1e-12)


def test_refusals_and_config() -> None:
    factory = HFStageFactory.from_config(_config(tie_word_embeddings=True), seed=0)
    with pytest.raises(ValueError, match="tied"):
        factory.build_stage(0, 2)
    stage = HFStageFactory.from_config(_config(), seed=0).build_stage(0, 1)
    mb = Microbatch([0], [5], 5, 1)                       # full recomputation runs (it was refused)
    assert torch.isfinite(stage(None, make_inputs(mb, [torch.arange(6)]), recompute=True))
    with pytest.raises(TypeError, match="Llama decoder layout"):
        HFStageFactory(torch.nn.Linear(2, 2))
    cfg = model_config_from_hf(_config())
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_ff, cfg.vocab_size) == (64, 4, 4, 172, VOCAB)


@pytest.mark.parametrize("arch", ["Qwen2", "Mistral"])
def test_other_llama_layout_decoders(arch: str) -> None:
    cls = getattr(transformers, f"{arch}Config")
    cfg = cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    _two_stages_equal_transformers(HFStageFactory.from_config(cfg, seed=1), seed=1, docs=8, longest=30, docs_per_row=4)
