"""Lower bounds (dynmb.timing.bounds): hand-computed cases, no schedule below its bound, ideal <= bound."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dynmb.timing.bounds import (dependency_bound, ideal_bound, plan_bound, plan_bounds, plan_ideal, split_mask,
                          stage_ranks, step_bound_fields)
from dynmb.core.config import ModelConfig
from dynmb.data.lengths import shipped_dir
from dynmb.costmodel import AnalyticCostModel, CommModel, CostModel, fit_cost_model
from dynmb.costmodel.gpu import GPUCostModel, GPUSpec
from dynmb.memory.model import MemoryModel
from dynmb.packing import METHODS, PackingError, pack
from dynmb.planning import default_cost_model_path, make_schedule, plan_step
from dynmb.schedule import build_schedule
from dynmb.schedule.zerobubble import ZBInputs, zb_h1
from dynmb.timing.simulate import simulate, simulate_costs
from dynmb.core.types import Microbatch, Plan
from dynmb.core.planspec import PlanSpec
from dynmb.costmodel.loader import Models

TINY = ModelConfig.preset("tiny")
SMALL = ModelConfig.preset("small")
KINDS = ("gpipe", "1f1b", "interleaved", "memory-aware", "zb-h1", "zb")
EPS = 1e-9


def _random_costs(rng, P, m, split=False):
    F = rng.uniform(0.1, 3.0, (P, m))
    out = {"F": F, "B": F * rng.uniform(1.0, 3.0, (P, m))}
    if split:
        w = rng.uniform(0.2, 0.6, (P, m))
        out["W"], out["I"] = w * out["B"], (1.05 - w) * out["B"]
    return out


# --- hand-computed ----------------------------------------------------------------------------------

def test_two_stages_two_microbatches_by_hand():
    """Stage 1: fill F0 + c = 1.5, work 2 (2 + 3) = 10, drain B0 + c = 2.5: 14 = 1F1B's makespan
    (stage 0: F0 [0, 1], F1 [1, 2]; stage 1: F0 [1.5, 3.5], B0 [3.5, 6.5], F1 [6.5, 8.5],
    B1 [8.5, 11.5]; stage 0: B0 [7, 9], B1 [12, 14])."""
    costs = {"F": np.array([[1.0, 1.0], [2.0, 2.0]]), "B": np.array([[2.0, 2.0], [3.0, 3.0]])}
    assert dependency_bound(costs, 0.5) == pytest.approx(14.0)
    assert simulate_costs(build_schedule("1f1b", 2, 2), costs, 0.5).makespan_s == pytest.approx(14.0)


def test_unequal_microbatches_by_hand():
    """F = (1, 3) per stage, B = 2 F: stage 1 fill min(1, 3) = 1, work 3 + 9 = 12, drain
    min(2, 6) = 2: bound 15, whatever the order. 1F1B, short one first: stage 1 runs F0 [1, 2],
    B0 [2, 4], F1 [4, 7], B1 [7, 13], stage 0 B1 [13, 19]: 19; long one first: stage 1 F0 [3, 6],
    B0 [6, 12], F1 [12, 13], B1 [13, 15], stage 0 B0 [12, 18], B1 [18, 20]: 20 (the long
    microbatch fills or drains the pipeline)."""
    costs = {"F": np.array([[1.0, 3.0], [1.0, 3.0]]), "B": np.array([[2.0, 6.0], [2.0, 6.0]])}
    assert dependency_bound(costs) == pytest.approx(15.0)
    rev = {op: c[:, ::-1] for op, c in costs.items()}
    assert dependency_bound(rev) == pytest.approx(15.0)
    for c, want in ((costs, 19.0), (rev, 20.0)):
        assert simulate_costs(build_schedule("1f1b", 2, 2), c).makespan_s == pytest.approx(want)


@settings(max_examples=40, deadline=None)
@given(P=st.integers(1, 6), seed=st.integers(0, 10**6), c=st.sampled_from([0.0, 0.05, 0.7]))
def test_one_microbatch_bound_is_the_makespan(P, seed, c):
    rng = np.random.default_rng(seed)
    costs = _random_costs(rng, P, 1)
    want = costs["F"].sum() + costs["B"].sum() + 2 * (P - 1) * c
    assert dependency_bound(costs, c) == pytest.approx(want, rel=1e-12)
    for kind in ("gpipe", "1f1b"):
        assert simulate_costs(build_schedule(kind, P, 1), costs, c).makespan_s == pytest.approx(want, rel=1e-12)
    # split backward: the drain runs I back to stage 0, then stage 0's W
    split = _random_costs(rng, P, 1, split=True)
    sched = zb_h1(P, 1, ZBInputs(split["F"], split["B"], split["I"], split["W"], np.full(1, c),
                                 np.ones((P, 1), bool)))
    mk = simulate_costs(sched, {op: split[op] for op in "FIW"}, c).makespan_s
    assert dependency_bound({op: split[op] for op in "FIW"}, c, split=split_mask(sched)) == pytest.approx(mk, rel=1e-12)


@pytest.mark.parametrize("P", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 16])
def test_equal_microbatches_bound_is_one_f_one_b(P, m):
    """(m + P - 1)(F + B) + 2 (P - 1) c: 1F1B's makespan without P2P time, GPipe's with it; with
    P2P 1F1B waits whole round trips 2c in its steady state (module doc), never less than the bound."""
    F, B = 3.0, 5.0
    costs = {"F": np.full((P, m), F), "B": np.full((P, m), B)}
    assert dependency_bound(costs) == (m + P - 1) * (F + B)
    assert simulate_costs(build_schedule("1f1b", P, m), costs).makespan_s == (m + P - 1) * (F + B)
    c = 0.25
    want = (m + P - 1) * (F + B) + 2 * (P - 1) * c
    assert dependency_bound(costs, c) == pytest.approx(want, abs=1e-12)
    assert simulate_costs(build_schedule("gpipe", P, m), costs, c).makespan_s == pytest.approx(want, abs=1e-12)
    excess = (simulate_costs(build_schedule("1f1b", P, m), costs, c).makespan_s - want) / (2 * c)
    assert excess >= -1e-9 and excess == pytest.approx(round(excess), abs=1e-9)
    # with two microbatches or fewer 1F1B is GPipe; from the third on its steady state waits
    assert (excess > 0.5) == (P > 1 and m >= 3), excess


@pytest.mark.parametrize("R", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("rounds", [1, 2, 4])
def test_equal_microbatches_bound_is_interleaved_makespan(R, v, rounds):
    """Interleaved 1F1B of m = rounds x R equal microbatches without P2P time runs v m (F + B)
    + (R - 1)(F + B) (per-chunk costs): the per-rank bound exactly."""
    P, m = R * v, rounds * R
    costs = {"F": np.ones((P, m)), "B": 2 * np.ones((P, m))}
    sched = build_schedule("interleaved", P, m, virtual=v)
    want = v * m * 3 + (R - 1) * 3
    assert simulate_costs(sched, costs).makespan_s == want
    assert dependency_bound(costs, 0.0, stage_ranks(P, sched)) == want


@pytest.mark.parametrize("P", [2, 3, 4, 8])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_split_backward_unit_bound_is_the_papers_zb_h1(P, k):
    """F = I = W = 1: 3m + P - 1 (ZB-H1's bubble (P - 1)(F + I - W)); the list-scheduled zb-h1 is not below it."""
    m = k * P
    inp = ZBInputs.unit(P, m)
    sched = zb_h1(P, m, inp)
    costs = {"F": inp.F, "I": inp.I, "W": inp.W}
    assert dependency_bound(costs, 0.0, None, split_mask(sched)) == 3 * m + P - 1
    assert simulate_costs(sched, costs).makespan_s >= 3 * m + P - 1


def test_interleaved_bound_is_per_rank():
    """Two ranks holding stages (0, 2) and (1, 3): rank 1's fill is stage 1's (F of stage 0 and
    one P2P), its work all four ops of stages 1 and 3, its drain stage 1's."""
    P, m, c = 4, 4, 0.1
    costs = {"F": np.ones((P, m)), "B": 2 * np.ones((P, m))}
    sched = build_schedule("interleaved", P, m, virtual=2)
    rank = stage_ranks(P, sched)
    assert rank.tolist() == [0, 1, 0, 1]
    assert dependency_bound(costs, c, rank) == pytest.approx((1 + c) + 2 * m * 3 + (2 + c))
    assert simulate_costs(sched, costs, c).makespan_s >= dependency_bound(costs, c, rank) - EPS


# --- no schedule beats its bound -------------------------------------------------------------------

@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(R=st.integers(1, 4), v=st.integers(1, 3), m=st.integers(1, 12), seed=st.integers(0, 10**6),
       c=st.sampled_from([0.0, 0.01, 0.3, 2.0]), kind=st.sampled_from(KINDS))
def test_no_schedule_is_below_its_bound(R, v, m, seed, c, kind):
    """Random per-(stage, microbatch) costs and P2P times, every builder."""
    rng = np.random.default_rng(seed)
    P = R * v if kind == "interleaved" else R + v - 1
    split = kind in ("zb-h1", "zb")
    costs = _random_costs(rng, P, m, split=split)
    comm = c * rng.uniform(0.5, 1.5, m)
    if kind == "interleaved":
        sched = build_schedule(kind, P, m, virtual=v)
    elif kind == "memory-aware":
        act = rng.uniform(1, 10, (P, m))
        sched = build_schedule(kind, P, m, act_bytes=act, state_bytes=np.zeros(P),
                               limit_bytes=float(act.max() * rng.uniform(1, P + 1)))
    elif split:
        inp = ZBInputs(costs["F"], costs["B"], costs["I"], costs["W"], comm, rng.random((P, m)) < 0.8)

        def evaluate(s):
            return simulate_costs(s, costs, comm).makespan_s, np.zeros(P)
        sched = build_schedule(kind, P, m, zb_inputs=inp, evaluate=evaluate,
                               limit_bytes=1e30 if kind == "zb" else None)
    else:
        sched = build_schedule(kind, P, m)
    used = {a.op for acts in sched.ranks for a in acts}
    mk = simulate_costs(sched, {op: x for op, x in costs.items() if op in used or op == "B"}, comm).makespan_s
    bound = dependency_bound(costs, comm, stage_ranks(P, sched), split_mask(sched))
    assert bound <= mk * (1 + EPS), (kind, bound, mk)
    assert bound > 0


def _models(P):
    """The cost models the bound is checked on: analytic, the GPU model (efficiency growing with the
    microbatch), and at 2 stages the shipped poly fit and a grid fitted on the shipped samples."""
    out = [AnalyticCostModel(SMALL, P, comm=CommModel(2e-4, 1e9)), GPUCostModel(SMALL, P)]
    if P == 2:
        path = default_cost_model_path("small", 2, "cpu")
        out.append(CostModel.load(path))
        out.append(_grid())
    return out


_GRID = []


def _grid():
    if not _GRID:
        import pandas as pd
        samples = pd.read_csv(shipped_dir("costmodels").joinpath("samples-small-p2-cpu.csv"))
        _GRID.append(fit_cost_model(samples, SMALL, 2, kind="grid"))
    return _GRID[0]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 1200), min_size=1, max_size=48), P=st.sampled_from([1, 2, 2, 4]),
       method=st.sampled_from(METHODS), kind=st.sampled_from(KINDS), which=st.integers(0, 3),
       scale=st.floats(1.5, 8.0))
