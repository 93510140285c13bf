"""The torchrun entry point of ``dynmb run``: one process per pipeline rank.

Single node (what ``dynmb run --nproc 2 ...`` starts)::

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m dynmb.runtime.worker --spec out/spec.json

Multi-node (same spec file on every node, e.g. on a shared file system)::

    torchrun --nnodes 2 --node-rank $NODE --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint $HOST:29500 \\
        -m dynmb.runtime.worker --spec /shared/out/spec.json

The spec file is a ``JobSpec`` (``dynmb.runtime.spec``; ``launch`` writes it): one run, or
the cases of a job run in the same process group (start-up paid once), one after another
or, with ``interleave`` (CPU), round by round: step k of every case, in a fresh random order each
round (``round_order``: seeded by the job's ``order_seed``; rotated by one without one), before step
k + 1 (``run_cases``; what ``dynmb compare`` does on CPU); the steps rows record ``round_position``.

Algorithm per run
-----------------
Set-up (``state.RunState``, collective): topology and process groups
(``dynmb.runtime.topology``), this rank's stages and Adam, the models and the trace; on
CPU the heap is faulted in up to twice the memory limit (``hostmem.prefault``); rank 0
appends the run's ``runs`` row. With ``prewarm`` every distinct microbatch shape runs
once. Then every step ``k`` (warm-up steps first, logged with ``warmup=True``):

0. on CPU, the cost model the step plans with is calibrated on every step the job measured
   before it (``RunState.calibrate``: a scale per stage and op, an overhead per action);
1. ``step.run_step``: plan (digests agree), run the actions, sum gradients, Adam, and
   measure; the memory-limit and ``--verify`` checks (``dynmb.runtime.checks``);
2. all reports are all-gathered; rank 0 appends the step's rows to the ``steps``,
   ``actions`` and ``memory`` tables (``dynmb.runtime.records``; atomic, step by step)
   and prints one progress line (``launch.PROGRESS``) for the launcher;
3. any failed check is raised on every rank (``StepCheckError``), naming rank and reason;
4. on CPU the step's actions join the job's calibration history (``RunState.record``); the
   cyclic garbage collector runs between steps only (frozen after set-up, off inside a step).

At the end of each run rank 0 rewrites its ``runs`` row with ``status`` ``ok``, or
``failed`` and the error when the run raised on rank 0. Any exception writes
``out_dir/errors/rank<k>.txt`` (rank, host, error, traceback) and exits with status 1, so
torchrun tears the other ranks down.

A worker never outlives its torchrun agent (``exit_with_parent``): on Linux the kernel sends
it SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``), and a watchdog thread polls
the parent pid everywhere, so killing the launcher (``dynmb run``, which starts torchrun the
same way) leaves no rank training on.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from dynmb.io.atomic import write_text_atomic
from dynmb.io.results import set_run_status
from dynmb.runtime.checkpoint import resume_run, save_due
from dynmb.runtime.checks import PlanDivergenceError, StepCheckError, problem_line
from dynmb.runtime.device import DeviceOps, bind_device, device_ops
from dynmb.runtime.hooks import StepHooks, load_hooks
from dynmb.runtime.hostmem import prefault, retain_freed_memory
from dynmb.runtime.launch import PROGRESS
from dynmb.runtime.processes import set_parent_death_signal
from dynmb.runtime.records import Recorder, StepReport, step_row
from dynmb.runtime.spec import JobSpec, RunSpec
from dynmb.runtime.state import RunState, prewarm
from dynmb.runtime.step import run_step

__all__ = ["main", "run_spec", "run_cases", "round_order", "exit_with_parent", "PlanDivergenceError",
           "StepCheckError"]


def exit_with_parent(poll_s: float = 1.0) -> None:
    """End this process when its parent (the torchrun agent) dies: ``PR_SET_PDEATHSIG`` on
    Linux, and a daemon thread that polls ``os.getppid()`` and exits when it changes."""
    parent = os.getppid()
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent or parent == 1:
        os._exit(1)                          # the parent died before the kernel was told

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="dynmb-parent-watchdog", daemon=True).start()


def _open_run(spec: RunSpec, device: torch.device, recorder: Recorder, hooks: StepHooks | None,
              histories: dict[tuple, list]) -> RunState:
    """Set up one run on this rank; rank 0 records its ``runs`` row. Interleaved runs on the same
    model, stage count and cost model share one calibration history (``histories``)."""
    run = spec.run
    history = histories.setdefault((run.model, run.spec.num_stages, run.cost_model), [])
    state = RunState(spec, device, hooks if hooks is not None else load_hooks(spec.hooks), history)
    state.first_step = resume_run(state)
    if state.rank == 0:
        recorder.run_started(spec, backend=dist.get_backend(), device=str(device),
                             world_size=state.topology.world_size)
    return state


def round_order(cases: int, step: int, seed: int | None) -> list[int]:
    """The order of the cases in round ``step``: a permutation drawn from ``(seed, step)`` (the same on
    every rank), or the order rotated by ``step`` when ``seed`` is None."""
    if seed is None:
        return [(i + step) % cases for i in range(cases)]
    import numpy as np

    return [int(i) for i in np.random.default_rng([int(seed), int(step)]).permutation(cases)]


def _step(state: RunState, step: int, recorder: Recorder, position: int = 0) -> None:
    """Step ``step`` of one run: calibrate, run it, gather the reports, record them, raise any failure."""
    if state.calibrates:
        state.calibrate()
    report, plan, schedule = run_step(state, step)
    reports: list[StepReport | None] = [None] * state.topology.world_size
    dist.all_gather_object(reports, report)
    gathered = [r for r in reports if r is not None]
    shapes = state.note_shapes(plan)
    run = state.run
    problems = [p for r in gathered for p in r.problems]
    if state.rank == 0:
        # the step's actions and memory rows first, its steps row last (after its checks): a
        # reader never sees a step without its measurements, and `verified` means the check passed
        recorder.measurements(state.spec, gathered)
        row = step_row(state.spec, step, plan, gathered, world_size=state.topology.world_size, shapes=shapes,
                       cost_model=state.cost_model, schedule=schedule)
        row["verified"] = bool(state.spec.verify) and not problems
        row["round_position"] = position
        recorder.steps(state.spec, row)
        warm = "warm-up " if step < run.warmup else ""
        print(f"{PROGRESS}{state.spec.run_id} {warm}step {step}: {row['step_s']:.2f} s", flush=True)
    if problems:
        raise StepCheckError(problem_line(step, problems))
    if state.calibrates:
        state.record([a for r in gathered for a in r.actions])
    save_due(state, step)
    gc.collect()


def _finish(states: list[RunState], recorder: Recorder) -> None:
    """Rank 0: the runs ended well; their ``runs`` rows say ``ok``."""
    for state in states:
        if state.rank == 0:
            recorder.run_finished(state.spec, "ok")


def _mark_failed(job: JobSpec, err: BaseException) -> None:
    """Rank 0, after its error file: the ``runs`` rows still ``running`` say ``failed`` and the
    error (the launcher may name the root cause instead, once torchrun exits)."""
    for case in job.cases:
        try:
            set_run_status(case.out_dir, [case.run_id], "failed", f"{type(err).__name__}: {err}")
        except Exception:  # noqa: BLE001 - the run's own error matters more; the launcher marks it
            pass


def _close(states: list[RunState], recorder: Recorder, ops: DeviceOps) -> None:
    """Free the runs' models, gradients and optimizer states before the next case of the job
    starts: modules, hooks and the optimizer form reference cycles that only the cyclic
    collector frees, and on CUDA the next case's measured peak would include them."""
    recorder.close()
    for state in states:
        state.close()
    states.clear()
    gc.collect()
    gc.freeze()         # what outlives a case (imports it made, caches) is the process's: scanned no more
    ops.empty_cache()


