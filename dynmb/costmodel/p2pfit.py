"""What a running pipeline pays between its actions that the simulator does not know.

The simulator (``dynmb.timing.simulate``) starts an action when its rank is free and its input message
has arrived, ``comm_s`` (the cost model's ``CommModel``) after the sender finished. Recorded
compares show two costs outside that model, both paid once per microbatch and stage, so a plan
with many microbatches is predicted too fast by more than a plan with few:

- **late receives.** A message is handed to the transport (``isend``) when its sender finishes,
  yet the recorded waits behave as a rendezvous: a receive posted before its sender finished
  waited 0.2-0.4 ms beyond the ping-pong model (median), while an activation the receiver asked
  for after its sender had moved on to its next compute often waited 5-100 ms *after asking*
  (a default ``dynmb compare`` recorded on the loaded 2-core box, c0fe06a: balanced div=64, step 2, 16 microbatches: 185 ms of a 2.0 s
  step), as if the transfer starts once both ends are there and competes with the sender's
  compute for the 2 cores (our reading of the timings; gloo's internals were not traced);
- **gaps.** Between one action's end and the next one's receive the interpreter builds the
  next forward's inputs and samples the memory meter: about 1.3 ms before every ``F``.

Algorithm, on one step's ``actions`` (every rank's: ``rank``, ``stage``, ``op``, ``mb``,
``start_s``, ``end_s``, ``wait_s``, and ``comm_s``, the cost model's P2P seconds of the action's
microbatch; ``dp_rank`` when present):

1. ``receive_waits``: every action that receives a message from another rank (``F`` of stage s
   from ``F`` of s - 1, ``B``/``I`` of s from ``B``/``I`` of s + 1) gets its *unexplained wait*
   ``start - max(posted, sender_end + offset + comm_s)``, where ``posted = start - wait_s`` is
   when the receiver asked for the message. The two ranks' clocks start at their own barrier
   exits; ``offset`` (receiver clock minus sender clock) is half the difference of the shortest
   delays ``start - sender_end`` in the two directions of the rank pair, over the receives that
   were posted before their sender finished (those see the transport's latency and nothing else);
   0 when a direction has none.
2. ``action_gaps``: every action but a rank's first gets ``start - wait_s - previous end`` on
   its rank.

``p2p_latency(waits)`` is the mean unexplained wait over some steps' receives (a mean, since the
step adds the waits up; the few long ones are most of it), never negative, None with fewer than
``LATENCY_MIN_RECEIVES`` receives. ``gap_per_op(gaps)`` the median gap per op (a median: a
gap that is long because the rank was descheduled belongs to the speed the scale measures),
``GAP_MIN_ACTIONS`` of an op needed. ``calibration.job_calibration`` adds the latency to every
receiving action (``CostModel.with_recv_latency``) and the gap to every action's per-action
overhead.

Why on the receiving action and not on the message's P2P time: the wait starts when the
receiver asks (rendezvous), not when the sender finished, so a message sent long before still
costs its receiver the wait; a latency on the P2P time would delay only the receivers the
simulator has waiting anyway. Replayed on ``compare_small_r3`` with every action's measured
time (``studies/prediction/calibration_study.py``, column ``measured_actions+p2p``: the latency and gaps
fitted on the steps before each one), the simulator's error on dynamic's steps went from 4.1% to
1.6%, on balanced div=16's from 1.3% to 0.8%, the median over the 16 cases from 2.4% to 1.3%.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

__all__ = ["LATENCY_MIN_RECEIVES", "GAP_MIN_ACTIONS", "RECEIVE_COLUMNS", "has_receive_columns", "receive_waits", "action_gaps",
           "p2p_latency", "gap_per_op"]

LATENCY_MIN_RECEIVES = 8
"""``p2p_latency`` needs 8 receives across ranks."""

GAP_MIN_ACTIONS = 8
"""``gap_per_op`` needs 8 gaps of an op."""

RECEIVE_COLUMNS = ("rank", "stage", "op", "mb", "start_s", "end_s", "wait_s", "comm_s")
"""The ``actions`` columns the fit reads (``dp_rank`` too, when there)."""


def has_receive_columns(actions: pd.DataFrame) -> bool:
    """Whether ``actions`` carries what ``receive_waits`` and ``action_gaps`` read."""
    return set(RECEIVE_COLUMNS) <= set(actions.columns)


def _pairs(actions: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Positions of one step's cross-rank receives and of their senders (a dictionary walk: a
    step holds a few hundred actions, where pandas merges cost more than the rest of the fit)."""
    n = len(actions)
    dp = actions["dp_rank"].to_numpy() if "dp_rank" in actions.columns else np.zeros(n, dtype=np.int64)
    stage, op, mb, rank = (actions[c].to_numpy() for c in ("stage", "op", "mb", "rank"))
    sent: dict[tuple, int] = {}
    for i in range(n):             # F of s feeds F of s + 1; B/I of s feeds B/I of s - 1
        if op[i] == "F":
            sent[(dp[i], stage[i] + 1, mb[i], "F")] = i
        elif op[i] in ("B", "I"):
            sent[(dp[i], stage[i] - 1, mb[i], "B")] = i
    recv, src = [], []
    for i in range(n):
        j = sent.get((dp[i], stage[i], mb[i], "F" if op[i] == "F" else "B")) if op[i] in ("F", "B", "I") else None
        if j is not None and rank[j] != rank[i]:
            recv.append(i)
            src.append(j)
    return np.asarray(recv, dtype=np.int64), np.asarray(src, dtype=np.int64)


