"""Costs of a split backward (``I``, ``W``) and of full recomputation, from one cost model.

``CostModel.predict(stage, "I" | "W", ...)`` answers from the model's own fits when it was
fitted on samples with ``I``/``W`` rows (``dynmb profile --split``); otherwise it comes here and
the two ops are derived from the full backward ``B`` of the same microbatch:

    W = W_SHARE[role] * B(b, s, attention work 0)      # the Linear weight GEMMs: per token only
    I = (1 + SPLIT_OVERHEAD[role]) * B(b, s, a) - W     # the rest, plus the cost of two passes

The weight-gradient GEMMs do not depend on the attention work, so ``W`` is a share of ``B``
without its attention term and ``I`` keeps all of the attention. ``role`` is ``first``,
``middle`` or ``last`` (the last stage's LM head is a Linear, the first's embeddings are not);
a single stage is ``last``.

Recomputation (``recompute`` microbatches): the backward first reruns the stage's forward,
``RECOMPUTE_F_SHARE[role] * F`` (the stage's forward without what is not recomputed: the
embeddings; the last stage's head, final norm, LM head and loss, is recomputed too,
``dynmb.models.RecomputedHead``), and a recomputed microbatch runs its whole
backward in ``I`` (its ``W`` is empty, see ``dynmb.runtime.splitbackward``):

    B_rc = B + RECOMPUTE_F_SHARE[role] * F,    I_rc = B_rc,    W_rc = 0

Measured (``benchmarks/bench_split.py``, two runs of ``--repeats 5`` and ``--repeats 7`` pooled:
torch 2.13 CPU, 1 thread, ``small`` preset, 2 and 4 stages, thread time; medians over the 8
shapes 1x512 ... 16x64 and packed 1x1024/16 of each run, 32 (shape, stage, run) per role; the
shared 2-core box was loaded, single shapes scatter by +-10%):

=========  ========  ==============  =================
role       W_SHARE   SPLIT_OVERHEAD  RECOMPUTE_F_SHARE
=========  ========  ==============  =================
first      0.54      0.045           1.01
middle     0.44      0.033           1.01
last       0.53      0.051           0.70 (head not recomputed then; 1.01 used now)
=========  ========  ==============  =================

Recomputed leading blocks (``ModelConfig.recompute_blocks``, per stage; AdaPipe, arXiv:2401.03146): stage ``i``'s
first ``k_i`` blocks rerun their forward inside every microbatch's backward and compute their weight gradients
there (nested backward), so on such a stage, for a microbatch not flagged ``recompute`` (those rerun every block
anyway, above):

    B += F_blk,    I += F_blk + W_blk,    W -= W_blk

``F_blk`` / ``W_blk``: the blocks' own F / W, priced by the model itself as the stage's F / W less the same
stage's with those blocks moved off it (onto the stage before; stage 0's whole leading layers onto stage 1: a
layout-free model prices a stage by what it holds), so the per-op fixed cost is not charged twice; where the
stage keeps nothing else (or has no neighbour to take them), less its F / W at no tokens (the rest layouts' models
remembered by ``_rest_model``, keyed by the kind, layout, stage and constants). Applied by
``CostModel.stage_costs`` to the models that price any layout (``layout_free``: analytic, GPU); a fitted model
measured on a layout with the field has it in its samples already.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import replace
from typing import Any

import numpy as np

from dynmb.core.config import ModelConfig
from dynmb.core.model_sizes import UNITS_PER_LAYER, leading_layers

__all__ = ["W_SHARE", "SPLIT_OVERHEAD", "RECOMPUTE_F_SHARE", "stage_role", "derived_split", "apply_recompute",
           "apply_block_recompute", "rest_layout"]

W_SHARE = {"first": 0.54, "middle": 0.44, "last": 0.53}
"""W / B(b, s, attention work 0), per stage role."""
SPLIT_OVERHEAD = {"first": 0.045, "middle": 0.033, "last": 0.051}
"""(I + W) / B - 1: two backward passes instead of one."""
RECOMPUTE_F_SHARE = {"first": 1.01, "middle": 1.01, "last": 1.01}
"""(B with recomputation - B) / F: the share of the forward a recomputing backward reruns. Measured
1.01 on first and middle stages (the whole forward but the embeddings) and 0.70 on the last while
its head was not recomputed; with the head recomputed as well the last reruns its whole forward,
taken as the first and middle stages' measured 1.01 (not re-measured)."""


def stage_role(stage: int, num_stages: int) -> str:
    """``first``, ``middle`` or ``last`` (one stage: ``last``, it holds the LM head)."""
    if stage == num_stages - 1:
        return "last"
    return "first" if stage == 0 else "middle"


def derived_split(model: Any, stage: int, op: str, b: np.ndarray, s: np.ndarray, a: np.ndarray) -> np.ndarray:
    """``I`` or ``W`` seconds of ``model`` derived from its fitted ``B`` (module doc); ``model.predict``'s
    arguments, already broadcast. Raw: ``predict`` applies the runtime scale and overhead."""
    role = stage_role(stage, model.num_stages)
    full = np.maximum(model._predict(stage, "B", b, s, a), 0.0)
    no_attn = np.maximum(model._predict(stage, "B", b, s, np.zeros_like(a)), 0.0)
    w = np.minimum(W_SHARE[role] * no_attn, full)
    out = w if op == "W" else (1.0 + SPLIT_OVERHEAD[role]) * full - w
    return np.maximum(out, 0.0)


