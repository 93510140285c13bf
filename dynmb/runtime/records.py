"""Rows of the results tables a run writes, and the writer rank 0 appends them with.

Every rank measures its own actions and stages (``ActionRow``, ``MemoryRow``) and sends
them, with its step time, busy time, loss and failed checks (``StepReport``), to every rank
(``all_gather_object``). Rank 0 then appends, step by step (``Recorder``; atomic rewrites
through ``results.TableWriter``, so a crash keeps every finished step):

- ``steps``: one row per step (``step_row``): the plan's tokens and predictions, the
  step time (the slowest rank's, barrier to barrier), mean bubble over ranks
  (1 - busy / step time), the run's settings, and the simulator's step time on the measured
  action times (``replay_step_s``);
- ``actions``: one row per action of every rank; ``start_s``/``end_s`` bound the compute
  from the step start on the rank's clock, ``wait_s`` is the receive wait before it;
- ``memory``: one row per stage: measured peak, the limit it was checked against, the
  planned peak, on CUDA the allocator's ``allocated_bytes``/``reserved_bytes``, and the bytes of
  saved activations offloaded to host memory (``offloaded_bytes``);
- ``runs``: one row per run when it starts (``run_row``: flattened config and provenance,
  ``status`` ``running``), finished when the run ends (``Recorder.run_finished``: ``ok``, or
  ``failed`` with its ``error``; the launcher finishes the rows rank 0 could not).

The column dictionary of every table is in the repository's ``docs/design.md``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np
import pandas as pd

from dynmb.costmodel.loader import refit_version
from dynmb.planning.choice import plan_choice_fields
from dynmb.timing.bounds import step_bound_fields
from dynmb.costmodel import CostModelLike
from dynmb.io.results import TableWriter, run_info
from dynmb.runtime.hostmem import host_malloc_mode
from dynmb.runtime.spec import RunSpec
from dynmb.schedule.io import sidecar_path
from dynmb.timing.simulate import comm_times, simulate_costs
from dynmb.core.types import Plan, Schedule

__all__ = ["ActionRow", "MemoryRow", "ShapeCounts", "StepReport", "step_row", "replay_step_s", "run_row", "actions_frame",
           "Recorder"]


@dataclass(frozen=True, kw_only=True)
class ActionRow:
    """One action of one rank in one step (a row of ``actions``)."""

    run_id: str
    step: int
    rank: int
    dp_rank: int
    stage: int
    op: str
    mb: int
    batch: int
    padded_len: int
    docs: int
    attn_work: int
    start_s: float
    end_s: float
    pred_s: float
    wait_s: float
    raw_pred_s: float = 0.0
    """The uncalibrated cost model's prediction (what runtime calibration fits ``pred_s`` from)."""
    cpu_s: float | None = None
    """CPU: this rank's thread CPU seconds of the compute (end_s - start_s minus the time the
    thread was not running); None (NaN in the table) on CUDA."""


@dataclass(frozen=True, kw_only=True)
class MemoryRow:
    """The measured peak of one stage in one step (a row of ``memory``)."""

    run_id: str
    step: int
    stage: int
    rank: int
    dp_rank: int
    peak_bytes: int
    limit_bytes: int
    pred_peak_bytes: int | None
    """The plan's predicted peak of the stage (``Predictions.pred_peak_bytes``: the stage's own states and
    activations, the highest over the replicas)."""
    pred_rank_peak_bytes: int | None = None
    """The predicted peak of this rank's GPU, what ``peak_bytes`` measures (with allocator statistics the rank's
    peak; the CPU meter samples the rank's bytes): the stage's ``pred_peak_bytes`` where the rank holds one stage,
    else (interleaved chunks, the embedding stage beside the last) the simulator's peak of the rank over its
    replica's schedule (the plan's ``Predictions.pred_rank_peak_bytes``, ``SimResult.peak_bytes_rank`` made where
    the plan was predicted: its stages' states and activations at once)."""
    allocated_bytes: int | None = None
    """CUDA: ``max_memory_allocated`` of the rank in the step (no column on CPU)."""
    reserved_bytes: int | None = None
    """CUDA: ``max_memory_reserved`` of the rank in the step (no column on CPU)."""
    offloaded_bytes: int = 0
    """Bytes of the stage's saved activations copied to host memory in the step (``PlanMeta.offload_blocks``,
    ``dynmb.runtime.offload``: each storage once per forward; 0 without offload)."""

    def as_row(self) -> dict[str, Any]:
        row = asdict(self)
        for cuda_only in ("allocated_bytes", "reserved_bytes"):
            if row[cuda_only] is None:
                del row[cuda_only]
        return row


