"""Prices, bytes and positions of the embedding stage (``PlanSpec.embedding = "last"``, ``dynmb.schedule.embedlast``).

- ``embed_costs``: the seconds of a microbatch's embed (``F``: gather its rows of the table, write the hidden state)
  and embedding-backward (``B``: redo the lookup, add the gradient into the table's rows) on the last rank:
  memory-bound, ``bytes / bandwidth`` plus one op's fixed time, with the cost model's device bandwidth
  (``GPUCostModel.spec.hbm_bytes_per_s``) or ``HOST_BYTES_PER_S`` on a host model. F moves the hidden state twice
  (read the rows, write it); B three times (the gradient, the rows read and written back).
- ``lifted_costs`` / ``lifted_memory``: the simulator's ``[S + 1, m]`` arrays, the embedding stage first. The
  embedding stage holds nothing from F to B (its backward redoes the lookup; the int64 ids are kept,
  ``ID_BYTES`` a token) and, while an op runs, the hidden state and its gradient (2 ``d e`` a token); its states
  are ``MemoryModel.embed_state_bytes`` (moved from the last stage's count to it: the rank's total is the same).
  The P2P messages it sends and gets back are priced like every other (``comm_times``: the simulator's
  cross-rank rule), so each microbatch pays two more messages.
- ``embed_times``: the keys ``embed_last`` merges the embeds by: the schedule's own timeline (the simulator's
  recurrence, ``action_times``, with the plan's costs and P2P times, or unit times without a cost model); an
  embed keyed its own time plus one message before stage 0's forward, an embedding-backward one message after
  stage 0's backward.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dynmb.costmodel.base import CostModelLike
from dynmb.core.types import Plan, Schedule
from dynmb.schedule.embedlast import EmbedTimes, embed_rank
from dynmb.schedule.validate import execution_order

__all__ = ["embed_costs", "lifted_costs", "lifted_memory", "embed_times", "HOST_BYTES_PER_S", "ID_BYTES",
           "EMBED_OVERHEAD_S"]

HOST_BYTES_PER_S = 10e9
"""Memory bandwidth of a host (CPU) cost model's embed: a few streams of DRAM copy."""
EMBED_OVERHEAD_S = 20e-6
"""Fixed seconds of one embed op (a kernel launch and the send's posting, ``GPUSpec.overhead_s``)."""
ID_BYTES = 8
"""Bytes a token's id (int64) keeps on the embedding stage from its forward to its backward."""


def _tokens(plan: Plan) -> np.ndarray:
    shapes = plan.shapes()
    return (shapes[:, 0] * shapes[:, 1]).astype(np.float64)


def embed_costs(cost_model: CostModelLike, plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    """``(F[m], B[m])`` seconds of the embeds and embedding-backwards of ``plan`` (module doc)."""
    cfg = cost_model.model_cfg
    spec = getattr(cost_model, "spec", None)
    bandwidth = float(getattr(spec, "hbm_bytes_per_s", HOST_BYTES_PER_S))
    overhead = float(getattr(spec, "overhead_s", EMBED_OVERHEAD_S))
    hidden = _tokens(plan) * cfg.d_model * cfg.dtype_bytes
    return overhead + 2 * hidden / bandwidth, overhead + 3 * hidden / bandwidth


def lifted_costs(costs: dict[str, np.ndarray], embed: tuple[np.ndarray, np.ndarray]) -> dict[str, np.ndarray]:
    """``costs[op][S, m]`` with the embedding stage's row first (its F and B; 0 for I and W, which it never runs)."""
    rows = {"F": embed[0], "B": embed[1]}
    return {op: np.vstack([rows.get(op, np.zeros_like(embed[0]))[None, :], np.asarray(c, dtype=np.float64)])
            for op, c in costs.items()}


def lifted_memory(memory_model: Any, plan: Plan, arrays: tuple[Any, Any, Any, Any]) -> tuple[Any, Any, Any, Any]:
    """``(act, transient, state, w)`` of the plan's stages with the embedding stage's first (module doc)."""
    act, tr, state, w = arrays
    if act is None:
        return arrays
    cfg, tokens = memory_model.model_cfg, _tokens(plan)
    moved = float(getattr(memory_model, "embed_state_bytes", 0.0))
    e = cfg.dtype_bytes
    act = np.vstack([ID_BYTES * tokens[None, :], act])
    tr = None if tr is None else np.vstack([2 * cfg.d_model * e * tokens[None, :], tr])
    state = np.concatenate([[moved], np.asarray(state, dtype=np.float64)])
    state[-1] -= moved
    w = None if w is None else np.vstack([np.zeros((1, w.shape[1])), w])
    return act, tr, state, w


def embed_times(schedule: Schedule, costs: dict[str, np.ndarray] | None, comm: Any = 0.0,
                embed: tuple[np.ndarray, np.ndarray] | None = None) -> EmbedTimes:
    """The keys of ``embed_last`` (module doc) from ``schedule``'s timeline: with ``costs`` (``[S, m]`` per op) and
    ``comm`` (per microbatch) and the embeds' own ``embed`` seconds, else unit times (F = I = W = 1, B = 2)."""
    from dynmb.timing.simulate import action_times, cross_mask      # the one recurrence (simulate imports us)
    S, m = schedule.num_stages, schedule.num_microbatches
    flat = execution_order(schedule)
    if costs is None:
        dur = np.array([1.0, 2.0, 1.0, 1.0])[flat.op]
        comm_mb, lead = np.zeros(m), np.zeros(m)
    else:
        cube = np.zeros((4, S, m))
        for k, op in enumerate("FBIW"):
            if op in costs:
                cube[k] = costs[op]
        dur = cube[flat.op, flat.stage, flat.mb]
        comm_mb = np.broadcast_to(np.asarray(comm, dtype=np.float64), (m,))
        lead = comm_mb + (embed[0] if embed is not None else 0.0)
    cross = np.zeros(len(dur))
    xi = cross_mask(flat)
    cross[xi] = comm_mb[flat.mb[xi]]
    start, end = (np.asarray(t) for t in action_times(flat, dur, cross, schedule.num_ranks))
    first_f = np.flatnonzero((flat.stage == 0) & (flat.op == 0))
    first_b = np.flatnonzero((flat.stage == 0) & ((flat.op == 1) | (flat.op == 2)))
    fkey, bkey = np.zeros(m), np.zeros(m)
    fkey[flat.mb[first_f]] = start[first_f] - lead[flat.mb[first_f]]
    bkey[flat.mb[first_b]] = end[first_b] + comm_mb[flat.mb[first_b]]
    r = embed_rank(schedule)
    own = np.arange(flat.start[r], flat.start[r + 1])
    return EmbedTimes(fkey, bkey, list(zip(start[own].tolist(), end[own].tolist())))
