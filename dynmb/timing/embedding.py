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

Where the embeds go on the last rank's list: ``dynmb.timing.embedplace``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dynmb.costmodel.base import CostModelLike
from dynmb.core.types import Plan

__all__ = ["embed_costs", "embed_seconds", "lifted_costs", "lifted_memory", "HOST_BYTES_PER_S", "ID_BYTES", "EMBED_OVERHEAD_S"]

HOST_BYTES_PER_S = 10e9
"""Memory bandwidth of a host (CPU) cost model's embed: a few streams of DRAM copy."""
EMBED_OVERHEAD_S = 20e-6
"""Fixed seconds of one embed op (a kernel launch and the send's posting, ``GPUSpec.overhead_s``)."""
ID_BYTES = 8
"""Bytes a token's id (int64) keeps on the embedding stage from its forward to its backward."""


def _tokens(plan: Plan) -> np.ndarray:
    shapes = plan.shapes()
    return (shapes[:, 0] * shapes[:, 1]).astype(np.float64)


def embed_seconds(cost_model: CostModelLike, rows: Any, padded_len: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(F, B)`` seconds of the embed and embedding-backward of microbatches of ``rows`` x ``padded_len`` tokens
    (module doc; what a packer adds to its fast estimate, ``dynmb.timing.makespan.embed_terms``)."""
    cfg = cost_model.model_cfg
    spec = getattr(cost_model, "spec", None)
    bandwidth = float(getattr(spec, "hbm_bytes_per_s", HOST_BYTES_PER_S))
    overhead = float(getattr(spec, "overhead_s", EMBED_OVERHEAD_S))
    tokens = np.asarray(rows, dtype=np.float64) * np.asarray(padded_len, dtype=np.float64)
    hidden = tokens * cfg.d_model * cfg.dtype_bytes
    return overhead + 2 * hidden / bandwidth, overhead + 3 * hidden / bandwidth


def embed_costs(cost_model: CostModelLike, plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    """``(F[m], B[m])`` seconds of the embeds and embedding-backwards of ``plan`` (module doc)."""
    shapes = plan.shapes()
    return embed_seconds(cost_model, shapes[:, 0], shapes[:, 1])


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
