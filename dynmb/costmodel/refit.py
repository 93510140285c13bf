"""Online refit: the poly cost model's coefficients per (stage, op) learned from a job's own measured actions.

A profile prices each shape on its own graph; a running pipeline runs at another speed, and that speed
depends on the shape (on the loaded development box measured / profiled was 0.91 for actions of at most
256 tokens and 0.52 above 4,096 in one compare), so one scale per (stage, op) leaves the big and the
small actions biased in opposite directions, and a planner that chooses by those prices picks the
shapes it underprices. The refit learns the coefficients themselves, on the prior's features
(``poly.features``: 1, computed tokens, attention work, rows, packed tokens), per (stage, op):

    c = L p * r,   r = argmin_{r >= 0}  sum_i w_i ((x_i . (L p * r) - t_i) / t_i)^2 + lam * sum_j (r_j - 1)^2

``p`` the prior's coefficients (the shipped or user fit: a term the prior does not have stays out), ``L``
the level, ``sum_i w_i t_i / sum_i w_i x_i . p`` (how fast the machine runs this (stage, op) now: learned
freely, so a host several times slower than its profile is followed at once, while the ridge keeps the
shape, the ratios between the terms, near the prior's unless the actions say otherwise),
``t_i`` an action's measured seconds (``end_s - start_s``: what the runtime's actions take, per-action
overhead included), ``w_i = 0.5 ** (age_i / half_life_steps)`` (age: history steps since it ran, so
recent steps weigh most and a drifting machine is followed), ``lam = prior_weight`` (the prior counts as
that many fresh actions per coefficient: a term the job's shapes do not exercise keeps its prior value).
It is solved as one non-negative least squares (``scipy.optimize.nnls``) on the rows stacked with the
prior's. ``I`` / ``W`` keep their split of ``B`` (``costmodel.split``).

``job_refit(prior, history)`` is what a run plans its next step with: every step of the job's history
(every case of a ``dynmb compare`` on this machine, in the order they ran), so step k is planned with
what steps before k taught. The refit model's ``meta["refit"]`` carries its ``version`` (the history
steps it learned from; 0 is the prior), and ``residuals``: per op, the weighted relative RMS of the
refit on the actions of each token bucket (``TOKEN_BUCKETS``), which ``dynamic``'s robust choice reads
(``dynmb.costmodel.residuals``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import pandas as pd
from scipy.optimize import nnls

from dynmb.costmodel.poly import FittedCostModel, features

__all__ = ["RefitSettings", "TOKEN_BUCKETS", "token_bucket", "refit_cost_model", "job_refit", "refit_actions"]

TOKEN_BUCKETS = (256, 1024, 4096)
"""Bucket edges in computed tokens (rows x padded_len): <= 256, <= 1,024, <= 4,096, above."""


def token_bucket(tokens: Any) -> np.ndarray:
    """The ``TOKEN_BUCKETS`` bucket (0..3) of each action's computed tokens."""
    return np.searchsorted(np.asarray(TOKEN_BUCKETS), np.asarray(tokens, dtype=np.float64), side="left")


@dataclass(frozen=True, kw_only=True)
class RefitSettings:
    """How the online refit weighs what it saw against the prior."""

    half_life_steps: float = 8.0
    """History steps after which an action weighs half (a compare's round of cases is ~10-16 steps)."""
    prior_weight: float = 1.0
    """The prior's pull per coefficient, in fresh actions."""
    min_actions: int = 4
    """A (stage, op) refits once this many of its actions were measured; else it keeps the prior."""

    def __post_init__(self) -> None:
        if not self.half_life_steps > 0 or not self.prior_weight > 0 or self.min_actions < 1:
            raise ValueError(f"bad refit settings {self}: half_life_steps and prior_weight must be > 0, "
                             f"min_actions >= 1")


