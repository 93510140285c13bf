"""Stopping ``dynmb run`` stops the run: Ctrl-C (SIGINT to the process group, as a terminal
sends it) and SIGTERM stop torchrun and every worker within 10 s, print one line, exit 130 /
143 and leave only complete steps; a launcher killed with SIGKILL takes its workers with it.

Each case starts a real ``dynmb run`` (tiny model, 2 gloo ranks, many steps) as a subprocess in
its own session and waits for the first step's progress line before it signals."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from dynmb.runtime.launch import PROGRESS

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


class _Run:
    """``dynmb run`` in its own session, its stdout and stderr read by threads."""

    def __init__(self, out: Path) -> None:
        cmd = [sys.executable, "-m", "dynmb.cli", "run", "--model", "tiny", "--global-batch", "4", "--memory-limit",
               "256MiB", "--steps", "5000", "--warmup", "0", "--device", "cpu", "--out", str(out)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, args=(self.proc.stdout, None), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, self.stderr), daemon=True).start()

    def _read(self, stream, into: list[str] | None) -> None:
        for line in stream:
            (into.append(line) if into is not None else self.lines.put(line))

    def wait_for_step(self) -> None:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                if self.proc.poll() is not None:
                    pytest.fail(f"dynmb run ended with {self.proc.returncode}: {''.join(self.stderr)[-2000:]}")
                continue
            if line.startswith(PROGRESS):
                return
        pytest.fail("no progress line")

    def wait(self, timeout: float) -> float:
        t0 = time.monotonic()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            pytest.fail(f"dynmb run still running {timeout:.0f} s after the signal")
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


@pytest.mark.parametrize("sig, code, to_group", [(signal.SIGINT, 130, True), (signal.SIGTERM, 143, False)])
def test_a_signal_stops_torchrun_and_every_worker(tmp_path, sig, code, to_group):
    out = tmp_path / "out"
    run = _Run(out)
    try:
        run.wait_for_step()
        assert len(_processes_of(out)) >= 3          # torchrun and two workers
        (os.killpg if to_group else os.kill)(run.proc.pid, sig)
        took = run.wait(STOP_S + 20)
        assert took < STOP_S, f"took {took:.1f} s to stop"
        assert run.proc.returncode == code
        _assert_gone(out, 1.0)
    finally:
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
    time.sleep(0.2)
    lines = [ln for ln in "".join(run.stderr).splitlines() if "interrupted" in ln]
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith(f"dynmb run: interrupted ({signal.Signals(sig).name}), stopped torchrun and 2 workers")
    steps = _assert_complete_steps(out)
    assert steps and steps == list(range(len(steps)))
    assert f"tables hold step{'s' if len(steps) > 1 else ''} 0" in lines[0]
    runs = pd.read_csv(out / "runs.csv")
    assert list(runs["status"]) == ["interrupted"]


def test_workers_die_with_a_killed_launcher(tmp_path):
    out = tmp_path / "out"
    run = _Run(out)
    try:
        run.wait_for_step()
        assert len(_processes_of(out)) >= 3
        run.proc.send_signal(signal.SIGKILL)
        run.proc.wait(5)
        _assert_gone(out, STOP_S)
    finally:
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
