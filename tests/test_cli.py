"""The ``dynmb`` command's shape: one module per verb (parser next to handler), the entry
point, ``-v``/``-q`` logging, only the chosen verb imported."""

from __future__ import annotations

import importlib
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dynmb.cli import VERBS, build_parser, main

ROOT = Path(__file__).resolve().parent.parent


def test_entry_point_is_the_package_main():
    entry = re.search(r'^dynmb\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert entry is not None
    module, _, attr = entry.group(1).partition(":")
    assert getattr(importlib.import_module(module), attr) is main


@pytest.mark.parametrize("verb", list(VERBS))
def test_each_verb_is_a_small_module_with_parser_and_handler(verb):
    module = importlib.import_module(f"dynmb.cli.{verb}")
    assert callable(module.add_parser) and callable(module.run) and module.__doc__
    assert {"add_parser", "run"} <= set(module.__all__)
    assert len(Path(module.__file__).read_text().splitlines()) <= 300
    args = build_parser([verb]).parse_args([verb] + (["x", "-o", "y"] if verb in ("lengths", "fit") else
                                                     ["--plan", "p", "-o", "s"] if verb == "schedule" else
                                                     ["--plan", "p", "--schedule", "s"] if verb == "simulate" else
                                                     ["-o", "x"] if verb in ("memory", "profile") else
                                                     ["--out", "x"] if verb == "run" else []))
    assert args.func is module.run


def test_help_lists_every_verb_without_importing_them():
    """Building the top-level parser imports no verb module and nothing beyond ``import dynmb``."""
    code = ("import json, sys, dynmb; before = set(sys.modules); from dynmb.cli import build_parser; "
            "build_parser([]); print(json.dumps(sorted(set(sys.modules) - before)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    added = set(json.loads(out.stdout))
    assert {"dynmb.cli", "dynmb.cli.main"} <= added
    assert added - {"dynmb.cli", "dynmb.cli.main", "argparse", "gettext", "locale"} == set(), added
    text = build_parser([]).format_help()
    assert all(verb in text for verb in VERBS) and "-v" in text and "-q" in text


@pytest.mark.parametrize("flags,level", [([], logging.WARNING), (["-v"], logging.INFO), (["-vv"], logging.DEBUG),
                                         (["-q"], logging.ERROR)])
def test_verbosity_sets_the_library_log_level(flags, level, capsys):
    assert main(flags + ["datasets", "--json"]) == 0
    assert logging.getLogger("dynmb").level == level
    assert capsys.readouterr().out.startswith("[{")
    logging.getLogger("dynmb").info("an info line")
    assert ("an info line" in capsys.readouterr().err) == (level <= logging.INFO)


def test_user_error_is_one_line_and_exit_2(capsys):
    assert main(["plan", "--dataset", "no-such-trace"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dynmb plan: error: unknown dataset")


def test_python_dash_m_runs_the_command():
    out = subprocess.run([sys.executable, "-m", "dynmb.cli", "datasets"], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    assert "sharegpt" in out.stdout
