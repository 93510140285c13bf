"""The LM head split by vocabulary over the last stages, planned: where the head outweighs a stage.

A pipeline's steady state is bound by its busiest stage. With Llama-3's 128k vocabulary the final
norm, LM head and loss are about 2.4 layers of work: at P = 16 (two layers a stage) even a stage of its
own for the head (``stage_split``) leaves it the busiest, a split ceiling of 0.77. Cutting the head's
rows over the last stages (``ModelConfig.head_split``: each shard computes its rows' logits and passes
the running log-sum-exp and target logit on with the normalised hidden state, ``dynmb.models``) turns
the head into work that can be divided as finely as a vocabulary row.

Algorithm (``shard_head``, called by ``stage_split.planned_layout``): the head's work ``last`` (the work
model's last-stage extra, read off the same small layouts as ``stage_split.unit_work``) is cut into
``HEAD_CHUNKS`` equal vocabulary chunks appended after the layer units (half-blocks). The split chosen so
far keeps its first ``P - m`` stages; the units of its last ``m`` stages and the head chunks get the
min-max contiguous partition over ``m`` non-empty stages (``partition.min_max_partition``), for the
smallest ``m`` that reaches the lowest busiest stage over the whole pipeline (a prefix of the split's own
stages is kept because where uneven stages sit moves fill and drain, which the split search weighed). In
order, so the head's stages form a suffix and only the first of them may also hold layers. Chunk ``c`` ends at vocabulary row ``round(V c / HEAD_CHUNKS)``.
The sharded layout replaces the split it refines only where its busiest stage does strictly less work,
and where a split search can simulate (``stage_split.planned_layout`` with a ``SplitSearch``) only where
its simulated step per real token on the sample batches is strictly smaller too; otherwise (a head lighter
than a stage: Llama-2's 32k at P <= 16) nothing changes. Only for dynmb's own families with an untied
head and one model chunk a GPU (``virtual`` 1).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np

from dynmb.config import ModelConfig

from .partition import min_max_partition

__all__ = ["shard_head", "HEAD_CHUNKS"]

logger = logging.getLogger(__name__)

HEAD_CHUNKS = 64
"""Equal vocabulary chunks the head is cut into for the partition (its granularity: 1/64 of the head)."""


def _layout(cfg: ModelConfig, counts: list[int], n_units: int) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """(layers per stage, head rows per stage) of a partition of ``n_units`` half-blocks + the chunks."""
    bounds = np.concatenate([[0], np.cumsum(counts)])
    row = [round(cfg.vocab_size * c / HEAD_CHUNKS) for c in range(HEAD_CHUNKS + 1)]
    layers, rows = [], []
    for b0, b1 in zip(bounds[:-1], bounds[1:]):
        u = int(min(b1, n_units) - min(b0, n_units))
        layers.append(u // 2 if u % 2 == 0 else u / 2)
        rows.append(row[int(max(b1 - n_units, 0))] - row[int(max(b0 - n_units, 0))])
    return tuple(layers), tuple(rows)


def shard_head(cfg: ModelConfig, num_stages: int, units: np.ndarray, first: float, last: float,
               now: float) -> ModelConfig | None:
    """``cfg`` (whose ``layer_split`` is the split chosen so far, its busiest stage's work ``now``) with the
    head sharded over its last stages where that makes the busiest stage strictly lighter; ``units`` the
    half-blocks' work, ``first`` / ``last`` the embedding's and the head's (``stage_split.unit_work``). Only
    a suffix of the stages is re-partitioned (the fewest whose re-partition reaches the best busiest stage),
    so the stages before it keep the sizes and places the split's choice gave them. None where nothing
    gets lighter, or where the model cannot shard (a tied head, one stage) (module docstring)."""
    p = int(num_stages)
    if p < 2 or cfg.tie_embeddings:
        return None
    bounds = [r.start for r in cfg.stage_units(p)] + [units.size]
    work = [float(units[a:b].sum()) for a, b in zip(bounds[:-1], bounds[1:])]
    work[0] += first
    head = np.full(HEAD_CHUNKS, last / HEAD_CHUNKS)
    best: tuple[float, list[int], int] | None = None
    for m in range(2, p + 1):                         # re-partition the last m stages, layers + head chunks
        start = bounds[p - m]
        counts, top, _ = min_max_partition(np.concatenate([units[start:], head]), m, first if m == p else 0.0, 0.0)
        top = max([top, *work[:p - m]])
        if best is None or top < best[0] * (1 - 1e-9):
            best = (top, counts, m)
    assert best is not None
    top, counts, m = best
    if not top < now * (1 - 1e-9):
        return None
    prefix = [b - a for a, b in zip(bounds[:p - m], bounds[1:p - m + 1])]
    layers, rows = _layout(cfg, prefix + list(counts), units.size)
    out = replace(cfg, layer_split=layers, head_split=rows)
    if out.head_split is None:                      # the whole head on the last stage after all
        return None
    logger.info("stage split: the LM head over stages %d..%d by vocabulary rows %s (the last %d stages "
                "re-partitioned): busiest stage's work %.4g against %.4g", out.head_stage(p), p - 1,
                list(rows[out.head_stage(p):]), m, top, now)
    return out
