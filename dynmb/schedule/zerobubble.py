"""Zero-bubble schedules for variable-size microbatches: a greedy list scheduler over F, I, W.

A split backward (``I``: input gradient, ``W``: weight gradients; see
``dynmb.runtime.splitbackward``) lets a stage send its input gradient upstream before it has
computed its weight gradients, and run the ``W`` later, where it would otherwise wait. With
variable microbatches the gaps differ everywhere, so the order is built from the predicted
times of every (stage, microbatch) instead of a fixed pattern.

List scheduler (``list_schedule``), one stage per rank. Each stage keeps 1F1B's order of
forwards and backwards for an in-flight window ``inflight[s]`` (forward while fewer are in
flight, else the oldest backward; ``P - s`` is 1F1B), with each backward an ``I`` (a full ``B``
where ``split`` is False); a ``W`` joins a FIFO queue when its ``I`` ends and counts as in
flight until it ran (windows under which a stage would wait for forwards its upstream
stage sends only after that wait, e.g. one that grows downstream, are refused: ``_check_windows``).
Stages are advanced in time order (a heap on their clocks); at its
clock ``t`` a stage looks at the next op of its order:

1. if it is a forward that the in-flight window or the memory cap stops, or a backward whose
   bytes would pass the cap, and a ``W`` is queued: the oldest ``W`` runs (it frees both);
2. else if its input is there (the activation of the previous stage, the gradient of the
   next stage's ``B``/``I``, each plus P2P time; the last stage's backward: its own
   forward): it runs;
3. else if a ``W`` is queued and ends before that input can arrive (known when its producer
   ran, else a lower bound: the producer's clock + its op + P2P): the ``W`` fills the gap;
4. else, with a ``fill`` objective, if a ``W`` is queued and waiting would make this stage the
   critical one -- its projected span (its work plus its waits since its first op: the span it
   would have if it waited no more; ``fill="span"``) or end (that span from its first op's start;
   ``"makespan"``) the largest of all stages' -- the ``W`` runs although it ends after the input
   arrives (Qi et al., Section 3.1: "insert a W if the current bubble makes the largest cumulative
   bubble size among all stages larger"; with equal stages the two are the same test), decided when
   the stage falls idle (its clock at its last op's end, the wait ``r - t`` then exact or a lower
   bound), so that the ``W`` starts where the simulator starts it;
5. else, with ``pump``, if the op is a backward and the stage's next forward (in microbatch order; possibly
   past its window) has arrived and fits under the cap, that forward runs now (it may end after the
   gradient arrives; its template slot is skipped later): a memory-bound stage whose window is full keeps
   feeding the stages after it while a gradient is on its way (P2P latency on the loop of 1F1B's window);
6. else the clock moves to that arrival time (or bound).

When the order is done, the queued ``W`` run. The times are the simulator's recurrence for the
order emitted, and the forwards and backwards keep 1F1B's (window's) order, so a ``W`` only
ever runs in a gap or where the window needs its slot -- where 1F1B's ``B`` had its weight part.

Memory, per stage, the simulator's rule (``dynmb.timing.simulate.op_memory``): held bytes grow by
``a`` at F, shrink by ``a`` at B, change by ``w - a`` at I and shrink by ``w`` at W; while an op
runs it also holds: F and B ``tr``, I ``max(w - a, 0) + tr``, W nothing. An op is started
only if held + its extra stays within ``caps[s]``; a backward that would pass it runs queued
``W`` first, and when none is queued runs as a full ``B`` (an ``I`` holds ``max(w - a, 0)`` more
than ``B``), which starts anyway: waiting cannot lower the bytes. The times the scheduler computes are the simulator's
recurrence for the order it emits.

Kinds:

- ``zb-h1`` (``zb_h1``): ZB-H1 as published (Qi et al., arXiv:2401.10241, Section 2.1): 1F1B's
  in-flight count ``P - s`` for forwards, and stage s may defer ``s`` weight gradients beyond it
  (``w_defer``: a forward waits only when ``P - s`` microbatches wait for their ``I`` or ``P``
  for their ``W``), so the input gradients reach stage 0 without the ``W`` in their way; the paper's
  worker i holds ``(p - i + 1) M_B + (i - 1) M_W``. With memory inputs every stage is capped at what
  1F1B's fullest GPU holds (``h1_caps``: its peak plus states, less the stage's own states), so the
  peak over GPUs never exceeds 1F1B's. Given an ``evaluate`` (the planner passes the simulator), the
  list schedule without deferral and 1F1B's order are candidates too, and, where a split backward
  costs more than a full one (the CPU shares of ``dynmb.costmodel.split``; not a GPU's), the list
  schedule with full backwards wherever its ``W`` ran right after its ``I``, once everywhere and once
  keeping the splits of each stage's last ``P - s`` microbatches: the fastest is returned, so ZB-H1 is
  never predicted slower than 1F1B. Fed the paper's profiled times (its Table 9) it gives its Table 5
  ZB-H1 bubble rates to four digits (``studies/zerobubble``).
- ``zb`` (``zb_limit_aware``), the memory-spending kind (ZB-2p-like): the caps are the memory limit
  (minus states), every ``W`` may be deferred as far as they let, and the in-flight count grows toward
  ZB-H2's ``2 (P - s) - 1`` extra warm-up forwards: candidates ``k_s = P - s + round(alpha (P - s - 1))``
  for ``alpha`` = 0 then ``ZB_ALPHAS`` in increasing order, stopping at the first that is no faster than
  the one before, without rule 4, then with it for ``evaluate``'s objective (``objective_of``) from
  the fastest window of the first sweep up; plus ZB-H1 and 1F1B; the fastest by ``evaluate`` whose
  simulated peak stays under the limit wins. Fed the paper's profiled times (Table 9) under its ZB-2p limit ``2 p M_B``, judged by
  its cost (the longest stage span), it gives its Table 5 ZB-2p bubble rates to four digits at P 8 and
  16 (``tests/test_zb_paper.py``); without rule 4 it left a wait shorter than a ``W`` empty on every
  cool-down step of stage 0 (at 1.5B, m 24: 0.0906 for 0.0433; 0.0877 at ZB-H2's window). Three more
  candidates: two run 1F1B's windows with rule 5 (``pump``), one with ZB-H1's deferral and one with every ``W``
  deferrable, and the fastest window of the second sweep with rule 4 and rule 5, under the limit's caps (``studies/shortdoc/schedule_gap.py``: at 24 GiB the busiest stage waits
  for forwards held back by stage 0's window while P2P latency stretches the gradients' return).

Judging: where ``evaluate`` declares itself the simulator's makespan on these inputs (``evaluate.judge``, as the
planner's), the list scheduler's own makespan of a candidate is the judge's, bit for bit (the same recurrence on
the same numbers; ``tests/test_zb_judge.py``), so a candidate whose own makespan already loses (``zb_h1``: not
below the fastest judged before it; ``zb``: neither below the best that fits nor below its sweep's fastest) is
built but not judged (``JUDGE_CONTENDERS_ONLY``): the same choice. Such a candidate is not even built to its end
(``_give_up_at``): every ``CHECK_EVERY`` decisions the scheduler looks whether some stage's last end plus a lower
bound of its work still to run (forwards and backwards left, each backward at ``min(B, I + W)``, and its queued ``W``) passes
the time below which alone it would be judged, and stops there (``listed``'s ``give_up``).

Slices of a long sequence (``backward_order``, ``Plan.backward_order``): every stage's order
takes its backwards (``I`` or ``B``) in that order, so a chain's input gradients run in reverse
slice order as its ``B`` would (its ``W`` anywhere after its ``I``: they read only the stage's
own Linear inputs and output gradients), and forwards on until a backward's own microbatch
went forward (``dynmb.schedule.order.windowed_order``, with the ``ChainOrder``'s lookahead past
it); 1F1B's candidate and the caps it gives use the same order.

Without costs (``build_schedule("zb-h1", P, m)``): unit times F = I = W = 1, B = 2, no P2P
time, no memory caps -- the paper's setting; ``zb`` without costs is ZB-H1's order.
"""

