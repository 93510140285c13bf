"""``resolve_model``: what a user names as a model, as a ``StageFactory`` (the contract itself,
its Protocols and helpers, is ``dynmb.core.contract``, re-exported here).

A ``ModelConfig``, a preset name with overrides (``small``, ``llama-small:d_model=512``) or a JSON
file of ``ModelConfig`` fields are served by dynmb's own families
(``dynmb.models.families.FamilyFactory``); ``package.module:factory`` is imported and called; a
factory callable or a ``StageFactory`` is checked as it is. A bad spec raises one ``ValueError``
naming it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from dynmb.core.config import ModelConfig, model_config
from dynmb.core.contract import (ATTENTION_WORK, StageFactory, StageModule, as_factory, check_factory, check_importable,
                            factory_spec, is_factory_spec, is_family_factory, load_factory, planning_config)

__all__ = ["StageModule", "StageFactory", "resolve_model", "ATTENTION_WORK", "planning_config", "factory_spec",
           "check_importable", "is_family_factory", "is_factory_spec", "check_factory", "load_factory", "as_factory"]


def resolve_model(spec: "str | ModelConfig | StageFactory | Callable[[], StageFactory] | Any", *,
                  attention: str | None = None) -> StageFactory:
    """The ``StageFactory`` ``spec`` names (module docstring). ``attention`` overrides a dynmb
    family's ``ModelConfig.attention`` (ignored for other factories)."""
    from dynmb.models.families import family_factory

    if isinstance(spec, ModelConfig):
        return family_factory(spec if attention is None else replace(spec, attention=attention))
    if isinstance(spec, str):
        if is_factory_spec(spec):
            return load_factory(spec)
        return family_factory(model_config(spec, attention=attention))
    return as_factory(spec)
