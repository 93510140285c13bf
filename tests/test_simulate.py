"""Discrete-event simulator: exact bubble formulas, comm, memory, deadlock, the plan-level entry point."""

from __future__ import annotations

from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest

from dynmb.core.config import ModelConfig
from dynmb.costmodel import AnalyticCostModel, CommModel
from dynmb.runtime.records import ActionRow, replay_step_s
from dynmb.schedule import ScheduleError, build_schedule
from dynmb.timing.simulate import SimResult, simulate, simulate_costs
from dynmb.core.types import Action, Microbatch, Plan, Schedule


def _unit(P, m):
    return {"F": np.ones((P, m)), "B": 2 * np.ones((P, m))}


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_bubble_formula_exact(kind):
    for P in (1, 2, 3, 4, 5, 8, 16):
        for m in (1, 2, 3, 4, 7, 8, 16, 33):
            r = simulate_costs(build_schedule(kind, P, m), _unit(P, m))
            want = Fraction(P - 1, m + P - 1)
            assert Fraction(r.makespan_s) == 3 * (m + P - 1)
            for busy, bub in zip(r.busy_s, r.bubble_fraction):
                assert 1 - Fraction(busy) / Fraction(r.makespan_s) == want, (kind, P, m)
                assert bub == pytest.approx(float(want), rel=1e-12, abs=1e-15)
            assert r.mean_bubble == pytest.approx(float(want), rel=1e-12, abs=1e-15)


def test_interleaved_bubble_formula():
    for R in (2, 3, 4):
        for v in (1, 2, 3, 4):
            for m in (R, 2 * R, 4 * R):
                r = simulate_costs(build_schedule("interleaved", R * v, m, virtual=v), _unit(R * v, m))
                want = Fraction(R - 1, v * m + R - 1)
                for busy in r.busy_s:
                    assert 1 - Fraction(busy) / Fraction(r.makespan_s) == want, (R, v, m)


def test_timeline_and_summary():
    P, m = 3, 4
    r = simulate_costs(build_schedule("1f1b", P, m), _unit(P, m))
    tl = r.timeline
    assert list(tl.columns) == ["rank", "stage", "op", "mb", "start_s", "end_s"]
    assert len(tl) == 2 * P * m
    assert set(tl["op"]) == {"F", "B"}
    assert np.all(tl["end_s"] - tl["start_s"] == np.where(tl["op"] == "F", 1.0, 2.0))
    # no two actions of a rank overlap
    for _, g in tl.sort_values("start_s").groupby("rank"):
        assert np.all(g["start_s"].to_numpy()[1:] >= g["end_s"].to_numpy()[:-1])
    s = r.to_summary()
    assert s["makespan_s"] == r.makespan_s and len(s["bubble_fraction"]) == P and s["peak_bytes"] is None
    import json
    json.dumps(s)


def test_comm_only_across_ranks_and_overlapping():
    P, m = 2, 1
    r = simulate_costs(build_schedule("1f1b", P, m), _unit(P, m), comm_s=0.5)
    # F0 [0,1], send .5, F1 [1.5,2.5], B1 [2.5,4.5], send .5, B0 [5,7]
    assert r.makespan_s == pytest.approx(7.0)
    # interleaved with one rank: every hop is local, no comm
    r1 = simulate_costs(build_schedule("interleaved", 2, 2, virtual=2), _unit(2, 2), comm_s=100.0)
    assert r1.makespan_s == pytest.approx(12.0)  # 2 stages x 2 mbs x (1 + 2), no gaps
    # per-microbatch comm; sender is not blocked: rank 0 runs F0, F1 back to back
    r2 = simulate_costs(build_schedule("gpipe", 2, 2), _unit(2, 2), comm_s=np.array([0.25, 3.0]))
    tl = r2.timeline.set_index(["stage", "op", "mb"])
    assert tl.loc[(0, "F", 1), "start_s"] == 1.0
    assert tl.loc[(1, "F", 0), "start_s"] == 1.25
    assert tl.loc[(1, "F", 1), "start_s"] == 5.0


