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
from dynmb.core.config import ModelConfig, PipelineConfig, RunConfig, model_config, parse_bytes
from dynmb.costmodel.loader import load_models
from dynmb.data import CorpusSource, TokenFile, load_trace, prepare_tokens, sample_batch
from dynmb.planning import default_cost_model_path, plan_step, reorder_for
from dynmb.planning.spec_check import uses_pack_len
from dynmb.planning.split_search import SplitSearch
from dynmb.planning.stage_split import resolve_stage_split
from dynmb.report.plots import compare_throughput, gantt, predicted_timeline
from dynmb.io.results import TABLES, load_results, set_run_status, tag_runs, write_table
from dynmb.packing import METHODS
from dynmb.runtime.launch import LaunchResult, default_backend_device, launch_job
from dynmb.runtime.spec import JobSpec, RunSpec, check_writable

__all__ = ["CompareSettings", "CompareCase", "CompareJob", "CompareResult", "prepare_compare", "run_compare_job",
           "fixed_candidates", "budget_candidates", "display_summary", "format_summary", "COLUMNS",
           "FIXED_SIZE_METHODS", "BUDGET_METHODS"]

COLUMNS = ["tokens_per_s", "x_dynamic", "speedup_vs_fixed", "padding_fraction", "mean_bubble", "peak_over_limit",
           "pred_step_s", "step_s", "pred_err", "step_ratio", "action_ratio", "replay_err", "gap_to_bound", "gap_to_ideal", "plan_s",
           "num_microbatches", "mbs", "distinct_shapes", "new_shapes"]
BUDGET_CANDIDATES = 3
"""The divided budgets run per budget method: those with the smallest predicted step time."""
ALL_METHODS = ("fixed", "sorted", "packed", "token-budget", "balanced", "lockstep", "dynapipe", "dynamic")


