"""Stopping ``dynmb run`` stops the run: Ctrl-C (SIGINT to the process group, as a terminal
sends it) and SIGTERM stop torchrun and every worker within 10 s, print one line, exit 130 /
143 and leave only complete steps; a launcher killed with SIGKILL takes its workers with it.

Each case starts a real ``dynmb run`` (tiny model, 2 gloo ranks, many steps) as a subprocess in
its own session and waits for the first step's progress line before it signals."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from dynmb.runtime.launch import PROGRESS
from dynmb.runtime.processes import _descendants

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to find leftover processes")

START_S = 180.0     # start-up of torchrun and two ranks on a loaded 2-core machine
STOP_S = 10.0


def _processes_of(out: Path) -> list[int]:
    """Live processes whose command line names ``out`` (torchrun and its workers: ``--spec out/spec.json``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(out) in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


RUN = ["run", "--model", "tiny", "--global-batch", "4", "--memory-limit", "256MiB", "--steps", "800", "--warmup", "0",
       "--device", "cpu"]
COMPARE = ["compare", "--model", "tiny", "--methods", "fixed,dynamic", "--no-fixed-best", "--global-batch", "4",
           "--memory-limit", "256MiB", "--steps", "800", "--device", "cpu"]


class _Run:
    """``dynmb ARGV --out OUT`` in its own session; its stdout and stderr read by threads."""

    def __init__(self, argv: list[str], out: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "dynmb.cli", *argv, "--out", str(out)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.out: list[str] = []
        self.err: list[str] = []
        self._got = threading.Event()
        threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True).start()

    def _read(self, stream, into: list[str]) -> None:
        while chunk := os.read(stream.fileno(), 65536):   # tqdm's bar ends its updates with \r, not \n
            into.append(chunk.decode(errors="replace"))
            self._got.set()

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def wait_for(self, pattern: str, in_stderr: bool = False) -> None:
        """Until ``pattern`` (a regular expression) appears: a step's progress line (dynmb run
        prints them on stdout, dynmb compare's progress bar its latest on stderr)."""
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if re.search(pattern, "".join(self.err if in_stderr else self.out)):
                return
            if self.proc.poll() is not None:
                pytest.fail(f"dynmb ended with {self.proc.returncode}: {self.stderr[-2000:]}")
            self._got.wait(1)
            self._got.clear()
        pytest.fail(f"no {pattern!r} within {START_S:.0f} s")

    def wait(self, timeout: float) -> float:
        t0 = time.monotonic()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            pytest.fail(f"dynmb still running {timeout:.0f} s after the signal")
        return time.monotonic() - t0


def _assert_gone(out: Path, within: float) -> None:
    deadline = time.monotonic() + within
    while _processes_of(out) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _processes_of(out), f"processes left: {_processes_of(out)}"


def _assert_complete_steps(out: Path) -> list[int]:
    steps = pd.read_csv(out / "steps.csv")
    done = set(zip(steps["run_id"], steps["step"]))
    for table in ("actions", "memory"):
        df = pd.read_csv(out / f"{table}.csv")
        orphans = set(zip(df["run_id"], df["step"])) - done
        assert not orphans, f"{table} rows of steps without a steps row: {sorted(orphans)}"
    assert not list(out.glob(".*.tmp"))
    return sorted(steps["step"])


def _stop(run: _Run, out: Path, sig: int, to_group: bool, to_torchrun: bool = False) -> int:
    """Send ``sig`` (to the process group, as a terminal's Ctrl-C, or to the process; ``to_torchrun``: to
    the launcher's torchrun) and check that everything stopped within ``STOP_S``; returns the exit code."""
    try:
        assert len(_processes_of(out)) >= 3          # torchrun and two workers
        if to_torchrun:
            os.kill(_descendants(run.proc.pid)[0], sig)      # torchrun: the launcher's only child
        else:
            (os.killpg if to_group else os.kill)(run.proc.pid, sig)
        took = run.wait(STOP_S + 20)
        assert took < STOP_S, f"took {took:.1f} s to stop"
        _assert_gone(out, 1.0)
    finally:
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
    time.sleep(0.2)                                  # the reader threads take the last output
    return run.proc.returncode


def _stop_line(run: _Run, verb: str, sig: int) -> str:
    lines = [ln.split("\r")[-1] for ln in run.stderr.splitlines() if "interrupted" in ln]
    assert len(lines) == 1, run.stderr[-2000:]
    assert lines[0].startswith(f"dynmb {verb}: interrupted ({signal.Signals(sig).name}), stopped torchrun and 2 "
                               "workers; tables hold "), lines[0]
    return lines[0]


@pytest.mark.parametrize("sig, code, to_group, to_torchrun", [
    (signal.SIGINT, 130, True, False), (signal.SIGTERM, 143, False, False),
    (signal.SIGHUP, 129, False, False),        # a closed terminal
    (signal.SIGHUP, 129, False, True),         # torchrun itself signalled: its SignalException traceback unshown
    (signal.SIGTERM, 143, False, True)])
def test_a_signal_stops_torchrun_and_every_worker(tmp_path, sig, code, to_group, to_torchrun):
    out = tmp_path / "out"
    run = _Run(RUN, out)
    run.wait_for(re.escape(PROGRESS))
    assert _stop(run, out, sig, to_group, to_torchrun) == code
    line = _stop_line(run, "run", sig)
    assert "Traceback" not in "".join(run.out) + run.stderr       # torchrun's SignalException unshown
    steps = _assert_complete_steps(out)
    assert steps and steps == list(range(len(steps)))
    assert line.endswith(f"{'steps 0-' + str(steps[-1]) if len(steps) > 1 else 'step 0'} complete")
    runs = pd.read_csv(out / "runs.csv")
    assert list(runs["status"]) == ["interrupted"]


def test_ctrl_c_stops_compare(tmp_path):
    out = tmp_path / "out"
    run = _Run(COMPARE, out)
    run.wait_for(r" step \d+: \d", in_stderr=True)
    assert _stop(run, out, signal.SIGINT, True) == 130
    _stop_line(run, "compare", signal.SIGINT)
    _assert_complete_steps(out)
    assert set(pd.read_csv(out / "runs.csv")["status"]) == {"interrupted"}


def test_workers_die_with_a_killed_launcher(tmp_path):
    out = tmp_path / "out"
    run = _Run(RUN, out)
    try:
        run.wait_for(re.escape(PROGRESS))
        assert len(_processes_of(out)) >= 3
        run.proc.send_signal(signal.SIGKILL)
        run.proc.wait(5)
        _assert_gone(out, STOP_S)
    finally:
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
