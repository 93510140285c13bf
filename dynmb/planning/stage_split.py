"""The layer split planned too: contiguous layers per stage that balance the stages' work.

An even split gives every stage the same number of layers, but the first stage also embeds and the
last runs the final norm, the LM head and the loss: at Llama-2-7B widths the head is a 32,000 x 4,096
matmul, about 1.4 layers' worth of FLOPs for a 1k-token microbatch, so with two layers per stage at
P = 16 the last stage does 1.4x the others' work and caps the whole pipeline at 1/1.36 of the machine
(Megatron's ``pipeline_model_parallel_layout`` and DeepSpeed's ``partition_method`` let users move
layers by hand for the same reason).

Work model: a stage's work is the forward FLOPs of its layers plus, on the first stage, the embedding
and, on the last, the head (``ModelConfig.stage_flops``, the same count every consumer uses, for both
families; backward is a multiple of forward per part, so forward FLOPs rank splits as the whole step
does). The per-part FLOPs are read off ``stage_flops`` at one representative microbatch of
``tokens_hint`` tokens in one row (attention grows with the row length, the head does not: the hint
matters; ``--stage-split auto`` uses 1,024 tokens, a typical microbatch row of the shipped traces):
``layer = F(2 layers, 1 stage) - F(1 layer, 1 stage)``, ``first = F_0(2 layers, 2 stages) - layer``,
``last = F_1(2 layers, 2 stages) - layer``.

Algorithm: the min-max contiguous partition of ``n_layers`` items into ``P`` non-empty segments,
where a segment's cost is its layers' work plus the first/last extras when it touches an end, by
dynamic programming over (stages used, layers covered): ``best[k][j] = min over i of max(best[k-1][i],
cost(i, j))``, ties (the min-max optimum is rarely unique with whole layers) broken by the smallest
sum of squared stage work, so the spare work spreads evenly instead of leaving a near-empty stage.
``O(P x n_layers^2)`` with the inner minimum vectorised (numpy): milliseconds for 128 layers.

Whole layers bound what any split can do: moving a layer off the last stage only helps when the head
costs more than the layer moved, so at 32k vocabularies and two layers a stage (Llama-2-7B at P = 16)
the even split is already optimal and the head's 1.4x stays; at Llama-3's 128k vocabulary the head is
about 2.4 layers and the planned split removes most of the imbalance (tests/test_stage_split.py).

The split is a property of the model layout (``ModelConfig.layer_split``): the memory model, the cost
models, the runtime's stages and the single-process reference all read it through
``ModelConfig.stage_layers``; a fitted cost or memory model is refused for another split.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np

from dynmb.config import ModelConfig

__all__ = ["balanced_split", "stage_work", "resolve_stage_split", "STAGE_SPLITS"]

logger = logging.getLogger(__name__)

STAGE_SPLITS = ("even", "auto")
"""The named ``--stage-split`` settings; anything else is an explicit list such as ``"9,8,8,7"``."""


def _parts(cfg: ModelConfig, tokens_hint: int) -> tuple[float, float, float]:
    """(per-layer, first-stage extra, last-stage extra) forward FLOPs at one row of ``tokens_hint``."""
    base = replace(cfg, layer_split=None)
    one, two = replace(base, n_layers=1), replace(base, n_layers=2)
    layer = float(two.stage_flops(0, 1, 1, tokens_hint)) - float(one.stage_flops(0, 1, 1, tokens_hint))
    first = float(two.stage_flops(0, 2, 1, tokens_hint)) - layer
    last = float(two.stage_flops(1, 2, 1, tokens_hint)) - layer
    return layer, max(first, 0.0), max(last, 0.0)


def stage_work(cfg: ModelConfig, split: tuple[int, ...], tokens_hint: int = 1024) -> list[float]:
    """The work model's forward FLOPs of each stage under ``split`` (layers per stage)."""
    layer, first, last = _parts(cfg, tokens_hint)
    work = [n * layer for n in split]
    work[0] += first
    work[-1] += last
    return work


def balanced_split(cfg: ModelConfig, num_stages: int, tokens_hint: int = 1024) -> tuple[int, ...]:
    """The contiguous split of ``cfg``'s layers over ``num_stages`` stages with the smallest maximum
    stage work, ties broken by the smallest sum of squared stage work (module docstring)."""
    n, p = cfg.n_layers, int(num_stages)
    if not 1 <= p <= n:
        raise ValueError(f"cannot split {n} layers over {p} stages (need 1 <= stages <= layers)")
    layer, first, last = _parts(cfg, max(1, int(tokens_hint)))
    prefix = np.arange(n + 1, dtype=np.float64) * layer            # work of layers [0, j)
    inf = np.inf
    # best[k][j]: (max, sum of squares) of the best split of layers [0, j) into k + 1 stages
    best_max = np.full((p, n + 1), inf)
    best_sq = np.full((p, n + 1), inf)
    arg = np.zeros((p, n + 1), dtype=np.int64)
    j = np.arange(n + 1)
    seg0 = prefix + first + np.where(j == n, last, 0.0)
    best_max[0, 1:], best_sq[0, 1:] = seg0[1:], seg0[1:] ** 2
    for k in range(1, p):
        for end in range(k + 1, n + 1):
            starts = np.arange(k, end)                                    # the last segment is [start, end)
            seg = prefix[end] - prefix[starts] + (last if end == n else 0.0)
            mx = np.maximum(best_max[k - 1, starts], seg)
            sq = best_sq[k - 1, starts] + seg ** 2
            lo = mx.min()
            ties = np.flatnonzero(mx <= lo * (1 + 1e-12))
            pick = ties[np.argmin(sq[ties])]
            best_max[k, end], best_sq[k, end], arg[k, end] = mx[pick], sq[pick], starts[pick]
    split, end = [], n
    for k in range(p - 1, 0, -1):
        start = int(arg[k, end])
        split.append(end - start)
        end = start
    split.append(end)
    return tuple(reversed(split))


def resolve_stage_split(cfg: ModelConfig, num_stages: int, setting: str, tokens_hint: int = 1024) -> ModelConfig:
    """``cfg`` with the layer split ``setting`` names: ``even`` (None), ``auto`` (``balanced_split``), or an
    explicit comma-separated list of layers per stage."""
    setting = str(setting).strip()
    if setting == "even":
        return replace(cfg, layer_split=None)
    if setting == "auto":
        split = balanced_split(cfg, num_stages, tokens_hint)
        even = [len(r) for r in replace(cfg, layer_split=None).stage_layers(num_stages)]
        w_even, w_auto = stage_work(cfg, tuple(even), tokens_hint), stage_work(cfg, split, tokens_hint)
        logger.info("stage split auto: %s (max/mean stage work %.3f; even split %s: %.3f)", list(split),
                    max(w_auto) * len(w_auto) / sum(w_auto), even, max(w_even) * len(w_even) / sum(w_even))
        return replace(cfg, layer_split=split)
    try:
        split = tuple(int(x) for x in setting.split(","))
    except ValueError:
        raise ValueError(f"--stage-split must be even, auto or layers per stage such as 9,8,8,7; got {setting!r}") from None
    if len(split) != num_stages:
        raise ValueError(f"--stage-split {setting} gives {len(split)} stages, not {num_stages}")
    return replace(cfg, layer_split=split)
