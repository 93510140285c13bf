"""``dynmb run``: one run on a real torch.distributed pipeline, launched through torchrun
(``dynmb.runtime.launch``); prints a one-line summary of this run's measured steps.

Two ways to say what runs: the data and packing flags (every step plans a new global batch),
or ``--plan P.json [--schedule S.csv]`` (every step runs exactly that plan, ``--steps``
repetitions, no re-planning; model, stages, limit, method, dp and global batch come from the
plan, a conflicting flag is refused, and a schedule whose sidecar names another plan is
refused before anything starts). ``--corpus FILE --field F [--tokenizer T]`` trains on real
text: the corpus is tokenized once, here, into ``OUT/tokens/<key>.npz`` (``dynmb.data.tokens``;
the tokenizer's vocabulary is checked against the model's first), the global batches are drawn
from its records and every rank reads their ids from that file. Everything checkable without
torch is checked before the torch import and torchrun (``JobSpec.check``): a typo costs one
line and exit 2, and writes nothing (a corpus run: nothing but its token file). Ctrl-C / SIGTERM stop torchrun and its workers (exit 130 / 143, one line saying
which steps the tables hold). ``--model package.module:factory`` runs a model of the user's own:
the spec records the string (``RunSpec.model_factory``) and every rank builds its stages with it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any


from dynmb.cli.outcome import run_summary, stop_line
from dynmb.cli.flags import (add_data_flags, add_model_flags, add_packing_flags, add_run_shape_flags, corpus_source,
                             model_from_args, names_factory, nonnegative_int, positive_int, spec_from_flags,
                             virtual_arg, warn_own_model_stand_ins, with_virtual_choice, embedding_pending,
                             with_embedding_choice, workload_of)
from dynmb.cli.planfile import plan_model, plan_pack_len, recorded_model_file, refuse_split_conflict
from dynmb.cli.schedule import check_schedule_plan, sidecar_path
from dynmb.core.config import ModelConfig, RunConfig, parse_bytes
from dynmb.data import TokenFile, prepare_tokens
from dynmb.io.outdir import check_fresh
from dynmb.planning.embedding_choice import Workload
from dynmb.planning.virtual_search import describe
from dynmb.runtime.api import run_job
from dynmb.runtime.checkpoint import check_resume
from dynmb.runtime.launch import default_backend_device
from dynmb.runtime.spec import JobSpec, RunSpec, check_writable
from dynmb.schedule import SCHEDULE_KINDS
from dynmb.schedule.kinds import is_schedule_name
from dynmb.core.types import Plan

__all__ = ["add_parser", "run", "run_config", "DEFAULTS"]

DEFAULTS: dict[str, Any] = dict(stages=2, memory_limit="1GiB", method="dynamic", dp=1, schedule="1f1b",
                                global_batch=64, seed=0, round_to=1, oversize="error", recompute="never",
                                reorder="none", model="small", virtual=1, slice_fitting="never")
"""The defaults of the flags whose parser default is None (None: not given, so a ``--plan``
run can tell a flag that conflicts with the plan from one left alone)."""


def add_parser(subparsers: argparse._SubParsersAction, help_text: str) -> None:
    parser = subparsers.add_parser("run", help=help_text)
    add_data_flags(parser, corpus=True)
    add_packing_flags(parser, schedule_default=None, schedule_help=(
        "schedule kind: gpipe, 1f1b, interleaved, memory-aware, zb-h1, zb, or auto (per step, the fastest predicted "
        "of 1f1b / zb-h1 / zb, interleaved with --virtual > 1) (default 1f1b); with --plan also a schedule CSV built "
        "for that plan (`dynmb schedule`)"))
    add_model_flags(parser)
    parser.add_argument("--plan", default=None,
                        help="run exactly this plan JSON (`dynmb plan` / `dynmb schedule`) every step, without "
                             "re-planning; model, stages, limit, method, dp and global batch come from the plan")
    parser.add_argument("--nproc", type=positive_int, default=None, help="processes (ranks); default stages x dp / virtual (--virtual auto: stages x dp)")
    parser.add_argument("--virtual", type=virtual_arg, default=None,
                        help="model chunks per rank for interleaved (default 1; --stages counts chunks), or auto: "
                             "--stages counts the ranks of one pipeline and V (1, 2 or 4) is chosen once, before "
                             "any process starts, by simulated step on sample batches, as Planner(virtual='auto') "
                             "does (needs a layout-free --cost-model and --schedule auto or interleaved; else V 1, "
                             "said once); the runs table's virtual_choice says how")
    parser.add_argument("--reorder", default=None, help="microbatch reordering (default none)")
    parser.add_argument("--steps", type=positive_int, default=3, help="measured steps (default 3)")
    parser.add_argument("--warmup", type=nonnegative_int, default=1, help="warm-up steps (default 1)")
    parser.add_argument("--backend", default=None, choices=["gloo", "nccl"],
                        help="gloo or nccl (default: nccl with CUDA, else gloo)")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"],
                        help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="process-group / P2P timeout in seconds (default 120)")
    parser.add_argument("--verify", action="store_true",
                        help="check each step's gradients against a single-process reference")
    parser.add_argument("--shard", action="store_true",
                        help="FSDP2 over the --dp replicas: each rank keeps 1/dp of its stages' weights, gradients "
                             "and Adam states between steps (gathered once per step); gradients are summed; the steps "
                             "are planned with the states sharded over --dp (PlanSpec.state_shards); a --plan made "
                             "with --state-shards N runs only with --shard over N or more")
    parser.add_argument("--allow-over-limit", action="store_true",
                        help="report a measured peak over the limit instead of failing")
    add_run_shape_flags(parser)
    parser.add_argument("--checkpoint", default=None, metavar="DIR",
                        help="save torch.distributed.checkpoint checkpoints (weights, Adam) in DIR/step-<k> after the "
                             "last step and every --checkpoint-every steps; they load at any --stages / --dp")
    parser.add_argument("--checkpoint-every", type=nonnegative_int, default=0, metavar="N",
                        help="optimizer steps between checkpoints (default 0: after the last step only)")
    parser.add_argument("--resume", default=None, metavar="PATH",
                        help="start from this checkpoint (a step-<k> folder, or a --checkpoint folder: its latest) "
                             "at this run's layout; the run goes on from step k to --warmup + --steps")
    parser.add_argument("--out", required=True,
                        help="results folder (tables steps/actions/memory/runs); one holding another job's tables "
                             "is refused unless --append")
    parser.add_argument("--append", action="store_true",
                        help="add this run's rows (a new run_id) to a results folder that already holds tables")
    # None = not given (see DEFAULTS); the help texts above state the defaults
    parser.set_defaults(func=run, **{k: None for k in DEFAULTS if k not in ("schedule", "virtual", "reorder")},
                        stage_split=None)


def _arg(args: argparse.Namespace, name: str) -> Any:
    value = getattr(args, name, None)
    return DEFAULTS[name] if value is None else value


def _flag_backend_device(args: argparse.Namespace) -> tuple[str, str] | None:
    """The backend and device the flags give (None when neither ``--device`` nor ``--backend``)."""
    if args.device is not None:
        return args.backend or ("nccl" if args.device == "cuda" else "gloo"), args.device
    if args.backend is not None:
        return args.backend, "cuda" if args.backend == "nccl" else "cpu"
    return None


def run_config(args: argparse.Namespace, backend: str = "gloo", device: str = "cpu") -> RunConfig:
    """The RunConfig of the flags (a run that plans every step)."""
    if args.schedule is not None and not is_schedule_name(args.schedule) and (
            args.schedule.endswith(".csv") or Path(args.schedule).exists()):
        raise ValueError(f"--schedule {args.schedule} is a schedule file: it runs only with the plan it was built "
                         "for (--plan)")
    model = model_from_args(args, model=_arg(args, "model"), stages=_arg(args, "stages"))
    return RunConfig(
        model=model, spec=spec_from_flags(args), dataset=args.lengths or args.dataset or "sharegpt",
        global_batch=_arg(args, "global_batch"), seed=_arg(args, "seed"), steps=args.steps,
        warmup=args.warmup, backend=backend, device=device, cost_model=args.cost_model, timeout_s=args.timeout,
        prewarm=args.prewarm, expandable_segments=not args.no_expandable_segments, plan_ahead=args.plan_ahead,
        shard=args.shard)


def _planned_virtual(plan: Plan) -> int | None:
    """The chunks per GPU a plan was made for (``dynmb plan --virtual``); None for one chunk (older plans: unknown)."""
    return int(plan.spec.virtual) if plan.spec is not None and plan.spec.virtual > 1 else None


def _refuse_conflicts(args: argparse.Namespace, plan: Plan, model: ModelConfig, kind: str,
                      sidecar: dict[str, Any]) -> None:
    """One ``ValueError`` line for the first flag given that says otherwise than the plan."""
    meta = plan.meta
    recorded: list[tuple[str, Any, Any]] = [
        ("stages", args.stages, plan.num_stages),
        ("memory-limit", args.memory_limit and parse_bytes(args.memory_limit), int(plan.memory_limit_bytes)),
        ("method", args.method, plan.method), ("dp", args.dp, plan.dp),
        ("global-batch", args.global_batch, plan.num_sequences),
        ("schedule", args.schedule if args.schedule in SCHEDULE_KINDS else None, kind),   # auto: the plan chose
        ("virtual", args.virtual, sidecar.get("virtual") or _planned_virtual(plan)),
        ("dataset", args.dataset or args.lengths, meta.get("dataset")), ("seed", args.seed, meta.get("seed")),
        ("mbs", args.mbs, meta.get("mbs")), ("pack-len", args.pack_len, plan_pack_len(plan)),
        ("round-to", args.round_to, meta.get("round_to")),
    ]
    for flag, given, in_plan in recorded:
        if given is not None and in_plan is not None and given != in_plan:
            shown = getattr(args, flag.replace("-", "_"), given) if flag != "schedule" else given
            theirs = in_plan.name if isinstance(in_plan, ModelConfig) else in_plan
            raise ValueError(f"--{flag} {shown} conflicts with the plan {args.plan}, which has {flag} {theirs}; "
                             "leave the flag out to run the plan as it is")
    refuse_split_conflict(args, plan, model)
    for flag in ("oversize", "recompute", "reorder", "slice_fitting"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag.replace('_', '-')} plans a batch; --plan {args.plan} runs that plan as it is")
    if args.plan_ahead:
        raise ValueError(f"--plan-ahead plans the steps' batches; --plan {args.plan} runs that plan every step")


def plan_run_config(args: argparse.Namespace, backend: str = "gloo", device: str = "cpu"
                    ) -> tuple[RunConfig, str | None, str | None]:
    """The RunConfig of ``--plan`` (and ``--schedule`` CSV) runs, the schedule file and the memory-model
    file. Every setting comes from the plan (its spec, model config and model files: ``cli.planfile``);
    refuses a schedule built for another plan (``check_schedule_plan``) and flags that conflict."""
    plan = Plan.load(args.plan, allow_over_limit=args.allow_over_limit)
    schedule_file = args.schedule if args.schedule is not None and not is_schedule_name(args.schedule) else None
    sidecar: dict[str, Any] = {}
    if schedule_file is not None:
        if not Path(schedule_file).is_file():
            raise ValueError(f"--schedule {schedule_file}: neither a schedule kind ({', '.join(SCHEDULE_KINDS)}) "
                             "nor a schedule file")
        check_schedule_plan(plan, args.plan, schedule_file)
        meta_path = sidecar_path(schedule_file)
        sidecar = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    kind = str(sidecar.get("kind") or plan.schedule_kind)
    model = plan_model(plan, args, args.plan)
    _refuse_conflicts(args, plan, model, kind, sidecar)
    cost_file = recorded_model_file("cost-model", args.cost_model, plan.meta.get("cost_model"), args.plan)
    memory_file = recorded_model_file("memory-model", args.memory_model, plan.meta.get("memory_model"), args.plan)
    meta, spec = plan.meta, plan.spec
    virtual = int(sidecar.get("virtual") or _planned_virtual(plan) or args.virtual or 1)
    shards = 1 if spec is None else spec.state_shards
    if shards > (plan.dp if args.shard else 1):     # smaller than the run's shards is safe, larger is not
        raise ValueError(f"the plan {args.plan} counts model states sharded over {shards} replicas (--state-shards "
                         f"{shards}); it runs only with --shard over {shards} or more (its dp is {plan.dp})")
    recorded: dict[str, Any] = {} if spec is None else {          # older plans: the defaults
        "oversize": spec.oversize, "recompute": spec.recompute, "slice_fitting": spec.slice_fitting,
        "embedding": spec.embedding, "state_shards": shards}
    run_spec = spec_from_flags(argparse.Namespace(), method=plan.method, stages=plan.num_stages, virtual=virtual,
                               schedule=kind, reorder=str(sidecar.get("reorder") or meta.get("reorder") or "none"),
                               memory_limit=int(plan.memory_limit_bytes), dp=plan.dp, mbs=meta.get("mbs"),
                               pack_len=plan_pack_len(plan),
                               round_to=int(meta.get("round_to") or (spec.round_to if spec else 1)), **recorded)
    cfg = RunConfig(
        model=model, spec=run_spec, dataset=str(meta.get("dataset") or Path(args.plan).resolve()),
        global_batch=plan.num_sequences, shard=args.shard, seed=int(meta.get("seed") or 0), steps=args.steps,
        warmup=args.warmup, backend=backend, device=device, cost_model=cost_file, timeout_s=args.timeout,
        prewarm=args.prewarm, expandable_segments=not args.no_expandable_segments)
    return cfg, schedule_file, memory_file


def _spec(args: argparse.Namespace, backend: str, device: str, corpus: TokenFile | None = None) -> RunSpec:
    memory_model = args.memory_model
    if args.plan is not None:
        cfg, schedule_file, memory_model = plan_run_config(args, backend, device)
    else:
        cfg, schedule_file = run_config(args, backend, device), None
    if corpus is not None:
        cfg = replace(cfg, dataset=corpus.source.name)
    cfg = replace(cfg, checkpoint=args.checkpoint, checkpoint_every=args.checkpoint_every, resume=args.resume)
    if cfg.resume:
        check_resume(cfg)
    warn_own_model_stand_ins(args, cfg.model, cfg.cost_model, args.memory_model, cfg.spec.num_stages, "dynmb run")
    named = args.model or (args.plan and Plan.load(args.plan, allow_over_limit=True).meta.get("model_factory"))
    factory = str(named) if isinstance(named, str) and names_factory(named) else None
    choice = getattr(args, "virtual_choice", None)
    return RunSpec.create(cfg, args.out, verify=args.verify, allow_over_limit=args.allow_over_limit,
                          memory_model=memory_model, plan=args.plan, schedule=schedule_file, corpus=corpus,
                          model_factory=factory, virtual_choice=describe(choice) if choice is not None else "")


def _token_file(args: argparse.Namespace) -> TokenFile | None:
    """``--corpus``: its token file in the results folder (the tokenizer checked against the
    model's vocabulary first); None without it."""
    source = corpus_source(args)
    if source is None:
        return None
    check_writable(args.out)
    run = _spec(args, "gloo", "cpu").run
    model = run.model
    return prepare_tokens(source, args.out, vocab_size=model.vocab_size, model_name=model.name,
                          max_len=model.max_seq_len if run.oversize == "error" else None)   # a record no row holds


def _workload(args: argparse.Namespace, tokens: TokenFile | None) -> Workload:
    """What the run's global batches are drawn from (the corpus's token counts, else the trace), its global batch
    size and seed: ``--embedding auto`` chooses on its sample batches (``embedding_choice.choose_on_samples``)."""
    lengths = tokens.load().lengths if tokens is not None else workload_of(args)
    return Workload(lengths, _arg(args, "global_batch"), _arg(args, "seed"))


def run(args: argparse.Namespace) -> int:
    try:
        # every check that needs no torch first (JobSpec.check; gloo/cpu stand in for the default
        # device, which torch (~4 s to import) decides): a typo costs no torch import
        given = _flag_backend_device(args)
        args = with_virtual_choice(embedding_pending(args), model=_arg(args, "model"),
                                   stages=_arg(args, "stages"))   # auto: V once
        # the settings alone first (what `dynmb plan` refuses, the device): nothing read or written yet
        _spec(args, *(given or ("gloo", "cpu"))).check_settings()
        check_fresh(args.out, args.append)          # one job per folder, before anything is written
        tokens = _token_file(args)
        if args.embedding_auto:                     # the embedding's place, once, on the workload's sample batches
            args = with_embedding_choice(args, _workload(args, tokens), model=_arg(args, "model"),
                                         stages=_arg(args, "stages"), device=(given or default_backend_device())[1])
        JobSpec.single(_spec(args, *(given or ("gloo", "cpu")), corpus=tokens)).check()
        spec = _spec(args, *(given or default_backend_device()), corpus=tokens)
    except KeyboardInterrupt:
        print("dynmb run: interrupted before torchrun started", file=sys.stderr)
        return 130
    if spec.virtual_choice:
        print(f"dynmb run: --virtual auto: {spec.virtual_choice}", file=sys.stderr, flush=True)
    if getattr(args, "embedding_choice", None) is not None:
        print(f"dynmb run: --{args.embedding_choice.describe()}", file=sys.stderr, flush=True)
    nproc = args.nproc or spec.run.spec.num_ranks * spec.run.spec.dp
    result = run_job(JobSpec.single(spec), nproc)
    if result.launch.interrupted:
        print(stop_line("run", result.launch), file=sys.stderr, flush=True)
    elif result.returncode == 0:
        print(run_summary(Path(spec.out_dir), spec.run_id), flush=True)
    return result.returncode
