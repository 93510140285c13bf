"""Schedule builders: GPipe, 1F1B, interleaved 1F1B and memory-aware 1F1B.

Every builder is a pure function ``(num_stages, num_microbatches, ...) ->
Schedule`` (one ordered list of ``Action`` per rank); nothing here knows about
times or tensors. Microbatch ``j`` is the ``j``-th microbatch of the plan in
execution order, so reordering a plan never changes the schedule's shape.

Algorithms (``P`` stages, ``m`` microbatches, ``R`` ranks, ``v`` chunks per rank):

- ``gpipe``: rank ``s`` runs ``F0..F(m-1)`` then ``B0..B(m-1)`` (fill, drain).
- ``1f1b``: rank ``s`` first runs ``w_s = min(m, P - s)`` forwards, then
  alternates one backward and one forward until the forwards are used up, then
  drains the remaining backwards. At most ``P - s`` microbatches are in flight.
  With slices of a long sequence (``backward_order``) backwards follow that order and
  the warm-up extends until the backward's microbatch has gone forward.
  Both orders are ``dynmb.schedule.order.stage_order``: the one GPipe / 1F1B op order,
  which the fast makespan estimate (``dynmb.timing.makespan``) sweeps too.
- ``interleaved`` (Megatron / torch ``ScheduleInterleaved1F1B`` ordering):
  stage ``s`` lives on rank ``s % R``. Microbatches go in ``n = max(1, m // R)``
  rounds of ``k = m // n`` (torch's rule); when that does not split ``m``, which
  torch refuses, the ``m % n`` first rounds take one more (``k + 1``; every
  round then holds R to 2R - 1 microbatches, ``interleaved_round_sizes``). A
  rank's forwards run a round through chunk 0, then chunk 1, ..., its backwards
  the round through chunk ``v - 1`` down to 0. Rank ``r`` warms up with
  ``min((v - 1) k + 2 (R - 1 - r), v m)`` forwards (``k`` the first round's
  size), then alternates F, B, then drains the backwards. Should an order still
  deadlock, the warm-up of a rank waiting on a backward grows by one until the
  validator's queue play-out passes (``warm = v m`` always does: all forwards
  first). The rounds of ``R`` with a short last one used before (and their
  grown warm-ups) ran up to 3.9x the interleaved makespan on equal
  microbatches (R 16, m 472); near-equal rounds run it exactly
  (tests/test_schedule.py).
  With slices of a long sequence (``backward_order``) the backward rounds are
  taken from that order (rounds of ``k`` in ``backward_order``, chunks ``v - 1``
  down to 0), so every stage runs a chain's backwards in reverse slice order;
  a rank forwards on (beyond one forward per backward) until the next
  backward's own forward has run, and the warm-up grows as above until the
  play-out passes (all forwards first relabels torch's backward pattern by the
  order, which is deadlock-free).
- ``memory-aware``: 1F1B with a per-(stage, microbatch) window. Before the
  forward of microbatch ``j`` stage ``s`` may hold at most ``k_s(j)`` microbatches
  (``j`` included), where ``k_s(j)`` is the largest window whose activation
  bytes ``act[s, j-k+1..j]`` plus the stage's state bytes fit ``limit_bytes``,
  capped by ``P - s`` and by ``k_{s-1}(j)``. The per-stage order is the greedy
  "forward if the window allows, else backward". Windows that never grow along
  the pipeline keep it deadlock-free: a stage that stops forwarding to wait for
  a backward has at least as many microbatches in flight as its successor may
  hold, so the successor is never waiting for that stage's next forward.
- ``zb-h1`` / ``zb``: zero-bubble schedules with split backwards (``I`` then ``W``), built by
  the list scheduler of ``dynmb.schedule.zerobubble`` from per-(stage, microbatch) times and
  bytes (``zb_inputs``); without them ZB-H1's order at unit times.

Each kind's record (builder + traits) is in the registry ``dynmb.schedule.kinds``, which also
holds ``build_schedule(kind, ...)``.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from dynmb.schedule.order import check_order, stage_order
from dynmb.schedule.validate import ScheduleError, execution_order
from dynmb.schedule.zerobubble import ZBInputs
from dynmb.core.types import Action, Schedule

__all__ = ["gpipe", "one_f_one_b", "interleaved",
           "memory_aware", "memory_windows", "interleaved_rounds", "interleaved_round_sizes", "interleaved_warmup", "ZBInputs"]

def _check(num_stages: int, m: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if m < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {m}")


def gpipe(num_stages: int, num_microbatches: int, backward_order: Sequence[int] | None = None) -> Schedule:
    """Fill-drain: all forwards, then all backwards in microbatch order (torch ``ScheduleGPipe``),
    or in ``backward_order`` (``Plan.backward_order``: slices of a sequence backward in reverse)."""
    _check(num_stages, num_microbatches)
    return Schedule(_stage_orders(num_stages, num_microbatches, "gpipe", backward_order), num_stages,
                    num_microbatches, kind="gpipe")


def _stage_orders(num_stages: int, m: int, kind: str, backward_order: Sequence[int] | None = None
                  ) -> list[list[Action]]:
    """Every stage's actions in ``stage_order`` (GPipe or 1F1B), one stage per rank."""
    return [[Action(s, op, j) for op, j in stage_order(s, num_stages, m, kind, backward_order)]
            for s in range(num_stages)]


