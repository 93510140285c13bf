"""``GridCostModel`` ("grid"): the DynaPipe-style interpolation cost model.

Per (stage, op), ``scipy.interpolate.RegularGridInterpolator`` (bilinear) over (rows,
padded_len) of the measured time (medians over repeats; one-document rows). Cells missing
from the rectangle (token cap, held-out folds) are filled along rows at the same padded_len:
linearly between the two nearest measured rows, and beyond the measured rows in proportion to
rows from the nearest measured cell (linear extrapolation from two noisy neighbours can go to
~0 or double); columns with no measured cell are then filled along padded_len, linearly.
Extrapolation rule outside the grid: linear in each variable from the edge cell (``fill_value=None``),
i.e. time keeps the slope of the last grid interval -- exact in rows (time is affine in rows at
fixed length); beyond the longest padded_len the attention the slope misses (it grows like s^2) is
added back by the document correction below; below the shortest measured padded_len the time is held at that length's (fixed
costs dominate there, and a line through two noisy short points reached 0 s for many short rows);
clipped at >= 0. Reached through ``dynmb.costmodel``
(``GridCostModel``, ``fit_cost_model(kind="grid")``, ``CostModel.load``, which refuses a table
with unordered axes, a wrong shape, or times that fall as padded_len grows).

Documents. The table is indexed by shape only, as DynaPipe's is, so it cannot see how many
documents a row holds; its cells are one-document rows (attention work ``b * s^2``). A packed
microbatch of attention work ``a < b * s^2`` gets a linear correction per (stage, op):

    t(b, s, a) = table(b, s) - k * (b * s^2 - a)

Beyond the longest measured padded_len ``s_e`` the table's linear extrapolation holds the attention
work of the last interval's secant, not ``b * s^2``, so the correction is taken against what the
table holds there: ``t(b, s, a) = table(b, s) + k * (a - A_tab(b, s))`` with ``A_tab = b * s^2`` up to
``s_e`` and ``b * (s_e^2 + (s_e + s_p)(s - s_e))`` beyond it (``s_p`` the padded_len before ``s_e``):
a one-document row past the grid gains the attention the linear extrapolation misses, and a packed
row past it loses only what the table holds (subtracting ``k * (b s^2 - a)`` there drove long packed
rows to 0 s).

``k`` (seconds per unit of attention work, >= 0) is the relative-error least-squares slope of
``table(b, s) - t`` against ``b * s^2 - a`` over the packed points of the samples, or, when
there are none, the ``c2_attn`` coefficient of the poly ``quad`` form fitted to the table's
own one-document points. Files written before the correction have ``k = 0``: they ignore
documents and over-predict packed microbatches.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from scipy.interpolate import RegularGridInterpolator

from dynmb.core.config import ModelConfig

from dynmb.costmodel.base import CommModel, CostModel
from dynmb.costmodel.nnls import nnls_rel
from dynmb.costmodel.poly import features
from dynmb.costmodel.samples import point_medians, sample_meta

__all__ = ["GridCostModel"]


class GridCostModel(CostModel):
    """Per (stage, op) bilinear RegularGridInterpolator of time over (rows, padded_len); see module doc."""

    kind = "grid"

    def __init__(self, model_cfg: ModelConfig, num_stages: int,
                 grids: dict[tuple[int, str], tuple[np.ndarray, np.ndarray, np.ndarray]],
                 comm: CommModel | None = None, meta: dict[str, Any] | None = None,
                 attn_slope: dict[tuple[int, str], float] | None = None) -> None:
        super().__init__(model_cfg, num_stages, comm, meta)
        self.grids = {(int(k[0]), k[1]): tuple(np.asarray(a, dtype=np.float64) for a in v) for k, v in grids.items()}
        self.attn_slope = {k: max(0.0, float((attn_slope or {}).get(k, 0.0))) for k in self.grids}
        missing = [(p, op) for p in range(num_stages) for op in ("F", "B") if (p, op) not in self.grids]
        if missing:
            raise ValueError(f"grid cost model lacks tables for (stage, op) {missing}: profile every stage")
        self._interp = {k: RegularGridInterpolator((r, s), t, method="linear", bounds_error=False, fill_value=None)
                        if len(r) > 1 and len(s) > 1 else None for k, (r, s, t) in self.grids.items()}

    def _predict(self, stage, op, b, s, a):
        return self._table(stage, op, b, s) + self.attn_slope[(stage, op)] * (a - self._table_attn(stage, op, b, s))

    def _table_attn(self, stage: int, op: str, b: np.ndarray, s: np.ndarray) -> np.ndarray:
        """The attention work the table's value at (rows, padded_len) stands for: ``b * s^2`` up to
        the longest measured padded_len ``s_e``; beyond it the table goes on along its last interval
        ``[s_p, s_e]``, so its attention grows as that secant of ``s^2`` does: ``b * (s_e^2 + (s_e + s_p)
        * (s - s_e))`` (module doc)."""
        s_ax = self.grids[(stage, op)][1]
        if len(s_ax) < 2:
            return b * s * s
        s_e, s_p = float(s_ax[-1]), float(s_ax[-2])
        return b * np.where(s > s_e, s_e * s_e + (s_e + s_p) * (s - s_e), s * s)

    def _table(self, stage: int, op: str, b: np.ndarray, s: np.ndarray) -> np.ndarray:
        """The interpolated one-document time at (rows, padded_len); held at the shortest measured
        padded_len below it (module doc)."""
        r_ax, s_ax, t = self.grids[(stage, op)]
        if len(s_ax) > 1:
            s = np.maximum(s, s_ax[0])
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
        one_doc = med["attn_work"] == med["rows"] * med["padded_len"] ** 2
        grids = {}
        for (p, op), g in med[one_doc].groupby(["stage", "op"]):
            r_ax = np.unique(g["rows"].to_numpy(np.float64))
            s_ax = np.unique(g["padded_len"].to_numpy(np.float64))
            t = np.full((len(r_ax), len(s_ax)), np.nan)
            t[np.searchsorted(r_ax, g["rows"]), np.searchsorted(s_ax, g["padded_len"])] = g["time_s"]
            grids[(int(p), op)] = (r_ax, s_ax, _fill(r_ax, s_ax, t))
        model = cls(model_cfg, num_stages, grids, comm, {**sample_meta(samples), **(meta or {})})
        model.attn_slope = {k: _attn_slope(model, k, med[one_doc], med[~one_doc]) for k in grids}
        return model

    def _params(self):
        return {"tables": [{"stage": p, "op": op, "rows": r.tolist(), "padded_len": s.tolist(), "time_s": t.tolist(),
                            "attn_slope": self.attn_slope[(p, op)]}
                           for (p, op), (r, s, t) in sorted(self.grids.items())]}

    @classmethod
    def _from_parts(cls, cfg, p, comm, meta, params):
        for d in params["tables"]:
            _check_table(d)
        grids = {(d["stage"], d["op"]): (d["rows"], d["padded_len"], d["time_s"]) for d in params["tables"]}
        slopes = {(d["stage"], d["op"]): d.get("attn_slope", 0.0) for d in params["tables"]}
        return cls(cfg, p, grids, comm, meta, slopes)


def _check_table(d: dict[str, Any]) -> None:
    """Refuse a stored table whose axes are not positive and strictly increasing or whose
    ``time_s`` is not ``len(rows) x len(padded_len)`` (a file edited or written by another tool)."""
    where = f"table of stage {d['stage']} op {d['op']}"
    axes = {k: np.asarray(d[k], dtype=np.float64).reshape(-1) for k in ("rows", "padded_len")}
    for k, ax in axes.items():
        if ax.size == 0 or not np.all(ax > 0) or not np.all(np.diff(ax) > 0):
            raise ValueError(f"{where}: {k} {ax.tolist()} must be positive and strictly increasing")
    t = np.asarray(d["time_s"], dtype=np.float64)
    if t.shape != (axes["rows"].size, axes["padded_len"].size):
        raise ValueError(f"{where}: time_s is {'x'.join(map(str, t.shape)) or 'a scalar'}, expected "
                         f"{axes['rows'].size}x{axes['padded_len'].size} (rows x padded_len)")


def _attn_slope(model: GridCostModel, key: tuple[int, str], one_doc: pd.DataFrame, packed: pd.DataFrame) -> float:
    """Seconds per unit of attention work saved by packing, for ``key`` = (stage, op): fitted on
    the packed points (relative least squares of table - t against b*s^2 - a, >= 0), else the
    quad poly's c2_attn on the one-document points."""
    stage, op = key
    pk = packed[(packed["stage"] == stage) & (packed["op"] == op)]
    if len(pk):
        b, s, a, t = (pk[c].to_numpy(np.float64) for c in ("rows", "padded_len", "attn_work", "time_s"))
        saved_rel = (b * s * s - a) / t                                   # x / t
        excess_rel = (model._table(stage, op, b, s) - t) / t               # (table - t) / t
        return max(0.0, float(saved_rel @ excess_rel / (saved_rel @ saved_rel)))
    g = one_doc[(one_doc["stage"] == stage) & (one_doc["op"] == op)]
    if len(g) < 3:
        return 0.0
    b, s, t = (g[c].to_numpy(np.float64) for c in ("rows", "padded_len", "time_s"))
    return float(nnls_rel(features("quad", b, s), t)[2])


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
    """Fill NaN cells along rows per padded_len (linear inside the measured rows, proportional
    to rows outside), then along padded_len per row (linear); >= 0."""
    t = t.copy()
    for j in range(t.shape[1]):
        ok = ~np.isnan(t[:, j])
        if ok.any() and not ok.all():
            t[~ok, j] = _along_rows(r_ax[~ok], r_ax[ok], t[ok, j])
    for i in range(t.shape[0]):
        ok = ~np.isnan(t[i])
        if ok.any() and not ok.all():
            t[i, ~ok] = _lin(s_ax[~ok], s_ax[ok], t[i, ok])
    return np.maximum(t, 0.0)


def _along_rows(rq: np.ndarray, r: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Time at rows ``rq`` from measured (r, y): linear between measured rows, y * rq / r of
    the nearest measured row outside them."""
    out = np.interp(rq, r, y)
    lo, hi = rq < r[0], rq > r[-1]
    out[lo] = y[0] * rq[lo] / r[0]
    out[hi] = y[-1] * rq[hi] / r[-1]
    return out
