"""The re-balance of a layout recomputing leading blocks on any stage (``memory_split._rebalanced``, the ``extras``
of ``partition.min_max_partition``) and the home of the rest-layout cost models (``costmodel.split._rest_model``).

On the code before (c7a7e84): ``_rebalanced`` returned None wherever a stage other than 0 recomputed blocks (only
stage 0's extra forward was counted), ``min_max_partition`` took no ``extras``, and ``_block_costs`` kept its rest
models in the cost model's ``__dict__`` (``_rest_models``), so the cases below fail there."""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dynmb
from dynmb.core.config import ModelConfig
from dynmb.costmodel import split as cm_split
from dynmb.costmodel.analytic import AnalyticCostModel
from dynmb.costmodel.gpu import GPUCostModel
from dynmb.planning import memory_split as ms
from dynmb.planning.partition import min_max_partition
from dynmb.planning.split_units import UNITS_PER_LAYER
from dynmb.planning.stage_split import resolve_stage_split

# --- the partition with a fixed work per segment -------------------------------------------------------------------


def _brute_min_max(units: np.ndarray, p: int, first: float, last: float, extras: list[float]) -> float:
    best = np.inf
    for cuts in itertools.combinations(range(1, units.size), p - 1):
        bounds = (0, *cuts, units.size)
        segs = [float(units[bounds[k]:bounds[k + 1]].sum()) + extras[k] for k in range(p)]
        segs[0] += first
        segs[-1] += last
        best = min(best, max(segs))
    return best


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 9).flatmap(lambda n: st.tuples(
    st.lists(st.floats(0.1, 5.0), min_size=n, max_size=n), st.integers(1, min(n, 4)),
    st.floats(0.0, 3.0), st.floats(0.0, 3.0), st.lists(st.floats(0.0, 4.0), min_size=4, max_size=4))))
def test_extras_per_segment_give_the_best_contiguous_partition(case: tuple) -> None:
    """Every segment non-empty, the busiest segment (its units, its extra, ``first`` / ``last`` at the ends) as low
    as any contiguous partition's, the counts summing to the units."""
    units_list, p, first, last, extras_all = case
    units, extras = np.array(units_list), extras_all[:p]
    counts, top, _ = min_max_partition(units, p, first, last, extras)
    assert len(counts) == p and min(counts) >= 1 and sum(counts) == units.size
    bounds = np.concatenate([[0], np.cumsum(counts)])
    segs = [units[bounds[k]:bounds[k + 1]].sum() + extras[k] for k in range(p)]
    segs[0] += first
    segs[-1] += last
    assert max(segs) == pytest.approx(top, rel=1e-12)
    assert top == pytest.approx(_brute_min_max(units, p, first, last, extras), rel=1e-12)


def _loop_partition(units: np.ndarray, p: int, first: float, last: float, extras: list[float]) -> tuple:
    """The DP one segment end at a time (the code before it was vectorised over the ends), the reference."""
    n = units.size
    prefix = np.concatenate([[0.0], np.cumsum(units)])
    best_max, best_sq = np.full((p, n + 1), np.inf), np.full((p, n + 1), np.inf)
    arg = np.zeros((p, n + 1), dtype=np.int64)
    seg0 = prefix + first + extras[0] + np.where(np.arange(n + 1) == n, last, 0.0)
    best_max[0, 1:], best_sq[0, 1:] = seg0[1:], seg0[1:] ** 2
    for k in range(1, p):
        for end in range(k + 1, n + 1):
            starts = np.arange(k, end)
            seg = prefix[end] - prefix[starts] + extras[k] + (last if end == n else 0.0)
            mx, sq = np.maximum(best_max[k - 1, starts], seg), best_sq[k - 1, starts] + seg ** 2
            ties = np.flatnonzero(mx <= mx.min() * (1 + 1e-12))
            pick = ties[np.argmin(sq[ties])]
            best_max[k, end], best_sq[k, end], arg[k, end] = mx[pick], sq[pick], starts[pick]
    split, end = [], n
    for k in range(p - 1, 0, -1):
        split.append(end - int(arg[k, end]))
        end = int(arg[k, end])
    return list(reversed([*split, end])), float(best_max[p - 1, n]), float(best_sq[p - 1, n])