def _f_then_b(stage: int, m: int, warmup: Sequence[int] | int) -> list[Action]:
    """Greedy windowed order of one stage (memory-aware): forward while the in-flight window
    allows, else backward.

    ``warmup`` is either one window for all microbatches or one per microbatch
    (the number that may be in flight right after forwarding it). With the window ``P - s``
    for every microbatch it is 1F1B's order (``stage_order``; memory-aware with room is 1F1B).
    """
    win = [warmup] * m if isinstance(warmup, (int, np.integer)) else list(warmup)
    out: list[Action] = []
    f = b = 0
    while b < m:
        if f < m and f - b + 1 <= win[f]:
            out.append(Action(stage, "F", f))
            f += 1
        else:
            out.append(Action(stage, "B", b))
            b += 1
    return out


def one_f_one_b(num_stages: int, num_microbatches: int, backward_order: Sequence[int] | None = None) -> Schedule:
    """1F1B (PipeDream-flush): at most ``P - s`` microbatches in flight on stage ``s`` (torch ``Schedule1F1B``);
    with ``backward_order`` a chain of slices stays in flight until its last slice's forward."""
    _check(num_stages, num_microbatches)
    return Schedule(_stage_orders(num_stages, num_microbatches, "1f1b", backward_order), num_stages,
                    num_microbatches, kind="1f1b")


