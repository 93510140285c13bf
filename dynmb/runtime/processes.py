"""Process control of a launch: stop signals, the parent-death signal, stopping a process tree.

- ``StopSignals``: a ``with`` block (main thread) in which SIGINT and SIGTERM are recorded, not
  raised, so that the launcher can stop torchrun and its workers itself.
- ``set_parent_death_signal`` / ``die_with_parent``: Linux ``prctl(PR_SET_PDEATHSIG)``: the kernel
  kills a child (torchrun, a worker) when its parent dies.
- ``wait_or_stop(proc, guard_s, stop)``: poll ``proc`` every 0.1 s; past the wall-clock guard or
  on a recorded signal, ``stop_job`` it and say how waiting ``Ended``.
- ``stop_job(proc)``: the processes below ``proc`` are read from ``/proc`` (ppid links, zombies
  skipped); SIGTERM to ``proc``, its process group and every descendant, SIGKILL to what is left
  after a grace period, then wait for ``proc`` and its descendants.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Ended", "StopSignals", "set_parent_death_signal", "die_with_parent", "wait_or_stop", "stop_job",
           "alive"]

PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Ended:
    """How waiting for torchrun ended."""

    how: str            # "exited", "timeout" or "signal"
    signum: int | None = None
    stopped: int = 0    # workers stopped


class StopSignals:
    """While in the ``with`` block (main thread only), SIGINT, SIGTERM and SIGHUP (a closed terminal:
    it stops the job as SIGTERM does) are recorded in ``received`` (the first one, as it came) instead
    of raising or ending the process; the old handlers come back after."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._old: dict[int, Any] = {}

    def _on(self, signum: int, _frame: object) -> None:
        if self.received is None:
            self.received = signum

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                self._old[sig] = signal.signal(sig, self._on)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def _libc_prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):   # pragma: no cover - no prctl
        return None


_PRCTL = _libc_prctl()   # looked up here: a forked child (preexec_fn) only calls it


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Linux: have the kernel send ``sig`` to this process when its parent dies (a no-op elsewhere)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def die_with_parent() -> None:
    """``preexec_fn`` of a child the kernel kills (SIGKILL) when this process dies."""
    set_parent_death_signal(signal.SIGKILL)


def wait_or_stop(proc: subprocess.Popen, guard_s: float, stop: StopSignals) -> Ended:
    """Wait for ``proc``; past ``guard_s``, or on a stop signal, stop it and its workers."""
    t0 = time.monotonic()
    while proc.poll() is None:
        if stop.received is not None:
            return Ended("signal", stop.received, stop_job(proc))
        if time.monotonic() - t0 > guard_s:
            return Ended("timeout", None, stop_job(proc))
        time.sleep(0.1)
    return Ended("exited")


def stop_job(proc: subprocess.Popen, grace_s: float = 3.0) -> int:
    """Stop torchrun (``proc``, in its own session) and every process below it (its workers run in
    sessions of their own): SIGTERM to all, SIGKILL to what is left after ``grace_s``; waits for
    ``proc``. Returns the number of processes stopped below torchrun (its workers)."""
    below = _descendants(proc.pid)
    targets = [proc.pid, *below]
    for pid in targets:
        _signal(pid, signal.SIGTERM)
    _signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (proc.poll() is None or any(alive(p) for p in below)):
        time.sleep(0.05)
    for pid in targets:
        if alive(pid):
            _signal(pid, signal.SIGKILL)
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p) for p in below):
        time.sleep(0.05)
    return len(below)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """``(state, ppid)`` of ``pid`` from ``/proc`` (None when it is gone or there is no ``/proc``)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    stat = _proc_stat(pid)
    return stat is not None and stat[0] != "Z"


def _descendants(root: int) -> list[int]:
    """Every live process below ``root`` (from ``/proc``; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if entry.name.isdigit():
            stat = _proc_stat(int(entry.name))
            if stat is not None and stat[0] != "Z":
                children.setdefault(stat[1], []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
