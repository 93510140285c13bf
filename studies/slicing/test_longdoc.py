"""Smoke test of ``studies/slicing/longdoc.py`` (``python -m pytest -q studies``): the chain counterfactual on a tiny
sliced plan, and the tables from JSON lines."""

from __future__ import annotations

import json

import numpy as np
import pytest

import dynmb
from dynmb.core.config import parse_bytes
from studies.slicing import longdoc


def test_chain_stall_is_zero_without_slices_and_finite_with_them():
    planner = dynmb.Planner(model="tiny", num_stages=2, memory_limit="16MiB", cost_model="analytic",
                            oversize="split", recompute="auto")
    sliced = planner.plan(np.array([2400, 1800, *([60, 90, 120, 30] * 4)]))
    plain = planner.plan(np.array([60, 90, 120, 30] * 4))
    assert sliced.plan.slice_groups() and sliced.plan.memory_limit_bytes == parse_bytes("16MiB")
    assert longdoc.chain_stall(plain, planner.cost_model, planner.memory_model) == 0.0
    assert np.isfinite(longdoc.chain_stall(sliced, planner.cost_model, planner.memory_model))
    assert not longdoc.unchained(sliced.plan).slice_groups()


def test_tables_from_json_lines(tmp_path, capsys):
    terms = {f"gap_{t}": 0.01 for t in ("chain", "order", *longdoc.TERMS)}
    row = {"trace": "t", "model": "m", "P": 8, "longest": 10, "step_s": 2.0, "ideal_s": 1.5, "gap": 1 / 3,
           "kind": "zb", "microbatches": 4, "sliced": 1, "slice_len": 5, "slice_cuts": "equal-cost",
           "placement": "spread", "plan_cpu_s": 1.0, "best_other": "", "best_other_s": float("nan"), **terms}
    before, after = tmp_path / "before.jsonl", tmp_path / "after.jsonl"
    before.write_text(json.dumps({**row, "step_s": 3.0, "gap": 1.0}) + "\n")
    after.write_text(json.dumps({**row, "step_fixed": 2.5, "best_other": "fixed", "best_other_s": 2.5}) + "\n")
    assert longdoc.main(["--table", str(after), "--before", str(before)]) == 0
    out = capsys.readouterr().out
    assert "3.0000 -> 2.0000" in out and "fixed (2.5000) | 0.800" in out
    assert longdoc.main(["--table", str(after)]) == 0


def test_table_merges_the_other_methods_of_every_file_per_cell(tmp_path, capsys):
    """Files that ran different ``--others`` on one cell: one row, dynamic from the last file, each other method's
    lowest step of any file (the best other may come from the earlier file)."""
    terms = {f"gap_{t}": 0.0 for t in ("chain", "order", *longdoc.TERMS)}
    row = {"trace": "t", "model": "m", "P": 8, "longest": 10, "step_s": 2.0, "ideal_s": 1.5, "gap": 1 / 3,
           "kind": "zb", "microbatches": 4, "sliced": 1, "slice_len": 5, "slice_cuts": "even", "placement": "first",
           "plan_cpu_s": 1.0, **terms}
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text(json.dumps({**row, "step_fixed": 2.5, "best_other": "fixed", "best_other_s": 2.5}) + "\n")
    second.write_text(json.dumps({**row, "step_lockstep": 4.0, "best_other": "lockstep", "best_other_s": 4.0}) + "\n")
    assert longdoc.main(["--table", str(first), str(second)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| t |")]
    assert len(lines) == 1 and "fixed (2.5000) | 0.800" in lines[0]


def test_the_other_methods_are_every_alternative_dynamic_weighs():
    from dynmb.planning.slicing import slice_alternatives

    assert {m if b is None else f"{m}/{b}" for m, b in slice_alternatives()} == set(longdoc.OTHERS)


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        longdoc.main(["--help"])
    assert e.value.code == 0 and "--out" in capsys.readouterr().out


def test_lookahead_help(capsys):
    from studies.slicing import lookahead

    with pytest.raises(SystemExit) as e:
        lookahead.main(["--help"])
    assert e.value.code == 0 and "--kinds" in capsys.readouterr().out


def test_weighprofile_and_plantime_help(capsys):
    from studies.slicing import plantime, weighprofile

    for main, flag in ((weighprofile.main, "--finalists"), (plantime.main, "--modes")):
        with pytest.raises(SystemExit) as e:
            main(["--help"])
        assert e.value.code == 0 and flag in capsys.readouterr().out
    assert set(plantime.MODES) >= {"off", "screened", "full"}


def test_weighprofile_parts_of_a_tiny_profile():
    import cProfile
    import pstats
    import time

    from studies.slicing import weighprofile

    planner = dynmb.Planner(model="tiny", num_stages=2, memory_limit="16MiB", cost_model="analytic",
                            oversize="split", recompute="auto")
    prof = cProfile.Profile(time.process_time)
    prof.enable()
    planner.plan(np.array([2400, 1800, *([60, 90, 120, 30] * 4)]))
    prof.disable()
    parts = weighprofile.part_seconds(pstats.Stats(prof))
    assert parts["simulate"][1] > 0 and parts["schedule build"][1] > 0 and parts["search total"][1] > 0


def test_behind_logs_the_screen_and_the_final_check_and_restores_them(capsys):
    from dynmb.planning import planner as planner_module
    from dynmb.planning import slicing
    from studies.slicing import behind

    planner = dynmb.Planner(model="tiny", num_stages=2, memory_limit="16MiB", cost_model="analytic",
                            oversize="split", recompute="auto")
    screen, robust = slicing._screen, planner_module.robust
    with behind.screen_logged():
        sliced = planner.plan(np.array([2400, 1800, *([60, 90, 120, 30] * 4)]))
    with behind.final_logged():
        plain = planner.plan(np.array([60, 90, 120, 30] * 4))
    out = capsys.readouterr().out
    assert sliced.plan.slice_groups() and "whole searches:" in out and "screen of" in out
    assert not plain.plan.slice_groups() and "final check of" in out and "chosen" in out
    assert slicing._screen is screen and planner_module.robust is robust
    assert behind.describe("x", sliced, 1.0).startswith(f"x: {sliced.sim.makespan_s:.5f} s")
