"""Planner processes of ``dynmb.runtime.planahead``: plain child processes fed through pipes.

``PlannerPool(n)`` starts ``n`` children (``python -m dynmb.runtime.planahead_procs``; the kernel kills
each with its rank, ``processes.set_parent_death_signal``). A child reads pickled jobs ``(fn, args)``
from its stdin and writes ``(True, fn(*args))`` or ``(False, error)`` to its stdout (its own prints
and logs go to stderr). In the rank one thread per child takes the next job from a shared queue,
sends it and reads the answer into the job's ``Future``.

No ``multiprocessing`` machinery: no semaphores, so no resource tracker (a killed tracker left
``KeyError`` tracebacks on a run that succeeded) and no leaked-semaphore warnings. A child that dies
(end of its stdout) fails its job's future with ``PlannerDied`` saying how (exit code or signal);
``stopped()`` names a child stopped by a signal (SIGSTOP, SIGTSTP: ``/proc`` state ``T``), which
would otherwise leave its job waiting forever.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

from dynmb.runtime.processes import die_with_parent

__all__ = ["PlannerPool", "PlannerDied"]


class PlannerDied(RuntimeError):
    """A planner process ended (or stopped) while it held a job."""


def _how(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0 and -code in signal.valid_signals():
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _state(pid: int) -> str | None:
    """The ``/proc`` state letter of ``pid`` (None when it cannot be read)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()[0]


class PlannerPool:
    """``n`` planner processes; ``submit(fn, *args)`` returns a ``Future`` of ``fn(*args)``."""

    def __init__(self, n: int) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",    # the rank's cores are for training
               "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # the rank's imports (as spawn passes them)
        self._procs = [subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=env, preexec_fn=die_with_parent)
                       for _ in range(n)]
        self._jobs: queue.Queue[tuple[Future, Callable[..., Any], tuple] | None] = queue.Queue()
        self.busy: dict[int, bool] = {p.pid: False for p in self._procs}
        self._threads = [threading.Thread(target=self._serve, args=(p,), daemon=True) for p in self._procs]
        for t in self._threads:
            t.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _serve(self, proc: subprocess.Popen) -> None:
        """One child's thread: send it jobs one at a time and set their futures."""
        assert proc.stdin is not None and proc.stdout is not None
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                job_bytes = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:  # noqa: BLE001 - a job that does not pickle is its step's error
                future.set_exception(e)
                continue
            self.busy[proc.pid] = True
            try:
                proc.stdin.write(job_bytes)
                proc.stdin.flush()
                ok, value = pickle.load(proc.stdout)
            except (OSError, EOFError, pickle.UnpicklingError, ValueError):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)
                future.set_exception(PlannerDied(f"planner process {proc.pid} died ({_how(proc.poll())})"))
                self._jobs.put(None)       # the pool is broken: let the other threads end too
                return
            finally:
                self.busy[proc.pid] = False
            (future.set_result if ok else future.set_exception)(value)

    def stopped(self) -> str | None:
        """A line naming a busy planner process that a signal stopped (or that died), else None."""
        for proc in self._procs:
            state = _state(proc.pid)
            if state in ("T", "t") and self.busy.get(proc.pid):
                return f"planner process {proc.pid} stopped (state {state}: SIGSTOP/SIGTSTP)"
        return None

    def close(self) -> None:
        """Stop every planner process (its jobs are dropped) and reap it."""
        for _ in self._procs:
            self._jobs.put(None)
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()            # SIGKILL ends a stopped child too
        for proc in self._procs:
            for stream in (proc.stdin, proc.stdout):
                with contextlib.suppress(OSError):
                    if stream is not None:
                        stream.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)


def _serve_stdin() -> None:
    """A planner process: answer the jobs on stdin until it closes."""
    jobs, answers = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)                      # the library's own prints go to stderr, not into the answers
    sys.stdout = sys.stderr
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:      # pragma: no cover - torch is a dependency of the runtime
        pass
    while True:
        try:
            fn, args = pickle.load(jobs)
        except EOFError:
            return
        try:
            answer: tuple[bool, Any] = (True, fn(*args))
        except Exception as e:  # noqa: BLE001 - the rank raises it at the step that needs the plan
            answer = (False, e)
        try:
            data = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - an error that does not pickle: its text
            data = pickle.dumps((False, RuntimeError(f"{type(answer[1]).__name__}: {e}")))
        answers.write(data)
        answers.flush()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
        _serve_stdin()
