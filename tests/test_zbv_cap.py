"""ZB-V's exact admission (``dynmb.schedule.vshape``, rule 2): every forward, chunk 1's included, is
held to the cap, so a rank never holds more than ``cap`` chunk-microbatches (``v_inflight`` = ``2R``, 1F1B's
stage 0 in layer-microbatches); the list scheduler never deadlocks on it and its clocks bound the simulator's."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dynmb.schedule.vshape as vshape
from dynmb.schedule import validate
from dynmb.schedule.vshape import admission_caps, list_makespan, v_inflight, zb_v
from dynmb.schedule.zerobubble import ZBInputs
from dynmb.timing.simulate import simulate_costs
from tests.test_zbv import _live as _held          # most chunk-microbatches each rank held



def _pipeline(R: int, m: int, seed: int) -> ZBInputs:
    rng = np.random.default_rng(seed)
    S = 2 * R
    tok = rng.lognormal(0, float(rng.choice([0.0, 0.5, 1.0])), m)
    F = tok[None, :] * rng.uniform(0.7, 1.4, (S, 1))
    share = rng.uniform(0.3, 0.6, (S, 1))
    B = rng.uniform(1.8, 2.4, (S, 1)) * F
    comm = rng.uniform(0, 0.4) * tok
    return ZBInputs(F, B, (1 - share) * B, share * B, comm, np.ones((S, m), dtype=bool))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(1, 48), st.integers(0, 2**31 - 1))
def test_no_rank_ever_holds_more_than_the_cap(R: int, m: int, seed: int) -> None:
    """Random pipelines, every cap the builder tries: valid, within the cap on every rank (the old rule 2 let chunk-1
    forwards past it: up to ``3R`` at cap ``2R``, which fails here), and the list clocks never before the simulator's
    step of the same schedule."""
    inp = _pipeline(R, m, seed)
    costs = {"F": inp.F, "B": inp.B, "I": inp.I, "W": inp.W}
    for cap in admission_caps(R):
        sched = vshape._list_v(inp, cap)
        validate(sched)
        assert max(_held(sched)) <= min(cap, 2 * m), (cap, _held(sched))
        sim = simulate_costs(sched, costs, inp.comm).makespan_s
        assert list_makespan(inp, cap) >= sim * (1 - 1e-9)


def test_the_window_the_packers_count_is_the_cap() -> None:
    """``v_inflight`` (the packers' and the peak rule's count) is the largest cap, ``2R``, at most ``2m``."""
    assert v_inflight(0, 8, 2) == 16 == max(admission_caps(8))
    assert list(v_inflight(np.arange(4), 4, 2, num_microbatches=3)) == [6] * 4


def test_the_full_builder_stays_within_v_inflight_on_a_long_ramp() -> None:
    """The evaluated builder (three caps, the fastest kept) on a P 16 ramp of 120 growing microbatches."""
    R, m = 8, 120
    inp = _pipeline(R, m, 3)
    costs = {"F": inp.F, "B": inp.B, "I": inp.I, "W": inp.W}

    def judge(s):
        return simulate_costs(s, costs, inp.comm).makespan_s, np.zeros(2 * R)

    sched = zb_v(2 * R, m, inp, evaluate=judge)
    assert max(_held(sched)) <= v_inflight(0, R, 2, m)


@pytest.mark.parametrize("cap", [1, 0])
def test_a_cap_below_two_is_refused(cap: int) -> None:
    with pytest.raises(ValueError, match="admission cap"):
        vshape._list_v(_pipeline(2, 4, 0), cap)
