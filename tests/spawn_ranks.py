"""Spawned test ranks: start ``world`` processes, join each within a timeout, never leave one running."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any, Callable


def spawn_ranks(target: Callable[..., None], world: int, args_of: Callable[[int], tuple[Any, ...]],
                timeout_s: float) -> list[int | None]:
    """``target(*args_of(rank))`` in one spawned process per rank; ranks still running after ``timeout_s``
    are killed and named in the assertion. Returns the ranks' exit codes."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args_of(r), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    assert not hung, f"ranks {hung} of the {world}-rank job ran past {timeout_s} s"
    return [p.exitcode for p in procs]