@pytest.mark.parametrize("seed", range(6))
def test_the_vectorised_partition_is_the_loops_bit_for_bit(seed: int) -> None:
    """Same counts, max and sum of squares as the DP one end at a time, ties included (units on a quarter grid)."""
    rng = np.random.default_rng(seed)
    for _ in range(40):
        n = int(rng.integers(1, 70))
        p = int(rng.integers(1, min(n, 16) + 1))
        units = rng.uniform(0.1, 3.0, n) if seed % 2 else np.round(rng.uniform(0.25, 4.0, n) * 4) / 4
        first, last, extras = float(rng.uniform(0, 3)), float(rng.uniform(0, 3)), list(rng.uniform(0, 2, p))
        assert min_max_partition(units, p, first, last, extras) == _loop_partition(units, p, first, last, extras)


def test_no_extras_is_all_zero_extras_and_a_wrong_count_is_refused() -> None:
    units = np.random.default_rng(3).uniform(0.5, 2.0, size=24)
    assert min_max_partition(units, 5, 0.7, 1.1) == min_max_partition(units, 5, 0.7, 1.1, [0.0] * 5)
    with pytest.raises(ValueError, match="extras must hold 5 numbers"):
        min_max_partition(units, 5, 0.7, 1.1, [1.0, 2.0])


# --- the re-balance of a recomputing layout -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gsm8k_l2_p8() -> tuple[ModelConfig, ms.ReliefInputs, ms._Work]:
    trace = dynmb.data.load_trace("gsm8k")
    cfg = replace(dynmb.model_config("llama2-7b"), max_seq_len=int(trace.max()))
    cfg = resolve_stage_split(cfg, 8, "auto", workload=trace, cost_model=GPUCostModel(cfg, 8))
    inputs = ms.ReliefInputs(memory_limit_bytes=24 << 30, schedule_kind="auto", workload=trace,
                             cost_model=GPUCostModel(cfg, 8))
    return cfg, inputs, ms._work(cfg, inputs)


def _busiest(cfg: ModelConfig, split: tuple[float, ...], work: ms._Work, blocks: tuple[int, ...]) -> float:
    """The busiest stage before the tail of ``split``: its units' work plus the forward its recomputed blocks hold
    there (``_recomputed_fwd``: a layer's remainder at a stage's start is its first block)."""
    tail = ms._tail(cfg, len(split))
    bounds = np.concatenate([[0], [work.row.index(int(round(UNITS_PER_LAYER * x))) for x in np.cumsum(split[:tail])]])
    loads = [float(work.row.work[bounds[i]:bounds[i + 1]].sum()) for i in range(tail)]
    loads[0] += work.row.first
    extras = ms._recomputed_fwd(cfg, len(split), work, split, blocks, tail)
    assert extras is not None
    return max(load + extra for load, extra in zip(loads, extras))


@pytest.mark.parametrize("blocks", [(0, 1, 0, 0, 0, 0, 0, 0), (0, 0, 2, 0, 0, 0, 0, 0), (1, 1, 1, 0, 0, 0, 0, 0),
                                    (1, 0, 0, 0, 0, 0, 1, 0)])
def test_every_recomputing_stage_sheds_work_in_the_rebalance(gsm8k_l2_p8, blocks: tuple[int, ...]) -> None:
    """Blocks recomputed on stages past 0 (stage 0's only, before): the re-balanced split exists, the recomputing
    stages hold fewer layers together than on the work-balanced split, its busiest stage (units + the forward its
    blocks hold there) is less busy than the balanced split's with the same blocks, and it is the partition of the
    forward its blocks hold on it (the re-count converged). Fails on the stage-0-only code (None)."""
    cfg, inputs, work = gsm8k_l2_p8
    balanced = tuple(cfg.stage_layer_counts(8))
    split = ms._rebalanced(cfg, 8, work, blocks)
    assert split is not None and sum(split) == pytest.approx(sum(balanced))
    assert sum(x for x, k in zip(split, blocks) if k) < sum(x for x, k in zip(balanced, blocks) if k)
    assert _busiest(cfg, split, work, blocks) < _busiest(cfg, balanced, work, blocks)
    tail = ms._tail(cfg, 8)
    body_end = work.row.index(int(round(UNITS_PER_LAYER * sum(balanced[:tail]))))
    again, _, _ = min_max_partition(work.row.work[:body_end], tail, work.row.first, 0.0,
                                    ms._recomputed_fwd(cfg, 8, work, split, blocks, tail))
    assert (*work.row.layers(again), *balanced[tail:]) == split
    layout = ms.with_recompute(cfg, 8, split, blocks)    # a layout that runs: each stage holds its blocks
    assert layout == ms.rebalanced_layout(cfg, 8, inputs, blocks)