from __future__ import annotations

import hashlib
import heapq
import threading
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from dynmb.schedule.order import check_order, lookahead_of, stage_order, windowed_order
from dynmb.core.types import Action, Schedule

__all__ = ["ZBInputs", "Listing", "list_schedule", "listed", "zb_h1", "zb_limit_aware", "one_f_one_b_peaks", "op_bytes", "ZB_ALPHAS",
           "FILL_OBJECTIVES", "objective_of", "PUMPED"]

ZB_ALPHAS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0)
"""Extra warm-up forwards tried by ``zb``, as multiples of ZB-H2's ``P - s - 1``."""

Evaluate = Callable[[Schedule], tuple[float, np.ndarray]]
"""schedule -> (predicted makespan, predicted peak bytes per stage, states included). It may declare what its
time measures as an attribute ``objective`` (``FILL_OBJECTIVES``; ``objective_of``): ``"makespan"`` (default:
the whole step, steps synchronised at the optimizer as dynmb's runtime does) or ``"span"`` (the longest span
of one stage, first op to last: steps overlap, Qi et al.'s cost)."""

FILL_OBJECTIVES = ("span", "makespan")
"""What the list scheduler's critical-wait rule (module doc, rule 4) projects per stage."""


def objective_of(evaluate: Evaluate) -> str:
    """``evaluate``'s declared ``objective`` (``"makespan"`` unless it says ``"span"``)."""
    return _check_fill(getattr(evaluate, "objective", "makespan")) or "makespan"


def _check_fill(fill: str | None) -> str | None:
    if fill is not None and fill not in FILL_OBJECTIVES:
        raise ValueError(f"zero-bubble list scheduler: fill must be None or one of {FILL_OBJECTIVES}, got {fill!r}")
    return fill


@dataclass
class ZBInputs:
    """Per (stage, microbatch) seconds and bytes the scheduler plans with ([P, m] arrays).

    ``W``/``I`` are used where ``split`` is True, ``B`` elsewhere; ``comm[m]`` is the P2P time of
    microbatch m's messages. ``act``/``w``/``tr`` (activation, held from I to W, transient) are
    optional: without them no memory cap applies."""

    F: np.ndarray
    B: np.ndarray
    I: np.ndarray  # noqa: E741
    W: np.ndarray
    comm: np.ndarray
    split: np.ndarray
    act: np.ndarray | None = None
    w: np.ndarray | None = None
    tr: np.ndarray | None = None

    @classmethod
    def unit(cls, num_stages: int, m: int) -> "ZBInputs":
        """F = I = W = 1, B = 2, no P2P time, no memory: the zero-bubble paper's setting."""
        one = np.ones((num_stages, m))
        return cls(one, 2 * one, one, one, np.zeros(m), np.ones((num_stages, m), dtype=bool))

    @property
    def shape(self) -> tuple[int, int]:
        return self.F.shape


def op_bytes(op: str, a: float, w: float, tr: float) -> tuple[float, float]:
    """``(change of held bytes at the end of op, extra bytes held while it runs on top of the
    held-before level)`` (module doc; ``dynmb.timing.simulate.op_memory`` is the same rule, vectorised)."""
    if op == "F":
        return a, a + tr
    if op == "B":
        return -a, tr
    if op == "I":
        return w - a, max(w - a, 0.0) + tr
    return -w, 0.0