def run_cases(specs: Sequence[RunSpec], device: torch.device, *, interleave: bool = False,
              hooks: StepHooks | None = None, order_seed: int | None = None) -> None:
    """Run specs in the current process group: one after another, or round by round.

    ``interleave`` (CPU only): all specs are set up first (their models and optimizers live
    side by side), then each round runs step k of every spec that has one, in the order
    ``round_order(len(specs), k, order_seed)``, so a burst of outside load on a shared machine slows every
    method's step alike instead of whichever method ran during it. Not on CUDA: the other
    specs' states would be in every measured peak.

    Python's cyclic collector, left on, runs a full collection now and then inside a step:
    ~0.1 s of one core over the ~220k objects torch, pandas and scipy leave, and the rank's
    peers wait for it (stalls of 0.2 s were measured mid-step). As Megatron-LM's --manual-gc
    does: freeze what the process holds before the cases (imports) and what outlives each case, keep the
    collector off while a step runs (``step.run_step``), collect between steps (a case's own objects stay
    unfrozen, so closing it frees them). ``hooks`` (tests) replaces every spec's own."""
    if interleave and device.type != "cpu":
        raise ValueError("interleaved cases are for CPU runs (the CUDA peak would count every case's states)")
    if device.type == "cpu":
        # fault the heap in once, before any case: not inside the first steps' actions, and not once
        # per case (each case's set-up then carves into the freed block and the next prefault grows
        # the heap by another 2x limit: 9 interleaved cases at 1 GiB took 17 GB and were OOM-killed)
        prefault(max(spec.run.spec.memory_limit_bytes for spec in specs),
                 local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    gc.collect()
    gc.freeze()
    for group in ([list(specs)] if interleave else [[s] for s in specs]):
        recorder = Recorder()
        histories: dict[tuple, list] = {}    # interleaved runs share their calibration history
        states: list[RunState] = []
        try:
            for spec in group:
                states.append(_open_run(spec, device, recorder, hooks, histories))
                if spec.run.prewarm:
                    prewarm(states[-1])
            gc.collect()
            for step in range(max(s.run.warmup + s.run.steps for s in states)):
                for position, i in enumerate(round_order(len(states), step, order_seed)):
                    state = states[i]
                    if state.first_step <= step < state.run.warmup + state.run.steps:
                        _step(state, step, recorder, position)
            _finish(states, recorder)
        finally:
            _close(states, recorder, device_ops(device))


def run_spec(spec: RunSpec, device: torch.device, *, hooks: StepHooks | None = None) -> None:
    """Run one spec (all its steps) in the current process group."""
    run_cases([spec], device, hooks=hooks)


def _write_error(out_dir: Path, rank: int, err: BaseException) -> None:
    text = (f"rank: {rank}\nhost: {socket.gethostname()}\nerror: {type(err).__name__}: {err}\n\n"
            + "".join(traceback.format_exception(err)))
    write_text_atomic(out_dir / "errors" / f"rank{rank}.txt", text)


def _device(job: JobSpec, local_rank: int) -> torch.device:
    """This rank's device; on CPU one torch thread and the host allocator policy."""
    device = bind_device(job.cases[0].run.device, local_rank)
    if device.type == "cpu":
        torch.set_num_threads(1)
        retain_freed_memory()
    return device


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynmb.runtime.worker", description=__doc__.split("\n")[0])
    parser.add_argument("--spec", required=True, help="spec JSON written by `dynmb run` (launch.launch_job)")
    args = parser.parse_args(argv)
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    if "TORCHELASTIC_RUN_ID" in os.environ:    # started by torchrun's agent (not in-process by a test)
        exit_with_parent()
    out_dir = Path(args.spec).resolve().parent
    job: JobSpec | None = None
    try:
        job = JobSpec.load(args.spec)
        out_dir = Path(job.out_dir)
        device = _device(job, local_rank)
        first = job.cases[0].run
        dist.init_process_group(first.backend, timeout=timedelta(seconds=first.timeout_s),
                                device_id=device_ops(device).group_device())
        run_cases(job.cases, device, interleave=job.interleave and len(job.cases) > 1, order_seed=job.order_seed)
        dist.barrier()
        dist.destroy_process_group()
        return 0
    except BaseException as e:  # noqa: BLE001 - every failure must leave a trace and a non-zero exit
        _write_error(out_dir, rank, e)
        if rank == 0 and job is not None:
            _mark_failed(job, e)
        print(f"[dynmb rank {rank}] {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)   # do not wait for peers stuck in collectives; torchrun tears them down


if __name__ == "__main__":
    sys.exit(main())
