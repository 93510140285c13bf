"""The one loader of cost and memory models (``dynmb.costmodel.loader``): one batch and one set of settings
give one plan from the command line and the API; a plan records the models it was made with."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace

import numpy as np
import pytest

import dynmb
from dynmb.cli import main
from dynmb.core.config import model_config
from dynmb.costmodel.analytic import AnalyticCostModel
from dynmb.costmodel.loader import Models, PredictionModels, load_models, model_digest, models_record, shipped_cost_model_path
from dynmb.costmodel.standin import StandInModelWarning, reset_stand_in_warnings
from dynmb.core.types import Plan
from dynmb.data import load_trace, sample_batch


def test_shipped_fit_file_and_stand_in_are_resolved_in_that_order(tmp_path):
    cfg = model_config("small")
    shipped = load_models(cfg, 2)
    assert isinstance(shipped, PredictionModels) and shipped.cost_source == "shipped"
    assert shipped.cost_path == shipped_cost_model_path("small", 2) and shipped.cost.kind == "poly"
    path = tmp_path / "cost.json"
    AnalyticCostModel(cfg, 2, flops_per_s=1e11).save(path)
    from_file = load_models(cfg, 2, cost=str(path))
    assert from_file.cost_source == "file" and from_file.cost.flops_per_s == 1e11
    reset_stand_in_warnings()
    with pytest.warns(StandInModelWarning, match="dynmb profile"):          # no fit shipped for 3 stages
        stand_in = load_models(cfg, 3)
    assert stand_in.cost_source == "stand-in" and stand_in.stand_ins == ("cost",)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StandInModelWarning)                 # said once
        load_models(cfg, 3)


def test_digest_changes_with_calibration():
    models = load_models(model_config("small"), 2)
    rec = models_record(models)
    assert not rec["cost"]["calibrated"] and rec["cost"]["version"] == 0
    scaled = models.cost.with_scale({"F": [1.2, 1.0]})
    assert model_digest(scaled) != rec["cost"]["digest"] and models_record(Models(scaled, models.memory))["cost"]["calibrated"]


@pytest.mark.parametrize("method", ["dynamic", "balanced"])
def test_plan_command_and_planner_give_one_plan(method, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--dataset", "sharegpt", "--global-batch", "32", "--stages", "2", "--memory-limit", "1GiB",
                 "--method", method, "--json", "-o", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    batch = sample_batch(load_trace("sharegpt"), 32, 0, step=0)
    step = dynmb.Planner(model="small", num_stages=2, memory_limit="1GiB").plan(batch, method=method)
    cli_plan = Plan.load(out)
    assert summary["num_microbatches"] == step.plan.num_microbatches
    assert summary["pred_step_s"] == pytest.approx(step.plan.predictions["pred_step_s"], rel=1e-12)
    assert [list(mb.seq_ids) for mb in cli_plan.microbatches] == [list(mb.seq_ids) for mb in step.plan.microbatches]
    assert cli_plan.meta["models"]["cost"]["digest"] == step.plan.meta["models"]["cost"]["digest"]
    assert cli_plan.meta["models"]["memory"]["digest"] == step.plan.meta["models"]["memory"]["digest"]


def test_plan_consumers_refuse_models_of_another_digest(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--dataset", "sharegpt", "--global-batch", "8", "--stages", "2", "--method", "balanced",
                 "-o", str(out)]) == 0
    plan = Plan.load(out)
    models = plan.meta["models"]
    models["cost"]["digest"] = "0" * 64
    bad = tmp_path / "bad.json"
    Plan.from_dict({**plan.to_dict(), "meta": {**plan.meta, "models": models}}).save(bad)
    assert main(["simulate", "--plan", str(out), "--schedule", str(_schedule(out, tmp_path)), "--json"]) == 0
    capsys.readouterr()
    assert main(["simulate", "--plan", str(bad), "--schedule", str(_schedule(out, tmp_path)), "--json"]) == 2
    assert "cost model of digest 000000000000" in capsys.readouterr().err


def _schedule(plan_path, tmp_path):
    sched = tmp_path / "s.csv"
    assert main(["schedule", "--plan", str(plan_path), "--kind", "1f1b", "-o", str(sched)]) == 0
    return sched


@pytest.mark.parametrize("cost", [None, "analytic"])
def test_plan_schedule_simulate_predict_one_step(cost, tmp_path, capsys):
    """plan -> schedule -> simulate with the plan's own models (the shipped fit, or the stand-in asked for by
    name, where a fit is shipped): the simulated makespan is the plan's pred_step_s."""
    out, sched = tmp_path / "plan.json", tmp_path / "s.csv"
    flags = ["--cost-model", cost] if cost else []
    assert main(["plan", "--dataset", "sharegpt", "--global-batch", "16", "--stages", "2", "--method", "dynamic",
                 "-o", str(out), *flags]) == 0
    plan = Plan.load(out)
    assert plan.meta["models"]["cost"]["kind"] == (cost or "poly")
    assert main(["schedule", "--plan", str(out), "--kind", "1f1b", "-o", str(sched)]) == 0
    capsys.readouterr()
    assert main(["simulate", "--plan", str(out), "--schedule", str(sched), "--json"]) == 0
    sim = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sim["makespan_s"] == pytest.approx(plan.predictions["pred_step_s"], rel=1e-9)


def test_a_plan_run_refuses_models_of_another_digest(tmp_path):
    from dynmb.core.config import PipelineConfig, RunConfig
    from dynmb.runtime.spec import RunSpec

    step = dynmb.Planner(model="small", num_stages=2).plan(np.array([100, 200, 300, 400]), method="balanced")
    path = tmp_path / "plan.json"
    step.plan.save(path)
    cfg = RunConfig(model=model_config("small"), pipeline=PipelineConfig(num_stages=2, memory_limit_bytes=2**30),
                    method="balanced",
                    global_batch=4, dataset="sharegpt")
    RunSpec.create(cfg, tmp_path / "ok", plan=str(path)).check()              # the shipped fit: the plan's
    other = tmp_path / "cost.json"
    AnalyticCostModel(model_config("small"), 2, flops_per_s=1e11).save(other)
    with pytest.raises(ValueError, match="cost model of digest"):
        RunSpec.create(replace(cfg, cost_model=str(other)), tmp_path / "bad", plan=str(path)).check()
