"""Profile stage times over a (rows, padded_len, documents per row) grid -> a samples table for ``dynmb fit``.

Algorithm. Every stage module (built by ``_stage_module``, the one place this module builds one,
through the model's ``StageFactory``: ``profile`` takes a ``ModelConfig`` of dynmb's families or any
factory of the stage contract, ``dynmb.models.resolve_model``; the samples' sizes, attention kind
and ``attn_work`` follow ``planning_config(factory)``) is timed at every grid point (``grid.default_grid``; the point's microbatch from
``grid.synthetic_microbatch`` through ``make_inputs``; input preparation untimed): ``warmup``
untimed and then timed runs of forward and backward, each on a fresh graph, and with ``split``
the split backward too (``timing.time_stage``). Clocks: CPU with ``threads == 1`` uses the
calling thread's CPU time (``time.thread_time``; torch then runs every op, forward and autograd
backward, on the calling thread), which is what the op costs on a dedicated core and is immune to
other processes time-sharing the machine; ``wall_s`` (``perf_counter``) is recorded next to it.
``clock="wall"`` (or threads > 1) uses wall time; CUDA uses events (``dynmb.runtime.device``).

Repeats are interleaved: pass r times repeat r of every (stage, point) (warm-up runs only on a
point's first visit), so a burst of machine load hits one repeat of many points, not every
repeat of one point, and the per-point median rejects it. Every repeat is one row of the samples
table (``samples``), plus ``mem_*`` columns on repeat 0 (``memory.measure_stage_memory``) unless
``memory=False``. Resumable: (repeat, stage, point) runs already in the output CSV are skipped;
the CSV is rewritten atomically every few seconds and at the end. ``comm=True`` first adds the
gloo ping-pong rows (op="comm", nbytes) of ``pingpong.ping_pong``. Progress and the ETA:
``eta.Progress`` over the analytic estimate of every run, fitted on the runs measured so far; a few
probe runs go first (``_probes_first``: each stage's largest point, a run of a later repeat) so the
fit spans the grid early.

Concurrent mode (``concurrent=True``, CPU): the stages are measured as a pipeline runs them, one
process per stage (1 torch thread each, gloo): every process holds its stage and all of them visit
the same points in the same order, meeting at a barrier before each run, so stage p's op is timed
while the other stages run theirs on the same shape -- the steady state of a pipeline whose
neighbouring microbatches are alike. On a machine whose cores share a last-level cache and memory
bandwidth (the development box: 2 vCPUs, 32 MiB L3), large microbatches (>~5k tokens; stage 1's
logits alone are rows x len x vocab x 4 bytes) are 5-20% slower under this concurrency than alone,
small ones are not; a profile measured alone under-predicts the large ones (see
``studies/prediction/pred_error.py``). Rows get ``concurrent = num_stages`` (1 otherwise).

Settings travel as one ``ProfileSettings``. Command line:
``dynmb profile --model small --stages 2 [--quick] [--concurrent] -o samples.csv``.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence, cast

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist

from dynmb.io.atomic import atomic_path
from dynmb.core.config import ModelConfig
from dynmb.measure.eta import Progress, minutes
from dynmb.measure.grid import Point, as_point, default_grid, estimate_run_seconds, synthetic_microbatch
from dynmb.measure.memory import measure_stage_memory
from dynmb.measure.pingpong import free_port, ping_pong
from dynmb.measure.samples import done_runs, read_resumable, sample_rows
from dynmb.measure.timing import time_stage
from dynmb.models import make_inputs, synthetic_tokens
from dynmb.models.contract import is_family_factory, planning_config, resolve_model
from dynmb.io.results import write_table
from dynmb.runtime.device import device_ops
from dynmb.runtime.hostmem import retain_freed_memory

__all__ = ["ProfileSettings", "profile"]

logger = logging.getLogger("dynmb.measure")

Run = tuple[int, int, int, int, int]
"""One timed run: (repeat, stage, rows, padded_len, docs_per_row)."""


@dataclass(frozen=True, kw_only=True)
class ProfileSettings:
    """How ``profile`` measures (``dynmb profile``'s flags); checked before anything is written."""

    grid: Sequence[tuple[int, int, int | bool]] | None = None
    """Points ``(rows, padded_len, docs_per_row)`` (a bool third element is the older ``packed``
    flag); None: ``default_grid(quick, max_len, token_cap)``."""
    quick: bool = False
    """The quick default grid (about a minute)."""
    max_len: int | None = None
    """Largest padded_len of the default grid."""
    token_cap: int | None = None
    """The default grid's rows x padded_len cap (default 8192 on CPU, 65536 on CUDA)."""
    repeats: int = 5
    """Timed repeats per (stage, point)."""
    warmup: int = 2
    """Untimed runs on a point's first visit."""
    device: str = "cpu"
    """``cpu`` or ``cuda``."""
    threads: int = 1
    """torch threads (1: one rank per core, timed on the thread's CPU clock)."""
    clock: str | None = None
    """``thread``, ``wall`` or ``event``; None: the device's default (``thread`` on CPU with one
    thread, else ``wall``; ``event`` on CUDA)."""
    comm: bool = False
    """Also measure the gloo ping-pong (``op="comm"`` rows)."""
    memory: bool = True
    """``mem_*`` columns on repeat 0 of every point."""
    seed: int = 0
    """Seed of the weights, the synthetic microbatches and their tokens."""
    progress: bool = True
    """A progress bar on a terminal (else ETA log lines)."""
    concurrent: bool = False
    """CPU: one process per stage, every stage of a point timed at once."""
    split: bool = False
    """Also time the split backward (``I`` and ``W`` rows)."""

    def __post_init__(self) -> None:
        if int(self.repeats) < 1 or int(self.warmup) < 0:
            raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={self.repeats}, "
                             f"warmup={self.warmup}")
        device_ops(self.device)      # ValueError naming the supported devices
        if self.concurrent and self.device != "cpu":
            raise ValueError("concurrent profiling is for CPU stages (one process per stage on one host)")

    def resolved_clock(self) -> str:
        """``clock``, or the device's default for ``threads``."""
        if self.clock:
            return self.clock
        default = device_ops(self.device).default_clock
        return "wall" if default == "thread" and self.threads != 1 else default


