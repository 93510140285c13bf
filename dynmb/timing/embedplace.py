"""Where the embeds go (``PlanSpec.embedding = "last"``): the keys ``dynmb.schedule.embedlast.embed_last`` merges them
into the last rank's list by, read off the schedule's own timeline without them (the simulator's recurrence,
``action_times``, with the plan's costs and P2P times, or unit times F = I = W = 1, B = 2 without a cost model): an
embed keyed its own time plus one message before stage 0's forward of its microbatch, an embedding-backward one
message after stage 0's backward (``B`` or ``I``); the largest of any microbatch for all, so the keys keep stage 0's
order (slices: forwards in slice order, backwards reversed).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dynmb.core.types import Schedule
from dynmb.schedule.embedlast import EmbedTimes, embed_rank
from dynmb.schedule.validate import execution_order
from dynmb.timing.simulate import action_times, cross_mask

__all__ = ["embed_times"]


def embed_times(schedule: Schedule, costs: dict[str, np.ndarray] | None, comm: Any = 0.0,
                embed: tuple[np.ndarray, np.ndarray] | None = None) -> EmbedTimes:
    """The keys of ``embed_last`` (module doc) from ``schedule``'s timeline: with ``costs`` (``[S, m]`` per op) and
    ``comm`` (per microbatch) and the embeds' own ``embed`` seconds, else unit times (F = I = W = 1, B = 2)."""
    S, m = schedule.num_stages, schedule.num_microbatches
    flat = execution_order(schedule)
    if costs is None:
        dur = np.array([1.0, 2.0, 1.0, 1.0])[flat.op]
        comm_mb, lead, lag = np.zeros(m), 0.0, 0.0
    else:
        cube = np.zeros((4, S, m))
        for k, op in enumerate("FBIW"):
            if op in costs:
                cube[k] = costs[op]
        dur = cube[flat.op, flat.stage, flat.mb]
        comm_mb = np.broadcast_to(np.asarray(comm, dtype=np.float64), (m,))
        lead = float(np.max(comm_mb + (embed[0] if embed is not None else 0.0), initial=0.0))   # one each: the
        lag = float(np.max(comm_mb, initial=0.0))                                         # keys keep stage 0's order
    cross = np.zeros(len(dur))
    xi = cross_mask(flat)
    cross[xi] = comm_mb[flat.mb[xi]]
    start, end = (np.asarray(t) for t in action_times(flat, dur, cross, schedule.num_ranks))
    first_f = np.flatnonzero((flat.stage == 0) & (flat.op == 0))
    first_b = np.flatnonzero((flat.stage == 0) & ((flat.op == 1) | (flat.op == 2)))
    fkey, bkey = np.zeros(m), np.zeros(m)
    fkey[flat.mb[first_f]] = start[first_f] - lead
    bkey[flat.mb[first_b]] = end[first_b] + lag
    r = embed_rank(schedule)
    own = np.arange(flat.start[r], flat.start[r + 1])
    return EmbedTimes(fkey.tolist(), bkey.tolist(), list(zip(start[own].tolist(), end[own].tolist())))
