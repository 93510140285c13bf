"""`dynmb compare` end to end on 2 gloo ranks with the tiny model: tables, summary and plots."""

from __future__ import annotations

import pandas as pd
import pytest

from dynmb.cli import main
from dynmb.planning import reorder_for

pytestmark = pytest.mark.dist


def test_reorder_auto_gives_each_method_its_own_order():
    assert reorder_for("dynamic", "auto") == "search"
    assert reorder_for("dynapipe", "auto") == "dynapipe"
    assert reorder_for("fixed", "auto") == "none"
    assert reorder_for("fixed", "ends") == "ends"


def test_compare_runs_methods_side_by_side(tmp_path, capsys):
    out = tmp_path / "cmp"
    rc = main(["compare", "--model", "tiny", "--dataset", "gsm8k", "--global-batch", "8", "--steps", "2",
               "--warmup", "0", "--methods", "fixed,dynamic", "--memory-limit", "24MiB", "--out", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    printed = captured.out
    steps = pd.read_csv(out / "steps.csv")
    cases = list(dict.fromkeys(steps["label"]))
    assert cases[:2] == ["fixed", "dynamic"] and all(c.startswith("fixed mbs=") for c in cases[2:])
    n = len(cases)
    assert n >= 3, "the hindsight search must try at least mbs 1 below the largest that fits"
    assert "steps: 100%" in captured.err and f"{2 * n}/{2 * n}" in captured.err     # the progress bar
    # on CPU the cases run round by round, the order rotated by one each round
    order = steps[["label", "step"]].apply(tuple, axis=1).tolist()
    assert order == [(c, 0) for c in cases] + [(cases[(i + 1) % n], 1) for i in range(n)]
    assert "dynamic x" in printed and "fixed-best (mbs" in printed and "the best other case" in printed
    summary = pd.read_csv(out / "summary.csv").set_index("case")
    used = steps.loc[steps["label"] == "fixed", "mbs"]
    auto = f"fixed (mbs {int(used.min())}{'' if used.nunique() == 1 else '-' + str(int(used.max()))})"
    assert summary.index[0] == auto                   # the largest mbs that fits, as each step chose it
    assert summary.loc[auto, "speedup_vs_fixed"] == pytest.approx(1.0)
    assert summary.loc["dynamic", "x_dynamic"] == pytest.approx(1.0)
    # the paired ratio: median over steps of dynamic's tokens/s over this case's, step by step
    dyn = steps[steps["label"] == "dynamic"].set_index("step")["tokens_per_s"]
    fix = steps[steps["label"] == "fixed"].set_index("step")["tokens_per_s"]
    assert summary.loc[auto, "x_dynamic"] == pytest.approx((dyn / fix).median())
    # throughput is total real tokens over total step time
    rows = steps[steps["label"] == "dynamic"]
    assert summary.loc["dynamic", "tokens_per_s"] == pytest.approx(rows["real_tokens"].sum() / rows["step_s"].sum())
    best = summary[summary.index.str.startswith("fixed-best")]
    fixed_rows = summary[summary["method"] == "fixed"]
    assert len(best) == 1 and best["tokens_per_s"].iloc[0] == fixed_rows["tokens_per_s"].max()
    assert {"distinct_shapes", "new_shapes"} <= set(steps.columns)
    assert (steps["new_shapes"] <= steps["distinct_shapes"]).all()
    assert (summary["peak_over_limit"] <= 1.0).all()
    assert (summary["padding_fraction"] >= 0).all()
    assert set(steps["method"]) == {"fixed", "dynamic"}
    assert set(steps.loc[steps["method"] == "dynamic", "reorder"]) == {"search"}
    for png in ("throughput.png", "gantt_fixed_measured.png", "gantt_dynamic_predicted.png"):
        assert (out / png).stat().st_size > 1000
    # the replay of every step's prediction from these tables: studies/test_studies.py (the calibration study)


def test_compare_on_one_rank_with_virtual_stages(tmp_path, capsys):
    """``--virtual 2``: both stages on one rank (one GPU), interleaved; the rank's peak, states
    of both stages included, stays under the limit."""
    out = tmp_path / "cmp1"
    rc = main(["compare", "--model", "tiny", "--dataset", "gsm8k", "--global-batch", "8", "--steps", "1",
               "--warmup", "0", "--methods", "fixed,dynamic", "--memory-limit", "64MiB", "--virtual", "2",
               "--device", "cpu", "--sequential", "--no-fixed-best", "--out", str(out)])
    assert rc == 0
    steps = pd.read_csv(out / "steps.csv")
    assert steps["method"].tolist() == ["fixed", "dynamic"]          # --sequential: one method after another
    assert set(steps["schedule"]) == {"interleaved"} and set(steps["virtual"]) == {2}
    assert set(steps["world_size"]) == {1}
    mem = pd.read_csv(out / "memory.csv")
    assert (mem["peak_bytes"] <= mem["limit_bytes"]).all()
    with pytest.raises(SystemExit):
        main(["compare", "--virtual", "2", "--device", "tpu"])
