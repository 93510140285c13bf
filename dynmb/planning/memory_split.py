"""Memory in the stage split: fewer layers on the first stage where its in-flight window sets the microbatch size.

Under 1F1B and the zero-bubble kinds that keep its window, stage ``s`` holds ``P - s`` microbatches in flight,
so at a tight memory limit the first stage (``P`` in flight, and the embedding's states unless it runs on the
last rank, ``ReliefInputs.embedding``) alone sets how many tokens a microbatch may hold; the other stages have room
to spare. Small microbatches pay the per-op fixed
cost and narrow GEMMs on every stage (``dynmb.timing.gap_terms``: ``overhead``, ``shape``). A split that moves
work off the first stage lets every microbatch grow, at the price of a busier pipeline elsewhere.

Algorithm (``relieve``): from the work-balanced split (``stage_split.resolve_stage_split``), candidates that
take ``d`` units (``RELIEF_STEP`` layers each) off the first stage and re-balance the stages between it and the
tail (the last stage, or the stages holding LM-head rows, kept as they are) over the units left
(``partition.min_max_partition``, the same work model and grain), ``d`` up to half the first stage. Each is priced by ``step_proxy``: the seconds per token of the busiest stage for a microbatch of
the workload's mean length holding the most tokens the layout's analytic memory model admits under the kind's
windows (``MemoryModel.max_rows``, tight; ``packing.context.stage_windows``): the step's work when the
pipeline is full, fill and drain left out. The candidate with the smallest proxy is taken when it is at least
``RELIEF_GAIN`` below the balanced split's (else the balanced split stays). One chunk a GPU only, dynmb's
own families with the analytic memory model (a fitted memory model prices its own split only).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dynmb.core.config import ModelConfig
from dynmb.memory.model import MemoryModel
from dynmb.packing.context import stage_windows
from dynmb.planning.partition import min_max_partition
from dynmb.planning.split_units import CHUNK, LAYER, UNITS_PER_LAYER, unit_row
from dynmb.planning.split_work import layout_cost_model, workload_cost, workload_lengths
from dynmb.planning.stage_split import with_split
from dynmb.schedule.kinds import AUTO, get_kind

__all__ = ["ReliefInputs", "Relief", "layout_of", "step_proxy", "relief_candidates", "relieve", "relieved_layout", "RELIEF_GAIN",
           "RELIEF_STEP"]

logger = logging.getLogger(__name__)

RELIEF_GAIN = 0.01
"""A relieved split is taken only where its ``step_proxy`` is at least this fraction below the balanced split's:
the proxy leaves out fill and drain, which larger microbatches lengthen."""

RELIEF_STEP = 0.25
"""Layers moved off the first stage per candidate (on the 1/16-layer grid; whole layers where the split is)."""


@dataclass(frozen=True, kw_only=True)
class ReliefInputs:
    """What ``relieve`` weighs a split by, beside the model and its stage count."""

    memory_limit_bytes: int
    """The per-GPU memory limit the run plans under."""
    schedule_kind: str
    """The run's schedule kind (``auto``: the 1F1B window its loop kinds keep)."""
    workload: Any
    """The lengths the pipeline will train (an array, a trace name or a length-trace CSV)."""
    cost_model: Any
    """A cost model that prices any layout (``CostModel.layout_free``): the analytic and GPU models."""
    half_blocks: bool = True
    """Splits may fall inside a block (dynmb's own families); False: whole layers."""
    state_shards: int = 1
    """The data-parallel ranks sharing each stage's model states (``PlanSpec.state_shards``, ``MemoryModel.sharded``)."""
    embedding: str = "first"
    """Where the token embedding runs (``PlanSpec.embedding``): ``last`` moves its states to the last stage
    (``MemoryModel.embedding_last``), so the first stage holds no table."""


@dataclass(frozen=True)
class Relief:
    """``relieve``'s choice: the split taken, the balanced one, each one's ``step_proxy`` and admitted tokens."""

    split: tuple[float, ...]
    balanced: tuple[float, ...]
    proxy_s: float
    balanced_proxy_s: float
    tokens: int
    balanced_tokens: int

    @property
    def relieved(self) -> bool:
        return self.split != self.balanced


def _windows(kind: str, num_stages: int) -> np.ndarray:
    return stage_windows(get_kind("1f1b" if kind == AUTO else kind), num_stages)


