"""``dynmb profile``: time forward and backward per stage over a (rows, padded_len) grid into a
samples CSV (resumable) for ``dynmb fit`` (``dynmb.measure.profiler``). Shows the ETA lines (INFO)
unless ``-q``, then a fixed-point table of median and max seconds per stage and op."""

from __future__ import annotations

import argparse
import logging

from dynmb.cli.flags import add_model_flags, factory_from_args, positive_int
from dynmb.measure.profiler import ProfileSettings, profile
from dynmb.runtime.spec import check_device

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction, help_text: str) -> None:
    parser = subparsers.add_parser("profile", help=help_text)
    add_model_flags(parser)
    parser.add_argument("--stages", type=positive_int, default=2, help="pipeline stages (default 2)")
    parser.add_argument("--quick", action="store_true", help="a grid that finishes in about a minute")
    parser.add_argument("--max-len", type=positive_int, default=None, help="largest padded_len in the grid")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per point (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed warm-up runs per point (default 2)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu or cuda")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads (default 1, as one rank per core)")
    parser.add_argument("--comm", action="store_true", help="also measure P2P ping-pong (alpha, beta) on gloo")
    parser.add_argument("--concurrent", action="store_true",
                        help="CPU: one process per stage, every stage of a point timed at once, as a pipeline "
                             "runs them")
    parser.add_argument("--token-cap", type=positive_int, default=None,
                        help="largest rows x padded_len in the default grid (default 8192 on CPU, 65536 on CUDA)")
    parser.add_argument("--split", action="store_true",
                        help="also time the split backward zero-bubble schedules run (I and W rows next to F and B)")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the memory columns (each point's first repeat builds a fresh stage for them: "
                             "about 1 s per point for gpt2; `dynmb memory` measures memory on its own)")
    parser.add_argument("-o", "--output", required=True, help="samples CSV (appended to / resumed if it exists)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_device("gloo", args.device)           # CUDA asked for where torch sees none: one line, no traceback
    if not args.quiet and args.verbosity == 0:
        logging.getLogger("dynmb.measure").setLevel(logging.INFO)   # the ETA lines, without -v
    settings = ProfileSettings(quick=args.quick, max_len=args.max_len, repeats=args.repeats, warmup=args.warmup,
                               device=args.device, threads=args.threads, comm=args.comm, memory=not args.no_memory,
                               concurrent=args.concurrent, token_cap=args.token_cap, split=args.split)
    samples = profile(factory_from_args(args), args.stages, settings, output=args.output)
    compute = samples[samples["op"].isin(["F", "B"])]
    medians = compute.groupby(["stage", "op"])["time_s"].agg(["size", "median", "max"])
    medians.columns = ["samples", "median_s", "max_s"]
    points = len(compute.groupby(["stage", "rows", "padded_len", "packed"]))
    print(f"wrote {args.output}: {len(samples)} samples ({points} stage x points)")
    print(medians.to_string(float_format=lambda x: f"{x:.6f}"))   # fixed-point, never 1.33e-03
    return 0