def test_simulated_plans_keep_ideal_below_bound_below_makespan(lengths, P, method, kind, which, scale):
    """``dynmb.timing.simulate`` of every method's plan under every schedule kind, on the shipped models:
    ideal_s <= bound_s <= makespan_s."""
    models = _models(P)
    cm = models[which % len(models)]
    mm = MemoryModel.analytic(SMALL, P)
    limit = int(mm.state_bytes.max() * scale)
    virtual = 2 if kind == "interleaved" and P % 2 == 0 else 1
    try:
        plan, sched, sim = plan_step(np.array(lengths), PlanSpec(method=method, num_stages=P, memory_limit_bytes=limit,
                                                                 schedule_kind=kind, virtual=virtual,
                                                                 oversize="truncate"), model_cfg=SMALL, models=Models(cm, mm))
    except (PackingError, ValueError):
        return
    assert sim.ideal_s <= sim.bound_s * (1 + EPS), (sim.ideal_s, sim.bound_s)
    assert sim.bound_s <= sim.makespan_s * (1 + EPS), (sim.bound_s, sim.makespan_s)
    assert sim.to_summary()["bound_s"] == sim.bound_s


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 900), min_size=8, max_size=64), dp=st.integers(2, 3),
       method=st.sampled_from(METHODS))
