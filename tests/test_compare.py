"""`dynmb compare` end to end on 2 gloo ranks with the tiny model: tables, summary and plots."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from dynmb.cli import main
from dynmb.planning import reorder_for
from dynmb.runtime.worker import round_order

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
    cases = [c["label"] for c in json.loads((out / "spec.json").read_text())["cases"]]
    assert cases[:2] == ["fixed", "dynamic"] and all(c.startswith("fixed mbs=") for c in cases[2:])
    n = len(cases)
    assert n >= 3, "the hindsight search must try at least mbs 1 below the largest that fits"
    assert "steps: 100%" in captured.err and f"{2 * n}/{2 * n}" in captured.err     # the progress bar
    # on CPU the cases run round by round, each round in a fresh random order drawn from the recorded seed
    seed = json.loads((out / "spec.json").read_text())["order_seed"]
    assert json.loads((out / "verdict.json").read_text())["box"]["order_seed"] == seed
    order = steps[["label", "step"]].apply(tuple, axis=1).tolist()
    assert order == [(cases[i], k) for k in (0, 1) for i in round_order(n, k, seed)]
    assert (steps.groupby("step")["round_position"].apply(sorted) == [list(range(n))] * 2).all()
    assert "x_dynamic_ci_lo" in printed and "fixed-best (mbs" in printed and "the closest other case" in printed
    assert "95% interval" in printed and "load average" in printed
    summary = pd.read_csv(out / "summary.csv").set_index("case")
    # every row of every table names its case as the summary does; the summary joins on it
    for table in ("steps", "actions", "memory", "runs"):
        assert set(pd.read_csv(out / f"{table}.csv")["case"]) <= set(summary.index)
    assert set(steps["case"]) == {c for c in summary.index if "-best" not in c}
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


@pytest.mark.slow
def test_compare_repeats_pair_within_each_repeat_and_measure_the_noise(tmp_path, capsys):
    out = tmp_path / "rep"
    rc = main(["compare", "--model", "tiny", "--dataset", "gsm8k", "--global-batch", "8", "--steps", "2",
               "--warmup", "0", "--methods", "fixed,dynamic", "--memory-limit", "24MiB", "--no-fixed-best",
               "--repeats", "2", "--order-seed", "5", "--out", str(out)])
    assert rc == 0
    steps = pd.read_csv(out / "steps.csv")
    assert sorted(set(steps["repeat"])) == [0, 1] and steps["run_id"].nunique() == 4
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["pairs"] == 4 and verdict["box"]["repeats"] == 2 and verdict["box"]["order_seed"] == 5
    assert verdict["box"]["repeat_noise"] >= 0 and "over 2 repeats" in capsys.readouterr().out
    # a second job into the same folder is refused; --append adds to it
    assert main(["compare", "--model", "tiny", "--out", str(out)]) == 2