def receive_waits(actions: pd.DataFrame) -> pd.Series:
    """One step's unexplained receive waits, seconds, one per cross-rank receive (module doc, 1)."""
    recv, src = _pairs(actions)
    if len(recv) == 0:
        return pd.Series(dtype=float)
    start, end, wait, comm, rank = (actions[c].to_numpy()
                                    for c in ("start_s", "end_s", "wait_s", "comm_s", "rank"))
    start, wait, comm, sender_end = start[recv], wait[recv], comm[recv], end[src]
    pair = list(zip(rank[src].tolist(), rank[recv].tolist()))
    posted = start - wait
    delay = start - sender_end
    shortest: dict[tuple[int, int], float] = {}
    for p, d, early in zip(pair, delay, posted < sender_end):
        if early:
            shortest[p] = min(d, shortest.get(p, np.inf))
    offset = np.array([(shortest[(s, d)] - shortest[(d, s)]) / 2 if (s, d) in shortest and (d, s) in shortest
                       else 0.0 for s, d in pair])
    return pd.Series(start - np.maximum(posted, sender_end + offset + comm), dtype=float)


def action_gaps(actions: pd.DataFrame) -> pd.DataFrame:
    """One step's gaps: ``op`` and ``gap_s`` (``start - wait_s - previous end`` on the rank) of
    every action but each rank's first (module doc, 2)."""
    rank = actions["rank"].to_numpy()
    start, end, wait, op = (actions[c].to_numpy() for c in ("start_s", "end_s", "wait_s", "op"))
    order = np.lexsort((start, rank))                 # rank by rank (a global rank), in time order
    same = rank[order][1:] == rank[order][:-1]
    after = order[1:][same]
    gap = start[after] - wait[after] - end[order[:-1][same]]
    return pd.DataFrame({"op": op[after], "gap_s": gap})


def p2p_latency(waits: Sequence[pd.Series]) -> float | None:
    """Mean of the unexplained receive waits ``waits`` (``receive_waits`` of some steps), >= 0;
    None with fewer than ``LATENCY_MIN_RECEIVES`` of them."""
    allw = np.concatenate([np.asarray(w, dtype=np.float64) for w in waits]) if waits else np.zeros(0)
    return max(0.0, float(allw.mean())) if len(allw) >= LATENCY_MIN_RECEIVES else None


def gap_per_op(gaps: Sequence[pd.DataFrame]) -> dict[str, float]:
    """Median gap per op over ``gaps`` (``action_gaps`` of some steps; ``GAP_MIN_ACTIONS`` of an
    op needed)."""
    if not gaps:
        return {}
    allg = pd.concat(gaps, ignore_index=True)
    return {str(op): max(0.0, float(g["gap_s"].median())) for op, g in allg.groupby("op")
            if len(g) >= GAP_MIN_ACTIONS}
