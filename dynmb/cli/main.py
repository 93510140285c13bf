"""The ``dynmb`` command: the top-level parser, logging, dispatch to one module per verb.

``dynmb [-v | -q] VERB ...``; ``dynmb VERB --help`` for each verb. Every verb lives in its
own module of this package (``dynmb.cli.<verb>``) with ``add_parser(subparsers)`` (its
flags, help on each) next to ``run(args) -> exit code`` (the handler: calls the library,
prints). Only the chosen verb's module is imported, so a typo or ``--help`` costs no torch
or scipy import; ``build_parser()`` without a verb builds every verb's parser.

A mistyped flag or value (argparse) is one line too, ``dynmb VERB: error: ...``, exit 2.

``-v`` shows the library's INFO log lines (``-vv`` DEBUG), ``-q`` only its errors; the
default shows warnings and errors, on stderr. A user error (``ValueError`` (JSON and pandas
parse errors among them), ``OSError``, ``KeyError``, ``csv.Error``) prints one line
``dynmb VERB: error: ...`` naming the file and exits 2, with no traceback (numpy scalars in it
printed as plain numbers, never ``np.int64(...)``); an input file (trace, plan, schedule, model,
samples) that is not UTF-8 text is refused naming it before the verb starts.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import logging
import re
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import NoReturn, Sequence

__all__ = ["main", "build_parser", "VERBS", "configure_logging"]

VERBS: dict[str, str] = {
    "datasets": "list shipped length traces with count, mean, median, p90, p99, max",
    "lengths": "build a length trace (token counts) from a jsonl/json/txt corpus",
    "plan": "pack one global batch into microbatches under a memory limit",
    "schedule": "build and validate a pipeline schedule for a plan",
    "simulate": "predict makespan, bubble and peak memory of a plan under a schedule",
    "memory": "measure activation/state bytes per stage on a (rows, padded_len) grid and fit the memory model",
    "profile": "measure forward/backward time per stage over a (rows, padded_len) grid",
    "fit": "fit the cost model to profiled samples; print held-out error",
    "run": "run the plan on a real torch.distributed pipeline (launched through torchrun)",
    "compare": "the main job: fixed vs dynamic microbatching on real runs, with a table and plots",
}
"""Verb -> its one-line help; the verb's module is ``dynmb.cli.<verb>``."""


class _StderrHandler(logging.Handler):
    """Writes each record to the current ``sys.stderr`` (looked up when it is written)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging must not raise
            self.handleError(record)


def configure_logging(verbosity: int) -> None:
    """Show the ``dynmb`` loggers' records on stderr from a level set by ``-v``/``-q``:
    -1 errors, 0 warnings, 1 info, 2 and more debug."""
    level = {-1: logging.ERROR, 0: logging.WARNING, 1: logging.INFO}.get(verbosity, logging.DEBUG)
    logger = logging.getLogger("dynmb")
    for handler in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
        logger.removeHandler(handler)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)


def _verb_module(verb: str) -> ModuleType:
    return importlib.import_module(f"dynmb.cli.{verb}")


def _chosen_verb(argv: Sequence[str]) -> str | None:
    """The verb of a command line: its first word that is not a top-level option."""
    return next((word for word in argv if not word.startswith("-")), None)


_NEGATIVE_VALUE = re.compile(r"^-\d+$|^-\d*\.\d+$|^-\d[\d.]*[A-Za-z]+$")
"""What argparse reads as a (negative) value rather than a flag: -3, -.5, and sizes such as -1GiB."""


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line (``dynmb VERB: error: argument --stages:
    must be >= 1, got 0 (dynmb VERB --help lists the flags)``), exit code 2, no usage block."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # a negative size (``--memory-limit -1GiB``) is a value, refused by its own check, not a missing one
        self._negative_number_matcher = _NEGATIVE_VALUE

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {_one_line(message)} ({self.prog} --help lists the flags)\n")


def build_parser(verbs: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``dynmb`` parser with the flags of ``verbs`` (default: every verb); the other verbs
    are listed with their help only."""
    parser = _Parser(prog="dynmb",
                                     description="Dynamic microbatching for pipeline-parallel transformer training.")
    loudness = parser.add_mutually_exclusive_group()
    loudness.add_argument("-v", dest="verbosity", action="count", default=0,
                          help="more log lines from the library (-v info, -vv debug)")
    loudness.add_argument("-q", dest="quiet", action="store_true", help="only the library's errors")
    subparsers = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    full = set(VERBS if verbs is None else verbs)
    for verb, help_text in VERBS.items():
        if verb in full:
            _verb_module(verb).add_parser(subparsers, help_text)
        else:
            subparsers.add_parser(verb, help=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    verb = _chosen_verb(argv)
    args = build_parser([verb] if verb in VERBS else []).parse_args(argv)
    configure_logging(-1 if args.quiet else args.verbosity)
    try:
        _check_text_inputs(args)
        with warnings.catch_warnings():     # a stand-in model is said by its log line, once, not twice
            warnings.filterwarnings("ignore", message=r".* with stand-in\(s\): ")    # StandInModelWarning
            return int(args.func(args) or 0)
    except OSError as e:
        # os.replace(tmp, target) names the temporary file first: the target is the user's path
        name = e.filename2 if e.filename2 is not None else e.filename
        message = f"{name}: {e.strerror or e}" if name is not None else str(e)
        print(f"dynmb {args.verb}: error: {_one_line(message)}", file=sys.stderr)
        return 2
    except (ValueError, KeyError, csv.Error) as e:
        print(f"dynmb {args.verb}: error: {_one_line(str(e))}", file=sys.stderr)
        return 2


_TEXT_INPUTS = ("lengths", "plan", "schedule", "cost_model", "memory_model", "model", "samples")
"""The flags (``args`` attributes) that name a text file a verb reads (a trace, a plan, a schedule,
a model file, samples)."""


def _check_text_inputs(args: argparse.Namespace) -> None:
    """Refuse an input file of ``_TEXT_INPUTS`` (``.csv`` / ``.json``) that is not UTF-8 text, one line
    naming it (``dynmb.io.results.check_utf8``), before the verb reads it."""
    paths = []
    for name in _TEXT_INPUTS:
        value = getattr(args, name, None) if name != "samples" or args.verb == "fit" else None  # memory: an output
        paths += [p for p in (value if isinstance(value, list) else [value])
                  if isinstance(p, str) and p.endswith((".csv", ".json")) and Path(p).is_file()]
    if paths:
        from dynmb.io.results import check_utf8

        for path in paths:
            check_utf8(path)


_NUMPY_SCALAR = re.compile(r"\bnp\.(?:u?int|float|bool_?|str_)\d*\(([^()]*)\)")
"""``np.int64(3)`` as numpy 2 prints a scalar in a list or tuple: shown as ``3``."""


def _one_line(message: str) -> str:
    """The message on one line, numpy scalars shown as plain numbers."""
    return " ".join(_NUMPY_SCALAR.sub(r"\1", message).split())
