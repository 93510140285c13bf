"""Plots (matplotlib, Agg backend): pipeline timeline Gantt, method comparison, cost-model fit.

Each function takes tidy pandas tables and writes a PNG; none of them shows a window.
"""

from __future__ import annotations

from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from dynmb.costmodel import point_medians  # noqa: E402

__all__: list[str] = ["compare_throughput", "cost_fit", "gantt", "predicted_timeline"]

# --- gantt (schedule helper) ---
_GANTT_COLORS = {"F": "#4C72B0", "B": "#DD8452", "I": "#C44E52", "W": "#55A868"}


def predicted_timeline(actions: pd.DataFrame, comm_s: Any = 0.0) -> pd.DataFrame:
    """The predicted timeline of the step that ran: its actions (one step, replica 0: rank, stage, op, mb,
    start_s, pred_s) in the order each rank ran them, simulated with each action's recorded prediction
    (``pred_s``, what the step was planned with) and ``comm_s`` (scalar or per microbatch) per message.
    Its microbatches are the step's, so the chart shows the plan that ran, not a plan made again."""
    from dynmb.core.actions import Action, Schedule
    from dynmb.timing.simulate import simulate_costs

    acts = actions[actions.get("dp_rank", 0) == 0] if "dp_rank" in actions else actions
    if acts.empty:
        raise ValueError("predicted_timeline: no actions")
    num_stages, num_mb = int(acts["stage"].max()) + 1, int(acts["mb"].max()) + 1
    ranks = [tuple(Action(int(a.stage), str(a.op), int(a.mb)) for a in g.sort_values("start_s").itertuples())
             for _, g in acts.groupby("rank")]
    ops = sorted(set(acts["op"]))
    costs = {op: np.zeros((num_stages, num_mb)) for op in ops}
    for a in acts.itertuples():
        costs[str(a.op)][int(a.stage), int(a.mb)] = float(a.pred_s)
    return simulate_costs(Schedule(ranks, num_stages, num_mb), costs, comm_s).timeline


def gantt(timeline: pd.DataFrame, path: str, title: str | None = None, *, max_labels: int = 600,
          span_s: float | None = None) -> str:
    """Pipeline Gantt chart of a timeline (rank, stage, op, mb, start_s, end_s): one row per rank,
    forward / backward (/ weight) boxes coloured per op, the microbatch number in each box wide
    enough to hold it; the white gaps are the bubbles (per-rank bubble fraction on the right).
    Works for simulated and measured timelines alike; ``span_s``: the x axis's seconds (at least the
    makespan: one scale for a step's measured and predicted charts). Writes a PNG, returns its path."""
    import numpy as np
    from matplotlib.patches import Patch

    if len(timeline) == 0:
        raise ValueError("gantt: the timeline is empty")
    tl = timeline
    t0 = float(tl["start_s"].min())
    makespan = float(tl["end_s"].max()) - t0
    ranks = sorted(int(r) for r in tl["rank"].unique())
    nr = len(ranks)
    span, fig_w = max(makespan, float(span_s or 0.0)), 12.0
    fig, ax = plt.subplots(figsize=(fig_w, 0.9 + 0.42 * nr))
    multi_stage = tl.groupby("rank")["stage"].nunique().max() > 1
    label_ok = len(tl) <= max_labels
    px_per_s = fig_w * 0.8 * 100 / max(span, 1e-12)
    lw = 0.4 if len(tl) <= 5000 else 0.0
    shade = (tl["stage"].to_numpy() // max(1, nr) > 0) if multi_stage else np.zeros(len(tl), dtype=bool)
    for (r, op, later), g in tl.assign(_later=shade).groupby(["rank", "op", "_later"]):
        color = _GANTT_COLORS.get(str(op), "#8172B2")
        yi = ranks.index(int(r))
        start = g["start_s"].to_numpy(dtype=float) - t0
        width = g["end_s"].to_numpy(dtype=float) - g["start_s"].to_numpy(dtype=float)
        # one collection per (rank, op, chunk shade): fast for 100k boxes; later chunks lighter
        # white separators only on boxes wide enough to keep their colour visible
        lws = np.where(width * px_per_s > 4, lw, 0.0)
        ax.broken_barh(list(zip(start, width)), (yi - 0.4, 0.8), facecolors=color, alpha=0.65 if later else 1.0,
                       edgecolor="white", linewidths=lws)
        if label_ok:
            for s, w, mb in zip(start, width, g["mb"].to_numpy()):
                txt = str(int(mb))
                if w * px_per_s >= 7 * len(txt) + 2:
                    ax.text(s + w / 2, yi, txt, ha="center", va="center", fontsize=7, color="white")
    busy = (tl["end_s"] - tl["start_s"]).groupby(tl["rank"]).sum()
    for i, r in enumerate(ranks):
        bub = 1.0 - float(busy.loc[r]) / makespan if makespan > 0 else 0.0
        ax.text(makespan * 1.005, i, f"bubble {100 * bub:.0f}%", va="center", fontsize=7)
    ax.set_yticks(range(nr), [f"rank {r}" for r in ranks])
    ax.set_ylim(nr - 0.5, -0.5)
    ax.set_xlim(0, span * 1.09)
    ax.set_xlabel("time (s)")
    handles = [Patch(color=_GANTT_COLORS.get(op, "#8172B2"),
                     label={"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}.get(op, op))
               for op in ("F", "B", "I", "W") if op in set(tl["op"])]
    if multi_stage:
        handles.append(Patch(color="#999999", alpha=0.65, label="later chunks: lighter"))
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(handles), fontsize=8,
              frameon=False, borderaxespad=0.2)
    ax.set_title(title or f"pipeline timeline: makespan {makespan:.4g} s", loc="left", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --- cost_fit (cost helper) ---
def cost_fit(samples: pd.DataFrame, cost_model, path: str, title: str | None = None,
             errors: pd.DataFrame | None = None) -> str:
    """Cost-model fit: left, measured (median over repeats) vs predicted time per (stage, op),
    log-log with the y = x line and a +-5% band; right, time per token against padded_len,
    measured points and the model's curves at a few row counts. ``errors`` (stage, op, mape)
    is written into the legend when given."""
    import numpy as np
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
    """Bar chart of measured tokens/s per case (one panel), dynamic's paired ratio to each on the bars.

    ``summary`` is ``dynmb.jobs.compare.display_summary``'s output (case names in the index, a
    ``method`` column, ``x_dynamic``) or ``summarise``'s (``method`` in the index or columns).
    """
    df = summary.reset_index()
    names = df["case"] if "case" in df.columns else df["method"]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(df)), 3.8))
    colors = ["#d62728" if m == "dynamic" else "#7f7f7f" if m == "fixed" else "#1f77b4" for m in df["method"]]
    bars = ax.bar(names.astype(str), df["tokens_per_s"].astype(float), color=colors)
    if "x_dynamic" in df.columns:
        for b, s in zip(bars, df["x_dynamic"].astype(float)):
            ax.annotate(f"dyn {s:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=8)
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    ax.set_ylabel("real tokens / s (total over steps)")
    ax.set_title(title or "throughput per packing method")
    ax.margins(y=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
