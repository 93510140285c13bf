"""The ``dynmb`` command. Thin: parses flags, calls the library, prints.

Verbs (``dynmb VERB --help`` for each): datasets, lengths, plan, schedule,
simulate, memory, profile, fit, run, compare.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

__all__ = ["main", "build_parser"]


# --------------------------------------------------------------------------
# shared flag groups
# --------------------------------------------------------------------------
def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="small", help="model preset: tiny, small (CPU default), gpt2, gpt2-medium, llama-1b, llama-7b")


def _add_data_flags(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    src = p.add_mutually_exclusive_group(required=False)
    src.add_argument("--dataset", default=None, help="shipped length trace name (see `dynmb datasets`)")
    src.add_argument("--lengths", default=None, help="a length-trace CSV (header + one column `length`)")
    p.add_argument("--global-batch", type=int, default=64, help="sequences per global batch (default 64)")
    p.add_argument("--seed", type=int, default=0, help="seed for sampling the global batch (default 0)")


def _add_packing_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    p.add_argument("--memory-limit", default="1GiB", help="per-GPU memory limit, e.g. 2GiB, 512MiB (default 1GiB)")
    p.add_argument("--method", default="dynamic", help="fixed, sorted, packed, token-budget, dynapipe, dynamic (default dynamic)")
    p.add_argument("--mbs", type=int, default=None, help="microbatch size for fixed-size methods (default: the largest that fits)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel pipelines the global batch is split over (default 1)")
    p.add_argument("--schedule-kind", default="1f1b", help="schedule the plan is made for: gpipe, 1f1b, interleaved, memory-aware (default 1f1b)")
    p.add_argument("--cost-model", default=None, help="fitted cost-model JSON (`dynmb fit`); default: analytic stand-in")
    p.add_argument("--memory-model", default=None, help="fitted memory-model JSON (`dynmb memory`); default: analytic")
    p.add_argument("--oversize", default="error", choices=["error", "truncate", "drop"],
                   help="a sequence that cannot fit alone: error (default), truncate it to fit, or drop it (both reported)")


def _not_yet(name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        print(f"dynmb {name}: not implemented yet", file=sys.stderr)
        return 2
    return run


# --------------------------------------------------------------------------
# verbs — each _cmd_X(args) -> exit code
# --------------------------------------------------------------------------
_cmd_datasets = _not_yet("datasets")
_cmd_lengths = _not_yet("lengths")
_cmd_plan = _not_yet("plan")
_cmd_schedule = _not_yet("schedule")
_cmd_simulate = _not_yet("simulate")
_cmd_memory = _not_yet("memory")
_cmd_profile = _not_yet("profile")
_cmd_fit = _not_yet("fit")
_cmd_run = _not_yet("run")
_cmd_compare = _not_yet("compare")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dynmb", description="Dynamic microbatching for pipeline-parallel transformer training.")
    sub = ap.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = sub.add_parser("datasets", help="list shipped length traces with count, mean, median, p90, p99, max")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    p.set_defaults(func=lambda a: _cmd_datasets(a))

    p = sub.add_parser("lengths", help="build a length trace (token counts) from a jsonl/json/txt corpus")
    p.add_argument("corpus", help="path to a .jsonl, .json, .txt (or .gz of them) corpus")
    p.add_argument("--field", action="append", default=None,
                   help="record field(s) to tokenize and concatenate; dotted paths like conversations.0.value; repeat for several (txt: ignored)")
    p.add_argument("--tokenizer", default="gpt2", help="gpt2 (offline BPE), a Hugging Face tokenizer name or tokenizer.json path (default gpt2)")
    p.add_argument("--txt-split", default="line", choices=["line", "article", "blank"],
                   help="txt corpora: one record per line, per top-level `= Title =` article, or per blank-line paragraph")
    p.add_argument("-o", "--output", required=True, help="output CSV path")
    p.set_defaults(func=lambda a: _cmd_lengths(a))

    p = sub.add_parser("plan", help="pack one global batch into microbatches under a memory limit")
    _add_data_flags(p)
    _add_packing_flags(p)
    _add_model_flags(p)
    p.add_argument("--step", type=int, default=0, help="which global batch of the seed's stream (default 0)")
    p.add_argument("-o", "--output", default=None, help="plan JSON path")
    p.add_argument("--json", action="store_true", help="print a one-line JSON summary")
    p.set_defaults(func=lambda a: _cmd_plan(a))

    p = sub.add_parser("schedule", help="build and validate a pipeline schedule for a plan")
    p.add_argument("--plan", required=True, help="plan JSON from `dynmb plan`")
    p.add_argument("--kind", default="1f1b", help="gpipe, 1f1b, interleaved, memory-aware (default 1f1b)")
    p.add_argument("--virtual", type=int, default=1, help="model chunks per rank for interleaved (default 1: ranks = stages)")
    p.add_argument("--reorder", default="none", help="none, descending, ascending, ends, dynapipe, search (default none)")
    p.add_argument("--cost-model", default=None, help="fitted cost-model JSON; default analytic")
    p.add_argument("--memory-model", default=None, help="fitted memory-model JSON; default analytic")
    _add_model_flags(p)
    p.add_argument("-o", "--output", required=True, help="schedule CSV path (torch.distributed.pipelining compute-only format)")
    p.add_argument("--plan-output", default=None, help="write the reordered plan here (default: next to the schedule)")
    p.set_defaults(func=lambda a: _cmd_schedule(a))

    p = sub.add_parser("simulate", help="predict makespan, bubble and peak memory of a plan under a schedule")
    p.add_argument("--plan", required=True, help="plan JSON")
    p.add_argument("--schedule", required=True, help="schedule CSV")
    p.add_argument("--cost-model", default=None, help="fitted cost-model JSON; default analytic")
    p.add_argument("--memory-model", default=None, help="fitted memory-model JSON; default analytic")
    _add_model_flags(p)
    p.add_argument("--gantt", default=None, help="write a Gantt PNG of the predicted timeline here")
    p.add_argument("--timeline", default=None, help="write the timeline CSV here")
    p.add_argument("--json", action="store_true", help="print a one-line JSON summary")
    p.set_defaults(func=lambda a: _cmd_simulate(a))

    p = sub.add_parser("memory", help="measure activation/state bytes per stage on a (rows, padded_len) grid and fit the memory model")
    _add_model_flags(p)
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    p.add_argument("--quick", action="store_true", help="a small grid")
    p.add_argument("--device", default="cpu", help="cpu (storage accounting) or cuda (max_memory_allocated)")
    p.add_argument("-o", "--output", required=True, help="memory-model JSON path")
    p.add_argument("--samples", default=None, help="also write the measured samples CSV here")
    p.set_defaults(func=lambda a: _cmd_memory(a))

    p = sub.add_parser("profile", help="measure forward/backward time per stage over a (rows, padded_len) grid")
    _add_model_flags(p)
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    p.add_argument("--quick", action="store_true", help="a grid that finishes in about a minute")
    p.add_argument("--max-len", type=int, default=None, help="largest padded_len in the grid")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per point (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up runs per point (default 2)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as one rank per core)")
    p.add_argument("--comm", action="store_true", help="also measure P2P ping-pong (alpha, beta) on gloo")
    p.add_argument("-o", "--output", required=True, help="samples CSV (appended to / resumed if it exists)")
    p.set_defaults(func=lambda a: _cmd_profile(a))

    p = sub.add_parser("fit", help="fit the cost model to profiled samples; print held-out error")
    p.add_argument("samples", nargs="+", help="samples CSV(s) from `dynmb profile` or a run's actions table")
    p.add_argument("--kind", default="poly", help="poly (scipy least squares, default) or grid (interpolation)")
    _add_model_flags(p)
    p.add_argument("--stages", type=int, default=2, help="pipeline stages the samples were measured for")
    p.add_argument("--folds", type=int, default=5, help="k for k-fold held-out error (default 5)")
    p.add_argument("--plot", default=None, help="write a measured-vs-predicted PNG here")
    p.add_argument("-o", "--output", required=True, help="cost-model JSON path")
    p.set_defaults(func=lambda a: _cmd_fit(a))

    p = sub.add_parser("run", help="run the plan on a real torch.distributed pipeline (launched through torchrun)")
    _add_data_flags(p)
    _add_packing_flags(p)
    _add_model_flags(p)
    p.add_argument("--nproc", type=int, default=2, help="processes (ranks) = stages x dp / virtual (default 2)")
    p.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved, memory-aware (default 1f1b)")
    p.add_argument("--virtual", type=int, default=1, help="model chunks per rank for interleaved (default 1)")
    p.add_argument("--reorder", default="none", help="microbatch reordering (default none)")
    p.add_argument("--steps", type=int, default=3, help="measured steps (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps (default 1)")
    p.add_argument("--backend", default=None, help="gloo or nccl (default: nccl with CUDA, else gloo)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--timeout", type=float, default=120.0, help="process-group / P2P timeout in seconds (default 120)")
    p.add_argument("--verify", action="store_true", help="check each step's gradients against a single-process reference")
    p.add_argument("--out", required=True, help="results folder (tables steps/actions/memory/runs)")
    p.set_defaults(func=lambda a: _cmd_run(a))

    p = sub.add_parser("compare", help="the main job: fixed vs dynamic microbatching on real runs, with a table and plots")
    _add_data_flags(p)
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    p.add_argument("--memory-limit", default=None, help="per-GPU memory limit (default: one that binds for the model)")
    p.add_argument("--methods", default="fixed,sorted,packed,token-budget,dynapipe,dynamic", help="comma-separated methods")
    p.add_argument("--mbs", type=int, default=None, help="microbatch size for fixed-size methods (default: largest that fits)")
    p.add_argument("--schedule", default="1f1b", help="schedule kind (default 1f1b)")
    p.add_argument("--steps", type=int, default=3, help="measured steps per method (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps per method (default 1)")
    p.add_argument("--cost-model", default=None, help="fitted cost-model JSON (default: profile a quick one, cached in --out)")
    _add_model_flags(p)
    p.add_argument("--out", default="results/compare", help="results folder (default results/compare)")
    p.set_defaults(func=lambda a: _cmd_compare(a))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"dynmb {args.verb}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
