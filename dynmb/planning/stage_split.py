"""The layer split planned too: contiguous layers per stage that balance the stages' work.

An even split gives every stage the same number of layers, but the first stage also embeds and the
last runs the final norm, the LM head and the loss: at Llama-2-7B widths the head is a 32,000 x 4,096
matmul, about 1.4 layers' worth of FLOPs for a 1k-token microbatch, so with two layers per stage at
P = 16 the last stage does 1.4x the others' work and caps the whole pipeline at 1/1.36 of the machine
(Megatron's ``pipeline_model_parallel_layout`` and DeepSpeed's ``partition_method`` let users move
layers by hand for the same reason).

Work model: what ``resolve_stage_split``'s ``auto`` balances is the work of the workload the pipeline
will train, when it is given (``workload``: the lengths, a trace name or a length-trace CSV;
``dynmb.Planner(workload=...)``, and ``dynmb plan`` / ``run`` / ``compare`` pass the trace they draw
batches from): every sequence's forward + backward at its own length, attention's s^2 term included,
priced by the cost model where it prices any layout (the analytic and GPU models), else in FLOPs
(``dynmb.planning.split_work``). With no workload it falls back to forward FLOPs
(``ModelConfig.stage_flops``) at one representative microbatch of ``tokens_hint`` tokens in one row
(1,024, a typical microbatch row of the shipped traces; the head does not grow with the row length,
attention does, so the hint matters), and says so once: with long documents that stand-in loads the
stages holding extra attention halves (docs/results.md "Half-block stage splits"). Any other work model
enters as ``stage_cost(layout, stage, num_stages) -> work`` and is read off the same small layouts
(``split_units.half_parts``).

Units: whole layers, half-blocks or chunks of them (``split_units``; ``half_blocks=True``, ``--stage-split
auto`` for dynmb's own families, allows the last two): a pre-norm block is two residual sub-blocks, ``x +
attn(norm1(x))`` then ``x + mlp(norm2(x))``, each a function of the hidden state alone, so a stage boundary
may fall between them with only the hidden state crossing it; inside a half, between eighths of its K/V
heads or MLP columns, the partial sum and the half's normalised input cross it (``dynmb.core.model_sizes``,
``[y | h]``). At Llama-2-7B widths the attention half (4 d^2 per token plus the scores) is about 1/3 of a
layer and the SwiGLU half 2/3.

Algorithm: the min-max contiguous partition of the ``N`` units (``n_layers``, ``2 n_layers`` alternating
attention/MLP halves, or up to ``16 n_layers`` chunks) into ``P`` non-empty segments, where a segment's cost
is its units' work plus the first/last extras when it touches an end, by dynamic programming over (stages
used, units covered): ``best[k][j] = min over i of max(best[k-1][i], cost(i, j))``, ties (the min-max
optimum is rarely unique) broken by the smallest sum of squared stage work, so the spare work spreads evenly
instead of leaving a near-empty stage (``partition``). ``O(P x N^2)`` with the inner minimum vectorised
(numpy): 0.1-0.5 s for 32 layers in chunks. The grains are solved coarse to fine and a finer one is taken
only where its busiest stage does less work: strictly less for half-blocks against whole layers, so wherever
whole layers are already optimal ``auto`` keeps the same whole-layer split (and the same fitted models), and
``CHUNK_GAIN`` (1%) less for chunks against half-blocks (a boundary inside a half sends twice the bytes;
the simulator prices every link's message at the widest, ``ModelConfig.link_bytes``). Chunks at one chunk a GPU only
(interleaved splits balance per GPU in half-blocks). The
last stage may also hold the final norm and LM head alone (``P - 1`` segments and an empty last one,
``_stage_partition``), taken only where that lowers the busiest stage's work: a head heavier than the
mean stage (Llama-3's 128k vocabulary at P >= 16) is then the busiest stage by itself.

Whole layers bound what a split can do: moving a layer off the last stage only helps when the head
costs more than the layer moved, so at 32k vocabularies and two layers a stage (Llama-2-7B at P = 16)
the even split is the best whole-layer one and the head's 1.4x stays (split ceiling, mean over busiest
stage work ``split_ceiling``, 0.78); half-blocks move an attention half off the head's stage and lift
it to 0.865 (docs/results.md); at Llama-3's 128k vocabulary the head is about 2.4 layers and the
planned split removes most of the imbalance at P <= 8 (tests/test_stage_split.py). Chunks lift the
ceiling to 0.98 at P 16 on both (``studies/stage_split/ceilings.py``).

Min-max cannot see where an uneven stage sits, which moves the fill and drain of 1F1B and the
zero-bubble kinds by a few percent: given the run's planning settings (``search``, a
``split_search.SplitSearch``), ``auto`` takes among the near-optimal splits the one whose simulated step
is fastest (``dynmb.planning.split_search``), else the min-max split, said once.

Interleaved chunks (``virtual`` V > 1: ``num_stages`` counts the P V chunks, chunk ``s`` on GPU ``s %
P``): the steady state is bound by each GPU's total work, the sum of its V chunks, so ``auto`` minimises
the busiest GPU's total instead (``dynmb.planning.gpu_split``: local search and, at V = 2, an exact
bisection), every chunk within caps taken from the per-chunk min-max split (per round of the schedule,
and its in-flight activations), and keeps the per-chunk split unless the busiest GPU does strictly less
work; ``resolve_stage_split`` reads V from its caller (``Planner``, ``run``, ``compare``, the scaling study)
or the split search's spec.

The split is a property of the model layout (``ModelConfig.layer_split``, halves allowed): the memory
model, the cost models, the runtime's stages and the single-process reference all read it through
``ModelConfig.stage_units`` / ``stage_parts`` / ``stage_blocks``; a fitted cost or memory model is
refused for another split; an ``auto`` split equal to the even one is the even split (``layer_split``
None), so a model fitted on the even split still fits. A model of the user's own splits whole layers only
(``half_blocks=False``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dynmb.core.config import ModelConfig

from dynmb.planning.gpu_split import chunk_loads, gpu_balanced_partition
from dynmb.planning.head_split import shard_head
from dynmb.planning.partition import min_max_partition as _min_max_partition
from dynmb.planning.split_units import CHUNK, HALF, LAYER, StageCost, UnitRow, flops_cost, stage_work, unit_row, unit_work
from dynmb.planning.split_work import fitted_split, workload_cost

__all__ = ["balanced_split", "planned_layout", "min_max_split", "with_split", "stage_work", "unit_work", "split_ceiling",
           "resolve_stage_split", "flops_cost", "StageCost", "STAGE_SPLITS", "SplitInputs"]

logger = logging.getLogger(__name__)

STAGE_SPLITS = ("even", "auto")
"""The named ``--stage-split`` settings; anything else is an explicit list such as ``"9,8,8,7"`` (or
``"2.5,2,2,1.5"``, in half-blocks)."""


CHUNK_GAIN = 0.01
"""A split with a boundary inside a half-block is taken only where its busiest stage does at least this much
less work than the half-block split's: such a boundary sends twice the bytes (``[y | h]``) and cuts the
matmuls narrower, so a smaller gain is left to the coarser split."""


def split_ceiling(cfg: ModelConfig, split: tuple[float, ...], tokens_hint: int = 1024, *,
                  stage_cost: StageCost | None = None, virtual: int = 1) -> float:
    """Mean GPU work over the busiest GPU's under ``split`` (``virtual`` chunks per GPU, chunk ``s`` on GPU
    ``s % (len(split) / virtual)``; one: a stage a GPU): the share of the machine the split alone lets a
    pipeline use (1.0: balanced)."""
    w = np.asarray(stage_work(cfg, split, tokens_hint, stage_cost=stage_cost))
    g = w.reshape(int(virtual), -1).sum(axis=0)
    return float(g.mean() / g.max())


def _stage_partition(units: np.ndarray, p: int, first: float, last: float) -> tuple[list[int], float, float]:
    """``_min_max_partition`` where the last of several stages may also hold the head alone (no unit):
    ``p - 1`` segments and an empty last one, taken only where its busiest stage does strictly less work."""
    counts, top, sq = _min_max_partition(units, p, first, last)
    if 1 < p <= units.size + 1:
        alone, top_alone, sq_alone = _min_max_partition(units, p - 1, first, 0.0)
        if max(top_alone, last) < top * (1 - 1e-9):
            return alone + [0], max(top_alone, last), sq_alone + last ** 2
    return counts, top, sq


def min_max_split(cfg: ModelConfig, num_stages: int, stage_cost: StageCost, *, half_blocks: bool) -> tuple[float, ...]:
    """The min-max partition in half-blocks (``half_blocks``) or whole layers, as layers per stage, without
    ``balanced_split``'s preference for whole layers."""
    row = unit_row(cfg, stage_cost, HALF if half_blocks else LAYER)
    return row.layers(_stage_partition(row.work, int(num_stages), row.first, row.last)[0])


