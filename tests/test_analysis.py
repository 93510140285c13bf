"""``summarise``: one row per configuration, never merging runs that differ in any setting of their spec."""

from __future__ import annotations

import pandas as pd
import pytest

from dynmb.report.analysis import summarise


def _steps(run_id: str, method: str, tps: list[float], **cols) -> list[dict]:
    base = dict(run_id=run_id, method=method, dataset="sharegpt", memory_limit_bytes=2**30, model="small",
                num_stages=2, virtual=1, dp=1, schedule="1f1b", attention="auto", round_to=1, global_batch=8,
                seed=0, reorder="auto", label=method, num_microbatches=4, pred_step_s=1.0, computed_tokens=1200,
                warmup=False)
    return [dict(base, step=k, real_tokens=1000, step_s=1000 / t, tokens_per_s=t, **cols) for k, t in enumerate(tps)]


def _runs(*rows: dict) -> pd.DataFrame:
    return pd.DataFrame([{**dict(mbs=None, pack_len=None, recompute="never", oversize="error", lr=1e-3), **r} for r in rows])


def test_runs_differing_only_in_their_spec_are_not_merged() -> None:
    steps = pd.DataFrame(_steps("a", "dynamic", [100, 110]) + _steps("b", "dynamic", [50, 55]))
    runs = _runs(dict(run_id="a", recompute="never"), dict(run_id="b", recompute="always"))
    out = summarise({"steps": steps, "runs": runs})
    assert len(out) == 2
    assert sorted(out.index.get_level_values("recompute")) == ["always", "never"]
    assert sorted(out["tokens_per_s"].round(6)) == [pytest.approx(52.380952), pytest.approx(104.761905)]
    with pytest.raises(ValueError, match="would merge runs of different 'recompute'"):
        summarise({"steps": steps, "runs": runs}, by=["method"])


def test_a_repeated_reference_run_plus_another_method() -> None:
    # two runs of one dynamic configuration into one folder, plus a fixed run: the reference is
    # their median per step, and every configuration gets its paired ratio
    steps = pd.DataFrame(_steps("a", "dynamic", [100, 120]) + _steps("b", "dynamic", [110, 100])
                         + _steps("c", "fixed", [50, 50]))
    runs = _runs(dict(run_id="a"), dict(run_id="b"), dict(run_id="c", mbs=2))
    out = summarise({"steps": steps, "runs": runs}).reset_index().set_index("method")
    assert out.loc["dynamic", "steps"] == 4
    assert out.loc["fixed", "x_dynamic"] == pytest.approx(2.15)      # median of 105/50 and 110/50
    # each dynamic step against fixed's: 1 / median(50/100, 50/120, 50/110, 50/100)
    assert out.loc["dynamic", "speedup_vs_fixed"] == pytest.approx(1 / ((50 / 110 + 50 / 100) / 2))


def test_constant_settings_add_no_index_levels() -> None:
    steps = pd.DataFrame(_steps("a", "dynamic", [100]) + _steps("c", "fixed", [50]))
    out = summarise({"steps": steps, "runs": _runs(dict(run_id="a"), dict(run_id="c"))})
    assert "recompute" not in out.index.names and len(out) == 2


def test_a_setting_the_steps_table_carries_itself_is_a_key_too() -> None:
    """Real runs write ``recompute`` and ``oversize`` into ``steps`` as well as ``runs``: two runs
    that differ in it stay two rows (the join skips columns the steps already have)."""
    steps = pd.DataFrame(_steps("a", "dynamic", [100, 110], recompute="never")
                         + _steps("b", "dynamic", [50, 55], recompute="always"))
    runs = _runs(dict(run_id="a", recompute="never"), dict(run_id="b", recompute="always"))
    out = summarise({"steps": steps, "runs": runs})
    assert len(out) == 2 and sorted(out.index.get_level_values("recompute")) == ["always", "never"]


def test_every_method_is_measured_against_one_ideal_per_batch() -> None:
    """Each run prices ``ideal_s`` with its own calibrated model; the summary's gap is to the median over
    the runs of the same batch (same context and step), so a method's gap does not move with its calibration."""
    steps = pd.DataFrame(_steps("a", "dynamic", [100, 100], ideal_s=8.0, bound_s=9.0, gap_to_bound=0.1)
                         + _steps("b", "balanced", [100, 100], ideal_s=9.0, bound_s=9.0, gap_to_bound=0.1)
                         + _steps("c", "fixed", [50, 50], ideal_s=10.0, bound_s=9.0, gap_to_bound=0.1))
    out = summarise({"steps": steps, "runs": _runs(dict(run_id="a"), dict(run_id="b"), dict(run_id="c"))})
    gaps = out.reset_index().set_index("method")["gap_to_ideal"]
    assert gaps["dynamic"] == pytest.approx(10.0 / 9.0 - 1) and gaps["balanced"] == pytest.approx(10.0 / 9.0 - 1)
    assert gaps["fixed"] == pytest.approx(20.0 / 9.0 - 1)
