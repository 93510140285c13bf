"""The public API in one script: plan a global batch with every method, simulate, and sample
microbatches for a training loop -- only names exported by ``import dynmb`` (and the shipped
length traces of ``dynmb.data``).

    python experiments/api_example.py --dataset sharegpt --global-batch 32 --memory-limit 1GiB
"""

from __future__ import annotations

import argparse

import dynmb
from dynmb.data import load_trace, sample_batch

METHODS = ("fixed", "sorted", "packed", "token-budget", "dynapipe", "dynamic")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default="sharegpt", help="shipped trace (default sharegpt)")
    ap.add_argument("--global-batch", type=int, default=32, help="sequences per global batch (default 32)")
    ap.add_argument("--memory-limit", default="1GiB", help="per-GPU limit (default 1GiB)")
    ap.add_argument("--model", default="small", help="model preset or preset:field=value (default small)")
    ap.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    args = ap.parse_args()

    planner = dynmb.Planner(model=args.model, num_stages=args.stages, memory_limit=args.memory_limit)
    trace = load_trace(args.dataset)
    batch = sample_batch(trace, args.global_batch, 0)
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


if __name__ == "__main__":
    main()
