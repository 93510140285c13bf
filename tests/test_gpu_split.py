"""The interleaved layer split balanced per GPU (``dynmb.planning.gpu_split``): exact at V = 2, never worse
than the per-chunk split, followed by the library API; V = 1 and ``even`` unchanged."""

from __future__ import annotations

import itertools
import logging
from dataclasses import replace

import numpy as np
import pytest

import dynmb
from dynmb.core.config import ModelConfig
from dynmb.costmodel.gpu import GPUCostModel
from dynmb.memory.model import get_memory_model
from dynmb.planning.gpu_split import chunk_caps, chunk_loads, gpu_balanced_partition
from dynmb.planning.split_search import SplitSearch, pick_layout
from dynmb.planning.split_work import workload_cost
from dynmb.planning.stage_split import (_min_max_partition, balanced_split, flops_cost, min_max_split, planned_layout, resolve_stage_split, split_ceiling,
                                        stage_work, unit_work)

# Llama-3's 128k vocabulary at 7B widths, 8 layers: the head is more than two layers of work, so at P 4 V 2
# the head's chunk 7 and its GPU partner chunk 3 overload GPU 3 under the per-chunk split
HEAVY_HEAD = ModelConfig(name="v128k-8", vocab_size=128256, d_model=4096, n_layers=8, n_heads=32, d_ff=11008)
P, V = 4, 2


def _compositions(n: int, s: int):
    for cuts in itertools.combinations(range(1, n), s - 1):
        bounds = (0, *cuts, n)
        yield [b - a for a, b in zip(bounds, bounds[1:])]


def _gpu_work(cfg: ModelConfig, split, virtual: int) -> np.ndarray:
    return np.asarray(stage_work(cfg, tuple(split))).reshape(virtual, -1).sum(axis=0)


@pytest.mark.parametrize("virtual", [2, 3])
def test_the_partition_against_exhaustive_search(virtual: int) -> None:
    """Random small cases (whole-layer-like, half-block-like and random unit work, a heavy last chunk), with
    the chunk caps of the per-chunk split (per round and memory) and without: every chunk non-empty, every
    unit covered, the caps kept; the busiest GPU never above the per-chunk min-max
    split's; at V = 2 the exhaustive optimum (the exact bisection), at V = 3 (local search alone) within 10%."""
    rng = np.random.default_rng(virtual)
    for case in range(40):
        p = int(rng.integers(2, 4)) if virtual == 2 else 2
        s = p * virtual
        n = int(rng.integers(s, s + 6))
        kind = case % 3
        a = rng.uniform(0.2, 0.5)
        units = np.ones(n) if kind == 0 else np.resize([a, 1 - a], n) if kind == 1 else rng.uniform(0.5, 1.5, n)
        first, last = float(rng.uniform(0, 0.5)), float(rng.uniform(0, 4))
        per_chunk = _min_max_partition(units, s, first, last)[0]
        caps = chunk_caps(per_chunk, units, first, last, virtual) * (1 + 1e-9)
        for ref in (0, None):                       # with the chunk caps (the default) and without
            counts, loads = gpu_balanced_partition(units, s, virtual, first, last, [per_chunk], bound_by=ref)
            assert len(counts) == s and min(counts) >= 1 and sum(counts) == n
            assert loads.key == chunk_loads(counts, units, first, last, virtual).key
            assert loads.gpus.sum() == pytest.approx(units.sum() + first + last)
            assert loads.key[0] <= chunk_loads(per_chunk, units, first, last, virtual).key[0] * (1 + 1e-9)
            fits = [c for c in _compositions(n, s)
                    if ref is None or np.all(chunk_loads(c, units, first, last, virtual).chunks <= caps)]
            assert ref is None or np.all(loads.chunks <= caps)
            best = min(chunk_loads(c, units, first, last, virtual).key[0] for c in fits)
            assert loads.key[0] <= best * (1 + (1e-9 if virtual == 2 else 0.1))