def _one_f_one_b(num_stages: int, m: int, order: Sequence[int] | None = None) -> Schedule:
    """1F1B's schedule (``dynmb.schedule.builders.one_f_one_b``: the same ``stage_order``), built here
    so that the builders can import this module."""
    return Schedule([[_stage_actions(s, m)[op][j] for op, j in stage_order(s, num_stages, m, "1f1b", order)]
                     for s in range(num_stages)], num_stages, m, kind="1f1b")


def one_f_one_b_peaks(inp: ZBInputs, backward_order: Sequence[int] | None = None) -> np.ndarray:
    """Peak held + running bytes (no states) of every stage under 1F1B with full backwards
    (backwards in ``backward_order``): per stage, the held bytes before each op (a running sum in the op order,
    ``op_bytes``' changes) plus what the op holds while it runs, at most."""
    P, m = inp.shape
    out = np.zeros(P)
    act = np.zeros((P, m)) if inp.act is None else inp.act
    tr = np.zeros((P, m)) if inp.tr is None else inp.tr        # a memory model without transients
    for s in range(P):
        seq = stage_order(s, P, m, "1f1b", backward_order)
        if not seq:
            continue
        fwd = np.array([op == "F" for op, _ in seq])
        mb = np.array([j for _, j in seq])
        a, t = act[s, mb], tr[s, mb]
        held = np.cumsum(np.where(fwd, a, -a))              # in order, as one running sum adds them
        extra = np.where(fwd, a + t, t)                     # op_bytes("F" / "B", a, 0, tr)[1]
        extra[1:] += held[:-1]
        out[s] = max(0.0, float(extra.max()))
    return out


def _check_windows(windows: Sequence[int], orders: Sequence[Sequence[tuple[str, int]]]) -> None:
    """Refuse in-flight windows whose stage orders wait on each other (the list scheduler would chase
    lower bounds forever): stage ``s``'s b-th backward needs stage ``s + 1``'s b-th, which needs as many
    of stage ``s``'s forwards as stage ``s + 1`` runs before it -- never more than stage ``s`` ran before
    its own b-th. Windows that never grow downstream (1F1B's ``P - s``, every ``_inflight``) always pass."""
    before = []
    for order in orders:
        f, row = 0, []
        for op, _ in order:
            if op == "F":
                f += 1
            else:
                row.append(f)
        before.append(row)
    for s in range(len(before) - 1):
        for b, (need, sent) in enumerate(zip(before[s + 1], before[s])):
            if need > sent:
                raise ValueError(f"zero-bubble list scheduler: in-flight windows {list(windows)} deadlock: stage "
                                 f"{s + 1} runs {need} forwards before its backward #{b}, stage {s} only {sent}")


@dataclass(frozen=True)
class Listing:
    """The settings of one list schedule (``list_schedule``'s arguments after ``inp``)."""

    inflight: Sequence[int]
    caps: Sequence[float] | np.ndarray | None = None
    kind: str = "zb"
    backward_order: Sequence[int] | None = None
    w_defer: Sequence[int] | None = None
    fill: str | None = None
    pump: bool = False


