"""``dynamic``'s robust choice (``dynmb.planning.choice``): the tuned baseline unless the own plan's predicted
gain exceeds what the model's residuals on both plans' shapes can resolve; recorded in the plan."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import dynmb
from dynmb.core.config import model_config
from dynmb.costmodel.loader import load_models
from dynmb.costmodel.refit import TOKEN_BUCKETS
from dynmb.data import load_trace, sample_batch
from dynmb.planning.choice import choose_robust, plan_uncertainty


def _with_residuals(cost_model, value: float):
    """A copy of ``cost_model`` whose refit residuals are ``value`` in every bucket."""
    cm = copy.copy(cost_model)
    cm.meta = {**cost_model.meta, "refit": {"version": 1, "residuals": {
        op: [value] * (len(TOKEN_BUCKETS) + 1) for op in ("F", "B")}}}
    return cm


def _batch(step: int = 0) -> np.ndarray:
    return sample_batch(load_trace("sharegpt"), 32, 0, step=step)


def test_uncertainty_reads_the_residuals_then_the_fit_else_none():
    models = load_models(model_config("small"), 2)
    step = dynmb.Planner(model="small", num_stages=2, memory_limit="1GiB").plan(_batch(), method="balanced")
    assert plan_uncertainty(_with_residuals(models.cost, 0.2), step.plan) == pytest.approx(0.2)
    cv = plan_uncertainty(models.cost, step.plan)                # the shipped fit's held-out MAPE: 4.7%-5.7%
    assert 0.04 < cv < 0.06
    from dynmb.costmodel.analytic import AnalyticCostModel
    assert plan_uncertainty(AnalyticCostModel(model_config("small"), 2), step.plan) == 0.0   # says nothing


@pytest.mark.parametrize("step", [0, 1, 2])
def test_own_plan_only_beyond_the_bound(step):
    """Zero residuals: the fastest predicted plan; huge residuals: the robust one unless the own plan
    prices the same seconds per (stage, op, bucket) (a reordering: its errors cancel); always margin vs bound."""
    base = load_models(model_config("small"), 2).cost
    lengths = _batch(step)
    sure = dynmb.Planner(model="small", num_stages=2, cost_model=_with_residuals(base, 0.0)).plan(lengths).plan
    unsure = dynmb.Planner(model="small", num_stages=2, cost_model=_with_residuals(base, 5.0)).plan(lengths).plan
    for plan in (sure, unsure):
        assert plan.method == "dynamic"
        if plan.meta["candidate"] == "dynamic":
            assert plan.meta["pred_margin_s"] > plan.meta["error_bound_s"]
        else:
            assert plan.meta["candidate"] == plan.meta["robust_candidate"] == plan.meta["grouping"]
    if unsure.meta["error_bound_s"] > 1e-6:                      # ~0: the same microbatches in another order
        assert unsure.meta["candidate"] == unsure.meta["robust_candidate"]
    if sure.meta["pred_margin_s"] > 0:
        assert sure.meta["candidate"] == "dynamic" and sure.meta["error_bound_s"] == 0.0
    assert sure.predictions["pred_step_s"] <= unsure.predictions["pred_step_s"] + 1e-12


def test_choose_robust_without_alternatives_or_a_fitting_own_plan():
    step = dynmb.Planner(model="small", num_stages=2).plan(_batch(), method="balanced")
    triple = (step.plan, step.schedule, step.sim)
    cm = load_models(model_config("small"), 2).cost
    assert choose_robust(triple, {}, cm)[1].candidate == "dynamic"
    chosen, choice = choose_robust(None, {"balanced/4": triple}, cm)
    assert chosen is triple and choice.candidate == "balanced/4" and choice.pred_margin_s is None


def test_error_bound_charges_only_the_seconds_the_plans_do_not_share():
    """Identical plans: bound 0; uniform residual u: u times the busiest stage's summed |difference| per
    (op, bucket), never more than u times that stage's seconds of both plans."""
    from dynmb.planning.choice import bucket_seconds, error_bound
    cm = _with_residuals(load_models(model_config("small"), 2).cost, 0.2)
    planner = dynmb.Planner(model="small", num_stages=2, cost_model=cm)
    a = planner.plan(_batch(1), method="balanced").plan
    b = planner.plan(_batch(1), method="token-budget").plan
    assert error_bound(cm, a, a) == 0.0
    sa, sb = bucket_seconds(cm, a), bucket_seconds(cm, b)
    assert sa.sum() == pytest.approx(sum(float(v.sum()) for v in cm.plan_costs(a, ops=("F", "B")).values()))
    expected = 0.2 * np.abs(sa - sb).sum(axis=(1, 2)).max()
    assert error_bound(cm, a, b) == pytest.approx(expected)
    assert 0.0 < error_bound(cm, a, b) <= 0.2 * (sa + sb).sum(axis=(1, 2)).max()
