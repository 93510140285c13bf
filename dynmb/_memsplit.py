"""Memory of a split backward and of full recomputation, per stage, as ``[P, 3]`` coefficients.

Same form as ``dynmb.memory``: bytes of a (b rows x s) microbatch = ``c0 + c1*b*s + c2*b*s^2``.
Counted from what ``dynmb.model`` and ``dynmb.runtime.splitbackward`` keep (``e`` the model's
dtype bytes, ``d`` d_model, ``f`` d_ff, ``V`` the vocabulary, ``L`` the stage's blocks, ``g = 1 +
BUCKET_PADDING`` under ``attention="auto"`` (bucketed documents, an upper bound) else 1):

- ``w_coef``: held from ``I`` to ``W`` (each Linear call's input and output gradient). Per block
  and token ``e * (2d + 2f + 6d g)``: qkv (input d, gradient 3d), attention projection (d, d),
  MLP fc (d, f), MLP projection (f, d); the last stage adds the LM head's (d, V). Measured with the
  CPU meter on the small preset (2 and 4 stages, padded and packed rows): exact for one document per
  row (16,384 B per block and token), within the bucket padding for packed rows.
- ``recompute_saved_coef``: what a recomputed microbatch does not hold from F to B: each
  block's saved activations except its input, which the recomputation keeps (``e d`` per token).
- ``recompute_transient_coef``: one block's activations, live while that block is recomputed
  and back-propagated (added to the op's transient bytes; an upper bound, since on the last
  stage the logits gradient is gone by then).

Measured peak of one microbatch through a stage with recomputation (small preset, 1 x 512,
stage 0 of 2): 1.58 MB held after the forward (17.3 MB without), 9.46 MB during its backward.
"""

from __future__ import annotations

import numpy as np

from .config import ModelConfig

__all__ = ["w_coef", "recompute_saved_coef", "recompute_transient_coef", "block_act_coef"]


def block_act_coef(cfg: ModelConfig) -> np.ndarray:
    """``(a1, a2)`` of one block's saved activations (``dynmb.memory``'s count)."""
    from .memory import _block_act_coef      # memory imports this module: import at call time
    return _block_act_coef(cfg)


def w_coef(cfg: ModelConfig, num_stages: int) -> np.ndarray:
    """``[P, 3]``: bytes held from a microbatch's ``I`` to its ``W`` on each stage."""
    from .memory import BUCKET_PADDING
    e, d, f, v = cfg.dtype_bytes, cfg.d_model, cfg.d_ff, cfg.vocab_size
    g = 1.0 if cfg.attention == "dense" else 1.0 + BUCKET_PADDING
    out = np.zeros((num_stages, 3))
    for i, layers in enumerate(cfg.stage_layers(num_stages)):
        out[i, 1] = len(layers) * e * (2 * d + 2 * f + 6 * d * g)
        if i == num_stages - 1:
            out[i, 1] += e * (d + v)
    return out


def recompute_saved_coef(cfg: ModelConfig, num_stages: int) -> np.ndarray:
    """``[P, 3]``: activation bytes a recomputed microbatch does not hold (all blocks' but their inputs)."""
    out = np.zeros((num_stages, 3))
    blk = block_act_coef(cfg)
    for i, layers in enumerate(cfg.stage_layers(num_stages)):
        out[i, 1] = len(layers) * (blk[0] - cfg.dtype_bytes * cfg.d_model)
        out[i, 2] = len(layers) * blk[1]
    return out


def recompute_transient_coef(cfg: ModelConfig, num_stages: int) -> np.ndarray:
    """``[P, 3]``: one block's activation bytes, live during a recomputed backward (0 without blocks)."""
    out = np.zeros((num_stages, 3))
    blk = block_act_coef(cfg)
    for i, layers in enumerate(cfg.stage_layers(num_stages)):
        if len(layers):
            out[i, 1:] = blk
    return out