def test_memory_peak_per_stage():
    P, m = 2, 3
    act = np.array([[1.0, 2.0, 4.0], [10.0, 20.0, 40.0]])
    r = simulate_costs(build_schedule("gpipe", P, m), _unit(P, m), act_bytes=act, state_bytes=np.array([100.0, 200.0]),
                       limit_bytes=300)
    assert r.peak_bytes.tolist() == [107.0, 270.0]
    assert r.peak_bytes_rank.tolist() == [107.0, 270.0]
    assert r.fits
    r = simulate_costs(build_schedule("1f1b", P, m), _unit(P, m), act_bytes=act, state_bytes=np.array([100.0, 200.0]),
                       limit_bytes=250)
    # stage 0 holds mb 0+1 (window 2) then 1+2; stage 1 one at a time
    assert r.peak_bytes.tolist() == [106.0, 240.0]
    assert r.fits
    mt = r.memory_timeline
    assert set(mt.columns) == {"stage", "t_s", "bytes"} and mt["bytes"].max() == 240.0
    # interleaved: one rank holds two stages
    s = build_schedule("interleaved", 2, 2, virtual=2)
    r = simulate_costs(s, _unit(2, 2), act_bytes=np.ones((2, 2)), state_bytes=np.array([1.0, 1.0]))
    assert r.peak_bytes_rank[0] >= r.peak_bytes.max()


def test_rejects_deadlock_and_bad_costs():
    s = Schedule([[Action(0, "F", 0), Action(0, "B", 0), Action(0, "F", 1), Action(0, "B", 1)],
                  [Action(1, "F", 0), Action(1, "F", 1), Action(1, "B", 0), Action(1, "B", 1)]], 2, 2)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate_costs(s, _unit(2, 2))
    with pytest.raises(ValueError, match="must be"):
        simulate_costs(build_schedule("1f1b", 2, 2), {"F": np.ones((2, 3)), "B": np.ones((2, 2))})
    with pytest.raises(ValueError, match="lack op"):
        simulate_costs(build_schedule("1f1b", 2, 2), {"F": np.ones((2, 2))})


def test_i_and_w_ops_are_simulated():
    s = Schedule([[Action(0, "F", 0), Action(0, "I", 0), Action(0, "W", 0)],
                  [Action(1, "F", 0), Action(1, "I", 0), Action(1, "W", 0)]], 2, 1)
    c = {"F": np.ones((2, 1)), "B": 5 * np.ones((2, 1)), "I": np.ones((2, 1)), "W": np.ones((2, 1))}
    r = simulate_costs(s, c)
    assert r.makespan_s == 5.0  # F F I(1) I(0) W(0): 0I0 waits only for 1I0, not 1W0
    with pytest.raises(ValueError, match="lack op 'I'"):
        simulate_costs(s, {"F": np.ones((2, 1)), "B": np.ones((2, 1))})


class _Cost:
    """A stand-in with the CostModel interface: time = tokens * (1 + stage)."""

    def __init__(self, P):
        self.num_stages = P
        self.model_cfg = SimpleNamespace(link_bytes=lambda rows, plen, p: np.asarray(rows) * np.asarray(plen) * 4)
        self.comm = SimpleNamespace(time=lambda nbytes: np.asarray(nbytes, dtype=float) * 1e-3)

    def stage_costs(self, rows, plen):
        tok = np.asarray(rows) * np.asarray(plen)
        f = np.stack([tok * (1 + s) * 1e-3 for s in range(self.num_stages)])
        return {"F": f, "B": 2 * f}

    def plan_costs(self, plan):
        shapes = plan.shapes()
        return self.stage_costs(shapes[:, 0], shapes[:, 1])


class _Mem:
    def __init__(self, P):
        self.state_bytes = np.full(P, 1000.0)

    def activation_bytes(self, stage, rows, plen):
        return np.asarray(rows) * np.asarray(plen) * 10.0


def _plan(P=2, lengths=(5, 9, 3, 7)):
    mbs = [Microbatch(seq_ids=[i], lengths=[n], padded_len=n, batch=1) for i, n in enumerate(lengths)]
    return Plan(microbatches=mbs, method="test", num_stages=P, memory_limit_bytes=10**6, num_sequences=len(lengths))


def test_simulate_plan_uses_cost_and_memory_models():
    plan = _plan()
    s = build_schedule("1f1b", 2, 4)
    r = simulate(s, plan, _Cost(2), _Mem(2))
    assert isinstance(r, SimResult)
    ref = simulate_costs(s, _Cost(2).stage_costs(np.ones(4), np.array([5, 9, 3, 7])),
                         comm_s=np.array([5, 9, 3, 7]) * 4e-3)
    assert r.makespan_s == pytest.approx(ref.makespan_s)
    assert r.peak_bytes[0] == 1000 + 10 * (5 + 9)
    assert r.limit_bytes == 10**6 and r.fits
    assert {"batch", "padded_len"} <= set(r.timeline.columns)
    with pytest.raises(ValueError, match="stages"):
        simulate(build_schedule("1f1b", 3, 4), plan, _Cost(2))