def step_proxy(layout: ModelConfig, num_stages: int, inputs: ReliefInputs, mean_len: int) -> tuple[float, int]:
    """(seconds per token of the busiest stage, tokens admitted) for a microbatch of ``mean_len``-token rows
    holding as many tokens as ``layout``'s analytic memory model admits on every stage under the kind's window
    (module doc; the rows' token count as one-token rows, continuous: the s^2 term of short rows left out);
    ``inf`` where not one ``mean_len`` row fits."""
    mm = MemoryModel.analytic(layout, num_stages).as_planned(inputs.embedding, inputs.state_shards)
    caps = float(inputs.memory_limit_bytes) - np.asarray(mm.state_bytes, dtype=np.float64)
    tokens = int(mm.max_rows(caps, 1, _windows(inputs.schedule_kind, num_stages), tight=True)[0])
    if tokens < mean_len:
        return float("inf"), tokens
    cm = layout_cost_model(inputs.cost_model)
    assert cm is not None
    costs = cm.for_layout(layout, num_stages).stage_costs(tokens / mean_len, mean_len)
    per_stage = np.asarray(costs["F"], dtype=np.float64)[:, 0] + np.asarray(costs["B"], dtype=np.float64)[:, 0]
    return float(per_stage.max()) / tokens, tokens


def _tail(cfg: ModelConfig, num_stages: int) -> int:
    """The first stage kept as it is: the first that holds LM-head rows (``head_split``), else the last."""
    if cfg.head_split is None:
        return num_stages - 1
    return next(i for i, rows in enumerate(cfg.head_split) if rows)


def layout_of(cfg: ModelConfig, num_stages: int, split: tuple[float, ...]) -> ModelConfig:
    """``cfg`` with layers per stage ``split``, its LM-head rows (``head_split``) kept."""
    return with_split(cfg, num_stages, split) if cfg.head_split is None else replace(cfg, layer_split=tuple(split))


def relief_candidates(cfg: ModelConfig, num_stages: int, inputs: ReliefInputs) -> list[tuple[float, ...]]:
    """The balanced split (``cfg``'s) first, then each split with ``d`` units fewer on the first stage and the
    stages up to the tail (``_tail``: the head's stages, kept as they are) re-balanced over those units (module
    doc), distinct, in order of ``d``."""
    split = tuple(cfg.stage_layer_counts(num_stages))
    tail = _tail(cfg, num_stages)
    if tail < 2 or not split[0]:
        return [split]
    row = unit_row(cfg, workload_cost(inputs.workload, cfg, inputs.cost_model), CHUNK if inputs.half_blocks else LAYER)
    first = row.index(int(round(UNITS_PER_LAYER * split[0])))
    body_end = row.index(int(round(UNITS_PER_LAYER * sum(split[:tail]))))
    step = max(1, int(round(RELIEF_STEP * first / split[0])))
    out = [split]
    for d in range(step, first // 2 + 1, step):
        body, _, _ = min_max_partition(row.work[first - d:body_end], tail - 1, 0.0, 0.0)
        if min(body) < 1:
            break
        cand = (*row.layers([first - d, *body]), *split[tail:])
        if cand not in out:
            out.append(cand)
    return out


def relieve(cfg: ModelConfig, num_stages: int, inputs: ReliefInputs) -> tuple[ModelConfig, Relief]:
    """``cfg`` (its split the work-balanced one) with the split of ``relief_candidates`` that has the smallest
    ``step_proxy``, where it gains ``RELIEF_GAIN`` (module doc), and the record of the choice."""
    lengths = workload_lengths(inputs.workload, cfg)
    mean_len = max(1, int(round(float(lengths.mean()))))
    cands = relief_candidates(cfg, num_stages, inputs)
    scored = [(*step_proxy(layout_of(cfg, num_stages, s), num_stages, inputs, mean_len), s) for s in cands]
    base_proxy, base_rows, base = scored[0]
    proxy, rows, split = min(scored, key=lambda t: t[0])
    if not proxy < base_proxy * (1 - RELIEF_GAIN):
        proxy, rows, split = base_proxy, base_rows, base
    choice = Relief(split, base, proxy, base_proxy, rows, base_rows)
    if choice.relieved:
        logger.info("stage split auto: %s, memory relief of the first stage (microbatches of %d tokens in "
                    "%d-token rows, %.4g s/token on the busiest stage) over the work-balanced %s (%d tokens, %.4g "
                    "s/token)", list(split), rows, mean_len, proxy, list(base), base_rows, base_proxy)
    return (layout_of(cfg, num_stages, split) if choice.relieved else cfg), choice


def relieved_layout(cfg: ModelConfig, num_stages: int, inputs: ReliefInputs, *, virtual: int = 1,
                    memory_model: Any = None) -> tuple[ModelConfig, Relief | None]:
    """``relieve`` where it applies (``--stage-split auto`` resolved to ``cfg``): one chunk a GPU, a workload, a
    cost model that prices any layout and no memory model given (the analytic one); else ``(cfg, None)``."""
    if virtual != 1 or num_stages < 2 or memory_model is not None or inputs.workload is None \
            or layout_cost_model(inputs.cost_model) is None:
        return cfg, None
    return relieve(cfg, num_stages, inputs)
