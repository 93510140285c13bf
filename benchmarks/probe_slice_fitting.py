"""Probe (not a feature): what slicing sequences that DO fit would give, on one replica's share of the
realistic study's batch (``experiments/scaling.py``: 4M tokens, DP 8, the GPU cost model, 80 GiB).

``oversize="split"`` slices only sequences longer than the longest row that fits
(``dynmb.planning.slicing.longest_row``). This probe lowers that threshold to ``row / k`` (k = 2, 4) by
substituting ``longest_row`` in the planner for the run of this script only, so every sequence longer than
``row / k`` runs as a chain of slices (slice lengths, placement and fill chosen by ``plan_split`` as usual)
while the rest is packed by ``dynamic`` as usual, and prints the step, ``ideal_s`` and tokens against
``truncate`` and plain ``split`` (k = 1). One replica's share: a seeded 1/8 of the global batch, DP 1,
``--schedule auto``, the ``--stage-split auto`` split of that share.

    PYTHONPATH=$PWD python3 benchmarks/probe_slice_fitting.py longtail 16 llama2-7b
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import scaling  # noqa: E402

import dynmb  # noqa: E402
import dynmb.planning.planner as planner_mod  # noqa: E402
import dynmb.planning.slicing as slicing_mod  # noqa: E402
from dynmb import data  # noqa: E402
from dynmb.costmodel.gpu import GPUCostModel  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("stages", type=int)
    ap.add_argument("model", nargs="?", default="llama2-7b")
    args = ap.parse_args()
    trace = data.load_trace(args.trace)
    cfg = scaling.model_for(args.model, [trace])
    batch = scaling.token_batch(trace, 4_000_000, 8, 0)
    share = batch[np.random.default_rng(0).permutation(batch.size)[: batch.size // 8]]
    cfg = scaling.resolve_stage_split(cfg, args.stages, "auto", stage_cost=scaling.ideal_cost(share, "ib"))
    real = slicing_mod.longest_row
    for k in (None, 1, 2, 4):
        if k is not None:
            lowered = (lambda kk: lambda spec, m, mm: max(slicing_mod.MIN_SLICE, real(spec, m, mm) // kk))(k)
            planner_mod.longest_row = slicing_mod.longest_row = lowered
        try:
            planner = dynmb.Planner(model=cfg, num_stages=args.stages, memory_limit="80GiB",
                                    cost_model=GPUCostModel(cfg, args.stages), schedule="auto",
                                    oversize="truncate" if k is None else "split")
            t0 = time.process_time()
            step = planner.plan(share)
            sim, plan = step.sim, step.plan
            print(f"{args.trace} P{args.stages} {'truncate' if k is None else f'split, rows / {k}'}: step "
                  f"{sim.makespan_s:.4f} s, ideal {sim.ideal_s:.4f} s ({sim.makespan_s / sim.ideal_s - 1:+.1%}), "
                  f"{plan.real_tokens} tokens, {plan.num_microbatches} microbatches, "
                  f"{len(plan.meta.get('sliced', {}))} sliced (slices of {plan.meta.get('slice_len')}), "
                  f"{len(plan.meta.get('truncated', []))} truncated, {time.process_time() - t0:.1f} CPU s", flush=True)
        finally:
            planner_mod.longest_row = slicing_mod.longest_row = real


if __name__ == "__main__":
    main()