class _ListRun:
    """One run of the list scheduler: each stage's clock, held bytes, in-flight count, queued Ws and emitted order."""

    STEP = {"F": 1, "B": -1, "I": 0, "W": -1}   # in-flight count change per op

    def __init__(self, inp: ZBInputs, how: Listing, give_up: float = np.inf) -> None:
        P, m = inp.shape
        self.P = P
        self.fill = _check_fill(how.fill)
        self.pump = bool(how.pump)
        inflight, caps, backward_order, w_defer = how.inflight, how.caps, how.backward_order, how.w_defer
        self.nextf = [0] * P                        # forwards run on each stage (they run in microbatch order)
        # the span each stage would have if it waited no more: its work, plus its waits once started
        self.span = (inp.F + np.where(inp.split, inp.I + inp.W, inp.B)).sum(axis=1).tolist()
        self.first = [0.0] * P                      # start of each stage's first op
        self.free = [0.0] * P                       # end of each stage's last op
        check_order(m, backward_order)              # refused here, before any stage
        self.k = [max(1, min(m, int(x))) for x in inflight]
        self.defer = [0] * P if w_defer is None else [max(0, int(x)) for x in w_defer]
        mem = caps is not None and inp.act is not None
        self.cap = [float(c) + 1e-6 for c in caps] if mem and caps is not None else [np.inf] * P
        zero = np.zeros((P, m))
        # plain Python lists: the loop reads one scalar at a time
        self.act, self.wb, self.tr = ((zero if a is None else a).tolist() for a in (inp.act, inp.w, inp.tr))
        self.F, self.B, self.I, self.W = inp.F.tolist(), inp.B.tolist(), inp.I.tolist(), inp.W.tolist()
        self.comm, self.split = inp.comm.tolist(), inp.split.tolist()
        self.est_bwd = np.where(inp.split, inp.I, inp.B).tolist()
        self.fend = [[-1.0] * m for _ in range(P)]
        self.bend = [[-1.0] * m for _ in range(P)]
        self.clock = [0.0] * P
        # 1F1B's greedy order per stage for its window (X: the backward, I or B)
        self.todo = [deque(_windowed(m, self.k[s], backward_order)) for s in range(P)]  # its lookahead
        if any(a < b for a, b in zip(self.k, self.k[1:])):
            _check_windows(self.k, self.todo)           # a window that grows downstream may deadlock
        self.pend: list[deque] = [deque() for _ in range(P)]
        self.held, self.live = [0.0] * P, [0] * P
        self.ranks: list[list[Action]] = [[] for _ in range(P)]
        self.acts = [_stage_actions(s, m) for s in range(P)]      # Action(s, op, j) is acts[s][op][j]
        self.makespan = 0.0
        self.give_up = float(give_up)
        if self.give_up < np.inf:           # each stage's work from its f-th forward / b-th backward on (``passes``)
            bwd = np.where(inp.split, np.minimum(inp.I + inp.W, inp.B), inp.B)[:, check_order(m, backward_order)]
            left = np.zeros((2, P, m + 1))
            left[:, :, :m] = np.cumsum(np.stack([inp.F, bwd])[:, :, ::-1], axis=2)[:, :, ::-1]
            self.f_left, self.b_left = left.tolist()

    def ready(self, s: int, op: str, j: int) -> tuple[float, bool]:
        """(time op j's input is there, known?) -- else a lower bound from the producer's clock."""
        comm = self.comm
        if op == "F":
            if s == 0:
                return 0.0, True
            if self.fend[s - 1][j] >= 0:
                return self.fend[s - 1][j] + comm[j], True
            return self.clock[s - 1] + self.F[s - 1][j] + comm[j], False
        if s == self.P - 1:
            return self.fend[s][j], self.fend[s][j] >= 0
        if self.bend[s + 1][j] >= 0:
            return self.bend[s + 1][j] + comm[j], True
        return self.clock[s + 1] + self.est_bwd[s + 1][j] + comm[j], False

    def run(self, s: int, op: str, j: int, dur: float, at: float | None = None) -> None:
        # held bytes change by op_bytes(op, ...)[0], written out: this runs for every op of every candidate
        if op == "F":
            self.held[s] += self.act[s][j]
            self.live[s] += 1
            self.nextf[s] += 1
        elif op == "B":
            self.held[s] += -self.act[s][j]
            self.live[s] -= 1
        elif op == "I":
            self.held[s] += self.wb[s][j] - self.act[s][j]
        else:
            self.held[s] += -self.wb[s][j]
            self.live[s] -= 1
        ranks = self.ranks[s]
        if not ranks:
            self.first[s] = self.clock[s]
        ranks.append(self.acts[s][op][j])
        # a W needs no input: it starts where the stage's last op ended (the simulator's recurrence), even
        # where the clock had moved on to a later bound on an input; a pumped forward where its input arrived;
        # every other op runs at the clock
        clock = self.clock[s]
        end = (self.free[s] if op == "W" else clock if at is None else at) + dur
        self.free[s] = end
        self.clock[s] = end if end > clock else clock
        if end > self.makespan:
            self.makespan = end
        if op == "F":
            self.fend[s][j] = end
        elif op != "W":
            self.bend[s][j] = end
            if op == "I":
                self.pend[s].append(j)

    def passes(self) -> bool:
        """Is the makespan certain to pass ``give_up``: does some stage's last end plus a lower bound of its work
        still to run (its forwards from ``nextf`` on, its backwards from the ones run on in the backward order,
        each at ``min(B, I + W)``, and its queued ``W``) pass it? Every op left starts after that end. The ops run,
        by kind, from the counts kept: ``live = F - B - W``, ``len(pend) = I - W``, ``len(ranks) = F + B + I + W``."""
        give_up, free, nextf, live, ranks = self.give_up, self.free, self.nextf, self.live, self.ranks
        for s in range(self.P):
            f, pend, done = nextf[s], self.pend[s], len(ranks[s])
            w = done - 2 * f + live[s] - len(pend)                          # W run: I run less those queued
            bound = free[s] + self.f_left[s][f] + self.b_left[s][done - f - w]
            if bound > give_up or (pend and bound + sum(map(self.W[s].__getitem__, pend)) > give_up):
                return True
        return False

    def wait_is_critical(self, s: int, wait: float) -> bool:
        """Would waiting ``wait`` make stage ``s`` the one with the largest projected span (``fill`` "span")
        or end (``"makespan"``: its first op's start + span; a stage not started yet from its clock)?"""
        if self.fill == "span":
            return self.span[s] + wait > max(self.span) + 1e-12
        first, ranks, clock, span = self.first, self.ranks, self.clock, self.span
        mine = (first[s] if ranks[s] else clock[s]) + span[s] + wait
        for k in range(self.P):             # mine > max(ends) + 1e-12, stopping at the first end it does not pass
            if not mine > (first[k] if ranks[k] else clock[k]) + span[k] + 1e-12:
                return False
        return True

    def run_w(self, s: int) -> None:
        """``run`` of the oldest queued ``W``, written out: it starts where the stage's last op ended."""
        j = self.pend[s].popleft()
        self.held[s] += -self.wb[s][j]
        self.live[s] -= 1
        ranks, clock = self.ranks[s], self.clock[s]
        if not ranks:
            self.first[s] = clock
        ranks.append(self.acts[s]["W"][j])
        end = self.free[s] + self.W[s][j]
        self.free[s] = end
        self.clock[s] = end if end > clock else clock
        if end > self.makespan:
            self.makespan = end

    def window_full(self, s: int) -> bool:
        return self.live[s] - len(self.pend[s]) >= self.k[s] or self.live[s] >= self.k[s] + self.defer[s]

    def next_op(self, s: int, j: int) -> tuple[str, bool]:
        """(the op stage ``s`` runs next for microbatch ``j``'s template slot, blocked by its window or cap?)."""
        cap, held = self.cap[s], self.held[s]
        if self.todo[s][0][0] == "F":
            return "F", self.window_full(s) or held + self.act[s][j] + self.tr[s][j] > cap
        tr = self.tr[s][j]
        if self.split[s][j]:                                  # op_bytes("I", ...)[1], written out
            w_a = self.wb[s][j] - self.act[s][j]
            if held + ((w_a if w_a > 0.0 else 0.0) + tr) <= cap:
                return "I", False
            if self.pend[s]:
                return "I", True
        return "B", held + tr > cap                           # I would hold w > a past the cap: no split

    def pump_forward(self, s: int, t: float) -> bool:
        """Rule 5 (module doc): run stage ``s``'s next forward now if it has arrived and fits under the cap."""
        j = self.nextf[s]
        if j >= len(self.fend[s]) or self.held[s] + self.act[s][j] + self.tr[s][j] > self.cap[s]:
            return False
        r, known = self.ready(s, "F", j)
        if not known or r > t + 1e-12:
            return False
        self.run(s, "F", j, self.F[s][j], max(self.free[s], r))     # where the simulator starts it
        return True

    def advance(self, s: int, t: float) -> None:
        """One decision on stage ``s`` at time ``t`` (its clock): run an op, a queued W, or wait for an input.
        ``next_op`` and ``ready`` written out (they run for most decisions of every candidate)."""
        todo, pend, nextf = self.todo[s], self.pend[s], self.nextf[s]
        while todo and todo[0][0] == "F" and todo[0][1] < nextf:
            todo.popleft()                                    # a forward rule 5 ran ahead of its slot
        if not todo:
            while pend:                                       # the template is done: the last W
                self.run_w(s)
            return
        op, j = todo[0]
        if op == "F":
            live, k = self.live[s], self.k[s]
            if pend and (live - len(pend) >= k or live >= k + self.defer[s]
                         or self.held[s] + self.act[s][j] + self.tr[s][j] > self.cap[s]):
                self.run_w(s)                                 # frees an in-flight slot and bytes
                return
            if s == 0:
                r, known = 0.0, True
            elif self.fend[s - 1][j] >= 0:
                r, known = self.fend[s - 1][j] + self.comm[j], True
            else:
                r, known = self.clock[s - 1] + self.F[s - 1][j] + self.comm[j], False
        else:
            held, cap, tr = self.held[s], self.cap[s], self.tr[s][j]
            op = "B"
            if self.split[s][j]:
                w_a = self.wb[s][j] - self.act[s][j]
                if held + ((w_a if w_a > 0.0 else 0.0) + tr) <= cap:
                    op = "I"
                elif pend:
                    self.run_w(s)                             # I would pass the cap: a W frees bytes first
                    return
            if op == "B" and pend and held + tr > cap:
                self.run_w(s)
                return
            if s == self.P - 1:
                r = self.fend[s][j]
                known = r >= 0
            elif self.bend[s + 1][j] >= 0:
                r, known = self.bend[s + 1][j] + self.comm[j], True
            else:
                r, known = self.clock[s + 1] + self.est_bwd[s + 1][j] + self.comm[j], False
        if known and r <= t + 1e-12:
            todo.popleft()
            self.run_now(s, op, j)
        elif not pend and (op == "F" or not self.pump) and r > t:
            if self.ranks[s]:                                 # rule 6, written out
                self.span[s] += r - t
            self.clock[s] = r
        else:
            self.wait(s, t, op, r)

    def run_now(self, s: int, op: str, j: int) -> None:
        """``run`` of a forward or backward at the stage's clock."""
        self.run(s, op, j, self.F[s][j] if op == "F" else self.I[s][j] if op == "I" else self.B[s][j])
    def wait(self, s: int, t: float, op: str, r: float) -> None:
        """Stage ``s``'s next op has not arrived by ``t`` (``r``: when it does, or a bound): rules 5, 3, 4, 6."""
        pend = self.pend[s]
        if self.pump and op != "F" and self.pump_forward(s, t):
            pass                                              # a forward fills the gradient's wait
        elif pend and t + self.W[s][pend[0]] <= r + 1e-12:
            self.run_w(s)                                     # fills the gap before the input arrives
        elif pend and self.fill is not None and self.ranks[s] and t == self.free[s] and self.wait_is_critical(s, r - t):
            self.run_w(s)                                     # a W past the arrival: this stage is critical
        elif r > t:
            if self.ranks[s]:
                self.span[s] += r - t
            self.clock[s] = r
        else:                                                 # known is False and r <= t: cannot happen
            raise RuntimeError(f"zero-bubble list scheduler stuck on stage {s} at t={t}")