@dataclass(kw_only=True)
class StepReport:
    """What one rank measured in one step; all-gathered to every rank."""

    rank: int
    step_s: float
    """Barrier to barrier, on this rank."""
    busy_s: float
    """Sum of this rank's compute intervals."""
    loss: float
    """This rank's share of the scaled loss (non-zero on last stages only)."""
    actions: list[ActionRow] = field(default_factory=list)
    memory: list[MemoryRow] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    """Failed checks (memory limit, gradients), one message each."""
    plan_wait_s: float = 0.0
    """How long this rank's step start waited for the step's plan (``runtime.planahead``)."""
    grad_rel_err: float | None = None
    """``--verify``: the largest relative gradient error of this rank's parameters (``checks.relative_error``)."""


def actions_frame(rows: Sequence[ActionRow]) -> pd.DataFrame:
    """``rows`` as an ``actions`` table."""
    return pd.DataFrame([asdict(r) for r in rows])


def replay_step_s(schedule: Schedule, plan: Plan, actions: Sequence[ActionRow],
                  cost_model: CostModelLike) -> float | None:
    """The simulator's step time of ``schedule`` with every action's *measured* compute time
    (``end_s - start_s``) in place of the cost model's, and the cost model's P2P time.

    ``pred_step_s`` errs for two reasons: the cost model's action times, and what the simulator
    leaves out (receive latency beyond the P2P model, work between actions, the optimizer step,
    a rank waiting on a peer it does not depend on). Replaying the measured action times
    removes the first, so ``|replay - step_s| / step_s`` is the simulator's own error and the
    rest of ``pred_err`` is the cost model's (on a shared machine, mostly its speed drifting
    between calibration and step). Replica 0 only: None for a data-parallel plan or when an
    action of the schedule was not measured."""
    if plan.dp > 1:
        return None
    costs = {op: np.full((schedule.num_stages, schedule.num_microbatches), np.nan) for op in ("F", "B", "I", "W")}
    for a in actions:
        if a.dp_rank == 0 and a.op in costs:
            costs[a.op][a.stage, a.mb] = a.end_s - a.start_s
    scheduled = [a for acts in schedule.ranks for a in acts]
    if any(np.isnan(costs[a.op][a.stage, a.mb]) for a in scheduled):
        return None
    # an op some microbatches do not run (B beside I/W in a zero-bubble schedule) costs them nothing
    costs = {op: np.nan_to_num(c, nan=0.0) for op, c in costs.items() if op in {a.op for a in scheduled}}
    return simulate_costs(schedule, costs, comm_times(cost_model, plan)).makespan_s


@dataclass(frozen=True)
class ShapeCounts:
    """A step's microbatch shapes ``(batch, padded_len)``: how many ``distinct``, how many ``new`` to the run."""

    distinct: int
    new: int


def step_row(spec: RunSpec, step: int, plan: Plan, reports: Sequence[StepReport], *, world_size: int,
             shapes: ShapeCounts, cost_model: CostModelLike, schedule: Schedule | None = None) -> dict[str, Any]:
    """The ``steps`` row of ``step``: ``plan`` is the global batch's plan, ``reports`` every rank's,
    ``shapes`` its shape counts (``RunState.note_shapes``), ``cost_model`` the model the step was planned and predicted with (its per-action runtime
    overhead, ``F`` / ``B``, its calibration scale, mean over stages, and the wait per received
    message it adds to receiving actions, ``recv_latency_s``), ``schedule``
    the schedule replica 0 ran (for ``replay_step_s``; None leaves it empty)."""
    overhead_s = cost_model.runtime_overhead_s
    num_stages = spec.run.pipeline.num_stages
    cfg, pipeline = spec.run, spec.run.pipeline
    step_s = max(r.step_s for r in reports)
    return dict(
        run_id=spec.run_id, method=cfg.method, dataset=cfg.dataset, step=step, warmup=step < cfg.warmup,
        step_s=step_s, pred_step_s=plan.predictions.get("pred_step_s"), real_tokens=plan.real_tokens,
        computed_tokens=plan.computed_tokens, tokens_per_s=plan.real_tokens / step_s,
        num_microbatches=plan.num_microbatches, padding_fraction=plan.padding_fraction,
        mean_bubble=sum(1 - r.busy_s / step_s for r in reports) / len(reports),
        pred_mean_bubble=plan.predictions.get("mean_bubble"), plan_s=plan.predictions.get("plan_s"),
        plan_wait_s=max(r.plan_wait_s for r in reports), plan_ahead=cfg.plan_ahead,
        loss=sum(r.loss for r in reports), schedule=schedule_label(spec), schedule_kind=plan.schedule_kind,
        reorder=pipeline.reorder,
        num_stages=pipeline.num_stages, virtual=pipeline.virtual, dp=cfg.dp, world_size=world_size,
        verified=spec.verify, grad_rel_err=_grad_rel_err(reports), memory_limit_bytes=int(plan.memory_limit_bytes), mbs=plan.meta.get("mbs"),
        model=cfg.model.name, global_batch=cfg.global_batch, truncated=len(plan.meta.get("truncated", [])),
        dropped=len(plan.meta.get("dropped", [])), recomputed=int(plan.recompute_mask().sum()),
        sliced=len(plan.slice_groups()), slices=sum(len(w) for w in plan.slice_groups().values()),
        oversize=cfg.oversize, slice_fitting=cfg.slice_fitting, slice_threshold=plan.meta.get("slice_threshold"),
        recompute=cfg.recompute, overhead_F_s=overhead_s["F"], overhead_B_s=overhead_s["B"],
        scale_F=sum(cost_model.scale_of(p, "F") for p in range(num_stages)) / num_stages,
        scale_B=sum(cost_model.scale_of(p, "B") for p in range(num_stages)) / num_stages,
        recv_latency_s=float(getattr(getattr(cost_model, "comm", None), "recv_latency_s", 0.0)),
        attention=cfg.model.attention, pack_len=plan.meta.get("pack_len"), round_to=cfg.round_to,
        distinct_shapes=shapes.distinct, new_shapes=shapes.new, prewarm=cfg.prewarm, seed=cfg.seed,
        replay_step_s=None if schedule is None else replay_step_s(
            schedule, plan, [a for r in reports for a in r.actions], cost_model),
        **step_bound_fields(plan, schedule, cost_model, [a for r in reports for a in r.actions], step_s),
        model_version=refit_version(cost_model), **plan_choice_fields(plan), label=spec.display_label)


