"""Profile stage times over a (rows, padded_len, documents per row) grid -> a samples table for ``dynmb fit``.

Algorithm. For every stage module of ``build_stages(cfg, P)`` and every grid point
(rows b, padded_len s, docs_per_row k), build a synthetic microbatch with ``make_inputs``:
k = 1 holds one sequence per row (the first row full, the others of random length, so
there is padding); k > 1 fills every row with k documents of random lengths (at least
``MIN_DOC_TOKENS`` each; document-causal attention, positions restarting per document).
The row's attention work ``Microbatch.attention_work(cfg.attention)`` of that exact
microbatch is recorded as ``attn_work`` (b*s^2 for k = 1, sum of s_i^2 for packed rows under
``attention="auto"``). Input preparation is not timed. Then ``warmup`` untimed and
``repeats`` timed runs; each run builds a fresh graph:

    x  = fresh leaf hidden state (requires_grad, as a pipeline receiver holds it)
    F  = time(y = stage(x, inputs))
    B  = time(y.backward(g))      # g: a fixed random grad of y (non-last), or loss.backward()

so backward is timed alone on its own graph; parameter gradients accumulate as over the
microbatches of a step. With ``split`` every run also times the split backward a zero-bubble
schedule runs (``dynmb.runtime.splitbackward``) on a second fresh graph:

    y  = stage(x, inputs)         # recording the Linear calls, untimed
    I  = time(backward_input(y))  # the input's gradient (+ LayerNorm, embedding, bias grads)
    W  = time(backward_weight())  # the deferred Linear weight gradients

and writes ``I`` and ``W`` rows next to ``F`` and ``B``. Clocks: CPU with ``threads == 1`` uses the calling thread's CPU
time (``time.thread_time``; torch then runs every op, forward and autograd backward, on the
calling thread), which is what the op costs on a dedicated core and is immune to other
processes time-sharing the machine; ``wall_s`` (``perf_counter``) is recorded next to it.
``clock="wall"`` (or threads > 1) uses wall time. CUDA: ``torch.cuda.Event`` pairs.
Repeats are interleaved: pass r times repeat r of every (stage, point) (warm-up runs only
on a point's first visit), so a burst of machine load hits one repeat of many points, not
every repeat of one point, and the per-point median rejects it.
Every repeat is one row of the samples table (stage, op, rows, padded_len, tokens, packed,
docs_per_row, attn_work, time_s, wall_s, clock, repeat, device, threads, torch_version, model,
attention, num_stages), plus
``mem_*`` columns when ``dynmb.runtime.meter`` is present. Resumable: (stage, point, repeat)
rows already in the output CSV are skipped; the CSV is rewritten atomically (tmp +
os.replace) every few seconds and at the end; a CSV without ``attn_work`` (profiled before
it was recorded) is refused. ``comm=True`` adds the gloo ping-pong rows (op="comm", nbytes)
of ``dynmb.runtime.pingpong``.

Time estimate. Before measuring, every run is priced with the analytic cost model (FLOPs of
the development CPU's core, attention work included) plus ``RUN_OVERHEAD_S`` per run, and the
progress bar counts those estimated seconds, not points. The ETA (``Eta``: on the bar, and as
INFO log lines that ``dynmb profile`` shows) appears once the first runs are measured: the
estimate of what is left times measured / estimated seconds of what is done, recalibrated after
every run (so large points late in a pass do not make it lie), logged every 30 s or when it
moves by more than a quarter.

Concurrent mode (``concurrent=True``, CPU): the stages are measured as a pipeline runs them,
one process per stage (1 torch thread each, gloo): every process holds its stage and all of
them visit the same points in the same order, meeting at a barrier before each run, so stage
p's op is timed while the other stages run theirs on the same shape -- the steady state of a
pipeline whose neighbouring microbatches are alike. On a machine whose cores share a last-level
cache and memory bandwidth (the development box: 2 vCPUs, 32 MiB L3), large microbatches
(>~5k tokens; stage 1's logits alone are rows x len x vocab x 4 bytes) are 5-20% slower under
this concurrency than alone, small ones are not; a profile measured alone under-predicts the
large ones (see ``experiments/pred_error.py``). Rows get ``concurrent = num_stages`` (1 otherwise).

Command line: ``dynmb profile --model small --stages 2 [--quick] [--concurrent] -o samples.csv``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist

from dynmb.atomic import atomic_path
from dynmb.config import ModelConfig
from dynmb.costmodel import AnalyticCostModel, samples_from_actions
from dynmb.models import build_stage, build_stages, make_inputs, synthetic_tokens
from dynmb.results import write_table
from dynmb.runtime.hostmem import retain_freed_memory
from dynmb.runtime.meter import measure_stage_memory
from dynmb.runtime.pingpong import ping_pong
from dynmb.runtime.splitbackward import backward_input, backward_weight, record_linears
from dynmb.types import Microbatch

__all__ = ["GRID_ROWS", "GRID_LENS", "GRID_DOCS", "PACKED_ROWS", "PACKED_LENS", "MIN_DOC_TOKENS", "default_grid",
           "synthetic_microbatch", "estimate_run_seconds", "time_stage", "profile", "load_samples", "Eta"]

logger = logging.getLogger(__name__)

Point = tuple[int, int, int]
"""A grid point: (rows, padded_len, docs_per_row)."""

GRID_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
GRID_LENS = (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 4096, 8192)
GRID_DOCS = (1, 4, 16, 64)
"""Documents per row; k > 1 only where padded_len >= k * MIN_DOC_TOKENS."""
PACKED_ROWS = (1, 2, 4)
PACKED_LENS = (128, 512, 1024, 2048, 4096)
MIN_DOC_TOKENS = 8
"""Shortest synthetic document (and the least padded_len per document of a packed grid point)."""
RUN_OVERHEAD_S = 0.03
"""Estimated wall seconds per (stage, point) run beyond the op itself (inputs, graph, barrier)."""
_POINT = ["stage", "rows", "padded_len", "docs_per_row"]


def default_grid(*, quick: bool = False, max_len: int | None = None, token_cap: int | None = None,
                 packed_points: bool = True) -> list[Point]:
    """Grid points ``(rows, padded_len, docs_per_row)`` with rows * padded_len <= token_cap.

    Full: one document per row at rows 1..64 x padded_len 32..8192 (powers of two and 1.5x
    up to 2048), token_cap 8192 (one CPU core runs an F+B of 8k tokens on the small preset in
    a few seconds), plus packed rows: rows ``PACKED_ROWS`` x padded_len ``PACKED_LENS`` x
    documents per row ``GRID_DOCS`` (> 1, at least ``MIN_DOC_TOKENS`` tokens per document).
    The long rows matter: causal attention skips its masked blocks only on long rows, so the
    cost per unit of attention work of one long document is below that of short ones.
    Quick: rows {1, 2, 4, 8} x {32, 128, 512}, cap 2048, plus rows {1, 2} x 512 x {4, 16, 64}.
    """
    rows, lens = ((1, 2, 4, 8), (32, 128, 512)) if quick else (GRID_ROWS, GRID_LENS)
    packed_rows, packed_lens = ((1, 2), (512,)) if quick else (PACKED_ROWS, PACKED_LENS)
    cap = token_cap or (2048 if quick else 8192)
    if max_len is not None:
        lens = tuple(s for s in lens if s <= max_len) or (int(max_len),)
        packed_lens = tuple(s for s in packed_lens if s <= max_len)
    pts = [(b, s, 1) for s in lens for b in rows if b * s <= cap]
    if packed_points:
        pts += [(b, s, k) for s in packed_lens for k in GRID_DOCS[1:] for b in packed_rows
                if b * s <= cap and s >= k * MIN_DOC_TOKENS]
    return pts


def _as_point(point: tuple[int, int, int | bool]) -> Point:
    """``(rows, padded_len, docs_per_row)``; a bool third element is the older ``packed`` flag
    (True: 4 documents per row, fewer where the row is short)."""
    b, s, d = point
    if isinstance(d, (bool, np.bool_)):
        d = max(2, min(4, int(s) // MIN_DOC_TOKENS)) if d else 1
    return int(b), int(s), int(d)


def synthetic_microbatch(rows: int, padded_len: int, docs_per_row: int | bool = 1, seed: int = 0) -> Microbatch:
    """A (rows x padded_len) microbatch. One document per row: row 0 full, the others of random
    length >= padded_len/2 (padding). ``docs_per_row`` k > 1: every row filled exactly with k
    documents of random lengths, each >= min(MIN_DOC_TOKENS, padded_len // k) (uniform random
    split points). A bool is the older ``packed`` flag (see ``_as_point``)."""
    rows, padded_len, docs = _as_point((rows, padded_len, docs_per_row))
    if not 1 <= docs <= padded_len:
        raise ValueError(f"docs_per_row must lie in [1, padded_len={padded_len}], got {docs}")
    rng = np.random.default_rng([seed, rows, padded_len, docs])
    if docs == 1:
        lens = np.concatenate([[padded_len], rng.integers(max(1, padded_len // 2), padded_len + 1, size=rows - 1)])
        return Microbatch(np.arange(rows), lens, padded_len, rows)
    shortest = min(MIN_DOC_TOKENS, padded_len // docs)
    spare = padded_len - docs * shortest
    cuts = np.sort(rng.integers(0, spare + 1, size=(rows, docs - 1)), axis=1)
    edges = np.concatenate([np.zeros((rows, 1), np.int64), cuts, np.full((rows, 1), spare)], axis=1)
    lens = (np.diff(edges, axis=1) + shortest).reshape(-1)
    return Microbatch(np.arange(rows * docs), lens, padded_len, rows, row_ids=np.repeat(np.arange(rows), docs))


def estimate_run_seconds(cfg: ModelConfig, num_stages: int, stage: int, point: Point, runs: int = 1,
                         seed: int = 0) -> float:
    """Estimated wall seconds of ``runs`` forward+backward runs of ``stage`` at ``point`` (analytic
    cost model of the development CPU's core, with the point's attention work) + overheads."""
    b, s, d = point
    work = synthetic_microbatch(b, s, d, seed).attention_work(cfg.attention)
    cm = AnalyticCostModel(cfg, num_stages)
    op_s = sum(float(cm.predict(stage, op, b, s, work)) for op in ("F", "B"))
    return runs * (op_s + RUN_OVERHEAD_S)


def _minutes(seconds: float) -> str:
    """``42 s`` under two minutes, else ``3.4 min`` (fixed-point)."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


