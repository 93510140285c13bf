"""Set-up points every rank passes, checked through the job's store so that a wait names who is late.

A rank that waits in a collective or a P2P op for a peer still building its model times out with the
backend's message (gloo: "Timed out waiting ... for recv"), which names neither the peer nor what it
was doing, and torchrun then blames the rank that waited. ``wait_for_ranks(store, point, rank, world,
timeout_s, doing)`` is a store-based barrier: each rank sets ``dynmb/ready/<point>/<rank>``, counts
itself in ``.../count`` and polls that counter until every rank has; past ``timeout_s`` it raises ``RanksLateError`` naming the ranks
whose key is missing and what they were doing ("rank 1 has not finished building its stages within
60 s"), which becomes the waiting rank's one error line.
"""

from __future__ import annotations

import time

from dynmb.runtime.planshare import KeyValueStore

__all__ = ["RanksLateError", "wait_for_ranks"]


class RanksLateError(RuntimeError):
    """Ranks did not reach a set-up point within the job's timeout."""


def wait_for_ranks(store: KeyValueStore, point: str, rank: int, world: int, timeout_s: float, doing: str,
                   poll_s: float = 0.1) -> None:
    """Mark ``rank`` at ``point`` and wait until all ``world`` ranks are (one counter polled: a store
    request per rank per ``poll_s``); past ``timeout_s`` raise ``RanksLateError`` naming the ranks still
    ``doing`` it (their keys missing)."""
    def key(r: int) -> str:
        return f"dynmb/ready/{point}/{r}"

    store.set(key(rank), b"1")
    counter = f"dynmb/ready/{point}/count"
    arrived = store.add(counter, 1)
    deadline = time.monotonic() + timeout_s
    while arrived < world:
        if time.monotonic() > deadline:
            late = ", ".join(str(r) for r in range(world) if r != rank and not store.check([key(r)]))
            raise RanksLateError(f"rank {rank} waited {timeout_s:.0f} s (--timeout) for rank(s) {late or '?'}, still "
                                 f"{doing}: the late rank(s) are the cause, not rank {rank}")
        time.sleep(poll_s)
        arrived = store.add(counter, 0)