def _stage_module(model: Any, stage: int, num_stages: int, settings: ProfileSettings,
                  device: torch.device | None = None) -> torch.nn.Module:
    """Stage ``stage`` of ``num_stages`` of ``model`` (a ``ModelConfig`` or a ``StageFactory``) with the
    profile's seeded weights, built by its factory."""
    return cast(torch.nn.Module, resolve_model(model).build_stage(stage, num_stages, seed=settings.seed, device=device))


def profile(cfg: Any, num_stages: int, settings: ProfileSettings | None = None, *,
            output: str | Path | None = None, **overrides: Any) -> pd.DataFrame:
    """Measure every stage over the grid; return (and write to ``output``) the samples.

    ``cfg``: a ``ModelConfig`` (dynmb's family) or a ``StageFactory`` (a model of the stage contract).
    ``settings`` (default ``ProfileSettings()``) with ``overrides`` (its fields by name, e.g.
    ``profile(cfg, 2, quick=True, repeats=1)``); see the module doc."""
    settings = replace(settings or ProfileSettings(), **overrides)
    factory = resolve_model(cfg)
    cfg = planning_config(factory)
    if settings.concurrent and not is_family_factory(factory):
        raise ValueError(f"concurrent profiling rebuilds the model in each process from its ModelConfig: not for a "
                         f"model of your own ({type(factory).__name__}); profile it without --concurrent")
    torch.set_num_threads(int(settings.threads))
    dev = torch.device(settings.device)
    ops = device_ops(dev)
    if not ops.available():
        raise ValueError(f"device {dev.type} requested but torch sees none on this host")
    if not ops.allocator_stats:
        retain_freed_memory()   # measure under the allocator policy the runtime uses
    clock = settings.resolved_clock()
    settings = replace(settings, clock=clock)
    grid = [as_point(g) for g in settings.grid] if settings.grid is not None else default_grid(
        quick=settings.quick, max_len=settings.max_len,
        token_cap=settings.token_cap or (None if dev.type == "cpu" else 65536))
    base = {"device": ops.name(), "threads": int(settings.threads), "clock": clock,
            "torch_version": torch.__version__, "model": cfg.name, "attention": cfg.attention,
            "num_stages": int(num_stages), "concurrent": int(num_stages) if settings.concurrent else 1,
            **{k: v for k, v in cfg.to_dict().items() if k not in ("name", "attention")}}   # every field
    old = read_resumable(output, base)
    if settings.comm and not (len(old) and (old["op"] == "comm").any()):  # first: before the grid heats the machine
        c = ping_pong(threads=settings.threads)
        old = pd.concat([old, c.assign(stage=-1, op="comm", rows=0, padded_len=0, tokens=0, packed=False,
                                       wall_s=c["time_s"], **{**base, "clock": "wall"})], ignore_index=True)
        if output is not None:
            write_table(old, output, parquet=False)
    done = done_runs(old)
    todo = [(r, p, *pt) for r in range(settings.repeats) for pt in grid for p in range(num_stages)
            if (r, p, *pt) not in done]
    todo.sort(key=lambda x: (x[0], x[2] * x[3], x[4], x[1]))
    if settings.concurrent:
        df = pd.concat([old, pd.DataFrame(_profile_concurrent(cfg, num_stages, todo, settings, base))],
                       ignore_index=True)
        if output is not None:
            write_table(df, output, parquet=False)
        return df
    def size(run: Run) -> float:       # the run's estimated seconds (attention's s^2 included), not its tokens
        return estimate_run_seconds(cfg, num_stages, run[1], run[2:], seed=settings.seed)
    return _profile_alone(factory, num_stages, _probes_first(todo, size), old, settings, base, output)