def test_transient_bytes_count_while_the_op_runs():
    act = np.array([[1.0, 2.0, 4.0], [10.0, 20.0, 40.0]])
    tr = np.full((2, 3), 0.5)
    r = simulate_costs(build_schedule("1f1b", 2, 3), _unit(2, 3), act_bytes=act, state_bytes=np.zeros(2),
                       transient_bytes=tr)
    assert r.peak_bytes.tolist() == [6.5, 40.5]


def test_peak_matches_memory_model_definition():
    memory = pytest.importorskip("dynmb.memory.model")
    from dynmb.core.config import ModelConfig
    P = 4
    mm = memory.get_memory_model(None, ModelConfig.preset("tiny"), P)
    rng = np.random.default_rng(0)
    rows, plen = rng.integers(1, 8, 12), rng.integers(16, 512, 12)
    act, tr = mm.act_matrix(rows, plen)
    for kind in ("gpipe", "1f1b"):
        r = simulate_costs(build_schedule(kind, P, 12), _unit(P, 12), act_bytes=act, state_bytes=mm.state_bytes,
                           transient_bytes=tr)
        np.testing.assert_allclose(r.peak_bytes, mm.peak_bytes(rows, plen, kind), rtol=1e-12)


def test_matches_fixpoint_relaxation_on_random_schedules():
    """The one-pass topological simulation equals a naive relaxation to the fixpoint of
    start = max(prev end on rank, dependency end + comm) on random valid schedules."""
    from hypothesis import given, settings
    from tests.test_schedule import valid_schedules

    @settings(max_examples=30, deadline=None)
    @given(valid_schedules(), st_seed())
    def check(s, seed):
        rng = np.random.default_rng(seed)
        P, m = s.num_stages, s.num_microbatches
        costs = {op: rng.uniform(0.1, 2.0, (P, m)) for op in "FBIW"}
        comm = rng.uniform(0, 0.5, m)
        r = simulate_costs(s, costs, comm)
        rank_of = s.stage_to_rank()
        acts = [(rk, i, a) for rk, lst in enumerate(s.ranks) for i, a in enumerate(lst)]
        end: dict = {}
        start: dict = {}
        for _ in range(len(acts) + 2):
            changed = False
            for rk, i, a in acts:
                t = end.get((rk, i - 1), 0.0) if i else 0.0
                dep = None
                if a.op == "F" and a.stage > 0:
                    dep = Action(a.stage - 1, "F", a.mb)
                elif a.op in "BI" and a.stage < P - 1:
                    nxt = s.ranks[rank_of[a.stage + 1]]
                    dep = Action(a.stage + 1, "B", a.mb) if Action(a.stage + 1, "B", a.mb) in nxt else \
                        Action(a.stage + 1, "I", a.mb)
                if dep is not None:
                    drk = rank_of[dep.stage]
                    t = max(t, end.get((drk, s.ranks[drk].index(dep)), 0.0) + (comm[a.mb] if drk != rk else 0.0))
                e = t + costs[a.op][a.stage, a.mb]
                if start.get((rk, i)) != t or end.get((rk, i)) != e:
                    start[(rk, i)], end[(rk, i)], changed = t, e, True
            if not changed:
                break
        got = {(int(x.rank), x.stage, x.op, int(x.mb)): (x.start_s, x.end_s) for x in r.timeline.itertuples()}
        for rk, i, a in acts:
            assert got[(rk, a.stage, a.op, a.mb)] == pytest.approx((start[(rk, i)], end[(rk, i)]))
        assert r.makespan_s == pytest.approx(max(end.values()))

    check()


def st_seed():
    from hypothesis import strategies as st
    return st.integers(0, 2**31)


