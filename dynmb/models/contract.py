"""The stage contract: what dynmb's runtime, profiler and planner need of a model.

``StageModule`` (an ``nn.Module``) is one pipeline stage: attributes ``stage``, ``num_stages``,
``is_first``, ``is_last``; ``forward(x, inputs, *, reduction="sum", recompute=False)``. ``x`` is
ignored on the first stage (it embeds ``inputs.input_ids``); otherwise it is the hidden state
``(rows, padded_len, d_model)`` the previous stage returned. Non-last stages return the hidden
state; the last returns the SUM of token cross-entropy over real tokens (0-dim, float32 or
wider), and the caller divides by the global batch's real tokens (token-weighted loss).
``inputs`` is a ``dynmb.inputs.MicrobatchInputs``: input_ids, labels (``IGNORE_INDEX`` at pads),
position_ids (restarting at 0 in every document, continuing across the slices of a sliced
document), doc_ids (-1 at pads), ``buckets`` (document buckets of packed rows), the dense mask
(``attention="dense"`` only) and the slice ``prefix`` store.

``StageFactory``: ``config`` (a ``ModelConfig``: the sizes the analytic memory and cost models
and the planner use), ``attention_work`` (``document``: attention costs the document-causal
sum of s_i^2; ``masked``: the full rows * padded_len^2 of a masked kernel) and
``build_stage(stage, num_stages, *, seed=0, dtype=None, device=None)`` returning a
``StageModule`` whose parameters have global names and equal values on every rank for any
split (seeded by ``(seed, global name)``, or loaded identically). Layers split with
``config.stage_layers(num_stages)``: the first stage holds the embedding, the last the final
norm and LM head.

``resolve_model(spec)`` turns what a user names into a factory: a ``ModelConfig``; a preset
name with overrides (``small``, ``llama-small:d_model=512``) or a JSON file of ``ModelConfig``
fields (``dynmb.config.model_config``), both served by dynmb's own families
(``dynmb.models.families.FamilyFactory``); ``package.module:factory`` (imported, then
``factory()`` called); a factory callable; or a ``StageFactory`` itself. Whatever it returns is
checked to keep the contract's attributes; a bad spec raises one ``ValueError`` naming it.
This module imports no torch (the families load on first use).
"""

from __future__ import annotations

import importlib
import re
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

from dynmb.config import MODEL_PRESETS, ModelConfig, model_config

if TYPE_CHECKING:
    import torch

    from dynmb.inputs import MicrobatchInputs

__all__ = ["StageModule", "StageFactory", "resolve_model", "ATTENTION_WORK"]

ATTENTION_WORK = ("document", "masked")
"""``StageFactory.attention_work``: what the cost model's attention feature counts."""


@runtime_checkable
class StageModule(Protocol):
    """One pipeline stage (module docstring); an ``nn.Module``."""

    stage: int
    num_stages: int
    is_first: bool
    is_last: bool

    def forward(self, x: "torch.Tensor | None", inputs: "MicrobatchInputs", *, reduction: str = "sum",
                recompute: bool = False) -> "torch.Tensor": ...

    def parameters(self, recurse: bool = True) -> Any: ...

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any: ...


@runtime_checkable
class StageFactory(Protocol):
    """Builds the stages of one model (module docstring)."""

    config: ModelConfig
    attention_work: str

    def build_stage(self, stage: int, num_stages: int, *, seed: int = 0, dtype: Any = None,
                    device: Any = None) -> StageModule: ...


_FACTORY_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def _is_factory_spec(spec: str) -> bool:
    """``package.module:factory`` (and not ``preset:field=value``)."""
    return bool(_FACTORY_SPEC.fullmatch(spec)) and spec.partition(":")[0] not in MODEL_PRESETS


def _check(obj: Any, spec: str) -> StageFactory:
    missing = [a for a in ("config", "attention_work", "build_stage") if not hasattr(obj, a)]
    if missing:
        raise ValueError(f"--model {spec}: {type(obj).__name__} is not a StageFactory (missing {', '.join(missing)}; "
                         f"see docs/design.md 'The stage contract')")
    if not isinstance(obj.config, ModelConfig):
        raise ValueError(f"--model {spec}: factory.config must be a dynmb ModelConfig, got {type(obj.config).__name__}")
    if obj.attention_work not in ATTENTION_WORK:
        raise ValueError(f"--model {spec}: factory.attention_work must be one of {ATTENTION_WORK}, "
                         f"got {obj.attention_work!r}")
    return obj


def _import_factory(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"--model {spec}: cannot import module {module!r} ({e})") from None
    try:
        return getattr(mod, attr)
    except AttributeError:
        raise ValueError(f"--model {spec}: module {module!r} has no attribute {attr!r}") from None


def resolve_model(spec: "str | ModelConfig | StageFactory | Callable[[], StageFactory]", *,
                  attention: str | None = None) -> StageFactory:
    """The ``StageFactory`` ``spec`` names (module docstring). ``attention`` overrides a dynmb
    family's ``ModelConfig.attention`` (ignored for other factories)."""
    from .families import family_factory

    if isinstance(spec, ModelConfig):
        return family_factory(spec if attention is None else _with_attention(spec, attention))
    if isinstance(spec, str):
        if _is_factory_spec(spec):
            made = _import_factory(spec)
            return _check(made() if callable(made) and not hasattr(made, "build_stage") else made, spec)
        return family_factory(model_config(spec, attention=attention))
    if hasattr(spec, "build_stage"):
        return _check(spec, type(spec).__name__)
    if callable(spec):
        return _check(spec(), getattr(spec, "__name__", repr(spec)))
    raise ValueError(f"model must be a preset name, a JSON file, 'package.module:factory', a ModelConfig or a "
                     f"StageFactory, got {type(spec).__name__}")


def _with_attention(cfg: ModelConfig, attention: str) -> ModelConfig:
    from dataclasses import replace

    return replace(cfg, attention=attention)
