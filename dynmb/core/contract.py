"""The stage contract: what dynmb's runtime, profiler and planner need of a model.

``StageModule`` (an ``nn.Module``) is one pipeline stage: attributes ``stage``, ``num_stages``,
``is_first``, ``is_last``; ``forward(x, inputs, *, reduction="sum", recompute=False)``. ``x`` is
ignored on the first stage (it embeds ``inputs.input_ids``); otherwise it is the hidden state
``(rows, padded_len, d_model)`` the previous stage returned. Non-last stages return the hidden
state; the last returns the SUM of token cross-entropy over real tokens (0-dim, float32 or
wider), and the caller divides by the global batch's real tokens (token-weighted loss).
``inputs`` is a ``dynmb.models.inputs.MicrobatchInputs``: input_ids, labels (``IGNORE_INDEX`` at pads),
position_ids (restarting at 0 in every document, continuing across the slices of a sliced
document), doc_ids (-1 at pads), ``buckets`` (document buckets of packed rows), the dense mask
(``attention="dense"`` only) and the slice ``prefix`` store.

``StageFactory``: ``config`` (a ``ModelConfig``: the sizes the analytic memory and cost models
and the planner use), ``attention_work`` (``document``: attention costs the document-causal
sum of s_i^2; ``masked``: the full rows * padded_len^2 of a masked kernel) and
``build_stage(stage, num_stages, *, seed=0, dtype=None, device=None)`` returning a
``StageModule`` whose parameters have global names and equal values on every rank for any
split (seeded by ``(seed, global name)``, or loaded identically). Layers split with
``config.stage_layers(num_stages)`` (whole layers; a split between half-blocks, which only dynmb's own
families run, is refused there): the first stage holds the embedding, the last the final
norm and LM head.

``resolve_model(spec)`` turns what a user names into a factory: a ``ModelConfig``; a preset
name with overrides (``small``, ``llama-small:d_model=512``) or a JSON file of ``ModelConfig``
fields (``dynmb.core.config.model_config``), both served by dynmb's own families
(``dynmb.models.families.FamilyFactory``); ``package.module:factory`` (imported, then
``factory()`` called); a factory callable; or a ``StageFactory`` itself. Whatever it returns is
checked to keep the contract's attributes; a bad spec raises one ``ValueError`` naming it.
This module imports no torch and nothing of dynmb but its config, so every layer may read the
contract; ``dynmb.models.contract.resolve_model`` adds dynmb's own families on top of it.

``planning_config(factory)`` is the ``ModelConfig`` everything downstream of a factory uses (the
planner, the cost and memory models, the profiler's samples, ``make_inputs``): ``factory.config``,
with ``attention="dense"`` where ``attention_work`` is ``masked``. That is the one place the
factory's attention kind enters: ``Microbatch.attention_work("dense")`` is ``rows * padded_len**2``
(a packed row costs what a padded row of its length costs), the memory model counts the
``(rows, s, s)`` mask a masked kernel holds, and the stages receive that mask in their inputs
(``doc_ids`` too). ``factory_spec(model)`` is the ``package.module:factory`` string of a user's
model (None for dynmb's families), what a run records so every rank rebuilds the factory;
``check_importable(spec)`` checks, in a fresh interpreter started like a torchrun worker, that it
imports.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import re
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from dynmb.core.config import MODEL_PRESETS, ModelConfig

if TYPE_CHECKING:
    import torch

__all__ = ["IGNORE_INDEX", "names_factory", "StageModule", "StageFactory", "ATTENTION_WORK", "planning_config", "factory_spec", "check_importable",
           "is_family_factory", "is_factory_spec", "check_factory", "load_factory", "as_factory"]

IGNORE_INDEX = -100
"""The label of a token that gets no loss (pads, every document's first token): torch's cross-entropy default."""

ATTENTION_WORK = ("document", "masked")
"""``StageFactory.attention_work``: what the cost model's attention feature counts."""


@runtime_checkable
class StageModule(Protocol):
    """One pipeline stage (module docstring); an ``nn.Module``. ``inputs`` is a
    ``dynmb.models.inputs.MicrobatchInputs``."""

    stage: int
    num_stages: int
    is_first: bool
    is_last: bool

    def forward(self, x: "torch.Tensor | None", inputs: Any, *, reduction: str = "sum",
                recompute: bool = False) -> "torch.Tensor": ...

    def parameters(self, recurse: bool = True) -> Any: ...

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any: ...


@runtime_checkable
class StageFactory(Protocol):
    """Builds the stages of one model (module docstring). ``config`` and ``attention_work`` are read
    (properties here: a plain attribute, a frozen dataclass field or a property all qualify)."""

    @property
    def config(self) -> ModelConfig: ...
    @property
    def attention_work(self) -> str: ...

    def build_stage(self, stage: int, num_stages: int, *, seed: int = 0, dtype: Any = None,
                    device: Any = None) -> StageModule: ...


_FACTORY_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def is_factory_spec(spec: str) -> bool:
    """``package.module:factory`` (and not ``preset:field=value``)."""
    return bool(_FACTORY_SPEC.fullmatch(spec)) and spec.partition(":")[0] not in MODEL_PRESETS


def check_factory(obj: Any, spec: str) -> StageFactory:
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


def _import_local(module: str) -> Any:
    """Import ``module``; not found on ``sys.path``, from the working directory as ``python -m`` would
    (which puts it on the path; the ranks of ``dynmb run``, started with ``-m`` there, see it too)."""
    import os
    import sys

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        cwd = os.getcwd()
        top = module.partition(".")[0]
        if e.name != top or cwd in sys.path or "" in sys.path:
            raise
        if importlib.machinery.PathFinder.find_spec(top, [cwd]) is None:
            raise ModuleNotFoundError(f"no module named {top!r} on the path or in the working directory "
                                      f"{cwd}; run from the folder that holds it, or put that folder on "
                                      "PYTHONPATH", name=top) from None
        sys.path.append(cwd)
        return importlib.import_module(module)


def _import_factory(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    try:
        mod = _import_local(module)
    except ImportError as e:
        raise ValueError(f"--model {spec}: cannot import module {module!r} ({e})") from None
    try:
        return getattr(mod, attr)
    except AttributeError:
        raise ValueError(f"--model {spec}: module {module!r} has no attribute {attr!r}") from None


def load_factory(spec: str) -> StageFactory:
    """The factory ``package.module:factory`` names: imported, called when it is a callable returning one."""
    made = _import_factory(spec)
    return check_factory(made() if callable(made) and not hasattr(made, "build_stage") else made, spec)


def as_factory(obj: Any) -> StageFactory:
    """A ``StageFactory`` object as it is, or the one a callable returns (checked)."""
    if hasattr(obj, "build_stage"):
        return check_factory(obj, type(obj).__name__)
    if callable(obj):
        return check_factory(obj(), getattr(obj, "__name__", repr(obj)))
    raise ValueError(f"model must be a preset name, a JSON file, 'package.module:factory', a ModelConfig or a "
                     f"StageFactory, got {type(obj).__name__}")


def _with_attention(cfg: ModelConfig, attention: str) -> ModelConfig:
    from dataclasses import replace

    return replace(cfg, attention=attention)


def planning_config(factory: StageFactory) -> ModelConfig:
    """The ``ModelConfig`` the planner, cost/memory models and inputs use for ``factory`` (module docstring)."""
    cfg = factory.config
    if factory.attention_work == "masked" and cfg.attention != "dense":
        return _with_attention(cfg, "dense")
    return cfg


def is_family_factory(factory: Any) -> bool:
    """Whether ``factory`` is one of dynmb's own families (``dynmb.models.families.FamilyFactory`` says so
    with ``dynmb_family = True``)."""
    return bool(getattr(factory, "dynmb_family", False))


def factory_spec(model: Any) -> str | None:
    """``model`` when it is a ``package.module:factory`` string, else None (presets, JSON files, objects)."""
    return model if isinstance(model, str) and is_factory_spec(model) else None


def check_importable(spec: str) -> None:
    """Raise one ``ValueError`` naming ``spec`` unless a fresh interpreter with this one's environment
    and working directory (what a torchrun worker sees) finds its module (``importlib.util.find_spec``,
    which imports the parent packages only), and this one has the attribute."""
    import os
    import subprocess
    import sys

    module, _, _ = spec.partition(":")
    code = f"import importlib.util, sys\nsys.exit(0 if importlib.util.find_spec({module!r}) else 3)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ),
                          cwd=os.getcwd())
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no such module"])[-1]
        raise ValueError(f"--model {spec}: module {module!r} is not importable by the ranks ({last}); "
                         f"put its folder on PYTHONPATH or run from the folder that holds it")
    _import_factory(spec)


def names_factory(spec: str) -> bool:
    """Whether ``spec`` is ``package.module:factory`` (a preset with overrides has ``=``; the check
    resolves the module only for a spec that can be one)."""
    if ":" not in spec or "=" in spec or spec.endswith(".json"):
        return False
    return factory_spec(spec) is not None