def list_schedule(inp: ZBInputs, inflight: Sequence[int], caps: Sequence[float] | np.ndarray | None = None,
                  kind: str = "zb", backward_order: Sequence[int] | None = None,
                  w_defer: Sequence[int] | None = None, fill: str | None = None,
                  pump: bool = False) -> tuple[Schedule, float]:
    """The order the list scheduler (module doc) emits and its makespan under ``inp``'s times;
    each stage's backwards in ``backward_order`` (slices of a sequence in reverse); ``fill``: None, or the
    objective (``FILL_OBJECTIVES``) by which a ``W`` may also fill a wait shorter than it (module doc, rule 4);
    ``pump``: a forward may fill a gradient's wait past the window, memory permitting (rule 5)."""
    return listed(inp, Listing(inflight, caps, kind, backward_order, w_defer, fill, pump))


def listed(inp: ZBInputs, how: Listing, give_up: float = np.inf) -> tuple[Schedule, float]:
    """``list_schedule`` with its settings as one ``Listing``. ``give_up``: where the makespan passes it, an empty
    schedule with makespan ``inf`` (a candidate that cannot be judged), found as soon as some stage's last end plus
    a lower bound of its work still to run passes it (``_ListRun.passes``, looked at every ``CHECK_EVERY``
    decisions), else at the end."""
    P, m = inp.shape
    st = _ListRun(inp, how, give_up)
    if not _run_list(st, P) or st.makespan > give_up:
        return Schedule([[] for _ in range(P)], P, m, kind=how.kind), np.inf
    return Schedule(st.ranks, P, m, kind=how.kind), st.makespan


CHECK_EVERY = 256
"""Decisions of the list scheduler between two looks at whether its makespan will pass ``give_up`` (``listed``)."""


