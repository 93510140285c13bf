"""The README is true (issue 40, item 4): its Python blocks run as they are, its command table runs, and
what it says about the flags ``run`` and ``compare`` share with ``plan`` matches their parsers."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dynmb.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def _python(code: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _block(word: str) -> str:
    found = [b for b in BLOCKS if word in b]
    assert len(found) == 1, f"one README block with {word!r}"
    return found[0]


def test_the_own_loop_block_runs_as_it_is(tmp_path) -> None:
    done = _python(_block("DynamicBatchSampler"), tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_api_blocks_planning_part_runs(tmp_path) -> None:
    """The API block up to its real run (the whole block: the slow test below)."""
    code = _block("dynmb.Planner").split("result = dynmb.run")[0]
    done = _python(code, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "above the batch's ideal" in done.stdout and len(done.stdout.splitlines()) == 5


@pytest.mark.slow
def test_the_api_block_runs_whole(tmp_path) -> None:
    done = _python(_block("dynmb.Planner"), tmp_path, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = done.stdout.splitlines()[5:]
    assert "tokens_per_s" in summary[0] and not any("..." in line for line in summary)


def _table_commands() -> list[list[str]]:
    """The ``dynmb plan`` / ``schedule`` / ``simulate`` cells of the README's command table, in order."""
    cells = re.findall(r"^\| `(dynmb (?:plan|schedule|simulate) [^`]*)`", README, re.M)
    return [shlex.split(c)[1:] for c in cells]


def test_the_command_tables_plan_schedule_simulate_run_in_a_fresh_folder(tmp_path) -> None:
    commands = _table_commands()
    assert [c[0] for c in commands] == ["plan", "schedule", "simulate"]
    for argv in commands:
        done = subprocess.run([sys.executable, "-m", "dynmb.cli", *argv], cwd=tmp_path, capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
        assert done.returncode == 0, (argv, done.stderr[-1500:])


def _flags(verb: str) -> set[str]:
    sub = build_parser([verb])._subparsers._group_actions[0].choices[verb]   # type: ignore[union-attr]
    return {s for a in sub._actions for s in a.option_strings if s.startswith("--")} - {"--help"}


def test_run_and_compare_take_plans_flags_but_those_the_readme_names() -> None:
    said = re.search(r"`run` and `compare` take the same data and packing flags as `plan`, except:(.*?)\n\n",
                     README, re.S)
    assert said is not None
    named = set(re.findall(r"`(--[a-z-]+)`", said.group(1)))
    plan = _flags("plan")
    assert plan - _flags("run") <= named
    assert plan - _flags("compare") <= named
    assert {"--dp", "--method", "--json", "--step", "--output", "--state-shards"} == plan - _flags("compare")
    assert {"--slice-fitting", "--repeats", "--append", "--embedding"} <= _flags("compare")


def test_data_readme_lists_every_shipped_file() -> None:
    text = (ROOT / "data" / "README.md").read_text()
    for folder in ("traces", "costmodels"):
        for f in (ROOT / "data" / folder).iterdir():
            assert f.name in text, f"data/README.md does not name {folder}/{f.name}"
    assert "../shared/datasets" not in text.split("### Rebuild them")[0]      # users do not have it
