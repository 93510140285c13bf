"""Profile stage times over a (rows, padded_len) grid -> a tidy samples table for ``dynmb fit``.

Algorithm. For every stage module of ``build_stages(cfg, P)`` and every grid point
(rows b, padded_len s, packed?), build a synthetic microbatch with ``make_inputs``: plain
points hold one sequence per row (the first row full, the others of random length, so
there is padding), packed points hold several documents per row (document-causal mask,
positions restarting per document). Input preparation is not timed. Then ``warmup``
untimed and ``repeats`` timed runs; each run builds a fresh graph:

    x  = fresh leaf hidden state (requires_grad, as a pipeline receiver holds it)
    F  = time(y = stage(x, inputs))
    B  = time(y.backward(g))      # g: a fixed random grad of y (non-last), or loss.backward()

so backward is timed alone on its own graph; parameter gradients accumulate as over the
microbatches of a step. Clocks: CPU with ``threads == 1`` uses the calling thread's CPU
time (``time.thread_time``; torch then runs every op, forward and autograd backward, on the
calling thread), which is what the op costs on a dedicated core and is immune to other
processes time-sharing the machine; ``wall_s`` (``perf_counter``) is recorded next to it.
``clock="wall"`` (or threads > 1) uses wall time. CUDA: ``torch.cuda.Event`` pairs.
Repeats are interleaved: pass r times repeat r of every (stage, point) (warm-up runs only
on a point's first visit), so a burst of machine load hits one repeat of many points, not
every repeat of one point, and the per-point median rejects it.
Every repeat is one row of the samples table (stage, op, rows, padded_len, tokens, packed,
time_s, wall_s, clock, repeat, device, threads, torch_version, model, num_stages), plus
``mem_*`` columns when ``dynmb.runtime.meter`` is present. Resumable: (stage, point, repeat)
rows already in the output CSV are skipped; the CSV is rewritten atomically (tmp +
os.replace) every few seconds and at the end. ``comm=True`` adds the gloo ping-pong rows
(op="comm", nbytes) of ``dynmb.runtime.pingpong``.

Concurrent mode (``concurrent=True``, CPU): the stages are measured as a pipeline runs them,
one process per stage (1 torch thread each, gloo): every process holds its stage and all of
them visit the same points in the same order, meeting at a barrier before each run, so stage
p's op is timed while the other stages run theirs on the same shape -- the steady state of a
pipeline whose neighbouring microbatches are alike. On a machine whose cores share a last-level
cache and memory bandwidth (the development box: 2 vCPUs, 32 MiB L3), large microbatches
(>~5k tokens; stage 1's logits alone are rows x len x vocab x 4 bytes) are 5-20% slower under
this concurrency than alone, small ones are not; a profile measured alone under-predicts the
large ones (see ``experiments/pred_error.py``). Rows get ``concurrent = num_stages`` (1 otherwise).

Command line: ``dynmb profile --model small --stages 2 [--quick] -o samples.csv``.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd
import torch

from dynmb.config import ModelConfig
from dynmb.model import build_stages, make_inputs, synthetic_tokens
from dynmb.results import write_table
from dynmb.runtime.hostmem import retain_freed_memory
from dynmb.types import Microbatch

__all__ = ["GRID_ROWS", "GRID_LENS", "default_grid", "synthetic_microbatch", "time_stage", "profile", "load_samples"]

GRID_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
GRID_LENS = (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
_POINT = ["stage", "rows", "padded_len", "packed"]


def default_grid(*, quick: bool = False, max_len: int | None = None, token_cap: int | None = None,
                 packed_points: bool = True) -> list[tuple[int, int, bool]]:
    """Grid points ``(rows, padded_len, packed)`` with rows * padded_len <= token_cap.

    Full: rows 1..64 x padded_len 32..2048 (powers of two and 1.5x), token_cap 8192 (one CPU
    core runs an F+B of 8k tokens on the small preset in a few seconds), plus packed rows at
    a few lengths >= 128. Quick: rows {1, 2, 4, 8} x {32, 128, 512}, cap 2048.
    """
    rows, lens = ((1, 2, 4, 8), (32, 128, 512)) if quick else (GRID_ROWS, GRID_LENS)
    cap = token_cap or (2048 if quick else 8192)
    if max_len is not None:
        lens = tuple(s for s in lens if s <= max_len) or (int(max_len),)
    pts = [(b, s, False) for s in lens for b in rows if b * s <= cap]
    if packed_points:
        longs = [s for s in lens if s >= 128]
        for s in (longs[::3] if not quick else longs[-1:]):
            b = max(r for r in rows if r * s <= cap) if any(r * s <= cap for r in rows) else None
            if b is not None:
                pts.append((min(b, 2), s, True))
    return pts


def synthetic_microbatch(rows: int, padded_len: int, packed: bool = False, seed: int = 0) -> Microbatch:
    """A (rows x padded_len) microbatch: one sequence per row (row 0 full, others random
    lengths >= padded_len/2), or with ``packed`` 2-4 documents filling each row."""
    rng = np.random.default_rng([seed, rows, padded_len, int(packed)])
    if not packed:
        lens = np.concatenate([[padded_len], rng.integers(max(1, padded_len // 2), padded_len + 1, size=rows - 1)])
        return Microbatch(np.arange(rows), lens, padded_len, rows)
    lens, row_ids = [], []
    for r in range(rows):
        k = int(rng.integers(2, 5)) if padded_len >= 8 else 1
        cuts = np.sort(rng.choice(np.arange(1, padded_len), size=k - 1, replace=False)) if k > 1 else np.array([], int)
        parts = np.diff(np.concatenate([[0], cuts, [padded_len]]))
        lens += parts.tolist()
        row_ids += [r] * len(parts)
    return Microbatch(np.arange(len(lens)), lens, padded_len, rows, row_ids=row_ids)


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
               device: str | torch.device = "cpu", clock: str = "thread") -> list[tuple[float, float, float, float]]:
    """``repeats`` (forward_s, backward_s, forward_wall_s, backward_wall_s) of ``stage_mod`` on ``inputs``."""
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
        y, tf, wf = timed(lambda: stage_mod(x, inputs))
        _, tb, wb = timed(lambda: y.backward() if g is None else y.backward(g))
        del y, x
        if i >= warmup:
            out.append((tf, tb, wf, wb))
    return out


def _meter():
    try:
        from dynmb.runtime.meter import measure_stage_memory
        return measure_stage_memory
    except Exception:  # the memory meter is optional
        return None


def load_samples(paths: Iterable[str | Path]) -> pd.DataFrame:
    """Read and concatenate samples CSVs (or a run's actions CSVs, converted)."""
    from dynmb.costmodel import samples_from_actions
    dfs = []
    for p in paths:
        df = pd.read_csv(p)
        dfs.append(samples_from_actions(df) if {"start_s", "end_s"} <= set(df.columns) else df)
    if not dfs:
        raise ValueError("no samples files given")
    return pd.concat(dfs, ignore_index=True)


def profile(cfg: ModelConfig, num_stages: int, *, grid: list[tuple[int, int, bool]] | None = None,
            quick: bool = False, max_len: int | None = None, repeats: int = 5, warmup: int = 2,
            device: str = "cpu", threads: int = 1, clock: str | None = None, output: str | Path | None = None,
            comm: bool = False, memory: bool = True, seed: int = 0, progress: bool = True,
            concurrent: bool = False, token_cap: int | None = None) -> pd.DataFrame:
    """Measure every stage over ``grid`` (default ``default_grid``); return (and write) the samples.

    ``concurrent``: one process per stage, all running the same point at once (see the module
    doc); CPU only. ``token_cap``: the default grid's rows x padded_len cap (default 8192 on CPU)."""
    torch.set_num_threads(int(threads))
    dev = torch.device(device)
    if dev.type == "cpu":
        retain_freed_memory()   # measure under the allocator policy the runtime uses
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but torch.cuda.is_available() is False")
    clock = clock or ("event" if dev.type == "cuda" else "thread" if threads == 1 else "wall")
    if concurrent and dev.type != "cpu":
        raise ValueError("concurrent profiling is for CPU stages (one process per stage on one host)")
    grid = grid if grid is not None else default_grid(quick=quick, max_len=max_len,
                                                      token_cap=token_cap or (None if dev.type == "cpu" else 65536))
    base = {"device": dev.type if dev.type == "cpu" else torch.cuda.get_device_name(dev), "threads": int(threads),
            "clock": clock, "torch_version": torch.__version__, "model": cfg.name, "num_stages": int(num_stages),
            "concurrent": int(num_stages) if concurrent else 1}
    old = pd.DataFrame()
    if output is not None and Path(output).exists():
        old = pd.read_csv(output)
        if "concurrent" not in old:
            old["concurrent"] = 1
        for k in ("model", "num_stages", "clock", "concurrent"):
            if k in old and len(old) and set(old.loc[old["op"] != "comm", k].dropna().unique()) - {base[k]}:
                raise ValueError(f"{output} holds samples for {k}={sorted(old[k].unique())}, not {base[k]}; use another -o")
    if comm and not (len(old) and (old["op"] == "comm").any()):  # first: before the grid heats the machine
        from dynmb.runtime.pingpong import ping_pong
        c = ping_pong(threads=threads)
        old = pd.concat([old, c.assign(stage=-1, op="comm", rows=0, padded_len=0, tokens=0, packed=False,
                                       wall_s=c["time_s"], **{**base, "clock": "wall"})], ignore_index=True)
        if output is not None:
            write_table(old, output, parquet=False)
    done = set()
    if len(old):
        ff = old[old["op"] == "B"]
        done = {(int(r), int(p), int(b), int(s), bool(pk)) for r, p, b, s, pk in
                ff[["repeat", "stage", "rows", "padded_len", "packed"]].itertuples(index=False)}
    todo = [(r, p, b, s, pk) for r in range(repeats) for b, s, pk in grid for p in range(num_stages)
            if (r, p, b, s, pk) not in done]
    todo.sort(key=lambda x: (x[0], x[2] * x[3], x[1]))
    if concurrent:
        rows_out = _profile_concurrent(cfg, num_stages, todo, warmup=warmup, clock=clock, threads=threads,
                                       seed=seed, memory=memory, progress=progress, base=base)
        df = pd.concat([old, pd.DataFrame(rows_out)], ignore_index=True)
        if output is not None:
            write_table(df, output, parquet=False)
        return df
    stages = build_stages(cfg, num_stages, seed, device=dev) if todo else []
    meter = _meter() if memory else None
    seen: set = set()
    rows_out: list[dict] = []
    try:
        from tqdm.auto import tqdm
        it = tqdm(todo, desc="profile", unit="pt", disable=not progress)
    except ImportError:  # pragma: no cover
        it = todo
    last_write = time.monotonic()
    for r, p, b, s, pk in it:
        mb = synthetic_microbatch(b, s, pk, seed)
        inputs = make_inputs(mb, synthetic_tokens(mb.lengths, cfg.vocab_size, seed), cfg=cfg, device=dev)
        first = (p, b, s, pk) not in seen
        seen.add((p, b, s, pk))
        if first:
            stages[p].zero_grad(set_to_none=False)
        ((tf, tb, wf, wb),) = time_stage(stages[p], inputs, repeats=1, warmup=warmup if first else 0,
                                         device=dev, clock=clock)
        extra = {}
        if meter is not None and r == 0:
            try:
                extra = {f"mem_{k}": v for k, v in meter(cfg, num_stages, p, b, s, packed=pk, device=dev).items()
                         if isinstance(v, (int, float, np.integer, np.floating))}
            except Exception as e:  # report once, keep profiling times
                print(f"profile: memory meter failed ({e}); continuing without memory columns")
                meter = None
        rows_out += [{"stage": p, "op": op, "rows": b, "padded_len": s, "tokens": b * s, "packed": pk,
                      "time_s": t, "wall_s": w, "repeat": r, **base, **extra}
                     for op, t, w in (("F", tf, wf), ("B", tb, wb))]
        if output is not None and time.monotonic() - last_write > 5:
            write_table(pd.concat([old, pd.DataFrame(rows_out)], ignore_index=True), output, parquet=False)
            last_write = time.monotonic()
        if hasattr(it, "set_postfix"):
            it.set_postfix(rep=r, stage=p, rows=b, len=s, F=f"{tf:.3g}s")
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
                       out_dir: str) -> None:
    import torch.distributed as dist

    from dynmb.model import build_stage
    torch.set_num_threads(int(threads))
    retain_freed_memory()
    cfg = ModelConfig.from_dict(cfg_dict)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_stages)
    try:
        stage = build_stage(cfg, rank, num_stages, seed)
        meter = _meter() if memory else None
        seen: set = set()
        rows: list[dict] = []
        it = points
        if progress and rank == 0:
            try:
                from tqdm.auto import tqdm
                it = tqdm(points, desc=f"profile x{num_stages}", unit="pt")
            except ImportError:  # pragma: no cover
                pass
        for r, b, s, pk, stages_todo in it:
            mb = synthetic_microbatch(b, s, pk, seed)
            inputs = make_inputs(mb, synthetic_tokens(mb.lengths, cfg.vocab_size, seed), cfg=cfg)
            first = (b, s, pk) not in seen
            seen.add((b, s, pk))
            if first:
                stage.zero_grad(set_to_none=False)
            dist.barrier()          # every stage starts this point's runs together
            ((tf, tb, wf, wb),) = time_stage(stage, inputs, repeats=1, warmup=warmup if first else 0, clock=clock)
            if rank not in stages_todo:
                continue
            extra = {}
            if meter is not None and r == 0:
                try:
                    extra = {f"mem_{k}": v for k, v in meter(cfg, num_stages, rank, b, s, packed=pk).items()
                             if isinstance(v, (int, float, np.integer, np.floating))}
                except Exception:  # the memory columns are optional
                    meter = None
            rows += [{"stage": rank, "op": op, "rows": b, "padded_len": s, "tokens": b * s, "packed": pk,
                      "time_s": t, "wall_s": w, "repeat": r, **base, **extra}
                     for op, t, w in (("F", tf, wf), ("B", tb, wb))]
        with open(os.path.join(out_dir, f"rank{rank}.json.tmp"), "w") as f:
            json.dump(rows, f, default=lambda o: o.item() if hasattr(o, "item") else str(o))
        os.replace(os.path.join(out_dir, f"rank{rank}.json.tmp"), os.path.join(out_dir, f"rank{rank}.json"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _profile_concurrent(cfg: ModelConfig, num_stages: int, todo: list, *, warmup: int, clock: str, threads: int,
                        seed: int, memory: bool, progress: bool, base: dict) -> list[dict]:
    """Rows of ``todo`` ((repeat, stage, rows, padded_len, packed), sorted) measured by one process per
    stage, all stages of a point at once (a stage already measured there runs untimed, as load)."""
    import torch.multiprocessing as mp
    points: dict = {}
    for r, p, b, s, pk in todo:
        points.setdefault((r, b, s, pk), set()).add(p)
    plist = [(r, b, s, pk, sorted(ps)) for (r, b, s, pk), ps in points.items()]
    plist.sort(key=lambda x: (x[0], x[1] * x[2]))
    if not plist:
        return []
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_concurrent_worker, args=(_free_port(), cfg.to_dict(), num_stages, plist, warmup, clock,
                                                     threads, seed, memory, progress, base, d),
                           nprocs=num_stages, start_method="spawn")
        rows: list[dict] = []
        for rank in range(num_stages):
            with open(os.path.join(d, f"rank{rank}.json")) as f:
                rows += json.load(f)
    return rows
