"""What ``--stage-split auto`` balances: the work of the workload the pipeline will train.

``dynmb.planning.stage_split`` partitions layers (half-blocks for dynmb's families) by a work model
``stage_cost(layout, stage, num_stages) -> work`` read off a few small layouts. This module gives it
the workload's own work: a stage's work is the forward + backward of every sequence of the workload at
its own length (one sequence per row, attention's s^2 term included), summed over the sequences.

- **From the cost model**, when it prices any layer split from the config alone
  (``CostModel.layout_free``: the analytic kinds, ``analytic`` and the GPU model ``gpu``): the model is
  rebuilt for each layout (``CostModel.for_layout``) and each sequence's F and B seconds are read with
  ``dynmb.timing.bounds.sequence_costs``, the pricing ``ideal_s`` is made of: ``ideal_stage_costs`` where the
  model has it (``GPUCostModel``: every FLOP at its best efficiency, attention at its own, its backward
  at ``attn_bwd_ratio`` x its FLOPs; a sequence priced alone at its own GEMM size would count short
  sequences dearer than they run packed), else the one cost lookup at one row minus its value at
  length 0 (no per-op overhead). ``studies/scaling/scaling.py``'s ``ideal_cost`` is this with the study's
  batch and GPU model.
- **Else from FLOPs** (a fitted model measured one split only, or no cost model was given): the forward
  FLOPs of ``ModelConfig.stage_flops`` at each length, plus the backward's: 2x the GEMMs' (input and
  weight gradients) and ``ATTN_BWD_FLOPS`` x the s^2 attention term's.

Why not one 1,024-token row (the old default, ``stage_split.flops_cost``): with long documents (wikitext2,
sum s^2 / sum s about 7,300 tokens) attention is a larger share of a layer than at 1k tokens, and its
backward is dearer than the GEMMs', so the split balanced at 1k tokens loaded the stages holding extra
attention halves (docs/results.md "Half-block stage splits": Llama-2-7B P16 +1.7% slower than even).
Where no lengths are known the 1,024-token FLOPs model stays, said once (``resolve_stage_split``). A
fitted cost model prices the one split it was measured on, so ``auto`` with one made for this model and
stage count plans that split (``fitted_split``, logged).

The workload: lengths (any array), or a shipped trace name or length-trace CSV (``dynmb.data.load_trace``),
read only when ``auto`` needs it. Lengths of a family with a learned position table are capped at its
``max_seq_len`` (documents are). Everything is a function of the lengths, the config and the model's
constants, summed in the lengths' order: every rank computes the same split.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from dynmb.timing.bounds import sequence_costs
from dynmb.core.config import ModelConfig
from dynmb.costmodel.base import CostModel

logger = logging.getLogger(__name__)

__all__ = ["workload_cost", "workload_lengths", "layout_cost_model", "fitted_split", "ATTN_BWD_FLOPS"]

ATTN_BWD_FLOPS = 2.5
"""Attention backward FLOPs over its forward's: fused (flash) kernels recompute the scores, five matmuls
against the forward's two (FlashAttention-2, Dao 2023; ``GPUSpec.attn_bwd_ratio`` uses the same)."""


def workload_lengths(workload: Any, cfg: ModelConfig) -> np.ndarray:
    """The sequence lengths of ``workload`` (an array of lengths, a trace name or a length-trace CSV) as
    float64, capped at ``max_seq_len`` for a family with learned positions. Zero lengths (empty
    documents: real traces have empty files) are skipped with a note; ValueError when a length is
    negative or not finite, or none is left."""
    if isinstance(workload, (str, bytes)) or hasattr(workload, "__fspath__"):
        from dynmb.data import load_trace

        workload = load_trace(workload)
    lengths = np.asarray(workload, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(lengths)) or (lengths.size and lengths.min() < 0):
        raise ValueError("a stage-split workload needs finite, non-negative lengths")
    empty = int(np.count_nonzero(lengths == 0))
    if empty:
        logger.warning("stage-split workload: skipped %d zero-length sequence(s) of %d", empty, lengths.size)
        lengths = lengths[lengths > 0]
    if lengths.size == 0:
        raise ValueError("a stage-split workload needs at least one sequence of length >= 1")
    return np.minimum(lengths, cfg.max_seq_len) if cfg.learned_positions else lengths


def layout_cost_model(cost_model: Any) -> CostModel | None:
    """``cost_model`` (an object, or a cost-model JSON path) when it can price any layout
    (``layout_free``), else None (the FLOPs work model is used)."""
    if cost_model is None:
        return None
    if isinstance(cost_model, str) or hasattr(cost_model, "__fspath__"):
        cost_model = CostModel.load(cost_model)
    return cost_model if getattr(cost_model, "layout_free", False) else None


def fitted_split(cost_model: Any, cfg: ModelConfig, num_stages: int) -> ModelConfig | None:
    """``cfg`` with the layer split a fitted (not ``layout_free``) ``cost_model`` (an object or a JSON path)
    was measured on, when it was made for this model at ``num_stages`` stages; else None. Such a model
    prices that split only, so ``auto`` plans with it (``resolve_stage_split``): a model profiled and fitted
    with ``--stage-split auto`` (no workload there) then plans ``run --stage-split auto`` on its own split."""
    if cost_model is None:
        return None
    if isinstance(cost_model, str) or hasattr(cost_model, "__fspath__"):
        cost_model = CostModel.load(cost_model)
    if getattr(cost_model, "layout_free", True) or int(getattr(cost_model, "num_stages", -1)) != int(num_stages):
        return None
    out = cfg.with_layout_of(cost_model.model_cfg)
    try:
        cost_model.check(out, num_stages)
    except ValueError:
        return None                                 # another model: its own check refuses it later
    return out


def _flops_work(layout: ModelConfig, stage: int, num_stages: int, lengths: np.ndarray) -> float:
    """Forward + backward FLOPs of ``stage`` over the sequences (module docstring)."""
    f1, f2 = (float(layout.stage_flops(stage, num_stages, 1, s)) for s in (1.0, 2.0))
    unit = (f2 - 2.0 * f1) / 2.0                                   # the s^2 coefficient
    fwd = np.asarray(layout.stage_flops(stage, num_stages, 1, lengths), dtype=np.float64)
    attn = unit * lengths * lengths
    return float(np.sum(fwd + 2.0 * (fwd - attn) + ATTN_BWD_FLOPS * attn))


def workload_cost(workload: Any, cfg: ModelConfig, cost_model: Any = None):
    """The ``stage_split.StageCost`` of ``workload`` (module docstring): a ``layout_free`` ``cost_model``'s
    F + B seconds of every sequence, else forward + backward FLOPs; ``cfg`` caps the lengths."""
    lengths = workload_lengths(workload, cfg)
    cm = layout_cost_model(cost_model)
    if cm is None:
        return lambda layout, stage, num_stages: _flops_work(layout, stage, num_stages, lengths)

    cm.check(cfg.with_layout_of(cm.model_cfg), cm.num_stages)   # the same model, any split

    def seconds(layout: ModelConfig, stage: int, num_stages: int) -> float:
        priced = cm.for_layout(layout, num_stages)
        return float(sum(t[stage].sum() for t in sequence_costs(priced, lengths).values()))

    return seconds
