"""Fitting a memory model's coefficients to measurements (``MemoryModel.fit``).

``fit_memory_model(model, samples)`` fits the activation and transient coefficients of each
stage from measurements (``dynmb memory``, ``dynmb.runtime.meter.measure_stage_memory``) by
non-negative least squares on the relative error (an exhaustive active-set over the three
terms ``c0 + c1 b s + c2 b s^2``), reporting the error on held-out (b, s) points.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

__all__ = ["fit_memory_model"]


def fit_memory_model(model: Any, samples: Any, *, holdout: Any = None, holdout_frac: float = 0.25,
                     seed: int = 0) -> Any:
    """A new model of ``model``'s class, config and optimizer fitted to ``samples`` (DataFrame or
    dict of arrays with columns stage, rows, padded_len, act_bytes and optionally peak_bytes,
    state_bytes).

    Held-out points: ``holdout`` (boolean mask) or a random ``holdout_frac`` of the
    distinct (rows, padded_len) points; the fit uses the rest. ``report`` holds the
    held-out relative errors of act_bytes and peak_bytes (single microbatch).
    """
    cols = {k: np.asarray(samples[k]) for k in ("stage", "rows", "padded_len", "act_bytes")}
    stage = cols["stage"].astype(np.int64)
    b = cols["rows"].astype(np.float64)
    s = cols["padded_len"].astype(np.float64)
    act = cols["act_bytes"].astype(np.float64)
    has = lambda k: k in getattr(samples, "columns", samples)  # noqa: E731
    peak = np.asarray(samples["peak_bytes"], dtype=np.float64) if has("peak_bytes") else None
    state = model.state_bytes.copy()
    if has("state_bytes"):
        sb = np.asarray(samples["state_bytes"], dtype=np.float64)
        state = np.array([np.median(sb[stage == i]) if np.any(stage == i) else state[i] for i in range(model.num_stages)])
    if holdout is None:
        pts = np.unique(np.stack([b, s], 1), axis=0)
        rng = np.random.default_rng(seed)
        k = int(round(holdout_frac * len(pts))) if len(pts) >= 4 else 0
        held = pts[rng.choice(len(pts), size=k, replace=False)] if k else np.zeros((0, 2))
        holdout = np.array([any((bb == hb) and (ss == hs) for hb, hs in held) for bb, ss in zip(b, s)], dtype=bool)
    holdout = np.asarray(holdout, dtype=bool)
    train = ~holdout
    act_c, tr_c = model.act_coef.copy(), model.transient_coef.copy()
    for i in range(model.num_stages):
        sel = train & (stage == i)
        if not np.any(sel):
            continue
        act_c[i] = _nnls_rel(b[sel], s[sel], act[sel])
        if peak is not None:
            trv = peak[sel] - state[i] - act[sel]
            if np.all(trv > 0):
                tr_c[i] = _nnls_rel(b[sel], s[sel], trv)
    out = type(model)(model.model_cfg, model.num_stages, state, act_c, tr_c, optimizer=model.optimizer,
                      source="fitted")
    rep: dict[str, Any] = {"n_train": int(train.sum()), "n_heldout": int(holdout.sum())}
    for name, meas, pred in (("act", act, _at(out.act_coef, stage, b, s)),
                             ("peak", peak, None if peak is None else _at(out.act_coef, stage, b, s)
                              + _at(out.transient_coef, stage, b, s) + out.state_bytes[stage])):
        if meas is None:
            continue
        assert pred is not None                  # None only with peak None
        for part, sel in (("train", train), ("heldout", holdout)):
            if np.any(sel):
                err = np.abs(pred[sel] - meas[sel]) / meas[sel]
                rep[f"{name}_{part}_max_rel_err"] = float(err.max())
                rep[f"{name}_{part}_mean_rel_err"] = float(err.mean())
    out.report = rep
    return out


def _at(coef: np.ndarray, stage: np.ndarray, b: np.ndarray, s: np.ndarray) -> np.ndarray:
    """``coef[stage]`` (``[P, 3]`` coefficients) at microbatches (b, s), one per sample."""
    c = coef[stage]
    return c[:, 0] + c[:, 1] * b * s + c[:, 2] * b * s * s


def _nnls_rel(b: np.ndarray, s: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin_{c >= 0} sum(((c0 + c1 b s + c2 b s^2 - y) / y)^2) over every active set."""
    x = np.stack([np.ones_like(b), b * s, b * s * s], 1) / y[:, None]
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs, one = x / scale, np.ones(len(y))
    best, best_err = np.zeros(3), np.inf
    for k in (1, 2, 3):
        for cols in itertools.combinations(range(3), k):
            c, *_ = np.linalg.lstsq(xs[:, cols], one, rcond=None)
            if np.any(c < 0):
                continue
            err = float(np.sum((xs[:, cols] @ c - one) ** 2))
            if err < best_err - 1e-12:
                best_err, best = err, np.zeros(3)
                best[list(cols)] = c
    return best / scale