class Eta:
    """An honest remaining time of a profile, from the runs measured so far.

    Every run has an analytic estimate (``estimate_run_seconds``); after the first
    ``first_runs`` runs (and ``first_s`` seconds) the remaining time is the estimate of what is
    left times measured / estimated seconds of what is done, so it is calibrated on this
    machine and keeps being recalibrated as larger points come. ``update(est_s)`` after each
    run returns a log line when one is due: the first estimate, then every ``every_s`` seconds
    or when the remaining time moved by more than a quarter since the last line."""

    def __init__(self, estimates: list[float], *, first_runs: int = 3, first_s: float = 2.0, every_s: float = 30.0,
                 clock=time.monotonic) -> None:
        self.total_est, self.runs = float(sum(estimates)), len(estimates)
        self.first_runs, self.first_s, self.every_s, self.clock = first_runs, first_s, every_s, clock
        self.t0 = clock()
        self.done_runs, self.done_est = 0, 0.0
        self.last_line_at: float | None = None
        self.last_end: float | None = None      # elapsed + remaining at the last line
        self.last_remaining = 0.0

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def remaining(self) -> float | None:
        """Seconds left (None before the first run is measured)."""
        if self.done_runs == 0 or self.done_est <= 0:
            return None
        return max(0.0, self.total_est - self.done_est) * self.elapsed() / self.done_est

    def update(self, est_s: float) -> str | None:
        self.done_runs += 1
        self.done_est += float(est_s)
        now, left = self.elapsed(), self.remaining()
        if left is None or self.done_runs >= self.runs or self.done_runs < self.first_runs or now < self.first_s:
            return None
        # moved: the projected finish shifted by more than a quarter of what was left (and 10 s)
        moved = self.last_end is not None and abs(now + left - self.last_end) > max(0.25 * self.last_remaining, 10.0)
        if self.last_line_at is not None and now - self.last_line_at < self.every_s and not moved:
            return None
        self.last_line_at, self.last_end, self.last_remaining = now, now + left, left
        return (f"profile: {self.done_runs}/{self.runs} runs in {_minutes(now)}; about {_minutes(left)} left "
                f"(from the runs measured so far; first estimate {_minutes(self.total_est)})")

    def postfix(self) -> str:
        left = self.remaining()
        return "ETA ?" if left is None or self.done_runs < self.first_runs else f"ETA {_minutes(left)}"

    def final(self) -> str:
        return (f"profile: {self.done_runs} runs in {_minutes(self.elapsed())} "
                f"(first estimate {_minutes(self.total_est)})")


