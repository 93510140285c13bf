"""What one run keeps on this rank across its steps, set up once, collectively.

``RunState(spec, device, hooks)`` creates, in the same order on every rank: the topology
and process groups (``dynmb.runtime.topology``), this rank's stages (``factory.build_stage`` of the
run's ``StageFactory``, ``RunSpec.factory()``: a user's ``package.module:factory`` or dynmb's family
of ``run.model``; weights equal to the single-process model's; data-parallel replicas then take the first
replica's, ``replicas.sync_replicas``) and Adam over their parameters, the cost and
memory models, the length trace, the memory meter and the clock. ``plan_batch(k)`` samples
global batch ``k`` (the trace rows ``data.sample_indices(len(trace), B, seed, k)``) and plans it
with ``planning.plan_step``: deterministic, so every rank computes the same plan, which records
the rows (``Plan.dataset_ids``). On real text (``RunSpec.corpus``) the trace is the token
file's document lengths and ``tokens`` gives the documents' ids; else synthetic ids. A run of a plan
file (``RunSpec.plan``) runs that plan every step instead, with the spec's schedule file or
the schedule built for the plan's kind, predictions from this run's cost and memory models.

``prewarm(state)`` runs one forward + backward of every distinct microbatch shape of the
run before its first step (``RunConfig.prewarm``). Runtime calibration (CPU default): every
measured step is appended to the job's history (``RunState.record``, shared by the runs of a job
on the same model, stages and cost model), and before each step ``RunState.calibrate`` sets the
cost model the step is planned and predicted with: a poly model (the shipped or user fit) refit online on
the job's measured actions (``costmodel.refit``: coefficients per stage and op, the fit as the prior, recent
steps weighted most), another kind scaled per stage and op plus a per-action overhead
(``costmodel.job_calibration``); both plus the gap before each action and a wait per received message (the
job's unexplained receive waits), so a step's predictions use only what ran before it. The cost model is
resolved once by the one loader (``RunSpec.models``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from dynmb.costmodel import CalibrationStep, CostModel, job_calibration
from dynmb.costmodel.loader import Models, refit_version
from dynmb.costmodel.refit import job_refit
from dynmb.data import load_trace, sample_indices
from dynmb.costmodel.standin import suppress_stand_in_warnings
from dynmb.memory.model import MemoryModel
from dynmb.models.embedstage import schedule_stage
from dynmb.models.inputs import corpus_tokens
from dynmb.models import hidden_shape, make_inputs, synthetic_tokens, torch_dtype
from dynmb.planning import plan_step, predict_replicas, replica_schedules, replicas_of
from dynmb.runtime.hooks import NoHooks, StepHooks
from dynmb.runtime.device import device_ops
from dynmb.runtime.fsdp import shard_stage
from dynmb.runtime.meter import MemoryMeter
from dynmb.runtime.planahead import PlanAhead
from dynmb.runtime.ready import wait_for_ranks
from dynmb.runtime.planshare import PlanShare, job_store
from dynmb.runtime.records import ActionRow, ShapeCounts, actions_frame
from dynmb.runtime.spec import RunSpec, load_plan_files, refuse_foreign_layout
from dynmb.runtime.replicas import sync_replicas
from dynmb.runtime.topology import Topology, make_process_groups
from dynmb.timing.simulate import SimResult
from dynmb.core.types import Microbatch, Plan, Schedule

__all__ = ["PlannedBatch", "RunState", "prewarm", "token_seed", "plan_lengths", "planning_model"]

logger = logging.getLogger(__name__)


def token_seed(seed: int, step: int) -> int:
    """Seed of the synthetic token ids of step ``step``."""
    return seed * 1_000_003 + step


def plan_lengths(plan: Plan) -> np.ndarray:
    """The global batch's sequence lengths as ``plan`` holds them (a sliced sequence: its last
    slice's end; a dropped one: 1, never run)."""
    lengths = np.ones(plan.num_sequences, dtype=np.int64)
    for mb in plan.microbatches:
        np.maximum.at(lengths, mb.seq_ids, mb.offsets + mb.lengths)
    return lengths


