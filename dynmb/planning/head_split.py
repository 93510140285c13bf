"""The LM head split by vocabulary over the last stages, planned: where the head outweighs a stage.

A pipeline's steady state is bound by its busiest stage. With Llama-3's 128k vocabulary the final
norm, LM head and loss are about 2.4 layers of work: at P = 16 (two layers a stage) even a stage of its
own for the head (``stage_split``) leaves it the busiest, a split ceiling of 0.77. Cutting the head's
rows over the last stages (``ModelConfig.head_split``: each shard computes its rows' logits and passes
the running log-sum-exp and target logit on with the normalised hidden state, ``dynmb.models``) turns
the head into work that can be divided as finely as a vocabulary row.

Algorithm (``shard_head``, called by ``stage_split.planned_layout``): the head's work ``last`` (the work
model's last-stage extra, read off the same small layouts as ``split_units.unit_row``) is cut into
``HEAD_CHUNKS`` equal vocabulary chunks appended after the layer units (the planning row at the chunk grain:
every boundary the model allows, ``split_units``), and the units of the
split's last ``m`` stages plus the chunks get the min-max contiguous partition over ``m`` non-empty stages
(``partition.min_max_partition``), the split's first ``P - m`` stages kept. Two candidates: ``m = P`` (the
whole pipeline re-partitioned: the min-max layout) and the smallest ``m`` that reaches the same busiest
stage (the split's own prefix kept: where uneven stages sit moves fill and drain, which the split search
weighed; measured either way, docs/results.md). In order, so the head's stages form a suffix and only the
first of them may also hold layers. Chunk ``c`` ends at vocabulary row ``round(V c / HEAD_CHUNKS)``.
A sharded layout replaces the split it refines only where its busiest stage does strictly less work; where
a split search can simulate (``stage_split.planned_layout`` with a ``SplitSearch``) the candidate of the
smallest simulated step per real token on the sample batches, only where strictly smaller than the split's
own, the prefix-keeping shards of the search's other candidate arrangements weighed too (where the uneven
stages sit matters as much with shards); without one the min-max layout. Otherwise (a head lighter than a stage: Llama-2's 32k at P <= 16)
nothing changes. Only for dynmb's own families with an untied
head and one model chunk a GPU (``virtual`` 1).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np

from dynmb.core.config import ModelConfig

from dynmb.planning.partition import min_max_partition
from dynmb.planning.split_units import UnitRow

__all__ = ["shard_head", "HEAD_CHUNKS"]

logger = logging.getLogger(__name__)

HEAD_CHUNKS = 64
"""Equal vocabulary chunks the head is cut into for the partition (its granularity: 1/64 of the head)."""


def _layout(cfg: ModelConfig, counts: list[int], row: UnitRow) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """(layers per stage, head rows per stage) of a partition of ``row``'s units + the head chunks."""
    n_units = row.work.size
    bounds = np.concatenate([[0], np.cumsum(counts)])
    vocab = [round(cfg.vocab_size * c / HEAD_CHUNKS) for c in range(HEAD_CHUNKS + 1)]
    layers = row.layers([int(min(b1, n_units) - min(b0, n_units)) for b0, b1 in zip(bounds[:-1], bounds[1:])])
    rows = [vocab[int(max(b1 - n_units, 0))] - vocab[int(max(b0 - n_units, 0))] for b0, b1 in zip(bounds[:-1], bounds[1:])]
    return layers, tuple(rows)


def shard_head(cfg: ModelConfig, num_stages: int, row: UnitRow, now: float, *,
               whole: bool = True) -> list[ModelConfig]:
    """Layouts of ``cfg`` (whose ``layer_split`` is the split chosen so far, its busiest stage's work ``now``)
    with the head sharded over its last stages that make the busiest stage strictly lighter, the whole
    pipeline re-partitioned first, then the split's own prefix kept and only the fewest last stages that
    reach the best busiest stage re-partitioned (where that differs); ``row`` the layers' planning row, its
    ``first`` / ``last`` the embedding's and the head's work (``split_units.unit_row``); ``whole=False``: the
    prefix-keeping one only. Empty where nothing gets lighter, or where the model cannot shard (a tied
    head, one stage) (module docstring)."""
    p = int(num_stages)
    if p < 2 or cfg.tie_embeddings:
        return []
    units, first, last = row.work, row.first, row.last
    bounds = [row.index(r.start) for r in cfg.stage_units(p)] + [units.size]
    work = [float(units[a:b].sum()) for a, b in zip(bounds[:-1], bounds[1:])]
    work[0] += first
    head = np.full(HEAD_CHUNKS, last / HEAD_CHUNKS)
    tops: dict[int, tuple[float, list[int]]] = {}
    for m in range(2, p + 1):                         # re-partition the last m stages, layers + head chunks
        counts, top, _ = min_max_partition(np.concatenate([units[bounds[p - m]:], head]), m,
                                           first if m == p else 0.0, 0.0)
        tops[m] = (max([top, *work[:p - m]]), [b - a for a, b in zip(bounds[:p - m], bounds[1:p - m + 1])] + counts)
    best = min(t for t, _ in tops.values())
    fewest = min(m for m, (t, _) in tops.items() if t <= best * (1 + 1e-9))
    out: list[ModelConfig] = []
    for m in dict.fromkeys((p, fewest) if whole else (fewest,)):
        top, counts = tops[m]
        if not top < now * (1 - 1e-9):
            continue
        layers, rows = _layout(cfg, counts, row)
        layout = replace(cfg, layer_split=layers, head_split=rows)
        if layout.head_split is not None and layout not in out:
            out.append(layout)
            logger.info("stage split: the LM head over stages %d..%d by vocabulary rows %s (the last %d stages "
                        "re-partitioned): busiest stage's work %.4g against %.4g", layout.head_stage(p), p - 1,
                        list(rows[layout.head_stage(p):]), m, top, now)
    return out
