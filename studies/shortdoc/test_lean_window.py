"""Smoke test of ``studies/shortdoc/lean_window.py``: the lean window, the kind it registers, and the stall that
makes it slow (two neighbouring stages with the same window under 1F1B's order)."""

from __future__ import annotations

import pytest
from studies.shortdoc import lean_window

from dynmb.schedule.kinds import build_schedule, unregister_kind
from dynmb.schedule.zerobubble import ZBInputs, list_schedule


def test_lean_window_is_a_fraction_of_one_f_one_b_and_at_least_one():
    w = lean_window.LeanWindow(0.75)
    assert [w(s, 8) for s in range(8)] == [6, 6, 5, 4, 3, 3, 2, 1]
    assert [lean_window.LeanWindow(1.0)(s, 4) for s in range(4)] == [4, 3, 2, 1]


def test_zb_lean_builds_a_valid_schedule_holding_its_window():
    name = lean_window.register_lean(0.75)
    try:
        sched = build_schedule(name, 4, 12)
        window = lean_window.LeanWindow(0.75)
        for s, acts in enumerate(sched.ranks):
            waiting, most = 0, 0                 # forwards whose backward (I or B) has not run
            for a in acts:
                waiting += 1 if a.op == "F" else -1 if a.op in ("I", "B") else 0
                most = max(most, waiting)
            assert most == window(s, 4)
            assert sum(a.op == "F" for a in acts) == 12
    finally:
        unregister_kind(name)


@pytest.mark.parametrize("P", [4, 8])
def test_equal_neighbouring_windows_stall_the_pipeline(P):
    unit = ZBInputs.unit(P, 4 * P)
    full = [P - s for s in range(P)]
    lean = [max(1, P - s - 1) if s == 0 else P - s for s in range(P)]       # stage 0 as stage 1
    assert lean[0] == lean[1]
    t_full = list_schedule(unit, full)[1]
    t_lean = list_schedule(unit, lean)[1]
    assert t_lean > 1.1 * t_full
