"""The public API in one script: plan a global batch with every method, simulate, and sample
microbatches for a training loop -- only names exported by ``import dynmb``.

The lengths come from a length trace (CSV with a header ``length``, the format ``dynmb lengths``
writes; default: the shipped ``sharegpt`` trace: package data of an installed ``dynmb`` wheel,
else the checkout's ``data/traces/``).

    python experiments/api_example.py --global-batch 32 --memory-limit 1GiB [--lengths trace.csv]
"""

from __future__ import annotations

import argparse
from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd

import dynmb

METHODS = ("fixed", "sorted", "packed", "token-budget", "dynapipe", "dynamic")


def shipped_trace(name: str) -> str:
    """Path of a length trace shipped with dynmb (``dynmb datasets`` lists them)."""
    packaged = resources.files("dynmb.data").joinpath("traces", f"{name}.csv")
    return str(packaged) if packaged.is_file() else str(Path(__file__).resolve().parents[1] / "data" / "traces" / f"{name}.csv")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default=None, help="length trace CSV (column `length`; default: shipped sharegpt)")
    ap.add_argument("--global-batch", type=int, default=32, help="sequences per global batch (default 32)")
    ap.add_argument("--memory-limit", default="1GiB", help="per-GPU limit (default 1GiB)")
    ap.add_argument("--model", default="small", help="model preset or preset:field=value (default small)")
    ap.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    args = ap.parse_args(argv)

    planner = dynmb.Planner(model=args.model, num_stages=args.stages, memory_limit=args.memory_limit)
    trace = pd.read_csv(args.lengths or shipped_trace("sharegpt"))["length"].to_numpy(np.int64)
    batch = np.random.default_rng(0).choice(trace, size=args.global_batch, replace=False)
    print(f"{planner}\n{'method':>13} {'microbatches':>12} {'padding':>8} {'pred step s':>11} {'bubble':>7}")
    for method in METHODS:
        step = planner.plan(batch, method=method)
        print(f"{method:>13} {step.plan.num_microbatches:>12} {step.plan.padding_fraction:>8.3f} "
              f"{step.sim.makespan_s:>11.3f} {step.sim.mean_bubble:>7.3f}")
    sampler = dynmb.DynamicBatchSampler(trace[:256], args.global_batch, model=args.model, num_stages=args.stages,
                                        memory_limit=args.memory_limit, num_replicas=2, rank=0, seed=0)
    sizes = [len(mb) for mb in sampler]
    print(f"sampler, replica 0 of 2: {len(sizes)} microbatches over {len(sampler.plans())} global batches, "
          f"sequences per microbatch {min(sizes)}-{max(sizes)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
