"""``dynmb run``: one run on a real torch.distributed pipeline, launched through torchrun
(``dynmb.runtime.launch``); prints a one-line summary of its measured steps."""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from dynmb.cli.flags import add_data_flags, add_model_flags, add_packing_flags, add_run_shape_flags, model_from_args
from dynmb.config import PipelineConfig, RunConfig, parse_bytes
from dynmb.runtime.launch import default_backend_device, launch

__all__ = ["add_parser", "run", "run_summary"]


def add_parser(subparsers: argparse._SubParsersAction, help_text: str) -> None:
    parser = subparsers.add_parser("run", help=help_text)
    add_data_flags(parser)
    add_packing_flags(parser)
    add_model_flags(parser)
    parser.add_argument("--nproc", type=int, default=2, help="processes (ranks) = stages x dp / virtual (default 2)")
    parser.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved, memory-aware, zb-h1, zb (default 1f1b)")
    parser.add_argument("--virtual", type=int, default=1, help="model chunks per rank for interleaved (default 1)")
    parser.add_argument("--reorder", default="none", help="microbatch reordering (default none)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps (default 1)")
    parser.add_argument("--backend", default=None, help="gloo or nccl (default: nccl with CUDA, else gloo)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="process-group / P2P timeout in seconds (default 120)")
    parser.add_argument("--verify", action="store_true",
                        help="check each step's gradients against a single-process reference")
    parser.add_argument("--allow-over-limit", action="store_true",
                        help="report a measured peak over the limit instead of failing")
    add_run_shape_flags(parser)
    parser.add_argument("--out", required=True, help="results folder (tables steps/actions/memory/runs)")
    parser.set_defaults(func=run)


def run_config(args: argparse.Namespace) -> RunConfig:
    """The RunConfig of the flags (``--schedule``, else ``--schedule-kind``)."""
    backend, device = default_backend_device()
    kind = args.schedule if args.schedule != "1f1b" else args.schedule_kind
    return RunConfig(
        model=model_from_args(args),
        pipeline=PipelineConfig(num_stages=args.stages, virtual=args.virtual, schedule=kind, reorder=args.reorder,
                                memory_limit_bytes=parse_bytes(args.memory_limit)),
        dataset=args.lengths or args.dataset or "sharegpt", global_batch=args.global_batch, method=args.method,
        mbs=args.mbs, dp=args.dp, seed=args.seed, steps=args.steps, warmup=args.warmup,
        backend=args.backend or backend, device=args.device or device, cost_model=args.cost_model,
        timeout_s=args.timeout, oversize=args.oversize, pack_len=args.pack_len, round_to=args.round_to,
        prewarm=args.prewarm, expandable_segments=not args.no_expandable_segments, recompute=args.recompute)


def run_summary(out: Path) -> str:
    """One line on the measured steps in ``out``: median step, predicted, tokens/s, bubble."""
    steps = pd.read_csv(out / "steps.csv")
    steps = steps[~steps["warmup"]] if "warmup" in steps else steps
    return (f"dynmb run: ok, {len(steps)} measured steps, median step {steps['step_s'].median():.3f} s "
            f"(predicted {steps['pred_step_s'].median():.3f} s), {steps['tokens_per_s'].median():.0f} tokens/s, "
            f"mean bubble {steps['mean_bubble'].median():.2f}; tables in {out}")


def run(args: argparse.Namespace) -> int:
    returncode = launch(run_config(args), args.out, args.nproc, verify=args.verify, memory_model=args.memory_model,
                        allow_over_limit=args.allow_over_limit)
    if returncode == 0:
        print(run_summary(Path(args.out)), flush=True)
    return returncode