def _check_factory_sizes(built: object, planned: object, spec: str | None) -> None:
    """The factory a rank resolved has the sizes the run was planned with."""
    keys = ("vocab_size", "d_model", "n_layers")
    if spec and any(getattr(built, k) != getattr(planned, k) for k in keys):
        raise ValueError(f"--model {spec}: this rank's factory has sizes "
                         f"{[getattr(built, k) for k in keys]}, the run was planned with "
                         f"{[getattr(planned, k) for k in keys]} ({', '.join(keys)})")


@dataclass(frozen=True)
class PlannedBatch:
    """One global batch and its plan, replica 0's schedule and the simulation of it."""

    lengths: np.ndarray
    plan: Plan
    schedule: Schedule
    sim: SimResult
    wait_s: float = 0.0
    """How long the step's start waited for this plan (``plan_s`` in line; see ``planahead``)."""


class RunState:
    """Everything one run keeps across steps on this rank (set up collectively)."""

    def __init__(self, spec: RunSpec, device: torch.device, hooks: StepHooks | None = None,
                 history: list[CalibrationStep] | None = None) -> None:
        self.spec, self.device, self.hooks = spec, device, hooks or NoHooks()
        self.run = run = spec.run
        self.topology = Topology.for_run(run, dist.get_rank(), dist.get_world_size())
        self.groups = make_process_groups(self.topology, timedelta(seconds=run.timeout_s), device)
        num_stages = run.spec.num_stages
        self.factory = spec.factory()
        _check_factory_sizes(self.factory.config, run.model, spec.model_factory)
        if not getattr(self.factory, "dynmb_family", False):
            refuse_foreign_layout(run.model, f"--model {spec.model_factory or type(self.factory).__name__}")
        with suppress_stand_in_warnings():           # said once by the launcher (RunSpec.check)
            self.models = spec.models()
        self.profile_model = self.models.cost                # uncalibrated: the prior of the online refit
        self.cost_model = self.profile_model                 # what the next step plans with
        self.history = history if history is not None else []   # the job's measured steps, shared
        self.memory_model = self.models.memory
        self.fixed = load_plan_files(spec) if spec.plan else None   # (plan, schedule file or None)
        self.corpus = spec.corpus.load() if spec.corpus is not None else None     # real text
        self.trace = None if self.fixed is not None else (
            self.corpus.lengths if self.corpus is not None else load_trace(run.dataset))
        self.ahead = PlanAhead(run.plan_ahead, self.batch_lengths, run.warmup + run.steps - 1, spec=run.plan_spec,
                               model_cfg=run.model, memory_model=self.memory_model, share=self._plan_share()) \
            if run.plan_ahead and self.fixed is None else None
        if self.ahead is not None:       # the planner processes start while the stages are built
            self.ahead.submit_through(self.ahead.window, self.cost_model)
        self.stages = {s: schedule_stage(self.factory, s, num_stages, run.spec.embedding, seed=run.seed, device=device)
                       for s in self.topology.local_stages}
        if dist.get_world_size() > 1:    # a slow or stuck factory names its rank, not the one waiting for it
            wait_for_ranks(job_store(), f"{spec.run_id}/stages", self.rank, dist.get_world_size(), run.timeout_s,
                           "building its stages (the model factory's build_stage)")
        sync_replicas(self.stages.values(), self.groups.data_parallel)   # replicas start identical
        self.sharded = run.shard      # FSDP2 over the replicas (dynmb.runtime.fsdp); before the optimizer
        for stage in self.stages.values() if self.sharded else ():
            shard_stage(stage, self.groups.data_parallel)
        self.params = {n: p for module in self.stages.values() for n, p in module.named_parameters()}
        self.optimizer = torch.optim.Adam(self.params.values(), lr=run.lr)
        self.meter = MemoryMeter(device=device, modules=list(self.stages.values()), optimizer=self.optimizer)
        self.ops = device_ops(device)     # the device seam; also the clock the actions are timed with
        self.clock = self.ops
        self.seen_shapes: set[tuple[int, int]] = set()  # (rows, padded_len) run so far (prewarm included)
        self.first_step = 0        # the step a resumed run goes on from (``checkpoint.resume_run``)

    @property
    def rank(self) -> int:
        return self.topology.rank

    def _plan_share(self) -> PlanShare | None:
        """Planning ahead shared by the job's ranks (``runtime.planshare``) when there are several."""
        world = dist.get_world_size()
        return PlanShare(job_store(), dist.get_rank(), world, self.spec.run_id) if world > 1 else None

    @property
    def calibrates(self) -> bool:
        """Whether measured steps calibrate the cost model of later steps (default: on CPU)."""
        return self.spec.calibrate if self.spec.calibrate is not None else self.device.type == "cpu"

    def batch_rows(self, step: int) -> np.ndarray:
        """The trace rows of global batch ``step`` (deterministic)."""
        assert self.trace is not None
        return sample_indices(len(self.trace), self.run.global_batch, self.run.seed, step=step, note=False)

    def batch_lengths(self, step: int) -> np.ndarray:
        """The sequence lengths of global batch ``step``."""
        assert self.trace is not None
        return self.trace[self.batch_rows(step)]

    @property
    def planning_models(self) -> Models[MemoryModel]:
        """The models the next step plans with: the cost model as calibrated so far, the memory model."""
        return Models(self.cost_model, self.memory_model)

    def plan_batch(self, step: int, *, ahead: bool = True) -> PlannedBatch:
        """Global batch ``step`` and its plan: deterministic, the same on every rank. With
        ``plan_ahead`` (and ``ahead``) from the planner processes, else planned here and now."""
        run = self.run
        if self.fixed is not None:
            return self._plan_file_batch()
        rows = self.batch_rows(step)
        if ahead and self.ahead is not None:
            (plan, schedule, sim), lengths, wait_s = self.ahead.get(step, self.cost_model)
        else:
            lengths = self.batch_lengths(step)
            plan, schedule, sim = plan_step(lengths, run.plan_spec, model_cfg=run.model, models=self.planning_models)
            wait_s = float(plan.predictions.get("plan_s") or 0.0)
        return PlannedBatch(lengths, replace(plan, dataset_ids=tuple(rows.tolist())), schedule, sim, wait_s)

    def tokens(self, batch: PlannedBatch, step: int) -> list[torch.Tensor]:
        """Token ids of ``batch``: the corpus documents of its rows, else synthetic ids of step ``step``."""
        if self.corpus is not None:
            assert batch.plan.dataset_ids is not None    # set by plan_batch; RunSpec checks a plan file's
            return corpus_tokens(self.corpus, batch.plan.dataset_ids, batch.lengths)
        return synthetic_tokens(batch.lengths, self.run.model.vocab_size, token_seed(self.run.seed, step))

    def _plan_file_batch(self) -> PlannedBatch:
        """The plan file's plan, replica 0's schedule, and predictions of this run's models (the
        slowest replica's step, every stage's highest peak)."""
        assert self.fixed is not None
        plan, schedule = self.fixed
        replicas = replicas_of(plan)
        scheds = replica_schedules(replicas, self.run.plan_spec, models=self.planning_models, first=schedule)
        predicted = predict_replicas(replicas, scheds, self.planning_models, plan.predictions)
        plan = replace(plan, predictions=predicted.predictions.updated(plan_s=0.0))
        return PlannedBatch(plan_lengths(plan), plan, scheds[0], predicted.sims[0])

    def note_shapes(self, plan: Plan) -> ShapeCounts:
        """The counts of ``plan``'s microbatch shapes, distinct and new; remembers them as seen."""
        shapes = {(mb.batch, mb.padded_len) for mb in plan.microbatches}
        new = len(shapes - self.seen_shapes)
        self.seen_shapes |= shapes
        return ShapeCounts(distinct=len(shapes), new=new)

    def record(self, actions: list[ActionRow]) -> None:
        """Append one step's actions (every rank's, the same list on every rank) to the job's
        history, priced by the uncalibrated model (``raw_pred_s``, and ``comm_s``: its P2P time
        of the action's microbatch, what the receive waits are measured against); with the embedding on the last
        rank the plan's stages' actions, numbered as the plan does (``dynmb.schedule.embedlast``)."""
        frame = actions_frame(actions)
        if self.run.spec.embedding == "last":     # the plan's stages only: the embeds are priced, not calibrated
            frame = frame[frame["stage"] > 0].assign(stage=lambda f: f["stage"] - 1)
        if not frame.empty:
            comm = self.profile_model.comm_s(frame["batch"].to_numpy(), frame["padded_len"].to_numpy())
            self.history.append(CalibrationStep(self.spec.run_id, frame.assign(pred_s=frame["raw_pred_s"], comm_s=comm)))

    def calibrate(self) -> None:
        """Set the cost model the next step is planned and predicted with (``planning_model`` of the job's
        history; every rank holds the same history, so all compute the same model)."""
        self.cost_model = planning_model(self.profile_model, self.history, self.spec.run_id,
                                         self.run.spec.num_stages)

    def close(self) -> None:
        self.meter.close()
        if self.ahead is not None:
            self.ahead.close()


