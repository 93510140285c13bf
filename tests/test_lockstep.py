"""The ``lockstep`` packing method: property tests of its invariants and its balance report."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dynmb
from dynmb.costmodel import get_cost_model
from dynmb.core.planspec import PlanSpec
from dynmb.memory.model import get_memory_model
from dynmb.packing import PackingError, pack
from dynmb.packing.lockstep import (LockstepShape, balanced_fill, doc_weights, layout_of_plan, layout_of_rows,
                                    plan_lockstep, rebalance)
from dynmb.packing.rows import bfd_rows
from dynmb.planning.spec_check import check_plan_spec
from dynmb.costmodel.loader import Models

CFG = dynmb.model_config("llama-tiny")
P = 2
CM = get_cost_model(None, CFG, P)
MM = get_memory_model(None, CFG, P)


def _plan(lens: np.ndarray, T: int, dp: int, mbs: int) -> dynmb.Plan:
    spec = PlanSpec(method="lockstep", num_stages=P, dp=dp, mbs=mbs, pack_len=T, memory_limit_bytes=2**31)
    return pack(lens, spec, models=Models(CM, MM))


def _busy(plan: dynmb.Plan, T: int, mbs: int) -> np.ndarray:
    """[D, m] bottleneck-stage F + B of every replica's microbatches, at the static shape (``mbs`` rows of T)
    with the attention work dynmb runs (``Microbatch.attention_work``)."""
    attn = np.array([float(mb.attention_work("auto")) for mb in plan.microbatches])
    c = CM.stage_costs(np.full(len(attn), mbs), np.full(len(attn), T), attn)
    busy = (c["F"] + c["B"]).max(axis=0)
    rid = np.asarray(plan.replica_ids)
    return np.stack([busy[rid == r] for r in range(plan.dp)])


batches = st.tuples(st.sampled_from([64, 128, 256]), st.integers(1, 4), st.integers(1, 2), st.integers(0, 2**31))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches)
def test_every_document_once_rows_within_T_and_reported_balance(case):
    T, dp, mbs, seed = case
    rng = np.random.default_rng(seed)
    n = int(rng.integers(dp * mbs * 2, 120))
    lens = rng.integers(1, T + 1, n) if seed % 2 else np.minimum(rng.pareto(1.2, n) * 8 + 1, T).astype(np.int64)
    plan = _plan(lens, T, dp, mbs)
    ids = np.concatenate([mb.seq_ids for mb in plan.microbatches])
    assert sorted(ids.tolist()) == list(range(n))                                   # every document once
    for mb in plan.microbatches:
        fill = np.bincount(mb.row_ids, weights=mb.lengths, minlength=mb.batch)
        assert mb.padded_len == T and mb.batch <= mbs and fill.max() <= T          # rows never longer than T
        assert np.array_equal(np.sort(lens[mb.seq_ids]), np.sort(mb.lengths))
    counts = np.bincount(plan.replica_ids, minlength=dp)
    assert np.all(counts == counts[0])                                              # same M on every replica
    busy = _busy(plan, T, mbs)                                                      # [D, M]: row i of every replica
    spread = busy.max(axis=0) - busy.min(axis=0)
    assert spread.max() <= plan.meta["replica_spread_s"] * (1 + 1e-9) + 1e-15
    assert np.all(spread / busy.max(axis=0) <= plan.meta["replica_spread"] + 1e-9)


def test_faster_than_packed_in_lockstep_on_a_long_tail_batch():
    """Long-tail documents: ``packed``'s rows, dealt to the replicas by total work, put rows of unequal
    attention work side by side; lockstep's plan is predicted faster, and the replicas wait less for each other
    at row i (summed over the slots: the slowest replica's microbatch less their mean)."""
    rng = np.random.default_rng(1)
    lens = np.minimum(rng.pareto(0.8, 700) * 10 + 1, 1024).astype(np.int64)
    shape = LockstepShape(pack_len=1024, dp=4)
    packed = pack(lens, PlanSpec(method="packed", num_stages=P, dp=4, pack_len=1024, memory_limit_bytes=2**31),
                  models=Models(CM, MM))
    base = layout_of_plan(packed, shape, CM)
    best = plan_lockstep(lens, shape, CM)
    assert best.step_s < base.step_s
    wait = [float(((lay.F + lay.B).max(axis=0).max(axis=2) - (lay.F + lay.B).max(axis=0).mean(axis=2)).sum())
            for lay in (best, base)]
    assert wait[0] < wait[1]


def test_plan_lockstep_never_slower_than_its_packed_rows():
    rng = np.random.default_rng(3)
    for _ in range(5):
        lens = np.minimum(rng.pareto(1.0, 300) * 20 + 1, 512).astype(np.int64)
        shape = LockstepShape(pack_len=512, dp=2, groups=2)
        lay = plan_lockstep(lens, shape, CM)
        ref = layout_of_rows(bfd_rows(lens, 512), lens, shape, lay.grid[1], CM, "packed rows")
        assert lay.step_s <= ref.step_s + 1e-12
        assert sorted(np.bincount(lay.row_of, weights=lens, minlength=lay.row_of.max() + 1).tolist())[-1] <= 512


@pytest.mark.parametrize("dims", ["D", "M", "G"])
def test_rebalance_keeps_documents_and_rows(dims):
    rng = np.random.default_rng(5)
    lens = np.minimum(rng.pareto(1.0, 400) * 20 + 1, 512).astype(np.int64)
    shape = LockstepShape(pack_len=512, dp=2, groups=2)
    M = -(-(int(bfd_rows(lens, 512).max()) + 1) // 4)
    base = layout_of_rows(bfd_rows(lens, 512), lens, shape, M, CM, "packed rows")
    out = rebalance(base, lens, dims, shape, CM)
    assert len(out.row_of) == len(lens)
    assert np.bincount(out.row_of, weights=lens).max() <= 512
    axis = {"G": 1, "M": 2, "D": 3}[dims]          # the pools re-filled: only documents of one pool move
    moved = np.flatnonzero(out.row_of != base.row_of)
    grid = (2, base.grid[1], 2)
    before = np.stack(np.unravel_index(base.row_of[moved], grid), axis=1)
    after = np.stack(np.unravel_index(out.row_of[moved], grid), axis=1)
    same = [a for a in range(3) if a != axis - 1]
    assert np.array_equal(before[:, same], after[:, same])


def test_balanced_fill_none_when_full_and_weights_monotone():
    assert balanced_fill(np.array([3, 3, 3]), np.ones(3), 2, 5) is None
    w = doc_weights(np.array([1, 10, 100]), 128, CM)
    assert np.all(np.diff(w) > 0)


def test_refusals_name_the_flag():
    with pytest.raises(ValueError, match="--oversize split"):
        check_plan_spec(PlanSpec(method="lockstep", pack_len=64, oversize="split"))
    with pytest.raises(ValueError, match="--reorder search"):
        check_plan_spec(PlanSpec(method="lockstep", pack_len=64, reorder="search", dp=2))
    check_plan_spec(PlanSpec(method="lockstep", pack_len=64, reorder="search"))     # one replica: any order
    planner = dynmb.Planner(model=CFG, num_stages=P, memory_limit="2GiB", dp=2, pack_len=64)
    with pytest.raises(ValueError, match="--reorder search"):                      # the API path refuses too
        planner.plan(np.full(20, 30), method="lockstep", reorder="search")
    with pytest.raises(PackingError, match="more than the"):
        plan_lockstep(np.full(10, 60), LockstepShape(pack_len=64, dp=2, microbatches=2), CM)


def test_planner_and_sampler_use_it():
    lens = np.random.default_rng(0).integers(1, 200, 64)
    planner = dynmb.Planner(model=CFG, num_stages=P, memory_limit="2GiB", dp=2, pack_len=256)
    step = planner.plan(lens, method="lockstep")
    assert step.plan.method == "lockstep" and step.plan.meta["reorder"] == "none"
    sampler = dynmb.DynamicBatchSampler(lens, 64, model=CFG, num_stages=P, memory_limit="2GiB", method="lockstep",
                                        num_replicas=2, rank=1, pack_len=256)
    recs = list(sampler)
    mine = [mb for mb, r in zip(step.plan.microbatches, step.plan.replica_ids) if r == 1]
    assert len(recs) == len(mine) and all(r.padded_len == 256 for r in recs)


def test_light_ends_put_the_lightest_rows_at_fill_and_drain():
    """Step 3 (iii): the candidates keeping the end slots light hold every document once, and their first and last
    slot of every group are lighter than the group's middle slots on average."""
    from dynmb.packing.lockstep import _light_ends

    rng = np.random.default_rng(5)
    lens = np.minimum(rng.pareto(0.9, 400) * 12 + 1, 512).astype(np.int64)
    shape = LockstepShape(pack_len=512, dp=2, groups=2)
    M = plan_lockstep(lens, shape, CM).grid[1]
    lays = _light_ends(lens, doc_weights(lens, 512, CM), shape, M, CM)
    assert lays and M >= 4
    for lay in lays:
        assert len(lay.row_of) == len(lens) and np.bincount(lay.row_of, weights=lens).max() <= 512
        slot = (lay.F + lay.B).max(axis=0).max(axis=2)                  # [G, M] slot maxima
        assert np.all(slot[:, [0, -1]].mean(axis=1) < slot[:, 1:-1].mean(axis=1))
