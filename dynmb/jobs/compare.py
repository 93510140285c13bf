"""The main job: fixed against dynamic microbatching on real pipelines, in one run.

``prepare_compare(settings)`` plans the cases: every method of ``settings.methods`` at its own microbatch
order (``--reorder auto``: ``planning.AUTO_REORDER``), and, for ``fixed`` without a given microbatch size,
extra ``fixed`` cases at 1, 2, 4, ... rows below the largest size that fits every step, to find the best
fixed size in hindsight (``fixed_candidates``), and for ``token-budget`` and ``balanced`` extra cases at
the memory-maximum budget divided by 2, 4, ... (``budget_candidates``; the budget users set is the
method's own case). ``run_compare_job(job)`` runs them all as the cases of ONE torchrun job (one process
per pipeline rank; gloo on CPU, NCCL on CUDA), so the throughputs are measured side by side on the same
machine state. On CPU the cases run round by round (step k of every method, in a fresh random order each
round, seeded by ``order_seed`` and recorded in ``spec.json``, ``verdict.json`` and the steps'
``round_position``; then step k + 1; ``sequential`` for one method after another, as on CUDA), so a burst
of outside load on a shared machine slows every method alike instead of whichever ran during it.
``repeats`` runs the whole job that many times on the same batches (run ids ``...-r<k>``, rows tagged
``repeat``); the paired ratios are then paired within each repeat and the box's repeat noise is measured.
A folder that holds another job's tables is refused (``dynmb.io.outdir.check_fresh``) unless ``append``.
Then it:

1. summarises the measured steps per case (``analysis.summarise``; ``display_summary``
   names the rows: ``fixed (mbs 3)``, ``fixed-best (mbs B)``, ``token-budget-best (cap/4)``,
   ``balanced-best (cap/d)``, ...; each with its gap to its bound and to the batch's ``ideal_s``,
   ``dynmb.timing.bounds``);
2. writes ``summary.csv`` next to the tidy ``steps``/``actions``/``memory``/``runs`` tables (every row of
   which gets a ``case`` column, the summary's name of its case) and ``verdict.json``
   (``compare_table.verdict``: the closest case's ratio, its bootstrap interval, within noise or not, the
   load average while the job ran, the repeat noise, the order seed);
3. plots ``throughput.png`` and measured-vs-predicted Gantt charts for ``fixed`` and
   ``dynamic`` (``gantt_<method>_measured.png`` / ``gantt_<method>_predicted.png``).

``format_summary`` is the printed table under the CSV's column names: tokens/s, dynamic's paired per-step
ratio to every case with its interval, padding, bubble, peak / limit, predicted vs measured step time, a
legend line and the verdict.

Defaults (``dynmb compare``): the sharegpt trace, the ``small`` model, 2 stages, a 1 GiB limit (binding:
``fixed`` can only afford a few rows of the longest sequences), global batches of 32 sequences, each
method's own microbatch order, 1 warm-up + 3 measured steps per method. The cost model is the one fitted
on this kind of CPU and shipped in ``data/costmodels/`` (package data of a wheel) when the model and
stage count match (``planning.default_cost_model_path``), else the analytic stand-in (``cost_model`` for
your own fit).

Real text (``corpus``, ``--corpus FILE --field F``): the corpus is tokenized once into the results
folder's token file (``dynmb.data.prepare_tokens``) before torchrun starts; every case draws the same
global batches from its records and trains on their ids. The torchrun line of one case: ``dynmb.runtime.worker``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import operator
import secrets
import shutil
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pandas as pd

from dynmb.io.atomic import write_text_atomic
from dynmb.io.hostinfo import LoadSampler, usable_cores
from dynmb.io.outdir import check_fresh
from dynmb.report.analysis import repeat_noise, summarise
from dynmb.report.compare_table import (BUDGET_METHODS, FIXED_SIZE_METHODS, BoxState, display_summary, format_summary,
                                        verdict)
from dynmb.core.config import ModelConfig, PlanSpec, RunConfig, format_bytes, model_config, parse_bytes, with_aliases
from dynmb.costmodel.loader import load_models
from dynmb.data import CorpusSource, TokenFile, load_trace, prepare_tokens, sample_batch
from dynmb.planning import default_cost_model_path, plan_step, reorder_for
from dynmb.planning.memory_split import ReliefInputs, relieved_layout
from dynmb.planning.spec_check import uses_pack_len
from dynmb.planning.split_search import SplitSearch
from dynmb.planning.embedding_choice import Placement
from dynmb.planning.stage_split import resolve_stage_split
from dynmb.report.plots import compare_throughput, gantt, predicted_timeline
from dynmb.io.results import TABLES, load_results, set_run_status, tag_runs, write_table
from dynmb.packing import METHODS
from dynmb.runtime.launch import LaunchResult, default_backend_device, launch_job
from dynmb.runtime.spec import JobSpec, RunSpec, check_writable

__all__ = ["CompareSettings", "CompareCase", "CompareJob", "CompareResult", "prepare_compare", "run_compare_job",
           "fixed_candidates", "budget_candidates", "base_model_config", "DEFAULT_LIMIT", "display_summary",
           "format_summary", "case_placement", "trace_lengths", "COLUMNS", "FIXED_SIZE_METHODS", "BUDGET_METHODS"]

COLUMNS = ["tokens_per_s", "x_dynamic", "speedup_vs_fixed", "padding_fraction", "mean_bubble", "peak_over_limit",
           "pred_step_s", "step_s", "pred_err", "step_ratio", "action_ratio", "replay_err", "gap_to_bound", "gap_to_ideal", "plan_s",
           "num_microbatches", "mbs", "distinct_shapes", "new_shapes"]
BUDGET_CANDIDATES = 3
"""The divided budgets run per budget method: those with the smallest predicted step time."""
ALL_METHODS = ("fixed", "sorted", "packed", "token-budget", "balanced", "lockstep", "dynapipe", "dynamic")


DEFAULT_LIMIT = "1GiB"
"""The compare job's memory limit when none is given (it binds for the small model)."""