def planning_model(profile_model: CostModel, history: list[CalibrationStep], run_id: str,
                   num_stages: int) -> CostModel:
    """The cost model run ``run_id``'s next step is planned with, from the job's ``history``: a poly prior
    refit online on every measured action (``costmodel.refit.job_refit``: coefficients per stage and op,
    recent steps weighted most) plus the gap before each action; another kind scaled per stage and op plus a
    per-action overhead (``costmodel.job_calibration``); both plus the wait per received message."""
    cal = job_calibration(history, run_id, num_stages)
    refit = job_refit(profile_model, history)
    if refit is not profile_model:          # the refit's fixed cost holds the per-action overhead
        model = refit.with_overhead(**cal.gap_s) if cal.gap_s else refit
        logger.debug("%s: online refit version %d", run_id, refit_version(refit))
    else:
        logger.debug("%s: calibration: scale %s, per action %s", run_id,
                     ", ".join(f"{op} {'/'.join(f'{v:.2f}' for v in per)}" for op, per in cal.scale.items())
                     or "none", ", ".join(f"{op} {1e3 * v:.1f} ms" for op, v in cal.per_action_s.items()) or "none")
        model = profile_model.with_scale(cal.scale) if cal.scale else profile_model
        model = model.with_overhead(**cal.per_action_s) if cal.per_action_s else model
    return model.with_recv_latency(cal.latency_s) if cal.latency_s else model


