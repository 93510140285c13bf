"""``GridCostModel``: the DynaPipe-style interpolation cost model (see ``dynmb.costmodel``).

Per (stage, op), ``scipy.interpolate.RegularGridInterpolator`` (bilinear) over (rows,
padded_len) of the measured time (medians over repeats; plain, unpacked rows). Cells missing
from the rectangle (token cap, held-out folds) are filled along rows at the same padded_len,
then along padded_len, linearly (inter- and extrapolating from the two nearest measured
cells). Extrapolation rule outside the grid: linear in each variable from the edge cell
(``fill_value=None``), i.e. time keeps the slope of the last grid interval -- exact in rows
(time is affine in rows at fixed length), an underestimate in padded_len beyond the grid
(attention grows like s^2); clipped at >= 0. Reached through ``dynmb.costmodel``
(``GridCostModel``, ``fit_cost_model(kind="grid")``, ``CostModel.load``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from scipy.interpolate import RegularGridInterpolator

from dynmb.config import ModelConfig
from dynmb.costmodel import CommModel, CostModel, _meta_from, point_medians

__all__ = ["GridCostModel"]


class GridCostModel(CostModel):
    """Per (stage, op) bilinear RegularGridInterpolator of time over (rows, padded_len); see module doc."""

    kind = "grid"

    def __init__(self, model_cfg: ModelConfig, num_stages: int,
                 grids: dict[tuple[int, str], tuple[np.ndarray, np.ndarray, np.ndarray]],
                 comm: CommModel | None = None, meta: dict[str, Any] | None = None) -> None:
        super().__init__(model_cfg, num_stages, comm, meta)
        self.grids = {(int(k[0]), k[1]): tuple(np.asarray(a, dtype=np.float64) for a in v) for k, v in grids.items()}
        missing = [(p, op) for p in range(num_stages) for op in ("F", "B") if (p, op) not in self.grids]
        if missing:
            raise ValueError(f"grid cost model lacks tables for (stage, op) {missing}: profile every stage")
        self._interp = {k: RegularGridInterpolator((r, s), t, method="linear", bounds_error=False, fill_value=None)
                        if len(r) > 1 and len(s) > 1 else None for k, (r, s, t) in self.grids.items()}

    def _predict(self, stage, op, b, s, a):
        r_ax, s_ax, t = self.grids[(stage, op)]
        f = self._interp[(stage, op)]
        if f is not None:
            return f(np.stack([b.ravel(), s.ravel()], axis=-1)).reshape(b.shape)
        if len(r_ax) == 1 and len(s_ax) == 1:  # one point: time proportional to tokens
            return t[0, 0] * b * s / (r_ax[0] * s_ax[0])
        return _lin(s, s_ax, t[0]) * b / r_ax[0] if len(r_ax) == 1 else _lin(b, r_ax, t[:, 0]) * s / s_ax[0]

    @classmethod
    def fit(cls, samples: pd.DataFrame, model_cfg: ModelConfig, num_stages: int, *, comm: CommModel | None = None,
            meta: dict[str, Any] | None = None, **_: Any) -> "GridCostModel":
        med = point_medians(samples)
        med = med[~med["packed"]]  # packed rows run at the same shapes; the grid keeps plain rows
        grids = {}
        for (p, op), g in med.groupby(["stage", "op"]):
            r_ax = np.unique(g["rows"].to_numpy(np.float64))
            s_ax = np.unique(g["padded_len"].to_numpy(np.float64))
            t = np.full((len(r_ax), len(s_ax)), np.nan)
            t[np.searchsorted(r_ax, g["rows"]), np.searchsorted(s_ax, g["padded_len"])] = g["time_s"]
            grids[(int(p), op)] = (r_ax, s_ax, _fill(r_ax, s_ax, t))
        return cls(model_cfg, num_stages, grids, comm, {**_meta_from(samples), **(meta or {})})

    def _params(self):
        return {"tables": [{"stage": p, "op": op, "rows": r.tolist(), "padded_len": s.tolist(), "time_s": t.tolist()}
                           for (p, op), (r, s, t) in sorted(self.grids.items())]}

    @classmethod
    def _from_parts(cls, cfg, p, comm, meta, params):
        grids = {(d["stage"], d["op"]): (d["rows"], d["padded_len"], d["time_s"]) for d in params["tables"]}
        return cls(cfg, p, grids, comm, meta)


def _lin(xq: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Piecewise-linear interpolation with linear extrapolation from the end segments."""
    xq = np.asarray(xq, dtype=np.float64)
    if len(x) == 1:
        return np.full(xq.shape, y[0])
    out = np.interp(xq, x, y)
    lo, hi = xq < x[0], xq > x[-1]
    out[lo] = y[0] + (xq[lo] - x[0]) * (y[1] - y[0]) / (x[1] - x[0])
    out[hi] = y[-1] + (xq[hi] - x[-1]) * (y[-1] - y[-2]) / (x[-1] - x[-2])
    return out


def _fill(r_ax: np.ndarray, s_ax: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Fill NaN cells linearly along rows per padded_len, then along padded_len per row; >= 0."""
    t = t.copy()
    for j in range(t.shape[1]):
        ok = ~np.isnan(t[:, j])
        if ok.any() and not ok.all():
            t[~ok, j] = _lin(r_ax[~ok], r_ax[ok], t[ok, j])
    for i in range(t.shape[0]):
        ok = ~np.isnan(t[i])
        if ok.any() and not ok.all():
            t[i, ~ok] = _lin(s_ax[~ok], s_ax[ok], t[i, ok])
    return np.maximum(t, 0.0)
