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

Recomputed leading blocks (``ModelConfig.recompute_blocks``; AdaPipe, arXiv:2401.03146, chooses recomputation per
stage jointly with the partition): a recomputed block keeps only its input from forward to backward and costs its
forward again in the backward (``dynmb.memory.coef``, ``dynmb.costmodel.split``). From each candidate split
(``recompute_steps``), one more block on the stage whose admission binds (the fewest tokens one microbatch may hold
there alone, as ``planning.offload.binding_blocks`` grows offload), two ways: on the same split, and on the split
re-balanced with the recomputation's extra forward counted (``min_max_partition`` over the unit work, each stage's
recomputed blocks' forward added to that stage's own work, its ``extras``, re-counted on the split it gives:
a stage starting inside a layer recomputes that layer's remainder first); the better by ``step_proxy`` is kept while it
improves on the last. Every pair (split, recomputed blocks) so found is a candidate, taken where its proxy is
``RELIEF_GAIN`` below the best split without recomputation as well (a second lever pays the same margin: the proxy
leaves out what larger microbatches add to the fill and to the schedule's idle time, which at P 16 and 24 GiB ate a
1% proxy gain: Llama-3.1-8B gsm8k, 2.1202 -> 2.1379 s); ``Relief`` records the choice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from dynmb.core.config import ModelConfig
from dynmb.core.model_sizes import leading_layers
from dynmb.memory.model import MemoryModel
from dynmb.packing.context import stage_windows
from dynmb.planning.partition import min_max_partition
from dynmb.planning.split_units import CHUNK, LAYER, UNITS_PER_LAYER, UnitRow, fine_grid, unit_row
from dynmb.planning.split_work import layout_cost_model, workload_cost, workload_lengths
from dynmb.planning.stage_split import with_split
from dynmb.schedule.kinds import AUTO, get_kind
from dynmb.timing.bounds import sequence_costs

__all__ = ["ReliefInputs", "Relief", "layout_of", "step_proxy", "stage_tokens", "relief_candidates", "relieve",
           "relieved_layout", "recompute_steps", "rebalanced_layout", "with_recompute", "RELIEF_GAIN", "RELIEF_STEP"]

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
    recompute_blocks: tuple[int, ...] | None = None
    """The leading blocks each stage recomputes in the layout taken (``ModelConfig.recompute_blocks``; None: none)."""

    @property
    def relieved(self) -> bool:
        return self.split != self.balanced or self.recompute_blocks is not None


def _windows(kind: str, num_stages: int) -> np.ndarray:
    return stage_windows(get_kind("1f1b" if kind == AUTO else kind), num_stages)


def stage_tokens(layout: ModelConfig, num_stages: int, inputs: ReliefInputs) -> np.ndarray:
    """``[P]``: the tokens one microbatch may hold on each stage alone under ``layout``'s analytic memory model and
    the kind's window (one-token rows, the tight budget: ``MemoryModel.max_rows``); 0 where its states pass the
    limit."""
    mm = MemoryModel.analytic(layout, num_stages).as_planned(inputs.embedding, inputs.state_shards)
    caps = float(inputs.memory_limit_bytes) - np.asarray(mm.state_bytes, dtype=np.float64)
    windows = _windows(inputs.schedule_kind, num_stages)
    out = np.empty(num_stages, dtype=np.int64)
    for i in range(num_stages):
        alone = np.full(num_stages, np.inf)
        alone[i] = caps[i]
        out[i] = int(mm.max_rows(alone, 1, windows, tight=True)[0])
    return out


def step_proxy(layout: ModelConfig, num_stages: int, inputs: ReliefInputs, mean_len: int) -> tuple[float, int]:
    """(seconds per token of the busiest stage, tokens admitted) for a microbatch of ``mean_len``-token rows
    holding as many tokens as ``layout``'s analytic memory model admits on every stage under the kind's window
    (module doc; the rows' token count as one-token rows, continuous: the s^2 term of short rows left out);
    ``inf`` where not one ``mean_len`` row fits. The layout's recomputed blocks are in both models."""
    tokens = int(stage_tokens(layout, num_stages, inputs).min())
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
    """``cfg`` with layers per stage ``split``, its LM-head rows (``head_split``) kept and no blocks recomputed
    (``recompute_blocks`` counts the blocks of the split it was chosen with: ``with_recompute`` sets them)."""
    cfg = replace(cfg, recompute_blocks=None)
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


def with_recompute(cfg: ModelConfig, num_stages: int, split: tuple[float, ...],
                   blocks: tuple[int, ...] | None) -> ModelConfig:
    """``layout_of(cfg, num_stages, split)`` recomputing ``blocks`` leading blocks per stage (None or all 0: none;
    ValueError where a stage holds fewer)."""
    layout = layout_of(cfg, num_stages, split)
    if blocks is None or not any(blocks):
        return layout
    return replace(layout, layer_split=tuple(layout.stage_layer_counts(num_stages)), recompute_blocks=tuple(blocks))


