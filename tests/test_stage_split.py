"""The planned layer split: optimal min-max partition, the head's imbalance removed, followed everywhere."""

from __future__ import annotations

import itertools
import re
from dataclasses import replace

import pytest
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dynmb.core.config import ModelConfig, PipelineConfig, RunConfig
from dynmb.memory.model import MemoryModel
from dynmb.planning.stage_split import (balanced_split, flops_cost, min_max_split, resolve_stage_split, split_ceiling,
                                        stage_work)
from tests.gloo_jobs import register

SEVEN_B = ModelConfig(name="7b-widths", vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, d_ff=11008,
                      max_seq_len=8192, dtype="bfloat16")


def _compositions(n: int, p: int):
    """Every split of n layers over p stages: non-empty stages, or (p > 1) a last stage of the head alone."""
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = (0,) + cuts + (n,)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))
    if p > 1:
        yield from (c + (0,) for c in _compositions(n, p - 1))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 10), p=st.integers(1, 10), vocab=st.sampled_from([64, 2048, 50000]),
       hint=st.sampled_from([16, 1024, 8192]))
def test_the_split_is_the_best_contiguous_partition(n: int, p: int, vocab: int, hint: int) -> None:
    if p > n:
        return
    cfg = ModelConfig(name="t", vocab_size=vocab, d_model=64, n_layers=n, n_heads=4, d_ff=256)
    got = balanced_split(cfg, p, hint)
    assert sum(got) == n and len(got) == p and min(got[:-1], default=1) >= 1 and got[-1] >= (0 if p > 1 else 1)
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


# --------------------------------------------------------------------------- half-block units
def _half_compositions(n_layers: int, p: int):
    for units in _compositions(2 * n_layers, p):
        yield tuple(u / 2 for u in units)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 6), p=st.integers(1, 8), family=st.sampled_from(["gpt2", "llama"]),
       vocab=st.sampled_from([64, 2048, 50000]), hint=st.sampled_from([16, 1024, 8192]))
def test_the_half_block_split_is_the_best_contiguous_partition(n: int, p: int, family: str, vocab: int,
                                                                hint: int) -> None:
    if p > 2 * n:
        return
    cfg = ModelConfig(name="t", family=family, vocab_size=vocab, d_model=64, n_layers=n, n_heads=4, d_ff=256)
    got = balanced_split(cfg, p, hint, half_blocks=True)
    assert len(got) == p and sum(got) == n and min(got[:-1], default=0.5) > 0 and got[-1] >= (0 if p > 1 else 0.5)
    laid = replace(cfg, layer_split=got)                        # every boundary one the model allows
    best = min(max(stage_work(cfg, c, hint)) for c in _half_compositions(n, p))
    w_got = max(stage_work(cfg, got, hint))
    assert w_got <= best * (1 + 1e-9)
    if laid.chunk_split:                                        # chunks only where strictly lighter than halves
        assert w_got < best * (1 - 1e-9)
    elif p <= n:
        whole = balanced_split(cfg, p, hint)
        w_whole = max(stage_work(cfg, whole, hint))
        if w_whole <= best * (1 + 1e-9):            # whole layers are optimal: the whole-layer answer
            assert got == whole
        else:
            assert w_got < w_whole


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 3), p=st.integers(2, 3), kv=st.sampled_from([1, 2, 8]), vocab=st.sampled_from([64, 20000]))
def test_the_chunk_split_is_the_best_contiguous_partition_on_the_allowed_cuts(n: int, p: int, kv: int,
                                                                             vocab: int) -> None:
    cfg = ModelConfig(name="t", family="llama", vocab_size=vocab, d_model=64, n_layers=n, n_heads=8, n_kv_heads=kv,
                      d_ff=176)
    got = balanced_split(cfg, p, 512, half_blocks=True)
    best = np.inf
    for units in _compositions(16 * n, p):
        try:
            layout = replace(cfg, layer_split=tuple(u / 16 for u in units))
        except ValueError:                          # a cut inside K/V heads or MLP columns
            continue
        best = min(best, max(stage_work(layout, layout.layer_split, 512)))
    assert max(stage_work(cfg, got, 512)) <= best * (1 + 1e-9)


