"""Helpers shared by the packers (numpy): row packing, memory budgets, makespan estimate.

- ``next_fit_rows(lengths_sorted, cap)``: next-fit over lengths in the given (sorted)
  order into rows of at most ``cap`` tokens; one ``bisect`` per row over the prefix sums,
  so it costs O(rows log n) Python steps, not O(n).
- ``ffd_rows(lengths, cap)``: first-fit-decreasing into rows of ``cap`` (Megatron-style
  packing baseline; O(n log rows) with a sorted list of open rows, best fit).
- ``est_makespan(F, B, comm_s, kind)``: the exact makespan of a GPipe or 1F1B schedule
  with per-stage, per-microbatch costs ``F[P, m]``, ``B[P, m]`` and a per-microbatch
  send time between neighbouring stages (every op starts when its stage is free and its
  input has arrived). 1F1B order on stage i: ``w = min(P-1-i, m)`` warm-up forwards,
  then F/B pairs, then the remaining backwards (torch's ``Schedule1F1B``). Computed by a
  sweep over stages that advances each one as far as its dependencies allow.
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np

__all__ = ["next_fit_rows", "ffd_rows", "est_makespan", "approx_makespan", "makespan", "stage_order", "EXACT_OPS"]

EXACT_OPS = 6000
"""Above this many ops (2 * P * m) ``makespan`` uses ``approx_makespan`` (relative error O(P / m))."""


def next_fit_rows(lengths: np.ndarray, cap: int) -> np.ndarray:
    """Row id per item (items in the given order, each <= cap), next-fit into rows of ``cap``."""
    n = len(lengths)
    cum = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    row = np.empty(n, dtype=np.int64)
    a, r = 0, 0
    while a < n:
        e = bisect.bisect_right(cum, cum[a] + cap, lo=a + 1) - 1
        e = max(e, a + 1)
        row[a:e] = r
        a, r = e, r + 1
    return row


def ffd_rows(lengths: np.ndarray, cap: int) -> np.ndarray:
    """Row id per item: first-fit-decreasing (best fit among open rows) into rows of ``cap``."""
    order = np.argsort(-lengths, kind="stable")
    row = np.empty(len(lengths), dtype=np.int64)
    free: list[tuple[int, int]] = []     # sorted (remaining, row)
    nrows = 0
    for i in order.tolist():
        x = int(lengths[i])
        k = bisect.bisect_left(free, (x, -1))
        if k < len(free):
            rem, r = free.pop(k)
            rem -= x
        else:
            r, rem = nrows, cap - x
            nrows += 1
        row[i] = r
        if rem > 0:
            bisect.insort(free, (rem, r))
    return row


def stage_order(stage: int, num_stages: int, m: int, kind: str) -> list[tuple[str, int]]:
    """The (op, mb) sequence of ``stage`` under GPipe or 1F1B."""
    if kind == "gpipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
    w = min(num_stages - 1 - stage, m)
    seq = [("F", j) for j in range(w)]
    for j in range(m - w):
        seq += [("F", w + j), ("B", j)]
    seq += [("B", j) for j in range(m - w, m)]
    return seq


def est_makespan(F: np.ndarray, B: np.ndarray, comm_s: Any = 0.0, kind: str = "1f1b") -> float:
    """Makespan of the schedule ``kind`` (gpipe or 1f1b; others use 1f1b) for costs ``F``, ``B``."""
    p, m = F.shape
    if m == 0:
        return 0.0
    kind = "gpipe" if kind == "gpipe" else "1f1b"
    c = np.broadcast_to(np.asarray(comm_s, dtype=np.float64), (m,)).tolist()
    Fl, Bl = F.tolist(), B.tolist()
    seqs = [stage_order(i, p, m, kind) for i in range(p)]
    endF = [[-1.0] * m for _ in range(p)]
    endB = [[-1.0] * m for _ in range(p)]
    pos = [0] * p
    free = [0.0] * p
    total = 2 * m * p
    done = 0
    while done < total:
        progressed = False
        for i in range(p):
            seq, k, t = seqs[i], pos[i], free[i]
            fi, bi = Fl[i], Bl[i]
            ef, eb = endF[i], endB[i]
            while k < len(seq):
                op, j = seq[k]
                if op == "F":
                    if i > 0:
                        dep = endF[i - 1][j]
                        if dep < 0:
                            break
                        dep += c[j]
                        if dep > t:
                            t = dep
                    t += fi[j]
                    ef[j] = t
                else:
                    if i < p - 1:
                        dep = endB[i + 1][j]
                        if dep < 0:
                            break
                        dep += c[j]
                        if dep > t:
                            t = dep
                    if ef[j] > t:
                        t = ef[j]
                    t += bi[j]
                    eb[j] = t
                k += 1
                done += 1
                progressed = True
            pos[i], free[i] = k, t
        if not progressed:
            raise RuntimeError("makespan estimate deadlocked (bad schedule order)")
    return float(max(free))


def approx_makespan(F: np.ndarray, B: np.ndarray, comm_s: Any = 0.0) -> float:
    """1F1B/GPipe makespan estimate for m >> P: the busiest stage's work plus the fill of the
    first microbatch's forward up to that stage and the drain of the last one's backward."""
    p, m = F.shape
    c = float(np.mean(comm_s)) if np.ndim(comm_s) else float(comm_s)
    work = (F + B).sum(axis=1)
    fill = np.concatenate([[0.0], np.cumsum(F[:-1, 0] + c)])
    drain = np.concatenate([[0.0], np.cumsum(B[:-1, -1] + c)])
    return float(np.max(work + fill + drain))


def makespan(F: np.ndarray, B: np.ndarray, comm_s: Any = 0.0, kind: str = "1f1b") -> float:
    """``est_makespan`` when small enough (2 * P * m <= EXACT_OPS), else ``approx_makespan``."""
    if 2 * F.size <= EXACT_OPS:
        return est_makespan(F, B, comm_s, kind)
    return approx_makespan(F, B, comm_s)
