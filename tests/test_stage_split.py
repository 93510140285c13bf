"""The planned layer split: optimal min-max partition, the head's imbalance removed, followed everywhere."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynmb.config import ModelConfig, PipelineConfig, RunConfig
from dynmb.memory import MemoryModel
from dynmb.planning.stage_split import balanced_split, resolve_stage_split, stage_work
from tests.gloo_jobs import register

SEVEN_B = ModelConfig(name="7b-widths", vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, d_ff=11008,
                      max_seq_len=8192, dtype="bfloat16")


def _compositions(n: int, p: int):
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = (0,) + cuts + (n,)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 10), p=st.integers(1, 10), vocab=st.sampled_from([64, 2048, 50000]),
       hint=st.sampled_from([16, 1024, 8192]))
def test_the_split_is_the_best_contiguous_partition(n: int, p: int, vocab: int, hint: int) -> None:
    if p > n:
        return
    cfg = ModelConfig(name="t", vocab_size=vocab, d_model=64, n_layers=n, n_heads=4, d_ff=256)
    got = balanced_split(cfg, p, hint)
    assert sum(got) == n and len(got) == p and min(got) >= 1
    best = min(max(stage_work(cfg, c, hint)) for c in _compositions(n, p))
    assert max(stage_work(cfg, got, hint)) <= best * (1 + 1e-9)


def test_a_big_vocabulary_head_is_balanced_and_whole_layers_bound_the_gain() -> None:
    # Llama-3 vocabulary (128,256) at 7B widths: the head is ~2.4 layers of work
    big_vocab = ModelConfig(name="v128k", vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, d_ff=11008)

    def imbalance(cfg: ModelConfig, split) -> float:
        w = stage_work(cfg, tuple(split))
        return max(w) * len(w) / sum(w)

    for p, at_most in ((4, 1.05), (8, 1.2), (16, 1.9)):
        even = [len(r) for r in big_vocab.stage_layers(p)]
        auto = balanced_split(big_vocab, p, 1024)
        assert auto[-1] < auto[0]
        assert imbalance(big_vocab, auto) < at_most < imbalance(big_vocab, even)
    # a 32k vocabulary at P = 16 (two layers a stage): the head is less than a layer, so no whole-layer
    # split beats the even one (the last stage keeps its two layers)
    auto = balanced_split(SEVEN_B, 16, 1024)
    assert imbalance(SEVEN_B, auto) == pytest.approx(imbalance(SEVEN_B, [2] * 16))
    assert imbalance(SEVEN_B, auto) > 1.3


def test_the_split_is_followed_by_the_config_and_memory_model() -> None:
    cfg = resolve_stage_split(ModelConfig.preset("tiny"), 2, "1,3")
    assert [len(r) for r in cfg.stage_layers(2)] == [1, 3] and cfg.stage_layers(1) == [range(0, 4)]
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    even = MemoryModel.analytic(ModelConfig.preset("tiny"), 2).rank_state_bytes()
    uneven = MemoryModel.analytic(cfg, 2).rank_state_bytes()
    assert uneven[0] < even[0] and uneven[1] > even[1]
    assert resolve_stage_split(cfg, 2, "even").layer_split is None
    with pytest.raises(ValueError, match="gives 3 stages, not 2"):
        resolve_stage_split(cfg, 2, "1,1,2")
    with pytest.raises(ValueError, match="sum to n_layers 4"):
        ModelConfig.preset("tiny", layer_split=(1, 1))
    with pytest.raises(ValueError, match="not 4"):
        cfg.stage_layers(4)
    with pytest.raises(ValueError, match="even, auto or layers per stage"):
        resolve_stage_split(cfg, 2, "half")


# --------------------------------------------------------------------------- real gloo ranks
def _split_cfg(split: tuple[int, ...], kind: str = "1f1b") -> RunConfig:

    model = ModelConfig.preset("tiny", n_layers=sum(split), layer_split=split)
    return RunConfig(model=model, pipeline=PipelineConfig(num_stages=len(split), schedule=kind,
                                                          memory_limit_bytes=2**30),
                     dataset="gsm8k", global_batch=8, method="dynamic", seed=0, steps=1, warmup=0,
                     backend="gloo", device="cpu", timeout_s=90.0)


SPLIT_CASES = {2: {"split-1-3": ((1, 3), "1f1b"), "split-3-1-zbh1": ((3, 1), "zb-h1")},
               4: {"split-1-2-2-1": ((1, 2, 2, 1), "1f1b")}}


def _provider(nproc: int):
    def provide(out):
        from dynmb.runtime.spec import RunSpec
        return [RunSpec.create(_split_cfg(*args), out / name, verify=True, run_id=name)
                for name, args in SPLIT_CASES[nproc].items()]
    return provide


register(2)(_provider(2))
register(4)(_provider(4))


@pytest.mark.dist
@pytest.mark.parametrize("nproc", [2, 4])
def test_uneven_splits_give_the_reference_gradients(gloo_job, nproc: int) -> None:
    from dynmb.results import load_results

    job = gloo_job(nproc)
    assert job.returncode == 0, job.errors
    for name, (split, _) in SPLIT_CASES[nproc].items():
        t = load_results(job.out / name)
        assert t["steps"]["verified"].all(), name
        recorded = str(t["runs"]["model.layer_split"].iloc[0])          # a list, or numpy's print of it
        assert tuple(int(x) for x in re.findall(r"\d+", recorded)) == split, name
