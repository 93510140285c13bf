"""Start a real pipeline run through torchrun and report failures rank by rank.

``launch_job(job, nproc)`` writes ``<job.out_dir>/spec.json`` (a ``JobSpec``) and runs, as a
child process in its own session::

    python -m torch.distributed.run --standalone --nproc-per-node P \\
        -m dynmb.runtime.worker --spec out_dir/spec.json

streaming its output (unless ``quiet``), and returns a ``LaunchResult``: the exit code and
one line per failed rank. ``launch(run_cfg, out_dir, nproc, verify=False)`` does it for one
run. The same worker module runs under a user's own ``torchrun --nnodes N --node-rank K
--rdzv-endpoint HOST:PORT ... -m dynmb.runtime.worker --spec SPEC`` for multi-node runs
(see ``dynmb.runtime.worker``).

Before torchrun starts, ``JobSpec.check()`` checks the job (names, files, output folder, run
ids: a bad input costs no torchrun start and writes nothing) and the rank count.

Faults never hang: the worker's process groups time out after ``run_cfg.timeout_s``; a
rank that raises writes ``out_dir/errors/rank<k>.txt`` and exits 1, and torchrun's agent
then stops the others. This launcher adds a wall-clock guard and, on failure, logs
(``logging``, level ERROR) one line per failed rank: the error of every rank that left an
error file, and for the rank torchrun names as the root cause without such a file "rank k
died (exit code / signal) without a Python error".

Stopping: torchrun runs in its own session (a terminal's Ctrl-C reaches only the launcher)
with the kernel told to kill it when the launcher dies (``PR_SET_PDEATHSIG``; its workers
die with it, ``worker.exit_with_parent``). SIGINT or SIGTERM to the launcher while
``launch_job`` waits (main thread) -- and the wall-clock guard -- stop torchrun and every
process below it (``stop_job``: SIGTERM, SIGKILL after 3 s); the result then has
``returncode`` 128 + the signal (130, 143) and ``signal`` set. After torchrun exits the
launcher finishes the job's ``runs`` rows (``status`` ok / failed / interrupted, ``error``:
the first failure line) and, unless the job succeeded, drops ``actions``/``memory`` rows of
steps without a ``steps`` row, so the tables hold complete steps only (``complete_steps``).
``write_spec``/``launch_spec`` take and give the spec's JSON form, for scripts that build
jobs as dicts.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from tqdm.auto import tqdm

from dynmb.config import RunConfig
from dynmb.hostinfo import cores_warning
from dynmb.results import drop_incomplete_steps, set_run_status
from dynmb.runtime.spec import HookRef, JobSpec, RunSpec

__all__ = ["launch", "launch_job", "launch_spec", "write_spec", "LaunchResult", "default_backend_device",
           "failure_lines", "stop_job", "set_parent_death_signal", "PROGRESS"]

logger = logging.getLogger(__name__)

PROGRESS = "[dynmb step] "   # rank 0 prints one such line per finished step (run id, step, seconds)
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class LaunchResult:
    """How a torchrun job ended."""

    returncode: int
    """0 on success; torchrun's exit code, or 124 when the wall-clock guard killed the job."""
    failures: tuple[str, ...] = ()
    """One line per failed rank (first the guard's, when it fired), or torchrun's exit code."""
    timed_out: bool = False
    """The wall-clock guard killed the job."""
    signal: int | None = None
    """The signal (SIGINT, SIGTERM) that stopped the job; ``returncode`` is then 128 + it."""
    stopped_workers: int = 0
    """Processes below torchrun (its workers) stopped with it."""
    complete_steps: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Run id -> the steps of it that the tables hold complete (every table's rows)."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def interrupted(self) -> bool:
        """Stopped by SIGINT or SIGTERM."""
        return self.signal is not None


def default_backend_device() -> tuple[str, str]:
    """``("nccl", "cuda")`` when CUDA is available, else ``("gloo", "cpu")``. Imports torch (~4 s)
    only here, so that the checks before a launch cost no torch import."""
    import torch

    return ("nccl", "cuda") if torch.cuda.is_available() else ("gloo", "cpu")


def launch(run_cfg: RunConfig, out_dir: str | Path, nproc: int, verify: bool = False, *,
           guard_s: float | None = None, allow_over_limit: bool = False, memory_model: str | None = None,
           run_id: str | None = None, hooks: HookRef | None = None) -> int:
    """Run ``run_cfg`` on ``nproc`` local ranks; returns the exit code (0 = success)."""
    spec = RunSpec.create(run_cfg, out_dir, run_id=run_id, verify=verify, allow_over_limit=allow_over_limit,
                          memory_model=memory_model, hooks=hooks)
    return launch_job(JobSpec.single(spec), nproc, guard_s=guard_s).returncode


def write_spec(run_cfg: RunConfig, out_dir: str | Path, *, verify: bool = False, allow_over_limit: bool = False,
               memory_model: str | None = None, run_id: str | None = None, oversize: str | None = None,
               label: str | None = None) -> dict[str, Any]:
    """The JSON form of one run's spec (``RunSpec.create(...).to_dict()``); ``oversize``
    overrides ``run_cfg.oversize``."""
    if oversize is not None:
        run_cfg = replace(run_cfg, oversize=oversize)
    return RunSpec.create(run_cfg, out_dir, run_id=run_id, label=label, verify=verify,
                          allow_over_limit=allow_over_limit, memory_model=memory_model).to_dict()


def launch_spec(spec: JobSpec | RunSpec | Mapping[str, Any], nproc: int, *, guard_s: float | None = None,
                quiet: bool = False, progress: bool = False) -> int:
    """``launch_job`` of a job, a run, or the JSON form of either; returns the exit code."""
    if isinstance(spec, RunSpec):
        job = JobSpec.single(spec)
    elif isinstance(spec, JobSpec):
        job = spec
    else:
        job = JobSpec.from_dict(spec)
    return launch_job(job, nproc, guard_s=guard_s, quiet=quiet, progress=progress).returncode


def launch_job(job: JobSpec, nproc: int, *, guard_s: float | None = None, quiet: bool = False,
               progress: bool = False) -> LaunchResult:
    """Check ``job`` (``JobSpec.check``: nothing is written when it fails), write it to
    ``<out_dir>/spec.json``, run it under torchrun on ``nproc`` ranks, stop it on SIGINT/SIGTERM
    (from the main thread), finish its ``runs`` rows and report failures. ``quiet``: do not
    stream the workers' output; ``progress``: a progress bar on stderr with one tick per step of
    every case."""
    for case in job.cases:
        want = case.run.pipeline.num_ranks * case.run.dp
        if nproc != want:
            raise ValueError(f"--nproc {nproc} does not match stages {case.run.pipeline.num_stages} / virtual "
                             f"{case.run.pipeline.virtual} x dp {case.run.dp} = {want} ranks")
    job.check()
    out = Path(job.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    errors = out / "errors"
    for f in errors.glob("rank*.txt") if errors.exists() else []:
        f.unlink()
    path = job.save(out / "spec.json")
    if guard_s is None:
        guard_s = 120.0 + sum(4 * c.run.timeout_s for c in job.cases)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "dynmb.runtime.worker", "--spec", str(path)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    if any(c.run.device == "cuda" and c.run.expandable_segments for c in job.cases):
        # fewer fragmented blocks when every microbatch has its own shape (opt out: --no-expandable-segments)
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    logger.info("launching %d rank(s): %s", nproc, " ".join(cmd))
    shared = cores_warning(nproc) if any(c.run.device == "cpu" for c in job.cases) else None
    if shared:
        logger.warning("%s", shared)
    lines: list[str] = []
    bar = tqdm(total=job.total_steps, unit="step", desc="steps", file=sys.stderr, mininterval=0.5) \
        if progress else None
    with _StopSignals() as stop:
        # torchrun in its own session (a terminal's Ctrl-C reaches only this process, which stops
        # it and its workers), killed by the kernel if this process dies
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True, preexec_fn=_torchrun_preexec)

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                if bar is not None and line.startswith(PROGRESS):
                    bar.set_postfix_str(line[len(PROGRESS):].strip(), refresh=False)
                    bar.update(1)
                elif not quiet:
                    sys.stdout.write(line)
                    sys.stdout.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        ended = _wait(proc, guard_s, stop)
    reader.join(5)
    if bar is not None:
        bar.close()
    return _finish(job, proc, ended, "".join(lines), guard_s)


@dataclass(frozen=True)
class _Ended:
    how: str            # "exited", "timeout" or "signal"
    signum: int | None = None
    stopped: int = 0    # workers stopped


def _finish(job: JobSpec, proc: subprocess.Popen, ended: _Ended, log: str, guard_s: float) -> LaunchResult:
    """Finish the job's ``runs`` rows, drop incomplete steps unless it succeeded, report."""
    out = Path(job.out_dir)
    by_dir: dict[str, list[str]] = {}
    for case in job.cases:
        by_dir.setdefault(case.out_dir, []).append(case.run_id)
    if ended.how == "signal":
        assert ended.signum is not None
        rc = 128 + ended.signum
        name = signal.Signals(ended.signum).name
        failures = [f"interrupted by {name}: stopped torchrun and {ended.stopped} worker(s)"]
        status = "interrupted"
    else:
        rc = 124 if ended.how == "timeout" else int(proc.returncode)
        failures = [] if rc == 0 else failure_lines(out, log)
        if ended.how == "timeout":
            failures.insert(0, f"dynmb run: no result within the {guard_s:.0f} s wall-clock guard; the job was killed")
        if rc != 0 and not failures:
            failures = [f"dynmb run: torchrun exited with code {rc}"]
        status = "ok" if rc == 0 else "failed"
    complete: dict[str, tuple[int, ...]] = {}
    for out_dir, ids in by_dir.items():
        _remove_stale_temp_files(Path(out_dir))
        if rc == 0:
            set_run_status(out_dir, ids, "ok")
        else:
            set_run_status(out_dir, ids, status, failures[0], keep=("ok",))
        complete.update({r: tuple(s) for r, s in drop_incomplete_steps(out_dir, ids).items()})
    if rc != 0 and ended.how != "signal":
        for line in failures:
            logger.error("%s", line)
    elif ended.how == "signal":
        logger.info("%s", failures[0])
    return LaunchResult(rc, tuple(failures), ended.how == "timeout", ended.signum, ended.stopped, complete)


def _remove_stale_temp_files(folder: Path) -> None:
    """Remove the temporary files (``dynmb.atomic``: ``.<name>.<pid>.<hex>.tmp``) that killed
    processes left in ``folder`` and its ``errors`` folder."""
    for f in [*folder.glob(".*.tmp"), *(folder / "errors").glob(".*.tmp")]:
        pid = f.name.split(".")[-3]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                f.unlink()


class _StopSignals:
    """While in the ``with`` block (main thread only), SIGINT and SIGTERM are recorded in
    ``received`` instead of raising or ending the process; the old handlers come back after."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._old: dict[int, Any] = {}

    def _on(self, signum: int, _frame: object) -> None:
        if self.received is None:
            self.received = signum

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
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
        _PRCTL(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def _torchrun_preexec() -> None:
    set_parent_death_signal(signal.SIGKILL)


def _wait(proc: subprocess.Popen, guard_s: float, stop: _StopSignals) -> _Ended:
    """Wait for ``proc``; past ``guard_s``, or on a stop signal, stop it and its workers."""
    t0 = time.monotonic()
    while proc.poll() is None:
        if stop.received is not None:
            return _Ended("signal", stop.received, stop_job(proc))
        if time.monotonic() - t0 > guard_s:
            return _Ended("timeout", None, stop_job(proc))
        time.sleep(0.1)
    return _Ended("exited")


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
    while time.monotonic() < deadline and (proc.poll() is None or any(_alive(p) for p in below)):
        time.sleep(0.05)
    for pid in targets:
        if _alive(pid):
            _signal(pid, signal.SIGKILL)
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in below):
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


def _alive(pid: int) -> bool:
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


_ROOT = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)
_FAILED = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n(?:[^\n]*\n)??\s*exitcode\s*:\s*(-?\d+)")


def failure_lines(out_dir: Path, log: str) -> list[str]:
    """One line per failed rank: its Python error, or how it died when it left none.

    The root cause is a rank that died without a Python error (killed, ``os._exit``), when
    torchrun's failure summary lists one: the others' errors (connection reset, timeout) are
    what its death did to them, whichever torchrun happened to observe first.
    """
    files = {}
    for f in sorted((out_dir / "errors").glob("rank*.txt")) if (out_dir / "errors").exists() else []:
        text = f.read_text()
        m = re.search(r"^error: (.*)$", text, re.M)
        files[int(f.stem[4:])] = m.group(1) if m else text.strip().splitlines()[-1]
    died = {int(r): int(c) for r, c in _FAILED.findall(log) if int(r) not in files and int(c) != 0}
    m = _ROOT.search(log)        # torchrun's summary; the other listed failures are ranks it stopped
    # ranks torchrun itself stopped (SIGTERM) after the first failure are not causes
    caused = {r: c for r, c in died.items() if c != -signal.SIGTERM}
    root: int | None
    if caused:
        root, code = min(caused.items())
    else:
        root = int(m.group(1)) if m else (min(files) if files else None)
        code = int(m.group(2)) if m else 0
    out = []
    if root is not None and root not in files and (died or m):
        signalled = code < 0 and -code in signal.valid_signals()
        how = f"signal {signal.Signals(-code).name}" if signalled else f"exit code {code}"
        out.append(f"dynmb run: rank {root} died ({how}) without a Python error")
    if root in files:
        out.append(f"dynmb run: rank {root} failed: {files[root]}")
    out += [f"dynmb run: rank {r} failed after rank {root}: {e}" for r, e in sorted(files.items()) if r != root]
    return out
