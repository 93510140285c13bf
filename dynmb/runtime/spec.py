"""What a torchrun job runs: typed run specs and their JSON form (``out_dir/spec.json``).

A ``RunSpec`` is one run: its ``RunConfig``, where its tables go, its run id and label,
and how it is checked (``verify``, ``allow_over_limit``, a fitted ``memory_model``). A
``JobSpec`` is the cases one torchrun job runs in the same process group (start-up paid
once): one after another, or with ``interleave`` (CPU) round by round, step k of every case
before step k + 1 (what ``dynmb compare`` does). ``hooks`` names a ``StepHooks`` factory by
import path (``"package.module:name"`` plus JSON keyword arguments); every rank builds it
and hands it to the step runner. Tests inject faults through it; runs leave it empty.

A run on real text (``dynmb run --corpus FILE --field F``) carries ``corpus``, the token file
the launcher wrote before torchrun started (``dynmb.data.prepare_tokens``): its documents'
token counts are the run's length trace and every rank reads the same ids from it
(``RunConfig.dataset`` then only names the corpus); without it the ranks draw synthetic ids.

A run of a model of the user's own (``--model package.module:factory``) records that string
(``model_factory``; ``run.model`` holds its sizes, ``dynmb.models.contract.planning_config``): every
rank resolves it and builds its stages with ``factory.build_stage``, and ``--verify``'s reference
resolves it again (a fresh factory, so a factory whose stages share one model's modules never
shares them with the reference). ``RunSpec.factory()`` gives the run's factory (dynmb's family of
``run.model`` without one). ``check()`` makes sure a fresh interpreter started like a torchrun worker
finds the module, and refuses an LM head split by vocabulary (``ModelConfig.head_split``) and leading blocks
recomputed per stage (``ModelConfig.recompute_blocks``) for it (``refuse_foreign_layout``; the ranks check it
again): only dynmb's families build head shards and read ``recompute_blocks``.

A run of a given plan (``dynmb run --plan P.json [--schedule S.csv]``) names the plan file
(``plan``) and optionally a schedule CSV (``schedule``): every step runs that plan, with that
schedule or the one built for the plan's ``schedule_kind``, instead of planning a new batch.

``JobSpec.check()`` (``launch_job`` calls it before torchrun starts) checks what can be checked
without starting a rank: first ``RunSpec.check_settings()`` (also what ``dynmb run`` and ``dynmb
compare`` call before anything is read or written): the planning settings by the same function
``dynmb plan`` uses (``dynmb.planning.spec_check.check_plan_spec``: names, a kind that takes the
virtual stages or slices asked for, ``mbs`` / ``pack_len`` only for the methods that read them), the
timeout and the device (``nccl`` needs CUDA, and CUDA must be there); then the model's cost- and
memory-model files, the length trace (or the token file, and that the tokenizer's ids fit the
model's vocabulary), the plan and schedule files, the output folder
(writable) and the run ids (new to their folder). It raises ``ValueError`` (``OSError`` for a
missing file) with one line naming the problem.

JSON form (``JobSpec.to_dict``): a job of one case written for that case's own folder is
the case itself::

    {"run": RunConfig.to_dict(), "out_dir": ..., "run_id": ..., "label": ...,
     "verify": bool, "allow_over_limit": bool, "memory_model": path | null,
     "calibrate": bool | null, "hooks": {"target": "mod:name", "kwargs": {...}} | null,
     "plan": path | null, "schedule": path | null, "corpus": TokenFile.to_dict() | null,
     "model_factory": "package.module:factory" | null}

any other job is ``{"out_dir": ..., "cases": [case, ...], "interleave": bool, "order_seed": int | null}``.
``JobSpec.from_dict`` reads both. The worker reads it (see ``dynmb.runtime.worker``).
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from dynmb.io.atomic import write_text_atomic
from dynmb.core.config import RunConfig
from dynmb.data import TokenFile, check_vocab, load_trace, sample_indices
from dynmb.memory.model import get_memory_model
from dynmb.costmodel.loader import PredictionModels, check_plan_models, load_models, spec_models
from dynmb.planning.spec_check import check_plan_spec
from dynmb.io.results import run_ids_in
from dynmb.schedule import ScheduleError, from_csv, validate
from dynmb.core.types import Plan, Schedule

__all__ = ["HookRef", "RunSpec", "JobSpec", "load_plan_files", "check_writable", "check_device", "refuse_foreign_layout",
           "refuse_foreign_head_split", "refuse_offload_with_recompute"]

_RUN_KEYS = ("run", "out_dir", "run_id", "label", "verify", "allow_over_limit", "memory_model", "calibrate", "hooks",
             "plan", "schedule", "corpus", "model_factory", "virtual_choice")
_JOB_KEYS = ("out_dir", "cases", "interleave", "order_seed")


def _check_keys(data: Mapping[str, Any], known: tuple[str, ...], what: str) -> None:
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{what}: unknown key(s) {unknown}; expected {list(known)}")


@dataclass(frozen=True, kw_only=True)
class HookRef:
    """A ``StepHooks`` factory named by import path, built on every rank (``runtime.hooks.load_hooks``)."""

    target: str
    """``"package.module:name"``: a callable returning the hooks object (a class works)."""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """JSON keyword arguments of that callable."""

    def __post_init__(self) -> None:
        module, sep, name = self.target.partition(":")
        if not sep or not module or not name:
            raise ValueError(f"hooks target {self.target!r} is not 'package.module:name'")

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "kwargs": dict(self.kwargs)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HookRef:
        _check_keys(data, ("target", "kwargs"), "hooks")
        return cls(target=str(data["target"]), kwargs=dict(data.get("kwargs") or {}))


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One run of a job: its configuration, its output and how it is checked."""

    run: RunConfig
    """What to run."""
    out_dir: str
    """Absolute folder of its ``steps``/``actions``/``memory``/``runs`` tables."""
    run_id: str
    """The ``run_id`` column of every row it writes."""
    label: str | None = None
    """The ``label`` column of its steps (default: the method): names a case of a compare job."""
    verify: bool = False
    """Check every step's gradients against a single-process reference."""
    allow_over_limit: bool = False
    """Report a measured peak over the memory limit instead of failing the run."""
    memory_model: str | None = None
    """Fitted memory-model JSON; None: the analytic model."""
    calibrate: bool | None = None
    """Calibrate each step's cost model on the steps the job measured before it
    (``RunState.calibrate``); None: on CPU."""
    hooks: HookRef | None = None
    """Step hooks every rank builds (tests: fault injection); None: none."""
    plan: str | None = None
    """A plan JSON every step runs as it is (no planning); None: plan each step's batch."""
    schedule: str | None = None
    """With ``plan``: a schedule CSV of that plan (replica 0's); None: built for its schedule kind."""
    corpus: TokenFile | None = None
    """Real text: the token file of the corpus the global batches are drawn from (its token
    counts are the length trace); None: the trace ``run.dataset`` and synthetic ids."""
    model_factory: str | None = None
    """``package.module:factory`` every rank builds its stages with (a model of the user's own);
    None: dynmb's family of ``run.model``."""
    virtual_choice: str = ""
    """How ``--virtual auto`` chose the run's chunks per GPU (``dynmb.planning.virtual_search.describe``);
    empty: V was given."""

    def factory(self) -> Any:
        """A fresh ``StageFactory`` of this run (each call resolves ``model_factory`` again)."""
        from dynmb.models.contract import resolve_model
        from dynmb.models.families import family_factory

        return resolve_model(self.model_factory) if self.model_factory else family_factory(self.run.model)

    @classmethod
    def create(cls, run: RunConfig, out_dir: str | Path, *, run_id: str | None = None, label: str | None = None,
               verify: bool = False, allow_over_limit: bool = False, memory_model: str | None = None,
               calibrate: bool | None = None, hooks: HookRef | None = None, plan: str | Path | None = None,
               schedule: str | Path | None = None, corpus: TokenFile | None = None,
               model_factory: str | None = None, virtual_choice: str = "") -> RunSpec:
        """A spec for ``run`` writing to ``out_dir`` (made absolute, as are ``plan`` and
        ``schedule``); ``run_id`` defaults to ``<method>-<schedule>-<8 hex digits>``, new every call."""
        rid = run_id or f"{run.spec.method}-{run.spec.schedule_kind}-{uuid.uuid4().hex[:8]}"
        return cls(run=run, out_dir=str(Path(out_dir).resolve()), run_id=rid, label=label, verify=verify,
                   allow_over_limit=allow_over_limit, memory_model=memory_model, calibrate=calibrate, hooks=hooks,
                   plan=str(Path(plan).resolve()) if plan else None,
                   schedule=str(Path(schedule).resolve()) if schedule else None, corpus=corpus,
                   model_factory=model_factory, virtual_choice=virtual_choice)

    @property
    def display_label(self) -> str:
        """The ``label`` column: the label, else the method."""
        return self.label or self.run.spec.method

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run.to_dict(), "out_dir": self.out_dir, "run_id": self.run_id, "label": self.label,
                "verify": self.verify, "allow_over_limit": self.allow_over_limit, "memory_model": self.memory_model,
                "calibrate": self.calibrate, "hooks": self.hooks.to_dict() if self.hooks else None,
                "plan": self.plan, "schedule": self.schedule,
                "corpus": self.corpus.to_dict() if self.corpus else None, "model_factory": self.model_factory,
                "virtual_choice": self.virtual_choice}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunSpec:
        _check_keys(data, _RUN_KEYS, "run spec")
        hooks = data.get("hooks")
        return cls(run=RunConfig.from_dict(data["run"]), out_dir=str(data["out_dir"]),
                   run_id=str(data.get("run_id") or "run"), label=data.get("label"),
                   verify=bool(data.get("verify", False)), allow_over_limit=bool(data.get("allow_over_limit", False)),
                   memory_model=data.get("memory_model"), calibrate=data.get("calibrate"),
                   hooks=HookRef.from_dict(hooks) if hooks else None, plan=data.get("plan"),
                   schedule=data.get("schedule"),
                   corpus=TokenFile.from_dict(data["corpus"]) if data.get("corpus") else None,
                   model_factory=data.get("model_factory"), virtual_choice=str(data.get("virtual_choice") or ""))

    def check_settings(self) -> None:
        """The settings of the run alone (nothing written): the planning settings
        (``dynmb.planning.spec_check.check_plan_spec``, what ``dynmb plan`` refuses; a plan run:
        the schedule kind, virtual stages and slices of its plan; ``pack_len`` against the memory
        model), the timeout, and the device:
        ``nccl`` runs on CUDA, and CUDA must be there (``dynmb.runtime.device.cuda_available``)."""
        run = self.run
        spec = run.plan_spec
        check_plan_spec(spec if self.plan is None else spec.with_(mbs=None, pack_len=None))
        if self.plan is None and run.spec.pack_len is not None:        # longer than any row that fits
            check_plan_spec(spec, run.model, get_memory_model(self.memory_model, run.model, spec.num_stages))
        if not run.timeout_s > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {run.timeout_s}")
        if self.plan is None and run.global_batch < run.spec.dp:
            raise ValueError(f"--global-batch {run.global_batch} is smaller than --dp {run.spec.dp}: every data-parallel "
                             "replica needs at least one sequence of the global batch")
        check_device(run.backend, run.device)

    def models(self, *, who: str = "dynmb run") -> PredictionModels:
        """The run's cost and memory models, through the one loader (``dynmb.costmodel.loader.load_models``:
        the run's files, else the fit shipped for its model, stages and device, else the stand-ins)."""
        run = self.run
        models = load_models(run.model, run.spec.num_stages, cost=run.cost_model, memory=self.memory_model,
                             device=run.device, virtual=run.spec.virtual, own_model=self.model_factory is not None,
                             who=who)
        return spec_models(models, run.spec)

    def check(self) -> None:
        """Check what can be checked before torchrun starts (see the module docstring)."""
        run = self.run
        self.check_settings()
        if self.model_factory is not None:
            from dynmb.models.contract import check_importable

            check_importable(self.model_factory)
            refuse_foreign_layout(run.model, f"--model {self.model_factory}")
        models = self.models(who="dynmb run")   # the one loader: a stand-in is said here, once, not by every rank
        if self.plan is not None:                # a plan runs with the models it was made with
            check_plan_models(Plan.load(self.plan, allow_over_limit=True).meta.models, models, str(self.plan))
        if self.corpus is not None:
            if not Path(self.corpus.path).is_file():
                raise FileNotFoundError(f"token file {self.corpus.path!r} of corpus {self.corpus.source.name} not found")
            check_vocab(self.corpus, run.model.vocab_size, run.model.name)
        if self.plan is None:
            if self.schedule is not None:
                raise ValueError(f"schedule file {self.schedule} given without the plan it was built for")
            if self.corpus is None:
                trace = load_trace(run.dataset)
                if trace.size < run.global_batch:       # said once here, not by every rank
                    sample_indices(trace.size, run.global_batch, run.seed)
        else:
            load_plan_files(self)
        check_writable(self.out_dir)


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """The runs of one torchrun job, in one process group."""

    out_dir: str
    """Folder of ``spec.json`` and ``errors/rank<k>.txt``."""
    cases: tuple[RunSpec, ...]
    """The runs, in order."""
    interleave: bool = False
    """CPU: round by round (step k of every case, then step k + 1) instead of one after another."""
    order_seed: int | None = None
    """With ``interleave``: each round runs the cases in a fresh random order drawn from this seed and the
    round (``dynmb.runtime.worker.round_order``); None: the order rotated by one every round."""

    def __post_init__(self) -> None:
        if not self.cases:
            raise ValueError("a job needs at least one case")

    @classmethod
    def single(cls, spec: RunSpec) -> JobSpec:
        """The job of one run, in the run's own folder."""
        return cls(out_dir=spec.out_dir, cases=(spec,))

    @property
    def is_single(self) -> bool:
        """One run in its own folder: the JSON form is the run's spec itself."""
        return len(self.cases) == 1 and not self.interleave and self.cases[0].out_dir == self.out_dir

    @property
    def total_steps(self) -> int:
        """Warm-up plus measured steps over every case."""
        return sum(c.run.warmup + c.run.steps for c in self.cases)

    def check(self) -> None:
        """Check every case (``RunSpec.check``), and that run ids are unique and new to their folder."""
        ids = [c.run_id for c in self.cases]
        if len(set(ids)) != len(ids):
            raise ValueError(f"run ids repeat in one job: {sorted(i for i in set(ids) if ids.count(i) > 1)}")
        check_writable(self.out_dir)
        for case in self.cases:
            case.check()
            if case.run_id in run_ids_in(case.out_dir):
                raise ValueError(f"run id {case.run_id!r} is already in {Path(case.out_dir) / 'runs.csv'}; "
                                 "a run never reuses one")

    def to_dict(self) -> dict[str, Any]:
        if self.is_single:
            return self.cases[0].to_dict()
        return {"out_dir": self.out_dir, "cases": [c.to_dict() for c in self.cases], "interleave": self.interleave,
                "order_seed": self.order_seed}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobSpec:
        if "cases" not in data:
            return cls.single(RunSpec.from_dict(data))
        _check_keys(data, _JOB_KEYS, "job spec")
        return cls(out_dir=str(data["out_dir"]), cases=tuple(RunSpec.from_dict(c) for c in data["cases"]),
                   interleave=bool(data.get("interleave", False)),
                   order_seed=None if data.get("order_seed") is None else int(data["order_seed"]))

    def save(self, path: str | Path) -> Path:
        """Write the JSON form to ``path`` (atomically)."""
        return write_text_atomic(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> JobSpec:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"spec file {path} is not valid JSON: {e}") from None
        return cls.from_dict(data)