@dataclass(frozen=True, kw_only=True)
class CompareSettings:
    """What a comparison runs (the flags of ``dynmb compare``); ``resolved()`` fills the defaults."""

    dataset: str | None = None
    """Shipped trace name (default sharegpt when ``lengths`` is not given either)."""
    lengths: str | None = None
    """A length-trace CSV instead of a shipped trace."""
    corpus: CorpusSource | None = None
    """Real text: the corpus the global batches are drawn from (its token counts are the trace)."""
    global_batch: int = 32
    seed: int = 0
    stages: int = 2
    memory_limit: str | None = None
    """Per-GPU memory limit, e.g. ``1GiB`` (the default)."""
    methods: tuple[str, ...] = ALL_METHODS
    microbatch_size: int | None = None
    """Rows per microbatch of the fixed-size methods; None: the largest that fits."""
    oversize: str = "error"
    slice_fitting: str = "never"
    """Slice sequences that fit too: never or auto (``dynmb.planning.slice_fitting``)."""
    pack_len: int | None = None
    """Row length of the ``packed`` cases (the methods that build rows of it,
    ``planning.spec_check.uses_pack_len``); the other cases never get it."""
    round_to: int = 1
    recompute: str = "never"
    """Per-microbatch activation recomputation: never, always or auto (``dynmb.packing.recompute``)."""
    prewarm: bool = False
    plan_ahead: int = 0
    """Planner processes per rank planning ahead of training (``dynmb.runtime.planahead``)."""
    expandable_segments: bool = True
    schedule: str = "1f1b"
    virtual: int = 1
    """Model chunks per rank; > 1 runs the interleaved schedule on stages / virtual ranks."""
    device: str | None = None
    """cpu or cuda; None: cuda when available."""
    memory_model: str | None = None
    allow_over_limit: bool = False
    reorder: str = "auto"
    steps: int = 3
    warmup: int = 1
    fixed_best: bool = True
    """Add the fixed cases that find the best fixed microbatch size in hindsight, and the
    token budgets that find the best budget of each ``BUDGET_METHODS`` method."""
    sequential: bool = False
    """Run the cases one after another even on CPU."""
    cost_model: str | None = None
    """Fitted cost-model JSON; None: the shipped one for this model, stages and device, if any."""
    model: str = "small"
    attention: str | None = None
    stage_split: str = "even"
    """Layers per stage: even, auto or a list (``dynmb.planning.stage_split``)."""
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
        return self.corpus.name if self.corpus is not None else self.lengths or self.dataset or "sharegpt"

    def model_config(self) -> ModelConfig:
        """The model of every case: ``model`` with ``attention`` and the ``stage_split`` over ``stages``
        (``package.module:factory``: its factory's ``planning_config``, every rank builds it)."""
        if self.model_factory is not None:
            from dynmb.models.contract import planning_config, resolve_model
            return planning_config(resolve_model(self.model_factory))
        return _split_model(self.model, self.attention, self.stages, self.stage_split,
                            None if self.corpus is not None else self.trace, self.cost_model,
                            self._split_search() if self.stage_split == "auto" else None, int(self.virtual))

    def _split_search(self) -> SplitSearch | None:
        """What ``--stage-split auto`` chooses by: dynamic's settings here; None where no plan can be made."""
        try:
            limit, cfg = parse_bytes(self.memory_limit or "1GiB"), model_config(self.model, attention=self.attention)
        except ValueError:
            return None
        kind = "interleaved" if self.virtual > 1 and self.schedule == "1f1b" else self.schedule
        fields = dict(num_stages=self.stages, virtual=self.virtual, schedule_kind=kind, reorder=self.reorder,
                      round_to=self.round_to, memory_limit_bytes=limit, oversize=self.oversize,
                      slice_fitting=self.slice_fitting,
                      recompute=self.recompute, attention=cfg.attention)
        return SplitSearch.of(fields, self.global_batch, seed=self.seed, memory_model=self.memory_model)

    @property
    def model_factory(self) -> str | None:
        """``model`` when it names a model of the user's own (``package.module:factory``), else None."""
        from dynmb.core.contract import names_factory
        return self.model if names_factory(self.model) else None

    def resolved(self) -> CompareSettings:
        """Defaults filled: trace, limit, device, the interleaved schedule for ``virtual`` > 1,
        the shipped cost model. Raises ``ValueError`` when stages do not spread over ranks."""
        device = self.device or default_backend_device()[1]
        schedule = "interleaved" if self.virtual > 1 and self.schedule == "1f1b" else self.schedule
        if self.stages % self.virtual:
            raise ValueError(f"--stages {self.stages} is not a multiple of --virtual {self.virtual}")
        dataset = "sharegpt" if self.dataset is None and self.lengths is None and self.corpus is None else self.dataset
        cost_model = self.cost_model or default_cost_model_path(self.model, self.stages, device)
        if self.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {self.repeats}")
        order_seed = secrets.randbits(31) if self.order_seed is None else int(self.order_seed)
        return replace(self, dataset=dataset, memory_limit=self.memory_limit or "1GiB", device=device,
                       schedule=schedule, cost_model=cost_model, order_seed=order_seed)


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
        return self.settings.device == "cpu" and not self.settings.sequential

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
def _split_model(model: str, attention: str | None, stages: int, split: str, workload: str | None,
                 cost_model: str | None, search: SplitSearch | None, virtual: int = 1) -> ModelConfig:
    """``resolve_stage_split`` once per settings (every case reads it; the split search plans batches)."""
    return resolve_stage_split(model_config(model, attention=attention), stages, split, workload=workload,
                               cost_model=cost_model, search=search, virtual=virtual)


def _case_config(settings: CompareSettings, method: str, microbatch_size: int | None = None) -> RunConfig:
    """The ``RunConfig`` of one case (the worker plans each step with its ``plan_spec``)."""
    if microbatch_size is None and method in FIXED_SIZE_METHODS:
        microbatch_size = settings.microbatch_size
    device = settings.device or "cpu"
    return RunConfig(model=settings.model_config(),
                     pipeline=PipelineConfig(num_stages=settings.stages, virtual=settings.virtual,
                                             schedule=settings.schedule,
                                             memory_limit_bytes=parse_bytes(settings.memory_limit or "1GiB"),
                                             reorder=reorder_for(method, settings.reorder)),
                     dataset=settings.trace, global_batch=settings.global_batch, method=method, mbs=microbatch_size,
                     seed=settings.seed, steps=settings.steps, warmup=settings.warmup,
                     backend="nccl" if device == "cuda" else "gloo", device=device, cost_model=settings.cost_model,
                     oversize=settings.oversize, slice_fitting=settings.slice_fitting,
                     pack_len=settings.pack_len if uses_pack_len(method) else None, round_to=settings.round_to,
                     prewarm=settings.prewarm, recompute=settings.recompute, plan_ahead=settings.plan_ahead,
                     expandable_segments=settings.expandable_segments)


