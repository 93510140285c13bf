"""ZB-V for variable microbatches: two model chunks per rank placed V-wise, split backwards, a greedy list scheduler.

Placement (Qi et al., "Zero Bubble Pipeline Parallelism", arXiv:2401.10241, Section 6): the model is cut
into ``S = 2R`` stages (chunks) over ``R`` ranks; chunk 0 of rank ``r`` is stage ``r`` and chunk 1 is
stage ``S - 1 - r`` (``v_rank``), so a microbatch goes down the ranks and back up, and its first
forward and its last backward both run on rank 0. ``placement_rank(stage, S, virtual, placement)``
is the one stage -> rank rule of every placement (``"loop"``: ``s % R``, the interleaved one).

List scheduler (``zb_v``), one rank at a time in clock order (a heap). Each stage runs its forwards
and its backwards (``I``, or a full ``B`` where ``split`` is False) in microbatch order; a ``W``
joins its rank's queue when its ``I`` ends. At its clock ``t`` a rank takes, in this order:

1. an input gradient whose gradient is there (chunk 1's first: it is earlier in the backward pass);
2. a forward whose input is there (chunk 1's first: it leads to a backward), held to the admission that
   bounds the rank's memory (``held``): chunk 0's only while the rank holds fewer than ``cap - 1``
   chunk-microbatches (forwarded, not yet through ``W``) and chunk 1's fewer than ``cap``, so a rank never
   holds more than ``cap`` (the slot chunk 0 leaves free is a chunk-1 forward's: the oldest microbatch
   always gets through, rank 0's chunk 1 drains by itself, so no rank waits forever); when the rank is full
   and a ``W`` is queued the ``W`` runs first (it frees a slot);
3. a queued ``W`` (it fills the wait);
4. else its clock moves to the first input known to arrive (or to the next rank's clock).

P2P time is paid where a message crosses ranks (chunk 0 -> chunk 1 on rank ``R - 1`` is a local
handoff). With ``cap = 2R`` chunk-microbatches (the paper's ``p M_B``: each chunk holds half a
stage's layers) a rank warms up with about ``2R - 1`` forwards, the paper's ZB-V warm-up. Given an
``evaluate`` (the simulator) the builder tries ``cap`` = ``R + 1``, ``(3R + 1) // 2`` and ``2R`` and keeps
the fastest; without costs it runs unit times F = I = W = 1 at ``2R``. A rank never held more than
``cap`` chunk-microbatches (800 random pipelines; ``v_inflight``, tests/test_zbv_cap.py; the admission of
before, chunk 1's forwards let past the cap, held ``cap + R``); slices of long sequences are not taken
(``slices`` False).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Any

import numpy as np

from dynmb.core.types import Action, Schedule
from dynmb.schedule.zerobubble import Evaluate, ZBInputs

__all__ = ["placement_rank", "v_rank", "zb_v", "v_inflight", "admission_caps", "list_makespan", "PLACEMENTS"]

PLACEMENTS = ("loop", "v")
"""Stage -> rank rules: ``loop`` (stage ``s`` on rank ``s % R``), ``v`` (``v_rank``)."""


def v_rank(stage: int, num_stages: int) -> int:
    """Rank of ``stage`` under the V placement: ``s`` for the first half, ``S - 1 - s`` for the second."""
    return stage if stage < num_stages // 2 else num_stages - 1 - stage


def placement_rank(stage: int, num_stages: int, virtual: int, placement: str = "loop") -> int:
    """The rank that holds ``stage`` of ``num_stages`` with ``virtual`` chunks per rank under ``placement``."""
    if placement == "v":
        return v_rank(stage, num_stages)
    if placement != "loop":
        raise ValueError(f"unknown placement {placement!r}; expected one of {PLACEMENTS}")
    return stage % (num_stages // max(1, virtual))


def v_inflight(rank: Any, ranks: int, virtual: int, num_microbatches: int | None = None) -> Any:
    """Chunk-microbatches a rank (an array of ranks) of ``zb-v`` holds at most: the admission cap ``2R``, never
    more than ``2 m``."""
    bound = np.full(np.shape(rank), 2 * int(ranks))
    out = bound if num_microbatches is None else np.minimum(bound, 2 * int(num_microbatches))
    return out if np.ndim(rank) else int(out)


def zb_v(num_stages: int, m: int, inp: ZBInputs | None = None, *, evaluate: Evaluate | None = None) -> Schedule:
    """ZB-V (module doc): unit times without ``inp``; with ``evaluate`` the fastest admission cap."""
    if num_stages < 2 or num_stages % 2:
        raise ValueError(f"zb-v runs two chunks per rank: num_stages must be even and >= 2, got {num_stages}")
    inp = inp if inp is not None else ZBInputs.unit(num_stages, m)
    R = num_stages // 2
    if evaluate is None:
        return _list_v(inp, 2 * R)
    cands = [_list_v(inp, cap) for cap in admission_caps(R)]
    return min(cands, key=lambda c: evaluate(c)[0])


def admission_caps(ranks: int) -> tuple[int, ...]:
    """The admission caps ``zb_v`` tries with an evaluator: ``R + 1``, ``(3R + 1) // 2``, ``2R`` (distinct)."""
    R = int(ranks)
    return tuple(sorted({R + 1, (3 * R + 1) // 2, 2 * R}))


def list_makespan(inp: ZBInputs, cap: int) -> float:
    """The end of the greedy V list schedule with admission ``cap``, by the list scheduler's own clocks (each
    op starts at its rank's clock, which waits only for inputs it knows of: never before the simulator's start
    of the same op, so an upper bound of that schedule's simulated makespan; ``dynmb.timing.makespan_zbv``)."""
    v = _VList(inp, cap)
    v.schedule()
    return max(v.clock)


def _list_v(inp: ZBInputs, cap: int) -> Schedule:
    """The greedy V list schedule with admission ``cap`` (module doc)."""
    return _VList(inp, cap).schedule()


class _VList:
    """The state of one greedy V list schedule (module doc): per stage the end of every forward and
    backward and the next microbatch of each, per rank its clock, held chunk-microbatches and queued W."""

    def __init__(self, inp: ZBInputs, cap: int) -> None:
        S, m = inp.shape
        self.S, self.m, self.R, self.cap = S, m, S // 2, cap
        if cap < 2:
            raise ValueError(f"zb-v admission cap {cap}: a rank must hold at least 2 chunk-microbatches")
        self.rank_of = [v_rank(s, S) for s in range(S)]
        self.F, self.B, self.I, self.W = inp.F.tolist(), inp.B.tolist(), inp.I.tolist(), inp.W.tolist()
        self.comm, self.split = inp.comm.tolist(), inp.split.tolist()
        self.fend = [[-1.0] * m for _ in range(S)]
        self.bend = [[-1.0] * m for _ in range(S)]
        self.nf, self.nb = [0] * S, [0] * S           # next forward / backward microbatch of each stage
        self.clock, self.live = [0.0] * self.R, [0] * self.R
        self.pend: list[deque] = [deque() for _ in range(self.R)]
        self.acts: list[list[Action]] = [[] for _ in range(self.R)]

    def arrival(self, s: int, op: str, j: int) -> float:
        """When op j's input is on stage s (-1: not yet known); P2P time where it crosses ranks."""
        if op == "F":
            if s == 0:
                return 0.0
            end, a = self.fend[s - 1][j], s - 1
        else:
            if self.fend[s][j] < 0:
                return -1.0
            if s == self.S - 1:
                return self.fend[s][j]
            end, a = self.bend[s + 1][j], s + 1
        if end < 0:
            return -1.0
        return end + self.comm[j] if self.rank_of[a] != self.rank_of[s] else end

    def run(self, r: int, s: int, op: str, j: int) -> None:
        """Rank r runs ``op`` of microbatch j on stage s (X: its backward, I or a full B)."""
        if op == "X":
            op = "I" if self.split[s][j] else "B"
        cost = self.F if op == "F" else self.I if op == "I" else self.W if op == "W" else self.B
        self.clock[r] += cost[s][j]
        self.acts[r].append(Action(s, op, j))
        if op == "F":
            self.fend[s][j], self.nf[s], self.live[r] = self.clock[r], self.nf[s] + 1, self.live[r] + 1
        elif op == "W":
            self.live[r] -= 1
        else:
            self.bend[s][j], self.nb[s] = self.clock[r], self.nb[s] + 1
            if op == "I":
                self.pend[r].append((s, j))
            else:
                self.live[r] -= 1

    def _candidates(self, r: int) -> list[tuple[int, str, int]]:
        """Rank r's next ops in priority order (module doc): chunk 1's backward, chunk 0's, chunk 1's forward,
        chunk 0's, as (stage, op, microbatch); X is a backward."""
        c1, m = self.S - 1 - r, self.m
        out = [(s, "X", self.nb[s]) for s in (c1, r) if self.nb[s] < m]
        return out + [(s, "F", self.nf[s]) for s in (c1, r) if self.nf[s] < m]

    def step(self, r: int, t: float, heap: list[tuple[float, int, int]]) -> bool:
        """One decision of rank r at its clock t (module doc, 1-4); ``heap``: the other ranks' (clock, turn,
        rank). False when it could only wait with no known time to wait for."""
        cands = self._candidates(r)
        full = self.live[r] >= self.cap
        chosen = None
        for s, op, j in cands:                        # the first ready in priority order
            a = self.arrival(s, op, j)
            if 0 <= a <= t + 1e-12 and not (op == "F" and self.held(r, s)):
                chosen = (s, op, j)
                break
        if chosen is not None and not (full and self.pend[r] and chosen[1] == "F"):
            self.run(r, *chosen)
        elif self.pend[r]:
            self.run_w(r)
        else:
            known = [a for a in (self.arrival(s, op, j) for s, op, j in cands) if a > t]
            known += [c for c, _, _ in heap if c > t]
            if not known:
                return False
            self.clock[r] = min(known)                # wait for the first input (or the next rank to move)
        return True

    def held(self, r: int, s: int) -> bool:
        """True when rank r may not start a forward of stage s now (rule 2): chunk 0 while it holds ``cap - 1``
        chunk-microbatches (one slot kept for a chunk-1 forward), chunk 1 while it holds ``cap``."""
        return self.live[r] >= self.cap - int(s == r)

    def run_w(self, r: int) -> None:
        """Rank r runs its oldest queued ``W``."""
        s, j = self.pend[r].popleft()
        self.run(r, s, "W", j)

    def schedule(self) -> Schedule:
        """Advance the ranks in clock order until every op ran."""
        heap = [(0.0, r, r) for r in range(self.R)]   # (clock, turn, rank): a rank that waits goes behind
        turn, stuck = self.R, 0
        while heap:
            t, _, r = heapq.heappop(heap)
            if self.nb[r] == self.m and self.nb[self.S - 1 - r] == self.m:
                while self.pend[r]:
                    self.run_w(r)
                continue
            if self.step(r, t, heap):
                stuck = 0
            else:                                     # every rank at t and none can run: cannot happen
                stuck += 1
                if stuck > 2 * self.R:
                    raise RuntimeError(f"zb-v list scheduler stuck on rank {r} at t={t}")
            turn += 1
            heapq.heappush(heap, (self.clock[r], turn, r))
        return Schedule(self.acts, self.S, self.m, kind="zb-v")
