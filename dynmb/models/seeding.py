"""Seeded parameter initialisation: every parameter from its own generator, seeded by
``(seed, global name)``.

``param_seed(seed, name)`` hashes ``f"{seed}/{name}"`` with SHA-256 and keeps 63 bits, so a
parameter's initial value depends only on the run's seed and its global name
("blocks.3.attn.qkv.weight"), never on which stage or rank builds it: stages built
separately on different ranks hold exactly the weights of the whole model.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["param_seed", "seeded_normal_"]


def param_seed(seed: int, name: str) -> int:
    """The generator seed of parameter ``name`` under run seed ``seed`` (63 bits)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") & (2**63 - 1)


@torch.no_grad()
def seeded_normal_(p: torch.Tensor, seed: int, name: str, std: float) -> None:
    """Fill ``p`` with N(0, std) drawn in fp32 from the generator of ``(seed, name)``."""
    g = torch.Generator().manual_seed(param_seed(seed, name))
    p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)
