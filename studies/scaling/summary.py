"""Markdown summary of ``studies/scaling/scaling.py``'s ``scaling`` table (``--summary``).

A *cell* is one (dataset, tokens, P, DP) global batch; every method planned it. Labels: the method name,
``dynamic`` with the even layer split, ``dynamic (auto)`` with ``--stage-split auto`` (the other methods
run their ``--others-split``, even by default), `` [sched auto]`` added to rows run with ``--schedule auto``
(rows without a ``schedule_key`` ran 1F1B; rows with ``--virtual`` V > 1 read `` [sched auto v2]``). Methods are
compared within one ``--schedule`` setting and V (dynamic with ``auto`` against the others with ``auto``). Tables:

1. per trace x P, each method's gap to ``ideal_s`` / gap to its own ``bound_s``, the median over the cells;
2. per trace x P, dynamic's ratio to the best other method (best other's step / dynamic's: > 1 means
   dynamic is faster; the minimum over the cells, and which method), its attainable fraction (auto split,
   minimum and median), its gap to ideal on the cells whose replicas hold >= 4P microbatches' worth of
   tokens (``load_ok``), and its plan time over its step (maximum);
3. per cell, dynamic (auto): microbatches per replica, step, ideal, gaps, bubble, padding, attainable,
   the split's ceiling ``attainable x (1 + gap to ideal)`` (= mean over busiest stage's ideal work, up to
   the ideal's tiny fill and drain: what the layer split alone allows), best other, plan / step, and the
   planner processes per rank that planning ahead needs so that no step waits (``planners_needed``);
4. with ``--virtual`` V > 1 rows: per cell, V and dynamic split, dynamic's step, tokens / s, truncated sequences,
   gap, attainable, kind, plan time and every other method's step (``virtual_table``);
5. the judged-by criteria, each with the cells that miss it (a cell missing the ideal criterion with where its
   gap goes, the ``gap_<term>`` columns of ``_scaling_gap``); with ``--schedule auto`` rows also: the
   chosen step is never slower than any kind weighed whose simulated peak fits (``step_<kind>_s``), nor
   than the same method's ``--schedule 1f1b`` row of the same cell where the data holds one.
"""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pandas as pd
from studies.scaling.gap import terms_text
from studies.scaling.virtual import setting_label

from dynmb.costmodel import gpu

__all__ = ["summary_markdown", "labelled", "spec_header"]

CELL = ["dataset", "tokens", "num_stages", "dp"]
METHOD_ORDER = ("fixed", "sorted", "packed", "token-budget", "token-budget-best", "balanced", "balanced-best",
                "dynapipe", "dynamic")
SCHED = "schedule_key"


def labelled(df: pd.DataFrame) -> pd.DataFrame:
    """Rows that planned (status ok) with a ``label`` column (dynamic's split named when not even)."""
    df = df[df["status"] == "ok"].reset_index(drop=True).copy()
    df[SCHED] = df[SCHED].astype(object).fillna("1f1b").astype(str) if SCHED in df else "1f1b"
    if "virtual" in df:                                  # V > 1: the setting reads "auto v2" (its own rows)
        df[SCHED] = [setting_label(k, v) for k, v in zip(df[SCHED], df["virtual"])]
    auto = (df["method"] == "dynamic") & (df["stage_split"].astype(str) != "even")
    label = pd.Series(np.where(auto, "dynamic (" + df["stage_split"].astype(str) + ")", df["method"]), index=df.index)
    df["label"] = label + np.where(df[SCHED] == "1f1b", "", " [sched " + df[SCHED] + "]")
    return df


def _order(df: pd.DataFrame) -> list[str]:
    """Labels by schedule setting (1f1b first), then method, then the rest sorted."""
    keys = sorted(set(df[SCHED]), key=lambda k: (k != "1f1b", k))
    order = [lbl for k in keys for m in METHOD_ORDER
             for lbl in sorted(set(df.loc[(df[SCHED] == k) & (df["method"] == m), "label"]), key=len)]
    return order + sorted(set(df["label"]) - set(order))


