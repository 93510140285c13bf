"""The makespan estimate of ZB-V (``zb-v``, ``dynmb.schedule.vshape``): the builder's list scheduler, timed by its clocks.

``dynmb.timing.makespan.makespans(F, B, comm, sizes, "zb-v", shares=, virtual=2)`` comes here (the kind's
``estimate_as``). ``F`` / ``B`` are ``[S, M]`` with ``S = 2R`` model chunks (stage ``s`` on rank
``v_rank(s)``); the split backward is ``split_backward(B, shares)`` (``dynmb.timing.makespan_zb``: the cost
model's ``I / B``, ``W / B`` per stage when the caller passes them, else ``dynmb.costmodel.split``'s).

ZB-V's op order is chosen by a greedy list scheduler that reads the costs (which input gradient, forward or queued
``W`` a rank runs next depends on when each input arrives), so no fixed order swept with the costs stands for it:
the order of unit costs swept with real ones is up to 40% above the simulated step on random pipelines (lognormal
microbatches, P 2-8). The estimate is therefore the builder's own greedy pass at the largest admission cap it tries
(``2R``, ``vshape.admission_caps``; with the exact admission, rule 2 of ``vshape``, the fastest of the three in 200
of 200 random pipelines, the estimate at most 1.5% above the simulated step there; in about 60% with the admission
of before), timed by the list scheduler's clocks (``vshape.list_makespan``). A list clock is never before the
simulator's start of the same op (it waits only for inputs already known), so it is an upper bound of that order's
simulated step, and the builder keeps the fastest of its caps by the simulator: the estimate is an upper bound of
``simulate`` of the built schedule (``guarantee="upper"``), above it by at most ``TOLERANCE`` on random pipelines
(tests/test_estimators.py; the gap: a smaller cap was faster, or a rank waited past an input sent by a rank at the
same clock). All three caps would bring it within 1.1% (200 random pipelines) at three times the cost, which the
packers pay on each of their finals (a zb-v plan of a 256-sequence batch at P 16: 3 CPU s with one cap, 8 with
three, 1.2 with the interleaved estimate of before). Cost: one greedy pass without the simulator, O(ops) Python
steps per pipeline; the packers rank candidates with the interleaved estimate on the same chunks
(``dynmb.timing.makespan_zb.RANK_AS``) and use this one for the finals.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dynmb.schedule.vshape import admission_caps, list_makespan
from dynmb.schedule.zerobubble import ZBInputs
from dynmb.timing.estimators import Estimator, register_estimator
from dynmb.timing.makespan_zb import split_backward

__all__ = ["zbv_makespans", "TOLERANCE", "ESTIMATE"]

ESTIMATE = "zb-v"
"""The ``estimate_as`` of this estimate."""
TOLERANCE = 0.10
"""The estimate is at most this far above the simulated zb-v step on random pipelines (never below it)."""


def zbv_makespans(F: np.ndarray, B: np.ndarray, comm: np.ndarray, sizes: np.ndarray, *, exact: bool | None = None,
                  shares: np.ndarray | None = None, virtual: int = 2) -> np.ndarray:
    """The estimate (module doc) of each pipeline k (the next ``sizes[k]`` columns; 0 for an empty one);
    ``exact`` is not read, ``virtual`` must be 2 (two chunks per rank)."""
    S = F.shape[0]
    if int(virtual) != 2 or S < 2 or S % 2:
        raise ValueError(f"zb-v estimate: two chunks per rank on an even number of stages, got {S} stages, "
                         f"virtual {virtual}")
    sizes = np.asarray(sizes, dtype=np.int64)
    comm = np.broadcast_to(np.asarray(comm, dtype=np.float64), (F.shape[1],))
    I, W = split_backward(B, shares)                           # noqa: E741
    offs = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    out = np.zeros(len(sizes))
    for k, (a, e) in enumerate(zip(offs[:-1], offs[1:])):
        if e > a:
            inp = ZBInputs(F[:, a:e], B[:, a:e], I[:, a:e], W[:, a:e], comm[a:e], np.ones((S, e - a), dtype=bool))
            out[k] = list_makespan(inp, admission_caps(S // 2)[-1])
    return out


def _estimate(F: np.ndarray, B: np.ndarray, comm: np.ndarray, sizes: np.ndarray, **kw: Any) -> np.ndarray:
    return zbv_makespans(F, B, comm, sizes, **kw)


register_estimator(Estimator(name=ESTIMATE, makespans=_estimate, guarantee="upper", tolerance=TOLERANCE,
                             split_backward=True))
