"""What ``embedding="auto"`` costs in plan time: the first plan plans the batch under both places.

One cell as ``studies.shortdoc.shortdoc`` plans it (``planner_for``: the public ``Planner``, ``GPUCostModel`` H100,
``schedule="auto"``, ``stage_split="auto"``), in one process, paired and interleaved: each round builds a planner with
``embedding="auto"`` and one with each fixed place, and times (CPU seconds) the construction
(auto resolves both places' layouts) and the first ``plan`` of the cell's batch (auto plans it twice), for
``auto``, ``first`` (the default before) and ``last``, each round in a rotated order. Prints the median of each and
the ratios of auto to each.

    PYTHONPATH=$PWD nice -n 10 python3 -m studies.shortdoc.embedding_auto_time --model llama2-7b --stages 16
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from studies.scaling import scaling
from studies.shortdoc import shortdoc

from dynmb import data
from dynmb.core.config import ModelConfig


def timed(cfg: ModelConfig, trace: np.ndarray, P: int, limit: str, embedding: str | None,
          batch: np.ndarray) -> tuple[float, float, str]:
    """(construction CPU s, first plan CPU s, the plan's embedding place) of one planner."""
    t0 = time.process_time()
    planner = shortdoc.planner_for(cfg, trace, P, limit, shortdoc.Variant(embedding=embedding))
    t1 = time.process_time()
    planner.plan(batch)
    return t1 - t0, time.process_time() - t1, planner.spec.embedding


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
    order = ["auto", "first", "last"]
    rows: dict[str, list[tuple[float, float]]] = {k: [] for k in order}
    for r in range(args.rounds):
        for emb in order[r % 3:] + order[:r % 3]:            # each first in turn
            build, plan, place = timed(cfg, trace, args.stages, args.limit, emb, batch)
            rows[emb].append((build, plan))
            print(f"round {r} {emb} ({place}): construction {build:.2f} CPU s, first plan {plan:.2f} CPU s", flush=True)
    med = {k: np.median(np.asarray(v), axis=0) for k, v in rows.items()}
    for k in order:
        print(f"median {k}: construction {med[k][0]:.2f}, first plan {med[k][1]:.2f} CPU s; auto / {k}: construction "
              f"{med['auto'][0] / med[k][0]:.2f}, first plan {med['auto'][1] / med[k][1]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