def prewarm(state: RunState) -> int:
    """Run one forward + backward of every distinct microbatch shape of this run's planned steps
    on this rank's stages, outside any measured step (``RunConfig.prewarm``), then drop the
    gradients. Shapes are planned with the cost model of set-up time (the runtime calibration
    may change later plans; the ``new_shapes`` column says what was still new). Returns the
    number of shapes run."""
    run = state.run
    todo: dict[tuple[int, int, bool], tuple[Microbatch, np.ndarray]] = {}
    for step in range(run.warmup + run.steps):
        batch = state.plan_batch(step, ahead=False)
        for mb in batch.plan.microbatches:
            todo.setdefault((mb.batch, mb.padded_len, mb.is_packed), (mb, batch.lengths))
    for microbatch, lengths in todo.values():
        tokens = synthetic_tokens(lengths, run.model.vocab_size, 0)
        if microbatch.has_slices:        # its shape, as whole documents (no earlier slices to attend to here)
            # None: the defaults (Microbatch's __init__ takes them; mypy types replace() by the fields)
            microbatch = replace(microbatch, offsets=None, continued=None)  # type: ignore[arg-type]
        inputs = make_inputs(microbatch, tokens, cfg=run.model, device=state.device)
        for s, stage in state.stages.items():
            sender = s - 1 - (run.spec.embedding == "last")         # the plan's stage that sends to it
            x = None if stage.is_first else torch.randn(hidden_shape(microbatch, run.model, sender if sender >= 0
                                                                     else None, run.spec.num_stages),
                                                        dtype=torch_dtype(run.model), device=state.device,
                                                        requires_grad=True)
            y = stage(x, inputs)
            if stage.is_last:
                y.backward()
            else:
                y.backward(torch.ones_like(y))
        state.seen_shapes.add((microbatch.batch, microbatch.padded_len))
    state.optimizer.zero_grad(set_to_none=True)
    return len(todo)