def _md(table: pd.DataFrame) -> str:
    cols = [str(c) for c in table.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines)


def _pct(x: float) -> str:
    return "" if pd.isna(x) else f"{100 * x:+.0f}%"


def _tok(t: float) -> str:
    return f"{t / 1e6:g}M"


def _split(text: str) -> str:
    """Layers per stage: ``2x16`` when even, else the list."""
    parts = text.split()
    return f"{parts[0]}x{len(parts)}" if len(set(parts)) == 1 else ",".join(parts)


def _others(df: pd.DataFrame) -> pd.DataFrame:
    """Per cell: the best non-dynamic method's step and name."""
    o = df[df["method"] != "dynamic"]
    i = o.groupby(CELL + [SCHED])["pred_step_s"].idxmin()
    return o.loc[i, CELL + [SCHED, "pred_step_s", "label"]].rename(columns={"pred_step_s": "best_other_s",
                                                                       "label": "best_other"})


def _dynamic(df: pd.DataFrame, label: str) -> pd.DataFrame:
    d = df[df["label"] == label].merge(_others(df), on=CELL + [SCHED], how="left")
    return d.assign(ratio=d["best_other_s"] / d["pred_step_s"])


def summary_markdown(raw: pd.DataFrame) -> str:
    df = labelled(raw)
    if df.empty:
        return "(no rows with status ok)"
    order = _order(df)
    out = []
    # 1. gaps per method, one table per (tokens, DP)
    out += ["Gap to `ideal_s` / gap to own `bound_s`, per trace x P (one global batch each):", ""]
    for (tokens, dp), part in df.groupby(["tokens", "dp"]):
        g = part.groupby(["dataset", "num_stages", "label"])[["gap_to_ideal", "gap_to_bound"]].median().reset_index()
        g["txt"] = [f"{_pct(a)} / {_pct(b)}" for a, b in zip(g["gap_to_ideal"], g["gap_to_bound"])]
        t1 = g.pivot(index=["dataset", "num_stages"], columns="label", values="txt")
        t1 = t1.reindex(columns=[c for c in order if c in t1.columns]).reset_index()
        t1 = t1.rename(columns={"dataset": "trace", "num_stages": "P"}).fillna("")
        out += [f"{_tok(tokens)} tokens, DP {dp}:", "", _md(t1), ""]
    # 2. dynamic against the best other
    rows = []
    splits = [lbl for lbl in order if lbl.startswith("dynamic")]
    autos = [lbl for lbl in splits if lbl.startswith("dynamic (auto)")]
    auto = autos[-1] if autos else splits[-1] if splits else None      # the auto split, --schedule auto if run
    for (trace, P), _ in df.groupby(["dataset", "num_stages"]):
        sub = df[(df["dataset"] == trace) & (df["num_stages"] == P)]
        row = {"trace": trace, "P": P}
        for lbl in splits:
            d = _dynamic(sub, lbl)
            if d.empty or d["ratio"].isna().all():
                continue
            w = d.loc[d["ratio"].idxmin()]
            row[f"{lbl}: min ratio (vs)"] = f"{w['ratio']:.3f} ({w['best_other']})"
            row[f"{lbl}: max plan/step"] = f"{d['plan_over_step'].max():.3f}"
        if auto is not None:
            d = sub[sub["label"] == auto]
            if not d.empty:
                row[f"{auto}: attainable min / median"] = f"{d['attainable'].min():.2f} / {d['attainable'].median():.2f}"
                ok = d[d["load_ok"].astype(bool)]
                row[f"{auto}: max gap to ideal, load_ok cells"] = _pct(ok["gap_to_ideal"].max()) if len(ok) else "(none)"
        rows.append(row)
    out += ["Dynamic against the best other method (ratio = best other's step / dynamic's, > 1: dynamic faster; "
            "minimum over the cells), attainable, gap to ideal where a replica holds >= 4P microbatches' worth, "
            "plan time / step:", "", _md(pd.DataFrame(rows).fillna("")), ""]
    # 3. per cell, dynamic (auto)
    if auto is not None:
        d = _dynamic(df, auto).sort_values(CELL)
        t3 = pd.DataFrame({
            "trace": d["dataset"], "tokens": d["tokens"].map(_tok), "P": d["num_stages"], "DP": d["dp"],
            "split": d["layer_split"].astype(str).map(_split),
            "mb/replica": d["num_microbatches"], "step s": d["pred_step_s"].map("{:.3f}".format),
            "ideal s": d["ideal_s"].map("{:.3f}".format), "gap ideal": d["gap_to_ideal"].map(_pct),
            "gap ideal (whole seqs)": (d["pred_step_s"] / d["ideal_whole_s"] - 1).map(_pct)
            if "ideal_whole_s" in d else "",
            "gap bound": d["gap_to_bound"].map(_pct), "bubble": d["mean_bubble"].map("{:.2f}".format),
            "padding": d["padding_fraction"].map("{:.3f}".format), "attainable": d["attainable"].map("{:.2f}".format),
            "split ceiling": (d["attainable"] * (1 + d["gap_to_ideal"])).map("{:.2f}".format),
            "best other": d["best_other"], "x best other": d["ratio"].map("{:.3f}".format),
            "plan/step": d["plan_over_step"].map("{:.3f}".format), "planners": planners_needed(d["plan_over_step"], _ranks(d)),
            "load_ok": d["load_ok"]})
        if "schedule" in d and "step_1f1b_s" in d and d[SCHED].ne("1f1b").any():
            t3.insert(8, "schedule", d["schedule"].fillna("1f1b"))
            t3.insert(9, "gap ideal 1f1b", (d["step_1f1b_s"] / d["ideal_s"] - 1).map(_pct))
        out += [f"Per cell, {auto}:", "", _md(t3), ""]
    if "virtual" in df and df["virtual"].fillna(1).gt(1).any():
        out += ["Per cell and V (`--virtual`), dynamic (each split) against the other methods of the same setting "
                "(step s; x best other = best other's step / dynamic's):", "", _md(virtual_table(df)), ""]
    out += ["Judged-by criteria (cells that miss them):", "", criteria_markdown(df, splits, auto)]
    out += schedule_criteria(df)
    return "\n".join(out)