class _Progress:
    """Progress of a profile: on a terminal a tqdm bar over estimated seconds with the ``Eta`` in
    it (when ``bar``), else the ``Eta`` lines (INFO); the first estimate and the total always."""

    def __init__(self, estimates: list[float], desc: str, bar: bool) -> None:
        self.eta = Eta(estimates)
        self.bar = None
        if bar and sys.stderr.isatty():
            try:
                from tqdm.auto import tqdm
            except ImportError:  # pragma: no cover
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=self.eta.total_est, desc=desc, unit="est-s",
                                bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed} elapsed{postfix}")
                self.bar.set_postfix_str("ETA ?")
        logger.info("profile: %d runs; first estimate %s (analytic, before any is measured)", self.eta.runs,
                    _minutes(self.eta.total_est))

    def update(self, est_s: float, what: str) -> None:
        line = self.eta.update(est_s)
        if self.bar is not None:
            self.bar.update(est_s)
            self.bar.set_postfix_str(f"{self.eta.postfix()}; {what}")
        if line is not None and self.bar is None:
            logger.info("%s", line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.eta.runs:
            logger.info("%s", self.eta.final())


def _sync_timer(device: torch.device, clock: str):
    """fn -> (out, seconds by ``clock``, wall seconds)."""
    if device.type == "cuda":
        def run(fn):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            w = time.perf_counter()
            a.record()
            out = fn()
            b.record()
            b.synchronize()
            return out, a.elapsed_time(b) / 1e3, time.perf_counter() - w
    else:
        cpu = time.thread_time if clock == "thread" else time.perf_counter

        def run(fn):
            w, c = time.perf_counter(), cpu()
            out = fn()
            c1, w1 = cpu(), time.perf_counter()
            return out, c1 - c, w1 - w
    return run


def time_stage(stage_mod: torch.nn.Module, inputs: Any, *, repeats: int = 5, warmup: int = 2,
               device: str | torch.device = "cpu", clock: str = "thread", split: bool = False) -> list[tuple[float, ...]]:
    """``repeats`` (forward_s, backward_s, forward_wall_s, backward_wall_s) of ``stage_mod`` on ``inputs``;
    with ``split`` each tuple goes on with (input_grad_s, weight_grad_s, input_grad_wall_s, weight_grad_wall_s)."""
    device = torch.device(device)
    timed = _sync_timer(device, clock)
    b, s = inputs.shape
    d = stage_mod.cfg.d_model
    dtype = next(stage_mod.parameters()).dtype
    gen = torch.Generator(device="cpu").manual_seed(b * 7919 + s)
    x0 = None if stage_mod.is_first else torch.randn(b, s, d, generator=gen).to(device=device, dtype=dtype)
    g = None if stage_mod.is_last else (torch.randn(b, s, d, generator=gen) * 1e-3).to(device=device, dtype=dtype)
    stage_mod.train()
    out = []
    for i in range(warmup + repeats):
        x = None if x0 is None else x0.detach().requires_grad_(True)
        y, tf, wf = timed(lambda x=x: stage_mod(x, inputs))          # bound now: x and y are deleted below
        _, tb, wb = timed(lambda y=y: y.backward() if g is None else y.backward(g))
        del y, x
        times: tuple[float, ...] = (tf, tb, wf, wb)
        if split:
            x = None if x0 is None else x0.detach().requires_grad_(True)
            with record_linears(stage_mod) as tape:
                y = stage_mod(x, inputs)
            _, ti, wi = timed(lambda: backward_input(stage_mod, y, g, x, tape))
            _, tw, ww = timed(lambda: backward_weight(tape))
            del y, x
            times += (ti, tw, wi, ww)
        if i >= warmup:
            out.append(times)
    return out


def _meter():
    """The memory measurement of the samples' memory columns (``dynmb.runtime.meter``)."""
    return measure_stage_memory


def load_samples(paths: Iterable[str | Path]) -> pd.DataFrame:
    """Read and concatenate samples CSVs (or a run's actions CSVs, converted)."""
    dfs = []
    for p in paths:
        try:
            df = pd.read_csv(p)
            dfs.append(samples_from_actions(df) if {"start_s", "end_s"} <= set(df.columns) else df)
        except (ValueError, KeyError) as e:   # pandas' parse errors are ValueErrors
            raise ValueError(f"{p}: not a samples or actions CSV: {e}") from None
        missing = {"stage", "op", "rows", "padded_len", "time_s"} - set(dfs[-1].columns)
        if missing:
            raise ValueError(f"{p}: not a samples or actions CSV (no column {', '.join(sorted(missing))})")
    if not dfs:
        raise ValueError("no samples files given")
    return pd.concat(dfs, ignore_index=True)


def profile(cfg: ModelConfig, num_stages: int, *, grid: list[tuple[int, int, int | bool]] | None = None,
            quick: bool = False, max_len: int | None = None, repeats: int = 5, warmup: int = 2,
            device: str = "cpu", threads: int = 1, clock: str | None = None, output: str | Path | None = None,
            comm: bool = False, memory: bool = True, seed: int = 0, progress: bool = True,
            concurrent: bool = False, token_cap: int | None = None, split: bool = False) -> pd.DataFrame:
    """Measure every stage over ``grid`` (default ``default_grid``); return (and write) the samples.
    ``split``: also time the split backward (``I`` and ``W`` rows, see the module doc).

    ``grid``: points ``(rows, padded_len, docs_per_row)`` (a bool third element is the older
    ``packed`` flag). ``concurrent``: one process per stage, all running the same point at once
    (see the module doc); CPU only. ``token_cap``: the default grid's rows x padded_len cap
    (default 8192 on CPU)."""
    if int(repeats) < 1 or int(warmup) < 0:   # checked before anything is written
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    torch.set_num_threads(int(threads))
    dev = torch.device(device)
    if dev.type == "cpu":
        retain_freed_memory()   # measure under the allocator policy the runtime uses
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but torch.cuda.is_available() is False")
    clock = clock or ("event" if dev.type == "cuda" else "thread" if threads == 1 else "wall")
    if concurrent and dev.type != "cpu":
        raise ValueError("concurrent profiling is for CPU stages (one process per stage on one host)")
    grid = [_as_point(g) for g in grid] if grid is not None else default_grid(
        quick=quick, max_len=max_len, token_cap=token_cap or (None if dev.type == "cpu" else 65536))
    base = {"device": dev.type if dev.type == "cpu" else torch.cuda.get_device_name(dev), "threads": int(threads),
            "clock": clock, "torch_version": torch.__version__, "model": cfg.name, "attention": cfg.attention,
            "num_stages": int(num_stages), "concurrent": int(num_stages) if concurrent else 1,
            **{k: v for k, v in cfg.to_dict().items() if k not in ("name", "attention")}}   # every field
    old = _read_resumable(output, base)
    if comm and not (len(old) and (old["op"] == "comm").any()):  # first: before the grid heats the machine
        c = ping_pong(threads=threads)
        old = pd.concat([old, c.assign(stage=-1, op="comm", rows=0, padded_len=0, tokens=0, packed=False,
                                       wall_s=c["time_s"], **{**base, "clock": "wall"})], ignore_index=True)
        if output is not None:
            write_table(old, output, parquet=False)
    done = _done_runs(old)
    todo = [(r, p, *pt) for r in range(repeats) for pt in grid for p in range(num_stages) if (r, p, *pt) not in done]
    todo.sort(key=lambda x: (x[0], x[2] * x[3], x[4], x[1]))
    if concurrent:
        rows_out = _profile_concurrent(cfg, num_stages, todo, warmup=warmup, clock=clock, threads=threads,
                                       seed=seed, memory=memory, progress=progress, base=base, split=split)
        df = pd.concat([old, pd.DataFrame(rows_out)], ignore_index=True)
        if output is not None:
            write_table(df, output, parquet=False)
        return df
    return _profile_alone(cfg, num_stages, todo, old, dev=dev, warmup=warmup, clock=clock, seed=seed, memory=memory,
                          progress=progress, base=base, output=output, split=split)


ARCH_FIELDS = tuple(f.name for f in fields(ModelConfig) if f.name != "name")
"""ModelConfig fields recorded as sample columns of the same name (the name is the ``model`` column)."""


def check_samples_model(samples: pd.DataFrame, cfg: ModelConfig, num_stages: int, source: str = "samples") -> None:
    """Raise ``ValueError`` naming both unless every recorded ModelConfig field (and the stage
    count) of ``samples`` equals ``cfg``'s: a cost model is fitted only for the architecture measured."""
    want = {"model": cfg.name, "num_stages": int(num_stages), **{k: getattr(cfg, k) for k in ARCH_FIELDS}}
    for column, value in want.items():
        if column not in samples:
            continue
        got = set(samples[column].dropna().unique().tolist())
        if got - {value}:
            raise ValueError(f"{source} were measured for {column}={sorted(got, key=str)}, not {value} "
                             f"(--model {cfg.name!r}, --stages {num_stages}); pass a matching --model/--stages")


def _read_resumable(output: str | Path | None, base: dict) -> pd.DataFrame:
    """The samples already in ``output`` (empty when none); refuses a file of other settings."""
    if output is None or not Path(output).exists():
        return pd.DataFrame()
    old = pd.read_csv(output)
    if "concurrent" not in old:
        old["concurrent"] = 1
    timed = old[old["op"] != "comm"]
    if len(timed) and "attn_work" not in old:
        raise ValueError(f"{output} holds samples without attn_work (profiled before the attention work was "
                         f"recorded, under another attention implementation); use another -o")
    for k in ("model", "num_stages", "clock", "concurrent", *(k for k in base if k in ARCH_FIELDS)):
        if k in old and len(timed) and set(timed[k].dropna().unique()) - {base[k]}:
            raise ValueError(f"{output} holds samples for {k}={sorted(old[k].dropna().unique().tolist(), key=str)}, not {base[k]}; "
                             f"use another -o")
    return old


def _done_runs(old: pd.DataFrame) -> set[tuple[int, int, int, int, int]]:
    """(repeat, stage, rows, padded_len, docs_per_row) already measured (their B row written)."""
    ff = old[old["op"] == "B"] if len(old) else old
    if not len(ff):             # nothing yet, or only the comm rows
        return set()
    return {(int(r), int(p), int(b), int(s), int(d)) for r, p, b, s, d in
            ff[["repeat", "stage", "rows", "padded_len", "docs_per_row"]].itertuples(index=False)}


def _sample_rows(stage: int, mb: Microbatch, cfg: ModelConfig, docs: int, times: tuple[float, ...],
                 repeat: int, base: dict, extra: dict) -> list[dict]:
    """The F and B rows of one timed run (and I and W after them when it timed a split backward)."""
    tf, tb, wf, wb = times[:4]
    ops = [("F", tf, wf), ("I", times[4], times[6]), ("W", times[5], times[7])] if len(times) == 8 else [("F", tf, wf)]
    ops.append(("B", tb, wb))       # last: a run counts as done once its B row is written (resume)
    point = {"stage": stage, "rows": mb.batch, "padded_len": mb.padded_len, "tokens": mb.computed_tokens,
             "packed": docs > 1, "docs_per_row": docs, "attn_work": mb.attention_work(cfg.attention)}
    return [{**point, "op": op, "time_s": t, "wall_s": w, "repeat": repeat, **base, **extra}
            for op, t, w in ops]


def _memory_columns(meter, cfg: ModelConfig, num_stages: int, stage: int, point: Point, dev=None) -> dict:
    """``mem_*`` columns of the meter at ``point`` (one-document rows unless packed)."""
    b, s, d = point
    kw = {} if dev is None else {"device": dev}
    return {f"mem_{k}": v for k, v in meter(cfg, num_stages, stage, b, s, packed=d > 1, **kw).items()
            if isinstance(v, (int, float, np.integer, np.floating))}


def _run_estimates(cfg: ModelConfig, num_stages: int, items: list[tuple[Point, list[int], bool]], warmup: int,
                   seed: int) -> list[float]:
    """Estimated wall seconds per item (point, stages run, first visit?): the slowest stage
    when stages run at once (one per item), the sum otherwise."""
    cache: dict = {}

    def one(p: int, pt: Point) -> float:
        if (p, pt) not in cache:
            cache[(p, pt)] = estimate_run_seconds(cfg, num_stages, p, pt, seed=seed)
        return cache[(p, pt)]
    return [(1 + (warmup if first else 0)) * max(one(p, pt) for p in stages) for pt, stages, first in items]


def _profile_alone(cfg: ModelConfig, num_stages: int, todo: list, old: pd.DataFrame, *, dev: torch.device,
                   warmup: int, clock: str, seed: int, memory: bool, progress: bool, base: dict,
                   output: str | Path | None, split: bool = False) -> pd.DataFrame:
    """Measure ``todo`` ((repeat, stage, rows, padded_len, docs), sorted) one stage at a time in this process."""
    stages = build_stages(cfg, num_stages, seed, device=dev) if todo else []
    meter = _meter() if memory else None
    seen: set = set()
    items = []
    for r, p, b, s, d in todo:
        items.append(((b, s, d), [p], (p, b, s, d) not in seen))
        seen.add((p, b, s, d))
    est = _run_estimates(cfg, num_stages, items, warmup, seed)
    bar = _Progress(est, "profile", progress) if todo else None
    rows_out: list[dict] = []
    last_write = time.monotonic()
    for (r, p, b, s, d), (_, _, first), est_s in zip(todo, items, est):
        mb = synthetic_microbatch(b, s, d, seed)
        inputs = make_inputs(mb, synthetic_tokens(mb.lengths, cfg.vocab_size, seed), cfg=cfg, device=dev)
        if first:
            stages[p].zero_grad(set_to_none=False)
        (times,) = time_stage(stages[p], inputs, repeats=1, warmup=warmup if first else 0, device=dev, clock=clock,
                              split=split)
        extra = {}
        if meter is not None and r == 0:
            try:
                extra = _memory_columns(meter, cfg, num_stages, p, (b, s, d), dev)
            except Exception as e:  # report once, keep profiling times
                logger.warning("profile: memory meter failed (%s); continuing without memory columns", e)
                meter = None
        rows_out += _sample_rows(p, mb, cfg, d, times, r, base, extra)
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
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _concurrent_worker(rank: int, port: int, cfg_dict: dict, num_stages: int, points: list, warmup: int,
                       clock: str, threads: int, seed: int, memory: bool, progress: bool, base: dict,
                       out_dir: str, split: bool = False, log_level: int = logging.WARNING) -> None:
    torch.set_num_threads(int(threads))
    retain_freed_memory()
    cfg = ModelConfig.from_dict(cfg_dict)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_stages)
    try:
        stage = build_stage(cfg, rank, num_stages, seed)
        meter = _meter() if memory else None
        seen: set = set()
        rows: list[dict] = []
        est = _run_estimates(cfg, num_stages, _concurrent_items(points, num_stages), warmup, seed)
        if rank == 0 and log_level < logging.WARNING and not logging.getLogger("dynmb").handlers:
            handler = logging.StreamHandler()       # a spawned process: show rank 0's ETA lines
            handler.setFormatter(logging.Formatter("%(message)s"))
            logger.addHandler(handler)
            logger.setLevel(log_level)
        bar = _Progress(est, f"profile x{num_stages}", progress) if rank == 0 else None
        for (r, b, s, d, stages_todo), est_s in zip(points, est):
            mb = synthetic_microbatch(b, s, d, seed)
            inputs = make_inputs(mb, synthetic_tokens(mb.lengths, cfg.vocab_size, seed), cfg=cfg)
            first = (b, s, d) not in seen
            seen.add((b, s, d))
            if first:
                stage.zero_grad(set_to_none=False)
            dist.barrier()          # every stage starts this point's runs together
            (times,) = time_stage(stage, inputs, repeats=1, warmup=warmup if first else 0, clock=clock, split=split)
            if bar is not None:
                bar.update(est_s, f"rep {r} {b}x{s}/{d}doc F={times[0]:.4f}s")
            if rank not in stages_todo:
                continue
            extra = {}
            if meter is not None and r == 0:
                try:
                    extra = _memory_columns(meter, cfg, num_stages, rank, (b, s, d))
                except Exception:  # the memory columns are optional
                    meter = None
            rows += _sample_rows(rank, mb, cfg, d, times, r, base, extra)
        if bar is not None:
            bar.close()
        with atomic_path(os.path.join(out_dir, f"rank{rank}.json")) as tmp, open(tmp, "w") as f:
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