def load_plan_files(spec: RunSpec) -> tuple[Plan, Schedule | None]:
    """The plan of a plan run (``Plan.load`` validates it) and its schedule, if a file gives one,
    checked against the run: stages, limit, method, data parallelism, sequences, ranks."""
    if spec.plan is None:
        raise ValueError("this run plans its batches; it has no plan file")
    run, pipeline = spec.run, spec.run.spec
    plan = Plan.load(spec.plan, allow_over_limit=spec.allow_over_limit)
    want = {"stages": (plan.num_stages, pipeline.num_stages),
            "memory limit bytes": (int(plan.memory_limit_bytes), int(pipeline.memory_limit_bytes)),
            "method": (plan.method, run.spec.method), "dp": (plan.dp, run.spec.dp),
            "sequences (global batch)": (plan.num_sequences, run.global_batch)}
    for what, (in_plan, in_run) in want.items():
        if in_plan != in_run:
            raise ValueError(f"plan {spec.plan} has {what} {in_plan}, the run {in_run}")
    refuse_offload_with_recompute(plan.meta.get("offload_blocks"), run.model.stage_recompute_blocks(plan.num_stages),
                                  f"plan {spec.plan}")
    if spec.corpus is not None:
        if plan.dataset_ids is None:
            raise ValueError(f"plan {spec.plan} has no dataset_ids: it cannot say which documents of corpus "
                             f"{spec.corpus.source.name} to run")
        if max(plan.dataset_ids) >= spec.corpus.num_documents or min(plan.dataset_ids) < 0:
            raise ValueError(f"plan {spec.plan} has dataset ids up to {max(plan.dataset_ids)}; corpus "
                             f"{spec.corpus.source.name} has {spec.corpus.num_documents} documents")
    if spec.schedule is None:
        return plan, None
    replica = plan.replica(0) if plan.dp > 1 else plan
    schedule = from_csv(spec.schedule, num_microbatches=replica.num_microbatches, kind=pipeline.schedule_kind)
    ranks = pipeline.num_stages // pipeline.virtual
    if schedule.num_stages != plan.num_stages or schedule.num_ranks != ranks:
        raise ValueError(f"schedule {spec.schedule} has {schedule.num_stages} stages on {schedule.num_ranks} ranks; "
                         f"the plan {spec.plan} needs {plan.num_stages} stages on {ranks} ranks")
    try:
        validate(schedule, replica)              # complete, deadlock-free, slices in order
    except ScheduleError as e:
        raise ValueError(f"schedule {spec.schedule} cannot run plan {spec.plan}: {str(e).splitlines()[0]}") from None
    return plan, schedule


