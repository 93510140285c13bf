"""What a running pipeline pays between its actions that the simulator does not know.

The simulator (``dynmb.simulate``) starts an action when its rank is free and its input message
has arrived, ``comm_s`` (the cost model's ``CommModel``) after the sender finished. Recorded
compares show two costs outside that model, both paid once per microbatch and stage, so a plan
with many microbatches is predicted too fast by more than a plan with few:

- **late receives.** A message is handed to the transport (``isend``) when its sender finishes,
  but gloo moves a large message only once the receiver has posted its ``irecv``, in a helper
  thread that competes with the sender's next compute for the cores. On the 2-core box an
  activation the receiver asked for after its sender had moved on arrived 5-100 ms later
  (``/work/meas/compare_small_r3``: balanced div=64, step 2, 16 microbatches, 185 ms of 2.0 s),
  where the ping-pong model says 0.2-0.6 ms;
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
time (``experiments/calibration_study.py``, column ``measured_actions+p2p``: the latency and gaps
fitted on the steps before each one), the simulator's error on dynamic's steps went from 4.1% to
1.6%, on balanced div=16's from 1.3% to 0.8%, the median over the 16 cases from 2.4% to 1.3%.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

__all__ = ["LATENCY_MIN_RECEIVES", "GAP_MIN_ACTIONS", "RECEIVE_COLUMNS", "receive_waits", "action_gaps",
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


def _keys(actions: pd.DataFrame) -> list[str]:
    return ["dp_rank", "stage", "mb"] if "dp_rank" in actions.columns else ["stage", "mb"]


def _pairs(actions: pd.DataFrame) -> pd.DataFrame:
    """Every cross-rank receive of one step with its sender's ``rank_src`` and ``end_src``."""
    keys = _keys(actions)
    cols = [*keys, "rank", "op", "start_s", "end_s", "wait_s", "comm_s"]
    a = actions[cols]
    fwd = a[a["op"] == "F"]
    bwd = a[a["op"].isin(("B", "I"))]
    src_f = fwd.assign(stage=fwd["stage"] + 1)[[*keys, "rank", "end_s"]]     # F of s feeds F of s + 1
    src_b = bwd.assign(stage=bwd["stage"] - 1)[[*keys, "rank", "end_s"]]     # B/I of s feeds B/I of s - 1
    out = pd.concat([fwd.merge(src_f, on=keys, suffixes=("", "_src")),
                     bwd.merge(src_b, on=keys, suffixes=("", "_src"))], ignore_index=True)
    return out[out["rank"] != out["rank_src"]]


def receive_waits(actions: pd.DataFrame) -> pd.Series:
    """One step's unexplained receive waits, seconds, one per cross-rank receive (module doc, 1)."""
    r = _pairs(actions)
    if r.empty:
        return pd.Series(dtype=float)
    posted = r["start_s"] - r["wait_s"]
    delay = r["start_s"] - r["end_s_src"]
    early = posted < r["end_s_src"]
    shortest = delay[early].groupby([r["rank_src"][early], r["rank"][early]]).min().to_dict()
    offset = np.array([(shortest[(s, d)] - shortest[(d, s)]) / 2 if (s, d) in shortest and (d, s) in shortest
                       else 0.0 for s, d in zip(r["rank_src"], r["rank"])])
    return (r["start_s"] - np.maximum(posted, r["end_s_src"] + offset + r["comm_s"])).astype(float)


def action_gaps(actions: pd.DataFrame) -> pd.DataFrame:
    """One step's gaps: ``op`` and ``gap_s`` (``start - wait_s - previous end`` on the rank) of
    every action but each rank's first (module doc, 2)."""
    ranks = ["dp_rank", "rank"] if "dp_rank" in actions.columns else ["rank"]
    a = actions.sort_values([*ranks, "start_s"])
    gap = a["start_s"] - a["wait_s"] - a.groupby(ranks)["end_s"].shift()
    return pd.DataFrame({"op": a["op"], "gap_s": gap}).dropna()


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
