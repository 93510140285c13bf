"""Per-stage recomputation of leading blocks chosen with the split (``ModelConfig.recompute_blocks``, chosen by
``stage_split="auto"``'s memory relief, ``dynmb.planning.memory_split``): the judged 24 GiB gsm8k cells and 80 GiB
P 16, main against this branch.

Each cell is ``studies.shortdoc.shortdoc.cell`` (the judged setting: public ``Planner``, ``GPUCostModel`` H100,
``schedule="auto"``, ``stage_split="auto"`` on the trace, embedding first), one JSON row per cell with the chosen
split and recomputed blocks (``split_recompute``: None on main, whose ``Relief`` has no such field). Run it once
with this tree on ``PYTHONPATH`` and once with main's (the script imports only names both have); ``--others``
names the methods to plan beside dynamic (default none: dynamic alone). ``--without-recompute`` plans every
method on the cell's layout with its recomputed blocks dropped (the tuned-baseline row: each method's faster of
the two is kept).

    PYTHONPATH=$PWD nice -n 10 python3 -m studies.shortdoc.stage_recompute --out results/rc_branch.jsonl
    PYTHONPATH=<a checkout of bc7c598> nice -n 10 python3 studies/shortdoc/stage_recompute.py --out results/rc_main.jsonl
    python3 -m studies.shortdoc.stage_recompute --table results/rc_main.jsonl results/rc_branch.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

import dynmb
from dynmb import data
from studies.scaling import scaling
from studies.shortdoc import shortdoc

CELLS = (("llama2-7b", 8, "24GiB"), ("llama3.1-8b", 8, "24GiB"), ("llama2-7b", 16, "24GiB"),
         ("llama3.1-8b", 16, "24GiB"), ("llama2-7b", 16, "80GiB"), ("llama3.1-8b", 16, "80GiB"))
"""(model, P, limit) of the cells, gsm8k each."""


def _without_recompute(model: str, P: int, limit: str, names: list[str]) -> dict:
    """Every method in ``names`` planned on the branch's chosen layout with its recomputed blocks dropped."""
    trace = data.load_trace("gsm8k")
    cfg = scaling.model_for(model, [trace])
    planner = shortdoc.planner_for(cfg, trace, P, limit, shortdoc.Variant())
    layout = replace(planner.model_cfg, recompute_blocks=None)
    plain = dynmb.Planner(model=layout, num_stages=P, memory_limit=limit, cost_model=shortdoc.Variant().gpu(layout, P),
                          schedule="auto", stage_split="even", workload=trace)
    batch = scaling.token_batch(trace, 500_000, 1, 0)
    steps = shortdoc.others(plain, batch, [n for n in names if n != "dynamic"])
    if "dynamic" in names:
        steps["step_dynamic"] = plain.plan(batch, "dynamic").sim.makespan_s
    return {"trace": "gsm8k", "model": model, "P": P, "limit": limit, "layout": "without recompute",
            "split": list(layout.stage_layer_counts(P)), **steps}


def run(cells: list[tuple[str, int, str]], names: list[str], without: bool) -> list[dict]:
    rows = []
    for model, P, limit in cells:
        if without:
            rows.append(_without_recompute(model, P, limit, names))
        else:
            trace = data.load_trace("gsm8k")
            row = shortdoc.cell("gsm8k", trace, model, P, limit, names)
            cfg = scaling.model_for(model, [trace])
            planner = shortdoc.planner_for(cfg, trace, P, limit, shortdoc.Variant())
            blocks = getattr(planner.model_cfg, "recompute_blocks", None)
            row["split_recompute"] = None if blocks is None else list(blocks)
            rows.append(row)
        print(json.dumps(rows[-1], default=float), flush=True)
    return rows


def table(main_rows: pd.DataFrame, branch_rows: pd.DataFrame) -> str:
    """Markdown: per cell, main -> branch step, gap against the balanced split's ideal, kind, microbatches, the
    branch's split and recomputed blocks, its gap terms."""
    key = ["model", "P", "limit"]
    m = main_rows.set_index(key)
    lines = ["| model | P | limit | step s main -> branch | ratio | gap (balanced ideal) | kind | mb | branch split "
             "| recompute | schedule / overhead / shape (branch) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for _, r in branch_rows.iterrows():
        o = m.loc[(r["model"], r["P"], r["limit"])]
        terms = " / ".join(f"{100 * r.get(f'gap_{t}', np.nan):.1f}" for t in ("schedule", "overhead", "shape"))
        lines.append(f"| {r['model']} | {r['P']} | {r['limit']} | {o['step_s']:.4f} -> {r['step_s']:.4f} | "
                     f"{r['step_s'] / o['step_s']:.4f} | {100 * o['gap_balanced']:+.1f}% -> "
                     f"{100 * r['gap_balanced']:+.1f}% | {o['kind']} -> {r['kind']} | {o['microbatches']} -> "
                     f"{r['microbatches']} | {r['split']} | {r.get('split_recompute')} | {terms} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cells", default="", help="indices into CELLS, comma-separated (default all)")
    ap.add_argument("--others", default="", help="methods planned beside dynamic, comma-separated")
    ap.add_argument("--without-recompute", action="store_true")
    ap.add_argument("--table", nargs=2, type=Path, metavar=("MAIN", "BRANCH"))
    a = ap.parse_args(argv)
    if a.table:
        print(table(*(pd.read_json(p, lines=True) for p in a.table)))
        return 0
    cells = [CELLS[int(i)] for i in a.cells.split(",")] if a.cells else list(CELLS)
    names = [n for n in a.others.split(",") if n]
    rows = run(cells, names, a.without_recompute)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        with a.out.open("a") as f:
            for r in rows:
                f.write(json.dumps(r, default=float) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