def virtual_table(df: pd.DataFrame) -> pd.DataFrame:
    """Table 4: per cell, schedule setting (V included) and dynamic split: dynamic's step, real tokens per second
    (a chunk holds more in flight, so more sequences may be truncated under V > 1: ``truncated``), gap to ideal,
    attainable, kind, microbatches, peak / limit, plan time, best other (x), and every other method's step."""
    others = [m for m in METHOD_ORDER if m != "dynamic" and m in set(df["method"])]
    rows = []
    for lbl in sorted(set(df.loc[df["method"] == "dynamic", "label"])):
        tag = lbl[lbl.index(" ["):] if " [" in lbl else ""
        for r in _dynamic(df, lbl).itertuples():
            same = df[(df[CELL + [SCHED]] == [getattr(r, c) for c in CELL + [SCHED]]).all(axis=1)]
            step = same.set_index("label")["pred_step_s"]
            rows.append({"trace": r.dataset, "tokens": _tok(r.tokens), "P": r.num_stages, "DP": r.dp,
                         "V": int(getattr(r, "virtual", 1) or 1), "dynamic": lbl.split(" [")[0],
                         "schedule": getattr(r, "schedule", ""), "mb/replica": r.num_microbatches,
                         "step s": f"{r.pred_step_s:.3f}", "Mtok/s": f"{r.real_tokens / r.pred_step_s / 1e6:.3f}",
                         "truncated": int(r.truncated), "gap ideal": _pct(r.gap_to_ideal),
                         "attainable": f"{r.attainable:.2f}", "peak/limit": f"{r.pred_peak_over_limit:.2f}",
                         "plan s": f"{r.plan_s:.1f}", "x best other": f"{r.ratio:.3f} ({r.best_other})",
                         **{m: f"{step[m + tag]:.3f}" if m + tag in step else "" for m in others}})
    return pd.DataFrame(rows).sort_values(["trace", "tokens", "P", "DP", "dynamic", "V"], kind="stable")


