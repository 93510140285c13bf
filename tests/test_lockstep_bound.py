"""``step_lower_bound`` and ``fewest_rows`` (``dynmb.packing.lockstep``): never above any planner's predicted step."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dynmb
from dynmb.core.planspec import PlanSpec
from dynmb.costmodel import get_cost_model, gpu
from dynmb.costmodel.loader import Models
from dynmb.memory.model import get_memory_model
from dynmb.packing import pack
from dynmb.packing.lockstep import (LockstepShape, fewest_rows, layout_of_plan, layout_of_rows, plan_lockstep,
                                    step_lower_bound)
from dynmb.packing.rows import bfd_rows

CFG = dynmb.model_config("llama-tiny")


def _models(P: int, kind: str) -> Models:
    cm = gpu.GPUCostModel(CFG, P, link="ib") if kind == "gpu" else get_cost_model(None, CFG, P)
    return Models(cm, get_memory_model(None, CFG, P))


def _lens(n: int, T: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(1, T + 1, n) if seed % 2 else np.minimum(rng.pareto(1.0, n) * T / 8 + 1, T).astype(np.int64)


def _optimal_rows(lens: list[int], T: int) -> int:
    """The fewest rows by exhaustive search (small batches): each document into an open row or a new one."""
    best = len(lens)

    def place(i: int, fill: list[int]) -> None:
        nonlocal best
        if len(fill) >= best:
            return
        if i == len(lens):
            best = len(fill)
            return
        for r in range(len(fill)):
            if fill[r] + lens[i] <= T:
                fill[r] += lens[i]
                place(i + 1, fill)
                fill[r] -= lens[i]
        place(i + 1, fill + [lens[i]])

    place(0, [])
    return best


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=8), st.integers(20, 30))
def test_fewest_rows_between_the_volume_and_the_optimum(lens, T):
    k = fewest_rows(np.array(lens), T)
    assert -(-sum(lens) // T) <= k <= _optimal_rows(sorted(lens, reverse=True), T)
    assert k >= sum(2 * s > T for s in lens)                          # two long documents never share a row


def test_fewest_rows_sees_what_the_volume_misses():
    """Three documents of 0.6 T need three rows although their tokens fit in two."""
    assert fewest_rows(np.array([60, 60, 60]), 100) == 3
    assert fewest_rows(np.array([60, 60, 60, 40, 40, 40]), 100) == 3
    assert fewest_rows(np.array([], dtype=np.int64), 100) == 0


cases = st.tuples(st.sampled_from([64, 128, 256]), st.integers(2, 4), st.integers(1, 3), st.integers(1, 2),
                  st.sampled_from(["gpu", "analytic"]), st.integers(0, 2**31))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases)
def test_bound_never_above_lockstep_in_order_packed_or_random_rows(case):
    """Random small batches: the bound is at most the predicted step of lockstep, of in-order and ``packed`` run in
    lockstep (``layout_of_plan``) and of random placements of the documents (``layout_of_rows``), at their own M."""
    T, P, D, G, kind, seed = case
    models = _models(P, kind)
    cm = models.cost
    n = int(np.random.default_rng(seed).integers(D * G * 2, 120))
    lens = _lens(n, T, seed)
    shape = LockstepShape(pack_len=T, dp=D, groups=G)
    lb = step_lower_bound(lens, shape, cm)
    steps = {"lockstep": plan_lockstep(lens, shape, cm).step_s}
    spec = PlanSpec(method="packed", num_stages=P, dp=D, pack_len=T, memory_limit_bytes=2**50)
    for method in ("packed", "in-order"):
        steps[method] = layout_of_plan(pack(lens, replace(spec, method=method), models=models), shape, cm).step_s
    rng = np.random.default_rng(seed)
    rows = bfd_rows(lens, T)
    M = max(lb.microbatches, -(-(int(rows.max()) + 1) // (G * D)))
    steps["random"] = layout_of_rows(rng.permutation(int(rows.max()) + 1)[rows], lens, shape, M, cm).step_s
    for name, step in steps.items():
        assert lb.lb_s <= step * (1 + 1e-12), (name, lb, step)


def test_bound_is_the_step_on_one_stage_with_full_rows():
    """One stage, one replica, every document a full row (attention ``T^2 = s^2``): the step is the sum of the
    microbatches' F + B, which is what the bound counts; the bound is exact, and the fewest rows are the documents."""
    cm = get_cost_model(None, CFG, 1)
    lens = np.full(6, 128)
    shape = LockstepShape(pack_len=128, dp=1, groups=2)
    lb = step_lower_bound(lens, shape, cm)
    lay = layout_of_rows(np.arange(6), lens, shape, 3, cm)
    assert lb.rows == 6 and lb.microbatches == 3
    assert lb.lb_s == pytest.approx(lay.step_s, rel=1e-9)


def test_bound_grows_with_the_attention_and_with_the_shapes_microbatches():
    cm = gpu.GPUCostModel(CFG, 4)
    short, long_ = np.full(64, 32), np.array([256] * 8)                 # the same tokens, 8x the attention
    shape = LockstepShape(pack_len=256, dp=2, groups=1)
    assert step_lower_bound(long_, shape, cm).lb_s > step_lower_bound(short, shape, cm).lb_s
    assert step_lower_bound(short, replace(shape, microbatches=9), cm).lb_s > step_lower_bound(short, shape, cm).lb_s


class _Quadratic:
    """A cost model whose op cost grows with the square of the attention work (not affine)."""

    num_stages = 2

    def stage_costs(self, rows, padded_len, attn=None):
        a = np.asarray(attn, dtype=np.float64)
        return {op: np.stack([1e-3 + 1e-12 * a * a] * 2) for op in ("F", "B")}

    def comm_s(self, rows, padded_len):
        return np.zeros(np.size(rows))


def test_bound_refuses_what_it_cannot_prove():
    lens = np.array([10, 20, 30])
    with pytest.raises(ValueError, match="not affine"):
        step_lower_bound(lens, LockstepShape(pack_len=64), _Quadratic())
    with pytest.raises(ValueError, match="1f1b / gpipe"):
        step_lower_bound(lens, LockstepShape(pack_len=64, kind="zb-h1"), gpu.GPUCostModel(CFG, 2))
    with pytest.raises(dynmb.packing.PackingError, match="longer than the row"):
        step_lower_bound(np.array([65]), LockstepShape(pack_len=64), gpu.GPUCostModel(CFG, 2))


def test_exhaustive_search_is_right():
    """The test's own reference: the exhaustive optimum on cases whose answer is known."""
    assert _optimal_rows([6, 5, 4, 3, 2], 10) == 2
    assert _optimal_rows([7, 7, 7], 10) == 3
    assert all(_optimal_rows(list(p), 10) == 2 for p in itertools.permutations([6, 4, 5, 5]))
