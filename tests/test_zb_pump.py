"""The zero-bubble list scheduler's rule 5 (``pump``: a forward fills a gradient's wait past the window, memory
permitting), ``zb``'s two pumped candidates (never slower than without them, within the limit), and
``schedule_wire`` (the P2P latency's share of the schedule term)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynmb.core.types import Microbatch, Plan
from dynmb.costmodel import AnalyticCostModel, CommModel
from dynmb.costmodel.loader import Models
from dynmb.core.config import ModelConfig
from dynmb.planning import make_schedule
from dynmb.planning.zerobubble import build_zb, zb_evaluator, zb_inputs
from dynmb.schedule import build_schedule, validate
from dynmb.schedule import zerobubble as zbm
from dynmb.schedule.zerobubble import ZBInputs, list_schedule, op_bytes
from dynmb.timing.gap_terms import gap_terms, schedule_wire
from dynmb.timing.simulate import simulate, simulate_costs
from tests.test_zerobubble import _models, _plan, variable_plans

SMALL = ModelConfig.preset("small")


def _inputs(F, I, W, comm, act=None):  # noqa: E741
    F, I, W = (np.asarray(x, dtype=np.float64) for x in (F, I, W))  # noqa: E741
    split = np.ones(F.shape, dtype=bool)
    act = None if act is None else np.asarray(act, dtype=np.float64)
    zero = None if act is None else np.zeros_like(act)
    return ZBInputs(F, I + W, I, W, np.asarray(comm, dtype=np.float64), split, act, act, zero)


def _peaks(sched, inp: ZBInputs) -> np.ndarray:
    """Held + running bytes per stage of ``sched`` (``op_bytes``, the simulator's rule)."""
    out = np.zeros(sched.num_stages)
    for s, acts in enumerate(sched.ranks):
        held = 0.0
        for a in acts:
            d, extra = op_bytes(a.op, inp.act[s, a.mb], inp.w[s, a.mb], inp.tr[s, a.mb])
            out[s] = max(out[s], held + extra)
            held += d
    return out


def _sim_makespan(sched, inp: ZBInputs) -> float:
    costs = {"F": inp.F, "B": inp.B, "I": inp.I, "W": inp.W}
    return simulate_costs(sched, costs, inp.comm).makespan_s


def test_a_late_gradient_lets_the_next_forward_run_past_the_window():
    """Two stages, window [2, 1], P2P 3 s: stage 0's gradient of microbatch 0 returns at 9; with the rule its
    forwards 2 and 3 run in that wait (it fails where the rule is absent: stage 0 then waits from 2 to 9)."""
    one = np.ones((2, 4))
    inp = _inputs(one, one, one, np.full(4, 3.0))
    plain, t_plain = list_schedule(inp, [2, 1], w_defer=[0, 1])
    pumped, t_pumped = list_schedule(inp, [2, 1], w_defer=[0, 1], pump=True)
    validate(pumped)
    assert [(a.op, a.mb) for a in plain.ranks[0][:3]] == [("F", 0), ("F", 1), ("I", 0)]
    assert [(a.op, a.mb) for a in pumped.ranks[0][:4]] == [("F", 0), ("F", 1), ("F", 2), ("F", 3)]
    assert t_pumped < t_plain
    assert t_pumped == pytest.approx(_sim_makespan(pumped, inp), rel=1e-12)


def test_the_rule_never_passes_the_cap():
    """The same pipeline with room for two activations on stage 0: no forward runs past the window."""
    one = np.ones((2, 4))
    inp = _inputs(one, one, one, np.full(4, 3.0), act=one)
    caps = [2.0, 1.0]
    pumped, _ = list_schedule(inp, [2, 1], caps, w_defer=[0, 1], pump=True)
    assert [(a.op, a.mb) for a in pumped.ranks[0][:3]] == [("F", 0), ("F", 1), ("I", 0)]
    assert np.all(_peaks(pumped, inp) <= np.asarray(caps) + 1e-9)


@st.composite
def pipelines(draw):
    """Random per-(stage, microbatch) times, P2P times and activations; caps from 1F1B's peaks x slack."""
    P, m = draw(st.integers(2, 6)), draw(st.integers(1, 16))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    size = rng.uniform(0.2, 3.0, m)
    F = np.outer(rng.uniform(0.8, 1.2, P), size)
    I, W = F * rng.uniform(0.9, 1.3), F * rng.uniform(0.6, 1.1)  # noqa: E741
    comm = size * draw(st.sampled_from([0.0, 0.05, 0.3, 1.0]))
    inp = _inputs(F, I, W, comm, act=np.outer(np.ones(P), size))
    caps = zbm.one_f_one_b_peaks(inp) * draw(st.floats(1.0, 2.5))
    return inp, caps


@settings(max_examples=80, deadline=None)
@given(pipelines(), st.sampled_from(["s", "all"]))
def test_pumped_schedules_are_valid_timed_as_the_simulator_and_within_the_caps(case, defer):
    inp, caps = case
    P, m = inp.shape
    sched, t = list_schedule(inp, zbm._inflight(P, m), caps, w_defer=list(range(P)) if defer == "s" else [m] * P,
                             pump=True)
    validate(sched)
    assert t == pytest.approx(_sim_makespan(sched, inp), rel=1e-12)
    assert np.all(_peaks(sched, inp) <= caps + 1e-6)


@settings(max_examples=25, deadline=None)
@given(variable_plans(), st.floats(1.0, 1.6))
def test_zb_with_the_pumped_candidates_is_never_slower_and_stays_under_the_limit(plan, slack):
    P, m = plan.num_stages, plan.num_microbatches
    cm, mm = _models(P)
    cm.comm = CommModel(2e-5, 2e9)                            # P2P latency on the loop: where the rule matters
    one = simulate(build_schedule("1f1b", P, m), plan, cm, mm)
    plan = Plan(plan.microbatches, "test", P, int(max(one.peak_bytes) * slack), plan.num_sequences)
    models = Models(cm, mm)
    steps = {}
    try:
        for pumped in (False, True):
            zbm.PUMPED = pumped
            sim = simulate(build_zb(plan, "zb", models=models), plan, cm, mm)
            assert np.all(sim.peak_bytes <= plan.memory_limit_bytes + 1e-6)
            steps[pumped] = sim.makespan_s
    finally:
        zbm.PUMPED = True
    assert steps[True] <= steps[False] * (1 + 1e-12)


def test_zb_takes_a_pumped_schedule_where_it_is_faster():
    """A three-stage ramp with a P2P latency above its small microbatches' W, at 1F1B's peak as the limit:
    ``zb`` with the pumped candidates is strictly faster than without them (fails on the candidates before:
    2.2432 s for 2.1797 s)."""
    plan = _plan([(1, 64), (1, 64), (1, 128), (1, 128), (1, 256), (1, 256), (1, 1024), (1, 1024)], 3)
    cm, mm = _models(3)
    cm.comm = CommModel(5e-4, 1e12)
    one = simulate(build_schedule("1f1b", 3, 8), plan, cm, mm)
    plan = Plan(plan.microbatches, "test", 3, int(max(one.peak_bytes)), plan.num_sequences)
    models = Models(cm, mm)
    inp = zb_inputs(plan, models)
    evaluate = zb_evaluator(plan, models, inp)
    steps = {}
    try:
        for pumped in (False, True):
            zbm.PUMPED = pumped
            steps[pumped], peak = evaluate(build_zb(plan, "zb", models=models))
            assert np.all(peak <= plan.memory_limit_bytes + 1e-6)
    finally:
        zbm.PUMPED = True
    assert steps[True] < steps[False] * (1 - 0.02)


# --- schedule_wire --------------------------------------------------------------------------------------------

def _equal_plan(m: int, P: int) -> Plan:
    mbs = [Microbatch(seq_ids=[i], lengths=[512], padded_len=512, batch=1) for i in range(m)]
    return Plan(microbatches=tuple(mbs), method="fixed", num_stages=P, memory_limit_bytes=1 << 40, num_sequences=m)


@pytest.mark.parametrize("alpha_s", [0.0, 1.0])
def test_wire_is_1f1bs_whole_excess_on_equal_microbatches(alpha_s):
    """Equal microbatches under 1F1B: at zero P2P time the makespan is the bound (``timing.bounds``' doc), so
    the wire share is all of ``step - bound`` (round trips of 1 s wait), 0 without P2P time."""
    P, m = 4, 8
    cm = AnalyticCostModel(SMALL, P, overhead_s=0.0, comm=CommModel(alpha_s, 1e30))
    plan = _equal_plan(m, P)
    sched = make_schedule(plan, "1f1b", models=Models(cm, None))
    sim = simulate(sched, plan, cm)
    wire = schedule_wire(plan, sched, cm)
    assert wire == pytest.approx(gap_terms(plan, sched, cm, sim.makespan_s).schedule, abs=1e-12)
    assert (wire > 0) == (alpha_s > 0)


def test_wire_refuses_a_schedule_of_another_plan():
    cm = AnalyticCostModel(SMALL, 2, overhead_s=0.0)
    with pytest.raises(ValueError, match="schedule_wire"):
        schedule_wire(_equal_plan(3, 2), build_schedule("1f1b", 2, 4), cm)