def schedule_criteria(df: pd.DataFrame) -> list[str]:
    """``--schedule`` rows other than 1f1b: the chosen step against every kind weighed that fits, and
    against the same method's 1f1b row of the same cell (when present); the kinds chosen."""
    rows = df[df[SCHED] != "1f1b"]
    if rows.empty:
        return []
    cols = [c for c in df.columns if c.startswith("step_") and c.endswith("_s")]
    over = rows.get("kinds_over_limit", pd.Series("", index=rows.index)).astype(object).fillna("").astype(str)
    slower, weighed = [], 0
    for (_, r), ol in zip(rows.iterrows(), over):
        for c in cols:
            k = c[len("step_"):-len("_s")]
            if pd.isna(r[c]) or k in ol.split():
                continue
            weighed += 1
            if r["pred_step_s"] > r[c] * (1 + 1e-9):
                slower.append(f"{r['label']} {r['dataset']} {_tok(r['tokens'])} P{r['num_stages']} DP{r['dp']}: "
                              f"{k} {r[c]:.4f} s < {r['pred_step_s']:.4f} s")
    chosen = rows["schedule"].value_counts() if "schedule" in rows else pd.Series(dtype=int)
    lines = [f"- auto never slower (predicted) than any fixed kind it weighed: {'met' if not slower else 'NOT met'} "
             f"({len(slower)} of {len(rows)} rows slower, {weighed} (row, kind) pairs that fit"
             + "".join(f"; {x}" for x in slower) + "); kinds chosen: "
             + ", ".join(f"{k} {n}" for k, n in chosen.items())
             + f"; rows with a kind over the limit: {int((over != '').sum())}"]
    keys = CELL + ["method", "stage_split", "sim_replicas"]
    base = df[df[SCHED] == "1f1b"][keys + ["pred_step_s"]].rename(columns={"pred_step_s": "step_1f1b_row_s"})
    both = rows.merge(base.drop_duplicates(keys), on=keys)
    if len(both):
        worse = both[both["pred_step_s"] > both["step_1f1b_row_s"] * (1 + 1e-9)]
        lines.append(f"- auto never slower than the same method's `--schedule 1f1b` row of the cell: "
                     f"{'met' if worse.empty else 'NOT met'} ({len(worse)} of {len(both)} rows slower; median "
                     f"1f1b / auto {float((both['step_1f1b_row_s'] / both['pred_step_s']).median()):.3f})")
    return lines