def test_half_blocks_balance_the_head_that_whole_layers_cannot() -> None:
    """Llama-2-7B widths at P = 16 (two layers a stage, the head ~0.6 layers): whole layers keep the
    even split; half-blocks move half a block off the last stage and lift the split's ceiling."""
    cfg = replace(SEVEN_B, family="llama", n_kv_heads=32)
    whole, half = balanced_split(cfg, 16, 1024), min_max_split(cfg, 16, flops_cost(1024), half_blocks=True)
    assert whole == (2,) * 16
    assert half[-1] == 1.5 and sum(half) == 32 and cfg.n_layers == 32
    assert split_ceiling(cfg, half) > split_ceiling(cfg, whole) + 0.05
    auto = balanced_split(cfg, 16, 1024, half_blocks=True)      # chunks of halves where they are lighter still
    assert replace(cfg, layer_split=auto).chunk_split and split_ceiling(cfg, auto) > split_ceiling(cfg, half) + 0.05
    assert resolve_stage_split(cfg, 16, "auto").layer_split == auto
    # the stage work is the FLOPs every consumer counts
    for split in (half, auto):
        flops = [float(replace(cfg, layer_split=split).stage_flops(s, 16, 1, 1024)) for s in range(16)]
        assert flops == pytest.approx(stage_work(cfg, split, 1024), rel=1e-12)


def _random_half_split(n: int, p: int, seed: int) -> tuple[float, ...]:
    import numpy as np

    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, 2 * n), size=p - 1, replace=False))
    return tuple(u / 2 for u in np.diff(np.concatenate([[0], cuts, [2 * n]])))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 8), p=st.integers(2, 6), family=st.sampled_from(["gpt2", "llama"]), seed=st.integers(0, 99))
def test_flops_and_parameters_per_stage_sum_to_the_model(n: int, p: int, family: str, seed: int) -> None:
    if p > 2 * n:
        return
    base = ModelConfig(name="t", family=family, vocab_size=300, d_model=32, n_layers=n, n_heads=4, d_ff=96,
                       n_kv_heads=2 if family == "llama" else None, max_seq_len=64)
    cfg = replace(base, layer_split=_random_half_split(n, p, seed))
    assert sum(cfg.stage_params(s, p) for s in range(p)) == base.param_count()
    for rows, s in ((1, 17), (3, 40)):
        assert sum(cfg.stage_flops(i, p, rows, s) for i in range(p)) == base.stage_flops(0, 1, rows, s)
    attn, mlp = zip(*cfg.stage_parts(p))
    assert sum(attn) == sum(mlp) == n
    units = [u for blocks in cfg.stage_blocks(p) for u in blocks]
    assert [(i, part) for i, parts in units for part in parts] == [(i, part) for i in range(n) for part in ("attn", "mlp")]