@dataclass(frozen=True)
class _Scored:
    """One candidate layout of ``relieve``: its split, recomputed blocks and ``step_proxy``."""

    proxy_s: float
    tokens: int
    split: tuple[float, ...]
    blocks: tuple[int, ...] | None = None


@dataclass(frozen=True)
class _Work:
    """The unit work ``relieve`` re-balances by: the planning row (``unit_row``) and each 1/16-layer unit's forward."""

    row: UnitRow
    fwd: np.ndarray
    rebalanced: dict[tuple[int, ...], tuple[float, ...] | None] = field(default_factory=dict)
    """``_rebalanced``'s answers by recomputed blocks (they do not depend on the split a search started from)."""


def _work(cfg: ModelConfig, inputs: ReliefInputs) -> _Work:
    """``_Work`` of the workload: its F + B per unit (``workload_cost``) and the forward's share of it, read off the
    cost model at one layer (a middle layer's workload seconds)."""
    cm = layout_cost_model(inputs.cost_model)
    assert cm is not None
    cost = workload_cost(inputs.workload, cfg, inputs.cost_model)
    one = replace(cfg, n_layers=2, layer_split=None, head_split=None, recompute_blocks=None)
    costs = sequence_costs(cm.for_layout(one, 2), workload_lengths(inputs.workload, cfg))
    fwd, bwd = float(costs["F"][0].sum()), float(costs["B"][0].sum())
    fine, _, _, _ = fine_grid(cfg, cost, CHUNK)
    return _Work(unit_row(cfg, cost, CHUNK if inputs.half_blocks else LAYER),
                 fine * (fwd / (fwd + bwd) if fwd + bwd > 0 else 0.0))


REBALANCE_ROUNDS = 3
"""Partitions ``_rebalanced`` tries at most: each re-counts the recomputed blocks' forward on the split it gave."""


def _recomputed_fwd(cfg: ModelConfig, num_stages: int, work: _Work, split: tuple[float, ...],
                    blocks: tuple[int, ...], stages: int) -> list[float] | None:
    """The forward of each of the first ``stages`` stages' recomputed blocks on ``split``: the units of its first
    ``k`` blocks (a layer's remainder at the stage's start counts one, ``leading_layers``); None where a stage holds
    fewer blocks than it recomputes."""
    try:
        layout = with_recompute(cfg, num_stages, split, blocks)
    except ValueError:
        return None
    out, start = [], 0
    for i, pieces in enumerate(layout.stage_pieces(num_stages)[:stages]):
        layers = set(leading_layers(pieces, blocks[i]))
        moved = sum(len(pc.chunks) for pc in pieces if pc.layer in layers)
        out.append(float(work.fwd[start:start + moved].sum()))
        start += sum(len(pc.chunks) for pc in pieces)
    return out


def _rebalanced(cfg: ModelConfig, num_stages: int, work: _Work, blocks: tuple[int, ...]) -> tuple[float, ...] | None:
    """The split of the stages up to the tail re-balanced over the unit work with every stage's recomputed blocks'
    forward added to its own work (``min_max_partition``'s ``extras``; module doc), the tail kept as it is: first
    ``k`` whole layers' forward each, then, up to ``REBALANCE_ROUNDS`` partitions, what the blocks hold on the split
    the last one gave (a stage starting inside a layer recomputes that layer's remainder first); None where not every
    stage gets a unit."""
    if blocks not in work.rebalanced:
        work.rebalanced[blocks] = _partitioned(cfg, num_stages, work, blocks)
    return work.rebalanced[blocks]


def _partitioned(cfg: ModelConfig, num_stages: int, work: _Work, blocks: tuple[int, ...]) -> tuple[float, ...] | None:
    """``_rebalanced`` computed: the partitions with the extras re-counted until they hold on the split given."""
    tail = _tail(cfg, num_stages)
    row = work.row
    kept = tuple(cfg.stage_layer_counts(num_stages)[tail:])
    body_end = row.index(int(round(UNITS_PER_LAYER * sum(cfg.stage_layer_counts(num_stages)[:tail]))))
    extras: list[float] | None = [float(work.fwd[:UNITS_PER_LAYER * k].sum()) for k in blocks[:tail]]
    split = None
    for _ in range(REBALANCE_ROUNDS):
        parts, _, _ = min_max_partition(row.work[:body_end], tail, row.first, 0.0, extras)
        if min(parts) < 1:
            return split
        split = (*row.layers(parts), *kept)
        counted = _recomputed_fwd(cfg, num_stages, work, split, blocks, tail)
        if counted is None or counted == extras:        # the blocks hold what the partition charged them
            break
        extras = counted
    return split


