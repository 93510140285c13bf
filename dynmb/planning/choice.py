"""``dynamic``'s choice, robust to prediction error: leave the tuned baseline only for a gain the model can resolve.

A planner that picks the plan its cost model prices lowest picks the plans the model underprices (the
optimizer's curse): in a recorded compare the plans ``dynamic`` chose ran 1.10x their forward prediction
while ``balanced``'s ran 0.88x. So ``dynamic`` starts from the most robust candidate, the best-predicted
of the tuned token-budget plans (``balanced`` and ``token-budget`` at the budgets the fast estimate ranks
best: a per-step choice among budgets, where a tuned baseline fixes one for the run), and takes its own
packer's plan only when its predicted gain exceeds what the model's residuals on those shapes say it can
resolve:

    own  iff  pred(robust) - pred(own) > bound,   bound = sqrt((u(own) pred(own))^2 + (u(robust) pred(robust))^2)

where ``u(plan)`` is the plan's relative uncertainty: the mean, weighted by predicted seconds, of the
relative residual of each of its actions' (op, token bucket) (``plan_uncertainty``). The residuals are
the online refit's on the job's recent actions (``meta["refit"]["residuals"]``, ``dynmb.costmodel.refit``);
before any (``dynmb plan``, a run's first step) the fit's held-out MAPE of its chosen form per (stage, op)
(``meta["form_cv_mape"]``); a model with neither (the analytic and GPU models of simulated studies) says
nothing about its error, so its prediction decides (bound 0, the fastest predicted plan).

``Choice`` is what the plan records (``meta["candidate"]``, ``pred_margin_s``, ``error_bound_s``,
``robust_candidate``) and the ``steps`` table carries (``plan_choice_fields``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dynmb.costmodel.refit import TOKEN_BUCKETS, token_bucket

__all__ = ["Choice", "plan_uncertainty", "choose_robust", "plan_choice_fields", "CHOICE_FIELDS"]

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


def plan_uncertainty(cost_model: Any, plan: Any) -> float:
    """The relative uncertainty of ``plan``'s predicted step: its actions' residuals (by op and token
    bucket) weighted by their predicted seconds."""
    if plan.num_microbatches == 0:
        return 0.0
    costs = cost_model.plan_costs(plan, ops=("F", "B"))
    shapes = plan.shapes()
    bucket = token_bucket(shapes[:, 0] * shapes[:, 1])
    num, den = 0.0, 0.0
    for op in ("F", "B"):
        for stage in range(costs[op].shape[0]):
            sec = costs[op][stage]
            num += float((sec * _residuals(cost_model, stage, op)[bucket]).sum())
            den += float(sec.sum())
    return num / den if den > 0 else 0.0


def choose_robust(own: Any, alternatives: dict[str, Any], cost_model: Any) -> tuple[Any, Choice]:
    """``(the chosen (plan, schedule, sim), Choice)`` among ``own`` and the named ``alternatives`` (each a
    ``(plan, schedule, sim)`` that fits the limit); ``own`` is None when it does not fit (module doc)."""
    if not alternatives:
        return own, Choice("dynamic", None, None, None)
    name, robust = min(alternatives.items(), key=lambda kv: float(kv[1][0].predictions["pred_step_s"]))
    if own is None:
        return robust, Choice(name, None, None, name)
    t_own, t_rob = (float(r[0].predictions["pred_step_s"]) for r in (own, robust))
    bound = float(np.hypot(plan_uncertainty(cost_model, own[0]) * t_own,
                           plan_uncertainty(cost_model, robust[0]) * t_rob))
    margin = t_rob - t_own
    chosen = ("dynamic", own) if margin > bound else (name, robust)
    return chosen[1], Choice(chosen[0], margin, bound, name)


def plan_choice_fields(plan: Any) -> dict[str, Any]:
    """The ``steps`` columns of a plan's choice (None where the method does not choose)."""
    return {k: getattr(plan.meta, k) for k in CHOICE_FIELDS}
