"""Cost samples: the tidy table models are fitted on, and what is read off it.

Samples are a tidy table (``dynmb profile``): stage, op, rows, padded_len, docs_per_row,
attn_work, time_s, repeat, (packed, device, threads, torch_version, model). A point is
(stage, op, rows, padded_len, attn_work) (``POINT_KEY``); fitting uses per-point medians over
repeats (``point_medians``); held-out error (``registry.kfold_error``) holds out whole points;
``noise_floor`` is the spread of repeats of one point. Samples without ``attn_work``
(profiled before it was recorded) get ``rows * padded_len^2`` on unpacked rows; their packed
rows are skipped with a warning (their attention work is unknown; ``with_attention_work``). A
run's ``actions`` table converts to samples with ``samples_from_actions`` so models refit from
real runs (``calibration`` reads a running pipeline's speed off the same table).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["POINT_KEY", "with_attention_work", "point_medians", "noise_floor", "samples_from_actions", "sample_meta"]

logger = logging.getLogger(__name__)

POINT_KEY = ["stage", "op", "rows", "padded_len", "attn_work"]
"""The columns that identify one measured point."""


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
