"""The ONE loader: the cost and memory models of a model, stage layout and device, as one bundle.

``load_models(model_cfg, num_stages, cost=, memory=, device=, virtual=)`` resolves, in this order:

- cost model: ``"analytic"`` (``STAND_IN``: the stand-in, asked for); an object or a JSON path (checked against the model and stages; a ``layout_free`` one,
  the analytic and GPU kinds, made for another layer split of the same model, or for the GPUs of a
  ``virtual`` > 1 layout, is rebuilt for this one); else the fit shipped for (model preset, stages,
  device) (``shipped_cost_model_path``: ``data/costmodels/<model>-p<P>-<device>.json``) when it was
  made for this config; else the analytic stand-in, said once with the commands that fit the right
  one (``dynmb.costmodel.standin.warn_stand_ins``);
- memory model: an object or a JSON path (checked), else the analytic model (a stand-in for a model
  of the user's own: said once when ``own_model``).

It returns ``PredictionModels`` (frozen): both models with where each came from. ``Models(cost, memory)`` is
the bundle itself, which every planning, packing and timing function takes as one argument (``models=``);
``PredictionModels`` is one, with the sources. Every planner of
dynmb (``dynmb plan`` / ``schedule`` / ``simulate`` / ``run`` / ``compare``, ``Planner``, the sampler,
the plots) resolves through it, so one batch and one set of settings give one plan.
``models_record(models)`` is what a plan records about the models it was made with: each
model's digest (sha256 of its canonical JSON form, calibration and online refit included), whether
the cost model was calibrated, and its refit version (``dynmb.costmodel.refit``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Generic, TypeVar

from dynmb.core.config import ModelConfig
from dynmb.core.planspec import PlanSpec
from dynmb.data.lengths import shipped_dir
from dynmb.costmodel.analytic import AnalyticCostModel
from dynmb.costmodel.base import CostModel, CostModelLike
from dynmb.costmodel.standin import warn_stand_ins
from dynmb.memory.model import MemoryModel, MemoryModelLike, get_memory_model

__all__ = ["Models", "PredictionModels", "load_models", "spec_models", "shipped_cost_model_path", "model_digest", "models_record",
           "refit_version", "is_calibrated", "check_plan_models", "STAND_IN"]

log = logging.getLogger(__name__)

STAND_IN = "analytic"
"""The cost-model name (``--cost-model analytic``, ``cost="analytic"``) that asks for the analytic stand-in
even where a fit is shipped (a plan recorded with it is run and simulated with it)."""

SOURCES = ("object", "file", "shipped", "analytic", "stand-in")
"""Where a model of the bundle came from."""


def shipped_cost_model_path(model: str, stages: int, device: str = "cpu") -> str | None:
    """The shipped fitted cost model for (model preset, stages) on ``device`` ("cpu"/"cuda"), if any."""
    p = shipped_dir("costmodels").joinpath(f"{model}-p{int(stages)}-{device}.json")
    return str(p) if p.is_file() else None


def model_digest(model: Any) -> str:
    """sha256 of ``model.to_dict()`` as canonical JSON (arrays as lists): what a plan names a model by."""
    text = json.dumps(model.to_dict(), sort_keys=True,
                      default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
    return hashlib.sha256(text.encode()).hexdigest()


def refit_version(cost_model: Any) -> int:
    """The online refit's version of ``cost_model`` (``dynmb.costmodel.refit``; 0: as fitted offline)."""
    return int((getattr(cost_model, "meta", None) or {}).get("refit", {}).get("version", 0))


def is_calibrated(cost_model: Any) -> bool:
    """Whether ``cost_model`` carries what a running job measured (a runtime scale, overhead, receive
    latency, or an online refit)."""
    comm = getattr(cost_model, "comm", None)
    return bool(getattr(cost_model, "runtime_scale", None) or any(getattr(cost_model, "runtime_overhead_s", {}).values())
                or getattr(comm, "recv_latency_s", 0.0) or refit_version(cost_model))


Memory = TypeVar("Memory", bound="MemoryModelLike | None", covariant=True)
"""The bundle's memory model type: ``MemoryModelLike`` where one is needed (packing, planning), or None too
where a function works without one (schedules without memory inputs, simulations without peaks)."""