def test_a_heavy_head_is_balanced_per_gpu_not_per_chunk() -> None:
    """P 4 V 2 with a 128k head: the per-chunk min-max split leaves chunk 3 (the head's GPU partner) a full
    share; balanced per GPU it gets less, the busiest GPU does strictly less work, the optimum over every
    half-block partition; every layer is covered once and the config, memory model and split ceiling take it."""
    s = P * V
    units, first, last = unit_work(HEAVY_HEAD, flops_cost(), True)     # the per-chunk min-max, every chunk non-empty
    per_chunk = tuple(u / 2 for u in _min_max_partition(units, s, first, last)[0])
    per_gpu = balanced_split(HEAVY_HEAD, s, half_blocks=True, virtual=V)
    assert len(per_gpu) == s and sum(per_gpu) == HEAVY_HEAD.n_layers and min(per_gpu) >= 0.5
    assert _gpu_work(HEAVY_HEAD, per_gpu, V).max() < _gpu_work(HEAVY_HEAD, per_chunk, V).max() * (1 - 1e-6)
    assert per_gpu[P - 1] < per_chunk[P - 1]
    best = min(_gpu_work(HEAVY_HEAD, [c / 2 for c in comp], V).max() for comp in _compositions(2 * HEAVY_HEAD.n_layers, s))
    assert _gpu_work(HEAVY_HEAD, per_gpu, V).max() == pytest.approx(best, rel=1e-9)
    assert split_ceiling(HEAVY_HEAD, per_gpu, virtual=V) > split_ceiling(HEAVY_HEAD, per_chunk, virtual=V)
    cfg = replace(HEAVY_HEAD, layer_split=per_gpu)
    units = [u for r in cfg.stage_units(s) for u in r]
    assert units == list(range(16 * HEAVY_HEAD.n_layers)) and all(len(r) for r in cfg.stage_units(s))
    assert len(get_memory_model(None, cfg, s).state_bytes) == s


def test_resolve_stage_split_takes_virtual_from_the_caller_or_the_search(caplog) -> None:
    """``auto`` with ``virtual=2`` (or a split search whose spec has it) plans per GPU; ``even`` stays even;
    V = 1 (the default) is the per-chunk min-max split it always was (with the head sharded where it outweighs
    a stage, ``head_split``)."""
    s = P * V
    per_gpu = balanced_split(HEAVY_HEAD, s, half_blocks=True, virtual=V)
    assert resolve_stage_split(HEAVY_HEAD, s, "auto", virtual=V).layer_split == per_gpu
    search = SplitSearch.of(dict(num_stages=s, virtual=V, schedule_kind="interleaved", memory_limit_bytes=2**36),
                            global_batch=8)
    assert search is not None and search.spec.virtual == V
    with caplog.at_level(logging.INFO, logger="dynmb.planning.stage_split"):
        assert resolve_stage_split(HEAVY_HEAD, s, "auto", search=search).layer_split == per_gpu
    assert "2 chunks a GPU" in caplog.text
    assert resolve_stage_split(HEAVY_HEAD, s, "even", virtual=V).layer_split is None
    per_chunk = balanced_split(HEAVY_HEAD, s, half_blocks=True)
    assert per_chunk != per_gpu
    # V = 1: the per-chunk split, its head then sharded over the last stages where that lightens the busiest
    one = planned_layout(HEAVY_HEAD, s, per_chunk, flops_cost())
    assert resolve_stage_split(HEAVY_HEAD, s, "auto") == one
    assert resolve_stage_split(HEAVY_HEAD, s, "auto", virtual=1) == one
    assert one.layer_split == per_chunk or one.head_split is not None


