"""The planning entry points of the public API: ``Planner`` and ``PlannedStep``.

A ``Planner`` holds what stays fixed over a training run (model, pipeline depth, memory
limit, cost and memory models, schedule kind, shape rounding); ``Planner.plan(lengths)``
runs one planning step (``dynmb.planning.planner.plan_step``: pack -> reorder -> build
and validate the schedule -> simulate) and returns a ``PlannedStep``. Cost and memory
models are resolved by the one loader (``dynmb.costmodel.loader.load_models``: the fitted ones shipped
for the model, else the stand-ins, said once); pass your own (``dynmb fit`` / ``dynmb memory``) as objects or
file paths. Every model is checked against the architecture and stage count it was made for.

Example::

    import dynmb
    planner = dynmb.Planner(model="small", num_stages=2, memory_limit="1GiB")
    step = planner.plan(lengths, method="dynamic")            # reorder="auto"
    step.plan.num_microbatches, step.sim.makespan_s, step.schedule
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dynmb.costmodel.base import CostModelLike
from dynmb.memory.model import MemoryModelLike
from dynmb.core.config import ModelConfig, model_config, parse_bytes
from dynmb.costmodel.loader import PredictionModels, load_models, spec_models, rebuilt_for_layout, shipped_cost_model_path
from dynmb.core.contract import as_factory, is_factory_spec, is_family_factory, load_factory, planning_config
from dynmb.core.planspec import EMBEDDING_PLACES, PlanSpec
from dynmb.timing.simulate import SimResult
from dynmb.core.types import Plan, Schedule
from dynmb.planning.planner import plan_step
from dynmb.planning.memory_split import Relief, ReliefInputs, relieved_layout
from dynmb.planning.split_search import SplitSearch
from dynmb.planning.stage_split import resolve_stage_split
from dynmb.planning.virtual_search import AUTO_VIRTUAL, VirtualChoice, choose_virtual
from dynmb.planning.embedding_choice import (AUTO_EMBEDDING, EmbeddingChoice, Placement, Workload, choose_embedding,
                                             choose_on_samples, embedding_setting, fallback, last_refusal)

__all__ = ["Planner", "PlannedStep", "PlannerInputs"]


@dataclass(frozen=True)
class PlannedStep:
    """One planned global batch: the plan (microbatches in execution order), the validated
    schedule of (replica 0 of) the pipeline, and its simulation."""

    plan: Plan
    schedule: Schedule
    sim: SimResult


def _model(model: Any) -> tuple[ModelConfig, bool]:
    """``(the ModelConfig planning uses, whether it is a model of the user's own)`` of ``model``: a
    ``ModelConfig``, a ``--model`` spec (a preset, a JSON file, ``package.module:factory``), a
    ``StageFactory`` or a callable returning one (``planning_config``: sizes, and the masked
    attention kind where the factory has it)."""
    if isinstance(model, ModelConfig):
        return model, False
    if isinstance(model, Path) or isinstance(model, str) and not is_factory_spec(model):
        return model_config(str(model)), False
    factory = load_factory(model) if isinstance(model, str) else as_factory(model)
    return planning_config(factory), not is_family_factory(factory)


@dataclass(frozen=True, kw_only=True)
class PlannerInputs:
    """What a ``Planner`` resolves besides its ``PlanSpec``: the cost and memory models, the device their
    shipped fits are for, the stage split, the workload and global batch its layout searches sample."""

    cost_model: CostModelLike | str | Path | None = None
    memory_model: MemoryModelLike | str | Path | None = None
    device: str = "cpu"
    stage_split: str = "even"
    workload: Any = None
    global_batch: int | None = None
    auto_virtual: bool = False
    """``virtual="auto"``: the spec's ``num_stages`` counts the GPUs; V is chosen once."""
    embedding_auto: bool = False
    """``embedding="auto"``: the spec's ``embedding`` is weighed against the other place at the first ``plan``."""


@dataclass(frozen=True)
class _Layout:
    """One placement's resolved planner state: its settings, layout, the choices made for it and its models."""

    spec: PlanSpec
    model_cfg: ModelConfig
    virtual_choice: VirtualChoice | None
    split_relief: Relief | None
    models: PredictionModels


def _virtual_layout(model_cfg: ModelConfig, own: bool, spec: PlanSpec, inputs: PlannerInputs, pricing: Any,
                    search: SplitSearch | None) -> tuple[PlanSpec, ModelConfig, VirtualChoice, str, Any]:
    """``virtual="auto"``: V chosen (``choose_virtual``); the spec over ``P V`` chunks, the model (its layout where
    the choice resolved it), the choice, the stage split still to resolve and the cost model for the chunks."""
    gpus, cost_model, stage_split = spec.num_stages, inputs.cost_model, inputs.stage_split
    choice = choose_virtual(model_cfg, gpus, str(stage_split), search=search, workload=inputs.workload,
                            cost_model=pricing, half_blocks=not own)
    spec = spec.with_(num_stages=gpus * choice.virtual, virtual=choice.virtual)
    if choice.layout is not None:                # resolved by the choice: not again
        stage_split, model_cfg = "even", choice.layout
        cost_model = rebuilt_for_layout(cost_model, model_cfg, spec.num_stages, gpus)
    return spec, model_cfg, choice, stage_split, cost_model


def _layout(model_cfg: ModelConfig, own: bool, spec: PlanSpec, inputs: PlannerInputs) -> _Layout:
    """The layout ``spec`` (its embedding's place included) plans on: ``virtual="auto"``, the stage split and its
    memory relief (weighed for the spec's embedding place), and the models (the one loader, ``spec_models``)."""
    cost_model, stage_split, num_stages = inputs.cost_model, inputs.stage_split, spec.num_stages
    pricing = cost_model if cost_model is not None or (stage_split == "even" and not inputs.auto_virtual) else \
        shipped_cost_model_path(model_cfg.name, num_stages, inputs.device)    # the model it will plan with
    search = None if inputs.global_batch is None else SplitSearch(
        spec=spec, global_batch=int(inputs.global_batch), memory_model=inputs.memory_model)
    virtual_choice, relief = None, None
    if inputs.auto_virtual:                      # num_stages: the GPUs; the chosen V's P V chunks from here on
        spec, model_cfg, virtual_choice, stage_split, cost_model = _virtual_layout(model_cfg, own, spec, inputs,
                                                                                   pricing, search)
        num_stages = spec.num_stages
    if stage_split != "even":                    # "even" keeps a split the model config already carries
        model_cfg = resolve_stage_split(model_cfg, num_stages, stage_split, half_blocks=not own,
                                        workload=inputs.workload, cost_model=pricing, search=search,
                                        virtual=spec.virtual)
        if stage_split == "auto":                # memory in the split (dynmb.planning.memory_split)
            model_cfg, relief = relieved_layout(model_cfg, num_stages, ReliefInputs(
                memory_limit_bytes=spec.memory_limit_bytes, schedule_kind=spec.schedule_kind, embedding=spec.embedding,
                workload=inputs.workload, cost_model=pricing, half_blocks=not own, state_shards=spec.state_shards),
                virtual=spec.virtual, memory_model=inputs.memory_model)
        cost_model = rebuilt_for_layout(cost_model, model_cfg, num_stages)
    # the one loader: file, shipped fit or stand-in (said once; the analytic memory model is one only for a model of
    # the user's own); then the embedding's place and the states' shards (dynmb.schedule.embedlast, MemoryModel.sharded)
    models = load_models(model_cfg, num_stages, cost=cost_model, memory=inputs.memory_model, device=inputs.device,
                         own_model=own, who="Planner")
    return _Layout(spec, model_cfg, virtual_choice, relief, spec_models(models, spec))


class Planner:
    """Plans global batches for one pipeline configuration; see the module docstring.

    Built from one ``PlanSpec``: ``Planner.from_spec(model, spec, ...)``, or from the keywords below, which
    build that spec in one place (``Planner(...).spec``).

    ``model``: a ``ModelConfig``, a ``--model`` spec (``"small"``, ``"small:d_model=512"``,
    ``"model.json"``, ``"package.module:factory"``) or a ``StageFactory`` (or a callable returning
    one): its ``config`` sizes the models and its ``attention_work`` sets the cost model's attention
    feature (``dynmb.models.contract.planning_config``); a model of your own planned with a stand-in
    cost or memory model is warned about once (``warn_stand_ins``); ``memory_limit``: bytes or a size string (``"1GiB"``);
    ``cost_model`` / ``memory_model``: objects or JSON paths (None: the shipped/analytic ones);
    ``schedule``: gpipe, 1f1b, interleaved, memory-aware, zb-h1, zb (and any kind the builders know);
    ``round_to``: every padded_len a multiple of it; ``dp``: data-parallel replicas;
    ``virtual``: model chunks per rank (interleaved), or ``"auto"``: ``num_stages`` then counts the GPUs and V (1, 2
    or 4, where the layers allow) is chosen once by the simulated step of the workload's sample batches
    (``dynmb.planning.virtual_search``; needs ``workload``, ``global_batch`` and a layout-free cost model, else V 1,
    said once; ``virtual_choice`` records how; ``num_stages`` and ``virtual`` read the chosen layout's); ``recompute``: never, always or auto
    (per-microbatch activation recomputation, ``dynmb.packing.recompute``); ``device``: which shipped cost model
    ("cpu"/"cuda") to default to; ``stage_split``: the layers per stage, ``"even"``, ``"auto"`` (balanced work,
    embedding and head included: ``dynmb.planning.stage_split``; in half-blocks or chunks of them for dynmb's
    families) or a list such as ``"9,8,8,7"``, ``"2.5,2,2,1.5"`` or ``"2.75,1.25"`` (the model's ``layer_split``;
    parts of blocks for dynmb's families only; a fitted cost or memory model must have been measured on the same split); ``workload``:
    what ``"auto"`` balances, the lengths the planner will see (an array, a shipped trace name or a
    length-trace CSV: every sequence's forward + backward at its own length, priced by ``cost_model`` where
    it prices any layout (the analytic and GPU models, rebuilt for the split), else in FLOPs:
    ``dynmb.planning.split_work``); None: forward FLOPs of one 1,024-token row, said once. A fitted cost
    model (given, or the shipped one) prices only the split it was measured on: ``"auto"`` is that split.
    ``global_batch``: sequences per global batch; given with ``workload`` and a layout-free cost model,
    ``"auto"`` takes among the near-optimal splits the one whose simulated ``dynamic`` step per real token
    on sample batches of the workload is smallest under these settings (``dynmb.planning.split_search``; once, CPU
    seconds logged); else the min-max split. ``slice_fitting``: ``"never"`` (default) or ``"auto"``: sequences
    longer than the longest row / 2 or / 4 may be planned as chains of slices too, where the simulator predicts a
    shorter step within the limit (``dynmb.planning.slice_fitting``; with ``oversize="truncate"`` after the cut).
    ``embedding``: ``"first"`` (the token embedding with stage 0, plans as ever), ``"last"``: on the last pipeline rank
    (``PlanSpec.embedding``, ``dynmb.schedule.embedlast``): stage 0's memory holds no table, every schedule gets the
    embedding stage, the simulator prices its ops and messages; or ``"auto"``: each place gets its own resolved layout
    (the stage split's memory relief weighed per place) and the faster place is kept for the run
    (``dynmb.planning.embedding_choice``): with ``workload`` and ``global_batch``, chosen here, at construction, by
    the mean simulated step per real token of the workload's sample batches (those the layout searches plan), so
    every first batch sees the same place and the first plan costs a fixed place's; without them, the first batch
    ``plan`` is given is planned under both places and the faster kept (until then the planner's attributes,
    ``spec``, ``model_cfg``, ``models``, read the ``first`` placement's; ``choose_embedding`` chooses without
    planning); ``first`` with the reason said once where ``last`` cannot run: one rank, a tied embedding, a model of
    your own, a V-placed kind, a fitted memory model; ``embedding_choice`` records the place, the steps and why. None (default): ``"auto"`` where ``stage_split="auto"``, else ``"first"``. ``offload``: ``"never"`` (default) or
    ``"auto"``: the saved activations of stages' leading blocks may wait in host memory between forward and
    backward where the cost model's host link hides the copies (``PlanSpec.offload``, ``dynmb.planning.offload``;
    the choice per stage in ``plan.meta.offload_blocks``; CPU cost models have no host link and offload nothing).
    ``state_shards``: how many data-parallel ranks share each stage's model states (FSDP2 over the replicas, ``dynmb
    run --dp N --shard``: N); 1 (default): held whole. The memory model counts the sharded run's states
    (``MemoryModel.sharded``), so microbatches may hold more tokens (``PlanSpec.state_shards``).
    """

    def __init__(self, *, model: Any = "small", num_stages: int = 2, memory_limit: int | str = "1GiB",
                 cost_model: CostModelLike | str | Path | None = None,
                 memory_model: MemoryModelLike | str | Path | None = None, schedule: str = "1f1b", round_to: int = 1,
                 dp: int = 1, virtual: int | str = 1, oversize: str = "error", pack_len: int | None = None,
                 recompute: str = "never", device: str = "cpu", stage_split: str = "even",
                 workload: Any = None, global_batch: int | None = None, slice_fitting: str = "never",
                 embedding: str | None = None, offload: str = "never", state_shards: int = 1) -> None:
        auto_v = str(virtual).strip() == AUTO_VIRTUAL
        embedding = embedding_setting(embedding, stage_split)
        auto_e = embedding == AUTO_EMBEDDING
        spec = PlanSpec(method="dynamic", num_stages=int(num_stages), virtual=1 if auto_v else int(virtual),
                        schedule_kind=schedule, reorder="auto", memory_limit_bytes=parse_bytes(memory_limit),
                        dp=int(dp), pack_len=pack_len, round_to=round_to, oversize=oversize, recompute=recompute,
                        slice_fitting=slice_fitting, embedding="first" if auto_e else embedding, offload=offload,
                        state_shards=state_shards)   # the keywords' one spec (``from_spec`` takes one)
        self._setup(model, spec, PlannerInputs(cost_model=cost_model, memory_model=memory_model, device=device,
                                               stage_split=stage_split, workload=workload, global_batch=global_batch,
                                               auto_virtual=auto_v, embedding_auto=auto_e))

    @classmethod
    def from_spec(cls, model: Any, spec: PlanSpec, **inputs: Any) -> "Planner":
        """A planner for ``spec`` (the settings record ``RunConfig.spec`` and ``dynmb plan`` use): ``plan()``
        starts from its method, reorder and mbs. ``inputs``: the fields of ``PlannerInputs`` (``cost_model``,
        ``memory_model``, ``device``, ``stage_split``, ``workload``, ``global_batch``, ``auto_virtual``: then
        ``spec.num_stages`` counts the GPUs and V is chosen as ``virtual="auto"`` does; ``embedding_auto``: the spec's
        embedding place weighed against the other at the first ``plan``, as ``embedding="auto"`` does)."""
        planner = cls.__new__(cls)
        planner._setup(model, spec, PlannerInputs(**inputs))
        return planner

    def _setup(self, model: Any, spec: PlanSpec, inputs: "PlannerInputs") -> None:
        """Resolve the model, the embedding's place (``embedding="auto"``: both placements' layouts, chosen at the
        first ``plan``), the layout (``virtual="auto"``, the stage split) and the cost and memory models."""
        model_cfg, own = _model(model)
        if spec.attention is not None and spec.attention != model_cfg.attention:
            raise ValueError(f"PlanSpec.attention {spec.attention!r} differs from the model's attention "
                             f"{model_cfg.attention!r}; leave it None (the model's)")
        spec = spec.with_(attention=model_cfg.attention)
        self.embedding_choice: EmbeddingChoice | None = None
        """With ``embedding="auto"``: where the embedding was put and why (``dynmb.planning.embedding_choice``); None
        until the first ``plan`` where both placements are weighed, and for a place given."""
        self._weighed: tuple[_Layout, ...] = ()
        if inputs.embedding_auto:
            why = last_refusal(spec, model_cfg, own_model=own,
                               memory_model_given=inputs.memory_model is not None)
            if why is None:
                self._weighed = tuple(_layout(model_cfg, own, spec.with_(embedding=p), inputs)
                                      for p in EMBEDDING_PLACES)
            else:
                self.embedding_choice = fallback(why)
            spec = spec.with_(embedding="first")
        if self._weighed and inputs.workload is not None and inputs.global_batch is not None:
            self.embedding_choice, won = choose_on_samples(Workload(inputs.workload, int(inputs.global_batch)),
                                                           self._placements(None))     # now, on sample batches
            self._fix(won)
        else:
            self._adopt(self._weighed[0] if self._weighed else _layout(model_cfg, own, spec, inputs))

    def _adopt(self, layout: "_Layout") -> None:
        """Plan from here on with ``layout``'s settings, model and models."""
        self.spec, self.model_cfg = layout.spec, layout.model_cfg
        """The settings every ``plan`` call starts from (``plan`` may set the method, reorder and mbs)."""
        self.virtual_choice: VirtualChoice | None = layout.virtual_choice
        """With ``virtual="auto"``: how V was chosen (``dynmb.planning.virtual_search``)."""
        self.split_relief: Relief | None = layout.split_relief
        """With ``stage_split="auto"``: the memory relief weighed (``dynmb.planning.memory_split``), else None."""
        self.models: PredictionModels = layout.models
        """The cost and memory models every ``plan`` uses, with where they came from."""
        self.cost_model, self.memory_model = self.models.cost, self.models.memory

    def choose_embedding(self, lengths: Any, method: str | None = None, *,
                         meta: dict[str, Any] | None = None) -> EmbeddingChoice | None:
        """With ``embedding="auto"`` and no choice yet: ``lengths`` planned with each placement's layout (``method``:
        the spec's) and the faster simulated step's placement fixed from here on (``embedding_choice``); what
        ``plan`` does at its first call. None where the place was given."""
        self._chosen(np.asarray(lengths, dtype=np.int64), self.spec.with_(method=method or self.spec.method), meta)
        return self.embedding_choice

    def _chosen(self, lengths: np.ndarray, spec: PlanSpec, meta: dict[str, Any] | None
                ) -> tuple[Plan, Schedule, SimResult] | None:
        """The choice at the first batch (``choose_embedding``) and the winner's plan of it under ``spec``'s
        method, reorder and mbs; None once chosen (or where the place was given)."""
        if not self._weighed:
            return None
        self.embedding_choice, won, planned = choose_embedding(lengths, self._placements(spec), meta)
        self._fix(won)
        return planned

    def _placements(self, spec: PlanSpec | None) -> list[Placement]:
        """Each weighed place's settings (with ``spec``'s method, reorder and mbs; None: its own), layout, models."""
        keep = ("method", "reorder", "mbs")
        return [Placement(spec=w.spec if spec is None else w.spec.with_(**{k: getattr(spec, k) for k in keep}),
                          model_cfg=w.model_cfg, models=w.models) for w in self._weighed]

    def _fix(self, won: Placement) -> None:
        """Plan with the winning place's layout from here on; nothing left to weigh."""
        self._adopt(self._weighed[EMBEDDING_PLACES.index(won.spec.embedding)])
        self._weighed = ()

    # the settings, read from the spec
    num_stages = property(lambda self: self.spec.num_stages)
    memory_limit_bytes = property(lambda self: self.spec.memory_limit_bytes)
    schedule = property(lambda self: self.spec.schedule_kind)
    round_to = property(lambda self: self.spec.round_to)
    dp = property(lambda self: self.spec.dp)
    virtual = property(lambda self: self.spec.virtual)
    oversize = property(lambda self: self.spec.oversize)
    pack_len = property(lambda self: self.spec.pack_len)
    recompute = property(lambda self: self.spec.recompute)
    slice_fitting = property(lambda self: self.spec.slice_fitting)

    def plan(self, lengths: Any, method: str | None = None, reorder: str | None = None, *, mbs: int | None = None,
             meta: dict[str, Any] | None = None) -> PlannedStep:
        """Plan one global batch ``lengths`` (sequence i has ``lengths[i]`` tokens) with ``method`` (None: the
        spec's, ``dynamic`` for a keyword-built planner); ``reorder`` (None: the spec's, ``auto``: each method in
        its own system's order); ``mbs`` (None: the spec's). With ``embedding="auto"`` the first call plans ``lengths``
        under both places with these settings and fixes the faster (``embedding_choice``)."""
        spec = self.spec.with_(method=method or self.spec.method, reorder=reorder or self.spec.reorder,
                               mbs=self.spec.mbs if mbs is None else mbs)
        batch = np.asarray(lengths, dtype=np.int64)
        planned = self._chosen(batch, spec, meta)      # embedding="auto": the first batch chooses the place
        if planned is not None:
            return PlannedStep(*planned)
        plan, schedule, sim = plan_step(batch, spec, model_cfg=self.model_cfg,
                                        models=self.models, meta=meta)
        return PlannedStep(plan=plan, schedule=schedule, sim=sim)

    def __repr__(self) -> str:
        return (f"Planner(model={self.model_cfg.name!r}, num_stages={self.num_stages}, "
                f"memory_limit_bytes={self.memory_limit_bytes}, schedule={self.schedule!r}, round_to={self.round_to}, "
                f"dp={self.dp}, cost_model={type(self.cost_model).__name__})")
