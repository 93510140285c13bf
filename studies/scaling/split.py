"""``--stage-split search`` in ``studies/scaling/scaling.py``: dynamic's layer split as the library chooses it
when it knows the run (``Planner(stage_split="auto", workload=..., global_batch=...)``,
``dynmb.planning.split_search.SplitSearch``), where the study's ``auto`` is the min-max split alone.

The candidates are the min-max split of the trace's work (``scaling.ideal_cost`` of the whole trace) and
its near-optimal arrangements; each is planned with ``dynamic`` and the row's settings (``--schedule``,
``--virtual``, the memory limit, ``--oversize``, DP) on sample batches drawn from the trace, not from the
measured batch, one replica's share of the global batch each; the min-max split is kept unless another is
faster per real token on every sample batch by more than the noise (``split_search.pick_layout``; the rule
that decided goes to stderr); its LM head is then sharded over the last stages where that lightens the
busiest stage (``dynmb.planning.head_split``), as ``auto`` does. Its CPU seconds (``split_choice_s``) are
paid once per run, not per step, and are not in ``plan_s``.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from dynmb.costmodel import gpu
from dynmb.planning.split_search import SplitSearch
from dynmb.planning.stage_split import planned_layout

__all__ = ["SEARCH", "searched_split", "row_search", "layout_label"]

SEARCH = "search"


def row_search(cfg, c: dict, chunks: int, virtual: int, global_batch: int) -> SplitSearch:
    """The library's search by simulated step (``SplitSearch``, which ``VirtualSearch`` reuses) under the row
    settings ``c`` on ``chunks`` model chunks, ``virtual`` a GPU; one line and exit where they cannot plan."""
    search = SplitSearch.of(dict(num_stages=chunks, virtual=virtual, schedule_kind=c["schedule_key"], reorder="auto",
                                 memory_limit_bytes=int(c["memory_limit_bytes"]), dp=int(c["dp"]),
                                 oversize=c["oversize"], attention=cfg.attention), global_batch, seed=int(c["seed"]))
    if search is None:
        raise SystemExit(f"scaling.py: the settings {c} cannot plan a sample batch")
    return search


def searched_split(cfg, c: dict, chunks: int, virtual: int, trace: np.ndarray, global_batch: int,
                   stage_cost) -> tuple[object, float]:
    """``(cfg with the chosen split, CPU seconds of the choice)`` for the row settings ``c`` on ``chunks``
    model chunks, ``virtual`` a GPU (module doc)."""
    search = row_search(cfg, c, chunks, virtual, global_batch)
    cm = gpu.GPUCostModel(cfg, chunks, link=c["link"])
    choice = search.choose(cfg, chunks, stage_cost, workload=trace, cost_model=cm, virtual=virtual)
    if choice.how != "simulated":
        raise SystemExit(f"scaling.py: --stage-split search fell back to the min-max split: {choice.reason}")
    print(f"split search P {chunks}: {' '.join(f'{n:g}' for n in choice.split)} (min-max "
          f"{' '.join(f'{n:g}' for n in choice.candidates[0])}); rule: {choice.rule}", file=sys.stderr, flush=True)
    t0 = time.process_time()
    layout = planned_layout(cfg, chunks, choice.split, stage_cost, virtual=virtual, search=search, workload=trace,
                            cost_model=cm, arrangements=choice.candidates)
    return layout, float(choice.cpu_s) + time.process_time() - t0


def layout_label(cfg, chunks: int) -> str:
    """The ``layer_split`` column: layers per stage (``2.5 2 2 1.5``), then where the LM head is sharded by
    vocabulary its rows per head stage (``| head 30:42084 31:86172``)."""
    text = " ".join(f"{n:g}" for n in cfg.stage_layer_counts(chunks))
    if cfg.head_split is None:
        return text
    return text + " | head " + " ".join(f"{i}:{n}" for i, n in enumerate(cfg.head_split) if n)