def test_where_per_gpu_balance_gains_nothing_the_per_chunk_split_stays() -> None:
    """Llama-2-7B (32k head, about 1.4 layers): at P 8 and 16, V 2 no split lowers the busiest GPU below the
    per-chunk split's, so ``auto`` keeps that split exactly (no churn of the fitted models or the runs). With
    V > 1 the split is planned in half-blocks (chunks of halves only at V 1)."""
    cfg = dynmb.model_config("llama2-7b")
    for p in (8, 16):
        assert balanced_split(cfg, p * V, half_blocks=True, virtual=V) == \
            min_max_split(cfg, p * V, flops_cost(), half_blocks=True)


def test_the_planner_plans_the_per_gpu_split_with_virtual_stages() -> None:
    """``Planner(virtual=2, stage_split="auto")`` (the library API) plans the split balanced per GPU, its cost
    and memory models made for it, and plans a batch on it."""
    s, lengths = P * V, [512, 1024, 2048, 700]
    cm = GPUCostModel(HEAVY_HEAD, s)
    planner = dynmb.Planner(model=HEAVY_HEAD, num_stages=s, virtual=V, schedule="interleaved", memory_limit="80GiB",
                            cost_model=cm, stage_split="auto", workload=lengths)
    cost = workload_cost(lengths, HEAVY_HEAD, cm)
    per_gpu = balanced_split(HEAVY_HEAD, s, half_blocks=True, virtual=V, stage_cost=cost)
    per_chunk = balanced_split(HEAVY_HEAD, s, half_blocks=True, stage_cost=cost)
    assert planner.model_cfg.layer_split == per_gpu != per_chunk
    out = planner.plan(np.array([512, 1024, 2048, 700, 300, 900, 1500, 64] * 2))
    assert out.plan.num_stages == s and out.plan.predictions["pred_step_s"] > 0


def test_the_split_search_with_virtual_stages_simulates_per_gpu_and_per_chunk() -> None:
    """With V = 2 the choice by simulated step weighs the split balanced per GPU (first: kept unless the
    other is faster per real token by more than the noise, ``pick_layout``) and the per-chunk min-max split."""
    s, lengths = P * V, [512, 1024, 2048, 700, 300, 900, 1500, 64]
    cm = GPUCostModel(HEAVY_HEAD, s)
    cost = workload_cost(lengths, HEAVY_HEAD, cm)
    search = SplitSearch.of(dict(num_stages=s, virtual=V, schedule_kind="interleaved", memory_limit_bytes=80 * 2**30,
                                 oversize="truncate"), global_batch=16)
    choice = search.choose(HEAVY_HEAD, s, cost, workload=lengths, cost_model=cm)
    per_gpu = balanced_split(HEAVY_HEAD, s, half_blocks=True, virtual=V, stage_cost=cost)
    assert choice.how == "simulated" and choice.candidates == (per_gpu, balanced_split(HEAVY_HEAD, s, half_blocks=True,
                                                                                         stage_cost=cost))
    assert all(np.isfinite(choice.scores_s)) and choice.split in choice.candidates
    assert choice.candidates.index(choice.split) == pick_layout(choice.batch_scores).index


def test_the_command_line_and_compare_pass_virtual() -> None:
    """``--virtual 2 --stage-split auto`` (``cli.flags.model_from_args``, what ``run`` reads) and ``compare``'s
    settings plan the split balanced per GPU (gpt2: its 50k head is several layers of work at 768 wide)."""
    import argparse

    from dynmb.cli.flags import model_from_args
    from dynmb.jobs.compare import _split_model

    s, cfg = P * V, dynmb.model_config("gpt2")
    per_gpu = balanced_split(cfg, s, half_blocks=True, virtual=V)
    assert per_gpu != balanced_split(cfg, s, half_blocks=True)
    args = argparse.Namespace(model="gpt2", stages=s, virtual=V, stage_split="auto", attention=None)
    assert model_from_args(args).layer_split == per_gpu
    assert model_from_args(argparse.Namespace(**{**vars(args), "virtual": None})).layer_split != per_gpu
    assert _split_model(cfg, s, "auto", None, None, None, V).layer_split == per_gpu
