"""What a user reads after a compare is true (issue 40): the verdict's interval, the round order, the
printed names, the figure, one job per folder, the ``case`` column, ``load_results``' summary and the
printed ``summarise``. Small synthetic tables; no runs."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynmb.io.outdir import check_fresh
from dynmb.io.results import ResultsError, load_results, tag_runs, write_table
from dynmb.report.analysis import paired_bootstrap, repeat_noise, summarise
from dynmb.report.compare_table import BoxState, display_summary, format_summary, verdict
from dynmb.report.plots import compare_figure, compare_throughput
from dynmb.runtime.worker import round_order


def _steps(run_id: str, method: str, tps: list[float], **cols) -> list[dict]:
    base = dict(run_id=run_id, method=method, dataset="sharegpt", memory_limit_bytes=2**30, model="small",
                num_stages=2, virtual=1, dp=1, schedule="1f1b", attention="auto", round_to=1, global_batch=8,
                seed=0, reorder="auto", label=method, num_microbatches=4, pred_step_s=1.0, computed_tokens=1200,
                warmup=False, mbs=2)
    return [dict(base, step=k, real_tokens=1000, step_s=1000 / t, tokens_per_s=t, **{**cols})
            for k, t in enumerate(tps)]


def _tables(balanced: list[float], dynamic: list[float] | None = None) -> dict[str, pd.DataFrame]:
    dynamic = dynamic or [100.0, 120.0, 130.0, 110.0, 90.0]
    rows = (_steps("d", "dynamic", dynamic) + _steps("f", "fixed", [50.0] * len(dynamic))
            + [dict(r, label="fixed mbs=1", mbs=1) for r in _steps("f1", "fixed", [40.0] * len(dynamic))]
            + _steps("b", "balanced", balanced))
    runs = pd.DataFrame([dict(run_id=r, mbs=m, pack_len=None) for r, m in
                         (("d", None), ("f", None), ("f1", 1), ("b", None))])
    return {"steps": pd.DataFrame(rows), "runs": runs}


BOX = BoxState(load_peak=1.5, load_mean=1.2, cores=2, repeat_noise=float("nan"), repeats=1, order_seed=3)


def _display(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    return display_summary(summarise(tables), ["fixed", "fixed mbs=1", "balanced", "dynamic"])


def test_the_paired_bootstrap_interval_holds_the_median_and_narrows_with_more_pairs() -> None:
    rng = np.random.default_rng(1)
    few, many = 1.05 + 0.05 * rng.standard_normal(5), 1.05 + 0.05 * rng.standard_normal(200)
    lo5, hi5 = paired_bootstrap(few)
    lo200, hi200 = paired_bootstrap(many)
    assert lo5 <= np.median(few) <= hi5 and lo200 <= np.median(many) <= hi200
    assert hi200 - lo200 < hi5 - lo5
    assert paired_bootstrap(np.array([1.2])) == (1.2, 1.2)
    assert all(math.isnan(v) for v in paired_bootstrap(np.array([np.nan])))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(0.2, 5.0), min_size=1, max_size=12))
def test_the_interval_lies_within_the_range_of_the_pairs(ratios: list[float]) -> None:
    lo, hi = paired_bootstrap(np.array(ratios))
    assert min(ratios) - 1e-12 <= lo <= hi <= max(ratios) + 1e-12


def test_a_verdict_whose_interval_covers_one_says_within_noise() -> None:
    close = _display(_tables(balanced=[95.0, 125.0, 128.0, 115.0, 88.0]))
    found = verdict(close, BOX)
    assert found is not None and found.best_other == "balanced"
    assert found.ci_lo <= 1.0 <= found.ci_hi and found.within_noise
    assert "within noise" in found.line() and "95% interval" in found.line() and "load average 1.2" in found.line()
    far = verdict(_display(_tables(balanced=[50.0, 60.0, 65.0, 55.0, 45.0])), BOX)
    assert far is not None and far.ci_lo > 1.0 and not far.within_noise and "dynamic faster" in far.line()


def test_the_printed_table_uses_the_csv_column_names_and_a_legend() -> None:
    shown = _display(_tables(balanced=[95.0, 125.0, 128.0, 115.0, 88.0]))
    text = format_summary(shown, box=BOX)
    header = text.splitlines()[0].split()
    assert {"tokens_per_s", "x_dynamic", "x_dynamic_ci_lo", "x_dynamic_ci_hi", "padding_fraction"} <= set(header)
    assert set(header) <= set(shown.reset_index().columns)           # every printed name is a CSV column
    assert "x_dynamic: dynamic's tokens/s over the case's" in text and "closest other case (balanced)" in text


def test_each_round_runs_the_cases_in_a_fresh_seeded_order() -> None:
    orders = [round_order(6, k, seed=11) for k in range(8)]
    assert all(sorted(o) == list(range(6)) for o in orders)
    assert len({tuple(o) for o in orders}) > 4                        # not a rotation of one order
    assert orders == [round_order(6, k, seed=11) for k in range(8)]   # the same on every rank
    assert round_order(3, 1, None) == [1, 2, 0]                       # no seed: the old rotation


def test_repeat_noise_is_the_spread_of_one_case_between_repeats() -> None:
    one = pd.DataFrame(_steps("a", "dynamic", [100.0, 100.0], repeat=0) + _steps("b", "dynamic", [110.0, 90.0],
                                                                                  repeat=1))
    assert repeat_noise(one) == pytest.approx(np.median([5 / 105, 5 / 105, 5 / 95, 5 / 95]))
    assert math.isnan(repeat_noise(pd.DataFrame(_steps("a", "dynamic", [100.0, 90.0], repeat=0))))


def test_repeats_are_paired_within_their_own_repeat() -> None:
    """Repeat 1 ran on a slower box: paired within each repeat, the ratio stays 2."""
    rows = (_steps("d0", "dynamic", [100.0, 100.0], repeat=0) + _steps("f0", "fixed", [50.0, 50.0], repeat=0)
            + _steps("d1", "dynamic", [60.0, 60.0], repeat=1) + _steps("f1", "fixed", [30.0, 30.0], repeat=1))
    out = summarise({"steps": pd.DataFrame(rows)}).reset_index().set_index("method")
    assert out.loc["fixed", "x_dynamic"] == pytest.approx(2.0) and out.loc["fixed", "pairs"] == 4
    assert out.loc["fixed", "x_dynamic_ci_lo"] == pytest.approx(2.0)


def test_the_figure_has_no_repeated_bars_a_colour_key_and_says_which_way_is_faster() -> None:
    shown = _display(_tables(balanced=[95.0, 125.0, 128.0, 115.0, 88.0]))
    assert any("-best" in c for c in shown.index)
    fig = compare_figure(shown, "t")
    bars, ratio = fig.axes[0], fig.axes[1]
    assert len(bars.patches) == 4                                        # the -best row is not drawn again
    # each bar is labelled with its own height
    labels = [t.get_text().strip() for t in bars.texts]
    assert labels == [f"{p.get_width():,.0f}" for p in bars.patches]
    assert {t.get_text() for t in fig.legends[0].get_texts()} == {"fixed", "balanced", "dynamic"}
    words = " ".join(t.get_text() for ax in fig.axes for t in ax.texts) + bars.get_xlabel()
    assert "dynamic faster" in words and "longer bar = faster" in words
    assert "95% interval" in ratio.get_xlabel()
    assert any(t.get_text().endswith(" *") for t in bars.get_yticklabels())   # the best in hindsight, starred
    compact = compare_figure(shown, "t", compact=True)
    width_px = compact.get_size_inches()[0] * 120
    assert width_px <= 800 and len(compact.axes) == 1                 # README width: no downscaling of its text


def test_compare_throughput_writes_both_figures(tmp_path) -> None:
    shown = _display(_tables(balanced=[95.0, 125.0, 128.0, 115.0, 88.0]))
    paths = compare_throughput(shown, str(tmp_path / "throughput.png"))
    assert [p.split("/")[-1] for p in paths] == ["throughput.png", "throughput_compact.png"]
    assert all((tmp_path / p.split("/")[-1]).stat().st_size > 1000 for p in paths)


def test_a_folder_holding_another_jobs_tables_is_refused_unless_appending(tmp_path) -> None:
    check_fresh(tmp_path, append=False)                                  # empty: fine
    write_table(pd.DataFrame(_steps("a", "dynamic", [100.0])), tmp_path / "steps.csv")
    with pytest.raises(ResultsError) as err:
        check_fresh(tmp_path, append=False)
    assert "--out" in str(err.value) and "--append" in str(err.value) and "\n" not in str(err.value)
    check_fresh(tmp_path, append=True)


def test_rows_carry_their_case_and_load_results_returns_the_summary(tmp_path) -> None:
    write_table(pd.DataFrame(_steps("a", "dynamic", [100.0, 90.0]) + _steps("b", "fixed", [50.0])),
                tmp_path / "steps.csv")
    write_table(pd.DataFrame([dict(run_id="a", step=0, stage=0, peak_bytes=1, limit_bytes=2)]),
                tmp_path / "memory.csv")
    tag_runs(tmp_path, {"a": {"case": "dynamic"}, "b": {"case": "fixed (mbs 2)"}})
    write_table(pd.DataFrame({"case": ["fixed (mbs 2)", "dynamic"], "tokens_per_s": [50.0, 95.0]}),
                tmp_path / "summary.csv")
    tables = load_results(tmp_path)
    assert list(tables["summary"]["case"]) == ["fixed (mbs 2)", "dynamic"]
    joined = tables["steps"].merge(tables["summary"], on="case", suffixes=("", "_case"))
    assert len(joined) == 3 and list(tables["memory"]["case"]) == ["dynamic"]


def test_summarise_prints_the_columns_people_read() -> None:
    out = summarise(_tables(balanced=[95.0, 125.0, 128.0, 115.0, 88.0]))
    text = repr(out)
    first = text.splitlines()[0]
    assert "tokens_per_s" in first and "x_dynamic" in first and "..." not in text
    assert "more columns" in text and out.index.nlevels > 3               # the frame itself keeps every key
    assert "dataset" not in first and "memory_limit_bytes" not in text.splitlines()[1]
    assert type(out.reset_index()) is pd.DataFrame


def test_a_cut_parquet_copy_is_refused_naming_it(tmp_path) -> None:
    pytest.importorskip("pyarrow")
    write_table(pd.DataFrame(_steps("a", "dynamic", [100.0] * 40)), tmp_path / "steps.csv")
    parquet = tmp_path / "steps.parquet"
    parquet.write_bytes(parquet.read_bytes()[:200])          # cut (and newer than the CSV)
    with pytest.raises(ResultsError, match="steps.parquet: not a whole Parquet table"):
        load_results(tmp_path)


def test_the_jobs_own_ranks_do_not_make_the_box_loaded() -> None:
    """Two gloo ranks on two cores put the load average near 2 by themselves: only load beyond them is others'."""
    own = BoxState(load_peak=2.9, load_mean=2.3, cores=2, repeat_noise=float("nan"), repeats=1, order_seed=3,
                   job_ranks=2)
    busy = BoxState(load_peak=6.0, load_mean=4.1, cores=2, repeat_noise=float("nan"), repeats=1, order_seed=3,
                    job_ranks=2)
    assert not own.loaded and busy.loaded
    assert busy.others_load == pytest.approx(2.1)
