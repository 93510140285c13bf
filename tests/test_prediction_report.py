"""What the compare shows about its predictions: the predicted Gantt is the plan that ran at the predictions it
was planned with (``report.plots.predicted_timeline``), and the summary carries each case's measured /
predicted step and action ratios (``report.analysis.summarise``)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import dynmb
from dynmb.data import load_trace, sample_batch
from dynmb.report.plots import gantt, predicted_timeline


@pytest.mark.parametrize("method", ["dynamic", "fixed", "balanced"])
def test_predicted_timeline_replays_the_plan_that_ran(method, tmp_path):
    """Actions recorded as a run records them (in each rank's order, ``pred_s`` the planned seconds, start
    times shifted as a real pipeline's would be): the replay's makespan is the plan's ``pred_step_s`` and its
    microbatches are the plan's."""
    planner = dynmb.Planner(model="small", num_stages=2, memory_limit="1GiB")
    step = planner.plan(sample_batch(load_trace("sharegpt"), 16, 0, step=1), method=method)
    tl = step.sim.timeline
    rng = np.random.default_rng(0)
    actions = tl.assign(pred_s=tl["end_s"] - tl["start_s"], dp_rank=0,
                        start_s=tl["start_s"] * 1.3 + rng.uniform(0, 1e-4, len(tl)))       # measured: slower
    shapes = tl.drop_duplicates("mb").sort_values("mb")
    comm = planner.cost_model.comm_s(shapes["batch"].to_numpy(), shapes["padded_len"].to_numpy())
    replay = predicted_timeline(actions, comm)
    assert replay["mb"].nunique() == step.plan.num_microbatches
    assert float(replay["end_s"].max()) == pytest.approx(step.plan.predictions["pred_step_s"], rel=1e-9)
    span = float(actions["start_s"].max()) * 2
    assert gantt(replay, str(tmp_path / "p.png"), span_s=span) == str(tmp_path / "p.png")


def test_summary_carries_measured_over_predicted_per_case():
    steps = pd.DataFrame({"run_id": ["a", "a", "b", "b"], "method": ["dynamic", "dynamic", "balanced", "balanced"],
                          "dataset": "x", "step": [0, 1, 0, 1], "warmup": False, "step_s": [2.0, 3.0, 1.0, 1.0],
                          "pred_step_s": [1.0, 1.0, 1.0, 2.0], "real_tokens": 10, "computed_tokens": 10,
                          "tokens_per_s": 1.0, "num_microbatches": 2})
    actions = pd.DataFrame({"run_id": ["a", "a", "b", "b"], "step": [0, 1, 0, 1], "start_s": 0.0,
                            "end_s": [1.0, 3.0, 0.5, 0.5], "pred_s": [1.0, 1.0, 1.0, 1.0]})
    out = dynmb.summarise({"steps": steps, "actions": actions}).reset_index().set_index("method")
    assert out.loc["dynamic", "step_ratio"] == pytest.approx(2.5)
    assert out.loc["balanced", "step_ratio"] == pytest.approx(0.75)
    assert out.loc["dynamic", "action_ratio"] == pytest.approx(2.0)
    assert out.loc["balanced", "action_ratio"] == pytest.approx(0.5)