def criteria_markdown(df: pd.DataFrame, splits: list[str], auto: str | None) -> str:
    lines = []
    for lbl in splits:
        d = _dynamic(df, lbl)
        behind = d[d["ratio"] < 1]
        lines.append(f"- {lbl} never behind any method: {'met' if behind.empty else 'NOT met'} "
                     f"({len(behind)} of {len(d)} cells behind"
                     + ("".join(f"; {r.dataset} {_tok(r.tokens)} P{r.num_stages} DP{r.dp}: {r.best_other} "
                                f"{1 / r.ratio - 1:+.1%}" for r in behind.itertuples()) if len(behind) else "") + ")")
    for lbl in splits:
        d = df[(df["label"] == lbl) & df["load_ok"].astype(bool)]
        lim = np.where(d["num_stages"] <= 16, 0.10, 0.20)
        miss = d[(d["gap_to_ideal"] > lim) & (d["num_stages"] <= 32)]
        lines.append(f"- {lbl} within 10% (P <= 16) / 20% (P = 32) of ideal where load_ok: "
                     f"{'met' if miss.empty and len(d) else 'NOT met' if len(d) else 'no load_ok cells'} "
                     f"({len(miss)} of {len(d)} load_ok cells miss"
                     + "".join(f"; {r.dataset} {_tok(r.tokens)} P{r.num_stages} DP{r.dp}: {_pct(r.gap_to_ideal)} "
                               f"(bubble {r.mean_bubble:.2f}, padding {r.padding_fraction:.3f}, gap to bound "
                               f"{_pct(r.gap_to_bound)}{terms_text(r)})" for r in miss.itertuples()) + ")")
    if auto is not None:
        d = df[(df["label"] == auto) & (df["num_stages"] <= 16)]
        miss = d[d["attainable"] < 0.85]
        ceiling = d["attainable"] * (1 + d["gap_to_ideal"])
        lines.append(f"- {auto} attainable >= 0.85 at P <= 16: {'met' if miss.empty else 'NOT met'} "
                     f"({len(miss)} of {len(d)} cells below; lowest {d['attainable'].min():.2f}; the split's ceiling "
                     f"(mean / busiest stage's ideal work) below 0.85 in {int((ceiling < 0.85).sum())} of them)")
    for lbl in splits:
        d = df[df["label"] == lbl]
        miss = d[d["plan_over_step"] > 0.05]
        lines.append(f"- {lbl} plan time <= 5% of its step: {'met' if miss.empty else 'NOT met'} "
                     f"({len(miss)} of {len(d)} cells over; max {d['plan_over_step'].max():.3f}, pack share "
                     f"{(d['pack_s'] / d['plan_s']).median():.2f} median)")
        n = planners_needed(d["plan_over_step"], _ranks(d))
        lines.append(f"- {lbl} planned ahead (`--plan-ahead N`: N planner processes per rank, shared by the P x DP "
                     f"ranks, a step waits only when its plan takes longer than N x P x DP steps): no step waits with N = 1 in {int((n == 1).sum())} of "
                     f"{len(d)} cells, N <= 4 in {int((n <= 4).sum())}, at most N = {int(n.max()) if len(n) else 0}")
    return "\n".join(lines)


def _ranks(d: pd.DataFrame) -> pd.Series:
    """The job's ranks per cell: P x DP (virtual stages add none)."""
    return d["num_stages"].astype(int) * d["dp"].astype(int)


def planners_needed(plan_over_step: pd.Series, ranks: pd.Series | int = 1) -> pd.Series:
    """Planner processes per rank (``--plan-ahead N``) with which no step waits for its plan:
    ceil(plan time / (ranks x step time)), at least 1 (``dynmb.runtime.planahead``: the job's ranks share
    the planning, ``ranks`` x N processes plan ``ranks`` x N steps at once)."""
    per_rank = plan_over_step.astype(float) / np.asarray(ranks, dtype=float)
    return np.maximum(1, np.ceil(per_rank - 1e-12)).astype(int)


def spec_header(link: str) -> str:
    """The GPUSpec constants, the link and their sources (the ``dynmb.costmodel.gpu`` docstring)."""
    lines = ["GPUCostModel constants (dynmb.costmodel.gpu.H100_SXM):"]
    lines += [f"  {k} = {v:g}" for k, v in asdict(gpu.H100_SXM).items()]
    comm = gpu.LINKS[link]
    lines.append(f"  link {link}: alpha = {comm.alpha_s * 1e6:g} us, bandwidth = {comm.bytes_per_s / 1e9:g} GB/s")
    doc = gpu.__doc__ or ""
    if "Sources of the constants" in doc:
        lines.append(doc[doc.index("Sources of the constants"):].strip())
    return "\n".join(lines)