def refit_actions(history_frames: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """The F / B actions of history steps (oldest first) with ``age`` (steps since) and ``time_s`` (measured)."""
    n = len(history_frames)
    parts = [f.loc[f["op"].isin(("F", "B")), ["stage", "op", "batch", "padded_len", "attn_work", "start_s", "end_s"]]
             .assign(age=n - 1 - i) for i, f in enumerate(history_frames) if len(f)]
    if not parts:
        return pd.DataFrame(columns=["stage", "op", "batch", "padded_len", "attn_work", "time_s", "age"])
    out = pd.concat(parts, ignore_index=True)
    out["time_s"] = (out["end_s"] - out["start_s"]).astype(float)
    return out[out["time_s"] > 0].drop(columns=["start_s", "end_s"])


def _solve(form: str, prior: np.ndarray, g: pd.DataFrame, settings: RefitSettings) -> tuple[np.ndarray, np.ndarray]:
    """Coefficients of one (stage, op) and the relative residuals of its actions (module doc)."""
    b, s, a, t = (g[c].to_numpy(np.float64) for c in ("batch", "padded_len", "attn_work", "time_s"))
    x = features(form, b, s, a)
    weight = 0.5 ** (g["age"].to_numpy(np.float64) / settings.half_life_steps)
    level = float(np.sum(weight * t) / max(np.sum(weight * (x @ prior)), 1e-300))   # the machine's speed now
    prior = prior * level if np.isfinite(level) and level > 0 else prior
    w = np.sqrt(weight)
    live = np.flatnonzero(prior > 0)
    design = x[:, live] * prior[live] / t[:, None] * w[:, None]
    lam = np.sqrt(settings.prior_weight)
    lhs = np.vstack([design, lam * np.eye(len(live))])
    rhs = np.concatenate([w, np.full(len(live), lam)])
    ratio, _ = nnls(lhs, rhs)
    coef = prior.copy()
    coef[live] = prior[live] * ratio
    return coef, (x @ coef - t) / t


def refit_cost_model(prior: FittedCostModel, actions: pd.DataFrame, *, version: int,
                     settings: RefitSettings = RefitSettings()) -> FittedCostModel:
    """``prior`` refit on ``actions`` (``refit_actions``' columns); ``version``: the history steps they
    came from. Runtime calibration (scale, overhead) is not carried over: the refit replaces it."""
    params = dict(prior.params)
    resid: dict[str, list[np.ndarray]] = {}
    weights: dict[str, list[np.ndarray]] = {}
    buckets: dict[str, list[np.ndarray]] = {}
    for (stage, op), g in actions.groupby(["stage", "op"]):
        key = (int(stage), str(op))
        if key not in params or len(g) < settings.min_actions:
            continue
        form, coef = params[key]
        new, err = _solve(form, np.asarray(coef, dtype=np.float64), g, settings)
        params[key] = (form, new)
        resid.setdefault(str(op), []).append(err)
        weights.setdefault(str(op), []).append(0.5 ** (g["age"].to_numpy(np.float64) / settings.half_life_steps))
        buckets.setdefault(str(op), []).append(token_bucket(g["batch"].to_numpy() * g["padded_len"].to_numpy()))
    residuals = {op: _bucket_rms(np.concatenate(resid[op]), np.concatenate(weights[op]), np.concatenate(buckets[op]))
                 for op in resid}
    meta = {**prior.meta, "refit": {"version": int(version), "actions": int(len(actions)), "residuals": residuals,
                                    "half_life_steps": settings.half_life_steps,
                                    "prior_weight": settings.prior_weight}}
    out = FittedCostModel(prior.model_cfg, prior.num_stages, params, prior.comm, meta)
    out.prefix_scale = dict(prior.prefix_scale)
    return out


def _bucket_rms(err: np.ndarray, w: np.ndarray, bucket: np.ndarray) -> list[float | None]:
    """Weighted relative RMS per token bucket (None: no action there)."""
    out: list[float | None] = []
    for k in range(len(TOKEN_BUCKETS) + 1):
        on = bucket == k
        out.append(float(np.sqrt(np.sum(w[on] * err[on] ** 2) / np.sum(w[on]))) if on.any() else None)
    return out


def job_refit(prior: Any, history: Sequence[Any], *, settings: RefitSettings = RefitSettings()) -> Any:
    """The cost model a run plans its next step with (module doc): ``prior`` refit on the actions of
    every step of ``history`` (``CalibrationStep``s, oldest first); ``prior`` itself when it is not a
    poly model or there is no history."""
    if not isinstance(prior, FittedCostModel) or not history:
        return prior
    actions = refit_actions([h.actions for h in history])
    if actions.empty:
        return prior
    return refit_cost_model(prior, actions, version=len(history), settings=settings)

