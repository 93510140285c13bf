"""Headroom: how far ahead of the tuned baselines ``dynamic`` is in its own predictions, before any real run.

For ``--steps`` global batches of a trace (the compare's batches: batch 32, seed 0), each planned by the public
``dynmb.Planner`` with the shipped fitted cost model, it prints the summed predicted step of ``dynamic`` and of
``balanced`` / ``token-budget`` at every budget the compare's ``-best`` rows sweep (the budget tuned in
hindsight is the one with the smallest sum). A real run cannot show a larger lead than the plans promise
unless the model errs in dynamic's favour, so the ratio printed last bounds what the compare can measure::

    python studies/compare/headroom.py --model small --steps 12
"""

from __future__ import annotations

import argparse

import dynmb
from dynmb.data import load_trace, sample_batch

SWEEPS = {"balanced": (4, 8, 16, 32, 64), "token-budget": (16, 32, 64, 128, 256)}
"""The budgets (memory maximum / d) each tuned baseline is swept over."""


def _total(planner: dynmb.Planner, batches: list, method: str, budget: int | None) -> float:
    """Summed predicted step of ``method`` (at ``budget``) over ``batches``; inf when a batch does not pack."""
    total = 0.0
    for lengths in batches:
        try:
            step = planner.plan(lengths, method=method, **({"mbs": budget} if budget else {}))
        except ValueError:
            return float("inf")
        total += float(step.plan.predictions["pred_step_s"])
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--dataset", default="sharegpt")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--memory-limit", default="1GiB")
    args = parser.parse_args(argv)
    planner = dynmb.Planner(model=args.model, num_stages=2, memory_limit=args.memory_limit)
    trace = load_trace(args.dataset)
    batches = [sample_batch(trace, 32, 0, step=k) for k in range(args.steps)]
    dynamic = _total(planner, batches, "dynamic", None)
    print(f"{args.model}, {args.dataset}, {args.steps} batches: dynamic {dynamic:.3f} s predicted")
    for method, budgets in SWEEPS.items():
        totals = {d: _total(planner, batches, method, d) for d in budgets}
        best = min(totals, key=lambda d: totals[d])
        row = ", ".join(f"/{d} {t:.3f}" for d, t in totals.items())
        print(f"  {method}: {row}; tuned /{best}: dynamic {totals[best] / dynamic:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