def test_half_splits_are_written_read_and_refused_where_they_cannot_run() -> None:
    tiny = ModelConfig.preset("tiny")
    cfg = resolve_stage_split(tiny, 3, "1.5,2,0.5")
    assert cfg.layer_split == (1.5, 2, 0.5) and cfg.half_split and cfg.unit_split == (24, 32, 8) and not cfg.chunk_split
    assert cfg.stage_blocks(3) == [[(0, ("attn", "mlp")), (1, ("attn",))], [(1, ("mlp",)), (2, ("attn", "mlp")),
                                                                           (3, ("attn",))], [(3, ("mlp",))]]
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert resolve_stage_split(tiny, 2, "2.0,2").layer_split == (2, 2) and not resolve_stage_split(tiny, 2, "2,2").half_split
    with pytest.raises(ValueError, match="cuts blocks in half"):
        cfg.stage_layers(3)
    with pytest.raises(ValueError, match="not a whole number of layers, halves or 1/16ths"):
        resolve_stage_split(tiny, 2, "1.3,2.7")
    with pytest.raises(ValueError, match="n_kv_heads 4 is not divisible"):       # 1/8 of 4 heads
        resolve_stage_split(tiny, 2, "1.0625,2.9375")
    with pytest.raises(ValueError, match="parts of blocks"):
        resolve_stage_split(tiny, 2, "1.5,2.5", half_blocks=False)
    auto = resolve_stage_split(tiny, 2, "auto", half_blocks=False)
    assert balanced_split(tiny, 2, half_blocks=False) == tuple(auto.stage_layer_counts(2))
    assert auto.layer_split is None             # the even split found is the even split (fitted models still fit)


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
@pytest.mark.parametrize("split", [(1.5, 2, 0.5), (2.5, 1.5, 0)])
def test_the_memory_model_counts_each_half_block_as_the_meter_does(preset: str, split) -> None:
    """Stages that start with an MLP half and/or end with an attention half (the last one holding only
    an MLP half: no rotary tables), or a last stage of the head alone: states exact, activations within
    5% of the CPU meter."""
    import torch

    from dynmb.measure.memory import measure_stage_memory

    torch.set_num_threads(1)
    cfg = replace(ModelConfig.preset(preset), layer_split=split)
    mm = MemoryModel.analytic(cfg, 3)
    whole = MemoryModel.analytic(replace(cfg, layer_split=None), 4)
    assert mm.state_bytes.sum() == whole.state_bytes.sum()                    # every parameter counted once
    for stage in range(3):
        for rows, padded_len, docs in [(1, 256, 1), (2, 160, 3)]:
            got = measure_stage_memory(cfg, 3, stage, rows, padded_len, docs_per_row=docs)
            assert got["state_bytes"] == mm.state_bytes[stage]
            pred = float(mm.activation_bytes(stage, rows, padded_len)[0])
            assert abs(pred - got["act_bytes"]) <= 0.05 * got["act_bytes"], (stage, rows, padded_len, pred, got)
            peak = mm.state_bytes[stage] + pred + float(mm.transient_bytes(stage, rows, padded_len)[0])
            assert abs(peak - got["peak_bytes"]) <= 0.05 * got["peak_bytes"], (stage, rows, padded_len, peak, got)


# --------------------------------------------------------------------------- real gloo ranks
def _split_cfg(split: tuple[float, ...], kind: str = "1f1b", preset: str = "tiny", method: str = "dynamic",
               recompute: str = "never", head: tuple[int, ...] | None = None, virtual: int = 1) -> RunConfig:
    """``head``: the LM head's vocabulary rows per stage (``ModelConfig.head_split``); ``virtual``: chunks per rank."""
    model = ModelConfig.preset(preset, n_layers=int(sum(split)), layer_split=split, head_split=head)
    return RunConfig(model=model, pipeline=PipelineConfig(num_stages=len(split), schedule=kind, virtual=virtual,
                                                          memory_limit_bytes=2**30),
                     dataset="gsm8k", global_batch=8, method=method, seed=0, steps=1, warmup=0, recompute=recompute,
                     backend="gloo", device="cpu", timeout_s=90.0)


