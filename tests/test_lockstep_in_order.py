"""The ``in-order`` packing method (``dynmb.packing.in_order``): property tests of its rows and its deal."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dynmb
from dynmb.core.planspec import PlanSpec
from dynmb.costmodel import get_cost_model
from dynmb.costmodel.loader import Models
from dynmb.memory.model import get_memory_model
from dynmb.packing import PackingError, pack
from dynmb.packing.in_order import in_order_flat, in_order_rows
from dynmb.packing.lockstep import LockstepShape, layout_of_plan
from dynmb.packing.rows import next_fit_rows
from dynmb.planning.spec_check import check_plan_spec

CFG = dynmb.model_config("llama-tiny")
P = 2
CM = get_cost_model(None, CFG, P)
MM = get_memory_model(None, CFG, P)


def _lens(n: int, T: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(1, T + 1, n) if seed % 2 else np.minimum(rng.pareto(1.2, n) * 8 + 1, T).astype(np.int64)


def _global_rows(flat, dp: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """(global row k of every item of ``flat``, its document), from the replica-major microbatch index and the
    local row: microbatch ``d M + j``, local row ``r`` is the ``(j b + r)``-th row of replica ``d``, row ``k = (j b
    + r) D + d`` of the round-robin deal."""
    M = len(flat.nseq) // dp
    mb = np.repeat(np.arange(len(flat.nseq)), flat.nseq)
    d, j = np.divmod(mb, M)
    return (j * b + flat.local_row) * dp + d, flat.items


cases = st.tuples(st.sampled_from([64, 128, 256]), st.integers(1, 8), st.integers(1, 3), st.integers(0, 2**31))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases)
def test_every_document_once_rows_within_T_sample_order_dealt_round_robin(case):
    T, dp, b, seed = case
    n = int(np.random.default_rng(seed).integers(dp * 2, 150))
    lens = _lens(n, T, seed)
    flat, meta = in_order_flat(lens, T, dp, b)
    k, doc = _global_rows(flat, dp, b)
    assert sorted(doc.tolist()) == list(range(n))                                  # every document once
    fill = np.bincount(k, weights=lens[doc])
    assert fill.max() <= T and np.all(fill > 0)                                    # rows <= T, none empty
    order = np.lexsort((doc, k))
    assert np.array_equal(doc[order], np.arange(n))                                # rows in sample order
    assert np.all(np.diff(k[order]) >= 0)
    M = meta["microbatches"]
    assert len(flat.nseq) == dp * M and np.all(flat.nseq > 0) and np.all(flat.batch <= b)  # same M everywhere
    nf = next_fit_rows(lens, T)
    cuts = np.flatnonzero(np.diff(k[order]))                                       # rows: next-fit but <= D - 1 cuts
    assert set(np.flatnonzero(np.diff(nf)).tolist()) <= set(cuts.tolist())
    assert len(cuts) - (int(nf[-1])) <= dp - 1


def test_plan_keeps_the_deal_and_refuses_split():
    """Through ``pack``: microbatch j of replica d holds rows j D + d (b = 1), in sample order; ``--oversize
    truncate`` cuts at T; ``split`` is refused as for ``lockstep``."""
    lens = np.array([40, 30, 50, 64, 10, 10, 10, 90, 5, 33, 20, 60])
    spec = PlanSpec(method="in-order", num_stages=P, dp=3, pack_len=64, oversize="truncate",
                    memory_limit_bytes=2**31)
    plan = pack(lens, spec, models=Models(CM, MM))
    rows = in_order_rows(np.minimum(lens, 64), 64, 3)
    rid = np.asarray(plan.replica_ids)
    for d in range(3):
        mine = [mb for mb, r in zip(plan.microbatches, rid.tolist()) if r == d]
        for j, mb in enumerate(mine):
            assert mb.padded_len == 64 and set(rows[mb.seq_ids].tolist()) == {j * 3 + d}
            assert list(mb.seq_ids) == sorted(mb.seq_ids)
    assert plan.meta["microbatches"] == len(plan.microbatches) // 3
    with pytest.raises(ValueError, match="--oversize split"):
        check_plan_spec(PlanSpec(method="in-order", pack_len=64, oversize="split"))
    with pytest.raises(PackingError, match="cannot give each of the 4 replicas"):
        in_order_rows(np.array([64, 64, 64]), 64, 4)


def test_last_round_rows_split_in_sample_order():
    """Next-fit gives 4 rows; for 3 replicas the last round holds 1, so the row of most documents is cut (its
    later half opening the next row) until the rounds are full: 5 rows (last round 2), then 6."""
    lens = np.array([10, 10, 10, 60, 60, 60])
    assert next_fit_rows(lens, 64).tolist() == [0, 0, 0, 1, 2, 3]
    assert in_order_rows(lens, 64, 3).tolist() == [0, 1, 2, 3, 4, 5]
    assert in_order_rows(lens, 64, 3, 2).tolist() == [0, 0, 0, 1, 2, 3]     # b 2: the last round's 4 rows fill 3
    assert in_order_rows(lens, 64, 2).tolist() == [0, 0, 0, 1, 2, 3]          # 4 rows: two full rounds


def test_planner_sampler_and_study_layout_use_it():
    lens = np.random.default_rng(0).integers(1, 200, 64)
    planner = dynmb.Planner(model=CFG, num_stages=P, memory_limit="2GiB", dp=2, pack_len=256)
    step = planner.plan(lens, method="in-order")
    assert step.plan.method == "in-order" and step.plan.meta["reorder"] == "none"
    sampler = dynmb.DynamicBatchSampler(lens, 64, model=CFG, num_stages=P, memory_limit="2GiB", method="in-order",
                                        num_replicas=2, rank=1, pack_len=256, shuffle=False)
    mine = [mb for mb, r in zip(step.plan.microbatches, step.plan.replica_ids) if r == 1]
    assert len(list(sampler)) == len(mine)
    lay = layout_of_plan(step.plan, LockstepShape(pack_len=256, dp=2), CM)       # the study's (a0)
    assert lay.grid[1] == len(mine) and len(lay.row_of) == len(lens)


def test_compare_runs_it_as_a_row_method(tmp_path):
    """``dynmb compare --methods in-order,...`` plans a case for it with the pack length (as ``packed``'s)."""
    from dynmb.jobs.compare import CompareSettings, prepare_compare

    job = prepare_compare(CompareSettings(methods=("in-order", "packed", "dynamic"), pack_len=512, device="cpu",
                                          out=str(tmp_path / "c")))
    assert {c.method: c.spec.run.pack_len for c in job.cases} == {"in-order": 512, "packed": 512, "dynamic": None}
