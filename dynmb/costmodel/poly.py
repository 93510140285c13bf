"""``FittedCostModel`` ("poly", the default kind): per (stage, op) a non-negative polynomial.

``t = c0 + c1*b*s + c2*a (+ c3*b) (+ c4*b*s*[a < b*s^2])`` (b rows, s padded_len, b*s the
tokens computed, a the attention work): a fixed cost, a per-computed-token cost (matmuls,
norms, the LM head), a cost per unit of attention work (QK^T and AV over each segment),
optionally a per-row cost and a per-token cost that only packed microbatches pay (their
document-causal path gathers the rows into length buckets and scatters them back; a
microbatch is packed exactly when a < b*s^2). ``FORMS`` are the allowed subsets of those
terms (``features`` builds their columns). Coefficients are non-negative and minimise the
*relative* squared error sum(((pred - t) / t)^2) (``nnls.nnls_rel``) over the per-point
medians of the samples (``samples.point_medians``). The form is chosen per (stage, op) by
k-fold held-out MAPE over points; a larger form must beat a smaller one by more than 2%
(relative) to be chosen, so the model stays explainable. Files written before the attention
work was a feature (quadratic coefficient ``c2_tok_len``) are refused with one line: refit them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from dynmb.core.config import ModelConfig

from dynmb.costmodel.base import CommModel, CostModel
from dynmb.costmodel.nnls import nnls_rel
from dynmb.costmodel.samples import point_medians, sample_meta

__all__ = ["FORMS", "COEFS", "FittedCostModel", "features", "fold_ids"]

FORMS: dict[str, tuple[str, ...]] = {
    "lin": ("c0", "c1_tok"),
    "lin_b": ("c0", "c1_tok", "c3_row"),
    "quad": ("c0", "c1_tok", "c2_attn"),
    "quad_b": ("c0", "c1_tok", "c2_attn", "c3_row"),
    "quad_p": ("c0", "c1_tok", "c2_attn", "c4_packed_tok"),
    "quad_bp": ("c0", "c1_tok", "c2_attn", "c3_row", "c4_packed_tok"),
}
"""Poly forms: c0 [s], c1_tok [s per computed token], c2_attn [s per unit of attention work,
i.e. per (query, key) position pair of a segment], c3_row [s/row], c4_packed_tok [s per
computed token of a packed microbatch: the document-causal path's gather of the rows into
length buckets and scatter back, which one-document rows do not run]."""

COEFS = ("c0", "c1_tok", "c2_attn", "c3_row", "c4_packed_tok")
"""Every poly coefficient, in the order tables list them."""

"""Coefficient names of older cost-model files -> their current name."""


def features(form: str, b: np.ndarray, s: np.ndarray, a: np.ndarray | None = None) -> np.ndarray:
    """Feature columns of ``form``: 1, computed tokens b*s, attention work ``a`` (default
    ``b * s**2``, one document per row), rows b, computed tokens of packed microbatches (a
    microbatch is packed exactly when its attention work is below ``b * s**2``)."""
    one_doc = b * s * s
    a = one_doc if a is None else a
    cols = {"c0": np.ones_like(b), "c1_tok": b * s, "c2_attn": a, "c3_row": b, "c4_packed_tok": b * s * (a < one_doc)}
    return np.stack([cols[c] for c in FORMS[form]], axis=-1)


class FittedCostModel(CostModel):
    """Per (stage, op) non-negative poly in (rows, padded_len, attention work);
    ``params[(stage, op)] = (form, coef)``."""

    kind = "poly"

    def __init__(self, model_cfg: ModelConfig, num_stages: int, params: dict[tuple[int, str], tuple[str, np.ndarray]],
                 comm: CommModel | None = None, meta: dict[str, Any] | None = None) -> None:
        super().__init__(model_cfg, num_stages, comm, meta)
        self.params = {(int(k[0]), k[1]): (f, np.asarray(c, dtype=np.float64)) for k, (f, c) in params.items()}
        missing = [(p, op) for p in range(num_stages) for op in ("F", "B") if (p, op) not in self.params]
        if missing:
            raise ValueError(f"poly cost model lacks fits for (stage, op) {missing}: profile every stage")

    def _predict(self, stage, op, b, s, a):
        form, coef = self.params[(stage, op)]
        return features(form, b, s, a) @ coef

    def coefficients(self) -> pd.DataFrame:
        """One row per (stage, op): form and every coefficient (NaN where the form lacks it)."""
        names = COEFS
        rows = []
        for (p, op), (form, coef) in sorted(self.params.items()):
            d = dict(zip(FORMS[form], coef))
            rows.append({"stage": p, "op": op, "form": form, **{n: d.get(n, np.nan) for n in names}})
        return pd.DataFrame(rows)

    @classmethod
    def fit(cls, samples: pd.DataFrame, model_cfg: ModelConfig, num_stages: int, *, forms: tuple[str, ...] | None = None,
            folds: int = 5, seed: int = 0, comm: CommModel | None = None, meta: dict[str, Any] | None = None) -> "FittedCostModel":
        """Fit every (stage, op) of ``samples``; choose the form by ``folds``-fold held-out MAPE."""
        med = point_medians(samples)
        params, sel = {}, {}
        for (p, op), g in med.groupby(["stage", "op"]):
            b, s, a, t = (g[c].to_numpy(np.float64) for c in ("rows", "padded_len", "attn_work", "time_s"))
            form, cv = _choose_form(b, s, a, t, forms or tuple(FORMS), folds, seed)
            params[(int(p), op)] = (form, nnls_rel(features(form, b, s, a), t))
            sel[f"{p}{op}"] = cv
        return cls(model_cfg, num_stages, params, comm, {**sample_meta(samples), **(meta or {}), "form_cv_mape": sel})

    def _params(self):
        return {"fits": [{"stage": p, "op": op, "form": f, "coef": dict(zip(FORMS[f], c.tolist()))}
                         for (p, op), (f, c) in sorted(self.params.items())]}

    @classmethod
    def _from_parts(cls, cfg, p, comm, meta, params):
        fits = {}
        for d in params["fits"]:
            coef = d["coef"]
            missing = [n for n in FORMS[d["form"]] if n not in coef]
            if missing:
                raise ValueError(f"stage {d['stage']} {d['op']}: form {d['form']!r} lacks the coefficients {missing} "
                                 f"(has {sorted(coef)}; a file from before the attention-work feature: refit it "
                                 f"with dynmb fit)")
            fits[(d["stage"], d["op"])] = (d["form"], [coef[n] for n in FORMS[d["form"]]])
        return cls(cfg, p, fits, comm, meta)


def fold_ids(n: int, k: int, seed: int) -> np.ndarray:
    """Fold of each of ``n`` points: a seeded permutation modulo min(k, n)."""
    return np.random.default_rng(seed).permutation(n) % max(1, min(k, n))


def _choose_form(b: np.ndarray, s: np.ndarray, a: np.ndarray, t: np.ndarray, forms: tuple[str, ...], folds: int,
                 seed: int) -> tuple[str, dict[str, float]]:
    """The smallest form within 2% of the best k-fold held-out MAPE, and every form's MAPE."""
    fold = fold_ids(len(t), folds, seed)
    cv = {}
    for form in forms:
        if len(t) < 2 * len(FORMS[form]):
            continue
        err = np.empty(len(t))
        for k in np.unique(fold):
            tr, te = fold != k, fold == k
            c = nnls_rel(features(form, b[tr], s[tr], a[tr]), t[tr])
            err[te] = np.abs(features(form, b[te], s[te], a[te]) @ c - t[te]) / t[te]
        cv[form] = float(err.mean())
    if not cv:
        return "lin", {}
    best = min(cv.values())
    ok = [f for f in forms if f in cv and cv[f] <= best * 1.02 + 1e-12]
    return min(ok, key=lambda f: len(FORMS[f])), cv