def _run_list(st: _ListRun, P: int) -> bool:
    """The list scheduler's loop: the stage whose clock is earliest decides next; with a ``give_up``, every
    ``CHECK_EVERY`` decisions a look whether the makespan will pass it (``_ListRun.passes``: then False, not done)."""
    heap = [(0.0, -s) for s in range(P)]           # ties: the later stage first (backwards flow up)
    todo, clock, advance, pop, requeue = st.todo, st.clock, st.advance, heapq.heappop, heapq.heapreplace
    chunk = CHECK_EVERY if st.give_up < np.inf else 1 << 62
    while heap:
        for _ in range(chunk):
            if not heap:
                return True
            t, neg = heap[0]                        # the stage whose clock is earliest (keys are unique)
            s = -neg
            if not todo[s]:
                advance(s, t)                       # its last Ws
                pop(heap)
            else:
                advance(s, t)
                requeue(heap, (clock[s], neg))      # = pop, then push it back at its clock
        if st.passes():
            return False
    return True


_ACTIONS: dict[int, dict[str, list[Action]]] = {}
_SHARED_LOCK = threading.Lock()


def _stage_actions(stage: int, m: int) -> dict[str, list[Action]]:
    """``Action(stage, op, j)`` for every op and ``j < m``, by op then ``j``: shared between calls (the list
    scheduler emits many); grown by a new table, never in place (a planner thread may be reading the old one)."""
    acts = _ACTIONS.get(stage)
    if acts is None or len(acts["F"]) < m:
        with _SHARED_LOCK:
            acts = _ACTIONS.get(stage) or {op: [] for op in "FBIW"}
            if len(acts["F"]) < m:
                acts = {op: row + [Action(stage, op, j) for j in range(len(row), m)] for op, row in acts.items()}
                _ACTIONS[stage] = acts
    return acts


_WINDOWED: dict[tuple, list[tuple[str, int]]] = {}


def _windowed(m: int, window: int, backward_order: Sequence[int] | None) -> list[tuple[str, int]]:
    """``windowed_order(m, window, backward_order, "X")``, remembered (the last ``4 REMEMBERED``; the list
    scheduler asks for each stage's window of each candidate)."""
    key = (m, window, None if backward_order is None else (tuple(backward_order), lookahead_of(backward_order)))
    seq = _WINDOWED.get(key) if REMEMBERED > 0 else None
    if seq is None:
        seq = windowed_order(m, window, backward_order, "X")
        if REMEMBERED > 0:
            with _SHARED_LOCK:
                while len(_WINDOWED) >= 4 * REMEMBERED:
                    _WINDOWED.pop(next(iter(_WINDOWED)))
                _WINDOWED[key] = seq
    return seq


def _inflight(P: int, m: int, alpha: float = 0.0) -> list[int]:
    return [min(m, P - s + int(round(alpha * (P - s - 1)))) for s in range(P)]


def _unsplit_adjacent(sched: Schedule, inp: ZBInputs, keep_cooldown: bool,
                      order: Sequence[int] | None = None) -> ZBInputs | None:
    """``inp`` with ``split`` off where ``sched`` runs a ``W`` right after its ``I`` (the split
    filled no gap there and only costs its overhead) -- with ``keep_cooldown``, except for each
    stage's last ``P - s`` backwards (in ``order``), whose early input gradients shorten the
    drain. None when nothing changes."""
    P, m = inp.shape
    rank = {j: b for b, j in enumerate(check_order(m, order))}     # position of each backward
    split = inp.split.copy()
    for acts in sched.ranks:
        for a, b in zip(acts, acts[1:]):
            if a.op == "I" and b.op == "W" and a.mb == b.mb and \
                    not (keep_cooldown and rank[a.mb] >= m - (P - a.stage)):
                split[a.stage, a.mb] = False
    if np.array_equal(split, inp.split):
        return None
    return ZBInputs(inp.F, inp.B, inp.I, inp.W, inp.comm, split, inp.act, inp.w, inp.tr)


def _variants(inp: ZBInputs, how: Listing, give_up: float = np.inf) -> list[tuple[Schedule, float]]:
    """The list schedule, and, where a split backward costs more than a full one, the list schedule again
    with full backwards where the first ran W right after I (``_unsplit_adjacent``; everywhere, and
    everywhere but the cool-down); each with its makespan under its inputs. ``give_up`` (``listed``) only where
    the list schedule is the one variant (the others are read off it)."""
    if not np.any(inp.I + inp.W > inp.B * (1 + 1e-9)):
        return [listed(inp, how, give_up)]  # the split costs nothing (a GPU's): a full B is never faster than I, W
    first = listed(inp, how)
    out = [first]
    for keep in (False, True):
        fewer = _unsplit_adjacent(first[0], inp, keep, how.backward_order)
        if fewer is not None:
            out.append(listed(fewer, how))
    return out


def _give_up_at(exact: bool, below: float) -> float:
    """The ``give_up`` (``listed``) of a candidate that is judged only where its own makespan is below ``below``:
    that plus a margin over the rounding of the bound's sums; without an exact judge (``_exact_judge``: the
    simulator's makespan on the scheduler's inputs), none: every candidate built to its end."""
    return below + 1e-9 if exact else np.inf


def _exact_judge(evaluate: Evaluate) -> bool:
    """Does ``evaluate`` declare itself the simulator's makespan on the scheduler's own inputs (``evaluate.judge``
    ``("makespan", ...)``, as ``dynmb.planning.zerobubble.zb_evaluator``)? Then its time of a list schedule is the
    list scheduler's own (the simulator's recurrence on the order emitted; ``tests/test_zb_judge.py``), and a
    candidate whose own time already loses needs no verdict (``JUDGE_CONTENDERS_ONLY``)."""
    judge = getattr(evaluate, "judge", None)
    return JUDGE_CONTENDERS_ONLY and isinstance(judge, tuple) and bool(judge) and judge[0] == "makespan"


