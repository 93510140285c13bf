"""`dynmb compare` end to end on 2 gloo ranks with the tiny model: tables, summary and plots."""

from __future__ import annotations

import pandas as pd
import pytest

from dynmb.cli import main
from dynmb.compare import reorder_for

pytestmark = pytest.mark.dist


def test_reorder_auto_gives_each_method_its_own_order():
    assert reorder_for("dynamic", "auto") == "search"
    assert reorder_for("dynapipe", "auto") == "dynapipe"
    assert reorder_for("fixed", "auto") == "none"
    assert reorder_for("fixed", "ends") == "ends"


def test_compare_runs_methods_side_by_side(tmp_path, capsys):
    out = tmp_path / "cmp"
    rc = main(["compare", "--model", "tiny", "--dataset", "gsm8k", "--global-batch", "8", "--steps", "2",
               "--warmup", "0", "--methods", "fixed,dynamic", "--memory-limit", "64MiB", "--out", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "steps: 100%" in captured.err and "4/4" in captured.err          # the progress bar
    # on CPU the methods run round by round, the order rotated: step 0 of fixed, of dynamic,
    # then step 1 of dynamic, of fixed (rank 0 appends the rows as the steps finish)
    order = pd.read_csv(out / "steps.csv")[["method", "step"]].apply(tuple, axis=1).tolist()
    assert order == [("fixed", 0), ("dynamic", 0), ("dynamic", 1), ("fixed", 1)]
    assert "dynamic" in printed and "speedup_vs_fixed" in printed
    summary = pd.read_csv(out / "summary.csv").set_index("method")
    assert list(summary.index) == ["fixed", "dynamic"]
    assert summary.loc["fixed", "speedup_vs_fixed"] == pytest.approx(1.0)
    assert (summary["peak_over_limit"] <= 1.0).all()
    assert (summary["padding_fraction"] >= 0).all()
    steps = pd.read_csv(out / "steps.csv")
    assert set(steps["method"]) == {"fixed", "dynamic"}
    assert set(steps.loc[steps["method"] == "dynamic", "reorder"]) == {"search"}
    for png in ("throughput.png", "gantt_fixed_measured.png", "gantt_dynamic_predicted.png"):
        assert (out / png).stat().st_size > 1000


def test_compare_on_one_rank_with_virtual_stages(tmp_path, capsys):
    """``--virtual 2``: both stages on one rank (one GPU), interleaved; the rank's peak, states
    of both stages included, stays under the limit."""
    out = tmp_path / "cmp1"
    rc = main(["compare", "--model", "tiny", "--dataset", "gsm8k", "--global-batch", "8", "--steps", "1",
               "--warmup", "0", "--methods", "fixed,dynamic", "--memory-limit", "64MiB", "--virtual", "2",
               "--device", "cpu", "--sequential", "--out", str(out)])
    assert rc == 0
    steps = pd.read_csv(out / "steps.csv")
    assert steps["method"].tolist() == ["fixed", "dynamic"]          # --sequential: one method after another
    assert set(steps["schedule"]) == {"interleaved"} and set(steps["virtual"]) == {2}
    assert set(steps["world_size"]) == {1}
    mem = pd.read_csv(out / "memory.csv")
    assert (mem["peak_bytes"] <= mem["limit_bytes"]).all()
    with pytest.raises(SystemExit):
        main(["compare", "--virtual", "2", "--device", "tpu"])