def _probes_first(todo: list[Run], size: Callable[[Run], float]) -> list[Run]:
    """``todo`` with a few of its runs moved to the front, so the ETA's fit (``eta.Eta``) spans the grid
    from the start: every stage's largest point by ``size`` of the first repeat left (warm-up and memory
    columns included), then of a later repeat (the op alone), and the smallest point of a later repeat."""
    if not todo:
        return todo
    first = todo[0][0]
    stages = sorted({r[1] for r in todo})
    probes = [max((r for r in todo if r[0] == first and r[1] == p), key=size)
              for p in stages if any(r[0] == first and r[1] == p for r in todo)]
    later = [r for r in todo if r[0] > first]
    if later:
        probes += [max((r for r in later if r[1] == p), key=size) for p in stages if any(r[1] == p for r in later)]
        probes.append(min(later, key=lambda r: (size(r), r[1])))
    moved = set(probes)
    return probes + [r for r in todo if r not in moved]


def _memory_columns(cfg: Any, num_stages: int, stage: int, point: Point, device: Any = "cpu") -> dict:
    """``mem_*`` columns of ``measure_stage_memory`` at ``point`` (one-document rows unless packed)."""
    b, s, d = point
    return {f"mem_{k}": v for k, v in measure_stage_memory(cfg, num_stages, stage, b, s, packed=d > 1,
                                                           device=device).items()
            if isinstance(v, (int, float, np.integer, np.floating))}


def _run_estimates(cfg: ModelConfig, num_stages: int, items: list[tuple[Point, list[int], bool]],
                   settings: ProfileSettings) -> list[float]:
    """Estimated wall seconds per item (point, stages run, first visit?): the slowest stage
    when stages run at once (one per item), the sum otherwise."""
    cache: dict = {}

    def one(p: int, pt: Point) -> float:
        if (p, pt) not in cache:
            cache[(p, pt)] = estimate_run_seconds(cfg, num_stages, p, pt, seed=settings.seed)
        return cache[(p, pt)]
    return [(1 + (settings.warmup if first else 0)) * max(one(p, pt) for p in stages) for pt, stages, first in items]


def _profile_alone(factory: Any, num_stages: int, todo: list[Run], old: pd.DataFrame, settings: ProfileSettings,
                   base: dict, output: str | Path | None) -> pd.DataFrame:
    """Measure ``todo`` (sorted) one stage at a time in this process."""
    dev, seed, clock = torch.device(settings.device), settings.seed, settings.resolved_clock()
    cfg = planning_config(factory)
    stages = [_stage_module(factory, p, num_stages, settings, dev) for p in range(num_stages)] if todo else []
    memory = settings.memory
    seen: set = set()
    items = []
    for r, p, b, s, d in todo:
        items.append(((b, s, d), [p], (p, b, s, d) not in seen))
        seen.add((p, b, s, d))
    est = _run_estimates(cfg, num_stages, items, settings)
    extras = [e / (1 + (settings.warmup if first else 0)) if memory and r == 0 else 0.0   # the memory columns:
              for (r, *_), (_, _, first), e in zip(todo, items, est)]                 # one more run, a fresh stage
    bar = Progress(est, "profile", settings.progress, extras) if todo else None
    rows_out: list[dict] = []
    last_write = time.monotonic()
    for (r, p, b, s, d), (_, _, first), est_s in zip(todo, items, est):
        mb = synthetic_microbatch(b, s, d, seed)
        inputs = make_inputs(mb, synthetic_tokens(mb.lengths, cfg.vocab_size, seed), cfg=cfg, device=dev)
        if first:
            stages[p].zero_grad(set_to_none=False)
        (times,) = time_stage(stages[p], inputs, hidden_size=cfg.d_model, repeats=1,
                              warmup=settings.warmup if first else 0, device=dev,
                              clock=clock, split=settings.split)
        extra = {}
        if memory and r == 0:
            try:
                extra = _memory_columns(factory, num_stages, p, (b, s, d), dev)
            except Exception as e:  # report once, keep profiling times
                logger.warning("profile: memory meter failed (%s); continuing without memory columns", e)
                memory = False
        rows_out += sample_rows(p, mb, cfg, d, times, r, base, extra)
        if output is not None and time.monotonic() - last_write > 5:
            write_table(pd.concat([old, pd.DataFrame(rows_out)], ignore_index=True), output, parquet=False)
            last_write = time.monotonic()
        if bar is not None:
            bar.update(est_s, f"rep {r} stage {p} {b}x{s}/{d}doc F={times[0]:.4f}s")
    if bar is not None:
        bar.close()
    df = pd.concat([old, pd.DataFrame(rows_out)], ignore_index=True)
    if output is not None:
        write_table(df, output, parquet=False)
    return df