def test_stage_0_alone_rebalances_as_before(gsm8k_l2_p8) -> None:
    """Stage 0 recomputing alone: the split the old rule gave (stage 0's forward added to its ``first``)."""
    cfg, _, work = gsm8k_l2_p8
    tail = ms._tail(cfg, 8)
    body_end = work.row.index(int(round(UNITS_PER_LAYER * sum(cfg.stage_layer_counts(8)[:tail]))))
    old, _, _ = min_max_partition(work.row.work[:body_end], tail, work.row.first + float(work.fwd[:32].sum()), 0.0)
    assert ms._rebalanced(cfg, 8, work, (2, 0, 0, 0, 0, 0, 0, 0)) == (*work.row.layers(old),
                                                                       *cfg.stage_layer_counts(8)[tail:])


def test_the_recompute_search_weighs_rebalanced_layouts_past_stage_0(gsm8k_l2_p8) -> None:
    """From a split whose stage 1 binds, ``recompute_steps`` weighs a re-balanced split recomputing on stage 1
    (before, only the same split: the re-balance refused it)."""
    cfg, inputs, work = gsm8k_l2_p8
    mean_len = max(1, int(round(float(np.asarray(inputs.workload, dtype=float).mean()))))
    split = ms.relief_candidates(cfg, 8, inputs)[-1]     # the most relieved stage 0: stage 1 binds there
    layout = ms.layout_of(cfg, 8, split)
    assert int(np.argmin(ms.stage_tokens(layout, 8, inputs))) > 0
    start = ms._Scored(*ms.step_proxy(layout, 8, inputs, mean_len), split)
    found = ms.recompute_steps(cfg, 8, inputs, start, mean_len, work)
    assert any(c.split != split and c.blocks is not None and any(c.blocks[1:]) for c in found)


# --- the rest models' home -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_cls", [GPUCostModel, AnalyticCostModel])
def test_pricing_a_recomputing_layout_keeps_nothing_in_the_model(model_cls: type) -> None:
    """The rest layouts' cost models are remembered by ``_rest_model`` (hashable inputs), not in the model's
    ``__dict__`` (before: ``_rest_models``); the price is the uncached one's."""
    cfg = replace(dynmb.model_config("llama-tiny"), layer_split=(2.5, 1.5), recompute_blocks=(1, 1))
    model = model_cls(cfg, 2)
    keys = set(vars(model))
    rows, lens = np.array([1.0, 2.0]), np.array([64.0, 200.0])
    first = model.stage_costs(rows, lens, ops=("F", "B", "I", "W"))
    assert set(vars(model)) == keys
    cm_split._rest_model.cache_clear()
    again = model_cls(cfg, 2).stage_costs(rows, lens, ops=("F", "B", "I", "W"))
    for op in first:
        np.testing.assert_array_equal(first[op], again[op])


def test_a_copy_of_another_layout_prices_its_own_blocks() -> None:
    """A copy of a model given another recomputing layout (as ``without_block_recompute`` gives a copy another
    field) prices that layout's blocks, as a fresh model does; before, the copy shared the first layout's rest
    models through the copied ``__dict__``."""
    base = dynmb.model_config("llama-tiny")
    a = replace(base, layer_split=(2.5, 1.5), recompute_blocks=(1, 0))
    b = replace(base, layer_split=(2.5, 1.5), recompute_blocks=(2, 0))
    rows, lens = np.array([1.0, 2.0]), np.array([64.0, 200.0])
    model = AnalyticCostModel(a, 2)
    model.stage_costs(rows, lens, ops=("B",))
    other = copy.copy(model)
    other.model_cfg = b
    np.testing.assert_array_equal(other.stage_costs(rows, lens, ops=("B",))["B"],
                                  AnalyticCostModel(b, 2).stage_costs(rows, lens, ops=("B",))["B"])
