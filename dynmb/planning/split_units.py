"""The rows of work units a layer split is planned over, at a grain, and the work of each stage of a split.

A work model (``StageCost``: ``(layout, stage, num_stages) -> work``) is read off small layouts
(``half_parts``): ``layer = F(2 layers, 1 stage) - F(1 layer, 1 stage)``, ``first = F_0(2 layers, 2
stages) - layer``, ``last = F_1(2 layers, 2 stages) - layer`` (the embedding's and the final norm +
LM head's extra work), the attention half ``attn = F_0(1 layer split (0.5, 0.5), 2 stages) - first``
and the MLP half ``layer - attn``. The model is cut into units of 1/16 layer (``dynmb.core.model_sizes``:
eight chunks of each half-block, attention by K/V-head groups, MLP by inner columns), each chunk 1/8 of
its half's work: the work models price matmuls and attention per head linearly, and the extra ``h``
message of a boundary inside a half is priced by the cost model (``CostModel.predict``), not here.

A planning row merges those units at a ``grain``: ``LAYER`` (16 units: whole layers), ``HALF`` (8:
half-blocks) or ``CHUNK`` (1: every boundary the model allows, ``ModelSizes.check_chunk_bounds``: an
attention boundary only on whole K/V heads, an MLP one on whole columns). ``UnitRow`` holds the row's
work per unit and each unit's end on the 1/16 grid, so a partition of the row (units per stage) maps
back to layers per stage (``UnitRow.layers``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from dynmb.core.config import ModelConfig
from dynmb.core.model_sizes import SUB_CHUNKS, UNITS_PER_LAYER

__all__ = ["StageCost", "UnitRow", "unit_row", "fine_grid", "unit_work", "half_parts", "stage_work", "flops_cost", "as_layers",
           "LAYER", "HALF", "CHUNK"]

StageCost = Callable[[ModelConfig, int, int], float]
"""``(layout, stage, num_stages) -> work``: what the split balances (``split_work.workload_cost``: a workload's
F + B; without one, ``flops_cost``: forward FLOPs at one row)."""

LAYER, HALF, CHUNK = UNITS_PER_LAYER, SUB_CHUNKS, 1
"""Grains: units of 1/16 layer a planning unit spans (``CHUNK``: every boundary the model allows)."""


def flops_cost(tokens_hint: int = 1024) -> StageCost:
    """The default work model: ``stage_flops`` at one row of ``tokens_hint`` tokens."""
    return lambda cfg, stage, num_stages: float(cfg.stage_flops(stage, num_stages, 1, tokens_hint))


def half_parts(cfg: ModelConfig, cost: StageCost) -> tuple[float, float, float, float]:
    """(attention half, MLP half, first-stage extra, last-stage extra) work, read off ``cost`` of small
    layouts (module docstring)."""
    base = replace(cfg, layer_split=None, head_split=None, recompute_blocks=None)
    one, two = replace(base, n_layers=1), replace(base, n_layers=2)
    layer = cost(two, 0, 1) - cost(one, 0, 1)
    first = max(cost(two, 0, 2) - layer, 0.0)
    last = max(cost(two, 1, 2) - layer, 0.0)
    attn = cost(replace(one, layer_split=(0.5, 0.5)), 0, 2) - first
    return attn, layer - attn, first, last


def _fine(attn: float, mlp: float, n_layers: int) -> np.ndarray:
    """The work of every 1/16-layer unit."""
    return np.tile(np.concatenate([np.full(SUB_CHUNKS, attn / SUB_CHUNKS), np.full(SUB_CHUNKS, mlp / SUB_CHUNKS)]),
                   n_layers)


def _cuts(cfg: ModelConfig, grain: int) -> np.ndarray:
    """The boundaries (on the 1/16 grid, 0 and the end included) a row at ``grain`` may cut at."""
    j = np.arange(UNITS_PER_LAYER * cfg.n_layers + 1)
    ok = j % grain == 0
    if grain < SUB_CHUNKS:
        c = j % SUB_CHUNKS
        width = np.where((j // SUB_CHUNKS) % 2 == 0, cfg.kv_heads, cfg.d_ff)
        ok &= (width * c) % SUB_CHUNKS == 0
    return np.flatnonzero(ok)


@dataclass(frozen=True)
class UnitRow:
    """A planning row: ``work`` of each unit, ``ends`` its end on the 1/16 grid, ``first`` / ``last`` the
    ends' extras."""

    work: np.ndarray
    ends: np.ndarray
    first: float
    last: float

    def layers(self, counts: list[int] | tuple[int, ...]) -> tuple[float, ...]:
        """Units per stage as layers per stage."""
        bounds = np.concatenate([[0], self.ends])[np.cumsum([0, *counts])]
        return as_layers(np.diff(bounds))

    def index(self, fine: int) -> int:
        """The row position of the boundary ``fine`` (on the 1/16 grid; one of the row's cuts)."""
        return int(np.searchsorted(self.ends, fine, side="right")) if fine else 0