def test_cli_schedule_and_simulate(tmp_path, capsys):
    pytest.importorskip("dynmb.costmodel")
    pytest.importorskip("dynmb.memory.model")
    import json

    from dynmb.cli import main
    from dynmb.schedule import from_csv, validate
    lengths = [120, 40, 300, 75, 220, 16, 180, 90]
    mbs = [Microbatch(seq_ids=[i], lengths=[n], padded_len=n, batch=1) for i, n in enumerate(lengths)]
    Plan(microbatches=mbs, method="test", num_stages=2, memory_limit_bytes=2**30,
         num_sequences=len(lengths)).save(tmp_path / "plan.json")
    out = tmp_path / "s.csv"
    assert main(["schedule", "--plan", str(tmp_path / "plan.json"), "--kind", "1f1b", "--reorder", "search",
                 "--model", "tiny", "-o", str(out)]) == 0
    assert "1f1b schedule: 2 ranks" in capsys.readouterr().out
    s = from_csv(out)
    validate(s)
    reordered = Plan.load(tmp_path / "s.plan.json")
    assert reordered.meta["reorder"] == "search" and reordered.num_microbatches == 8
    png, tl = tmp_path / "g.png", tmp_path / "t.csv"
    assert main(["simulate", "--plan", str(tmp_path / "s.plan.json"), "--schedule", str(out), "--model", "tiny",
                 "--json", "--gantt", str(png), "--timeline", str(tl)]) == 0
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert d["makespan_s"] > 0 and len(d["bubble_fraction"]) == 2 and len(d["peak_bytes"]) == 2 and d["fits"]
    assert png.stat().st_size > 1000 and len(__import__("pandas").read_csv(tl)) == 32
    # a deadlocking CSV is refused with the grid
    (tmp_path / "bad.csv").write_text("0F0,0B0,0F1,0B1,0F2,0B2,0F3,0B3,0F4,0B4,0F5,0B5,0F6,0B6,0F7,0B7\n"
                                      "1F0,1F1,1B0,1B1,1F2,1B2,1F3,1B3,1F4,1B4,1F5,1B5,1F6,1B6,1F7,1B7\n")
    assert main(["simulate", "--plan", str(tmp_path / "s.plan.json"), "--schedule", str(tmp_path / "bad.csv"),
                 "--model", "tiny"]) == 2
    assert "deadlocks" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_fast_path_is_the_simulation(kind):
    """``estimate_makespan`` (the packers' estimate) equals the discrete-event simulation of the
    builders' schedule, bit for bit, in its exact regime; above it, a lower bound close to it."""
    from dynmb.timing.simulate import estimate_makespan

    rng = np.random.default_rng(0)
    for P in range(1, 6):
        for m in (1, 2, 3, P, P + 1, 2 * P + 3, 17):
            costs = {"F": rng.uniform(1, 3, (P, m)), "B": rng.uniform(2, 6, (P, m))}
            comm = rng.uniform(0, 0.5, m)
            res = simulate_costs(build_schedule(kind, P, m), costs, comm)
            assert estimate_makespan(costs, comm, kind) == res.makespan_s, (P, m)
    P, m = 4, 1000                                   # 8000 ops: the pipeline bound
    costs = {"F": rng.uniform(1, 1.1, (P, m)), "B": rng.uniform(2, 2.2, (P, m))}
    res = simulate_costs(build_schedule(kind, P, m), costs, 0.01)
    assert 0.95 * res.makespan_s <= estimate_makespan(costs, 0.01, kind) <= res.makespan_s


def _action_row(stage, op, mb, seconds, dp_rank=0):
    return ActionRow(run_id="r", step=0, rank=stage, dp_rank=dp_rank, stage=stage, op=op, mb=mb, batch=1,
                     padded_len=8, docs=1, attn_work=64, start_s=10.0, end_s=10.0 + seconds, pred_s=0.0, wait_s=0.0)


def test_replay_step_s_simulates_the_measured_action_times():
    """1F1B, 2 stages, 2 microbatches, F = 1 s and B = 2 s measured, no P2P time: rank 1 runs
    F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7], rank 0 F0 [0,1] F1 [1,2] B0 [4,6] B1 [7,9]: 9 s; with
    0.5 s per message rank 1 runs F0 [1.5,2.5] B0 [2.5,4.5] F1 [4.5,5.5] B1 [5.5,7.5] and rank 0
    B0 [5,7] B1 [8,10]: 10 s."""
    plan = _plan(P=2, lengths=(5, 9))
    schedule = build_schedule("1f1b", 2, 2)
    rows = [_action_row(st, op, mb, 1.0 if op == "F" else 2.0) for st in (0, 1) for op in "FB" for mb in (0, 1)]
    free = AnalyticCostModel(ModelConfig.preset("tiny"), 2, comm=CommModel(alpha_s=0.0, bytes_per_s=1e30))
    assert replay_step_s(schedule, plan, rows, free) == pytest.approx(9.0)
    slow = AnalyticCostModel(ModelConfig.preset("tiny"), 2, comm=CommModel(alpha_s=0.5, bytes_per_s=1e30))
    assert replay_step_s(schedule, plan, rows, slow) == pytest.approx(10.0)
    # an action of the schedule without a measurement (another replica's does not stand in): no replay
    assert replay_step_s(schedule, plan, rows[1:], free) is None
    assert replay_step_s(schedule, plan, [_action_row(0, "F", 0, 1.0, dp_rank=1)] + rows[1:], free) is None