def _plan_kwargs(settings: CompareSettings, method: str, microbatch_size: int | None = None) -> dict[str, Any]:
    """``plan_step`` arguments of one case, the spec from its ``RunConfig``: what the worker plans with."""
    run = _case_config(settings, method, microbatch_size)
    models = load_models(run.model, settings.stages, cost=settings.cost_model, memory=settings.memory_model,
                         device=run.device, virtual=settings.virtual)         # the one loader, as the ranks'
    return dict(spec=run.plan_spec, model_cfg=run.model, cost_model=models.cost, memory_model=models.memory)


def _token_file(settings: CompareSettings) -> TokenFile | None:
    """The corpus's token file in the results folder (written once; the vocabulary checked first)."""
    if settings.corpus is None:
        return None
    model = settings.model_config()
    return prepare_tokens(settings.corpus, settings.out, vocab_size=model.vocab_size, model_name=model.name,
                          max_len=model.max_seq_len if settings.oversize == "error" else None)   # a record no row holds


def _trace_lengths(settings: CompareSettings) -> np.ndarray:
    """The lengths the global batches are drawn from: the trace, or the corpus's token counts."""
    tokens = _token_file(settings)
    return load_trace(settings.trace) if tokens is None else tokens.load().lengths


def fixed_candidates(settings: CompareSettings) -> tuple[list[int], list[int]]:
    """``(automatic microbatch size of each step, candidates)`` for the best fixed size in
    hindsight: 1, 2, 4, ... below the smallest automatic size (the largest that fits) of the
    run's steps, so that every candidate fits every step."""
    trace = _trace_lengths(settings)
    kwargs = _plan_kwargs(settings, "fixed")
    kwargs["spec"] = kwargs["spec"].with_(mbs=None, reorder="none")
    auto = [int(plan_step(sample_batch(trace, settings.global_batch, settings.seed, step=k), **kwargs)[0].meta["mbs"])
            for k in range(settings.warmup + settings.steps)]
    return auto, [1 << i for i in range(12) if (1 << i) < min(auto)]


def budget_candidates(settings: CompareSettings, method: str) -> list[int]:
    """Divisors d = 2, 4, ... of ``method``'s memory-maximum token budget (the budgets cap / d)
    for the best budget in hindsight: every d until the plans of the run's steps stop changing
    their microbatch count, then the ``BUDGET_CANDIDATES`` whose predicted steps (summed over the
    run's steps) are shortest, in increasing d. Measured like ``fixed-best``: the fastest case wins."""
    trace = _trace_lengths(settings)
    kwargs = _plan_kwargs(settings, method)
    batches = [sample_batch(trace, settings.global_batch, settings.seed, step=k)
               for k in range(settings.warmup + settings.steps)]
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
    device = settings.device or "cpu"
    backend = "nccl" if device == "cuda" else "gloo"
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
        (m, m, settings.microbatch_size if m in FIXED_SIZE_METHODS else None) for m in settings.methods]
    if "fixed" in settings.methods and settings.microbatch_size is None and settings.fixed_best:
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
    return CompareJob(settings, tuple(cases), nproc=settings.stages // settings.virtual, backend=backend,
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
    comm = _plan_kwargs(settings, method)["cost_model"].comm_s(shapes["batch"].to_numpy(), shapes["padded_len"].to_numpy())
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
    title = f"{settings.trace}, {settings.model}, {settings.stages} stages, limit {settings.memory_limit}"
    files = [Path(p).name for p in compare_throughput(summary, str(out / "throughput.png"), title=title)]
    for method in ("fixed", "dynamic"):
        if method in settings.methods:
            files += [Path(p).name for p in _gantts(job, tables["steps"], tables["actions"], method)]
    return CompareResult(0, (), wall_s, summary, files, launch=launched, box=box)