# --- concurrent (one process per stage) ----------------------------------------
@dataclass(frozen=True)
class _ConcurrentJob:
    """What each process of ``_profile_concurrent`` measures: the model, the points and where rows go."""

    cfg_dict: dict
    num_stages: int
    points: list
    settings: ProfileSettings
    base: dict
    out_dir: str
    log_level: int = logging.WARNING


def _concurrent_worker(rank: int, port: int, job: _ConcurrentJob) -> None:
    num_stages, points, settings, base, log_level = job.num_stages, job.points, job.settings, job.base, job.log_level
    torch.set_num_threads(int(settings.threads))
    retain_freed_memory()
    cfg = ModelConfig.from_dict(job.cfg_dict)
    seed, warmup = settings.seed, settings.warmup
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_stages)
    try:
        stage = _stage_module(cfg, rank, num_stages, settings)
        memory = settings.memory
        seen: set = set()
        rows: list[dict] = []
        est = _run_estimates(cfg, num_stages, _concurrent_items(points, num_stages), settings)
        if rank == 0 and log_level < logging.WARNING and not logging.getLogger("dynmb").handlers:
            handler = logging.StreamHandler()       # a spawned process: show rank 0's ETA lines
            handler.setFormatter(logging.Formatter("%(message)s"))
            logger.addHandler(handler)
            logger.setLevel(log_level)
        bar = Progress(est, f"profile x{num_stages}", settings.progress) if rank == 0 else None
        for (r, b, s, d, stages_todo), est_s in zip(points, est):
            mb = synthetic_microbatch(b, s, d, seed)
            inputs = make_inputs(mb, synthetic_tokens(mb.lengths, cfg.vocab_size, seed), cfg=cfg)
            first = (b, s, d) not in seen
            seen.add((b, s, d))
            if first:
                stage.zero_grad(set_to_none=False)
            dist.barrier()          # every stage starts this point's runs together
            (times,) = time_stage(stage, inputs, hidden_size=cfg.d_model, repeats=1, warmup=warmup if first else 0,
                                  clock=settings.resolved_clock(), split=settings.split)
            if bar is not None:
                bar.update(est_s, f"rep {r} {b}x{s}/{d}doc F={times[0]:.4f}s")
            if rank not in stages_todo:
                continue
            extra = {}
            if memory and r == 0:
                try:
                    extra = _memory_columns(cfg, num_stages, rank, (b, s, d))
                except Exception:  # the memory columns are optional
                    memory = False
            rows += sample_rows(rank, mb, cfg, d, times, r, base, extra)
        if bar is not None:
            bar.close()
        with atomic_path(os.path.join(job.out_dir, f"rank{rank}.json")) as tmp, open(tmp, "w") as f:
            json.dump(rows, f, default=lambda o: o.item() if hasattr(o, "item") else str(o))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _concurrent_items(points: list, num_stages: int) -> list[tuple[Point, list[int], bool]]:
    """(point, stages run, first visit?) of the concurrent plan: every stage runs every point."""
    seen: set = set()
    items = []
    for _, b, s, d, _ in points:
        items.append(((b, s, d), list(range(num_stages)), (b, s, d) not in seen))
        seen.add((b, s, d))
    return items


def _profile_concurrent(cfg: ModelConfig, num_stages: int, todo: list[Run], settings: ProfileSettings,
                        base: dict) -> list[dict]:
    """Rows of ``todo`` (sorted) measured by one process per stage, all stages of a point at once
    (a stage already measured there runs untimed, as load)."""
    import torch.multiprocessing as mp
    points: dict = {}
    for r, p, b, s, d in todo:
        points.setdefault((r, b, s, d), set()).add(p)
    plist = [(r, b, s, d, sorted(ps)) for (r, b, s, d), ps in points.items()]
    plist.sort(key=lambda x: (x[0], x[1] * x[2], x[3]))
    if not plist:
        return []
    est = sum(_run_estimates(cfg, num_stages, _concurrent_items(plist, num_stages), settings))
    logger.info("profile: %d points x %d stages at once, first estimate %s", len(plist), num_stages, minutes(est))
    with tempfile.TemporaryDirectory() as folder:
        job = _ConcurrentJob(cfg.to_dict(), num_stages, plist, settings, base, folder, logger.getEffectiveLevel())
        mp.start_processes(_concurrent_worker, args=(free_port(), job), nprocs=num_stages, start_method="spawn")
        rows: list[dict] = []
        for rank in range(num_stages):
            with open(os.path.join(folder, f"rank{rank}.json")) as f:
                rows += json.load(f)
    return rows
