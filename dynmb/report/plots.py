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
from pathlib import Path  # noqa: E402

from dynmb.costmodel import point_medians  # noqa: E402

__all__: list[str] = ["compare_throughput", "compare_figure", "cost_fit", "gantt", "predicted_timeline"]

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
_METHOD_COLORS = {"fixed": "#7f7f7f", "sorted": "#bcbd22", "packed": "#8c564b", "token-budget": "#1f77b4",
                  "balanced": "#2ca02c", "dynapipe": "#9467bd", "lockstep": "#17becf", "dynamic": "#d62728"}


def _cases(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per measured case (the ``-best`` rows repeat a case: dropped, the case they name is starred)."""
    df = summary.reset_index()
    names = (df["case"] if "case" in df.columns else df["method"]).astype(str)
    df = df.assign(case=names)
    best = df[names.str.contains("-best")]
    df = df[~names.str.contains("-best")].reset_index(drop=True)
    for _, row in best.iterrows():            # star the case the best-in-hindsight row repeats
        same = (df["method"] == row["method"]) & (df["tokens_per_s"].astype(float) == float(row["tokens_per_s"]))
        df.loc[same, "case"] = df.loc[same, "case"] + " *"
    return df


def _throughput_panel(ax, df: pd.DataFrame, steps: str) -> None:
    """Horizontal bars of total tokens/s per case, each labelled with its own height."""
    y = range(len(df))
    tps = df["tokens_per_s"].astype(float)
    colors = [_METHOD_COLORS.get(str(m), "#555555") for m in df["method"]]
    ax.barh(list(y), tps, color=colors)
    for yi, v in zip(y, tps):
        ax.text(v, yi, f" {v:,.0f}", va="center", fontsize=8)
    ax.set_yticks(list(y), df["case"])
    ax.invert_yaxis()
    ax.set_xlabel(f"real tokens / s, total over {steps}\n(longer bar = faster)")
    ax.margins(x=0.18)


def _ratio_panel(ax, df: pd.DataFrame) -> None:
    """Dynamic's paired ratio to each case (median of per-step ratios) with its 95% bootstrap interval."""
    from matplotlib.ticker import FuncFormatter

    y = list(range(len(df)))
    ratio = df["x_dynamic"].astype(float)
    lo = df.get("x_dynamic_ci_lo", ratio).astype(float)
    hi = df.get("x_dynamic_ci_hi", ratio).astype(float)
    colors = [_METHOD_COLORS.get(str(m), "#555555") for m in df["method"]]
    ax.errorbar(ratio, y, xerr=[ratio - lo, hi - ratio], fmt="none", ecolor="#333333", capsize=3, lw=1)
    ax.scatter(ratio, y, c=colors, zorder=3, s=28)
    for yi, r, a, b, m in zip(y, ratio, lo, hi, df["method"]):
        text = "  reference" if m == "dynamic" else f"  {r:.2f}x [{a:.2f}-{b:.2f}]"
        ax.text(max(b, r), yi, text, va="center", fontsize=8)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(plain)
    ax.tick_params(axis="x", which="minor", labelsize=7)
    ax.set_ylim(len(df) - 0.5, -0.5)
    ax.set_xlabel("dynamic tokens/s / case tokens/s\n(paired per step, 95% interval)")
    ax.margins(x=0.35)
    ax.text(0.99, 1.01, "dynamic faster \u2192", transform=ax.transAxes, ha="right", va="bottom", fontsize=8)
    ax.text(0.01, 1.01, "\u2190 case faster", transform=ax.transAxes, ha="left", va="bottom", fontsize=8)


def compare_figure(summary: pd.DataFrame, title: str | None = None, *, compact: bool = False):
    """The compare figure (returned, not saved): full, throughput bars (each labelled with its own tokens/s)
    beside dynamic's paired ratio to each case with its interval on its own axis; compact (the README's),
    the ratio panel alone. A colour key names the methods; ``*`` marks the best case in hindsight."""
    from matplotlib.patches import Patch

    df = _cases(summary)
    steps = f"{int(df['steps'].max())} measured steps" if "steps" in df.columns else "the measured steps"
    height = 1.4 + 0.32 * len(df)
    has_ratio = "x_dynamic" in df.columns and df["x_dynamic"].notna().any()
    if compact and has_ratio:
        fig, ax = plt.subplots(figsize=(6.4, height))
        _ratio_panel(ax, df)
        ax.set_yticks(range(len(df)), df["case"], fontsize=9)
    else:
        fig, grid = plt.subplots(1, 2 if has_ratio else 1, figsize=(11.0 if has_ratio else 6.4, height),
                                 squeeze=False, sharey=True)
        _throughput_panel(grid[0, 0], df, steps)
        if has_ratio:
            _ratio_panel(grid[0, 1], df)
    keys = [Patch(color=_METHOD_COLORS.get(m, "#555555"), label=m) for m in dict.fromkeys(df["method"].astype(str))]
    fig.legend(handles=keys, loc="lower center", ncol=min(len(keys), 8), fontsize=8, frameon=False)
    fig.suptitle((title or "throughput per case") + (f" ({steps}; * best in hindsight)"), fontsize=9)
    fig.tight_layout(rect=(0, 0.25 / height, 1, 1))
    return fig


def compare_throughput(summary: pd.DataFrame, path: str, title: str | None = None) -> list[str]:
    """Write ``compare_figure`` to ``path`` and its compact form next to it (``<stem>_compact.png``);
    returns both paths.

    ``summary`` is ``dynmb.jobs.compare.display_summary``'s output (case names in the index, a
    ``method`` column, ``x_dynamic`` and its interval) or ``summarise``'s.
    """
    paths = [path, str(Path(path).with_name(Path(path).stem + "_compact.png"))]
    for target, compact in zip(paths, (False, True)):
        fig = compare_figure(summary, title, compact=compact)
        fig.savefig(target, dpi=120)
        plt.close(fig)
    return paths
