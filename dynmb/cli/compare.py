"""``dynmb compare``: the main job, fixed against dynamic microbatching on real runs, with a table
and plots. The job itself is ``dynmb.jobs.compare``; this module parses, prints and sets the exit
code (1 when a measured peak is over the limit)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from dynmb.cli.flags import (OVERSIZE_CHOICES, add_data_flags, add_embedding_flag, add_model_flags, add_recompute_flag, add_run_shape_flags,
                             add_offload_flag, add_schedule_flag, add_shape_flags, add_slice_fitting_flag, corpus_source, nonnegative_int,
                             positive_int, spec_from_flags)
from dynmb.core.planspec import EMBEDDING_PLACES
from dynmb.cli.outcome import stop_line
from dynmb.core.config import RunConfig
from dynmb.io.outdir import check_fresh
from dynmb.jobs.compare import (DEFAULT_LIMIT, CompareJob, CompareSettings, base_model_config, format_summary,
                                case_placement, prepare_compare, run_compare_job, trace_lengths)
from dynmb.planning.embedding_choice import EmbeddingChoice, Workload, choose_on_samples, fallback, last_refusal
from dynmb.runtime.launch import default_backend_device

__all__ = ["add_parser", "run", "settings_from_args"]


def add_parser(subparsers: argparse._SubParsersAction, help_text: str) -> None:
    parser = subparsers.add_parser("compare", help=help_text)
    add_data_flags(parser, global_batch=32, corpus=True)
    parser.add_argument("--stages", type=positive_int, default=2, help="pipeline stages (default 2)")
    parser.add_argument("--memory-limit", default=None,
                        help="per-GPU memory limit (default 1GiB, which binds for the small model)")
    parser.add_argument("--methods", default="fixed,sorted,packed,token-budget,balanced,dynapipe,dynamic",
                        help="comma-separated methods")
    parser.add_argument("--mbs", type=positive_int, default=None,
                        help="microbatch size for fixed-size methods (default: largest that fits)")
    parser.add_argument("--oversize", default="error", choices=OVERSIZE_CHOICES,
                        help="a sequence that cannot fit alone: error (default), truncate or drop (both reported)")
    add_recompute_flag(parser)
    add_slice_fitting_flag(parser)
    add_offload_flag(parser)
    add_embedding_flag(parser, default="first")            # every case's place (auto: with dynamic's settings)
    add_shape_flags(parser)
    add_run_shape_flags(parser)
    add_schedule_flag(parser, help="schedule kind: gpipe, 1f1b, memory-aware, zb-h1, zb, or auto (per step, the "
                                   "fastest predicted kind that fits) (default 1f1b)")
    parser.add_argument("--virtual", type=positive_int, default=1,
                        help="model chunks per rank (default 1: one rank per stage; >1 runs the interleaved "
                             "schedule on stages/virtual ranks)")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"],
                        help="cpu (gloo) or cuda (NCCL, one GPU per rank); default cuda when available")
    parser.add_argument("--memory-model", default=None,
                        help="fitted memory-model JSON (`dynmb memory`); default analytic")
    parser.add_argument("--allow-over-limit", action="store_true",
                        help="finish and report a measured peak over the limit (exit 1) instead of stopping the run")
    parser.add_argument("--reorder", default="auto",
                        help="microbatch order: auto (dynamic: search, dynapipe: its cluster permutation, others: "
                             "none) or one of none, descending, ascending, ends, dynapipe, search for every method")
    parser.add_argument("--steps", type=positive_int, default=3, help="measured steps per method (default 3)")
    parser.add_argument("--warmup", type=nonnegative_int, default=1, help="warm-up steps per method (default 1)")
    parser.add_argument("--no-fixed-best", action="store_true",
                        help="skip the extra fixed cases (mbs 1, 2, 4, ... below the largest that fits) that find "
                             "the best fixed mbs in hindsight")
    parser.add_argument("--sequential", action="store_true",
                        help="run the methods one after another; default on CPU: round by round (step k of every "
                             "method, then step k+1), so outside load hits every method alike")
    parser.add_argument("--cost-model", default=None,
                        help="fitted cost-model JSON (default: the one shipped for this model/stages on CPU, "
                             "else analytic)")
    add_model_flags(parser)
    parser.add_argument("--repeats", type=positive_int, default=1,
                        help="run the whole job N times on the same batches (default 1); with N >= 2 the verdict "
                             "also gives the box's repeat noise")
    parser.add_argument("--order-seed", type=nonnegative_int, default=None,
                        help="seed of the random case order of every round (default: a fresh one, recorded in "
                             "spec.json and verdict.json)")
    parser.add_argument("--out", default="results/compare",
                        help="results folder (default results/compare); one holding another job's tables is "
                             "refused unless --append")
    parser.add_argument("--append", action="store_true",
                        help="add this job's rows to a results folder that already holds another job's tables")
    parser.add_argument("--verbose", action="store_true", help="stream the workers' output")
    parser.set_defaults(func=run)


def _place_given(args: argparse.Namespace) -> str:
    """``--embedding`` as a place (``auto``: ``first`` until ``with_embedding_choice`` chooses; default ``first``)."""
    given = getattr(args, "embedding", None) or "first"
    return "first" if given == "auto" else str(given)


def settings_from_args(args: argparse.Namespace) -> CompareSettings:
    """The ``CompareSettings`` of the flags: a ``RunConfig`` template (its spec from ``spec_from_flags``), the
    methods and the comparison's own options."""
    corpus = corpus_source(args)
    device = args.device or default_backend_device()[1]
    template = RunConfig(
        model=base_model_config(args.model, args.attention),
        spec=spec_from_flags(args, memory_limit=args.memory_limit or DEFAULT_LIMIT, virtual=int(args.virtual or 1),
                             embedding=_place_given(args)),
        dataset=corpus.name if corpus is not None else args.lengths or args.dataset or "sharegpt",
        global_batch=args.global_batch, seed=args.seed, steps=args.steps, warmup=args.warmup, device=device,
        backend="nccl" if device == "cuda" else "gloo", cost_model=args.cost_model, prewarm=args.prewarm,
        plan_ahead=args.plan_ahead, expandable_segments=not args.no_expandable_segments)
    return CompareSettings(
        template=template, methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()), model=args.model,
        stage_split=args.stage_split, corpus=corpus, memory_model=args.memory_model,
        allow_over_limit=args.allow_over_limit, fixed_best=not args.no_fixed_best, sequential=args.sequential,
        out=args.out, repeats=args.repeats, order_seed=args.order_seed, append=args.append)


