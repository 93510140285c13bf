"""Seeded parameter initialisation: every parameter from its own generator, seeded by
``(seed, global name)``.

``param_seed(seed, name)`` hashes ``f"{seed}/{name}"`` with SHA-256 and keeps 63 bits, so a
parameter's initial value depends only on the run's seed and its global name
("blocks.3.attn.qkv.weight"), never on which stage or rank builds it: stages built
separately on different ranks hold exactly the weights of the whole model.

``fill_normal_`` draws N(0, std) in fp32 in pieces of ``DRAW_ELEMENTS`` elements into a tensor of any
dtype: torch's CPU ``randn`` fills a contiguous tensor 16 values at a time from the generator's stream
(redrawing the last 16 when the size is not a multiple of 16), so pieces whose sizes are multiples of 16
(the last one at least 16) give the values of one whole draw. A parameter is filled in its final dtype
with at most one fp32 piece alive, never an fp32 copy of it.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["param_seed", "seeded_normal_", "fill_normal_", "DRAW_ELEMENTS"]

DRAW_ELEMENTS = 1 << 21
"""Elements of one fp32 draw (8 MiB): a multiple of 16."""


def param_seed(seed: int, name: str) -> int:
    """The generator seed of parameter ``name`` under run seed ``seed`` (63 bits)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") & (2**63 - 1)


@torch.no_grad()
def fill_normal_(p: torch.Tensor, generator: torch.Generator, std: float) -> None:
    """Fill the contiguous ``p`` with N(0, std) drawn in fp32 from ``generator``, piece by piece
    (module docstring): the values of ``torch.randn(p.shape, generator=generator) * std``."""
    flat = p.view(-1)
    n, at = flat.numel(), 0
    while at < n:
        k = min(DRAW_ELEMENTS, n - at)
        if n - at - k < 16:                 # a short tail joins this piece (torch redraws a tail of < 16)
            k = n - at
        flat[at:at + k].copy_(torch.randn(k, generator=generator, dtype=torch.float32).mul_(std))
        at += k


@torch.no_grad()
def seeded_normal_(p: torch.Tensor, seed: int, name: str, std: float) -> None:
    """Fill ``p`` with N(0, std) drawn in fp32 from the generator of ``(seed, name)``."""
    fill_normal_(p, torch.Generator().manual_seed(param_seed(seed, name)), std)
