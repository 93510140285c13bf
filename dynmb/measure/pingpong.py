"""P2P ping-pong between two local processes: the measurements behind ``CommModel``.

Algorithm: spawn 2 processes (``torch.multiprocessing``, start method spawn) that join a
gloo (or the given backend) process group over TCP on 127.0.0.1 with a timeout. For each
message size (4 KiB .. 64 MiB, powers of 4) rank 0 sends a float32 tensor of that many
bytes, rank 1 receives it and sends it back; after ``warmup`` untimed exchanges rank 0
records ``repeats`` round trips with ``time.perf_counter`` and reports one-way time =
round trip / 2. Rank 0 writes the rows to a JSON file in a temporary folder; the parent
reads it after joining (a stuck child is killed at ``timeout_s``). ``dynmb fit`` fits
t = alpha + nbytes / bytes_per_s to these rows (relative-error, non-negative).

Entry point: ``ping_pong()`` (used by ``dynmb profile --comm``);
also ``python -m dynmb.measure.pingpong`` prints the table.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import tempfile
import time
from dataclasses import dataclass

import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dynmb.io.atomic import write_text_atomic

__all__ = ["DEFAULT_SIZES", "ping_pong", "free_port"]

DEFAULT_SIZES = tuple(4096 * 4**i for i in range(8))  # 4 KiB .. 64 MiB


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (for a local process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class _PingSettings:
    """``ping_pong``'s settings, as its two processes receive them."""

    sizes: list[int]
    repeats: int
    warmup: int
    backend: str
    timeout_s: float
    threads: int


def _worker(rank: int, port: int, ps: _PingSettings, out_path: str) -> None:
    repeats, warmup = ps.repeats, ps.warmup
    torch.set_num_threads(ps.threads)
    dist.init_process_group(ps.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=ps.timeout_s))
    rows = []
    try:
        for nbytes in ps.sizes:
            buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
            reps = repeats if nbytes <= 2**22 else max(3, repeats // 4)
            for i in range(warmup + reps):
                if rank == 0:
                    t0 = time.perf_counter()
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                    dt = time.perf_counter() - t0
                    if i >= warmup:
                        rows.append({"nbytes": int(buf.numel() * 4), "repeat": i - warmup, "time_s": dt / 2})
                else:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
        if rank == 0:
            write_text_atomic(out_path, json.dumps(rows))
    finally:
        dist.destroy_process_group()


def ping_pong(sizes: tuple[int, ...] = DEFAULT_SIZES, *, repeats: int = 20, warmup: int = 3,
              backend: str = "gloo", timeout_s: float = 120.0, threads: int = 1) -> pd.DataFrame:
    """One-way P2P times between two local processes: DataFrame nbytes, repeat, time_s."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "pingpong.json")
        ps = _PingSettings(list(sizes), repeats, warmup, backend, timeout_s, threads)
        ctx = mp.start_processes(_worker, args=(free_port(), ps, out), nprocs=2, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s + 30
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"ping-pong did not finish within {timeout_s + 30:.0f}s")
        with open(out) as f:
            return pd.DataFrame(json.load(f))


if __name__ == "__main__":
    df = ping_pong()
    print(df.groupby("nbytes")["time_s"].median().to_string())