def rebalanced_layout(cfg: ModelConfig, num_stages: int, inputs: ReliefInputs, blocks: tuple[int, ...]) -> ModelConfig:
    """``cfg`` recomputing ``blocks`` leading blocks per stage on its split re-balanced with every stage's extra
    forward (``_rebalanced``; the split of ``cfg`` where no re-balance gives each stage a unit): the layout
    ``recompute_steps`` weighs for those blocks. ValueError where a stage holds fewer blocks than it recomputes."""
    split = _rebalanced(cfg, num_stages, _work(cfg, inputs), tuple(blocks))
    return with_recompute(cfg, num_stages, split or tuple(cfg.stage_layer_counts(num_stages)), tuple(blocks))


def recompute_steps(cfg: ModelConfig, num_stages: int, inputs: ReliefInputs, start: _Scored, mean_len: int,
                    work: _Work) -> list[_Scored]:
    """From ``start`` (a split, nothing recomputed), one more recomputed block on the binding stage at a time, on
    the same split and on the re-balanced one (``_rebalanced``), the better kept while its proxy improves (module
    doc): the candidates found, ``start`` not included."""
    out: list[_Scored] = []
    best = start
    while True:
        layout = with_recompute(cfg, num_stages, best.split, best.blocks)
        binding = int(np.argmin(stage_tokens(layout, num_stages, inputs)))
        blocks = list(best.blocks or (0,) * num_stages)
        blocks[binding] += 1
        trials = []
        splits = (best.split, _rebalanced(cfg, num_stages, work, tuple(blocks)))
        for split in dict.fromkeys(s for s in splits if s is not None):
            try:
                trial = with_recompute(cfg, num_stages, split, tuple(blocks))
            except ValueError:                          # more blocks than the stage holds there
                continue
            trials.append(_Scored(*step_proxy(trial, num_stages, inputs, mean_len), split, tuple(blocks)))
        if not trials:
            return out
        step = min(trials, key=lambda t: t.proxy_s)
        out += trials
        if not step.proxy_s < best.proxy_s:
            return out
        best = step


def relieve(cfg: ModelConfig, num_stages: int, inputs: ReliefInputs) -> tuple[ModelConfig, Relief]:
    """``cfg`` (its split the work-balanced one) with the split of ``relief_candidates`` and the recomputed blocks
    (``recompute_steps``) that have the smallest ``step_proxy``, where it gains ``RELIEF_GAIN`` (module doc), and
    the record of the choice."""
    lengths = workload_lengths(inputs.workload, cfg)
    mean_len = max(1, int(round(float(lengths.mean()))))
    scored = [_Scored(*step_proxy(layout_of(cfg, num_stages, s), num_stages, inputs, mean_len), s)
              for s in relief_candidates(cfg, num_stages, inputs)]
    base = scored[0]
    best = min(scored, key=lambda t: t.proxy_s)          # the splits without recomputation (module doc)
    if not best.proxy_s < base.proxy_s * (1 - RELIEF_GAIN):
        best = base
    work = _work(cfg, inputs)
    recomputing = [c for start in list(scored) for c in recompute_steps(cfg, num_stages, inputs, start, mean_len, work)]
    if recomputing:
        rc_best = min(recomputing, key=lambda t: t.proxy_s)
        if rc_best.proxy_s < min(t.proxy_s for t in scored) * (1 - RELIEF_GAIN):
            best = rc_best
    choice = Relief(best.split, base.split, best.proxy_s, base.proxy_s, best.tokens, base.tokens, best.blocks)
    if choice.relieved:
        logger.info("stage split auto: %s recomputing leading blocks %s, memory relief of the first stage "
                    "(microbatches of %d tokens in %d-token rows, %.4g s/token on the busiest stage) over the "
                    "work-balanced %s (%d tokens, %.4g s/token)", list(best.split),
                    list(best.blocks or [0] * num_stages), best.tokens, mean_len, best.proxy_s, list(base.split),
                    base.tokens, base.proxy_s)
    return (with_recompute(cfg, num_stages, best.split, best.blocks) if choice.relieved else cfg), choice


def relieved_layout(cfg: ModelConfig, num_stages: int, inputs: ReliefInputs, *, virtual: int = 1,
                    memory_model: Any = None) -> tuple[ModelConfig, Relief | None]:
    """``relieve`` where it applies (``--stage-split auto`` resolved to ``cfg``): one chunk a GPU, a workload, a
    cost model that prices any layout and no memory model given (the analytic one); else ``(cfg, None)``."""
    if virtual != 1 or num_stages < 2 or memory_model is not None or inputs.workload is None \
            or layout_cost_model(inputs.cost_model) is None:
        return cfg, None
    return relieve(cfg, num_stages, inputs)