def _profile_concurrent(cfg: ModelConfig, num_stages: int, todo: list, *, warmup: int, clock: str, threads: int,
                        seed: int, memory: bool, progress: bool, base: dict, split: bool = False) -> list[dict]:
    """Rows of ``todo`` ((repeat, stage, rows, padded_len, docs), sorted) measured by one process per
    stage, all stages of a point at once (a stage already measured there runs untimed, as load)."""
    import torch.multiprocessing as mp
    points: dict = {}
    for r, p, b, s, d in todo:
        points.setdefault((r, b, s, d), set()).add(p)
    plist = [(r, b, s, d, sorted(ps)) for (r, b, s, d), ps in points.items()]
    plist.sort(key=lambda x: (x[0], x[1] * x[2], x[3]))
    if not plist:
        return []
    est = sum(_run_estimates(cfg, num_stages, _concurrent_items(plist, num_stages), warmup, seed))
    logger.info("profile: %d points x %d stages at once, first estimate %s", len(plist), num_stages, _minutes(est))
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_concurrent_worker, args=(_free_port(), cfg.to_dict(), num_stages, plist, warmup, clock,
                                                     threads, seed, memory, progress, base, d, split,
                                                     logger.getEffectiveLevel()),
                           nprocs=num_stages, start_method="spawn")
        rows: list[dict] = []
        for rank in range(num_stages):
            with open(os.path.join(d, f"rank{rank}.json")) as f:
                rows += json.load(f)
    return rows