def h1_caps(inp: ZBInputs, state_bytes: Sequence[float] | np.ndarray | None = None,
            backward_order: Sequence[int] | None = None) -> np.ndarray:
    """ZB-H1's per-stage byte caps: every GPU may hold what 1F1B's fullest GPU holds (its peak plus its
    states), less its own states -- so ZB-H1's peak never passes 1F1B's (module doc)."""
    P = inp.shape[0]
    state = np.zeros(P) if state_bytes is None else np.asarray(state_bytes, dtype=np.float64).reshape(P)
    return float(np.max(one_f_one_b_peaks(inp, backward_order) + state)) - state


def zb_h1(num_stages: int, m: int, inp: ZBInputs | None = None, *, evaluate: Evaluate | None = None,
          backward_order: Sequence[int] | None = None,
          state_bytes: Sequence[float] | np.ndarray | None = None) -> Schedule:
    """ZB-H1 for variable microbatches (module doc); unit costs without ``inp``. With ``evaluate``
    the fastest of the list schedule, its variant without the splits that filled no gap
    (``_unsplit_adjacent``), the list schedule without deferred W and 1F1B. ``backward_order``:
    slices of a sequence backward in reverse; ``state_bytes``: per-stage states (the caps' GPU totals)."""
    unit = f"unit {num_stages} {m}".encode() if inp is None and backward_order is None and evaluate is None \
        and REMEMBERED > 0 else None                      # the schedule's shape alone (the reorder search's)
    if unit is not None and unit in _H1_UNIT:
        return _H1_UNIT[unit]
    inp = inp if inp is not None else ZBInputs.unit(num_stages, m)
    order = backward_order
    caps = h1_caps(inp, state_bytes, order) if inp.act is not None else None
    k, defer = _inflight(num_stages, m), list(range(num_stages))
    if evaluate is None:
        return _remember(_H1_UNIT, unit, listed(inp, Listing(k, caps, "zb-h1", order, defer))[0])
    return _h1_judged(inp, k, caps, evaluate, order).schedule


@dataclass(frozen=True)
class H1Judged:
    """ZB-H1's pick and 1F1B, each with ``evaluate``'s verdict on it (``zb`` weighs both again: ``zb_limit_aware``)."""

    schedule: Schedule
    verdict: tuple[float, np.ndarray]
    one_f_one_b: Schedule
    one_f_one_b_verdict: tuple[float, np.ndarray]


def _h1_judged(inp: ZBInputs, inflight: Sequence[int], caps: np.ndarray | None, evaluate: Evaluate,
               order: Sequence[int] | None) -> H1Judged:
    """ZB-H1 with a judge (``zb_h1``): the fastest candidate, first of equals (the split schedule), and the
    verdicts on it and on 1F1B; remembered in ``_H1`` by the inputs."""
    P, m = inp.shape
    key = _inputs_key(inp, caps, order, evaluate)
    if key is not None and key in _H1:
        return _H1[key]
    exact, how = _exact_judge(evaluate), Listing(inflight, caps, "zb-h1", order)
    verdicts: dict[int, tuple[float, np.ndarray]] = {}
    cands: list[Schedule] = []

    def judge(made: list[tuple[Schedule, float]]) -> None:
        for c, t in made:                               # the first of equals wins: a later one as slow loses
            if not (exact and cands and t >= min(v[0] for v in verdicts.values())):
                verdicts[len(cands)] = evaluate(c)
            cands.append(c)
    judge(_variants(inp, replace(how, w_defer=list(range(P)))))
    judge([listed(inp, how, _give_up_at(exact, min(v[0] for v in verdicts.values())))])
    cands.append(_one_f_one_b(P, m, order))
    verdicts[len(cands) - 1] = evaluate(cands[-1])
    b = min(verdicts, key=lambda i: verdicts[i][0])     # in insertion (candidate) order: first of equals
    judged = H1Judged(Schedule(cands[b].ranks, P, m, kind="zb-h1"), verdicts[b], cands[-1], verdicts[len(cands) - 1])
    if key is not None and REMEMBERED > 0:
        while len(_H1) >= REMEMBERED:
            _H1.pop(next(iter(_H1)))
        _H1[key] = judged
    return judged


_H1: dict[bytes, H1Judged] = {}
"""ZB-H1 schedules, with the verdicts on them and on 1F1B, by their inputs (``_inputs_key``): ``auto`` builds
``zb-h1`` and ``zb`` (which weighs ZB-H1 and 1F1B too) of the same plan."""

_H1_UNIT: dict[bytes, Schedule] = {}
"""ZB-H1 schedules on unit times by their shape (P, m): the reorder search builds them for every plan."""

_ZB: dict[bytes, Schedule] = {}
"""``zb`` schedules by their inputs (``_inputs_key`` with the limit and states): ``auto`` builds ``zb`` of the
same plan for more than one candidate (its own packing and another kind's, when the two are equal)."""

PUMPED = True
"""``zb`` also weighs the three list schedules with rule 5 (``pump``; module doc); False: not (the candidates before)."""

REUSE_H1_VERDICTS = True
"""``zb`` takes ZB-H1's verdicts on its pick and on 1F1B from ``zb_h1`` instead of simulating both again (the same
numbers); False: simulated again (as before)."""

JUDGE_CONTENDERS_ONLY = True
"""With a judge that is the simulator's makespan on the scheduler's inputs (``_exact_judge``), ``zb_h1`` and ``zb``
judge only the list schedules whose own makespan could still win (``zb_h1``: below the fastest judged before it;
``zb``: below the fastest that fits, and in a sweep of windows below the sweep's fastest, which decides where it
stops): the same choice. False: every candidate judged (as before)."""

REMEMBERED = 16
"""Schedules each of ``_H1``, ``_H1_UNIT`` and ``_ZB`` holds (the oldest goes first); 0: none (every one built afresh)."""


def _remember(store: dict[bytes, Schedule], key: bytes | None, sched: Schedule) -> Schedule:
    """``sched``, kept in ``store`` under ``key`` (None: not kept) within ``REMEMBERED``."""
    if key is not None and REMEMBERED > 0:
        while len(store) >= REMEMBERED:
            store.pop(next(iter(store)))
        store[key] = sched
    return sched


