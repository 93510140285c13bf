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

Faults never hang: the worker's process groups time out after ``run_cfg.timeout_s``; a
rank that raises writes ``out_dir/errors/rank<k>.txt`` and exits 1, and torchrun's agent
then stops the others. This launcher adds a wall-clock guard (it kills the whole process
group it started) and, on failure, logs (``logging``, level ERROR) one line per failed
rank: the error of every rank that left an error file, and for the rank torchrun names as
the root cause without such a file "rank k died (exit code / signal) without a Python
error". ``write_spec``/``launch_spec`` take and give the spec's JSON form, for scripts
that build jobs as dicts.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

import torch
from tqdm.auto import tqdm

from dynmb.config import RunConfig
from dynmb.runtime.spec import HookRef, JobSpec, RunSpec

__all__ = ["launch", "launch_job", "launch_spec", "write_spec", "LaunchResult", "default_backend_device",
           "failure_lines", "PROGRESS"]

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

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def default_backend_device() -> tuple[str, str]:
    """``("nccl", "cuda")`` when CUDA is available, else ``("gloo", "cpu")``."""
    return ("nccl", "cuda") if torch.cuda.is_available() else ("gloo", "cpu")


def launch(run_cfg: RunConfig, out_dir: str | Path, nproc: int, verify: bool = False, *,
           guard_s: float | None = None, allow_over_limit: bool = False, memory_model: str | None = None,
           run_id: str | None = None, hooks: HookRef | None = None) -> int:
    """Run ``run_cfg`` on ``nproc`` local ranks; returns the exit code (0 = success)."""
    want = run_cfg.pipeline.num_ranks * run_cfg.dp
    if nproc != want:
        raise ValueError(f"--nproc {nproc} does not match stages {run_cfg.pipeline.num_stages} / virtual "
                         f"{run_cfg.pipeline.virtual} x dp {run_cfg.dp} = {want} ranks")
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
    """Write ``job`` to ``<out_dir>/spec.json``, run it under torchrun on ``nproc`` ranks, report
    failures. ``quiet``: do not stream the workers' output; ``progress``: a progress bar on
    stderr with one tick per step of every case."""
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
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: list[str] = []
    bar = tqdm(total=job.total_steps, unit="step", desc="steps", file=sys.stderr, mininterval=0.5) \
        if progress else None

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
    timed_out = _wait(proc, guard_s)
    reader.join(5)
    if bar is not None:
        bar.close()
    rc = proc.returncode if not timed_out else 124
    if rc == 0:
        return LaunchResult(0)
    failures = failure_lines(out, "".join(lines))
    if timed_out:
        failures.insert(0, f"dynmb run: no result within the {guard_s:.0f} s wall-clock guard; the job was killed")
    failures = failures or [f"dynmb run: torchrun exited with code {rc}"]
    for line in failures:
        logger.error("%s", line)
    return LaunchResult(rc, tuple(failures), timed_out)


def _wait(proc: subprocess.Popen, guard_s: float) -> bool:
    """Wait for ``proc``; past ``guard_s`` kill its process group. Returns whether it was killed."""
    t0 = time.monotonic()
    while proc.poll() is None:
        if time.monotonic() - t0 > guard_s:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return True
        time.sleep(0.2)
    return False


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
