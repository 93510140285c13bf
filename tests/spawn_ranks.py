"""Spawned test ranks: start ``world`` processes, join each within a timeout, never leave one running.

A spawned rank costs about 5 s of one core before its target runs (a fresh interpreter importing torch,
dynmb and the test module), so the ranks of a world size are kept for the session and reused: the
processes that ran a call in which every rank returned normally and left no process group run the next
call too (with their environment variables as they were before the call). A call in which a rank raised,
exited non-zero, died or hung retires its processes: the next call spawns fresh ones, so a failure never
leaks into another test. Each target still makes and destroys its own process group.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Callable

_POOLS: dict[int, list[tuple[Any, Connection]]] = {}
"""Per world size: the live ranks (process, parent's end of its pipe) that a next call may reuse."""


def _exit_code(err: SystemExit) -> int:
    return err.code if isinstance(err.code, int) else (0 if err.code is None else 1)


def _serve(conn: Connection) -> None:
    """A rank's loop: run each ``(target, args)`` it is sent as ``multiprocessing.Process`` would (an
    exception's traceback on stderr, exit code 1), answer ``(code, reusable)``, until told ``None``."""
    while (msg := conn.recv()) is not None:
        target, args = msg
        env, code = dict(os.environ), 0
        try:
            target(*args)
        except SystemExit as e:
            code = _exit_code(e)
        except BaseException:  # noqa: BLE001 - reported as Process reports it: traceback, exit code 1
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        dist = sys.modules.get("torch.distributed")
        left_group = dist is not None and dist.is_available() and dist.is_initialized()
        os.environ.clear()
        os.environ.update(env)
        conn.send((code, code == 0 and not left_group))


def _spawn(world: int) -> list[tuple[Any, Connection]]:
    ctx = mp.get_context("spawn")
    ranks = []
    for _ in range(world):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child,), daemon=True)
        proc.start()
        child.close()
        ranks.append((proc, parent))
    return ranks


def _answer(proc: Any, conn: Connection, deadline: float) -> tuple[int | None, bool] | None:
    """The rank's ``(exit code, reusable)``; ``None`` while it still runs at ``deadline``."""
    try:
        if conn.poll(max(0.0, deadline - time.monotonic())):
            return conn.recv()
    except (EOFError, OSError):
        pass
    if proc.is_alive():
        proc.join(max(0.0, min(1.0, deadline - time.monotonic())))
    return None if proc.is_alive() else (proc.exitcode, False)


def _retire(ranks: list[tuple[Any, Connection]]) -> None:
    for proc, conn in ranks:
        if proc.is_alive():
            proc.kill()
        proc.join()
        conn.close()


def spawn_ranks(target: Callable[..., None], world: int, args_of: Callable[[int], tuple[Any, ...]],
                timeout_s: float) -> list[int | None]:
    """``target(*args_of(rank))`` in one spawned process per rank; ranks still running after ``timeout_s``
    are killed and named in the assertion. Returns the ranks' exit codes."""
    ranks = _POOLS.pop(world, None) or _spawn(world)
    for r, (_, conn) in enumerate(ranks):
        conn.send((target, args_of(r)))
    deadline = time.monotonic() + timeout_s
    answers = [_answer(proc, conn, deadline) for proc, conn in ranks]
    hung = [r for r, a in enumerate(answers) if a is None]
    if hung or not all(a is not None and a[1] for a in answers):
        _retire(ranks)
    else:
        _POOLS[world] = ranks
    assert not hung, f"ranks {hung} of the {world}-rank job ran past {timeout_s} s"
    return [a[0] for a in answers if a is not None]