def _inputs_key(inp: ZBInputs, caps: Sequence[float] | np.ndarray | None, order: Sequence[int] | None,
                evaluate: Evaluate, *more: Sequence[float] | np.ndarray | float | None) -> bytes | None:
    """A digest of everything ZB-H1's (with ``more``: the limit and states, ``zb``'s) choice reads, for a judge
    that declares itself (``evaluate.judge``: the simulator's makespan on these inputs); None: not cached (nor
    looked up: also with ``REMEMBERED`` 0)."""
    judge = getattr(evaluate, "judge", None)
    if judge is None or REMEMBERED <= 0:
        return None
    h = hashlib.blake2b(repr((judge, inp.shape, None if order is None else (tuple(order), lookahead_of(order)))).encode(),
                        digest_size=16)
    for a in (inp.F, inp.B, inp.I, inp.W, inp.comm, inp.split, inp.act, inp.w, inp.tr, caps, *more):
        h.update(b"-" if a is None else np.ascontiguousarray(np.asarray(a, dtype=np.float64)).tobytes())
    return h.digest()


def _sweep_windows(num_stages: int, m: int, consider: Callable[[tuple[int, ...], float], float],
                   alphas: Sequence[float] = (0.0, *ZB_ALPHAS)) -> float:
    """``consider`` (the fastest candidate that fits, seconds; told the time below which a candidate still
    decides the sweep: none for the first) the in-flight windows of ``alphas`` in increasing order, until one is
    no faster than the ones before or cannot fit at all; the fastest alpha."""
    seen, previous, best = set(), np.inf, alphas[0]
    for n, alpha in enumerate(alphas):
        k = tuple(_inflight(num_stages, m, alpha))
        if k in seen:
            continue
        seen.add(k)
        try:
            t = consider(k, previous if n > 0 else np.inf)
        except ValueError:          # a microbatch cannot fit under the cap alone: no larger window will
            break
        if n > 0 and t >= previous - 1e-12:
            break
        previous, best = (t, alpha) if t < previous else (previous, best)
    return best


def zb_limit_aware(num_stages: int, m: int, inp: ZBInputs, caps: Sequence[float], limit_bytes: float,
                   evaluate: Evaluate, backward_order: Sequence[int] | None = None,
                   state_bytes: Sequence[float] | np.ndarray | None = None) -> Schedule:
    """``zb``: the fastest of ZB-H1, 1F1B and the list schedules with extra warm-up forwards
    (``ZB_ALPHAS``, tried in increasing order until one is no faster than the one before) under
    the per-stage ``caps`` (limit minus states) whose simulated peak stays within
    ``limit_bytes`` (module doc); every candidate runs its backwards in ``backward_order``."""
    key = _inputs_key(inp, caps, backward_order, evaluate, limit_bytes, state_bytes, float(PUMPED))
    if key is not None and key in _ZB:
        return _ZB[key]
    best, best_t, exact = None, np.inf, _exact_judge(evaluate)

    def consider(cands: list[tuple[Schedule, float]], known: Sequence[tuple[float, np.ndarray]] = (),
                 deciding: float | None = None) -> float:
        """The fastest of ``cands`` (with their list makespans) that fits, the best kept; with an exact judge one
        whose own makespan is neither below the best so far nor below ``deciding`` (a sweep's fastest) is not
        judged: it can change neither."""
        nonlocal best, best_t
        fastest = np.inf
        for n, (c, own) in enumerate(cands):
            if n >= len(known) and exact and own >= max(best_t, -np.inf if deciding is None else deciding) - 1e-12:
                continue
            t, peak = known[n] if n < len(known) else evaluate(c)
            if np.all(np.asarray(peak) <= limit_bytes + 1e-6):
                fastest = min(fastest, t)
                if t < best_t - 1e-12:
                    best, best_t = c, t
        return fastest

    order = backward_order
    h1_caps_ = h1_caps(inp, state_bytes, order) if inp.act is not None else None
    judged = _h1_judged(inp, _inflight(num_stages, m), h1_caps_, evaluate, order)
    h1 = judged.schedule
    if REUSE_H1_VERDICTS:                   # zb_h1 judged both on these inputs
        consider([(h1, np.inf), (judged.one_f_one_b, np.inf)], [judged.verdict, judged.one_f_one_b_verdict])
    else:                                           # (no list makespan: always judged)
        consider([(h1, -np.inf), (_one_f_one_b(num_stages, m, order), -np.inf)])
    unbounded = [m] * num_stages                    # W deferred as far as the caps let (ZB-2p)

    def windows(fill: str | None) -> Callable[[tuple[int, ...], float], float]:
        return lambda k, deciding: consider(_variants(inp, Listing(k, caps, "zb", order, unbounded, fill),
                                                      _give_up_at(exact, max(best_t, deciding))), (), deciding)
    alphas = (0.0, *ZB_ALPHAS)
    start = _sweep_windows(num_stages, m, windows(None), alphas)        # W only in the waits they fit
    fill = objective_of(evaluate)
    critical = _sweep_windows(num_stages, m, windows(fill),             # then also where critical, from the
                              tuple(a for a in alphas if a >= start))   # fastest window up
    if PUMPED:                                                          # forwards fill the gradients' waits
        pumped = [(0.0, None, list(range(num_stages))), (0.0, None, unbounded), (critical, fill, unbounded)]
        for alpha, how, defer in pumped:        # each judged only below the best so far
            consider([listed(inp, Listing(_inflight(num_stages, m, alpha), caps, "zb", order, defer, how, True),
                             _give_up_at(exact, best_t))])
    return _remember(_ZB, key, Schedule((best or h1).ranks, num_stages, m, kind="zb"))
