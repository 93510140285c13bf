"""Per-stage, per-op time model: the one cost lookup shared by packer, scheduler and simulator.

A cost model answers ``predict(stage, op, rows, padded_len, attn)`` -> seconds (vectorised) for
a microbatch of ``rows`` x ``padded_len`` tokens whose attention work is ``attn`` (the sum of
segment_length^2 over its attention segments, ``Microbatch.attention_work``: ``rows *
padded_len^2`` for one document per row, ``sum(s_i^2)`` over the documents of packed rows under
``attention="auto"``; None means one document per row), op ``F`` (forward), ``B`` (full
backward), or the split backward's ``I`` (input gradient) and ``W`` (weight gradients): fitted
when the samples have them, else derived from ``B`` (``dynmb.splitcost``). ``stage_costs(rows[m],
padded_len[m], attn[m])`` returns ``{"F": ndarray[P, m], "B": ndarray[P, m]}`` (``ops=`` for
others); ``plan_costs(plan)`` is the same for a whole plan with each microbatch's attention work
and its ``recompute`` flag (``dynmb.splitcost.apply_recompute``), and is what consumers call.
``comm`` (a ``CommModel``) gives the P2P time ``alpha_s + nbytes / bytes_per_s`` of the
activation sent between neighbouring stages.

Three models, one interface:

- ``AnalyticCostModel``: FLOP count (``ModelConfig.stage_flops``, its s^2 attention FLOPs
  rescaled from ``rows * padded_len^2`` to the attention work) / ``flops_per_s`` + a fixed
  per-op overhead; backward = ``bwd_ratio`` x forward. A stand-in before profiling,
  calibrated roughly to one core of the development CPU.
- ``FittedCostModel`` ("poly", the default): per (stage, op) ``t = c0 + c1*b*s + c2*a (+ c3*b)``
  (b rows, s padded_len, b*s the tokens computed, a the attention work): a fixed cost, a
  per-computed-token cost (matmuls, norms, the LM head), a cost per unit of attention work
  (QK^T and AV over each segment), optionally a per-row cost. Coefficients are non-negative
  and minimise the *relative* squared error sum(((pred - t) / t)^2), solved as
  ``scipy.optimize.nnls`` on the system scaled row-wise by 1/t. The form is chosen per
  (stage, op) by k-fold held-out MAPE over points; a larger form must beat a smaller one by
  more than 2% (relative) to be chosen, so the model stays explainable. Files written before
  the attention work was a feature name the quadratic coefficient ``c2_tok_len``; they load
  as ``c2_attn`` (for them a = b*s^2 was the only case).
- ``GridCostModel`` ("grid", DynaPipe-style, in ``dynmb._costgrid``): bilinear
  ``scipy.interpolate.RegularGridInterpolator`` over (rows, padded_len) of the measured
  medians of one-document rows; outside the grid, linear extrapolation from the edge interval
  (exact in rows, an underestimate in padded_len, where attention grows like s^2). It cannot
  see documents; a packed microbatch gets a linear correction ``- k * (b*s^2 - a)`` (see there).

Samples are a tidy table (``dynmb profile``): stage, op, rows, padded_len, docs_per_row,
attn_work, time_s, repeat, (packed, device, threads, torch_version, model). A point is
(stage, op, rows, padded_len, attn_work); fitting uses per-point medians over repeats;
held-out error (``kfold_error``) holds out whole points. Samples without ``attn_work``
(profiled before it was recorded) get ``rows * padded_len^2`` on unpacked rows; their packed
rows are skipped with a warning (their attention work is unknown). A run's ``actions`` table
converts to samples with ``samples_from_actions`` so models refit from real runs.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy.optimize import nnls

from dynmb.config import ModelConfig

__all__ = [
    "CommModel", "CostModel", "AnalyticCostModel", "FittedCostModel", "GridCostModel",
    "FORMS", "get_cost_model", "load_cost_model", "fit_cost_model", "kfold_error",
    "noise_floor", "point_medians", "samples_from_actions", "with_attention_work", "LEGACY_COEF_NAMES",
]

logger = logging.getLogger(__name__)

FORMS: dict[str, tuple[str, ...]] = {
    "lin": ("c0", "c1_tok"),
    "lin_b": ("c0", "c1_tok", "c3_row"),
    "quad": ("c0", "c1_tok", "c2_attn"),
    "quad_b": ("c0", "c1_tok", "c2_attn", "c3_row"),
}
"""Poly forms: c0 [s], c1_tok [s per computed token], c2_attn [s per unit of attention work,
i.e. per (query, key) position pair of a segment], c3_row [s/row]."""

LEGACY_COEF_NAMES = {"c2_tok_len": "c2_attn"}
"""Coefficient names of older cost-model files -> their current name."""

_KEY = ["stage", "op", "rows", "padded_len", "attn_work"]


class CommModel:
    """Point-to-point time ``alpha_s + nbytes / bytes_per_s`` (one-way, one message)."""

    def __init__(self, alpha_s: float = 5e-5, bytes_per_s: float = 2e9) -> None:
        if alpha_s < 0 or bytes_per_s <= 0:
            raise ValueError(f"CommModel needs alpha_s >= 0 and bytes_per_s > 0, got {alpha_s}, {bytes_per_s}")
        self.alpha_s, self.bytes_per_s = float(alpha_s), float(bytes_per_s)

    def time(self, nbytes: Any) -> np.ndarray:
        return self.alpha_s + np.asarray(nbytes, dtype=np.float64) / self.bytes_per_s

    @classmethod
    def fit(cls, nbytes: Any, time_s: Any) -> "CommModel":
        """Non-negative relative-error least squares of t = alpha + nbytes * (1/beta)."""
        x = np.asarray(nbytes, dtype=np.float64)
        t = np.asarray(time_s, dtype=np.float64)
        coef = _nnls_rel(np.stack([np.ones_like(x), x], axis=1), t)
        return cls(coef[0], 1.0 / max(coef[1], 1e-15))

    def to_dict(self) -> dict[str, float]:
        return {"alpha_s": self.alpha_s, "bytes_per_s": self.bytes_per_s}

    def __repr__(self) -> str:
        return f"CommModel(alpha_s={self.alpha_s:.3g}, bytes_per_s={self.bytes_per_s:.3g})"


def _arch(cfg: ModelConfig) -> dict[str, Any]:
    d = cfg.to_dict()
    d.pop("name", None)
    return d


class CostModel:
    """Base: the interface every consumer uses. Subclasses implement ``_predict``."""

    kind = "base"

    def __init__(self, model_cfg: ModelConfig, num_stages: int, comm: CommModel | None = None,
                 meta: dict[str, Any] | None = None) -> None:
        model_cfg.stage_layers(num_stages)  # validates the split
        self.model_cfg, self.num_stages = model_cfg, int(num_stages)
        self.comm = comm if comm is not None else CommModel()
        self.meta = dict(meta or {})
        self.runtime_overhead_s: dict[str, float] = {"F": 0.0, "B": 0.0}

    # --- the lookup ---------------------------------------------------------
    def predict(self, stage: int, op: str, rows: Any, padded_len: Any, attn: Any = None) -> np.ndarray:
        """Seconds for ``op`` on ``stage`` of microbatches (rows, padded_len), broadcast.

        ``attn`` is each microbatch's attention work ``Microbatch.attention_work`` (sum of
        segment_length^2); None means one document per row: ``rows * padded_len**2``."""
        if not 0 <= int(stage) < self.num_stages:
            raise ValueError(f"stage {stage} out of range for {self.num_stages} stages")
        b, s = np.broadcast_arrays(np.asarray(rows, dtype=np.float64), np.asarray(padded_len, dtype=np.float64))
        a = b * s * s if attn is None else np.broadcast_to(np.asarray(attn, dtype=np.float64), b.shape)
        if op not in ("F", "B", "I", "W"):
            raise ValueError(f"unknown op {op!r}; expected F, B, I or W")
        if op in ("I", "W") and (int(stage), op) not in getattr(self, "params", getattr(self, "grids", {})):
            from dynmb.splitcost import derived_split
            return derived_split(self, int(stage), op, b, s, a)
        return np.maximum(self._predict(int(stage), op, b, s, a), 0.0) + self.runtime_overhead_s.get(op, 0.0)

    def with_overhead(self, F: float = 0.0, B: float = 0.0, I: float = 0.0, W: float = 0.0) -> "CostModel":  # noqa: E741
        """A copy whose every F / B prediction adds ``F`` / ``B`` seconds: what the runtime
        spends per action beyond the op itself (memory-meter hooks, posting sends, the other
        ranks' comm threads), measured on a run's warm-up steps (``runtime_overhead``)."""
        c = copy.copy(self)
        c.runtime_overhead_s = {"F": float(F), "B": float(B), **{k: float(v) for k, v in (("I", I), ("W", W)) if v}}
        return c

    def _predict(self, stage: int, op: str, b: np.ndarray, s: np.ndarray, a: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def stage_costs(self, rows: Any, padded_len: Any, attn: Any = None, ops: tuple[str, ...] = ("F", "B"),
                    recompute: Any = None) -> dict[str, np.ndarray]:
        """``{"F": ndarray[P, m], "B": ndarray[P, m]}`` seconds per stage and microbatch
        (``attn`` as in ``predict``; ``ops``: which ops; ``recompute[m]``: microbatches run with
        full recomputation, ``dynmb.splitcost.apply_recompute``)."""
        b = np.atleast_1d(np.asarray(rows, dtype=np.float64))
        s = np.atleast_1d(np.asarray(padded_len, dtype=np.float64))
        b, s = np.broadcast_arrays(b, s)
        a = b * s * s if attn is None else np.broadcast_to(np.atleast_1d(np.asarray(attn, dtype=np.float64)), b.shape)
        need = tuple(dict.fromkeys(("F", "B", *ops) if recompute is not None else ops))
        out = {op: np.stack([self.predict(p, op, b, s, a) for p in range(self.num_stages)]).reshape(self.num_stages, -1)
               for op in need}
        if recompute is not None:
            from dynmb.splitcost import apply_recompute
            out = {op: v for op, v in apply_recompute(self, out, recompute).items() if op in ops}
        return out

    def plan_costs(self, plan: Any, ops: tuple[str, ...] = ("F", "B")) -> dict[str, np.ndarray]:
        """``stage_costs`` of every microbatch of ``plan`` with its attention work under
        this model's ``attention`` setting and its ``recompute`` flag: the lookup the
        simulator, reorderer and runtime use for a whole plan."""
        shapes = plan.shapes()
        rc = plan.recompute_mask() if hasattr(plan, "recompute_mask") else None
        return self.stage_costs(shapes[:, 0], shapes[:, 1], plan.attention_work(self.model_cfg.attention), ops=ops,
                                recompute=rc if rc is not None and rc.any() else None)

    def comm_s(self, rows: Any, padded_len: Any) -> np.ndarray:
        """P2P seconds of the hidden state of microbatches (rows, padded_len) between stages."""
        nbytes = np.asarray(rows, dtype=np.float64) * np.asarray(padded_len, dtype=np.float64) \
            * self.model_cfg.d_model * self.model_cfg.dtype_bytes
        return self.comm.time(nbytes)

    def check(self, model_cfg: ModelConfig, num_stages: int) -> None:
        """Raise ValueError unless this model was made for ``model_cfg`` split over ``num_stages``."""
        if _arch(model_cfg) != _arch(self.model_cfg) or int(num_stages) != self.num_stages:
            raise ValueError(
                f"{self.kind} cost model was fitted for model {self.model_cfg.name!r} {_arch(self.model_cfg)} "
                f"at {self.num_stages} stages, not for model {model_cfg.name!r} {_arch(model_cfg)} at {num_stages} "
                f"stages; profile and fit one for this config (`dynmb profile` + `dynmb fit`)")

    # --- I/O ----------------------------------------------------------------
    def _params(self) -> dict[str, Any]:
        return {}

    def to_dict(self) -> dict[str, Any]:
        d = {"kind": self.kind, "model": self.model_cfg.to_dict(), "num_stages": self.num_stages,
             "comm": self.comm.to_dict(), "meta": self.meta, "params": self._params()}
        if any(self.runtime_overhead_s.values()):
            d["runtime_overhead_s"] = dict(self.runtime_overhead_s)
        return d

    def save(self, path: str | Path) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))
        tmp.replace(p)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "CostModel":
        kinds = {"analytic": AnalyticCostModel, "poly": FittedCostModel, "grid": _grid_cls()}
        if d.get("kind") not in kinds:
            raise ValueError(f"unknown cost model kind {d.get('kind')!r}; expected one of {list(kinds)}")
        cm = kinds[d["kind"]]._from_parts(ModelConfig.from_dict(d["model"]), int(d["num_stages"]),
                                          CommModel(**d.get("comm", {})), d.get("meta", {}), d.get("params", {}))
        return cm.with_overhead(**d["runtime_overhead_s"]) if d.get("runtime_overhead_s") else cm

    @staticmethod
    def load(path: str | Path) -> "CostModel":
        return CostModel.from_dict(json.loads(Path(path).read_text()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model={self.model_cfg.name!r}, num_stages={self.num_stages}, comm={self.comm})"


load_cost_model = CostModel.load

OVERHEAD_SMALL_S, OVERHEAD_MIN_ACTIONS = 0.05, 8
"""``runtime_overhead`` uses actions predicted under 50 ms, and needs 8 of an op to say anything."""


def runtime_overhead(actions: pd.DataFrame) -> dict[str, float]:
    """Seconds per F / B that a real run spends beyond the cost model's prediction of the op.

    From an ``actions`` table (measured ``start_s``/``end_s`` next to ``pred_s``), per op: the
    median of measured - predicted over the actions predicted under ``OVERHEAD_SMALL_S``,
    where a constant per action shows and the noise of big ops does not; 0 with fewer than
    ``OVERHEAD_MIN_ACTIONS`` such actions, and never negative. On the development box a real
    CPU pipeline spent 1-3 ms per small action beyond the profile (memory-meter hooks, posting
    sends, the other rank's comm threads), 5-20% of a 1-row microbatch, which a profile of
    one op at a time does not see."""
    out = {}
    for op in ("F", "B", "I", "W"):
        a = actions[(actions["op"] == op) & (actions["pred_s"] < OVERHEAD_SMALL_S)]
        if len(a) < OVERHEAD_MIN_ACTIONS:
            out[op] = 0.0
        else:
            out[op] = max(0.0, float(np.median(a["end_s"] - a["start_s"] - a["pred_s"])))
    return out


class AnalyticCostModel(CostModel):
    """FLOPs / flops_per_s + overhead_s; backward = bwd_ratio x forward.

    Defaults fitted (relative least squares) to the small preset's forward times at 2 stages
    on one core of the development CPU (AMD EPYC, torch 2.13, fp32): 58 GFLOP/s, 1.3 ms per op;
    measured backward/forward ~ 2.0. Held-out-free error there: ~5% (F), ~6% (B)."""

    kind = "analytic"

    def __init__(self, model_cfg: ModelConfig, num_stages: int, *, flops_per_s: float = 5.8e10,
                 overhead_s: float = 1.3e-3, bwd_ratio: float = 2.0, comm: CommModel | None = None,
                 meta: dict[str, Any] | None = None) -> None:
        super().__init__(model_cfg, num_stages, comm, meta)
        if flops_per_s <= 0 or overhead_s < 0 or bwd_ratio <= 0:
            raise ValueError(f"bad analytic constants flops_per_s={flops_per_s} overhead_s={overhead_s} bwd_ratio={bwd_ratio}")
        self.flops_per_s, self.overhead_s, self.bwd_ratio = float(flops_per_s), float(overhead_s), float(bwd_ratio)

    def _predict(self, stage, op, b, s, a):
        flops = self.model_cfg.stage_flops(stage, self.num_stages, b, s) \
            + self._attn_flops_per_unit(stage) * (a - b * s * s)
        f = self.overhead_s + flops / self.flops_per_s
        return f if op == "F" else self.bwd_ratio * f

    def _attn_flops_per_unit(self, stage: int) -> float:
        """FLOPs per unit of attention work in ``stage_flops`` (its s^2 coefficient at one row):
        stage_flops(1, s) = A*s + C*s^2, so C = (stage_flops(1, 2) - 2*stage_flops(1, 1)) / 2."""
        f1, f2 = (float(self.model_cfg.stage_flops(stage, self.num_stages, 1, s)) for s in (1, 2))
        return (f2 - 2.0 * f1) / 2.0

    def _params(self):
        return {"flops_per_s": self.flops_per_s, "overhead_s": self.overhead_s, "bwd_ratio": self.bwd_ratio}

    @classmethod
    def _from_parts(cls, cfg, p, comm, meta, params):
        return cls(cfg, p, comm=comm, meta=meta, **params)


def _features(form: str, b: np.ndarray, s: np.ndarray, a: np.ndarray | None = None) -> np.ndarray:
    """Feature columns of ``form``: 1, computed tokens b*s, attention work ``a`` (default
    ``b * s**2``, one document per row), rows b."""
    cols = {"c0": np.ones_like(b), "c1_tok": b * s, "c2_attn": b * s * s if a is None else a, "c3_row": b}
    return np.stack([cols[c] for c in FORMS[form]], axis=-1)


def _nnls_rel(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """argmin_{c >= 0} sum(((x @ c - t) / t)^2), columns rescaled for conditioning."""
    a = x / t[:, None]
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    c, _ = nnls(a / scale, np.ones(len(t)), maxiter=50 * a.shape[1] + 100)
    return c / scale


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
        return _features(form, b, s, a) @ coef

    def coefficients(self) -> pd.DataFrame:
        """One row per (stage, op): form and every coefficient (NaN where the form lacks it)."""
        names = FORMS["quad_b"]
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
            params[(int(p), op)] = (form, _nnls_rel(_features(form, b, s, a), t))
            sel[f"{p}{op}"] = cv
        return cls(model_cfg, num_stages, params, comm, {**_meta_from(samples), **(meta or {}), "form_cv_mape": sel})

    def _params(self):
        return {"fits": [{"stage": p, "op": op, "form": f, "coef": dict(zip(FORMS[f], c.tolist()))}
                         for (p, op), (f, c) in sorted(self.params.items())]}

    @classmethod
    def _from_parts(cls, cfg, p, comm, meta, params):
        fits = {}
        for d in params["fits"]:
            coef = {LEGACY_COEF_NAMES.get(n, n): v for n, v in d["coef"].items()}
            fits[(d["stage"], d["op"])] = (d["form"], [coef[n] for n in FORMS[d["form"]]])
        return cls(cfg, p, fits, comm, meta)


def _folds(n: int, k: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(n) % max(1, min(k, n))


def _choose_form(b: np.ndarray, s: np.ndarray, a: np.ndarray, t: np.ndarray, forms: tuple[str, ...], folds: int,
                 seed: int) -> tuple[str, dict[str, float]]:
    """The smallest form within 2% of the best k-fold held-out MAPE, and every form's MAPE."""
    fold = _folds(len(t), folds, seed)
    cv = {}
    for form in forms:
        if len(t) < 2 * len(FORMS[form]):
            continue
        err = np.empty(len(t))
        for k in np.unique(fold):
            tr, te = fold != k, fold == k
            c = _nnls_rel(_features(form, b[tr], s[tr], a[tr]), t[tr])
            err[te] = np.abs(_features(form, b[te], s[te], a[te]) @ c - t[te]) / t[te]
        cv[form] = float(err.mean())
    if not cv:
        return "lin", {}
    best = min(cv.values())
    ok = [f for f in forms if f in cv and cv[f] <= best * 1.02 + 1e-12]
    return min(ok, key=lambda f: len(FORMS[f])), cv


# --- samples ------------------------------------------------------------------
def with_attention_work(samples: pd.DataFrame) -> pd.DataFrame:
    """The F/B rows of ``samples`` with ``packed``, ``docs_per_row`` and ``attn_work`` filled in.

    Rows without ``attn_work`` (samples or actions recorded before it was): one document per
    row gets ``rows * padded_len**2``; a packed row's attention work is unknown, so it is
    dropped with a warning (its time cannot be told apart from the documents' layout)."""
    df = samples[samples["op"].isin(["F", "B", "I", "W"])].copy()
    df["packed"] = df["packed"].fillna(False).astype(bool) if "packed" in df else False
    one_doc_work = df["rows"].astype(np.int64) * df["padded_len"].astype(np.int64) ** 2
    work = df["attn_work"] if "attn_work" in df else pd.Series(np.nan, index=df.index)
    unknown = work.isna()
    if "docs_per_row" not in df:
        df["docs_per_row"] = np.nan
    df.loc[unknown & ~df["packed"], "docs_per_row"] = 1
    df["attn_work"] = work.where(~unknown, one_doc_work)
    bad = unknown & df["packed"]
    if bad.any():
        logger.warning("skipping %d packed sample rows without attn_work (recorded before the attention work was; "
                       "their sum of document_length^2 is unknown): re-profile with `dynmb profile` to fit packed rows",
                       int(bad.sum()))
        df = df[~bad]
    df["attn_work"] = df["attn_work"].astype(np.int64)
    return df


def point_medians(samples: pd.DataFrame) -> pd.DataFrame:
    """Median time over repeats per point (stage, op, rows, padded_len, attn_work); F/B/I/W rows only.
    Columns: the key, packed, docs_per_row, time_s, n (repeats)."""
    df = with_attention_work(samples)
    out = df.groupby(_KEY, as_index=False).agg(packed=("packed", "first"), docs_per_row=("docs_per_row", "first"),
                                               time_s=("time_s", "median"), n=("time_s", "size"))
    return out[out["time_s"] > 0].reset_index(drop=True)


def noise_floor(samples: pd.DataFrame, by: tuple[str, ...] = ("stage", "op")) -> pd.DataFrame:
    """Per ``by`` group: median over samples of |t_r - median_point| / median_point (the spread
    of repeats of one point; a model cannot be expected to beat it)."""
    df = with_attention_work(samples)
    med = df.groupby(_KEY)["time_s"].transform("median")
    df["dev"] = (df["time_s"] - med).abs() / med
    return df.groupby(list(by), as_index=False).agg(noise=("dev", "median"))


def _packed_actions(actions: pd.DataFrame) -> pd.Series | bool:
    """Which actions ran a packed microbatch: more sequences than rows (``docs``), else less
    attention work than one document per row (``attn_work``), else unknown: False."""
    if "docs" in actions:
        return actions["docs"] > actions["batch"]
    if "attn_work" in actions:
        return actions["attn_work"] < actions["batch"] * actions["padded_len"].astype(np.int64) ** 2
    return False


def samples_from_actions(actions: pd.DataFrame) -> pd.DataFrame:
    """A runtime ``actions`` table as cost samples: time_s = end_s - start_s, rows = batch.

    ``attn_work`` is carried over when the table has it; ``docs`` (sequences in the
    microbatch), when present, gives ``docs_per_row`` and tells packed microbatches
    (docs > batch) apart. A table with neither is taken as one document per row (logged)."""
    need = {"stage", "op", "batch", "padded_len", "start_s", "end_s"}
    if need - set(actions.columns):
        raise ValueError(f"actions table lacks columns {sorted(need - set(actions.columns))}")
    a = actions[actions["op"].isin(["F", "B", "I", "W"])]
    rows = a["batch"].astype(int)
    out = pd.DataFrame({
        "stage": a["stage"].astype(int), "op": a["op"], "rows": rows,
        "padded_len": a["padded_len"].astype(int), "tokens": (a["batch"] * a["padded_len"]).astype(int),
        "packed": _packed_actions(a),
        "docs_per_row": a["docs"] / rows if "docs" in a else np.nan,
        "time_s": (a["end_s"] - a["start_s"]).astype(float),
        "repeat": a["step"] if "step" in a else 0, "source": "actions",
    })
    if "attn_work" in a:
        out["attn_work"] = a["attn_work"]
    elif "docs" not in a:
        logger.warning("actions table has neither attn_work nor docs: every microbatch is taken as one document "
                       "per row (attention work rows * padded_len**2)")
    if "run_id" in a:
        out["run_id"] = a["run_id"]
    return out.reset_index(drop=True)


def _meta_from(samples: pd.DataFrame) -> dict[str, Any]:
    meta = {}
    for c in ("device", "threads", "torch_version", "model", "concurrent", "attention"):
        if c in samples and len(samples[c].dropna()):
            meta[c] = samples[c].dropna().iloc[0]
    meta["n_samples"] = int(len(samples))
    return meta


def _comm_from(samples: pd.DataFrame) -> CommModel | None:
    if "op" not in samples or not (samples["op"] == "comm").any():
        return None
    c = samples[samples["op"] == "comm"].groupby("nbytes", as_index=False)["time_s"].median()
    return CommModel.fit(c["nbytes"], c["time_s"])


def fit_cost_model(samples: pd.DataFrame, model_cfg: ModelConfig, num_stages: int, kind: str = "poly",
                   **kw: Any) -> CostModel:
    """Fit a ``poly`` (FittedCostModel) or ``grid`` (GridCostModel) model; comm from op=="comm" rows."""
    if kind not in ("poly", "grid"):
        raise ValueError(f"unknown cost model kind {kind!r}; expected poly or grid")
    stages = set(int(s) for s in samples.loc[samples["op"].isin(["F", "B"]), "stage"].unique())
    if stages != set(range(num_stages)):
        raise ValueError(f"samples cover stages {sorted(stages)}, expected 0..{num_stages - 1} for {num_stages} stages")
    kw.setdefault("comm", _comm_from(samples))
    return (FittedCostModel if kind == "poly" else _grid_cls()).fit(samples, model_cfg, num_stages, **kw)


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
    pts["fold"] = _folds(len(pts), k, seed)
    med = med.merge(pts, on=shape).reset_index(drop=True)
    pred = np.empty(len(med))
    for f in np.unique(pts["fold"]):
        m = (FittedCostModel if kind == "poly" else _grid_cls()).fit(med[med["fold"] != f], cfg, num_stages, seed=seed)
        for (p, op), g in med[med["fold"] == f].groupby(["stage", "op"]):
            pred[g.index] = m.predict(int(p), op, g["rows"].to_numpy(), g["padded_len"].to_numpy(),
                                      g["attn_work"].to_numpy())
    med["ape"] = np.abs(pred - med["time_s"]) / med["time_s"]
    return med.groupby(list(by), as_index=False).agg(mape=("ape", "mean"), max_ape=("ape", "max"), n=("ape", "size"))


def get_cost_model(path_or_none: str | Path | None, model_cfg: ModelConfig, num_stages: int) -> CostModel:
    """The fitted model at ``path`` (checked against the config) or the analytic stand-in."""
    if path_or_none is None:
        return AnalyticCostModel(model_cfg, num_stages)
    m = CostModel.load(path_or_none)
    m.check(model_cfg, num_stages)
    return m


def _grid_cls() -> type:
    from dynmb._costgrid import GridCostModel  # lives in its own module (size); imports this one
    return GridCostModel


def __getattr__(name: str) -> Any:  # ``from dynmb.costmodel import GridCostModel`` (PEP 562)
    if name == "GridCostModel":
        return _grid_cls()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
