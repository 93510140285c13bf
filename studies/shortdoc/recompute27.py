"""Recomputed leading blocks on more stages than the first, each layout's split re-balanced with every stage's extra
forward (``dynmb.planning.memory_split.rebalanced_layout``): does any close a 24 GiB short-document cell (issue 39)?

One cell as ``studies.shortdoc.shortdoc`` plans it (the public ``Planner``, ``GPUCostModel`` H100, ``schedule="auto"``,
the cell's batch). Per cell, dynamic's plan on: the planner's default layout (``stage_split="auto"``, the embedding
placed by ``embedding="auto"``), then, at that place, the layout recomputing one leading block on each of the first
``k`` stages for every ``k`` of ``--first``, its split re-balanced (planned with that split fixed). Each row: the
split, blocks, the relief's ``step_proxy`` and admitted tokens, the step and its gap terms (``gap_terms``, GEMMs
saturated, against the ideal of the layout without recomputation: the extra forward is in ``passes``).

    PYTHONPATH=$PWD nice -n 10 python3 -m studies.shortdoc.recompute27 --cells sharegpt:llama2-7b:16 --first 1,2,4,8
    python3 -m studies.shortdoc.recompute27 --table results/recompute27.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import pandas as pd

import dynmb
from dynmb import data
from dynmb.core.config import ModelConfig
from dynmb.costmodel.gpu import GPUCostModel
from dynmb.planning import memory_split
from dynmb.timing.gap_terms import gap_terms
from studies.common import append_row
from studies.scaling import scaling
from studies.shortdoc import shortdoc


def _row(planner: dynmb.Planner, batch: np.ndarray, layout: ModelConfig, P: int, inputs: memory_split.ReliefInputs,
         mean_len: int) -> dict:
    """Dynamic's plan of ``batch`` on ``planner`` (whose layout is ``layout``): step, terms, proxy, admission."""
    t0 = time.process_time()
    step = planner.plan(batch, "dynamic")
    cpu = time.process_time() - t0
    cm = planner.cost_model
    terms = gap_terms(step.plan, step.schedule, cm, step.sim.makespan_s,
                      ideal_model=scaling.saturated(cm.without_block_recompute()), ideal_split=False).check()
    proxy_s, tokens = memory_split.step_proxy(layout, P, inputs, mean_len)
    blocks = layout.recompute_blocks
    return {"split": list(layout.stage_layer_counts(P)), "blocks": None if blocks is None else list(blocks),
            "embedding": planner.spec.embedding, "proxy_s": proxy_s, "proxy_tokens": tokens,
            "step_s": step.sim.makespan_s, "ideal_s": terms.ideal, "gap": step.sim.makespan_s / terms.ideal - 1,
            "kind": step.plan.schedule_kind, "microbatches": step.plan.num_microbatches,
            "admission": shortdoc.stage_admission(planner.memory_model, planner.memory_limit_bytes)[:4],
            "plan_cpu_s": cpu, **terms.fractions()}


def cell_rows(trace_name: str, model: str, P: int, limit: str, firsts: list[int]) -> list[dict]:
    """The cell's rows (module doc): the default layout, then one block on each of the first ``k`` stages."""
    trace = data.load_trace(trace_name)
    cfg = scaling.model_for(model, [trace])
    batch = scaling.token_batch(trace, 500_000, 1, 0)
    default = shortdoc.planner_for(cfg, trace, P, limit, shortdoc.Variant())
    place = default.spec.embedding
    base = shortdoc.planner_for(cfg, trace, P, limit, shortdoc.Variant(embedding=place)).model_cfg
    base = memory_split.layout_of(base, P, tuple(base.stage_layer_counts(P)))
    inputs = memory_split.ReliefInputs(memory_limit_bytes=default.memory_limit_bytes, schedule_kind="auto",
                                       workload=trace, cost_model=GPUCostModel(base, P), embedding=place)
    mean_len = max(1, int(round(float(trace.mean()))))
    key = {"trace": trace_name, "model": model, "P": P, "limit": limit}
    rows = [{**key, "layout": "default", **_row(default, batch, default.model_cfg, P, inputs, mean_len)}]
    for k in firsts:
        blocks = tuple(1 if i < k else 0 for i in range(P))
        try:
            layout = memory_split.rebalanced_layout(base, P, inputs, blocks)
        except ValueError as e:
            rows.append({**key, "layout": f"first {k}", "status": str(e)[:200]})
            continue
        planner = dynmb.Planner(model=layout, num_stages=P, memory_limit=limit, cost_model=GPUCostModel(layout, P),
                                schedule="auto", stage_split="even", workload=trace, embedding=place)
        rows.append({**key, "layout": f"first {k}", **_row(planner, batch, layout, P, inputs, mean_len)})
    return rows


def table(paths: list[Path]) -> str:
    """Markdown of the rows: step, its ratio to the cell's default layout's, gap to the default's ideal (the
    layout without recomputation of ``planner_for``) and the terms in % of the row's own ideal."""
    df = pd.concat([pd.read_json(p, lines=True) for p in paths], ignore_index=True)
    if "step_s" not in df:
        return ""
    df = df[df["step_s"].notna()]
    default = df[df["layout"] == "default"].set_index(["trace", "model", "P"])
    out = ["| trace | model | P | layout | blocks | step s | / default | gap | kind, mb | admitted 0-3 | schedule | ends | "
           "overhead | shape | passes |", "|" + "---|" * 15]
    for r in df.itertuples():
        base = default.loc[(r.trace, r.model, r.P)]
        blocks = ",".join(map(str, r.blocks)) if isinstance(r.blocks, list) else "none"
        terms = " | ".join(f"{100 * getattr(r, 'gap_' + t):+.1f}" for t in ("schedule", "ends", "overhead", "shape",
                                                                            "passes"))
        out.append(f"| {r.trace} | {r.model} | {r.P} | {r.layout} | {blocks} | {r.step_s:.4f} | "
                   f"{r.step_s / base.step_s:.4f} | {100 * (r.step_s / base.ideal_s - 1):+.1f}% | {r.kind} "
                   f"{int(r.microbatches)} | {', '.join(map(str, r.admission))} | {terms} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", default="sharegpt:llama2-7b:16", help="trace:model:P, comma-separated")
    ap.add_argument("--limit", default="24GiB", help="memory limit per GPU")
    ap.add_argument("--first", default="1,2,4,8", help="k: one block recomputed on each of the first k stages")
    ap.add_argument("--out", type=Path, help="JSON lines of the rows (appended)")
    ap.add_argument("--table", type=Path, nargs="+", help="print the markdown table of these rows and exit")
    args = ap.parse_args(argv)
    if args.table:
        print(table(args.table))
        return 0
    firsts = [int(k) for k in args.first.split(",") if k]
    for spec in args.cells.split(","):
        trace_name, model, P = spec.split(":")
        for row in cell_rows(trace_name, model, int(P), args.limit, firsts):
            print(json.dumps(row, default=float), flush=True)
            append_row(row, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
