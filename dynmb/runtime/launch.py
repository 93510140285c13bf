"""Start a real pipeline run through torchrun and report failures rank by rank.

``launch(run_cfg, out_dir, nproc, verify=False)`` writes ``out_dir/spec.json``
and runs, as a child process in its own session::

    python -m torch.distributed.run --standalone --nproc-per-node P \\
        -m dynmb.runtime.worker --spec out_dir/spec.json

streaming its output, and returns its exit code. The same worker module runs
under a user's own ``torchrun --nnodes N --node-rank K --rdzv-endpoint HOST:PORT
... -m dynmb.runtime.worker --spec SPEC`` for multi-node runs (see
``dynmb.runtime.worker``).

Faults never hang: the worker's process groups time out after
``run_cfg.timeout_s``; a rank that raises writes ``out_dir/errors/rank<k>.txt``
and exits 1, and torchrun's agent then stops the others. This launcher adds a
wall-clock guard (it kills the whole process group it started) and, on failure,
prints one line per failed rank: the error of every rank that left an error
file, and for the rank torchrun names as the root cause without such a file
"rank k died (exit code / signal) without a Python error".
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from dynmb.config import RunConfig

__all__ = ["launch", "launch_spec", "write_spec", "default_backend_device", "failure_lines", "PROGRESS"]

PROGRESS = "[dynmb step] "   # rank 0 prints one such line per finished step (run id, step, seconds)


def default_backend_device() -> tuple[str, str]:
    """``("nccl", "cuda")`` when CUDA is available, else ``("gloo", "cpu")``."""
    import torch

    return ("nccl", "cuda") if torch.cuda.is_available() else ("gloo", "cpu")


def write_spec(run_cfg: RunConfig, out_dir: str | Path, *, verify: bool = False, allow_over_limit: bool = False,
               memory_model: str | None = None, fault: dict[str, Any] | None = None, run_id: str | None = None,
               oversize: str | None = None) -> dict[str, Any]:
    """The worker's spec for one run (also written to ``out_dir/spec.json`` by ``launch``);
    ``oversize`` overrides ``run_cfg.oversize``."""
    if oversize is not None:
        run_cfg = replace(run_cfg, oversize=oversize)
    return {
        "run": run_cfg.to_dict(), "out_dir": str(Path(out_dir).resolve()),
        "run_id": run_id or f"{run_cfg.method}-{run_cfg.pipeline.schedule}-{uuid.uuid4().hex[:8]}",
        "verify": verify, "allow_over_limit": allow_over_limit, "memory_model": memory_model,
        "fault": fault,
    }


def launch(run_cfg: RunConfig, out_dir: str | Path, nproc: int, verify: bool = False, *,
           guard_s: float | None = None, **spec_kw: Any) -> int:
    """Run ``run_cfg`` on ``nproc`` local ranks; returns the exit code (0 = success)."""
    want = run_cfg.pipeline.num_ranks * run_cfg.dp
    if nproc != want:
        raise ValueError(f"--nproc {nproc} does not match stages {run_cfg.pipeline.num_stages} / virtual "
                         f"{run_cfg.pipeline.virtual} x dp {run_cfg.dp} = {want} ranks")
    spec = write_spec(run_cfg, out_dir, verify=verify, **spec_kw)
    return launch_spec(spec, nproc, guard_s=guard_s)


def launch_spec(spec: dict[str, Any], nproc: int, *, guard_s: float | None = None, quiet: bool = False,
                progress: bool = False) -> int:
    """Write ``spec`` to ``<out_dir>/spec.json``, run it under torchrun on ``nproc`` ranks, report failures."""
    out = Path(spec["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    errors = out / "errors"
    for f in errors.glob("rank*.txt") if errors.exists() else []:
        f.unlink()
    path = out / "spec.json"
    path.write_text(json.dumps(spec, indent=1))
    if guard_s is None:
        cases = spec.get("cases") or [spec]
        guard_s = 120.0 + sum(4 * c["run"]["timeout_s"] for c in cases)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "dynmb.runtime.worker", "--spec", str(path)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    runs = [c["run"] for c in spec.get("cases") or [spec]]
    if any(r["device"] == "cuda" and r.get("expandable_segments", True) for r in runs):
        # fewer fragmented blocks when every microbatch has its own shape (opt out: --no-expandable-segments)
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: list[str] = []
    bar = None
    if progress:   # one tick per step of every case, from the PROGRESS lines rank 0 prints
        from tqdm.auto import tqdm

        cases = spec.get("cases") or [spec]
        bar = tqdm(total=sum(c["run"]["warmup"] + c["run"]["steps"] for c in cases), unit="step",
                   desc="steps", file=sys.stderr, mininterval=0.5)

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
    t0 = time.monotonic()
    timed_out = False
    while proc.poll() is None:
        if time.monotonic() - t0 > guard_s:
            timed_out = True
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            break
        time.sleep(0.2)
    reader.join(5)
    if bar is not None:
        bar.close()
    rc = proc.returncode if not timed_out else 124
    if rc == 0 and not quiet and "cases" not in spec:
        print(_summary(out), flush=True)
    if rc != 0:
        msgs = failure_lines(out, "".join(lines))
        if timed_out:
            msgs.insert(0, f"dynmb run: no result within the {guard_s:.0f} s wall-clock guard; the job was killed")
        for m in msgs or [f"dynmb run: torchrun exited with code {rc}"]:
            print(m, file=sys.stderr, flush=True)
    return rc if rc != 0 else 0


def _summary(out: Path) -> str:
    import pandas as pd

    st = pd.read_csv(out / "steps.csv")
    st = st[~st["warmup"]] if "warmup" in st else st
    return (f"dynmb run: ok, {len(st)} measured steps, median step {st['step_s'].median():.3f} s "
            f"(predicted {st['pred_step_s'].median():.3f} s), {st['tokens_per_s'].median():.0f} tokens/s, "
            f"mean bubble {st['mean_bubble'].median():.2f}; tables in {out}")


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
    if caused:
        root, code = min(caused.items())
    else:
        root = int(m.group(1)) if m else (min(files) if files else None)
        code = int(m.group(2)) if m else 0
    out = []
    if root is not None and root not in files and (died or m):
        how = f"signal {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else f"exit code {code}"
        out.append(f"dynmb run: rank {root} died ({how}) without a Python error")
    if root in files:
        out.append(f"dynmb run: rank {root} failed: {files[root]}")
    out += [f"dynmb run: rank {r} failed after rank {root}: {e}" for r, e in sorted(files.items()) if r != root]
    return out
