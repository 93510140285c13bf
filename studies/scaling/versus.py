"""Dynamic against every other method, one line a cell, from ``studies/scaling/scaling.py`` result folders.

A cell is (model, trace, P) of the folders given (any number, e.g. a cell's ``dyn``, ``strong`` and ``weak``
runs). Per cell: dynamic's row (the ``--stage-split`` given, ``search`` by default) with its step, kind, grouping
(``_scaling_final``) and fitting slices (``_scaling_slicefit``); every other method's row on every split run, the
shortest step kept as the best other (its method, split and ``-best`` budget divisor); ``dynamic / best other`` (< 1:
dynamic faster) and dynamic's gap to ``ideal_s``. A cell with no dynamic row or no other row is left out.

    python3 -m studies.scaling.versus results/s27/*/*/scaling.csv
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd

__all__ = ["cells", "main"]


def _other(row: pd.Series) -> str:
    div = row.get("budget_div")
    tuned = row["method"].endswith("-best") and pd.notna(div)
    return f"{row['method']}{f'/{int(div)}' if tuned else ''} ({row['stage_split']})"


def _dynamic_plan(row: pd.Series) -> str:
    extra = [str(row["schedule"])]
    if isinstance(row.get("grouping"), str) and row["grouping"]:
        extra.append(row["grouping"])
    if pd.notna(row.get("slice_threshold")):
        extra.append(f"slices > {int(row['slice_threshold'])}: {int(row['sliced'])}")
    return ", ".join(extra)


def cells(df: pd.DataFrame, split: str = "search") -> pd.DataFrame:
    """One row a (model, trace, P): dynamic (``split``) against the fastest other row (module doc)."""
    ok = df[df["status"] == "ok"]
    out = []
    for (model, trace, P), g in ok.groupby(["model", "dataset", "num_stages"], sort=True):
        dyn = g[(g["method"] == "dynamic") & (g["stage_split"] == split)]
        others = g[g["method"] != "dynamic"]
        if dyn.empty or others.empty:
            continue
        d, best = dyn.iloc[0], others.loc[others["pred_step_s"].idxmin()]
        out.append({"model": model, "trace": trace, "P": int(P), "dynamic s": f"{d['pred_step_s']:.4f}",
                    "dynamic plan": _dynamic_plan(d), "best other": _other(best),
                    "best other s": f"{best['pred_step_s']:.4f}",
                    "dynamic / best other": f"{d['pred_step_s'] / best['pred_step_s']:.4f}",
                    "gap to ideal_s": f"{100 * d['gap_to_ideal']:+.1f}%", "others run": len(others)})
    return pd.DataFrame(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="+", help="scaling.csv files of result folders")
    ap.add_argument("--split", default="search", help="dynamic's --stage-split row to compare (default search)")
    args = ap.parse_args(argv)
    df = pd.concat([pd.read_csv(f) for f in args.csv], ignore_index=True)
    table = cells(df, args.split)
    if table.empty:
        print("no cell with a dynamic row and another method's row", file=sys.stderr)
        return 1
    cols = list(table.columns)
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in table.itertuples(index=False):
        print("| " + " | ".join(str(v) for v in row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
