"""Cost samples: the tidy table models are fitted on, and what is read off it.

Samples are a tidy table (``dynmb profile``): stage, op, rows, padded_len, docs_per_row,
attn_work, time_s, repeat, (packed, device, threads, torch_version, model). A point is
(stage, op, rows, padded_len, attn_work) (``POINT_KEY``); fitting uses per-point medians over
repeats (``point_medians``); held-out error (``registry.kfold_error``) holds out whole points;
``noise_floor`` is the spread of repeats of one point. Samples without ``attn_work``
(profiled before it was recorded) get ``rows * padded_len^2`` on unpacked rows; their packed
rows are skipped with a warning (their attention work is unknown; ``with_attention_work``). A
run's ``actions`` table converts to samples with ``samples_from_actions`` so models refit from
real runs, and ``runtime_calibration`` reads off it how much slower a real pipeline runs each
stage's ops than the profile (a scale per stage and op) plus what it pays per action.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["POINT_KEY", "SCALE_MIN_ACTIONS", "SCALE_MIN_PRED_S", "OVERHEAD_SMALL_S", "OVERHEAD_MIN_ACTIONS",
           "with_attention_work", "point_medians", "noise_floor", "samples_from_actions", "sample_meta",
           "RuntimeCalibration", "runtime_calibration"]

logger = logging.getLogger(__name__)

POINT_KEY = ["stage", "op", "rows", "padded_len", "attn_work"]
"""The columns that identify one measured point."""

SCALE_MIN_ACTIONS, SCALE_MIN_PRED_S = 3, 0.1
"""``runtime_calibration``'s scale needs 3 big actions and 0.1 s of their predicted work of a (stage, op)."""

OVERHEAD_SMALL_S, OVERHEAD_MIN_ACTIONS = 0.05, 8
"""``runtime_calibration``: actions predicted under 50 ms give the per-action overhead (8 of an op
needed), the others the scale."""


def with_attention_work(samples: pd.DataFrame) -> pd.DataFrame:
    """The F/B/I/W rows of ``samples`` with ``packed``, ``docs_per_row`` and ``attn_work`` filled in.

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
    out = df.groupby(POINT_KEY, as_index=False).agg(packed=("packed", "first"), docs_per_row=("docs_per_row", "first"),
                                               time_s=("time_s", "median"), n=("time_s", "size"))
    return out[out["time_s"] > 0].reset_index(drop=True)


def noise_floor(samples: pd.DataFrame, by: tuple[str, ...] = ("stage", "op")) -> pd.DataFrame:
    """Per ``by`` group: median over samples of |t_r - median_point| / median_point (the spread
    of repeats of one point; a model cannot be expected to beat it)."""
    df = with_attention_work(samples)
    med = df.groupby(POINT_KEY)["time_s"].transform("median")
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


def sample_meta(samples: pd.DataFrame) -> dict[str, Any]:
    """Provenance of a samples table for a fitted model's ``meta`` (device, threads, torch, model, ...)."""
    meta = {}
    for c in ("device", "threads", "torch_version", "model", "concurrent", "attention"):
        if c in samples and len(samples[c].dropna()):
            meta[c] = samples[c].dropna().iloc[0]
    meta["n_samples"] = int(len(samples))
    return meta


@dataclass(frozen=True)
class RuntimeCalibration:
    """What a run's warm-up steps measured against the cost model (``runtime_calibration``):
    ``scale[op][stage]`` multiplies the profile's prediction (``CostModel.with_scale``), and
    ``overhead_s[op]`` seconds are added per action (``CostModel.with_overhead``)."""

    scale: dict[str, list[float]] = field(default_factory=dict)
    overhead_s: dict[str, float] = field(default_factory=dict)


def runtime_calibration(actions: pd.DataFrame, num_stages: int, *, min_actions: int = SCALE_MIN_ACTIONS,
                        min_pred_s: float = SCALE_MIN_PRED_S) -> RuntimeCalibration:
    """Fit ``measured = scale[op][stage] * predicted + overhead_s[op]`` to an ``actions`` table
    (measured ``start_s``/``end_s`` next to the uncalibrated ``pred_s``), in two steps.

    1. ``scale``: per (stage, op), ``sum(measured) / sum(predicted)`` over the actions predicted
       at ``OVERHEAD_SMALL_S`` or more, where a fixed cost per action does not show. A ratio of
       sums, so the big actions that make up a step weigh most. A (stage, op) with fewer than
       ``min_actions`` (``SCALE_MIN_ACTIONS``) such actions or under ``min_pred_s``
       (``SCALE_MIN_PRED_S``) of their predicted work keeps 1.0; an op with no such (stage, op)
       is left out.
    2. ``overhead_s``: per op, the median of ``measured - scale * predicted`` over the actions
       predicted under ``OVERHEAD_SMALL_S``; 0 with fewer than ``OVERHEAD_MIN_ACTIONS`` of them,
       never negative.

    Why: the profile times one stage's op at a time on its own graph, while a pipeline's ranks
    share the host's last-level cache and memory bandwidth with each other's compute and comm
    threads (on the 2-core development box a stage's forward ran up to 1.37x slower while the
    other rank computed than alone, ``benchmarks/bench_contention.py``), and the box drifts by
    10-20% between sittings: the scale. Each action also pays a few ms the profile's op does not
    (posting sends and receives, the memory meter's hooks, the interpreter): after scaling, 1-5
    ms per action remained on every idle-box run; without it the planner, seeing small
    microbatches as cheap as the profile says, cut a batch into too many (gsm8k: 23 microbatches
    predicted 1.08 s, measured 1.75 s)."""
    actions = actions[actions["op"].isin(["F", "B", "I", "W"])]
    measured = (actions["end_s"] - actions["start_s"]).astype(float)
    small = actions["pred_s"] < OVERHEAD_SMALL_S
    scale: dict[str, list[float]] = {}
    for op in ("F", "B", "I", "W"):
        big = actions[(actions["op"] == op) & ~small]
        per_stage = [1.0] * num_stages
        for stage, g in big.groupby("stage"):
            total = float(g["pred_s"].sum())
            if len(g) >= min_actions and total >= min_pred_s:
                per_stage[int(stage)] = float(measured[g.index].sum()) / total
        if per_stage != [1.0] * num_stages:
            scale[op] = per_stage
    overhead: dict[str, float] = {}
    for op in ("F", "B", "I", "W"):
        few = actions[(actions["op"] == op) & small]
        if len(few) < OVERHEAD_MIN_ACTIONS:
            continue
        factor = np.array([scale.get(op, [1.0] * num_stages)[int(st)] for st in few["stage"]])
        overhead[op] = max(0.0, float(np.median(measured[few.index] - factor * few["pred_s"])))
    return RuntimeCalibration(scale, overhead)