def apply_recompute(model: Any, costs: dict[str, np.ndarray], recompute: Any) -> dict[str, np.ndarray]:
    """``costs`` (``{op: [P, m]}``) with the microbatches flagged in ``recompute[m]`` costed as
    recomputed (module doc); ``costs`` must hold ``F``. Unchanged when none is flagged."""
    if recompute is None:
        return costs
    rc = np.asarray(recompute, dtype=bool).reshape(-1)
    if not rc.any():
        return costs
    share = np.array([RECOMPUTE_F_SHARE[stage_role(p, model.num_stages)] for p in range(model.num_stages)])
    extra = share[:, None] * costs["F"][:, rc]
    out = {op: np.array(v, dtype=np.float64, copy=True) for op, v in costs.items()}
    if "B" in out:
        out["B"][:, rc] += extra
    if "I" in out:
        full = costs["B"][:, rc] if "B" in costs else None
        if full is None:
            raise ValueError("recomputed I costs need the full backward B in the costs")
        out["I"][:, rc] = full + extra
    if "W" in out:
        out["W"][:, rc] = 0.0
    return out


def rest_layout(cfg: ModelConfig, num_stages: int, stage: int) -> ModelConfig | None:
    """``cfg`` with ``stage``'s recomputed blocks (``recompute_blocks``) moved off it (module doc) and no blocks
    recomputed: the stage then holds what it keeps of its own. None where it would keep nothing, or where stage 0's
    blocks are not whole layers or there is no stage 1 to take them."""
    k = cfg.stage_recompute_blocks(num_stages)[stage]
    pieces = cfg.stage_pieces(num_stages)[stage]
    layers = set(leading_layers(pieces, k))
    moved = sum(len(pc.chunks) for pc in pieces if pc.layer in layers)
    units = [len(r) for r in cfg.stage_units(num_stages)]
    if not moved or moved >= units[stage] or (stage == 0 and (num_stages < 2 or moved % UNITS_PER_LAYER)):
        return None
    units[stage] -= moved
    units[stage - 1 if stage else 1] += moved
    try:
        return replace(cfg, layer_split=tuple(u / UNITS_PER_LAYER for u in units), recompute_blocks=None)
    except ValueError:                              # a head shard that may hold no layers
        return None


REST_MODELS_REMEMBERED = 256
"""How many rest-layout cost models ``_rest_model`` remembers (one per (kind, layout, stage, constants))."""


@functools.lru_cache(maxsize=REST_MODELS_REMEMBERED)
def _rest_model(kind: Any, cfg: ModelConfig, num_stages: int, stage: int,
                params: tuple[tuple[str, Any], ...]) -> Any:
    """The uncalibrated cost model of kind ``kind`` (its constants ``params``, ``CostModel._params``) for
    ``rest_layout(cfg, num_stages, stage)``; None where there is no rest layout. Remembered by these hashable
    inputs, which fix it: a calibrated copy of a model (``with_scale``, ``with_overhead``) shares the answer, a
    model of another layout or constants gets its own."""
    layout = rest_layout(cfg, num_stages, stage)
    return None if layout is None else kind._from_parts(layout, num_stages, None, {}, dict(params))


def _block_costs(model: Any, stage: int, b: np.ndarray, s: np.ndarray, a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(F_blk, W_blk)`` seconds of ``stage``'s recomputed blocks (module doc), with the model's calibration and
    links (set on a copy of the remembered rest model, ``_rest_model``)."""
    kind: Any = type(model)
    rest = _rest_model(kind, model.model_cfg, model.num_stages, stage, tuple(sorted(model._params().items())))
    if rest is None:                                # the stage less its F / W at no tokens
        rest, b0, a0 = model, np.zeros_like(b), np.zeros_like(a)
    else:
        rest = copy.copy(rest)
        rest.runtime_scale, rest.runtime_overhead_s = model.runtime_scale, model.runtime_overhead_s
        rest.comm, b0, a0 = model.comm, b, a
    out = tuple(np.maximum(model.predict(stage, op, b, s, a) - rest.predict(stage, op, b0, s, a0), 0.0)
                for op in ("F", "W"))
    return out[0], out[1]


def apply_block_recompute(model: Any, costs: dict[str, np.ndarray], shapes: tuple[np.ndarray, np.ndarray, np.ndarray],
                          recompute: Any = None) -> dict[str, np.ndarray]:
    """``costs`` (``{op: [P, m]}`` of microbatches ``shapes`` = (rows, padded_len, attention work)) with the
    recomputed leading blocks of ``model``'s layout priced (module doc) on the microbatches not flagged in
    ``recompute[m]``. Unchanged (the same dict) without such blocks or for a model fitted on one layout."""
    blocks = model.model_cfg.stage_recompute_blocks(model.num_stages)
    if not any(blocks) or not getattr(model, "layout_free", False):
        return costs
    b, s, a = shapes
    plain = ~(np.zeros(b.size, dtype=bool) if recompute is None else np.asarray(recompute, dtype=bool).reshape(-1))
    out = {op: np.array(v, dtype=np.float64, copy=True) for op, v in costs.items()}
    for i, k in enumerate(blocks):
        if not k:
            continue
        f_blk, w_blk = _block_costs(model, i, b[plain], s[plain], a[plain])
        for op, extra in (("B", f_blk), ("I", f_blk + w_blk), ("W", -w_blk)):
            if op in out:
                out[op][i, plain] = np.maximum(out[op][i, plain] + extra, 0.0)
    return out
