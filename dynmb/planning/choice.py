"""``dynamic``'s choice, robust to prediction error: leave the tuned baseline only for a gain the model can resolve.

A planner that picks the plan its cost model prices lowest picks the plans the model underprices (the
optimizer's curse): in a recorded compare the plans ``dynamic`` chose ran 1.10x their forward prediction
while ``balanced``'s ran 0.88x. So ``dynamic`` starts from the most robust candidate, the best-predicted
of the tuned token-budget plans (``balanced`` and ``token-budget`` at the budgets the fast estimate ranks
best: a per-step choice among budgets, where a tuned baseline fixes one for the run), and takes its own
packer's plan only when its predicted gain exceeds what the model's residuals on those shapes say it can
resolve:

    own  iff  pred(robust) - pred(own) > bound,
    bound = max over stages s of  sum_{op, b} |S_own[s, op, b] - S_rob[s, op, b]| * u[s, op, b]

``S[s, op, b]`` is a plan's predicted seconds of op on stage s in token bucket b, and ``u`` the model's
relative error there: the step's error that does not cancel between the two plans is the error on the
seconds they do not share, since a bucket priced wrong is priced wrong in both (a first version charged
``u`` on both whole steps, ``hypot(u t_own, u t_rob)``: in run 10 of the compare study that bound was 3-10x
every predicted margin and dynamic never ran its own plan). The max over stages: the step follows its
busiest stage, not their sum. ``u`` is the relative residual of the (op, token bucket)
(``bucket_uncertainty``): the online refit's on the job's recent actions (``meta["refit"]["residuals"]``,
``dynmb.costmodel.refit``); before any (``dynmb plan``, a run's first step) the fit's held-out MAPE of its
chosen form per (stage, op) (``meta["form_cv_mape"]``); a model with neither (the analytic and GPU models of
simulated studies) says nothing about its error, so its prediction decides (bound 0, the fastest predicted
plan). ``plan_uncertainty`` is the seconds-weighted mean of ``u`` over a plan (a summary for reports).

``Choice`` is what the plan records (``meta["candidate"]``, ``pred_margin_s``, ``error_bound_s``,
``robust_candidate``) and the ``steps`` table carries (``plan_choice_fields``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dynmb.costmodel.refit import TOKEN_BUCKETS, token_bucket

__all__ = ["Choice", "plan_uncertainty", "error_bound", "choose_robust", "plan_choice_fields", "CHOICE_FIELDS"]

CHOICE_FIELDS = ("candidate", "pred_margin_s", "error_bound_s", "robust_candidate")
"""The ``Plan.meta`` keys (and ``steps`` columns) of the choice."""


@dataclass(frozen=True)
class Choice:
    """Which candidate planned the step: ``candidate`` (``"dynamic"``: the packer's own plan, else the
    robust one's name, ``balanced/d`` or ``token-budget/d``), ``pred_margin_s`` (the robust candidate's
    predicted step minus the own plan's: positive when the own plan is predicted faster),
    ``error_bound_s`` (the margin it needed), ``robust_candidate`` (the best tuned baseline)."""

    candidate: str
    pred_margin_s: float | None
    error_bound_s: float | None
    robust_candidate: str | None

    def meta(self) -> dict[str, Any]:
        return {"candidate": self.candidate, "pred_margin_s": self.pred_margin_s,
                "error_bound_s": self.error_bound_s, "robust_candidate": self.robust_candidate}


def _residuals(cost_model: Any, stage: int, op: str) -> np.ndarray:
    """Relative residual per token bucket of ``op`` on ``stage`` (module doc)."""
    meta = getattr(cost_model, "meta", None) or {}
    prior = 0.0                                     # no measured error: the prediction decides
    cv = (meta.get("form_cv_mape") or {}).get(f"{stage}{op}")
    params = getattr(cost_model, "params", {})
    if cv and (stage, op) in params and params[(stage, op)][0] in cv:
        prior = float(cv[params[(stage, op)][0]])
    refit = ((meta.get("refit") or {}).get("residuals") or {}).get(op)
    if not refit:
        return np.full(len(TOKEN_BUCKETS) + 1, prior)
    known = [v for v in refit if v is not None]
    return np.array([v if v is not None else max(known) for v in refit])


def bucket_seconds(cost_model: Any, plan: Any) -> np.ndarray:
    """``S[stage, op, bucket]``: the plan's predicted seconds of F and B per stage and token bucket."""
    costs = cost_model.plan_costs(plan, ops=("F", "B"))
    stages = costs["F"].shape[0]
    out = np.zeros((stages, 2, len(TOKEN_BUCKETS) + 1))
    if plan.num_microbatches == 0:
        return out
    shapes = plan.shapes()
    bucket = token_bucket(shapes[:, 0] * shapes[:, 1])
    for k, op in enumerate(("F", "B")):
        for stage in range(stages):
            np.add.at(out[stage, k], bucket, costs[op][stage])
    return out


def bucket_uncertainty(cost_model: Any, stages: int) -> np.ndarray:
    """``u[stage, op, bucket]``: the model's relative error of op on stage in each token bucket (module doc)."""
    return np.array([[_residuals(cost_model, stage, op) for op in ("F", "B")] for stage in range(stages)])


def plan_uncertainty(cost_model: Any, plan: Any) -> float:
    """The relative uncertainty of ``plan``'s predicted step: its actions' residuals (by op and token
    bucket) weighted by their predicted seconds."""
    seconds = bucket_seconds(cost_model, plan)
    total = float(seconds.sum())
    return float((seconds * bucket_uncertainty(cost_model, seconds.shape[0])).sum()) / total if total > 0 else 0.0


def error_bound(cost_model: Any, own: Any, robust: Any) -> float:
    """The predicted margin the model can resolve between plans ``own`` and ``robust`` (module doc)."""
    diff = np.abs(bucket_seconds(cost_model, own) - bucket_seconds(cost_model, robust))
    return float((diff * bucket_uncertainty(cost_model, diff.shape[0])).sum(axis=(1, 2)).max())


def choose_robust(own: Any, alternatives: dict[str, Any], cost_model: Any) -> tuple[Any, Choice]:
    """``(the chosen (plan, schedule, sim), Choice)`` among ``own`` and the named ``alternatives`` (each a
    ``(plan, schedule, sim)`` that fits the limit); ``own`` is None when it does not fit (module doc)."""
    if not alternatives:
        return own, Choice("dynamic", None, None, None)
    name, robust = min(alternatives.items(), key=lambda kv: float(kv[1][0].predictions["pred_step_s"]))
    if own is None:
        return robust, Choice(name, None, None, name)
    t_own, t_rob = (float(r[0].predictions["pred_step_s"]) for r in (own, robust))
    bound = error_bound(cost_model, own[0], robust[0])
    margin = t_rob - t_own
    chosen = ("dynamic", own) if margin > bound else (name, robust)
    return chosen[1], Choice(chosen[0], margin, bound, name)


def plan_choice_fields(plan: Any) -> dict[str, Any]:
    """The ``steps`` columns of a plan's choice (None where the method does not choose)."""
    return {k: getattr(plan.meta, k) for k in CHOICE_FIELDS}
