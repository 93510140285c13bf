"""The online refit of the poly cost model (``dynmb.costmodel.refit``): coefficients per (stage, op) learned
from measured actions, the fit as the prior, recent steps weighted most."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st

from dynmb.core.config import model_config
from dynmb.costmodel import CostModel
from dynmb.costmodel.calibration import CalibrationStep
from dynmb.costmodel.loader import is_calibrated, refit_version, shipped_cost_model_path
from dynmb.costmodel.poly import FORMS, FittedCostModel
from dynmb.costmodel.refit import RefitSettings, job_refit, refit_actions, refit_cost_model


def _prior() -> FittedCostModel:
    return CostModel.load(shipped_cost_model_path("small", 2))


def _truth(prior: FittedCostModel, factors: dict[str, float]) -> FittedCostModel:
    """``prior`` with each coefficient times its factor (by name)."""
    params = {}
    for key, (form, coef) in prior.params.items():
        params[key] = (form, np.array([c * factors.get(n, 1.0) for n, c in zip(FORMS[form], coef)]))
    return FittedCostModel(prior.model_cfg, prior.num_stages, params, prior.comm, prior.meta)


def _actions(model: FittedCostModel, rng: np.random.Generator, n: int, noise: float = 0.0) -> pd.DataFrame:
    """``n`` one-document actions per (stage, op) of random shapes, timed by ``model`` (x lognormal noise)."""
    rows = []
    for (stage, op) in model.params:
        b = rng.integers(1, 9, size=n)
        s = rng.integers(32, 2048, size=n)
        a = b * s * s
        t = model.predict(stage, op, b, s, a) * np.exp(rng.normal(0, noise, size=n))
        rows.append(pd.DataFrame({"stage": stage, "op": op, "batch": b, "padded_len": s, "attn_work": a,
                                  "start_s": 0.0, "end_s": t}))
    return pd.concat(rows, ignore_index=True)


def _mape(model: CostModel, frame: pd.DataFrame) -> float:
    err = [abs(float(model.predict(int(r.stage), r.op, r.batch, r.padded_len, r.attn_work)) - (r.end_s - r.start_s))
           / (r.end_s - r.start_s) for r in frame.itertuples()]
    return float(np.mean(err))


def test_refit_learns_the_shape_not_only_the_scale():
    """Truth: tokens 0.6x, attention 1.8x the prior: no one scale fits it; the refit does, held out."""
    prior = _prior()
    truth = _truth(prior, {"c1_tok": 0.6, "c2_attn": 1.8})
    rng = np.random.default_rng(0)
    train, test = _actions(truth, rng, 40, noise=0.02), _actions(truth, rng, 40)
    refit = refit_cost_model(prior, refit_actions([train]), version=1)
    assert _mape(refit, test) < 0.5 * _mape(prior, test)
    sharp = refit_cost_model(prior, refit_actions([train]), version=1, settings=RefitSettings(prior_weight=0.05))
    assert _mape(sharp, test) < 0.02                     # a weak prior: the truth, to the noise
    assert refit_version(refit) == 1 and is_calibrated(refit) and not is_calibrated(prior)
    assert set(refit.meta["refit"]["residuals"]) == {"F", "B"}


def test_a_term_the_actions_do_not_exercise_keeps_its_prior():
    prior = _prior()
    truth = _truth(prior, {"c1_tok": 0.7})
    train = _actions(truth, np.random.default_rng(1), 30)
    refit = refit_cost_model(prior, refit_actions([train]), version=1)
    checked = 0
    for key, (form, coef) in refit.params.items():
        assert form == prior.params[key][0]
        if "c4_packed_tok" in FORMS[form]:                  # no packed actions: the prior's value at the level
            g = train[(train["stage"] == key[0]) & (train["op"] == key[1])]
            level = g["end_s"].sum() / prior.predict(key[0], key[1], g["batch"], g["padded_len"], g["attn_work"]).sum()
            j = FORMS[form].index("c4_packed_tok")
            assert coef[j] == pytest.approx(prior.params[key][1][j] * level)
            checked += 1
    assert checked


@settings(max_examples=15, deadline=None)
@given(scale=st.floats(0.5, 2.0), seed=st.integers(0, 10_000))
def test_refit_is_non_negative_and_follows_the_recent_steps(scale, seed):
    prior = _prior()
    rng = np.random.default_rng(seed)
    old = _actions(prior, rng, 10)
    new = _actions(_truth(prior, {"c0": scale, "c1_tok": scale, "c2_attn": scale}), rng, 10)
    history = [CalibrationStep("a", old)] * 6 + [CalibrationStep("b", new)] * 6
    refit = job_refit(prior, history, settings=RefitSettings(half_life_steps=1.0, prior_weight=0.1))
    assert all(np.all(c >= 0) for _, c in refit.params.values())
    test = _actions(_truth(prior, {"c0": scale, "c1_tok": scale, "c2_attn": scale}), rng, 10)
    assert _mape(refit, test) < 0.1
    assert refit_version(refit) == 12


def test_no_history_or_another_kind_is_the_prior():
    prior = _prior()
    assert job_refit(prior, []) is prior
    from dynmb.costmodel.analytic import AnalyticCostModel
    analytic = AnalyticCostModel(model_config("small"), 2)
    assert job_refit(analytic, [CalibrationStep("a", _actions(prior, np.random.default_rng(0), 5))]) is analytic


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="half_life_steps"):
        RefitSettings(half_life_steps=0)


def test_a_host_several_times_slower_than_its_profile_is_followed_at_once():
    """The level is learned freely (the ridge keeps only the shape near the prior's): one step of a host
    5x slower than the profile prices the next within a few percent."""
    prior = _prior()
    slow = _truth(prior, {n: 5.0 for n in FORMS["quad_bp"]})
    rng = np.random.default_rng(3)
    refit = job_refit(prior, [CalibrationStep("a", _actions(slow, rng, 10))])
    assert _mape(refit, _actions(slow, rng, 20)) < 0.02


def test_a_run_plans_with_the_refit_poly_model_and_scales_another_kind():
    """``runtime.state.planning_model``: the poly prior refit (its version the history's length), the
    analytic stand-in scaled as before; neither changes the profile model it starts from."""
    from dynmb.costmodel.analytic import AnalyticCostModel
    from dynmb.runtime.state import planning_model

    prior = _prior()
    rng = np.random.default_rng(4)
    frames = [_actions(_truth(prior, {"c1_tok": 1.5}), rng, 8).assign(pred_s=lambda f: f["end_s"]) for _ in range(3)]
    history = [CalibrationStep(run, f) for run, f in zip(("a", "b", "a"), frames)]
    refit = planning_model(prior, history, "a", 2)
    assert refit_version(refit) == 3 and refit_version(prior) == 0 and is_calibrated(refit)
    analytic = AnalyticCostModel(model_config("small"), 2)
    scaled = planning_model(analytic, history, "a", 2)
    assert refit_version(scaled) == 0 and is_calibrated(scaled) and not is_calibrated(analytic)