def interleaved_round_sizes(num_ranks: int, num_microbatches: int) -> list[int]:
    """Microbatches in each round of the interleaved schedule: ``n = max(1, m // R)`` rounds of
    ``m // n`` (torch's rule when that splits ``m``), the ``m % n`` first of them one more (torch
    refuses such ``m``)."""
    n = max(1, num_microbatches // num_ranks)
    k, extra = divmod(num_microbatches, n)
    return [k + 1] * extra + [k] * (n - extra)


def interleaved_rounds(num_ranks: int, num_microbatches: int) -> int:
    """Microbatches in the first (largest) round of the interleaved schedule (``interleaved_round_sizes``):
    torch's ``m // max(1, m // R)`` when that splits ``m`` evenly."""
    return interleaved_round_sizes(num_ranks, num_microbatches)[0]


def interleaved_warmup(rank: Any, num_ranks: int, virtual: int, num_microbatches: int) -> Any:
    """Forwards pipeline ``rank`` runs before its first backward (torch's rule): ``(v - 1) k + 2 (R - 1 - r)``,
    ``k`` the first round's size (``interleaved_rounds``), at most every one of its ``v m``."""
    k = interleaved_rounds(num_ranks, num_microbatches)
    return np.minimum((virtual - 1) * k + 2 * (num_ranks - 1 - np.asarray(rank)), virtual * num_microbatches)


def _merge(fwd: list[Action], bwd: list[Action], warm: int) -> list[Action]:
    """``warm`` forwards, then one forward and one backward alternately, then the remaining
    backwards; a backward whose own forward has not run yet is preceded by the forwards up to it."""
    where = {(a.stage, a.mb): i for i, a in enumerate(fwd)}
    total = len(fwd)
    acts = fwd[:warm]
    f = warm
    for i, b in enumerate(bwd):
        need = max(min(total, warm + i + 1), where[(b.stage, b.mb)] + 1)
        acts.extend(fwd[f:need])
        f = max(f, need)
        acts.append(b)
    return acts


def interleaved(num_stages: int, num_microbatches: int, virtual: int = 2,
                backward_order: Sequence[int] | None = None) -> Schedule:
    """Interleaved 1F1B with ``virtual`` chunks per rank; ``num_stages`` must be a multiple of it.
    ``backward_order`` (``Plan.backward_order``: slices of a sequence backward in reverse) orders
    the backward rounds (module doc)."""
    _check(num_stages, num_microbatches)
    if virtual < 1 or num_stages % virtual:
        raise ValueError(f"num_stages ({num_stages}) must be a positive multiple of virtual ({virtual})")
    R, v, m = num_stages // virtual, virtual, num_microbatches
    order = check_order(m, backward_order)
    sizes = interleaved_round_sizes(R, m)
    cuts = np.cumsum([0, *sizes]).tolist()
    groups = [list(range(a, e)) for a, e in zip(cuts[:-1], cuts[1:])]
    bgroups = [order[a:e] for a, e in zip(cuts[:-1], cuts[1:])]
    fwd = [[Action(c * R + r, "F", j) for grp in groups for c in range(v) for j in grp] for r in range(R)]
    bwd = [[Action(c * R + r, "B", j) for grp in bgroups for c in reversed(range(v)) for j in grp] for r in range(R)]
    total = v * m
    warm = [int(w) for w in interleaved_warmup(np.arange(R), R, v, m)]
    plain = order == list(range(m))
    while True:
        ranks = [_merge(fwd[r], bwd[r], warm[r]) for r in range(R)]
        if len(set(sizes)) == 1 and plain:
            break  # torch's case: its warm-up counts are deadlock-free
        try:
            execution_order(Schedule(ranks, num_stages, m))
            break
        except ScheduleError as e:
            # uneven rounds or slices: a rank stuck on a backward forwards one more microbatch first
            grow = [r for r, i in e.blocked if ranks[r][i].op == "B" and warm[r] < total]
            if not grow:
                raise
            for r in grow:
                warm[r] += 1
    return Schedule(ranks, num_stages, m, kind="interleaved")


def memory_windows(act_bytes: np.ndarray, state_bytes: np.ndarray | Sequence[float] | None,
                   limit_bytes: float, transient_bytes: np.ndarray | None = None) -> np.ndarray:
    """``k[s, j]``: microbatches stage ``s`` may hold right after forwarding ``j`` (see module doc).

    ``transient_bytes[stage, mb]`` (buffers of the running op, not held) are
    reserved at their per-stage maximum. Raises ``ValueError`` naming the
    (stage, microbatch) that cannot fit even alone.
    """
    act = np.asarray(act_bytes, dtype=np.float64)
    if act.ndim != 2:
        raise ValueError(f"act_bytes must be [num_stages, m], got shape {act.shape}")
    P, m = act.shape
    state = np.zeros(P) if state_bytes is None else np.asarray(state_bytes, dtype=np.float64).reshape(-1)
    if state.shape != (P,):
        raise ValueError(f"state_bytes must have one entry per stage ({P}), got {state.shape}")
    budget = float(limit_bytes) - state
    if transient_bytes is not None:
        tr = np.asarray(transient_bytes, dtype=np.float64)
        if tr.shape != act.shape:
            raise ValueError(f"transient_bytes must be {act.shape}, got {tr.shape}")
        budget = budget - tr.max(axis=1)
    k = np.zeros((P, m), dtype=np.int64)
    too_big = act > budget[:, None]
    if too_big.any():
        s, j = (int(x) for x in np.argwhere(too_big)[0])
        raise ValueError(f"microbatch {j} needs {act[s, j]:.0f} activation bytes on stage {s}, over the "
                         f"{budget[s]:.0f} left by the limit {float(limit_bytes):.0f} after state bytes {state[s]:.0f}"
                         f"{'' if transient_bytes is None else ' and transient buffers'}")
    idx = np.arange(1, m + 1)
    for s in range(P):
        csum = np.concatenate([[0.0], np.cumsum(act[s])])
        # largest window w with act[s, j-w+1..j].sum() <= budget: first lo with csum[lo] >= csum[j+1] - budget
        lo = np.searchsorted(csum, csum[1:] - budget[s] - 1e-9 * max(1.0, budget[s]), side="left")
        cap = np.full(m, P - s) if s == 0 else np.minimum(P - s, k[s - 1])
        k[s] = np.maximum(1, np.minimum(idx - lo, cap))
    return k


def memory_aware(num_stages: int, num_microbatches: int, act_bytes: np.ndarray,
                 state_bytes: np.ndarray | Sequence[float] | None, limit_bytes: float,
                 transient_bytes: np.ndarray | None = None) -> Schedule:
    """1F1B whose in-flight window per stage shrinks so held activations + states stay under ``limit_bytes``."""
    _check(num_stages, num_microbatches)
    act = np.asarray(act_bytes, dtype=np.float64)
    if act.shape != (num_stages, num_microbatches):
        raise ValueError(f"act_bytes must be [{num_stages}, {num_microbatches}], got {act.shape}")
    k = memory_windows(act, state_bytes, limit_bytes, transient_bytes)
    ranks = [_f_then_b(s, num_microbatches, k[s].tolist()) for s in range(num_stages)]
    return Schedule(ranks, num_stages, num_microbatches, kind="memory-aware")
