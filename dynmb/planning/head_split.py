"""The LM head split by vocabulary over the last stages, planned: where the head outweighs a stage.

A pipeline's steady state is bound by its busiest stage. With Llama-3's 128k vocabulary the final
norm, LM head and loss are about 2.4 layers of work: at P = 16 (two layers a stage) even a stage of its
own for the head (``stage_split``) leaves it the busiest, a split ceiling of 0.77. Cutting the head's
rows over the last stages (``ModelConfig.head_split``: each shard computes its rows' logits and passes
the running log-sum-exp and target logit on with the normalised hidden state, ``dynmb.models``) turns
the head into work that can be divided as finely as a vocabulary row.

Algorithm (``shard_head``, called by ``stage_split.planned_layout``): the head's work ``last`` (the work model's last-stage extra, read off the
same small layouts as ``stage_split.unit_work``) is cut into ``HEAD_CHUNKS`` equal vocabulary chunks
appended after the layer units (half-blocks); the min-max contiguous partition of layers + chunks over
``P`` non-empty stages (``partition.min_max_partition``, the first-stage extra on stage 0) gives
each stage its layer units and head chunks, in order, so the head's stages form a suffix and only the
first of them may also hold layers. Chunk ``c`` ends at vocabulary row ``round(V c / HEAD_CHUNKS)``.
The sharded layout replaces the split it refines only where its busiest stage does strictly less work;
otherwise (a head lighter than a stage: Llama-2's 32k at P <= 8) nothing changes. Only for dynmb's own
families with an untied head and one model chunk a GPU (``virtual`` 1); the split search's arrangements
(``split_search``) are not walked for a sharded layout: it is the min-max one, said once per run.
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
    half-blocks' work, ``first`` / ``last`` the embedding's and the head's (``stage_split.unit_work``). None
    where it does not, or where the model cannot shard (a tied head, one stage) (module docstring)."""
    p = int(num_stages)
    if p < 2 or cfg.tie_embeddings:
        return None
    head = np.full(HEAD_CHUNKS, last / HEAD_CHUNKS)
    counts, top, _ = min_max_partition(np.concatenate([units, head]), p, first, 0.0)
    if not top < now * (1 - 1e-9):
        return None
    layers, rows = _layout(cfg, counts, units.size)
    out = replace(cfg, layer_split=layers, head_split=rows)
    if out.head_split is None:                      # the whole head on the last stage after all
        return None
    logger.info("stage split auto: the LM head over stages %d..%d by vocabulary rows %s (layers %s): busiest "
                "stage's work %.4g against %.4g", out.head_stage(p), p - 1, list(rows[out.head_stage(p):]),
                list(layers), top, now)
    return out