SPLIT_CASES = {2: {"split-1-3": ((1, 3), "1f1b"), "split-3-1-zbh1": ((3, 1), "zb-h1"),
                   # half-blocks, both families: recomputation, I/W (zb-h1), packed rows with document masks
                   "half-1.5-2.5-recompute": ((1.5, 2.5), "1f1b", "tiny", "dynamic", "always"),
                   "half-llama-2.5-1.5-zbh1": ((2.5, 1.5), "zb-h1", "llama-tiny"),
                   "half-llama-0.5-3.5-packed-recompute": ((0.5, 3.5), "1f1b", "llama-tiny", "packed", "always"),
                   "half-3.5-0.5-zbh1": ((3.5, 0.5), "zb-h1", "tiny", "packed"),
                   "head-alone-llama-4-0-zbh1": ((4, 0), "zb-h1", "llama-tiny"),
                   # the head split by vocabulary: a shard beside every layer on rank 0, the rest on rank 1
                   "vocab-llama-4-0-200-312": ((4, 0), "1f1b", "llama-tiny", "dynamic", "never", (200, 312)),
                   "vocab-4-0-300-212-packed-zbh1": ((4, 0), "zb-h1", "tiny", "packed", "never", (300, 212)),
                   "vocab-4-0-100-412-recompute": ((4, 0), "1f1b", "tiny", "dynamic", "always", (100, 412)),
                   # interleaved: chunks 2 and 3 (the two row-only shards) on ranks 0 and 1
                   "vocab-llama-2-2-0-0-interleaved": ((2, 2, 0, 0), "interleaved", "llama-tiny", "dynamic", "never",
                                                       (0, 0, 200, 312), 2)},
               4: {"split-1-2-2-1": ((1, 2, 2, 1), "1f1b"),
                   "half-llama-1.5-1-1-0.5": ((1.5, 1, 1, 0.5), "1f1b", "llama-tiny", "dynamic", "always"),
                   "half-0.5-1.5-1.5-0.5-zbh1": ((0.5, 1.5, 1.5, 0.5), "zb-h1", "tiny", "packed"),
                   "head-alone-2-1.5-0.5-0": ((2, 1.5, 0.5, 0), "1f1b", "tiny", "dynamic", "always"),
                   "vocab-llama-2-2-0-0-200-312": ((2, 2, 0, 0), "1f1b", "llama-tiny", "dynamic", "never",
                                                   (0, 0, 200, 312)),
                   "vocab-2-1.5-0.5-0-100-412-zbh1": ((2, 1.5, 0.5, 0), "zb-h1", "tiny", "packed", "never",
                                                      (0, 0, 100, 412))}}


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
    from dynmb.io.results import load_results

    job = gloo_job(nproc)
    assert job.returncode == 0, job.errors
    for name, (split, *args) in SPLIT_CASES[nproc].items():
        t = load_results(job.out / name)
        assert t["steps"]["verified"].all(), name
        recorded = str(t["runs"]["model.layer_split"].iloc[0])          # a list, or numpy's print of it
        assert tuple(float(x) for x in re.findall(r"\d+(?:\.\d+)?", recorded)) == split, name
        head = args[4] if len(args) > 4 else None
        if head is not None:
            recorded = str(t["runs"]["model.head_split"].iloc[0])
            assert tuple(int(x) for x in re.findall(r"\d+", recorded)) == head, name


def test_auto_with_more_stages_than_layers_splits_half_blocks():
    """More pipeline stages (model chunks with virtual stages) than layers: only parts of blocks cover
    them, so ``auto`` returns that split instead of failing on an even split that does not exist; up to
    one stage per chunk the model allows (llama-tiny: two K/V-head groups and eight column chunks a layer)."""
    from dynmb.core.config import model_config
    cfg = model_config("llama-tiny")
    n = cfg.n_layers
    split = resolve_stage_split(cfg, n + 1, "auto").layer_split
    assert len(split) == n + 1 and sum(split) == n and 0 < min(split) < 1
    finest = resolve_stage_split(cfg, 10 * n, "auto")
    assert len(finest.layer_split) == 10 * n and finest.chunk_split
    with pytest.raises(ValueError, match="chunks the model allows"):
        resolve_stage_split(cfg, 10 * n + 1, "auto")


def test_a_head_heavier_than_a_stage_gets_the_last_stage_alone():
    """Llama-3.1-8B's 128k head is ~2.3 layers of work: at P 16 the last stage holds it alone (split
    ending in 0), strictly below the busiest stage of every split with a non-empty last stage; the
    split search's candidates keep the empty stage last; a 32k head (Llama-2-7B) never stands alone."""
    from dynmb.core.config import model_config
    from dynmb.planning.split_search import near_optimal_splits
    from dynmb.planning.stage_split import _min_max_partition, flops_cost, unit_work, with_split

    cfg = model_config("llama3.1-8b")
    split = balanced_split(cfg, 16, half_blocks=True)
    assert split[-1] == 0 and sum(split) == cfg.n_layers
    units, first, last = unit_work(cfg, flops_cost(), True)
    non_empty_best = _min_max_partition(units, 16, first, last)[1]
    assert max(stage_work(cfg, split)) < non_empty_best * (1 - 1e-6)
    assert stage_work(cfg, split)[-1] == pytest.approx(last)
    cands, _ = near_optimal_splits(cfg, 16, flops_cost(), half_blocks=True)
    assert cands[0] == split and len(cands) > 1
    for c in cands:
        assert 0 not in c[:-1], c
        assert with_split(cfg, 16, c).stage_layer_counts(16) == [float(x) for x in c]
    llama2 = model_config("llama2-7b")
    assert all(balanced_split(llama2, p, half_blocks=True)[-1] > 0 for p in (2, 4, 8, 16, 32))