def as_layers(units: np.ndarray | Sequence[int]) -> tuple[float, ...]:
    """Units of 1/16 layer per stage as layers per stage (ints where whole)."""
    return tuple(int(u) // UNITS_PER_LAYER if int(u) % UNITS_PER_LAYER == 0 else int(u) / UNITS_PER_LAYER
                 for u in units)


def fine_grid(cfg: ModelConfig, cost: StageCost, grain: int) -> tuple[np.ndarray, float, float, np.ndarray]:
    """(work of every 1/16-layer unit, first extra, last extra, whether each boundary 0..16 n_layers is a
    cut of the row at ``grain``)."""
    attn, mlp, first, last = half_parts(cfg, cost)
    allowed = np.zeros(UNITS_PER_LAYER * cfg.n_layers + 1, dtype=bool)
    allowed[_cuts(cfg, grain)] = True
    return _fine(attn, mlp, cfg.n_layers), first, last, allowed


def unit_row(cfg: ModelConfig, cost: StageCost, grain: int) -> UnitRow:
    """The planning row of ``cfg`` at ``grain`` (module docstring)."""
    attn, mlp, first, last = half_parts(cfg, cost)
    prefix = np.concatenate([[0.0], np.cumsum(_fine(attn, mlp, cfg.n_layers))])
    cuts = _cuts(cfg, grain)
    return UnitRow(prefix[cuts[1:]] - prefix[cuts[:-1]], cuts[1:], first, last)


def unit_work(cfg: ModelConfig, cost: StageCost, half: bool) -> tuple[np.ndarray, float, float]:
    """(work of each unit in order, first extra, last extra): half-blocks (attention, MLP, ...) or
    whole layers."""
    row = unit_row(cfg, cost, HALF if half else LAYER)
    return row.work, row.first, row.last


def stage_work(cfg: ModelConfig, split: tuple[float, ...], tokens_hint: int = 1024, *,
               stage_cost: StageCost | None = None) -> list[float]:
    """The work model's work of each stage under ``split`` (layers per stage, on the 1/16 grid) and ``cfg``'s
    ``head_split`` (the head's work over its stages by rows; None: on the last): forward FLOPs at one row
    of ``tokens_hint`` tokens, or ``stage_cost``'s."""
    attn, mlp, first, last = half_parts(cfg, stage_cost or flops_cost(tokens_hint))
    prefix = np.concatenate([[0.0], np.cumsum(_fine(attn, mlp, cfg.n_layers))])
    ends = np.cumsum([int(round(UNITS_PER_LAYER * n)) for n in split])
    work = [float(prefix[b] - prefix[a]) for a, b in zip(np.concatenate([[0], ends[:-1]]), ends)]
    work[0] += first
    if cfg.head_split is not None and len(cfg.head_split) == len(work):     # the head's rows over its stages
        work = [w + last * rows / cfg.vocab_size for w, rows in zip(work, cfg.head_split)]
    else:
        work[-1] += last
    return work