def _gpu_partition(units: np.ndarray, p: int, virtual: int, first: float, last: float) -> tuple[list[int], float]:
    """(units per chunk, busiest GPU's work) of the split balanced per GPU (``dynmb.planning.gpu_split``),
    searched from the per-chunk min-max partition and the even one; the per-chunk min-max partition itself
    unless the busiest GPU's work is strictly lower (where per-GPU balance gains nothing the split stays)."""
    n = units.size
    even = [n // p + (1 if s < n % p else 0) for s in range(p)]
    per_chunk = _min_max_partition(units, p, first, last)[0]
    counts, loads = gpu_balanced_partition(units, p, virtual, first, last, [per_chunk, even])
    kept = chunk_loads(per_chunk, units, first, last, virtual).key[0]
    if loads.key[0] >= kept * (1 - 1e-9):
        return per_chunk, kept
    return counts, loads.key[0]


def balanced_split(cfg: ModelConfig, num_stages: int, tokens_hint: int = 1024, *,
                   half_blocks: bool = False, stage_cost: StageCost | None = None,
                   virtual: int = 1) -> tuple[float, ...]:
    """The contiguous split of ``cfg``'s layers over ``num_stages`` stages with the smallest maximum
    stage work, ties broken by the smallest sum of squared stage work (module docstring); with
    ``half_blocks`` a stage may start or end between a block's attention and MLP halves, and the
    half-block split is taken only where it lowers the busiest stage's work (else the whole-layer one).
    ``virtual`` > 1 (interleaved: ``num_stages`` chunks, chunk ``s`` on GPU ``s % (num_stages /
    virtual)``): the smallest busiest GPU's work (the sum of its chunks), then busiest chunk's
    (``dynmb.planning.gpu_split``), half-blocks again taken only where they lower the busiest GPU's."""
    n, p, v = cfg.n_layers, int(num_stages), int(virtual)
    if v < 1 or p % v:
        raise ValueError(f"cannot place {p} chunks {v} a GPU (virtual must divide the chunk count)")
    cost = stage_cost or flops_cost(max(1, int(tokens_hint)))
    most = n if not half_blocks else 2 * n if v > 1 else unit_row(cfg, cost, CHUNK).work.size
    if not 1 <= p <= most:
        raise ValueError(f"cannot split {n} layers over {p} stages (need 1 <= stages <= {most}, the "
                         f"{'layers' if not half_blocks else 'half-blocks' if v > 1 else 'chunks the model allows'})")

    def solve(row: UnitRow) -> tuple[list[int], float]:
        if v > 1:
            return _gpu_partition(row.work, p, v, row.first, row.last)
        counts, top, _ = _stage_partition(row.work, p, row.first, row.last)
        return counts, top

    best, w_max = None, np.inf
    grains = [LAYER] if p <= n else []
    if half_blocks:
        grains += [HALF, CHUNK] if v == 1 else [HALF]
    for grain in grains:                               # a finer grain only where lighter (CHUNK_GAIN)
        row = unit_row(cfg, cost, grain)
        counts, top = solve(row)
        if _finer_wins(top, w_max, grain):
            best, w_max = row.layers(counts), top
    assert best is not None
    return best


def _fallback_said() -> bool:
    """Whether the 1,024-token stand-in was said already (once per process); marks it said."""
    global _FALLBACK_SAID
    said, _FALLBACK_SAID = _FALLBACK_SAID, True
    return said


_FALLBACK_SAID = False
_CHOICE_SAID: set[str] = set()


def _say_choice(choice: Any) -> None:
    """Log how ``auto`` chose (``split_search.SplitChoice``): by simulated step every time (once per run), the
    min-max fallback and its reason once per process."""
    if choice.how == "simulated":
        i = choice.candidates.index(choice.split)
        logger.info("stage split auto: %s by simulated step, %.4f s (%.0f real tokens) against the min-max split "
                    "%s's %.4f s (%.0f) on sample batches (%d candidates of %d near-optimal arrangements; %.1f CPU s); "
                    "rule: %s", list(choice.split), choice.steps_s[i], choice.tokens[i], list(choice.candidates[0]),
                    choice.steps_s[0], choice.tokens[0], len(choice.candidates), choice.near_optimal, choice.cpu_s,
                    choice.rule)
    elif choice.reason not in _CHOICE_SAID:
        _CHOICE_SAID.add(choice.reason)
        logger.info("stage split auto: the min-max split, not chosen by simulated step: %s", choice.reason)


def with_split(cfg: ModelConfig, num_stages: int, split: tuple[float, ...]) -> ModelConfig:
    """``cfg`` with layers per stage ``split``; the even split as the even split (``layer_split`` None), so
    a model fitted on the even split still fits (with more stages than layers there is none)."""
    if num_stages <= cfg.n_layers and tuple(split) == tuple(replace(cfg, layer_split=None, head_split=None, recompute_blocks=None).stage_layer_counts(num_stages)):
        return replace(cfg, layer_split=None, head_split=None, recompute_blocks=None)
    return replace(cfg, layer_split=tuple(split), head_split=None, recompute_blocks=None)


@dataclass(frozen=True, kw_only=True)
class SplitInputs:
    """What ``resolve_stage_split`` and ``planned_layout`` take beside the model and the stage count (their
    keyword arguments, checked here: an unknown one is a ``TypeError`` naming it)."""

    half_blocks: bool = True
    """Split between a block's attention and MLP halves (dynmb's own families); False: whole layers only."""
    stage_cost: StageCost | None = None
    """The work ``auto`` balances; None: the workload's, else forward FLOPs of one ``tokens_hint`` row."""
    workload: Any = None
    """The lengths the pipeline will train (an array, a trace name or a length-trace CSV)."""
    cost_model: Any = None
    """Prices the workload where it prices any layout (an object or a JSON path); a fitted one pins its split."""
    search: Any = None
    """A ``split_search.SplitSearch``: choose among near-optimal splits by simulated step."""
    virtual: int | None = None
    """Model chunks per GPU (interleaved; the stage count counts chunks); None: ``search``'s, else 1."""
    arrangements: tuple = ()
    """``planned_layout``: the search's other candidate splits, whose prefix-keeping head shards are weighed too."""


def planned_layout(cfg: ModelConfig, num_stages: int, split: tuple[float, ...], stage_cost: StageCost,
                   **inputs: Any) -> ModelConfig:
    """``cfg`` with the layer split ``split`` an ``auto`` choice arrived at (``with_split``), its LM head then
    sharded over the last stages where that lightens the busiest stage (``head_split.shard_head``; one chunk
    a GPU, dynmb's own families) and, given a ``search`` that can simulate (``SplitSearch.scores`` of the
    ``workload`` priced by ``cost_model``), where the simulated step per real token is strictly smaller too,
    the prefix-keeping shards of the search's other candidate splits (``arrangements``) weighed beside.
    ``inputs``: the fields of ``SplitInputs`` (``virtual`` None counts as 1)."""
    opts = SplitInputs(**inputs)
    out = with_split(cfg, num_stages, split)
    if int(opts.virtual or 1) != 1 or not opts.half_blocks or num_stages < 2:
        return out
    sharded = _shards(out, num_stages, stage_cost)
    if not sharded:
        return out
    for other in (opts.arrangements if opts.search is not None else ()):
        sharded += [x for x in _shards(with_split(cfg, num_stages, tuple(other)), num_stages, stage_cost, whole=False)
                    if x not in sharded]
    scores = None if opts.search is None else opts.search.scores([out, *sharded], num_stages, workload=opts.workload,
                                                                 cost_model=opts.cost_model)
    if scores is None:
        return sharded[0]                              # the min-max layout
    best = min(range(len(scores)), key=lambda i: (scores[i] if i == 0 else scores[i] / (1 - 1e-9), i))
    logger.info("stage split: the head kept whole simulates %.4f s per batch, sharded %s: %s", scores[0],
                ", ".join(f"{x:.4f}" for x in scores[1:]), "kept whole" if best == 0 else f"sharded ({best})")
    return out if best == 0 else sharded[best - 1]


def _busiest(layout: ModelConfig, num_stages: int, stage_cost: StageCost) -> float:
    return max(stage_work(layout, tuple(layout.stage_layer_counts(num_stages)), stage_cost=stage_cost))


def _finer_wins(top: float, coarser_top: float, grain: int) -> bool:
    """Whether a partition at ``grain`` whose busiest stage does ``top`` replaces the coarser one's: strictly
    lighter, by ``CHUNK_GAIN`` for chunks (module docstring)."""
    return top < coarser_top * (1 - (CHUNK_GAIN if grain == CHUNK else 1e-9))


def _shards(layout: ModelConfig, num_stages: int, stage_cost: StageCost, *, whole: bool = True) -> list[ModelConfig]:
    """``head_split.shard_head`` of ``layout``: re-partitioned in half-blocks, or in chunks where that is
    ``CHUNK_GAIN`` lighter still (or ``layout`` has chunks already)."""
    now = _busiest(layout, num_stages, stage_cost)
    out: list[ModelConfig] = []
    best = np.inf
    for grain in ([CHUNK] if layout.chunk_split else [HALF, CHUNK]):
        found = shard_head(layout, num_stages, unit_row(layout, stage_cost, grain), now, whole=whole)
        top = min((_busiest(x, num_stages, stage_cost) for x in found), default=np.inf)
        if found and (not out or _finer_wins(top, best, grain)):
            out, best = found, top
    return out


def resolve_stage_split(cfg: ModelConfig, num_stages: int, setting: str, tokens_hint: int = 1024,
                        **inputs: Any) -> ModelConfig:
    """``cfg`` with the layer split ``setting`` names: ``even`` (None), ``auto`` (``balanced_split``, in
    half-blocks when ``half_blocks``), or an explicit comma-separated list of layers per stage, whole
    (``9,8,8,7``) or with halves (``2.5,2,2,1.5``). ``inputs``: the fields of ``SplitInputs``.
    ``half_blocks=False`` (a model of the user's own, whose stages split whole layers): ``auto`` in whole
    layers, and a list with halves is refused.
    The work ``auto`` balances: ``stage_cost`` when given; else the ``workload``'s (lengths, a trace
    name or a length-trace CSV) forward + backward at every sequence's own length, priced by
    ``cost_model`` (an object or JSON path) where it prices any layout, else in FLOPs
    (``dynmb.planning.split_work``); with neither, forward FLOPs at one row of ``tokens_hint`` tokens,
    said once (module docstring). A fitted ``cost_model`` made for this model and stage count prices
    only the split it was measured on: ``auto`` is that split. ``search`` (a
    ``dynmb.planning.split_search.SplitSearch``: the run's planning settings and global batch size): ``auto``
    takes, among the near-optimal splits, the one whose simulated step on sample batches of the workload is
    fastest, where the cost model prices any layout; else (and without ``search``) the min-max split.
    ``virtual`` (model chunks per GPU, interleaved; ``num_stages`` counts chunks; None: ``search``'s, else
    1): with more than one ``auto`` balances each GPU's total work (``balanced_split``)."""
    opts = SplitInputs(**inputs)
    setting = str(setting).strip()
    if opts.virtual is None:
        opts = replace(opts, virtual=int(getattr(getattr(opts.search, "spec", None), "virtual", 1)))
    if setting == "even":
        return replace(cfg, layer_split=None, head_split=None, recompute_blocks=None)
    if setting == "auto":
        if cfg.recompute_blocks is not None:    # per the model's own split: auto chooses its own, said
            logger.warning("stage split auto: model %r's recompute_blocks %s were for its own split %s and are not "
                           "carried over (auto chooses its own; an explicit --stage-split keeps them)", cfg.name,
                           list(cfg.recompute_blocks), list(cfg.layer_split or ()))
        return _auto_layout(cfg, num_stages, tokens_hint, opts)
    return _explicit_split(cfg, num_stages, setting, opts.half_blocks)


def _auto_layout(cfg: ModelConfig, num_stages: int, tokens_hint: int, opts: SplitInputs) -> ModelConfig:
    """``--stage-split auto`` (``resolve_stage_split``; ``opts.virtual`` resolved)."""
    stage_cost, virtual = opts.stage_cost, int(opts.virtual or 1)
    pinned = fitted_split(opts.cost_model, cfg, num_stages) if stage_cost is None else None
    if pinned is not None:
        logger.info("stage split auto: %s, the split the fitted cost model was measured on",
                    list(pinned.stage_layer_counts(num_stages)))
        return pinned
    if stage_cost is None and opts.workload is not None:
        stage_cost = workload_cost(opts.workload, cfg, opts.cost_model)
    elif stage_cost is None and not _fallback_said():
        logger.warning("--stage-split auto: no workload given, so the split balances forward FLOPs of one "
                       "%s-token row, not the work of the sequences you train; give the lengths (dynmb plan / "
                       "run / compare: --dataset or --lengths; Planner(workload=lengths or a trace name))",
                       f"{int(tokens_hint):,}")
    arrangements: tuple = ()
    if opts.search is not None:
        choice = opts.search.choose(cfg, num_stages, stage_cost or flops_cost(max(1, int(tokens_hint))),
                                    half_blocks=opts.half_blocks, workload=opts.workload, cost_model=opts.cost_model,
                                    virtual=virtual)
        split, arrangements = choice.split, getattr(choice, "candidates", ())
        _say_choice(choice)
    else:
        split = balanced_split(cfg, num_stages, tokens_hint, half_blocks=opts.half_blocks, stage_cost=stage_cost,
                               virtual=virtual)
    out = planned_layout(cfg, num_stages, split, stage_cost or flops_cost(max(1, int(tokens_hint))),
                         virtual=virtual, half_blocks=opts.half_blocks, search=opts.search, workload=opts.workload,
                         cost_model=opts.cost_model, arrangements=arrangements)
    _say_auto(cfg, num_stages, out, tokens_hint, stage_cost, virtual)
    return out


def _say_auto(cfg: ModelConfig, num_stages: int, out: ModelConfig, tokens_hint: int, stage_cost: StageCost | None,
              virtual: int) -> None:
    """Log the layout ``auto`` planned, its split ceiling and the even split's."""
    even = None if num_stages > cfg.n_layers else \
        replace(cfg, layer_split=None, head_split=None, recompute_blocks=None).stage_layer_counts(num_stages)

    def ceiling(s: tuple[float, ...], layout: ModelConfig = cfg) -> float:
        return split_ceiling(layout, s, tokens_hint, stage_cost=stage_cost, virtual=virtual)

    logger.info("stage split auto: %s%s (split ceiling %.3f%s; even split: %s)", list(out.stage_layer_counts(num_stages)),
                "" if out.head_split is None else f", LM-head rows {list(out.head_split)}",
                ceiling(tuple(out.stage_layer_counts(num_stages)), out),
                f", {virtual} chunks a GPU" if virtual > 1 else "",
                "none" if even is None else f"{ceiling(tuple(even)):.3f}")


def _explicit_split(cfg: ModelConfig, num_stages: int, setting: str, half_blocks: bool) -> ModelConfig:
    """An explicit ``--stage-split`` list of layers per stage, checked (one line each)."""
    try:
        split = tuple(float(x) for x in setting.split(","))
    except ValueError:
        raise ValueError(f"--stage-split must be even, auto or layers per stage such as 9,8,8,7 (or 2.5,2,2,1.5 in "
                         f"half-blocks, 2.75,1.25 on the 1/16-layer grid); got {setting!r}") from None
    if len(split) != num_stages:
        raise ValueError(f"--stage-split {setting} gives {len(split)} stages, not {num_stages}")
    out = replace(cfg, layer_split=split)
    if out.half_split and not half_blocks:
        raise ValueError(f"--stage-split {setting}: a model of your own splits whole layers only; parts of blocks "
                         f"(x.5, x.25, ...) are for dynmb's own families (gpt2, llama)")
    return out
