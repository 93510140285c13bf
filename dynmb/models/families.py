"""dynmb's model families and their stage factory: one registry, keyed by ``ModelConfig.family``.

``FAMILIES`` maps a family name to its stage class (``gpt2``: ``dynmb.models.gpt2.GPTStage``,
``llama``: ``dynmb.models.llama.LlamaStage``); ``build_stage(cfg, stage, P)`` builds the class
``cfg.family`` names. ``FamilyFactory(cfg)`` is the ``StageFactory`` (``dynmb.models.contract``)
of a dynmb family: its ``config`` is ``cfg`` and its ``attention_work`` is ``document``
(attention costs the document-causal sum of s_i^2) unless ``cfg.attention`` is the ``dense``
ablation (``masked``: the full rows * padded_len^2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dynmb.core.config import ModelConfig

from dynmb.models.gpt2 import GPTStage
from dynmb.models.llama import LlamaStage
from dynmb.models.stage import DecoderStage

__all__ = ["FAMILIES", "FamilyFactory", "build_stage", "build_stages", "family_factory"]

FAMILIES: dict[str, type[DecoderStage]] = {"gpt2": GPTStage, "llama": LlamaStage}
"""Stage class of every ``ModelConfig.family``."""


def build_stage(cfg: ModelConfig, stage: int, num_stages: int, seed: int = 0, *, dtype: torch.dtype | None = None,
                device: torch.device | str | None = None, weights: Any = None) -> DecoderStage:
    """One stage of ``cfg``'s family (what a pipeline rank builds), built on the meta device and materialised
    alone in its final dtype: its weights equal the whole model's of ``seed``, or are read from ``weights`` (a
    whole model's state dict or safetensors, only this stage's tensors: ``dynmb.models.weights``).
    ``device="meta"`` leaves it unmaterialised (``DecoderStage.materialise``)."""
    try:
        cls = FAMILIES[cfg.family]
    except KeyError:
        raise ValueError(f"model {cfg.name!r}: unknown family {cfg.family!r}; known: {', '.join(FAMILIES)}") from None
    if weights is None:
        return cls(cfg, stage, num_stages, seed=seed, dtype=dtype, device=device)
    return cls(cfg, stage, num_stages, dtype=dtype, device="meta").materialise(device, weights=weights)


def build_stages(cfg: ModelConfig, num_stages: int, seed: int = 0, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> list[DecoderStage]:
    """All ``num_stages`` stages; composed they are the whole model (same names, same weights)."""
    return [build_stage(cfg, s, num_stages, seed, dtype=dtype, device=device) for s in range(num_stages)]


@dataclass(frozen=True)
class FamilyFactory:
    """The ``StageFactory`` of a dynmb family (module docstring)."""

    config: ModelConfig
    weights: Any = None
    """A whole model's state dict or safetensors file every stage reads its tensors from (None: seeded init)."""
    dynmb_family = True
    """Marks dynmb's own families (``dynmb.core.contract.is_family_factory``)."""

    @property
    def attention_work(self) -> str:
        return "masked" if self.config.attention == "dense" else "document"

    def build_stage(self, stage: int, num_stages: int, *, seed: int = 0, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> DecoderStage:
        return build_stage(self.config, stage, num_stages, seed, dtype=dtype, device=device, weights=self.weights)


def family_factory(cfg: ModelConfig) -> FamilyFactory:
    """The factory of ``cfg``'s family (raises for an unknown family)."""
    if cfg.family not in FAMILIES:
        raise ValueError(f"model {cfg.name!r}: unknown family {cfg.family!r}; known: {', '.join(FAMILIES)}")
    return FamilyFactory(cfg)