@dataclass(frozen=True)
class Models(Generic[Memory]):
    """The cost and memory models a planning step prices with, as one argument (``models=``): seconds of a
    microbatch on a stage (``cost``) and its bytes (``memory``). The packers and the planner take
    ``Models[MemoryModelLike]``; the schedule builders, the reorder search and the zero-bubble inputs take
    ``Models[MemoryModelLike | None]`` (``memory`` None: times only). ``PredictionModels`` (what
    ``load_models`` returns) is one."""

    cost: CostModelLike
    memory: Memory

    @staticmethod
    def analytic(model_cfg: ModelConfig, num_stages: int) -> "Models[MemoryModel]":
        """The analytic stand-ins of ``model_cfg`` over ``num_stages`` stages (what ``plan_step`` uses without
        models), said nowhere (``load_models`` warns)."""
        return Models(AnalyticCostModel(model_cfg, num_stages), MemoryModel.analytic(model_cfg, num_stages))


def models_record(models: Models[Any]) -> dict[str, Any]:
    """What a plan records about the models it was made with (``Plan.meta["models"]``)."""
    cost_model, memory_model = models.cost, models.memory
    return {"cost": {"digest": model_digest(cost_model), "kind": getattr(cost_model, "kind", type(cost_model).__name__),
                     "calibrated": is_calibrated(cost_model), "version": refit_version(cost_model)},
            "memory": {"digest": model_digest(memory_model), "source": str(getattr(memory_model, "source", ""))}}


def check_plan_models(recorded: Any, models: Models[Any], where: str) -> None:
    """ValueError (one line naming ``where``, the plan) when the models differ from the digests a plan
    recorded (``recorded``: its ``meta["models"]``); nothing for a plan without a record, nor for the cost
    model of a plan made with a calibrated one (a run's: its predictions are made again)."""
    if not isinstance(recorded, dict):
        return
    now = models_record(models)
    for kind in ("cost", "memory"):
        theirs = recorded.get(kind) or {}
        if kind == "cost" and theirs.get("calibrated"):
            continue
        if theirs.get("digest") not in (None, now[kind]["digest"]):
            raise ValueError(f"the plan {where} was planned with a {kind} model of digest "
                             f"{str(theirs.get('digest'))[:12]}, the one given has {now[kind]['digest'][:12]}; "
                             f"plan again or pass the {kind} model it was planned with")


@dataclass(frozen=True)
class PredictionModels(Models[MemoryModel]):
    """The cost and memory models one planner uses (a ``Models``), and where each came from (``SOURCES``;
    ``*_path``: the file, or None)."""

    cost: CostModel
    memory: MemoryModel
    cost_source: str
    memory_source: str
    cost_path: str | None = None
    memory_path: str | None = None

    @property
    def stand_ins(self) -> tuple[str, ...]:
        """Which models are stand-ins (``"cost"``, ``"memory"``)."""
        return tuple(k for k, s in (("cost", self.cost_source), ("memory", self.memory_source)) if s == "stand-in")

    def record(self) -> dict[str, Any]:
        """``models_record`` plus each model's source and file."""
        rec = models_record(self)
        rec["cost"].update(source=self.cost_source, path=self.cost_path)
        rec["memory"].update(source=self.memory_source, path=self.memory_path)
        return rec


def _layout_free(cost: Any) -> CostModel | None:
    if isinstance(cost, (str, Path)):
        cost = CostModel.load(cost)
    return cost if getattr(cost, "layout_free", False) else None


def rebuilt_for_layout(cost: Any, cfg: ModelConfig, num_stages: int, chunks_from: int | None = None) -> Any:
    """``cost`` (an object or a JSON path) rebuilt for ``cfg``'s layer split when it prices any layout
    (``CostModel.layout_free``) and was made for another split of the same model, or (``chunks_from``) for
    that many stages (the GPUs of a virtual layout); else as given."""
    cm = _layout_free(cost) if cost is not None else None
    if cm is not None and chunks_from is not None and cm.num_stages == chunks_from != num_stages:
        cm.check(cfg.with_layout_of(cm.model_cfg), chunks_from)
        return cm.for_layout(cm.model_cfg.with_layout_of(cfg), num_stages)
    if cm is None or cm.model_cfg.with_layout_of(cfg) == cm.model_cfg or cm.num_stages != num_stages:
        return cost
    cm.check(cfg.with_layout_of(cm.model_cfg), num_stages)      # the same model otherwise
    return cm.for_layout(cm.model_cfg.with_layout_of(cfg), num_stages)


