"""Plots (matplotlib, Agg backend): pipeline timeline Gantt, method comparison, cost-model fit.

Each function takes tidy pandas tables and writes a PNG; none of them shows a window.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

__all__: list[str] = ["compare_throughput", "cost_fit"]

# --- gantt (schedule helper) ---

# --- cost_fit (cost helper) ---
def cost_fit(samples: pd.DataFrame, cost_model, path: str, title: str | None = None,
             errors: pd.DataFrame | None = None) -> str:
    """Cost-model fit: left, measured (median over repeats) vs predicted time per (stage, op),
    log-log with the y = x line and a +-5% band; right, time per token against padded_len,
    measured points and the model's curves at a few row counts. ``errors`` (stage, op, mape)
    is written into the legend when given."""
    import numpy as np
    from dynmb.costmodel import point_medians
    med = point_medians(samples)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.4))
    markers = {"F": "o", "B": "s"}
    for (p, op), g in med.groupby(["stage", "op"]):
        pred = cost_model.predict(int(p), op, g["rows"].to_numpy(), g["padded_len"].to_numpy())
        lab = f"stage {p} {op}"
        if errors is not None:
            e = errors[(errors["stage"] == p) & (errors["op"] == op)]
            if len(e):
                lab += f" (held-out MAPE {100 * float(e['mape'].iloc[0]):.1f}%)"
        ax.scatter(g["time_s"], pred, s=12, marker=markers.get(op, "x"), label=lab, alpha=0.8)
    lo, hi = med["time_s"].min() / 1.5, med["time_s"].max() * 1.5
    xs = np.geomspace(lo, hi, 50)
    ax.plot(xs, xs, "k-", lw=0.8)
    ax.fill_between(xs, xs * 0.95, xs * 1.05, color="k", alpha=0.1, label="+-5%")
    ax.set(xscale="log", yscale="log", xlabel="measured s (median of repeats)", ylabel="predicted s",
           title=title or f"{cost_model.kind} cost model: measured vs predicted")
    ax.legend(fontsize=7)
    plain = med[(~med["packed"]) & (med["op"] == "F")]
    for p, g in plain.groupby("stage"):
        for b in sorted(set(g["rows"]) & {1, 4, 16}):
            gb = g[g["rows"] == b].sort_values("padded_len")
            line = ax2.plot(gb["padded_len"], gb["time_s"] / (b * gb["padded_len"]), "o", ms=3)[0]
            s = np.geomspace(plain["padded_len"].min(), plain["padded_len"].max() * 2, 60)
            ax2.plot(s, cost_model.predict(int(p), "F", b, s) / (b * s), "-", color=line.get_color(), lw=0.8,
                     label=f"stage {p} F, rows {b}")
    ax2.set(xscale="log", yscale="log", xlabel="padded_len", ylabel="forward s / token", title="per-token forward time")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --- compare (lead) ---
def compare_throughput(summary: pd.DataFrame, path: str, title: str | None = None) -> str:
    """Bar chart of measured tokens/s per method (one panel), speedup over ``fixed`` on the bars.

    ``summary`` is ``dynmb.analysis.summarise``'s output (``method`` in the index or columns).
    """
    df = summary.reset_index()
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(df)), 3.6))
    colors = ["#d62728" if m == "dynamic" else "#7f7f7f" if m == "fixed" else "#1f77b4" for m in df["method"]]
    bars = ax.bar(df["method"], df["tokens_per_s"], color=colors)
    if "speedup_vs_fixed" in df.columns:
        for b, s in zip(bars, df["speedup_vs_fixed"]):
            ax.annotate(f"{s:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("real tokens / s (median step)")
    ax.set_title(title or "throughput per packing method")
    ax.margins(y=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