def test_data_parallel_bound_is_the_slowest_replica(lengths, dp, method):
    cm = AnalyticCostModel(SMALL, 2)
    mm = MemoryModel.analytic(SMALL, 2)
    plan, _, _ = plan_step(np.array(lengths), PlanSpec(method=method, num_stages=2,
                                                       memory_limit_bytes=int(mm.state_bytes.max() * 4), dp=dp),
                           model_cfg=SMALL, models=Models(cm, mm))
    per = [plan_bound(plan.replica(r), cm) for r in range(dp)]
    assert plan_bound(plan, cm) == pytest.approx(max(per))
    sims = [simulate(make_schedule(plan.replica(r), "1f1b", models=Models(cm, None)), plan.replica(r), cm)
            for r in range(dp)]
    assert max(per) <= max(s.makespan_s for s in sims) * (1 + EPS)
    assert plan_ideal(plan, cm) <= max(per) * (1 + EPS)


@pytest.mark.parametrize("method,stages,limit", [("dynamic", 2, 24), ("fixed", 2, 24), ("dynamic", 4, 12)])
def test_sliced_plans_keep_ideal_below_bound(method, stages, limit):
    """--oversize split: a sequence's slices add up to its attention work; the fill uses the shortest piece."""
    cm = AnalyticCostModel(TINY, stages, comm=CommModel(1e-4, 1e9))
    lengths = np.array([40, 100, 4000, 70, 300, 25, 90, 150])
    plan, sched, sim = plan_step(lengths, PlanSpec(method=method, num_stages=stages, memory_limit_bytes=limit << 20,
                                                   oversize="split", recompute="auto"), model_cfg=TINY,
                                 models=Models(cm, MemoryModel.analytic(TINY, stages)))
    assert plan.has_slices
    assert 0 < sim.ideal_s <= sim.bound_s * (1 + EPS) <= sim.makespan_s * (1 + 2 * EPS)
    assert plan_ideal(plan, cm, sched) == pytest.approx(ideal_bound(lengths, cm, shortest_piece=min(
        int(mb.lengths.min()) for mb in plan.microbatches)))