def _cost(cost: Any, cfg: ModelConfig, num_stages: int, device: str, chunks_from: int | None
          ) -> tuple[CostModel, str, str | None]:
    if isinstance(cost, str) and cost == STAND_IN:
        return AnalyticCostModel(cfg, num_stages), "analytic", None
    cost = rebuilt_for_layout(cost, cfg, num_stages, chunks_from)
    if isinstance(cost, (str, Path)):
        cm = CostModel.load(cost)
        cm.check(cfg, num_stages)
        return cm, "file", str(Path(cost).resolve())
    if cost is not None:
        cost.check(cfg, num_stages)
        return cost, "object", None
    path = shipped_cost_model_path(cfg.name, num_stages, device)
    if path is not None:
        cm = CostModel.load(path)
        try:
            cm.check(cfg, num_stages)
            return cm, "shipped", path
        except ValueError as e:
            log.info("the shipped cost model %s does not fit this config (%s)", path, e)
    return AnalyticCostModel(cfg, num_stages), "stand-in", None


def load_models(model_cfg: ModelConfig, num_stages: int, *, cost: Any = None, memory: Any = None,
                device: str = "cpu", virtual: int = 1, own_model: bool = False,
                who: str = "dynmb") -> PredictionModels:
    """The cost and memory models of ``model_cfg`` over ``num_stages`` stages (module doc). ``virtual``:
    chunks per GPU (a layout-free model made for the GPUs is rebuilt for the chunks); ``own_model``: a
    model of the user's own (the analytic memory model is a stand-in then); ``who`` names the warner."""
    chunks_from = int(num_stages) // int(virtual) if int(virtual) > 1 else None
    cm, cost_source, cost_path = _cost(cost, model_cfg, int(num_stages), device, chunks_from)
    if memory is None or isinstance(memory, (str, Path)):
        mm = get_memory_model(memory, model_cfg, int(num_stages))
        memory_source = "file" if memory is not None else ("stand-in" if own_model else "analytic")
        memory_path = str(Path(memory).resolve()) if memory is not None else None
    else:
        memory.check(model_cfg, int(num_stages))
        mm, memory_source, memory_path = memory, "object", None
    models = PredictionModels(cm, mm, cost_source, memory_source, cost_path, memory_path)
    if models.stand_ins:
        warn_stand_ins(model_cfg, int(num_stages), models.stand_ins, who=who, stacklevel=4)  # at who's caller
    return models


ModelsT = TypeVar("ModelsT", bound=Models[Any])


def spec_models(models: ModelsT, spec: PlanSpec) -> ModelsT:
    """``models`` as planned under ``spec``'s settings (``plan_step`` applies it; so do ``Planner`` and a run, whose
    plans record the digests of these): the memory model's ``MemoryModel.as_planned(spec.embedding,
    spec.state_shards)``, the one place the token embedding on the last rank (its states move there,
    ``MemoryModel.embedding_last``; a tied embedding is refused in one line there: its table is the head's, on the
    last stage already) and the states sharded over ``spec.state_shards`` data-parallel ranks
    (``MemoryModel.sharded``) are applied. A memory model without that view plans only the defaults. Idempotent: ``models``
    themselves where their memory model already is the view."""
    memory = models.memory
    as_planned = getattr(memory, "as_planned", None)
    if callable(as_planned):
        memory = as_planned(spec.embedding, spec.state_shards)
    elif spec.embedding != "first" or spec.state_shards != 1:
        raise ValueError(f"embedding {spec.embedding!r}, state_shards {spec.state_shards}: the memory model "
                         f"{type(memory).__name__} has no as_planned() view; plan with embedding 'first' and "
                         "state_shards 1 or pass a dynmb MemoryModel")
    return models if memory is models.memory else replace(models, memory=memory)

