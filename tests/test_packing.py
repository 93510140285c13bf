"""Packers (dynmb.packing): invariants, memory safety, errors, data parallelism, quality."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynmb._packutil import est_makespan, ffd_rows, next_fit_rows
from dynmb.config import ModelConfig
from dynmb.memory import MemoryModel
from dynmb.packing import METHODS, PackingError, auto_mbs, max_fitting_length, pack

TINY = ModelConfig.preset("tiny")
SMALL = ModelConfig.preset("small")


class AffineCost:
    """A tiny analytic stand-in with the CostModel interface (stage_costs, comm_s)."""

    def __init__(self, cfg, p, overhead=1e-3):
        self.cfg, self.num_stages, self.overhead = cfg, p, overhead

    def stage_costs(self, rows, padded_len):
        b = np.atleast_1d(np.asarray(rows, float))
        s = np.atleast_1d(np.asarray(padded_len, float))
        f = np.stack([self.overhead + self.cfg.stage_flops(i, self.num_stages, b, s) / 1e10
                      for i in range(self.num_stages)])
        return {"F": f, "B": 2 * f}

    def comm_s(self, rows, padded_len):
        return 1e-5 + np.asarray(rows, float) * np.asarray(padded_len, float) * self.cfg.d_model * 4 / 1e9


def _setup(cfg, p, limit_scale):
    mm = MemoryModel.analytic(cfg, p)
    limit = int(mm.state_bytes.max() * limit_scale)
    return mm, AffineCost(cfg, p), limit


def _check_plan(plan, lengths, mm, limit):
    plan.validate(lengths)
    peak = np.max([mm.peak_bytes(plan.replica(r).shapes()[:, 0], plan.replica(r).shapes()[:, 1], plan.schedule_kind)
                   for r in range(plan.dp)], axis=0)
    assert np.all(peak <= limit), (peak, limit)
    assert plan.predictions["pred_peak_bytes"] == [int(x) for x in np.ceil(peak)]
    assert plan.predictions["plan_s"] >= 0 and plan.predictions["est_makespan_s"] > 0
    for mb in plan.microbatches:                          # padding is counted in the shape
        assert mb.real_tokens <= mb.computed_tokens
        rows = np.bincount(mb.row_ids, weights=mb.lengths, minlength=mb.batch)
        assert rows.max() <= mb.padded_len and rows.min() > 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 1500), min_size=1, max_size=120), p=st.integers(1, 4),
       scale=st.floats(1.05, 30.0), method=st.sampled_from(METHODS), kind=st.sampled_from(["1f1b", "gpipe"]))
def test_every_method_keeps_the_invariants(lengths, p, scale, method, kind):
    lengths = np.array(lengths)
    mm, cm, limit = _setup(TINY, p, scale)
    try:
        plan = pack(lengths, method, num_stages=p, memory_limit_bytes=limit, memory_model=mm, cost_model=cm,
                    schedule_kind=kind)
    except PackingError as e:
        # only for a reason it names: a sequence too long, or (gpipe) the whole batch
        assert "cannot fit even alone" in str(e) or (kind == "gpipe" and "exceeds the limit" in str(e)), str(e)
        if "cannot fit even alone" in str(e):
            assert lengths.max() > max_fitting_length(mm, limit, p, kind)
        return
    assert plan.method == method and plan.num_sequences == len(lengths)
    _check_plan(plan, lengths, mm, limit)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 600), min_size=8, max_size=150), dp=st.integers(2, 4),
       method=st.sampled_from(["fixed", "token-budget", "dynapipe", "dynamic"]))
def test_data_parallel_replicas_are_equal_and_balanced(lengths, dp, method):
    lengths = np.array(lengths)
    mm, cm, limit = _setup(TINY, 2, 6.0)
    plan = pack(lengths, method, num_stages=2, memory_limit_bytes=limit, memory_model=mm, cost_model=cm, dp=dp)
    _check_plan(plan, lengths, mm, limit)
    per = np.bincount(plan.replica_ids, minlength=dp)
    assert len(per) == dp and np.all(per == per[0])
    for r in range(dp):
        assert plan.replica(r).num_microbatches == per[0]


def test_errors_name_the_offending_things():
    mm, cm, limit = _setup(TINY, 2, 1.5)
    kw = dict(num_stages=2, memory_limit_bytes=limit, memory_model=mm, cost_model=cm)
    with pytest.raises(PackingError, match="empty"):
        pack(np.array([], dtype=np.int64), "dynamic", **kw)
    with pytest.raises(PackingError, match=r"sequences \[1, 3\]"):
        pack(np.array([5, 0, 7, -2]), "dynamic", **kw)
    with pytest.raises(PackingError, match=str(int(mm.state_bytes[0]))):
        pack(np.array([5, 6]), "fixed", **{**kw, "memory_limit_bytes": int(mm.state_bytes[0]) - 1})
    fit = max_fitting_length(mm, limit, 2)
    with pytest.raises(PackingError, match=rf"ids \[2\] with lengths \[{fit + 10}\].*longest length that fits is {fit}"):
        pack(np.array([10, 20, fit + 10]), "dynamic", **kw)
    with pytest.raises(ValueError, match="unknown packing method"):
        pack(np.array([5]), "magic", **kw)
    with pytest.raises(PackingError, match="exceeds the limit.*largest mbs"):
        pack(np.full(64, fit), "fixed", mbs=64, **kw)


@pytest.mark.parametrize("method", METHODS)
def test_oversize_policies_are_reported(method):
    mm, cm, limit = _setup(TINY, 2, 1.5)
    fit = max_fitting_length(mm, limit, 2)
    lengths = np.array([10, fit + 50, 30, fit + 1, 7])
    kw = dict(num_stages=2, memory_limit_bytes=limit, memory_model=mm, cost_model=cm)
    plan = pack(lengths, method, oversize="truncate", **kw)
    assert plan.meta["truncated"] == [1, 3] and plan.meta["dropped"] == []
    _check_plan(plan, lengths, mm, limit)
    got = {int(i): int(n) for mb in plan.microbatches for i, n in zip(mb.seq_ids, mb.lengths)}
    assert got[1] == fit and got[3] == fit and got[0] == 10
    plan = pack(lengths, method, oversize="drop", **kw)
    assert plan.meta["dropped"] == [1, 3]
    assert sorted(int(i) for mb in plan.microbatches for i in mb.seq_ids) == [0, 2, 4]
    plan.validate(lengths)


def test_fixed_auto_mbs_is_the_largest_worst_case_fit():
    mm, cm, limit = _setup(SMALL, 2, 3.0)
    lengths = np.array([100, 900, 40, 700, 300] * 20)
    b = auto_mbs(mm, limit, 2, 900)
    assert b >= 1
    plan = pack(lengths, "fixed", num_stages=2, memory_limit_bytes=limit, memory_model=mm, cost_model=cm)
    assert plan.meta["mbs"] == b
    worst = mm.peak_bytes([b + 1] * 3, [900] * 3, "1f1b")
    assert np.any(worst > limit)
    assert [mb.batch for mb in plan.microbatches[:-1]] == [b] * (plan.num_microbatches - 1)


def test_packed_rows_hold_several_documents():
    mm, cm, limit = _setup(TINY, 2, 8.0)
    lengths = np.array([300, 20, 30, 500, 12, 100, 60, 250])
    plan = pack(lengths, "packed", num_stages=2, memory_limit_bytes=limit, memory_model=mm, cost_model=cm)
    assert plan.meta["row_len"] == 512
    assert all(mb.padded_len == 512 for mb in plan.microbatches)
    assert any(mb.is_packed for mb in plan.microbatches)
    _check_plan(plan, lengths, mm, limit)


def test_row_packers():
    x = np.array([5, 3, 8, 2, 2, 9, 1])
    for items, rows in ((x, ffd_rows(x, 10)), (np.sort(x), next_fit_rows(np.sort(x), 10))):
        assert np.bincount(rows, weights=items).max() <= 10
    assert ffd_rows(x, 10).max() + 1 == 3                   # 30 tokens in 3 rows of 10


def test_est_makespan_matches_the_simulator():
    sim = pytest.importorskip("dynmb.simulate")
    from dynmb.schedule import build_schedule

    rng = np.random.default_rng(0)
    for p, m, kind in ((2, 5, "1f1b"), (4, 9, "1f1b"), (3, 2, "1f1b"), (3, 6, "gpipe")):
        costs = {"F": rng.uniform(1, 3, (p, m)), "B": rng.uniform(2, 6, (p, m))}
        comm = rng.uniform(0, 0.5, m)
        res = sim.simulate_costs(build_schedule(kind, p, m), costs, comm)
        assert est_makespan(costs["F"], costs["B"], comm, kind) == pytest.approx(res.makespan_s)


@pytest.mark.parametrize("trace", ["gsm8k", "alpaca_eval", "sharegpt", "wikitext2", "humaneval"])
def test_dynamic_beats_every_method_on_the_shipped_traces(trace):
    """Small model at P = 2 and a binding limit (fixed gets mbs 4 at the batch's longest)."""
    from dynmb.costmodel import AnalyticCostModel
    from dynmb.data import load_trace, sample_batch

    mm, cm = MemoryModel.analytic(SMALL, 2), AnalyticCostModel(SMALL, 2)
    lengths = np.minimum(sample_batch(load_trace(trace), 256, 0), SMALL.max_seq_len)
    act, tr = mm.act_matrix([4], [int(lengths.max())])
    limit = int(np.max(mm.state_bytes + np.array([2, 1]) * (act[:, 0] + tr[:, 0]))) + 1
    est = {}
    for method in METHODS:
        plan = pack(lengths, method, num_stages=2, memory_limit_bytes=limit, memory_model=mm, cost_model=cm)
        _check_plan(plan, lengths, mm, limit)
        est[method] = plan.predictions["est_makespan_s"]
        if method == "dynamic":
            assert plan.padding_fraction <= 0.05
    assert est["dynamic"] <= min(est.values()) * (1 + 1e-9), est


@pytest.mark.parametrize("method", METHODS)
def test_interleaved_on_fewer_gpus_fits_the_gpu_not_the_stage(method):
    """With virtual chunks one GPU holds several stages: their states and in-flight activations
    add up, and the plan must keep that sum (the simulator's per-rank peak) under the limit."""
    from dynmb.costmodel import get_cost_model
    from dynmb.data import load_trace, sample_batch
    from dynmb.memory import get_memory_model
    from dynmb.planner import plan_step

    lengths = sample_batch(load_trace("sharegpt"), 32, 0)
    limit = 1 << 30
    _, _, sim = plan_step(lengths, method=method, model_cfg=SMALL, num_stages=2, memory_limit_bytes=limit,
                          schedule_kind="interleaved", virtual=2)
    assert sim.peak_bytes_rank is not None and len(sim.peak_bytes_rank) == 1
    assert sim.peak_bytes_rank[0] <= limit
    if method == "fixed":   # a per-stage budget alone lets the one GPU overflow
        mm = get_memory_model(None, SMALL, 2)
        naive = pack(lengths, method, num_stages=2, memory_limit_bytes=limit, memory_model=mm,
                     cost_model=get_cost_model(None, SMALL, 2), schedule_kind="interleaved")
        sh = naive.shapes()
        assert mm.peak_bytes(sh[:, 0], sh[:, 1], "interleaved", virtual=2).max() > limit
