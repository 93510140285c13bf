"""The token embedding on the last pipeline rank (``PlanSpec.embedding = "last"``): one post-pass over any kind.

Form: the embedding is a stage of its own with no blocks, stage 0 of an ``S + 1``-stage schedule, placed on the
rank that holds the last stage (``embed_rank``); the plan's stage ``s`` is the schedule's ``s + 1`` (``lifted``).
Its ``0Fm`` embeds microbatch m's tokens and sends the hidden state to stage 1 (the plan's stage 0, on rank 0),
its ``0Bm`` takes stage 1's input gradient back and accumulates the embedding's weight gradient. So the validator,
the simulator, the runtime and the CSV read one form, with no new op: every rule of a stage (F before B, the
cross-stage dependencies, the P2P message where a dependency crosses ranks) holds for it as it is.

Where the embeds go (``embed_last``), for any kind's schedule: the embed and embedding-backward ops are merged into
the last rank's list by time, on a timeline of the schedule without them (``action_times``, the simulator's
recurrence with the plan's costs, or unit times without costs). ``0Fm`` is keyed ``start(F of stage 0, m) -
lead`` and goes before the op of that rank that runs across its key (at the key where the rank idles then): the
embed is done, and sent, by the time stage 0 would start it, if the rank is where that timeline says; ``0Bm`` after
every op that starts by ``end(B or I of stage 0, m) + lag``, when the gradient is there. Deadlock-free for every
valid schedule and positive times: every op before ``0Fm`` on the rank started before stage 0's ``F`` of m, so none
waits for it (the merged lists follow one topological order: the old one with each embed at its key time), and
``0Bm`` comes after its dependency's end. One ``lead`` and one ``lag`` for every microbatch keep the keys in stage
0's order, so slices keep theirs (forwards in slice order, backwards reversed).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from dynmb.core.types import Action, Schedule

__all__ = ["embed_last", "embed_rank", "lifted", "is_lifted", "dropped", "EmbedTimes"]


def embed_rank(schedule: Schedule) -> int:
    """The rank that holds the last stage, where the embedding goes."""
    return schedule.stage_to_rank()[schedule.num_stages - 1]


def is_lifted(schedule: Schedule, num_stages: int) -> bool:
    """True when ``schedule`` carries the embedding stage for a plan of ``num_stages`` stages (module doc): one
    stage more than the plan, its stage 0 on the last stage's rank and not on stage 1's."""
    if schedule.num_stages != num_stages + 1 or num_stages < 1:
        return False
    rank = schedule.stage_to_rank()
    return rank.get(0) == rank.get(num_stages) != rank.get(1)


def lifted(stage: int) -> int:
    """The schedule's index of the plan's ``stage`` (the embedding stage is 0)."""
    return stage + 1


class EmbedTimes:
    """Per microbatch, the times on the schedule's own timeline (without the embeds) that key the embeds
    (module doc): ``forward_start[m]`` of stage 0's ``F`` less ``lead``, ``backward_end[m]`` of its ``B``/``I``
    plus ``lag``; and per action of the embedding's rank its ``(start, end)``."""

    def __init__(self, forward_key: Sequence[float], backward_key: Sequence[float],
                 rank_spans: Sequence[tuple[float, float]]) -> None:
        self.forward_key = [float(x) for x in forward_key]
        self.backward_key = [float(x) for x in backward_key]
        self.rank_spans = [(float(a), float(b)) for a, b in rank_spans]


def embed_last(schedule: Schedule, times: EmbedTimes) -> Schedule:
    """``schedule`` with the embedding stage (module doc): every stage one up, ``0Fm`` / ``0Bm`` merged into the
    last stage's rank's list at ``times``' keys."""
    R, m = schedule.num_ranks, schedule.num_microbatches
    where = embed_rank(schedule)
    if where == schedule.stage_to_rank()[0]:
        raise ValueError(f"embedding='last': the {schedule.kind or 'given'} schedule holds the first and the last stage "
                         f"on one rank ({where}): the embedding is on the last rank already")
    own = schedule.ranks[where]
    if len(times.rank_spans) != len(own):
        raise ValueError(f"embed times hold {len(times.rank_spans)} spans for the {len(own)} actions of rank {where}")
    keyed: list[tuple[float, int, float, int, Action]] = []   # (slot, tie, key, order, action), sorted: the list
    for k, (a, (start, _)) in enumerate(zip(own, times.rank_spans)):
        keyed.append((start, 1, start, k, Action(lifted(a.stage), a.op, a.mb)))
    for j in range(m):
        fkey, bkey = times.forward_key[j], times.backward_key[j]
        keyed.append((_forward_slot(times.rank_spans, fkey), 0, fkey, j, Action(0, "F", j)))
        keyed.append((bkey, 2, bkey, j, Action(0, "B", j)))
    merged = [t[-1] for t in sorted(keyed, key=lambda t: t[:4])]
    ranks = [[Action(lifted(a.stage), a.op, a.mb) for a in acts] if r != where else merged
             for r, acts in enumerate(schedule.ranks)]
    assert sum(len(r) for r in ranks) == sum(len(r) for r in schedule.ranks) + 2 * m and R == len(ranks)
    return Schedule(ranks, schedule.num_stages + 1, m, kind=schedule.kind)


def dropped(schedule: Schedule) -> Schedule:
    """``schedule`` without its embedding stage, every other stage one down: the plan's stages as the kind built
    them (what the bounds and the gap terms read)."""
    return Schedule([[Action(a.stage - 1, a.op, a.mb) for a in acts if a.stage > 0] for acts in schedule.ranks],
                    schedule.num_stages - 1, schedule.num_microbatches, kind=schedule.kind)


def _forward_slot(spans: Sequence[tuple[float, float]], key: float) -> float:
    """The start of the op that runs across ``key`` (the embed goes before it), else ``key`` itself (never later:
    the rank may idle at ``key``, and every op after the slot must be free to wait for stage 0's forward)."""
    ends = np.array([e for _, e in spans])
    after = np.flatnonzero(ends > key)
    return min(spans[int(after[0])][0], key) if len(after) else key

