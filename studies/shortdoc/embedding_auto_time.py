"""What ``embedding="auto"`` costs in plan time, by rule: the first batch's (both places plan it at the first ``plan``)
against the workload's sample batches (chosen at construction; the first ``plan`` is a fixed place's).

One cell as ``studies.shortdoc.shortdoc`` plans it (``planner_for``: the public ``Planner``, ``GPUCostModel`` H100,
``schedule="auto"``, ``stage_split="auto"``), in one process, paired: each round builds the ``first`` and the ``last``
planner (each place's layout, as ``auto`` resolves both) and times, in a rotated order, CPU seconds of

- ``first``: the fixed place's first ``plan`` of the cell's batch (today's default), and ``last``'s;
- ``first-batch``: ``choose_embedding`` on the batch (what ``auto``'s first ``plan`` costs without a global batch
  size: both places plan it, the winner's plan returned);
- ``samples``: ``choose_on_samples`` on the workload's sample batches of the batch's size (what ``auto`` adds to the
  construction given ``workload`` and ``global_batch``; its first ``plan`` is then the winner's fixed-place plan).

Prints each round, the medians, the ratios, and both rules' totals (construction + first plan) against ``first``'s.
A ``Planner`` given ``global_batch`` also runs the split search by simulated step (per place, as a fixed place
would); that cost is the split search's and is left out here (both places' layouts are the ``planner_for`` ones).

    PYTHONPATH=$PWD nice -n 10 python3 -m studies.shortdoc.embedding_auto_time --model llama2-7b --stages 16
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import numpy as np
from studies.scaling import scaling
from studies.shortdoc import shortdoc

from dynmb import Planner, data
from dynmb.planning.embedding_choice import Placement, Workload, choose_embedding, choose_on_samples

PLACES = ("first", "last")
TIMED = ("first", "last", "first-batch", "samples")


def _cpu(work: Callable[[], object]) -> tuple[float, object]:
    t0 = time.process_time()
    out = work()
    return time.process_time() - t0, out


def one_round(cfg, trace: np.ndarray, P: int, limit: str, batch: np.ndarray, r: int) -> dict[str, float]:
    """CPU seconds of one round: each place's construction (``build first`` / ``build last``) and the ``TIMED``
    jobs in an order rotated by ``r``; ``samples_place`` is 1.0 where the sample batches chose ``last``."""
    out: dict[str, float] = {}
    planners: dict[str, Planner] = {}
    for place in PLACES:
        out[f"build {place}"], made = _cpu(lambda: shortdoc.planner_for(cfg, trace, P, limit,
                                                                      shortdoc.Variant(embedding=place)))
        assert isinstance(made, Planner)
        planners[place] = made
    placed = [Placement(spec=p.spec, model_cfg=p.model_cfg, models=p.models) for p in planners.values()]
    jobs: dict[str, Callable[[], object]] = {
        "first": lambda: planners["first"].plan(batch), "last": lambda: planners["last"].plan(batch),
        "first-batch": lambda: choose_embedding(batch, placed),
        "samples": lambda: choose_on_samples(Workload(trace, int(batch.size)), placed)}
    for name in TIMED[r % 4:] + TIMED[:r % 4]:
        out[name], made = _cpu(jobs[name])
        if name == "samples":
            out["samples_place"] = float(made[0].place == "last")      # type: ignore[index]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="gsm8k")
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--stages", type=int, default=16)
    ap.add_argument("--limit", default="24GiB")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    trace = data.load_trace(args.trace)
    cfg = scaling.model_for(args.model, [trace])
    batch = scaling.token_batch(trace, 500_000, 1, 0)
    rounds = []
    for r in range(args.rounds):
        rounds.append(one_round(cfg, trace, args.stages, args.limit, batch, r))
        print(f"round {r}: " + ", ".join(f"{k} {v:.2f}" for k, v in rounds[-1].items()), flush=True)
    med = {k: float(np.median([row[k] for row in rounds])) for k in rounds[0]}
    place = "last" if med["samples_place"] >= 0.5 else "first"
    print("median CPU s: " + ", ".join(f"{k} {v:.2f}" for k, v in med.items() if k != "samples_place"))
    build = med["build first"] + med["build last"]
    print(f"construction: first {med['build first']:.2f}; auto, first-batch rule {build:.2f} "
          f"({build / med['build first']:.2f}x); auto, samples {build + med['samples']:.2f} "
          f"({(build + med['samples']) / med['build first']:.2f}x)")
    print(f"first plan: first {med['first']:.2f}; auto, first-batch rule {med['first-batch']:.2f} "
          f"({med['first-batch'] / med['first']:.2f}x); auto, samples (the winner, {place}) {med[place]:.2f} "
          f"({med[place] / med['first']:.2f}x)")
    fixed = med["build first"] + med["first"]
    print(f"construction + first plan: first {fixed:.2f}; first-batch rule {build + med['first-batch']:.2f} "
          f"({(build + med['first-batch']) / fixed:.2f}x); samples {build + med['samples'] + med[place]:.2f} "
          f"({(build + med['samples'] + med[place]) / fixed:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
