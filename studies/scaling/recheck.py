"""The final check's alternatives (``_scaling_final``, the Planner's list) for ``dynamic`` rows run before the list grew.

Rows written before scaling27 (no ``final_alternatives`` column) were checked against ``FINAL_METHODS`` at the ranked
budgets alone. For each such row of the folders given, the cell is rebuilt (the same batch: ``token_batch`` of
the row's trace, tokens, DP and seed) on the layout the row recorded (``layer_split``, head shards included: no
second split search), and every alternative of ``final.alternatives`` under the row's kind is planned with
``plan_once``. Printed per row: the row's step, the fastest alternative that fits, and the step the row would keep
(the shorter; the fitting-slice check ran after the final check, so a sliced row's step stays unless an
alternative beats it too). The kind is the row's kept plan's (``schedule``), which may differ from the kind of
dynamic's own packing where the old check replaced it.

    PYTHONPATH=$PWD nice -n 15 python3 -m studies.scaling.recheck results/s27/p8_wikitext2_llama2-7b/dyn

``--own T,M,P,LAYOUT``: the ``dynamic`` row of trace T, model M, P stages (4M tokens, DP 8, seed 0, 80 GiB, ``--schedule
auto``, one replica simulated, ``oversize`` truncate: the study's cell) on the layout LAYOUT (the ``split search`` line
a row prints) before its fitting-slice check: dynamic's own packing, then the final check (``_scaling_final``). The
fitting-slice check only replaces a plan by a strictly faster one, so this step bounds the row's from above; it
costs seconds where the slice check at 4M tokens costs minutes.
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd
from studies.scaling.final import alternatives, final_check, fits
from studies.scaling.library_row import layout_of
from studies.scaling.scaling import Cell, model_for, plan_once, saturated

from dynmb import data
from dynmb.costmodel import gpu
from dynmb.memory.model import get_memory_model
from dynmb.packing import PackingError

__all__ = ["recheck_row", "main"]


def recheck_row(row: pd.Series) -> str:
    """One line: the row's step against every alternative of the current check (module doc)."""
    c = {k: row[k] for k in ("dataset", "model", "tokens", "num_stages", "dp", "method", "stage_split", "link",
                             "memory_limit_bytes", "seed", "oversize", "sim_replicas", "mb_tokens", "schedule_key",
                             "virtual", "slice_fitting")}
    c.update(tokens=int(c["tokens"]), num_stages=int(c["num_stages"]), dp=int(c["dp"]), seed=int(c["seed"]),
             memory_limit_bytes=int(c["memory_limit_bytes"]), sim_replicas=int(c["sim_replicas"]),
             mb_tokens=int(c["mb_tokens"]), virtual=int(c["virtual"]))
    trace = data.load_trace(c["dataset"])
    cell = Cell(c, trace, model_for(c["model"], [trace]))
    P = c["num_stages"]
    cfg = layout_of(cell.cfg, P, str(row["layer_split"]))
    cm = gpu.GPUCostModel(cfg, P, link=c["link"])
    cell._models[c["stage_split"]] = (cfg, cm, saturated(cm), get_memory_model(None, cfg, P))
    steps = {}
    for name, spec in alternatives(cell, c, str(row["schedule"])).items():
        try:
            alt = plan_once(cell, c, spec.method, spec.mbs)
        except (PackingError, ValueError):
            continue
        if fits(alt):
            steps[name] = float(alt["pred_step_s"])
    best = min(steps, key=lambda n: steps[n])
    keep = min(float(row["pred_step_s"]), steps[best])
    return (f"{c['model']} {c['dataset']} P {P}: row {row['pred_step_s']:.4f} s ({row.get('grouping') or 'own'}); "
            f"fastest alternative {best} {steps[best]:.4f} s; kept {keep:.4f} s; every alternative: "
            + " ".join(f"{n} {s:.4f}" for n, s in steps.items()))


def own_row(trace_name: str, model: str, P: int, layout: str) -> str:
    """One line: the cell's ``dynamic`` row on ``layout`` before the fitting-slice check (``--own``)."""
    c = dict(dataset=trace_name, model=model, tokens=4_000_000, num_stages=P, dp=8, method="dynamic",
             stage_split="search", link="ib", memory_limit_bytes=80 * 2**30, seed=0, oversize="truncate",
             sim_replicas=1, mb_tokens=4096, schedule_key="auto", virtual=1, slice_fitting="never")
    trace = data.load_trace(trace_name)
    cell = Cell(c, trace, model_for(model, [trace]))
    cfg = layout_of(cell.cfg, P, layout)
    cm = gpu.GPUCostModel(cfg, P, link="ib")
    cell._models["search"] = (cfg, cm, saturated(cm), get_memory_model(None, cfg, P))
    row = final_check(cell, c, plan_once(cell, c, "dynamic", None), plan_once)
    return (f"{model} {trace_name} P {P} ({layout}): own {row['own_step_s']:.4f} s, after the final check "
            f"{row['pred_step_s']:.4f} s ({row['grouping'] or 'own'}, {row['schedule']}); {row['final_alternatives']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="*", help="result folders of dynamic rows")
    ap.add_argument("--own", help="T,M,P,LAYOUT: the cell's dynamic row before the slice check (module doc)")
    args = ap.parse_args(argv)
    if args.own:
        trace_name, model, P, layout = args.own.split(",")
        print(own_row(trace_name, model, int(P), layout), flush=True)
    for folder in args.folders:
        df = pd.read_csv(f"{folder}/scaling.csv")
        for _, row in df[(df["method"] == "dynamic") & (df["status"] == "ok")].iterrows():
            print(recheck_row(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