_TEMPLATE_FIELDS: dict[str, str] = {
    "stages": "spec.num_stages", "virtual": "spec.virtual", "schedule": "spec.schedule_kind",
    "reorder": "spec.reorder", "microbatch_size": "spec.mbs", "oversize": "spec.oversize",
    "slice_fitting": "spec.slice_fitting", "pack_len": "spec.pack_len", "round_to": "spec.round_to",
    "recompute": "spec.recompute", "global_batch": "global_batch", "seed": "seed", "steps": "steps",
    "warmup": "warmup", "device": "device", "cost_model": "cost_model", "prewarm": "prewarm",
    "plan_ahead": "plan_ahead", "expandable_segments": "expandable_segments", "dataset": "dataset",
}
"""The flat keywords ``CompareSettings`` took before it held a template (``dynmb compare``'s flags), and where
each lives in the template; still taken by the constructor and read as properties."""


def _limit_text(limit_bytes: int) -> str:
    """A memory limit as users write it: ``1GiB``, ``24MiB`` (whole units), else ``format_bytes``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if limit_bytes % size == 0:
            return f"{limit_bytes // size}{unit}"
    return format_bytes(limit_bytes)


def base_model_config(model: str, attention: str | None = None) -> ModelConfig:
    """``--model``'s config before its stage split: a preset, a JSON file, or a factory's ``planning_config``."""
    from dynmb.core.contract import names_factory
    if names_factory(model):
        from dynmb.models.contract import planning_config, resolve_model
        return planning_config(resolve_model(model))
    return model_config(model, attention=attention)


def _fold_compare(settings: dict[str, Any]) -> dict[str, Any]:
    """The flat keywords (``_TEMPLATE_FIELDS``, ``memory_limit``, ``lengths``, ``attention``) into the template:
    on top of ``template`` when given, else of the compare defaults (global batch 32, ``DEFAULT_LIMIT``, each
    method's own order, the device: cuda when available). Without a ``template`` (or with ``attention``) the
    template's model is ``model``'s config; a corpus is the template's dataset."""
    flat = {k: settings.pop(k) for k in [*_TEMPLATE_FIELDS, "memory_limit", "lengths", "attention"] if k in settings}
    if "template" in settings and not flat and "model" not in settings:
        return settings
    template = settings.get("template") or RunConfig(global_batch=32, device="cpu", spec=PlanSpec(
        memory_limit_bytes=parse_bytes(DEFAULT_LIMIT), reorder="auto"))
    if "template" not in settings and flat.get("device") is None:
        flat["device"] = default_backend_device()[1]
    corpus = settings.get("corpus")
    flat["dataset"] = (corpus.name if corpus is not None else flat.pop("lengths", None) or flat.get("dataset")
                       or (None if "template" in settings else "sharegpt"))
    flat.pop("lengths", None)
    if "template" not in settings or flat.get("attention") is not None:
        template = template.with_(model=base_model_config(settings.get("model") or "small", flat.get("attention")))
    flat.pop("attention", None)
    if flat.get("memory_limit") is not None:
        flat["memory_limit_bytes"] = parse_bytes(flat["memory_limit"])
    flat.pop("memory_limit", None)
    stages, virtual = flat.get("stages", template.spec.num_stages), flat.get("virtual", template.spec.virtual)
    if virtual < 1 or stages % virtual:
        raise ValueError(f"--stages {stages} is not a multiple of --virtual {virtual}")
    changes = {_TEMPLATE_FIELDS.get(k, k).removeprefix("spec."): v for k, v in flat.items() if v is not None
               or k in ("microbatch_size", "pack_len", "cost_model")}
    if "device" in changes:
        changes["backend"] = "nccl" if changes["device"] == "cuda" else "gloo"
    settings["template"] = template.with_(**changes)
    return settings


@with_aliases(_fold_compare)
@dataclass(frozen=True, kw_only=True)
class CompareSettings:
    """What a comparison runs (the flags of ``dynmb compare``): a ``RunConfig`` template that every case's
    ``RunConfig`` is made from (``template.with_(method=...)``, with the method's own microbatch order, mbs and
    pack length), the methods, and the options of the comparison itself. ``resolved()`` fills the defaults.

    The flat keywords of earlier versions (``stages=``, ``memory_limit="1GiB"``, ``schedule=``, ``dataset=`` /
    ``lengths=``, ``attention=``, ...: ``_TEMPLATE_FIELDS``) are still taken (into the template) and read back as
    properties (``settings.stages``, ``settings.memory_limit``)."""

    template: RunConfig = field(default_factory=lambda: _fold_compare({})["template"])
    """Every case's settings but its method: the model before its stage split (``model_config()`` resolves
    it), the plan spec (stages, virtual, schedule kind, memory limit, the fixed-size methods' ``mbs``, the
    ``packed`` cases' ``pack_len``, round_to, oversize, recompute, slice_fitting; ``reorder`` ``auto``: each
    method's own order, ``planning.reorder_for``), the trace (``dataset``), global batch, seed, steps, warm-up,
    device and backend, cost model, prewarm, plan-ahead, expandable segments."""
    methods: tuple[str, ...] = ALL_METHODS
    """The methods compared (one case each, and the hindsight cases of ``fixed_best``)."""
    model: str = "small"
    """``--model`` as given (a preset, a JSON file, ``package.module:factory``): the shipped cost model is looked
    up by it, and a factory is what every rank builds its stages with."""
    stage_split: str = "even"
    """Layers per stage: even, auto or a list (``dynmb.planning.stage_split``)."""
    corpus: CorpusSource | None = None
    """Real text: the corpus the global batches are drawn from (its token counts are the trace)."""
    memory_model: str | None = None
    allow_over_limit: bool = False
    fixed_best: bool = True
    """Add the fixed cases that find the best fixed microbatch size in hindsight, and the
    token budgets that find the best budget of each ``BUDGET_METHODS`` method."""
    sequential: bool = False
    """Run the cases one after another even on CPU."""
    out: str = "results/compare"
    repeats: int = 1
    """Times the whole job runs on the same batches (each a torchrun job, its own random round order)."""
    order_seed: int | None = None
    """Seed of the rounds' random case order; None: a fresh one (recorded)."""
    append: bool = False
    """Add this job's rows to a folder that holds another job's tables instead of refusing it."""

    @property
    def trace(self) -> str:
        """The trace the global batches are sampled from (a corpus: its name)."""
        return self.corpus.name if self.corpus is not None else self.template.dataset

    @property
    def memory_limit(self) -> str:
        """The memory limit as users write it (``1GiB``)."""
        return _limit_text(self.template.spec.memory_limit_bytes)

    def model_config(self) -> ModelConfig:
        """The model of every case: the template's with the ``stage_split`` over the stages (a model of the
        user's own, ``package.module:factory``: its factory's ``planning_config``, every rank builds it)."""
        if self.model_factory is not None:
            return self.template.model
        spec = self.template.spec
        workload = None if self.corpus is not None else self.trace
        cfg = _split_model(self.template.model, spec.num_stages, self.stage_split, workload, self.template.cost_model,
                           self._split_search() if self.stage_split == "auto" else None, int(spec.virtual))
        if self.stage_split != "auto":
            return cfg
        relief = ReliefInputs(memory_limit_bytes=spec.memory_limit_bytes, schedule_kind=spec.schedule_kind,
                              workload=workload, cost_model=self.template.cost_model,   # memory in the split,
                              embedding=spec.embedding)                                  # weighed for its place
        return _relieved(cfg, spec.num_stages, relief, int(spec.virtual), self.memory_model)

    def _split_search(self) -> SplitSearch | None:
        """What ``--stage-split auto`` chooses by: dynamic's settings here; None where no plan can be made."""
        spec = self.template.plan_spec
        kind = "interleaved" if spec.virtual > 1 and spec.schedule_kind == "1f1b" else spec.schedule_kind
        fields = {k: v for k, v in spec.with_(schedule_kind=kind).to_dict().items() if k not in ("mbs", "pack_len")}
        return SplitSearch.of(fields, self.template.global_batch, seed=self.template.seed,
                              memory_model=self.memory_model)

    @property
    def model_factory(self) -> str | None:
        """``model`` when it names a model of the user's own (``package.module:factory``), else None."""
        from dynmb.core.contract import names_factory
        return self.model if names_factory(self.model) else None

    def case_config(self, method: str, microbatch_size: int | None = None) -> RunConfig:
        """The ``RunConfig`` of one case: the template with ``method``, its order (``reorder_for``), its mbs
        (``microbatch_size``, else the template's for the fixed-size methods) and its pack length (the methods
        that build rows of it, ``planning.spec_check.uses_pack_len``; the other cases never get it)."""
        spec = self.template.spec
        if microbatch_size is None and method in FIXED_SIZE_METHODS:
            microbatch_size = spec.mbs
        return self.template.with_(model=self.model_config(), method=method, mbs=microbatch_size,
                                   reorder=reorder_for(method, spec.reorder),
                                   pack_len=spec.pack_len if uses_pack_len(method) else None)

    def resolved(self) -> CompareSettings:
        """Defaults filled: the interleaved schedule for ``virtual`` > 1, the shipped cost model, the order
        seed. Raises ``ValueError`` on a bad ``repeats``."""
        spec, template = self.template.spec, self.template
        if spec.virtual > 1 and spec.schedule_kind == "1f1b":
            template = template.with_(schedule_kind="interleaved")
        cost_model = template.cost_model or default_cost_model_path(self.model, spec.num_stages, template.device)
        if self.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {self.repeats}")
        order_seed = secrets.randbits(31) if self.order_seed is None else int(self.order_seed)
        return replace(self, template=template.with_(cost_model=cost_model), order_seed=order_seed)


for _name, _path in _TEMPLATE_FIELDS.items():       # the flat names of earlier versions, read from the template
    setattr(CompareSettings, _name, property(operator.attrgetter(f"template.{_path}"),
                                             doc=f"``template.{_path}`` (the older flat name)."))


@dataclass(frozen=True)
class CompareCase:
    """One case of the job: a method at a microbatch size, under a display label."""

    label: str
    method: str
    microbatch_size: int | None
    spec: RunSpec


@dataclass(frozen=True)
class CompareJob:
    """The planned comparison: resolved settings and the cases of its torchrun job."""

    settings: CompareSettings
    cases: tuple[CompareCase, ...]
    nproc: int
    backend: str
    created_out: bool = False
    """``prepare_compare`` made the results folder: a job refused before torchrun started removes it."""

    @property
    def interleave(self) -> bool:
        return self.settings.template.device == "cpu" and not self.settings.sequential

    @property
    def out_dir(self) -> Path:
        return Path(self.settings.out)

    def job_spec(self, repeat: int = 0) -> JobSpec:
        """The torchrun job of repeat ``repeat``: run ids ``<id>-r<repeat>`` after the first, the order seed + repeat."""
        cases = tuple(c.spec if repeat == 0 else replace(c.spec, run_id=f"{c.spec.run_id}-r{repeat}") for c in self.cases)
        seed = None if self.settings.order_seed is None else self.settings.order_seed + repeat
        return JobSpec(out_dir=str(self.out_dir.resolve()), cases=cases, interleave=self.interleave, order_seed=seed)


@dataclass
class CompareResult:
    """What a comparison produced."""

    returncode: int
    """0: every case ran (a peak over the limit is in ``over_limit``, not here); 130 / 143:
    stopped by SIGINT / SIGTERM (``launch.interrupted``)."""
    failures: tuple[str, ...] = ()
    """The launcher's lines on the failed ranks."""
    wall_s: float = 0.0
    summary: pd.DataFrame | None = None
    """``display_summary``'s table (case names in the index)."""
    files: list[str] = field(default_factory=list)
    """The PNG files written next to the tables."""
    launch: LaunchResult | None = None
    """The launcher's result (signal, stopped workers, complete steps)."""
    box: BoxState | None = None
    """The machine's load and repeat noise while the job ran (the verdict's context)."""

    @property
    def over_limit(self) -> list[str]:
        """Cases whose measured peak exceeded the limit."""
        if self.summary is None or "peak_over_limit" not in self.summary:
            return []
        return list(self.summary.index[self.summary["peak_over_limit"] > 1])


@functools.lru_cache(maxsize=8)
def _split_model(model: ModelConfig, stages: int, split: str, workload: str | None,
                 cost_model: str | None, search: SplitSearch | None, virtual: int = 1) -> ModelConfig:
    """``resolve_stage_split`` once per settings (every case reads it; the split search plans batches)."""
    return resolve_stage_split(model, stages, split, workload=workload, cost_model=cost_model, search=search,
                               virtual=virtual)


@functools.lru_cache(maxsize=8)
def _relieved(cfg: ModelConfig, stages: int, relief: ReliefInputs, virtual: int, memory_model: str | None) -> ModelConfig:
    """``memory_split.relieved_layout`` once per settings (as ``Planner`` resolves ``stage_split="auto"``)."""
    return relieved_layout(cfg, stages, relief, virtual=virtual, memory_model=memory_model)[0]


def _case_config(settings: CompareSettings, method: str, microbatch_size: int | None = None) -> RunConfig:
    """The ``RunConfig`` of one case (``CompareSettings.case_config``; the worker plans each step with its
    ``plan_spec``)."""
    return settings.case_config(method, microbatch_size)


def _plan_kwargs(settings: CompareSettings, method: str, microbatch_size: int | None = None) -> dict[str, Any]:
    """``plan_step`` arguments of one case, the spec from its ``RunConfig``: what the worker plans with."""
    run = _case_config(settings, method, microbatch_size)
    models = load_models(run.model, run.spec.num_stages, cost=run.cost_model, memory=settings.memory_model,
                         device=run.device, virtual=run.spec.virtual)         # the one loader, as the ranks'
    return dict(spec=run.plan_spec, model_cfg=run.model, models=models)


def _token_file(settings: CompareSettings) -> TokenFile | None:
    """The corpus's token file in the results folder (written once; the vocabulary checked first)."""
    if settings.corpus is None:
        return None
    model = settings.model_config()
    return prepare_tokens(settings.corpus, settings.out, vocab_size=model.vocab_size, model_name=model.name,
                          max_len=model.max_seq_len if settings.template.spec.oversize == "error" else None)   # a record no row holds


def case_placement(settings: CompareSettings, method: str) -> Placement:
    """One case's settings, layout (its embedding's place) and models: what ``compare --embedding auto`` weighs."""
    return Placement(**_plan_kwargs(settings, method))


def trace_lengths(settings: CompareSettings) -> np.ndarray:
    """The lengths the global batches are drawn from: the trace, or the corpus's token counts."""
    tokens = _token_file(settings)
    return load_trace(settings.trace) if tokens is None else tokens.load().lengths


def fixed_candidates(settings: CompareSettings) -> tuple[list[int], list[int]]:
    """``(automatic microbatch size of each step, candidates)`` for the best fixed size in
    hindsight: 1, 2, 4, ... below the smallest automatic size (the largest that fits) of the
    run's steps, so that every candidate fits every step."""
    trace = trace_lengths(settings)
    kwargs = _plan_kwargs(settings, "fixed")
    kwargs["spec"] = kwargs["spec"].with_(mbs=None, reorder="none")
    run = settings.template
    auto = [int(plan_step(sample_batch(trace, run.global_batch, run.seed, step=k), **kwargs)[0].meta["mbs"])
            for k in range(run.warmup + run.steps)]
    return auto, [1 << i for i in range(12) if (1 << i) < min(auto)]


def budget_candidates(settings: CompareSettings, method: str) -> list[int]:
    """Divisors d = 2, 4, ... of ``method``'s memory-maximum token budget (the budgets cap / d)
    for the best budget in hindsight: every d until the plans of the run's steps stop changing
    their microbatch count, then the ``BUDGET_CANDIDATES`` whose predicted steps (summed over the
    run's steps) are shortest, in increasing d. Measured like ``fixed-best``: the fastest case wins."""
    trace = trace_lengths(settings)
    kwargs = _plan_kwargs(settings, method)
    run = settings.template
    batches = [sample_batch(trace, run.global_batch, run.seed, step=k) for k in range(run.warmup + run.steps)]
    scored, last = [], None
    for j in range(1, 12):
        plans = [plan_step(b, **{**kwargs, "spec": kwargs["spec"].with_(mbs=1 << j)})[0] for b in batches]
        counts = [p.num_microbatches for p in plans]
        if counts == last:
            break
        last = counts
        scored.append((sum(float(p.predictions["pred_step_s"]) for p in plans), 1 << j))
    return sorted(d for _, d in sorted(scored)[:BUDGET_CANDIDATES])


def prepare_compare(settings: CompareSettings) -> CompareJob:
    """Resolve ``settings``, create the output folder and plan the cases (see the module docstring).
    Unknown methods, an unwritable folder, and every case's settings that ``dynmb plan`` would refuse
    or this machine cannot run (``RunSpec.check_settings``) are refused first (``ValueError``, one
    line), before the folder is made; the launcher checks the rest before torchrun starts."""
    unknown = [m for m in settings.methods if m not in METHODS]
    if unknown or not settings.methods:
        raise ValueError(f"unknown method(s) {unknown or '(none given)'}; expected some of {', '.join(METHODS)}")
    check_writable(settings.out)
    check_fresh(settings.out, settings.append)
    settings = settings.resolved()
    for method in settings.methods:       # what `dynmb plan` refuses, and the device: before anything is written
        RunSpec.create(_case_config(settings, method), settings.out).check_settings()
    if settings.corpus is None:
        load_trace(settings.trace)        # a bad trace is one line naming it, before the folder is made
    backend = settings.template.backend
    out = Path(settings.out)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    with _removed_on_refusal(out, created):
        return _plan_cases(settings, out, backend, created)


@contextlib.contextmanager
def _removed_on_refusal(out: Path, created: bool) -> Iterator[None]:
    """Remove ``out`` (made by this job) when a refusal (``ValueError``, ``OSError``) leaves it without tables."""
    try:
        yield
    except (ValueError, OSError):
        if created and not any((out / f"{t}.csv").exists() for t in TABLES):
            shutil.rmtree(out, ignore_errors=True)
        raise


def _plan_cases(settings: CompareSettings, out: Path, backend: str, created: bool) -> CompareJob:
    """``prepare_compare`` once the folder exists: the token file and every case's spec."""
    tag = uuid.uuid4().hex[:6]
    tokens = _token_file(settings)
    runs: list[tuple[str, str, int | None]] = [
        (m, m, settings.template.spec.mbs if m in FIXED_SIZE_METHODS else None) for m in settings.methods]
    if "fixed" in settings.methods and settings.template.spec.mbs is None and settings.fixed_best:
        _, candidates = fixed_candidates(settings)
        runs += [(f"fixed mbs={size}", "fixed", size) for size in candidates]
    for method in (m for m in BUDGET_METHODS if m in settings.methods and settings.fixed_best):
        runs += [(f"{method} div={d}", method, d) for d in budget_candidates(settings, method)]
    cases = []
    for label, method, size in runs:
        cfg = _case_config(settings, method, size)
        spec = RunSpec.create(cfg, out, run_id=f"{label.replace(' ', '-').replace('=', '')}-{tag}", label=label,
                              memory_model=settings.memory_model, allow_over_limit=settings.allow_over_limit,
                              corpus=tokens, model_factory=settings.model_factory)
        cases.append(CompareCase(label, method, size, spec))
    return CompareJob(settings, tuple(cases), nproc=settings.template.spec.num_ranks, backend=backend,
                      created_out=created)


def _gantts(job: CompareJob, steps: pd.DataFrame, actions: pd.DataFrame, method: str) -> list[str]:
    """Measured and predicted timelines of the first measured step of ``method`` (its main case), on one x
    scale: the predicted one is the plan that ran, its actions at the predictions they were planned with
    (``predicted_timeline``), titled with the step's recorded ``pred_step_s``."""
    settings, out = job.settings, job.out_dir
    measured = steps[(steps["label"] == method) & (~steps["warmup"].astype(bool))]
    if measured.empty:
        return []
    row = measured.iloc[0]
    run_id, k = row["run_id"], int(row["step"])
    timeline = actions[(actions["run_id"] == run_id) & (actions["step"] == k)]
    shapes = timeline.drop_duplicates("mb").sort_values("mb")
    comm = _plan_kwargs(settings, method)["models"].cost.comm_s(shapes["batch"].to_numpy(), shapes["padded_len"].to_numpy())
    predicted = predicted_timeline(timeline, comm)
    span = max(float(timeline["end_s"].max() - timeline["start_s"].min()), float(predicted["end_s"].max()))
    n = int(row["num_microbatches"])
    return [gantt(timeline, str(out / f"gantt_{method}_measured.png"), span_s=span,
                  title=f"{method}: measured step {k} ({row['step_s']:.2f} s, {n} microbatches)"),
            gantt(predicted, str(out / f"gantt_{method}_predicted.png"), span_s=span,
                  title=f"{method}: predicted step {k} ({float(row['pred_step_s']):.2f} s as planned, "
                        f"{n} microbatches)")]


def run_compare_job(job: CompareJob, *, quiet: bool = True, progress: bool = True) -> CompareResult:
    """Run the job's cases in one torchrun job per repeat, then summarise, write ``summary.csv`` and
    ``verdict.json``, and plot."""
    out = job.out_dir
    t0 = time.perf_counter()
    ids: dict[str, int] = {}
    with LoadSampler() as load:
        for repeat in range(job.settings.repeats):
            spec = job.job_spec(repeat)
            with _removed_on_refusal(out, job.created_out and repeat == 0):   # refused before torchrun started
                launched = launch_job(spec, job.nproc, quiet=quiet, progress=progress)
            if not launched.ok:
                return CompareResult(launched.returncode, launched.failures, time.perf_counter() - t0,
                                     launch=launched)
            ids.update({c.run_id: repeat for c in spec.cases})
            tag_runs(out, {rid: {"repeat": r} for rid, r in ids.items() if r == repeat})
    box = BoxState(load.peak, load.mean, usable_cores(), float("nan"), job.settings.repeats, job.settings.order_seed,
                   job_ranks=job.nproc)
    try:
        return _summarise_job(job, launched, time.perf_counter() - t0, ids, box)
    except OSError as e:        # ENOSPC writing summary.csv or a plot: the runs are not left saying ok
        with contextlib.suppress(OSError, ValueError):
            set_run_status(out, ids, "failed", f"compare could not write its summary: {e}", keep=())
        raise


def _case_names(summary: pd.DataFrame, steps: pd.DataFrame) -> dict[str, dict[str, str]]:
    """Run id -> ``{"case": the summary's name of its case}`` (the ``-best`` rows repeat a case: not used)."""
    names = {str(row["label"]): str(case) for case, row in summary.iterrows() if "-best" not in str(case)}
    first = steps.drop_duplicates("run_id")
    return {str(r): {"case": names.get(str(lb), str(lb))} for r, lb in zip(first["run_id"], first["label"])}


def _summarise_job(job: CompareJob, launched: LaunchResult, wall_s: float, ids: dict[str, int],
                   box: BoxState) -> CompareResult:
    """``run_compare_job`` after its torchrun jobs ended well: the summary table, the verdict and the plots."""
    settings, out = job.settings, job.out_dir
    tables = load_results(out)
    tables = {k: (v[v["run_id"].isin(set(ids))] if "run_id" in v.columns else v) for k, v in tables.items()}
    summary = display_summary(summarise(tables), [c.label for c in job.cases])
    tag_runs(out, _case_names(summary, tables["steps"]))
    box = replace(box, repeat_noise=repeat_noise(tables["steps"]))
    write_table(summary.reset_index(), out / "summary.csv")
    found = verdict(summary, box)
    write_text_atomic(out / "verdict.json", json.dumps(found.to_dict() if found else {"box": box.__dict__},
                                                       indent=1, default=str))
    title = (f"{settings.trace}, {settings.model}, {settings.template.spec.num_stages} stages, "
             f"limit {settings.memory_limit}")
    files = [Path(p).name for p in compare_throughput(summary, str(out / "throughput.png"), title=title)]
    for method in ("fixed", "dynamic"):
        if method in settings.methods:
            files += [Path(p).name for p in _gantts(job, tables["steps"], tables["actions"], method)]
    return CompareResult(0, (), wall_s, summary, files, launch=launched, box=box)
