"""The cost-model kinds and the functions that make one: load, get, fit, cross-validate.

``COST_MODEL_KINDS`` maps each kind to its class (``analytic``: ``AnalyticCostModel``,
``poly``: ``FittedCostModel``, ``grid``: ``GridCostModel``; ``FIT_KINDS`` the two fitted from
samples). ``CostModel.load(path)`` reads any kind; ``get_cost_model(path,
cfg, P)`` loads and checks a file against the config and stage split, or returns the analytic
stand-in without one; ``fit_cost_model(samples, cfg, P, kind)`` fits ``poly`` or ``grid`` (the
P2P model from the ``op == "comm"`` rows when there are any); ``kfold_error`` is the held-out
MAPE of a kind: points (rows, padded_len, attn_work) split in k folds, each predicted by a
model fitted on the others. This module sits above every kind, so none of them imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dynmb.core.config import ModelConfig

from dynmb.costmodel.analytic import AnalyticCostModel
from dynmb.costmodel.base import CommModel, CostModel
from dynmb.costmodel.grid import GridCostModel
from dynmb.costmodel.poly import FittedCostModel, fold_ids
from dynmb.costmodel.samples import point_medians

__all__ = ["COST_MODEL_KINDS", "FIT_KINDS", "get_cost_model", "fit_cost_model", "kfold_error"]

COST_MODEL_KINDS: dict[str, type[CostModel]] = {"analytic": AnalyticCostModel, "poly": FittedCostModel,
                                                "grid": GridCostModel}
"""Every cost-model kind, by the ``kind`` its files carry."""
FIT_KINDS: dict[str, type[FittedCostModel] | type[GridCostModel]] = {"poly": FittedCostModel, "grid": GridCostModel}
"""The kinds fitted from samples."""


def get_cost_model(path_or_none: str | Path | None, model_cfg: ModelConfig, num_stages: int) -> CostModel:
    """The fitted model at ``path`` (checked against the config) or the analytic stand-in."""
    if path_or_none is None:
        return AnalyticCostModel(model_cfg, num_stages)
    m = CostModel.load(path_or_none)
    m.check(model_cfg, num_stages)
    return m


def fit_cost_model(samples: pd.DataFrame, model_cfg: ModelConfig, num_stages: int, kind: str = "poly",
                   **kw: Any) -> CostModel:
    """Fit a ``poly`` (FittedCostModel) or ``grid`` (GridCostModel) model; comm from op=="comm" rows."""
    if kind not in ("poly", "grid"):
        raise ValueError(f"unknown cost model kind {kind!r}; expected poly or grid")
    stages = set(int(s) for s in samples.loc[samples["op"].isin(["F", "B"]), "stage"].unique())
    if stages != set(range(num_stages)):
        raise ValueError(f"samples cover stages {sorted(stages)}, expected 0..{num_stages - 1} for {num_stages} stages")
    kw.setdefault("comm", _comm_from(samples))
    return FIT_KINDS[kind].fit(samples, model_cfg, num_stages, **kw)


def kfold_error(samples: pd.DataFrame, kind: str = "poly", k: int = 5, *, model_cfg: ModelConfig | None = None,
                num_stages: int | None = None, seed: int = 0, by: tuple[str, ...] = ("stage", "op")) -> pd.DataFrame:
    """Held-out MAPE per ``by`` group (default (stage, op); add ``"packed"`` to split one-document
    from packed points): points (rows, padded_len, attn_work; all stages and repeats) split in k
    folds; each fold predicted by a model fitted on the others and compared with the point's
    median time. Columns: the ``by`` keys, mape, max_ape, n (points)."""
    med = point_medians(samples)
    num_stages = num_stages or int(med["stage"].max()) + 1
    cfg = model_cfg or ModelConfig()
    shape = ["rows", "padded_len", "attn_work"]
    pts = med[shape].drop_duplicates().reset_index(drop=True)
    pts["fold"] = fold_ids(len(pts), k, seed)
    med = med.merge(pts, on=shape).reset_index(drop=True)
    pred = np.empty(len(med))
    for f in np.unique(pts["fold"]):
        m = FIT_KINDS[kind].fit(med[med["fold"] != f], cfg, num_stages, seed=seed)
        for (p, op), g in med[med["fold"] == f].groupby(["stage", "op"]):
            pred[g.index] = m.predict(int(p), op, g["rows"].to_numpy(), g["padded_len"].to_numpy(),
                                      g["attn_work"].to_numpy())
    med["ape"] = np.abs(pred - med["time_s"]) / med["time_s"]
    return med.groupby(list(by), as_index=False).agg(mape=("ape", "mean"), max_ape=("ape", "max"), n=("ape", "size"))


def _comm_from(samples: pd.DataFrame) -> CommModel | None:
    if "op" not in samples or not (samples["op"] == "comm").any():
        return None
    c = samples[samples["op"] == "comm"].groupby("nbytes", as_index=False)["time_s"].median()
    return CommModel.fit(c["nbytes"], c["time_s"])
