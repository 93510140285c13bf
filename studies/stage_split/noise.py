"""Which layouts of the study's ``--stage-split search`` the noise rule changes (``split_search.pick_layout``).

For each (model, trace, P) cell of ``studies/scaling/scaling.py`` (4M tokens, DP 8, ``--schedule auto``, ib,
80 GiB, oversize truncate, seed 0) the search is built as the study's ``search`` rows build it
(``_scaling_split.row_search``: sample batches drawn from the whole trace, ``global_batch`` = the cell's
sequences; candidates from the min-max split of the trace's work, ``scaling.ideal_cost``). Every candidate is
planned once on ``--batches`` sample batches (``SplitSearch.runs_of``; the first two are the default
search's two, ``sample_batch`` draws step 0, 1, ...), then three rules pick from the same scores:

- ``old``: the smallest mean score on the first two batches, ``S0`` unless another is strictly smaller (the
  rule before ``pick_layout``);
- ``new2``: ``pick_layout`` on the first two batches (the library default, ``batches = 2``);
- ``newB``: ``pick_layout`` on all ``--batches``.

Only the layer split is chosen here; the study then shards the LM head where that lightens the busiest
stage (``stage_split.planned_layout``), which is the same for the same split. Prints one line per cell as it
goes and a markdown table at the end; ``--out`` writes the rows as JSON.

    PYTHONPATH=$PWD nice -n 19 python3 -m studies.stage_split.noise --models llama2-7b --traces sharegpt --stages 4 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from studies.scaling import scaling
from studies.scaling.split import row_search

from dynmb import data
from dynmb.core.config import parse_bytes
from dynmb.costmodel import gpu
from dynmb.planning.split_search import batch_scores, near_optimal_splits, pick_layout
from dynmb.planning.split_work import workload_lengths


def old_rule(scores: list[list[float]]) -> int:
    """The rule before ``pick_layout``: the smallest mean score, ``S0`` unless another is strictly smaller."""
    means = [float(np.mean(row)) for row in scores]
    best = 0
    for i, m in enumerate(means):
        if m < means[best] * (1 - 1e-9):
            best = i
    return best


def text(split) -> str:
    return " ".join(f"{n:g}" for n in split)


def cell_row(model: str, trace_name: str, P: int, args: argparse.Namespace) -> dict:
    cfg = scaling.model_for(model, [])
    trace = data.load_trace(trace_name)
    c = dict(tokens=scaling.parse_tokens(args.tokens), dp=args.dp, seed=args.seed, num_stages=P, link="ib",
             memory_limit_bytes=parse_bytes("80GiB"), oversize="truncate", schedule_key="auto")
    batch = scaling.token_batch(trace, c["tokens"], c["dp"], c["seed"])
    search = replace(row_search(cfg, c, P, 1, int(batch.size)), batches=int(args.batches))
    cm = gpu.GPUCostModel(cfg, P, link="ib")
    t0 = time.process_time()
    cands, near = near_optimal_splits(cfg, P, scaling.ideal_cost(trace, "ib"), half_blocks=True,
                                      tolerance=search.tolerance, max_candidates=search.max_candidates)
    batches = search.sample_batches(workload_lengths(trace, cfg))
    runs = [search.runs_of(cfg, s, P, cm, batches) for s in cands]
    cpu_s = time.process_time() - t0
    full = batch_scores(runs)
    two = [row[:2] for row in full]
    old, new2, newb = old_rule(two), pick_layout(two), pick_layout(full)
    gains = [[1 - a / b for a, b in zip(row, full[0])] for row in full]
    return {"model": model, "trace": trace_name, "P": P, "candidates": [text(s) for s in cands], "near": near,
            "gains": gains, "old": old, "new2": new2.index, "newB": newb.index, "rule2": new2.rule,
            "ruleB": newb.rule, "cpu_s": cpu_s, "batches": int(args.batches)}


def markdown(rows: list[dict]) -> str:
    out = ["| model | trace | P | layout, old rule (2 batches) | its gains over min-max per batch | new rule, 2 batches "
           "| new rule, all batches | CPU s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def name(i: int) -> str:
            return "min-max " + r["candidates"][0] if i == 0 else r["candidates"][i]
        g = " / ".join(f"{x:+.2%}" for x in r["gains"][r["old"]]) if r["old"] else "-"
        out.append(f"| {r['model']} | {r['trace']} | {r['P']} | {name(r['old'])} | {g} | "
                   f"{'same' if r['new2'] == r['old'] else name(r['new2'])} | "
                   f"{'same as new2' if r['newB'] == r['new2'] else name(r['newB'])} | {r['cpu_s']:.0f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["llama2-7b", "llama3.1-8b"])
    ap.add_argument("--traces", nargs="+", default=["sharegpt", "wikitext2", "longtail"])
    ap.add_argument("--stages", nargs="+", type=int, default=[4, 8, 16])
    ap.add_argument("--tokens", default="4M")
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batches", type=int, default=4, help="sample batches planned (default 4; rules on 2 and on all)")
    ap.add_argument("--skip", nargs="*", default=[], help="cells to leave out, as model:trace:P")
    ap.add_argument("--out", default=None, help="JSON rows (written after each cell)")
    args = ap.parse_args(argv)
    rows = []
    for P in args.stages:                           # the cheaper cells first
        for trace_name in args.traces:
            for model in args.models:
                if f"{model}:{trace_name}:{P}" in args.skip:
                    continue
                r = cell_row(model, trace_name, P, args)
                rows.append(r)
                print(f"{model} {trace_name} P{P}: old {r['old']} new2 {r['new2']} newB {r['newB']} "
                      f"({r['cpu_s']:.0f} CPU s); gains {[[round(x, 4) for x in g] for g in r['gains']]}; "
                      f"rule2: {r['rule2']}; ruleB: {r['ruleB']}; candidates {r['candidates']}", flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
