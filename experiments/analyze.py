"""Print the README results table (and "dynamic vs best fixed mbs") from a results folder.

What it does: loads the tidy tables of ``DIR`` (and of every folder below it) with
``dynmb.io.results.load_results``. Real runs (``steps``/``memory`` from the runtime) get their
settings joined by ``run_id`` from ``configs`` (the experiment scripts) or ``runs`` (the
flattened ``RunConfig`` of ``dynmb run``) and are summarised with
``dynmb.report.analysis.summarise``: tokens/s, speedup vs ``fixed``, padding, mean bubble,
peak / limit, predicted vs measured step time, plan time. Simulated sweeps (table ``sim``)
get the predicted counterpart. A settings column that varies within a (dataset, limit,
method) group (mbs, reorder, cost_model, ...) is appended to the method label, so nothing is
averaged across configurations. When fixed rows with explicit mbs are present
(``fixed_mbs_sweep.py``), a per-trace table compares ``dynamic`` with the best fixed mbs in
hindsight. The ``scaling`` table is printed per (trace, P, DP).

    python experiments/analyze.py results/sweep_traces --markdown
    python experiments/analyze.py results/fixed_mbs
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pandas as pd

from dynmb import load_results, summarise

TABLES = ("steps", "memory", "runs", "configs", "sim", "scaling")
CONTEXT = ("dataset", "memory_limit_bytes")
VARIANTS = ("mbs", "reorder", "cost_model", "schedule", "num_stages", "dp", "global_batch", "model", "seed", "oversize")
OPTIONAL_SIM = ("speedup_vs_none", "ref_tokens_per_s", "ref_pred_step_s")   # reorder / cost-model ablations
RUNS_RENAME = {"pipeline.memory_limit_bytes": "memory_limit_bytes", "model.name": "model",
               "pipeline.num_stages": "num_stages", "pipeline.schedule": "schedule", "pipeline.reorder": "reorder"}


# --------------------------------------------------------------------------- formatting
def markdown(df: pd.DataFrame, floatfmt: str = "{:.3g}") -> str:
    """A DataFrame (index included) as a GitHub markdown table."""
    flat = df.reset_index()
    cells = [[_fmt(v, floatfmt) for v in row] for row in flat.itertuples(index=False)]
    head = "| " + " | ".join(map(str, flat.columns)) + " |"
    rule = "|" + "|".join("---" for _ in flat.columns) + "|"
    return "\n".join([head, rule] + ["| " + " | ".join(r) + " |" for r in cells])


def _fmt(v, floatfmt: str) -> str:
    if isinstance(v, (float, np.floating)):
        if np.isnan(v):
            return ""
        return f"{v:.0f}" if abs(v) >= 100 else floatfmt.format(v)
    return str(v)


def _limit_label(df: pd.DataFrame) -> pd.DataFrame:
    if "memory_limit_bytes" in df.columns:
        from dynmb.core.config import format_bytes

        df = df.copy()
        df["memory_limit"] = [format_bytes(x) if pd.notna(x) else "" for x in df["memory_limit_bytes"]]
    return df


# --------------------------------------------------------------------------- labelling
def label_variants(df: pd.DataFrame) -> pd.DataFrame:
    """Append settings that vary within a (dataset, limit, method) group to ``method``."""
    df = df.copy()
    ctx = [c for c in CONTEXT if c in df.columns] + ["method"]
    varying = [c for c in VARIANTS if c in df.columns and
               (df.groupby(ctx, dropna=False)[c].nunique(dropna=False) > 1).any()]
    for c in varying:
        df["method"] = df["method"] + [f" {c}={_fmt(v, '{:g}')}" if pd.notna(v) else "" for v in df[c]]
    return df


def real_steps(t: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """``steps`` with the settings columns joined by run_id (configs first, else runs)."""
    steps = t["steps"]
    if t.get("configs") is not None and not t["configs"].empty:
        cfg = t["configs"][t["configs"]["status"] == "ok"].drop(columns=["method", "dataset"], errors="ignore")
        steps = steps.merge(cfg.drop_duplicates("run_id"), on="run_id", how="inner", suffixes=("", "_cfg"))
    elif t.get("runs") is not None and not t["runs"].empty:
        runs = t["runs"].rename(columns=RUNS_RENAME)
        keep = ["run_id"] + [c for c in ("memory_limit_bytes", "mbs", "model", "global_batch", "seed") if c in runs]
        steps = steps.merge(runs[keep].drop_duplicates("run_id"), on="run_id", how="left", suffixes=("", "_run"))
    return {"steps": label_variants(steps), "memory": t.get("memory", pd.DataFrame())}


# --------------------------------------------------------------------------- tables
def real_table(t: dict[str, pd.DataFrame]) -> pd.DataFrame:
    out = summarise(real_steps(t))
    cols = [c for c in ("tokens_per_s", "speedup_vs_fixed", "padding_fraction", "mean_bubble", "peak_over_limit",
                        "pred_step_s", "step_s", "pred_err", "plan_s", "num_microbatches", "steps") if c in out]
    return _limit_label(out[cols].reset_index()).drop(columns="memory_limit_bytes").set_index(
        ["dataset", "memory_limit", "method"])


def sim_table(sim: pd.DataFrame) -> pd.DataFrame:
    ok = label_variants(sim[sim["status"] == "ok"])
    keys = [c for c in CONTEXT if c in ok.columns] + ["method"]
    g = ok.groupby(keys, dropna=False).agg(
        pred_tokens_per_s=("pred_tokens_per_s", "median"), padding_fraction=("padding_fraction", "mean"),
        pred_mean_bubble=("pred_mean_bubble", "median"), pred_peak_over_limit=("pred_peak_over_limit", "max"),
        pred_step_s=("pred_step_s", "median"), plan_s=("plan_s", "median"),
        num_microbatches=("num_microbatches", "mean"), truncated=("truncated", "max"), steps=("step", "size"),
        **{c: (c, "median") for c in OPTIONAL_SIM if c in ok.columns})
    g = g.reset_index()
    base = g[g["method"] == "fixed"].set_index(keys[:-1])["pred_tokens_per_s"].rename("base")
    if not base.empty:
        g = g.join(base, on=keys[:-1])
        g.insert(keys.index("method") + 2, "speedup_vs_fixed", g["pred_tokens_per_s"] / g.pop("base"))
    return _limit_label(g).drop(columns="memory_limit_bytes").set_index(["dataset", "memory_limit", "method"])


def best_fixed(per_config: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Per (dataset, limit): the best fixed mbs in hindsight vs dynamic on ``metric``."""
    fx = per_config[(per_config["method"] == "fixed") & per_config["mbs"].notna()]
    dy = per_config[per_config["method"] == "dynamic"]
    if fx.empty or dy.empty:
        return pd.DataFrame()
    keys = [c for c in CONTEXT if c in per_config.columns]
    best = fx.loc[fx.groupby(keys)[metric].idxmax()].set_index(keys)
    out = pd.DataFrame({"best_fixed_mbs": best["mbs"].astype(int), f"best_fixed_{metric}": best[metric]})
    out["fixed_mbs_tried"] = fx.groupby(keys)["mbs"].apply(lambda s: ",".join(str(int(x)) for x in sorted(s.unique())))
    out[f"dynamic_{metric}"] = dy.groupby(keys)[metric].median()
    out["dynamic_vs_best_fixed"] = out[f"dynamic_{metric}"] / out[f"best_fixed_{metric}"]
    return _limit_label(out.reset_index()).drop(columns="memory_limit_bytes").set_index(["dataset", "memory_limit"])