def refuse_foreign_layout(cfg: Any, what: str) -> None:
    """One ``ValueError`` when ``cfg`` has a stage layout only dynmb's families build, for a model that is not one
    of them (``what`` names it): the LM head split by vocabulary (``ModelConfig.head_split``; its stages keep the
    head whole) or leading blocks recomputed per stage (``ModelConfig.recompute_blocks``; its stages read none)."""
    if getattr(cfg, "head_split", None) is not None:
        raise ValueError(f"{what}: the LM head split by vocabulary (head_split {list(cfg.head_split)}) runs on "
                         f"dynmb's own model families only; a model of your own keeps its head on the last stage")
    if getattr(cfg, "recompute_blocks", None) is not None:
        raise ValueError(f"{what}: recomputing leading blocks per stage (recompute_blocks {list(cfg.recompute_blocks)}) "
                         f"runs on dynmb's own model families only; a model of your own recomputes whole microbatches "
                         f"(--recompute) or none")


refuse_foreign_head_split = refuse_foreign_layout
"""The older name of ``refuse_foreign_layout``."""


def refuse_offload_with_recompute(offload_blocks: Sequence[int] | None, recompute_blocks: Sequence[int],
                                  what: str) -> None:
    """One ``ValueError`` (``what`` names the plan) when a stage both offloads blocks (``offload_blocks``) and
    recomputes blocks (``ModelConfig.recompute_blocks``, per plan stage): the memory model counts either on a
    stage, not both (a block's saved bytes would be taken off twice)."""
    for stage, (moved, redone) in enumerate(zip(offload_blocks or (), recompute_blocks)):
        if int(moved) and int(redone):
            raise ValueError(f"{what}: stage {stage} both offloads {int(moved)} block(s) to host memory (offload_blocks "
                             f"{[int(b) for b in offload_blocks or ()]}) and recomputes {int(redone)} (recompute_blocks "
                             f"{[int(b) for b in recompute_blocks]}); a stage does one or the other: plan with "
                             "offload='never' or without recompute_blocks there")


def check_device(backend: str, device: str) -> None:
    """Refuse (``ValueError``, one line) a backend and device this machine cannot run: ``nccl`` off
    CUDA, or CUDA where torch sees none (imports torch only for ``cuda``)."""
    if backend == "nccl" and device != "cuda":
        raise ValueError(f"--backend nccl runs on CUDA devices, not {device}; use --device cuda or --backend gloo")
    if device == "cuda":
        from dynmb.runtime.device import cuda_available

        if not cuda_available():
            raise ValueError(f"--device cuda{' (--backend nccl)' if backend == 'nccl' else ''}: CUDA is not "
                             "available here (torch.cuda.is_available() is False); use --device cpu")


def check_writable(folder: str | Path) -> None:
    """Raise ``ValueError`` naming ``folder`` when results cannot be written there: the folder, or the
    nearest existing folder above it, must take a new file. Creates nothing."""
    path = Path(folder).resolve()
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"results folder {path} cannot be made: {existing} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".dynmb-write-check-")
    except OSError as e:
        raise ValueError(f"results folder {path} is not writable: {e.strerror or e}") from None
    os.close(fd)
    os.unlink(probe)
