"""The stages of a run with the token embedding on the last rank (``PlanSpec.embedding = "last"``).

The schedule's stage 0 is the embedding alone (``dynmb.schedule.embedlast``): the plan's stage 0 module built on
the meta device without its blocks (``embed``, and gpt2's ``pos``: the same parameter names and seeded values as
the whole model's), marked ``embed_only``; the schedule's stage ``k >= 1`` is the plan's stage ``k - 1``, the first
of them without its embedding (it receives the hidden state as every other stage does). ``schedule_stage`` builds
either, or the plain stage where the embedding is first; its ``stage`` is the schedule's number. Only dynmb's families (a factory of one's own embeds inside
its own first stage).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dynmb.models.families import build_stage

__all__ = ["schedule_stage", "is_embed_only"]


def is_embed_only(module: nn.Module) -> bool:
    """Whether ``module`` is the embedding stage (module doc)."""
    return bool(getattr(module, "embed_only", False))


def schedule_stage(factory: Any, index: int, num_stages: int, embedding: str, *, seed: int = 0,
                   device: torch.device | str | None = None) -> nn.Module:
    """The module of the schedule's stage ``index`` (module doc) of a ``num_stages``-stage plan."""
    if embedding != "last":
        return factory.build_stage(index, num_stages, seed=seed, device=device)
    if not getattr(factory, "dynmb_family", False):
        raise ValueError("embedding='last' runs dynmb's own model families only (a factory of your own embeds in "
                         "its first stage)")
    cfg, weights = factory.config, getattr(factory, "weights", None)
    stage = build_stage(cfg, max(0, index - 1), num_stages, seed, device="meta")
    if index == 0:                                  # the embedding alone
        stage.blocks = nn.ModuleDict()
        stage.layers, stage.units, stage.pieces = [], [], []
        setattr(stage, "embed_only", True)
    elif index == 1:                                # the plan's stage 0 without its embedding
        for name in ("embed", "pos"):
            if hasattr(stage, name):
                delattr(stage, name)
        stage.is_first = False
    stage.stage = index                             # the schedule's number: what the meter and the records key by
    return stage.materialise(device, seed=seed, weights=weights)