def with_embedding_choice(settings: CompareSettings) -> tuple[CompareSettings, EmbeddingChoice]:
    """``--embedding auto``: ``settings`` (their embedding ``first``) with the place every case runs in chosen once by
    ``embedding_choice.choose_on_samples`` under dynamic's settings, each place with its own layout (the stage
    split's relief weighed for it) and models, as the cases plan; ``first`` where ``last`` cannot run (said once)."""
    settings = settings.resolved()
    run = settings.template
    why = last_refusal(run.spec, run.model, own_model=settings.model_factory is not None,
                       memory_model_given=settings.memory_model is not None)
    if why is not None:
        return settings, fallback(why)
    placed = [replace(settings, template=run.with_(embedding=place)) for place in EMBEDDING_PLACES]
    placements = [case_placement(s, "dynamic") for s in placed]
    if settings.corpus is not None:                  # its token counts: the token file, once the folder may be used
        check_fresh(settings.out, settings.append)
    workload = Workload(trace_lengths(settings), run.global_batch, run.seed)
    choice, won = choose_on_samples(workload, placements)
    return placed[EMBEDDING_PLACES.index(won.spec.embedding)], choice


def _header(job: CompareJob) -> str:
    s, run = job.settings, job.settings.template
    return (f"dynmb compare: {len(job.cases)} cases ({', '.join(c.label for c in job.cases)}) x ({run.warmup} warm-up "
            f"+ {run.steps} steps) on {job.nproc} {job.backend} rank(s) ({run.spec.num_stages} stages, "
            f"{run.spec.schedule_kind}, {run.device}), {s.trace}, global batch {run.global_batch}, limit "
            f"{s.memory_limit}, reorder {run.spec.reorder}, cost model {run.cost_model or 'analytic'}, {s.repeats} "
            f"repeat(s), round order seed {s.order_seed} -> {job.out_dir}")


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
        if getattr(args, "embedding", None) == "auto":     # the place of every case, once, before any worker starts
            settings, choice = with_embedding_choice(settings)
            print(f"dynmb compare: --{choice.describe()}", file=sys.stderr, flush=True)
        job = prepare_compare(settings)
    except KeyboardInterrupt:
        print("dynmb compare: interrupted before torchrun started", file=sys.stderr)
        return 130
    print(_header(job), file=sys.stderr)
    result = run_compare_job(job, quiet=not args.verbose, progress=True)
    if result.launch is not None and result.launch.interrupted:
        print(stop_line("compare", result.launch), file=sys.stderr, flush=True)
        return result.returncode
    if result.returncode != 0:
        for line in result.failures:
            print(f"dynmb compare: {line}", file=sys.stderr)
        return result.returncode
    assert result.summary is not None
    out = job.out_dir
    print(format_summary(result.summary, box=result.box))
    print(f"\n{len(job.cases)} cases in {result.wall_s:.0f} s; tables steps/actions/memory/runs/summary (.csv"
          f"{', .parquet' if (out / 'summary.parquet').exists() else ''}) and {', '.join(result.files)} in {out}")
    if result.over_limit:
        print(f"dynmb compare: measured peak over the limit for {result.over_limit}", file=sys.stderr)
        return 1
    return 0