def _grad_rel_err(reports: Sequence[StepReport]) -> float | None:
    """The ``grad_rel_err`` column: the largest of the ranks' (None: not verified)."""
    errs = [r.grad_rel_err for r in reports if r.grad_rel_err is not None]
    return max(errs) if errs else None


def schedule_label(spec: RunSpec) -> str:
    """The ``schedule`` column: the kind that ran, or ``file`` for a schedule CSV without the sidecar
    ``dynmb schedule`` writes (a hand-written or torch schedule: its kind is not known)."""
    if spec.schedule and not sidecar_path(spec.schedule).exists():
        return "file"
    return spec.run.pipeline.schedule


def run_row(spec: RunSpec, *, backend: str, device: str, world_size: int) -> dict[str, Any]:
    """The ``runs`` row of ``spec``: flattened config, provenance (the host allocator policy of
    this worker included), verify and process count."""
    info = run_info(spec.run_id, spec.run.flat(), backend=backend, device=device, world_size=world_size,
                    host_malloc=host_malloc_mode())
    return {**info, "verify": spec.verify, "nproc": world_size, "plan": spec.plan or "",
            "schedule_file": spec.schedule or "", "tokenizer": spec.corpus.source.tokenizer if spec.corpus else "",
            "token_file": spec.corpus.path if spec.corpus else "", "virtual_choice": spec.virtual_choice,
            "status": "running", "error": ""}


class Recorder:
    """Rank 0's table writers, one per results folder, shared by the cases of a job."""

    def __init__(self) -> None:
        self._writers: dict[str, TableWriter] = {}

    def writer(self, out_dir: str) -> TableWriter:
        if out_dir not in self._writers:
            self._writers[out_dir] = TableWriter(out_dir)
        return self._writers[out_dir]

    def run_started(self, spec: RunSpec, *, backend: str, device: str, world_size: int) -> None:
        self.writer(spec.out_dir).append("runs", [run_row(spec, backend=backend, device=device,
                                                           world_size=world_size)])

    def run_finished(self, spec: RunSpec, status: str, error: str = "") -> None:
        """Rewrite the run's ``runs`` row with its final ``status`` and ``error`` (one line)."""
        self.writer(spec.out_dir).update("runs", spec.run_id, {"status": status, "error": " ".join(error.split())})

    def steps(self, spec: RunSpec, row: dict[str, Any]) -> None:
        self.writer(spec.out_dir).append("steps", [row])

    def measurements(self, spec: RunSpec, reports: Sequence[StepReport]) -> None:
        """Every rank's ``actions`` and ``memory`` rows of one step."""
        writer = self.writer(spec.out_dir)
        writer.append("actions", [asdict(a) for r in reports for a in r.actions])
        writer.append("memory", [m.as_row() for r in reports for m in r.memory])

    def close(self) -> None:
        """Write the Parquet copies and forget the writers."""
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
