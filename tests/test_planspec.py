"""``PlanSpec`` (the settings of a planning step, passed whole), ``Predictions`` (typed
``Plan.predictions``), and the one replica helper: built once by RunConfig, Planner and the CLI,
recorded in the plan and read back from its JSON; the earlier keyword form plans the same."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dynmb
from dynmb.cli.plan import plan_spec
from dynmb.core.config import ModelConfig, PipelineConfig, PlanSpec, RunConfig
from dynmb.costmodel import get_cost_model
from dynmb.memory.model import MemoryModel
from dynmb.packing import pack
from dynmb.planning import plan_step, predict_replicas, replica_schedules, replicas_of, stitch
from dynmb.core.predictions import Predictions
from dynmb.core.types import Plan
from dynmb.costmodel.loader import Models

TINY = ModelConfig.preset("tiny")
LIMIT = 64 * 2**20


def _models(p: int = 2):
    return get_cost_model(None, TINY, p), MemoryModel.analytic(TINY, p)


def _lengths(n: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(16, 300, size=n)


@pytest.mark.parametrize("bad,match", [
    (dict(num_stages=0), "num_stages"), (dict(num_stages=3, virtual=2), "multiple of virtual"),
    (dict(memory_limit_bytes=0), "memory_limit_bytes"), (dict(dp=0), "dp and mbs"), (dict(mbs=0), "dp and mbs"),
    (dict(round_to=0), "round_to"), (dict(round_to=1.5), "round_to"),
    (dict(oversize="shrink"), "oversize"), (dict(recompute="sometimes"), "recompute"),
    (dict(attention="sparse"), "attention"), (dict(method=""), "method"),
])
def test_spec_checks_its_fields(bad, match):
    with pytest.raises(ValueError, match=match):
        PlanSpec(**bad)


def test_spec_is_frozen_and_keyword_only():
    spec = PlanSpec()
    with pytest.raises(AttributeError):
        spec.method = "fixed"                           # type: ignore[misc]
    with pytest.raises(TypeError):
        PlanSpec("dynamic")                             # type: ignore[misc]


@settings(max_examples=40, deadline=None)
@given(method=st.sampled_from(["fixed", "sorted", "packed", "dynamic"]), dp=st.sampled_from([1, 2]),
       round_to=st.sampled_from([1, 8, 64]), mbs=st.one_of(st.none(), st.integers(1, 4)),
       kind=st.sampled_from(["gpipe", "1f1b", "memory-aware"]))
def test_spec_round_trips_through_dict_and_plan_json(method, dp, round_to, mbs, kind):
    spec = PlanSpec(method=method, dp=dp, round_to=round_to, mbs=mbs, schedule_kind=kind, memory_limit_bytes=LIMIT,
                    attention="auto")
    assert PlanSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    plan = Plan((), method, 2, LIMIT, 0, spec=spec)
    assert Plan.from_json(plan.to_json()).spec == spec


def test_run_config_builds_the_spec_from_its_fields():
    run = RunConfig(model=replace(TINY, attention="dense"),
                    pipeline=PipelineConfig(num_stages=4, virtual=2, schedule="interleaved", reorder="ends",
                                            memory_limit_bytes=LIMIT),
                    method="packed", mbs=2, dp=2, pack_len=512, round_to=16, oversize="drop", recompute="auto")
    assert run.plan_spec == PlanSpec(method="packed", num_stages=4, virtual=2, schedule_kind="interleaved",
                                     reorder="ends", memory_limit_bytes=LIMIT, dp=2, mbs=2, pack_len=512, round_to=16,
                                     oversize="drop", recompute="auto", attention="dense")


def test_cli_builds_the_spec_from_its_flags():
    args = argparse.Namespace(method="fixed", stages=2, schedule_kind="gpipe", memory_limit="64MiB", mbs=3, dp=1,
                              oversize="truncate", pack_len=None, round_to=8, recompute="never")
    assert plan_spec(args, TINY) == PlanSpec(method="fixed", num_stages=2, schedule_kind="gpipe",
                                             memory_limit_bytes=LIMIT, mbs=3, oversize="truncate", round_to=8,
                                             attention=TINY.attention)


@pytest.mark.parametrize("method,dp,reorder", [("dynamic", 1, "auto"), ("fixed", 2, "none"), ("packed", 1, "search"),
                                               ("token-budget", 2, "ends")])
def test_plan_records_its_spec_and_refuses_keyword_settings(method, dp, reorder):
    cm, mm = _models()
    spec = PlanSpec(method=method, memory_limit_bytes=LIMIT, dp=dp, reorder=reorder)
    plan, sched, sim = plan_step(_lengths(), spec, model_cfg=TINY, models=Models(cm, mm))
    assert plan.spec == spec
    again = Plan.from_json(plan.to_json())
    assert again.spec == spec and again.predictions == plan.predictions
    with pytest.raises(TypeError, match="dp"):               # the earlier keyword form is gone
        plan_step(_lengths(), spec, model_cfg=TINY, dp=2)
    with pytest.raises(TypeError, match="one PlanSpec"):
        plan_step(_lengths(), method, model_cfg=TINY)


def test_pack_takes_the_spec_only():
    cm, mm = _models()
    spec = PlanSpec(method="sorted", memory_limit_bytes=LIMIT, mbs=2)
    a = pack(_lengths(), spec, models=Models(cm, mm))
    b = pack(_lengths(), PlanSpec(method="sorted", num_stages=2, memory_limit_bytes=LIMIT, mbs=2), models=Models(cm, mm))
    assert a.digest() == b.digest() and a.spec == b.spec == spec
    assert a.predictions.est_makespan_s > 0 and len(a.predictions.pred_peak_bytes) == 2
    with pytest.raises(TypeError, match="one PlanSpec"):
        pack(_lengths(), "sorted", models=Models(cm, mm))


def test_planner_holds_one_spec():
    planner = dynmb.Planner(model=TINY, num_stages=2, memory_limit="64MiB", schedule="gpipe", dp=2, round_to=8)
    assert planner.spec.schedule_kind == "gpipe" and planner.schedule == "gpipe" and planner.dp == 2
    step = planner.plan(_lengths(), "fixed", reorder="none", mbs=2)
    assert step.plan.spec == planner.spec.with_(method="fixed", reorder="none", mbs=2)
    with pytest.raises(ValueError, match="recompute"):
        dynmb.Planner(model=TINY, recompute="sometimes")


def test_predictions_are_typed_and_read_as_a_mapping():
    p = Predictions(pred_step_s=1, pred_peak_bytes=np.array([3.0, 4.0]))
    assert p.pred_step_s == 1.0 and p.pred_peak_bytes == (3, 4)
    assert p["pred_peak_bytes"] == [3, 4] and dict(p) == {"pred_step_s": 1.0, "pred_peak_bytes": [3, 4]}
    assert "mean_bubble" not in p and p.get("mean_bubble", "none") == "none"
    with pytest.raises(KeyError):
        p["mean_bubble"]
    assert {**p, "plan_s": 2.0}["plan_s"] == 2.0
    with pytest.raises(ValueError, match="unknown field"):
        Predictions.from_dict({"pred_step": 1.0})
    assert Plan((), "fixed", 2, LIMIT, 0, predictions={"plan_s": 0.5}).predictions == Predictions(plan_s=0.5)


def test_replica_helpers_split_schedule_predict_and_stitch():
    cm, mm = _models()
    spec = PlanSpec(method="dynamic", memory_limit_bytes=LIMIT, dp=2)
    plan, sched0, _ = plan_step(_lengths(24, seed=3), spec, model_cfg=TINY, models=Models(cm, mm))
    replicas = replicas_of(plan)
    assert [r.num_microbatches for r in replicas] == [plan.num_microbatches // 2] * 2
    scheds = replica_schedules(replicas, spec, models=Models(cm, mm))
    assert scheds[0] == sched0
    predicted = predict_replicas(replicas, scheds, Models(cm, mm), plan.predictions)
    assert predicted.predictions.pred_step_s == pytest.approx(max(s.makespan_s for s in predicted.sims))
    assert predicted.predictions.pred_step_s == pytest.approx(plan.predictions.pred_step_s)
    peaks = np.max([s.peak_bytes for s in predicted.sims], axis=0)
    assert predicted.predictions.pred_peak_bytes == tuple(int(x) for x in peaks)
    back = stitch(plan, [r.with_order(list(range(r.num_microbatches))[::-1]) for r in replicas])
    assert back.replica_ids == plan.replica_ids
    assert [mb.seq_ids.tolist() for mb in back.microbatches[:len(replicas[0].microbatches)]] == \
        [mb.seq_ids.tolist() for mb in replicas[0].microbatches[::-1]]
