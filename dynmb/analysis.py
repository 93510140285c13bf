"""Summaries of results tables: one row per method, the numbers the README quotes.

``summarise(tables)`` takes the dict from ``dynmb.results.load_results`` and returns
a DataFrame indexed by method (and dataset / limit when several are present):

- ``tokens_per_s``: median over measured steps of real tokens / step_s;
- ``speedup_vs_fixed``: that over the ``fixed`` method's, same dataset and limit;
- ``padding_fraction``, ``num_microbatches``: mean over steps;
- ``mean_bubble``: median of the measured per-step mean bubble fraction;
- ``peak_over_limit``: max over steps and stages of measured peak / limit;
- ``step_s``, ``pred_step_s``, ``pred_err``: medians, and the median of |pred − measured| / measured;
- ``plan_s``: median planning time per step.

Warm-up steps (``warmup`` column true) are excluded.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

__all__ = ["summarise", "GROUP_KEYS"]

GROUP_KEYS = ("dataset", "memory_limit_bytes", "method")


def _measured(steps: pd.DataFrame) -> pd.DataFrame:
    if "warmup" in steps.columns:
        steps = steps[~steps["warmup"].astype(bool)]
    return steps


def summarise(tables: dict[str, pd.DataFrame], baseline: str = "fixed") -> pd.DataFrame:
    steps = _measured(tables["steps"]).copy()
    if steps.empty:
        raise ValueError("no measured steps in the results tables")
    if "memory_limit_bytes" not in steps.columns:
        steps["memory_limit_bytes"] = np.nan
    keys = [k for k in GROUP_KEYS if k in steps.columns]
    steps["pred_err"] = (steps["pred_step_s"] - steps["step_s"]).abs() / steps["step_s"]
    agg: dict[str, tuple[str, str]] = {
        "steps": ("step_s", "size"),
        "tokens_per_s": ("tokens_per_s", "median"),
        "step_s": ("step_s", "median"),
        "pred_step_s": ("pred_step_s", "median"),
        "pred_err": ("pred_err", "median"),
        "num_microbatches": ("num_microbatches", "mean"),
    }
    for col, how in (("padding_fraction", "mean"), ("mean_bubble", "median"), ("plan_s", "median"), ("mbs", "first")):
        if col in steps.columns:
            agg[col] = (col, how)
    out = steps.groupby(keys, dropna=False).agg(**agg)
    mem = tables.get("memory")
    if mem is not None and not mem.empty:
        mem = mem.copy()
        if "warmup" in mem.columns:
            mem = mem[~mem["warmup"].astype(bool)]
        mem["ratio"] = mem["peak_bytes"] / mem["limit_bytes"]
        run_keys = steps.drop_duplicates("run_id").set_index("run_id")[keys]
        mem = mem.join(run_keys, on="run_id")
        out = out.join(mem.groupby(keys, dropna=False)["ratio"].max().rename("peak_over_limit"))
    # speedup against the baseline method of the same dataset and limit
    flat = out.reset_index()
    ctx = [k for k in keys if k != "method"]
    if baseline in set(flat["method"]):
        base = flat[flat["method"] == baseline].set_index(ctx)["tokens_per_s"].rename("base") if ctx else \
            flat.loc[flat["method"] == baseline, "tokens_per_s"].iloc[0]
        if ctx:
            flat = flat.join(base, on=ctx)
            flat["speedup_vs_fixed"] = flat["tokens_per_s"] / flat["base"]
            flat = flat.drop(columns="base")
        else:
            flat["speedup_vs_fixed"] = flat["tokens_per_s"] / base
    return flat.set_index(keys)
