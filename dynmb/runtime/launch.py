"""Start a real pipeline run through torchrun and report failures rank by rank.

``launch_job(job, nproc)`` writes ``<job.out_dir>/spec.json`` (a ``JobSpec``) and runs, as a
child process in its own session::

    python -m torch.distributed.run --standalone --nproc-per-node P \\
        -m dynmb.runtime.worker --spec out_dir/spec.json

streaming its output (unless ``quiet``), and returns a ``LaunchResult``: the exit code and
one line per failed rank (``dynmb.run`` does it for ``RunConfig``s). The same worker module
runs under a user's own ``torchrun --nnodes N --node-rank K --rdzv-endpoint HOST:PORT ...
-m dynmb.runtime.worker --spec SPEC`` for multi-node runs (see ``dynmb.runtime.worker``).

Before torchrun starts, ``JobSpec.check()`` checks the job (names, files, output folder, run
ids: a bad input costs no torchrun start and writes nothing) and the rank count, and
``preflight.preflight`` what the ranks would refuse: every stage built on the meta device, the first
batches planned as the ranks will plan them.

Faults never hang: the worker's process groups time out after ``run_cfg.timeout_s``; a
rank that raises writes ``out_dir/errors/rank<k>.txt`` and exits 1, and torchrun's agent
then stops the others. This launcher adds a wall-clock guard and, on failure, logs
(``logging``, level ERROR) one line per failed rank: the error of every rank that left an
error file, and for the rank torchrun names as the root cause without such a file "rank k
died (exit code / signal) without a Python error".

One writer per results folder: ``launch_job`` holds ``dynmb.io.outdir.lock_out_dir`` on the job's
folder from before ``spec.json`` is written until the ``runs`` rows are finished; a second job
into the same folder is refused at once naming the holder, and a file there named like a dynmb
table that is not one is refused untouched.

Stopping: torchrun runs in its own session (a terminal's Ctrl-C reaches only the launcher)
with the kernel told to kill it when the launcher dies (``PR_SET_PDEATHSIG``; its workers
die with it, ``worker.exit_with_parent``). SIGINT, SIGTERM or SIGHUP (a closed terminal) to the launcher while
``launch_job`` waits (main thread) -- and the wall-clock guard -- stop torchrun and every
process below it (``processes.stop_job``: SIGTERM, SIGKILL after 3 s); the result then has
``returncode`` 128 + the signal (130, 143, 129) and ``signal`` set; from the signal on, the workers' and
torchrun's output (its ``SignalException`` traceback) is no longer streamed, the launcher's one line says it. After torchrun exits the
launcher finishes the job's ``runs`` rows (``status`` ok / failed / interrupted, ``error``:
the first failure line; in a job that failed no row keeps ``ok`` unless its case was closed
before the failure, so a run whose command exits non-zero never reads ``ok``, and a status that
cannot be written, ``ENOSPC``, is one more failure line naming the file) and, unless the job succeeded, drops ``actions``/``memory`` rows of
steps without a ``steps`` row, so the tables hold complete steps only (``complete_steps``); every row of
the job's runs gets a ``case`` column (the run's label, else its method: ``dynmb.io.results.tag_runs``).
``write_spec`` gives a run spec's JSON form, for scripts that build jobs as dicts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from tqdm.auto import tqdm

from dynmb.core.config import RunConfig
from dynmb.io.hostinfo import cores_warning
from dynmb.io.outdir import lock_out_dir
from dynmb.io.results import ResultsError, drop_incomplete_steps, run_ids_in, set_run_status, tag_runs
from dynmb.runtime.preflight import preflight
from dynmb.runtime.processes import Ended, StopSignals, alive, die_with_parent, wait_or_stop
from dynmb.runtime.spec import JobSpec, RunSpec

__all__ = ["launch_job", "write_spec", "LaunchResult", "default_backend_device", "failure_lines",
           "PROGRESS"]

logger = logging.getLogger(__name__)

PROGRESS = "[dynmb step] "   # rank 0 prints one such line per finished step (run id, step, seconds)


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
    from dynmb.runtime.device import cuda_available

    return ("nccl", "cuda") if cuda_available() else ("gloo", "cpu")


def write_spec(run_cfg: RunConfig, out_dir: str | Path, *, verify: bool = False, allow_over_limit: bool = False,
               memory_model: str | None = None, run_id: str | None = None, oversize: str | None = None,
               label: str | None = None) -> dict[str, Any]:
    """The JSON form of one run's spec (``RunSpec.create(...).to_dict()``); ``oversize``
    overrides ``run_cfg.oversize``."""
    if oversize is not None:
        run_cfg = replace(run_cfg, spec=run_cfg.spec.with_(oversize=oversize))
    return RunSpec.create(run_cfg, out_dir, run_id=run_id, label=label, verify=verify,
                          allow_over_limit=allow_over_limit, memory_model=memory_model).to_dict()


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
    for case in job.cases:                     # what the ranks would refuse: the stages, the first batches
        preflight(case)
    with lock_out_dir(job.out_dir) as out:     # one writer per folder; a foreign table refused untouched
        return _launch_locked(job, nproc, out, guard_s, quiet=quiet, progress=progress)


def _launch_locked(job: JobSpec, nproc: int, out: Path, guard_s: float | None, *, quiet: bool,
                   progress: bool) -> LaunchResult:
    """``launch_job`` with the results folder held."""
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
    bar = tqdm(total=job.total_steps, unit="step", desc="steps", file=sys.stderr, mininterval=0.5) \
        if progress else None
    with StopSignals() as stop:
        # torchrun in its own session (a terminal's Ctrl-C reaches only this process, which stops
        # it and its workers), killed by the kernel if this process dies
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True, preexec_fn=die_with_parent)

        pump = _Pump(proc, bar, quiet, stop)
        reader = threading.Thread(target=pump.run, daemon=True)
        reader.start()
        ended = wait_or_stop(proc, guard_s, stop)
    reader.join(5)
    if bar is not None:
        bar.close()
    if ended.how == "exited" and pump.torchrun_signal is not None:    # a signal sent to torchrun itself
        ended = Ended("signal", pump.torchrun_signal, pump.closed_workers)
    return _finish(job, proc, ended, "".join(pump.lines), guard_s)


_DEATH = re.compile(r"Received (?:Signals\.)?(\w+) death signal")
_CLOSING = re.compile(r"Sending process \d+ closing signal")


class _Pump:
    """Streams torchrun's output (unless ``quiet``; ticks the progress bar) and keeps it in ``lines``.
    From a stop signal to the launcher, or torchrun's own "Received N death signal" (a signal sent to
    torchrun itself: SIGHUP, SIGTERM, SIGINT), nothing more is streamed (torchrun's ``SignalException``
    traceback); ``torchrun_signal`` is then that signal and ``closed_workers`` the workers it stopped."""

    def __init__(self, proc: subprocess.Popen, bar: Any, quiet: bool, stop: StopSignals) -> None:
        self.proc, self.bar, self.quiet, self.stop = proc, bar, quiet, stop
        self.lines: list[str] = []
        self.torchrun_signal: int | None = None
        self.closed_workers = 0

    def _death(self, line: str) -> None:
        m = _DEATH.search(line)
        if m is not None and self.torchrun_signal is None:
            name = m.group(1)
            self.torchrun_signal = int(name) if name.isdigit() else int(getattr(signal, name, signal.SIGTERM))
        elif self.torchrun_signal is not None and _CLOSING.search(line):
            self.closed_workers += 1

    def run(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            self._death(line)
            if self.bar is not None and line.startswith(PROGRESS):
                self.bar.set_postfix_str(line[len(PROGRESS):].strip(), refresh=False)
                self.bar.update(1)
            elif not self.quiet and self.stop.received is None and self.torchrun_signal is None:
                sys.stdout.write(line)
                sys.stdout.flush()


def _finish(job: JobSpec, proc: subprocess.Popen, ended: Ended, log: str, guard_s: float) -> LaunchResult:
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
    closed = set() if rc == 0 else _closed_cases(job)
    for out_dir, ids in by_dir.items():
        _remove_stale_temp_files(Path(out_dir))
        try:
            if rc == 0:
                set_run_status(out_dir, ids, "ok")
            else:       # a failed job: no row says ok unless its case was closed before the failure
                set_run_status(out_dir, [r for r in ids if r not in closed], status, failures[0], keep=())
            complete.update({r: tuple(s) for r, s in drop_incomplete_steps(out_dir, ids).items()})
            tag_runs(out_dir, {c.run_id: {"case": c.display_label} for c in job.cases if c.run_id in ids})
        except (OSError, ResultsError) as e:           # ENOSPC, a table cut by it: one line naming the file
            fname, strerror = getattr(e, "filename", None), getattr(e, "strerror", None)
            line = (f"dynmb run: writing the runs' status in {out_dir} failed: "
                    f"{f'{fname}: {strerror}' if fname and strerror else e}")
            failures.append(line)
            rc = rc or 1
    if rc != 0 and ended.how != "signal":
        for line in failures:
            logger.error("%s", line)
    elif ended.how == "signal":
        logger.info("%s", failures[0])
    return LaunchResult(rc, tuple(failures), ended.how == "timeout", ended.signum, ended.stopped, complete)


def _closed_cases(job: JobSpec) -> set[str]:
    """Run ids of the cases a failed job finished for good: cases run one after another (not
    interleaved) are closed (tables written whole) before the next one starts, so a case followed by
    one with a ``runs`` row is done; the last one that started may have failed after rank 0 wrote
    ``ok`` (its tables' final write, ``ENOSPC``), so its row does not keep ``ok``."""
    if job.interleave or len(job.cases) < 2:
        return set()
    try:
        started = set().union(*(run_ids_in(d) for d in {c.out_dir for c in job.cases}))
    except (OSError, ResultsError):
        return set()
    return {c.run_id for c, following in zip(job.cases, job.cases[1:]) if following.run_id in started}


def _remove_stale_temp_files(folder: Path) -> None:
    """Remove the temporary files (``dynmb.io.atomic``: ``.<name>.<pid>.<hex>.tmp``) that killed
    processes left in ``folder`` and its ``errors`` folder."""
    for f in [*folder.glob(".*.tmp"), *(folder / "errors").glob(".*.tmp")]:
        pid = f.name.split(".")[-3]
        if pid.isdigit() and not alive(int(pid)):
            with contextlib.suppress(OSError):
                f.unlink()


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
    same = [r for r, e in sorted(files.items()) if r != root and root in files and e == files[root]]
    if root in files:
        also = f" (rank(s) {', '.join(map(str, same))}: the same error)" if same else ""
        out.append(f"dynmb run: rank {root} failed: {files[root]}{also}")
    out += [f"dynmb run: rank {r} failed after rank {root}: {e}" for r, e in sorted(files.items())
            if r != root and r not in same]
    return out
