"""The table ``dynmb compare`` prints: ``summarise``'s rows named by case, with the best fixed mbs and the
best token budget in hindsight as rows of their own, formatted with dynamic's paired ratio to each."""

from __future__ import annotations

import pandas as pd

__all__ = ["FIXED_SIZE_METHODS", "BUDGET_METHODS", "display_summary", "format_summary"]

FIXED_SIZE_METHODS = ("fixed", "sorted", "packed")
BUDGET_METHODS = ("token-budget", "balanced")
"""Methods with a token budget: the memory maximum (their main case) and, for the best budget in
hindsight, the memory maximum divided by 2, 4, ... (their ``mbs``, ``budget_candidates``)."""


def display_summary(summary: pd.DataFrame, labels: list[str]) -> pd.DataFrame:
    """``summarise``'s rows indexed by a display name, in case order: ``fixed (mbs 3)`` for the
    largest mbs that fits, ``fixed (mbs 1)`` ... for the hindsight candidates, then a
    ``fixed-best (mbs B)`` row repeating the fastest fixed case."""
    flat = summary.reset_index()
    flat = flat.set_index("label").reindex([lb for lb in labels if lb in set(flat["label"])]).reset_index()

    def name(row: pd.Series) -> str:
        if row["method"] in FIXED_SIZE_METHODS and row["method"] != "packed" and row.get("mbs"):
            return f"{row['method']} (mbs {row['mbs']})"
        return str(row["label"])

    flat.insert(0, "case", flat.apply(name, axis=1))
    fixed = flat[flat["method"] == "fixed"]
    if len(fixed) > 1:
        best = fixed.loc[fixed["tokens_per_s"].idxmax()].copy()
        best["case"] = f"fixed-best (mbs {best['mbs']})"
        at = int(fixed.index.max()) + 1
        flat = pd.concat([flat.iloc[:at], best.to_frame().T, flat.iloc[at:]], ignore_index=True)
    for method in BUDGET_METHODS:      # the best token budget in hindsight: cap (d = 1) or cap / d
        rows = flat[flat["method"] == method]
        if len(rows) > 1:
            best = rows.loc[rows["tokens_per_s"].astype(float).idxmax()].copy()
            d = str(best["label"]).rpartition("div=")[2] if "div=" in str(best["label"]) else "1"
            best["case"] = f"{method}-best (cap/{d})"
            at = int(rows.index.max()) + 1
            flat = pd.concat([flat.iloc[:at], best.to_frame().T, flat.iloc[at:]], ignore_index=True)
    return flat.set_index("case")


def format_summary(summary: pd.DataFrame, reference: str = "dynamic") -> str:
    """The printed table: fixed-point numbers, dynamic's paired ratio to every case with its
    spread, and one line naming the best other case."""
    col = f"x_{reference}"
    view = pd.DataFrame(index=summary.index)
    view["tokens/s"] = summary["tokens_per_s"].map("{:,.0f}".format)
    if col in summary:
        view[f"{reference} x"] = [f"{m:.2f} ({lo:.2f}-{hi:.2f})" for m, lo, hi in
                                  zip(summary[col], summary[f"{col}_lo"], summary[f"{col}_hi"])]
    fmt = {"padding_fraction": ("padding", "{:.3f}"), "mean_bubble": ("bubble", "{:.3f}"),
           "peak_over_limit": ("peak/limit", "{:.3f}"), "pred_step_s": ("pred step s", "{:.2f}"),
           "step_s": ("step s", "{:.2f}"), "pred_err": ("pred err", "{:.1%}"),
           "step_ratio": ("meas/pred", "{:.2f}"), "action_ratio": ("act meas/pred", "{:.2f}"),
           "replay_err": ("replay err", "{:.1%}"), "gap_to_bound": ("gap bound", "{:.1%}"),
           "gap_to_ideal": ("gap ideal", "{:.1%}"),
           "num_microbatches": ("mbs/step", "{:.1f}"),
           "distinct_shapes": ("shapes", "{:.1f}"), "new_shapes": ("new shapes", "{:.0f}")}
    for key, (title, f) in fmt.items():
        if key in summary:
            view[title] = summary[key].map(lambda v, f=f: "" if pd.isna(v) else f.format(float(v)))
    if "plan_s" in summary:
        view["plan ms"] = (summary["plan_s"].astype(float) * 1e3).map("{:.1f}".format)
    text = view.to_string()
    others = summary[(summary["method"] != reference) & ~summary.index.str.contains("-best")]
    if col in summary and not others.empty and (summary["method"] == reference).any():
        best = others[col].astype(float).idxmin()
        text += (f"\n{reference} is {others.loc[best, col]:.2f}x the best other case ({best}; median of per-step "
                 f"paired ratios, range {others.loc[best, col + '_lo']:.2f}-{others.loc[best, col + '_hi']:.2f})")
    return text
