"""Where dynamic's gap to ``ideal_s`` goes (``dynmb.timing.gap_terms``), on one replica's share of the realistic
study's batch (``studies/scaling/scaling.py``: 4M tokens, DP 8, the GPU cost model, 80 GiB), as
``studies/scaling/slice_fitting.py`` takes it: a seeded 1/8 of the global batch, DP 1, the ``Planner``
with ``schedule="auto"``, the ``--stage-split auto`` split of that share, sequences too long to fit alone
truncated. ``ideal_s`` is priced as the study prices it: GEMMs saturated (``scaling.saturated``), the drain
kept under a split backward (``plan_ideal_v``). Prints one markdown row per (trace, P): step, ideal, the
gap and its terms in % of ``ideal_s`` (they add up to the gap), the rank deciding the bound.

    PYTHONPATH=$PWD nice -n 19 python3 -m studies.scaling.gap_terms --traces sharegpt,wikitext2,longtail --stages 8,16
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from studies.scaling import scaling

import dynmb
from dynmb import data
from dynmb.costmodel.gpu import GPUCostModel
from dynmb.timing.gap_terms import TERMS, gap_terms


def one(trace_name: str, P: int, model: str) -> str:
    trace = data.load_trace(trace_name)
    cfg = scaling.model_for(model, [trace])
    batch = scaling.token_batch(trace, 4_000_000, 8, 0)
    share = batch[np.random.default_rng(0).permutation(batch.size)[: batch.size // 8]]
    cfg = scaling.resolve_stage_split(cfg, P, "auto", stage_cost=scaling.ideal_cost(share, "ib"))
    cm = GPUCostModel(cfg, P)
    t0 = time.process_time()
    step = dynmb.Planner(model=cfg, num_stages=P, memory_limit="80GiB", cost_model=cm, schedule="auto",
                         oversize="truncate").plan(share)
    cpu = time.process_time() - t0
    sim = step.sim
    t = gap_terms(step.plan, step.schedule, cm, sim.makespan_s, ideal_model=scaling.saturated(cm),
                  ideal_split=False).check()
    assert abs(t.bound - sim.bound_s) <= 1e-9 * t.bound, (t.bound, sim.bound_s)
    pct = [f"{100 * v:+.1f}" for v in t.fractions().values()]
    return (f"| {trace_name} | {P} | {sim.kind} | {step.plan.num_microbatches} | {t.step:.4f} | {t.ideal:.4f} | "
            f"{100 * (t.step / t.ideal - 1):+.1f} | " + " | ".join(pct) + f" | {t.rank} | {cpu:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default="sharegpt,wikitext2,longtail")
    ap.add_argument("--stages", default="8,16")
    ap.add_argument("--model", default="llama2-7b")
    args = ap.parse_args()
    print("| trace | P | kind | mb | step s | ideal s | gap % | " + " | ".join(TERMS) + " | rank | plan CPU s |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(TERMS) + "---|---|", flush=True)
    for name in args.traces.split(","):
        for P in map(int, args.stages.split(",")):
            print(one(name, P, args.model), flush=True)


if __name__ == "__main__":
    main()