# --- ideal_s -------------------------------------------------------------------------------------

def test_ideal_of_one_sequence_is_its_makespan_without_overhead():
    """One sequence, one microbatch: ideal = the makespan minus every op's fixed cost."""
    P = 3
    cm = AnalyticCostModel(SMALL, P, overhead_s=0.0, comm=CommModel(1e-3, 1e9)).with_overhead(F=0.002, B=0.004)
    mb = Microbatch(seq_ids=[0], lengths=[300], padded_len=300, batch=1)
    plan = Plan(microbatches=(mb,), method="fixed", num_stages=P, memory_limit_bytes=1 << 40, num_sequences=1)
    sim = simulate(build_schedule("1f1b", P, 1), plan, cm)
    assert sim.bound_s == pytest.approx(sim.makespan_s)
    assert sim.ideal_s == pytest.approx(sim.makespan_s - P * (0.002 + 0.004))


@pytest.mark.parametrize("length", [7, 130, 2048])
def test_gpu_ideal_prices_attention_at_the_sequences_own_length(length):
    """GPU model with GEMMs saturated and no overhead: one sequence alone runs exactly its ideal (the
    attention of a short sequence is slow at any packing, so the ideal charges it), and packing it
    beside others in one row costs at least the sum of their ideals."""
    P = 2
    spec = GPUSpec(gemm_m_half=1e-9, overhead_s=0.0, overhead_per_layer_s=0.0)
    cm = GPUCostModel(SMALL, P, spec=spec, comm=CommModel(0.0, 1e30))
    mb = Microbatch(seq_ids=[0], lengths=[length], padded_len=length, batch=1)
    plan = Plan(microbatches=(mb,), method="fixed", num_stages=P, memory_limit_bytes=1 << 40, num_sequences=1)
    sim = simulate(build_schedule("1f1b", P, 1), plan, cm)
    assert sim.ideal_s == pytest.approx(sim.makespan_s, rel=1e-9)
    L = np.array([length, 3, 900, 64])
    row = Microbatch(seq_ids=np.arange(4), lengths=L, padded_len=int(L.sum()), batch=1, row_ids=np.zeros(4, int))
    packed = Plan(microbatches=(row,), method="fixed", num_stages=P, memory_limit_bytes=1 << 40, num_sequences=4)
    work = {op: float(c.sum()) for op, c in cm.plan_costs(packed, ops=("F", "B")).items()}
    ideal = {op: float(c.sum()) for op, c in cm.ideal_stage_costs(L).items()}
    assert ideal["F"] == pytest.approx(work["F"], rel=1e-9) and ideal["B"] == pytest.approx(work["B"], rel=1e-9)


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 2000), min_size=1, max_size=40), P=st.sampled_from([2, 2, 4]),
       which=st.integers(0, 3))