def real_per_config(t: dict[str, pd.DataFrame]) -> pd.DataFrame:
    if t.get("configs") is None or t["configs"].empty:
        return pd.DataFrame()
    steps = t["steps"]
    if "warmup" in steps:
        steps = steps[~steps["warmup"].astype(bool)]
    tps = steps.groupby("run_id")["tokens_per_s"].median()
    cfg = t["configs"][t["configs"]["status"] == "ok"].copy()
    cfg["tokens_per_s"] = cfg["run_id"].map(tps)
    return cfg.dropna(subset=["tokens_per_s"])


def scaling_table(sc: pd.DataFrame) -> pd.DataFrame:
    ok = sc[sc["status"] == "ok"]
    cols = ["plan_s", "pack_s", "pred_step_s", "efficiency", "mean_bubble", "num_microbatches", "truncated"]
    t = ok.pivot_table(index=["dataset", "num_stages", "dp"], columns="method", values=cols[:5])
    t.columns = [f"{metric} {method}" for metric, method in t.columns]
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("results", help="results folder (its subfolders' tables are concatenated)")
    ap.add_argument("--markdown", action="store_true", help="print markdown tables (the README's format)")
    args = ap.parse_args(argv)
    t = load_results(args.results, tables=TABLES)
    show = (lambda df: markdown(df)) if args.markdown else (lambda df: df.to_string(float_format=lambda x: f"{x:.4g}"))
    printed = False
    if not t["steps"].empty:
        print("## Measured (real runs)\n")
        print(show(real_table(t)), end="\n\n")
        bf = best_fixed(real_per_config(t), "tokens_per_s")
        if not bf.empty:
            print("## Dynamic vs the best fixed mbs in hindsight (measured)\n")
            print(show(bf), end="\n\n")
        printed = True
    if not t["sim"].empty:
        print("## Predicted (simulated)\n")
        print(show(sim_table(t["sim"])), end="\n\n")
        bf = best_fixed(t["sim"][t["sim"]["status"] == "ok"].groupby(
            [c for c in ("dataset", "memory_limit_bytes", "method", "mbs") if c in t["sim"]], dropna=False,
            as_index=False)["pred_tokens_per_s"].median(), "pred_tokens_per_s")
        if not bf.empty:
            print("## Dynamic vs the best fixed mbs in hindsight (predicted)\n")
            print(show(bf), end="\n\n")
        printed = True
    if not t["scaling"].empty:
        print("## Scaling by simulation\n")
        print(show(scaling_table(t["scaling"])), end="\n\n")
        printed = True
    if not printed:
        print(f"analyze: no steps, sim or scaling tables under {args.results}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
