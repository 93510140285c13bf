"""``slice_fitting`` never vs auto on one replica's share of the realistic study's batch (the setting of
the probe of studies/slicing/notes.md "Probe: slicing sequences that fit": a seeded 1/8 of 4M tokens, DP 1, ``--schedule auto``, the
``--stage-split auto`` split of that share, the GPU cost model, 80 GiB, ``--oversize truncate``).

Prints, for each setting, the predicted step, ``ideal_s`` and the gap to it, the tokens kept, microbatches,
the threshold kept (``slice_threshold``), sequences sliced, each option's predicted step
(``meta["slice_fitting"]``) and the CPU seconds of the plan.

    PYTHONPATH=$PWD python3 -m studies.scaling.slice_fitting longtail 16 llama2-7b
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from studies.scaling import scaling

import dynmb
from dynmb import data
from dynmb.costmodel.gpu import GPUCostModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("stages", type=int)
    ap.add_argument("model", nargs="?", default="llama2-7b")
    ap.add_argument("--oversize", default="truncate", choices=["truncate", "split"])
    args = ap.parse_args()
    trace = data.load_trace(args.trace)
    cfg = scaling.model_for(args.model, [trace])
    batch = scaling.token_batch(trace, 4_000_000, 8, 0)
    share = batch[np.random.default_rng(0).permutation(batch.size)[: batch.size // 8]]
    cfg = scaling.resolve_stage_split(cfg, args.stages, "auto", stage_cost=scaling.ideal_cost(share, "ib"))
    for mode in ("never", "auto"):
        planner = dynmb.Planner(model=cfg, num_stages=args.stages, memory_limit="80GiB",
                                cost_model=GPUCostModel(cfg, args.stages), schedule="auto", oversize=args.oversize,
                                slice_fitting=mode)
        t0 = time.process_time()
        step = planner.plan(share)
        cpu_s = time.process_time() - t0
        sim, plan = step.sim, step.plan
        options = {k: None if v is None else round(v, 4) for k, v in plan.meta.get("slice_fitting", {}).items()}
        print(f"{args.trace} P{args.stages} {args.oversize} slice_fitting={mode}: step {sim.makespan_s:.4f} s, ideal "
              f"{sim.ideal_s:.4f} s ({sim.makespan_s / sim.ideal_s - 1:+.1%}), {plan.real_tokens} tokens, "
              f"{plan.num_microbatches} microbatches, kind {plan.schedule_kind}, threshold "
              f"{plan.meta.get('slice_threshold')}, {len(plan.slice_groups())} sliced (slices of "
              f"{plan.meta.get('slice_len')}), {len(plan.meta.get('truncated', []))} truncated, options {options}, "
              f"{cpu_s:.1f} CPU s", flush=True)


if __name__ == "__main__":
    main()
