"""Schedule validation: completeness, per-stage order, and deadlock freedom.

``validate(schedule)`` checks, in this order, and raises ``ScheduleError`` (a
``ValueError``) at the first failure, with a message that prints the rank x
step grid of actions (columns = position in the rank's list) and marks the
faulty action as ``[2F7]`` on a row flagged ``>>``:

1. every action names a stage in ``[0, num_stages)`` and a microbatch in
   ``[0, num_microbatches)``; each stage's actions all sit on one rank;
2. every ``(stage, F, mb)`` appears exactly once, and so does its backward: either one full
   ``B`` or a split one, ``I`` (input gradient) and ``W`` (weight gradients), each once --
   never ``B`` together with ``I``/``W`` (torch's ``_validate_schedule`` rule);
3. on a stage, ``F`` of a microbatch comes before its ``B``/``I``, and ``I`` before its ``W``;
4. the cross-stage dependencies (``F`` of stage ``s`` after ``F`` of ``s - 1``; the
   backward ``B``/``I`` of ``s`` after the ``B``/``I`` of ``s + 1``, whose input gradient it
   needs; ``W`` has none) can be met: the ranks' queues are
   played out, each rank running its head action once its dependency has run
   (a worklist: a rank blocked on an action is woken when that action runs). If
   every rank is blocked before all actions ran, the schedule deadlocks; the
   error marks each blocked head and names what it waits for.

5. with a plan holding slices of long sequences (``validate(schedule, plan)``): on every
   stage the forwards of one sequence's slices run in slice order and their backwards
   (``B`` or ``I``) in reverse (``check_slice_order``).

``execution_order(schedule)`` returns the flattened action arrays and one
topological order of them (used by the simulator). Pure Python + numpy, O(actions). It remembers the last
``REMEMBERED`` schedules it flattened by the identity of their ranks' action tuples (immutable, held while
remembered), so the zero-bubble judge and the simulator flatten a chosen schedule once; a hit returns a shallow
copy whose arrays are read-only.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from dynmb.core.types import Action, Plan, Schedule

__all__ = ["ScheduleError", "validate", "execution_order", "format_grid", "FlatSchedule", "check_slice_order"]

_OPI = {"F": 0, "B": 1, "I": 2, "W": 3}
_OPS = "FBIW"


class ScheduleError(ValueError):
    """A schedule is incomplete, out of order, or deadlocks; the message shows the rank x step grid.

    On a deadlock, ``blocked`` lists the (rank, step) of every blocked head action.
    """

    blocked: list[tuple[int, int]] = []


@dataclass
class FlatSchedule:
    """The actions of a schedule as flat arrays, rank by rank (``start[r]:start[r+1]`` is rank ``r``)."""

    rank: np.ndarray
    stage: np.ndarray
    op: np.ndarray      # 0 = F, 1 = B, 2 = I, 3 = W
    mb: np.ndarray
    step: np.ndarray    # position in its rank's list
    start: np.ndarray   # [num_ranks + 1] offsets
    dep: np.ndarray     # index of the cross-stage action this one waits for, -1 if none
    order: np.ndarray   # a topological order (indices) respecting rank order and deps


def format_grid(schedule: Schedule, marks: dict[tuple[int, int], str] | None = None,
                focus: tuple[int, int] | None = None, width: int = 24, max_ranks: int = 16) -> str:
    """The rank x step grid of ``schedule`` as text; ``marks[(rank, step)]`` replaces that cell.

    Long schedules show a window of ``width`` steps (and ``max_ranks`` ranks) around ``focus``.
    """
    marks = marks or {}
    R = schedule.num_ranks
    n = max((len(a) for a in schedule.ranks), default=0)
    fr, fs = focus if focus is not None else (0, 0)
    s0 = max(0, min(fs - width // 2, n - width)) if n > width else 0
    s1 = min(n, s0 + width)
    r0 = max(0, min(fr - max_ranks // 2, R - max_ranks)) if R > max_ranks else 0
    r1 = min(R, r0 + max_ranks)
    cells = {}
    for r in range(r0, r1):
        for i in range(s0, s1):
            acts = schedule.ranks[r]
            c = str(acts[i]) if i < len(acts) else ""
            cells[r, i] = marks.get((r, i), c)
    w = max([len(c) for c in cells.values()] + [len(str(s1 - 1))]) + 1
    lines = ["       step " + "".join(f"{i:>{w}}" for i in range(s0, s1)) + (" ..." if s1 < n else "")]
    if s0 > 0:
        lines[0] = lines[0].replace("step", "step ...", 1)
    for r in range(r0, r1):
        flag = ">>" if any(k[0] == r for k in marks) else "  "
        lines.append(f"{flag} rank {r:>4} " + "".join(f"{cells[r, i]:>{w}}" for i in range(s0, s1)))
    if r0 > 0 or r1 < R:
        lines.append(f"   (ranks {r0}..{r1 - 1} of {R} shown)")
    return "\n".join(lines)


def _fail(schedule: Schedule, msg: str, where: list[tuple[int, int]]) -> ScheduleError:
    marks = {(r, i): f"[{schedule.ranks[r][i]}]" for r, i in where if i < len(schedule.ranks[r])}
    focus = where[0] if where else None
    return ScheduleError(f"{msg}\n{format_grid(schedule, marks, focus)}")


def _flatten(schedule: Schedule) -> FlatSchedule:
    sizes = [len(a) for a in schedule.ranks]
    n = sum(sizes)
    start = np.zeros(len(sizes) + 1, dtype=np.int64)
    start[1:] = np.cumsum(sizes)
    stage = np.empty(n, dtype=np.int64)
    op = np.empty(n, dtype=np.int64)
    mb = np.empty(n, dtype=np.int64)
    k = 0
    for acts in schedule.ranks:
        for a in acts:
            stage[k] = a.stage
            op[k] = _OPI[a.op]
            mb[k] = a.mb
            k += 1
    rank = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
    step = np.arange(n, dtype=np.int64) - start[rank]
    empty = np.zeros(0, dtype=np.int64)
    return FlatSchedule(rank, stage, op, mb, step, start, empty, empty)


def _loc(flat: FlatSchedule, i: int) -> tuple[int, int]:
    return int(flat.rank[i]), int(flat.step[i])


def _check_static(schedule: Schedule, flat: FlatSchedule) -> np.ndarray:
    """Checks 1-3; returns ``pos[key]`` (flat index of each (op, stage, mb) key, -1 if absent)."""
    placed = _check_placement(schedule, flat)
    key = _check_counts(schedule, flat, placed)
    return _check_op_order(schedule, flat, key)


def _check_placement(schedule: Schedule, flat: FlatSchedule) -> tuple[np.ndarray, np.ndarray]:
    """Sizes, ranges and one rank per stage; returns (stages, their ranks) of the actions sorted by stage."""
    S, m = schedule.num_stages, schedule.num_microbatches
    if S < 1 or m < 1 or schedule.num_ranks < 1:
        raise ScheduleError(f"schedule needs >= 1 stage, microbatch and rank; got {S}, {m}, {schedule.num_ranks}")
    bad = np.flatnonzero((flat.stage >= S) | (flat.mb >= m))
    if len(bad):
        i = int(bad[0])
        raise _fail(schedule, f"action {schedule.ranks[flat.rank[i]][flat.step[i]]} is out of range: "
                    f"{S} stages, {m} microbatches", [_loc(flat, i)])
    # one rank per stage
    order = np.lexsort((flat.rank, flat.stage))
    st, rk = flat.stage[order], flat.rank[order]
    clash = np.flatnonzero((st[1:] == st[:-1]) & (rk[1:] != rk[:-1]))
    if len(clash):
        i, j = int(order[clash[0]]), int(order[clash[0] + 1])
        raise _fail(schedule, f"stage {int(flat.stage[i])} has actions on rank {int(flat.rank[i])} and rank "
                    f"{int(flat.rank[j])}; a stage lives on one rank", [_loc(flat, j), _loc(flat, i)])
    return st, rk


def _check_counts(schedule: Schedule, flat: FlatSchedule, placed: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Each action once, no full and split backward of one microbatch, none missing; returns each action's key."""
    S, m = schedule.num_stages, schedule.num_microbatches
    key = (flat.op * S + flat.stage) * m + flat.mb
    counts = np.bincount(key, minlength=4 * S * m)
    dup = np.flatnonzero(counts > 1)
    if len(dup):
        idx = np.flatnonzero(key == dup[0])
        a = schedule.ranks[flat.rank[idx[0]]][flat.step[idx[0]]]
        raise _fail(schedule, f"action {a} appears {len(idx)} times", [_loc(flat, int(i)) for i in idx])
    c = counts.reshape(4, S * m)
    if np.any((c[1] > 0) & (c[2] + c[3] > 0)):
        k = int(np.flatnonzero((c[1] > 0) & (c[2] + c[3] > 0))[0])
        where = [_loc(flat, int(i)) for i in np.flatnonzero((flat.stage * m + flat.mb == k) & (flat.op > 0))]
        raise _fail(schedule, f"stage {k // m} microbatch {k % m} has a full backward B and a split one (I/W); "
                    f"it needs one or the other", where)
    missing = np.concatenate([np.flatnonzero(c[0] == 0),                              # F
                              S * m + np.flatnonzero((c[1] == 0) & (c[2] == 0) & (c[3] == 0)),   # B (or I + W)
                              2 * S * m + np.flatnonzero((c[2] == 0) & (c[3] > 0)),   # I of a W
                              3 * S * m + np.flatnonzero((c[2] > 0) & (c[3] == 0))])  # W of an I
    if len(missing):
        k = int(missing[0])
        a = Action(k // m % S, _OPS[k // (S * m)], k % m)
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        stage_rank = {s: r for s, r in zip(*(x.tolist() for x in placed))}
        r = stage_rank.get(a.stage)
        where = [(r, len(schedule.ranks[r]) - 1)] if r is not None and schedule.ranks[r] else []
        raise ScheduleError(f"action {a} is missing{more}; every (stage, microbatch) needs one F and either one B "
                            f"or one I and one W{f' (stage {a.stage} is on rank {r})' if r is not None else ''}\n"
                            + format_grid(schedule, {}, where[0] if where else None))
    return key


def _check_op_order(schedule: Schedule, flat: FlatSchedule, key: np.ndarray) -> np.ndarray:
    """Each backward after its forward and each W after its I on the stage; returns ``pos[key]``."""
    S, m = schedule.num_stages, schedule.num_microbatches
    pos = np.full(4 * S * m, -1, dtype=np.int64)
    pos[key] = np.arange(len(key))
    f_pos, b_pos, i_pos, w_pos = (pos[k * S * m: (k + 1) * S * m] for k in range(4))
    back = np.where(b_pos >= 0, b_pos, i_pos)          # the backward that needs the forward
    late = np.flatnonzero(back < f_pos)
    if len(late):
        k = int(late[0])
        a = schedule.ranks[flat.rank[back[k]]][flat.step[back[k]]]
        raise _fail(schedule, f"{a} runs before its forward {Action(k // m, 'F', k % m)} on the same stage",
                    [_loc(flat, int(back[k])), _loc(flat, int(f_pos[k]))])
    late = np.flatnonzero((w_pos >= 0) & (w_pos < i_pos))
    if len(late):
        k = int(late[0])
        a = Action(k // m, "W", k % m)
        raise _fail(schedule, f"{a} runs before its input gradient {Action(k // m, 'I', k % m)} on the same stage",
                    [_loc(flat, int(w_pos[k])), _loc(flat, int(i_pos[k]))])
    return pos


REMEMBERED = 8
"""Flattened schedules ``execution_order`` keeps (the oldest goes first); 0: none (each flattened afresh)."""

_FLAT: dict[tuple[int, ...], tuple[tuple[tuple[Action, ...], ...], FlatSchedule]] = {}
"""``(num_stages, num_microbatches, id of each rank's tuple) -> (the ranks, held so the ids stay theirs, flat)``."""


def execution_order(schedule: Schedule) -> FlatSchedule:
    """Validate ``schedule`` and return its flat arrays with a topological order; ``ScheduleError`` if invalid
    (remembered: module doc)."""
    if REMEMBERED <= 0:
        return _execution_order(schedule)
    key = (schedule.num_stages, schedule.num_microbatches, *map(id, schedule.ranks))
    hit = _FLAT.get(key)
    if hit is None:
        flat = _execution_order(schedule)
        for a in (flat.rank, flat.stage, flat.op, flat.mb, flat.step, flat.start, flat.dep, flat.order):
            a.setflags(write=False)
        while len(_FLAT) >= REMEMBERED:
            _FLAT.pop(next(iter(_FLAT)))
        hit = _FLAT[key] = (schedule.ranks, flat)
    return copy.copy(hit[1])


def _execution_order(schedule: Schedule) -> FlatSchedule:
    """``execution_order`` made afresh."""
    flat = _flatten(schedule)
    pos = _check_static(schedule, flat)
    S, m = schedule.num_stages, schedule.num_microbatches
    n = len(flat.stage)
    # cross-stage dependency: F(s) <- F(s-1); B/I(s) <- the B or I of (s+1); W none
    dep = np.full(n, -1, dtype=np.int64)
    isf, isb = flat.op == 0, (flat.op == 1) | (flat.op == 2)
    fi = np.flatnonzero(isf & (flat.stage > 0))
    dep[fi] = pos[(flat.stage[fi] - 1) * m + flat.mb[fi]]
    bi = np.flatnonzero(isb & (flat.stage < S - 1))
    nxt = (flat.stage[bi] + 1) * m + flat.mb[bi]
    dep[bi] = np.where(pos[S * m + nxt] >= 0, pos[S * m + nxt], pos[2 * S * m + nxt])
    depl = dep.tolist()
    starts = flat.start.tolist()
    R = schedule.num_ranks
    ptr = starts[:-1]
    done = bytearray(n)
    waiting: dict[int, int] = {}
    stack = list(range(R - 1, -1, -1))
    order: list[int] = []
    push = order.append
    while stack:
        r = stack.pop()
        i, e = ptr[r], starts[r + 1]
        while i < e:
            d = depl[i]
            if d >= 0 and not done[d]:
                waiting[d] = r
                break
            done[i] = 1
            push(i)
            w = waiting.pop(i, None)
            if w is not None:
                stack.append(w)
            i += 1
        ptr[r] = i
    if len(order) < n:
        blocked = [r for r in range(R) if ptr[r] < starts[r + 1]]
        why = []
        for r in blocked:
            i = ptr[r]
            d = depl[i]
            a, b = schedule.ranks[r][i - starts[r]], schedule.ranks[flat.rank[d]][flat.step[d]]
            why.append(f"rank {r} step {i - starts[r]}: {a} waits for {b} (rank {int(flat.rank[d])}, step {int(flat.step[d])})")
        err = _fail(schedule, f"schedule deadlocks after {len(order)} of {n} actions; every rank is blocked:\n  "
                    + "\n  ".join(why), [(r, ptr[r] - starts[r]) for r in blocked])
        err.blocked = [(r, ptr[r] - starts[r]) for r in blocked]
        raise err
    flat.dep = dep
    flat.order = np.asarray(order, dtype=np.int64)
    return flat


def check_slice_order(schedule: Schedule, plan: Plan) -> None:
    """Raise ``ScheduleError`` unless, on every stage, each sliced sequence's forwards run in
    slice order and its backwards in reverse slice order (rule 5)."""
    groups = plan.slice_groups()
    if not groups:
        return
    for acts in schedule.ranks:
        pos = {(a.stage, a.op if a.op != "I" else "B", a.mb): k for k, a in enumerate(acts)}
        for stage in sorted({a.stage for a in acts}):
            for sid, where in groups.items():
                for early, late in zip(where, where[1:]):
                    f0, f1 = pos.get((stage, "F", early)), pos.get((stage, "F", late))
                    b0, b1 = pos.get((stage, "B", early)), pos.get((stage, "B", late))
                    if f0 is not None and f1 is not None and f1 < f0:
                        raise _fail(schedule, f"sequence {sid}: slice in microbatch {late} goes forward before the "
                                    f"earlier slice in microbatch {early} on stage {stage}",
                                    [_loc_of(schedule, acts, f1)])
                    if b0 is not None and b1 is not None and b0 < b1:
                        raise _fail(schedule, f"sequence {sid}: slice in microbatch {early} runs its backward before "
                                    f"the later slice in microbatch {late} on stage {stage} (slices go backward in "
                                    f"reverse order)", [_loc_of(schedule, acts, b0)])


def _loc_of(schedule: Schedule, acts: tuple[Action, ...], k: int) -> tuple[int, int]:
    return next(r for r, ra in enumerate(schedule.ranks) if ra is acts), k


def validate(schedule: Schedule, plan: Plan | None = None) -> None:
    """Raise ``ScheduleError`` unless ``schedule`` is complete, ordered and deadlock-free, and
    (given the ``plan``) runs its slices in order (see module doc)."""
    execution_order(schedule)
    if plan is not None:
        check_slice_order(schedule, plan)