@example(lengths=[115, 117, 123, 128, 128, 513, 515, 517, 521, 531, 537, 1210, 1276, 1409, 1454, 1967], P=2, which=2)
@example(lengths=[4663, 6954, 7106, 6123], P=2, which=2)           # a packed row past the grid's longest row
@example(lengths=[1, 2] * 16, P=2, which=2)                        # rows shorter than the grid's shortest
def test_ideal_is_at_most_the_bound_of_one_sequence_per_microbatch_and_of_one_packed_row(lengths, P, which):
    """The superadditivity the proof assumes, on the shipped models: the batch run as one
    microbatch per sequence, as one padded microbatch, and as one packed row."""
    models = _models(P)
    cm = models[which % len(models)]
    L = np.array(lengths)
    n = len(L)
    ideal = ideal_bound(L, cm)
    plans = [
        [Microbatch(seq_ids=[i], lengths=[int(x)], padded_len=int(x), batch=1) for i, x in enumerate(L)],
        [Microbatch(seq_ids=np.arange(n), lengths=L, padded_len=int(L.max()), batch=n)],
        [Microbatch(seq_ids=np.arange(n), lengths=L, padded_len=int(L.sum()), batch=1, row_ids=np.zeros(n, int))],
    ]
    for mbs in plans:
        plan = Plan(microbatches=tuple(mbs), method="fixed", num_stages=P, memory_limit_bytes=1 << 40,
                    num_sequences=n)
        assert ideal <= plan_bound(plan, cm) * (1 + EPS)
        assert plan_ideal(plan, cm) == pytest.approx(ideal)


def test_ideal_is_the_same_for_every_method():
    cm = CostModel.load(default_cost_model_path("small", 2, "cpu"))
    mm = MemoryModel.analytic(SMALL, 2)
    lengths = np.random.default_rng(3).integers(5, 900, 40)
    ideals = set()
    for method in METHODS:
        plan = pack(lengths, PlanSpec(method=method, num_stages=2, memory_limit_bytes=1 << 30), models=Models(cm, mm))
        ideals.add(round(plan_ideal(plan, cm), 12))
        assert plan_ideal(plan, cm) <= plan_bound(plan, cm) * (1 + EPS)
    assert len(ideals) == 1


# --- steps columns -------------------------------------------------------------------------------

def test_step_bound_fields_from_measured_actions():
    cm = AnalyticCostModel(SMALL, 2)
    mm = MemoryModel.analytic(SMALL, 2)
    lengths = np.random.default_rng(0).integers(10, 500, 24)
    plan, sched, sim = plan_step(lengths, PlanSpec(method="dynamic", num_stages=2, memory_limit_bytes=1 << 30),
                                 model_cfg=SMALL, models=Models(cm, mm))
    tl = sim.timeline
    actions = [SimpleNamespace(dp_rank=0, stage=int(r.stage), op=r.op, mb=int(r.mb), start_s=float(r.start_s),
                               end_s=float(r.end_s)) for r in tl.itertuples()]
    row = step_bound_fields(plan, sched, cm, actions, step_s=sim.makespan_s * 1.1)
    assert row["bound_s"] == pytest.approx(sim.bound_s)          # measured = predicted times here
    assert row["pred_bound_s"] == pytest.approx(sim.bound_s)
    assert row["ideal_s"] == pytest.approx(sim.ideal_s)
    assert row["gap_to_bound"] == pytest.approx(sim.makespan_s * 1.1 / sim.bound_s - 1)
    slow = [SimpleNamespace(**{**a.__dict__, "end_s": a.start_s + 2 * (a.end_s - a.start_s)}) for a in actions]
    assert step_bound_fields(plan, sched, cm, slow, 1.0)["bound_s"] > 1.5 * sim.bound_s
    partial = step_bound_fields(plan, sched, cm, actions[:-1], 1.0)
    assert partial["bound_s"] is None and partial["gap_to_bound"] is None
    assert plan_bounds(plan, cm, sched) == pytest.approx((sim.bound_s, sim.ideal_s))


def test_cli_simulate_json_prints_the_bounds(tmp_path, capsys):
    import json

    from dynmb.cli import main
    from dynmb.schedule import to_csv
    mm = MemoryModel.analytic(TINY, 2)
    cm = AnalyticCostModel(TINY, 2)
    plan, sched, _ = plan_step(np.array([30, 200, 90, 400, 12]), PlanSpec(method="dynamic", num_stages=2,
                                                                          memory_limit_bytes=1 << 30), model_cfg=TINY,
                               models=Models(cm, mm))
    plan.save(tmp_path / "p.json")
    to_csv(sched, tmp_path / "s.csv")
    capsys.readouterr()
    assert main(["simulate", "--plan", str(tmp_path / "p.json"), "--schedule", str(tmp_path / "s.csv"),
                 "--model", "tiny", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 < out["ideal_s"] <= out["bound_s"] <= out["makespan_s"] * (1 + EPS)
