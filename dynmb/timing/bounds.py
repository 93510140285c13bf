"""Lower bounds of a step: ``bound_s`` (the dependency bound of the step's own microbatch
costs) and ``ideal_s`` (the limit of the batch itself, the same for every method).

Both follow the simulator's model (``dynmb.timing.simulate``): a rank runs one action at a time;
``F`` of stage s waits for ``F`` of s - 1, the backward (``B``, or the input gradient ``I`` of a
split backward) of s for that of s + 1, plus the P2P time ``c_j`` of microbatch j when the two
stages sit on different ranks; ``W`` waits only for its own ``I`` (same stage). Every op on a
stage follows an ``F`` of that stage, and a stage's ``W`` follows its ``I``.

``bound_s`` (``dependency_bound``), per rank r holding the stages S_r (one stage per rank
unless interleaved; a stage ``s`` lies ``h_s`` rank changes away from stage 0):

- ``head_r = min_{s in S_r, j} sum_{t<s} F[t, j] + h_s c_j``: the first op on r is an ``F``
  of some (s, j), which cannot start earlier (the shortest time any microbatch reaches r);
- ``work_r``: every op r must run, ``F`` and ``B`` (or ``I`` and ``W``) of every microbatch on
  every stage of r; r runs them one at a time after ``head_r``;
- ``tail_r = min_{s in S_r, j} max_{t<s} (sum_{t<=u<s} g[u, j] + (h_s - h_t) c_j + w[t, j])``
  with ``g`` the gradient op (``B`` or ``I``) and ``w`` the ``W`` of a split backward (0 for
  ``B``; then the max is at t = 0: the gradient's return to stage 0): after the last gradient op
  of r ends (at ``T``, on some (s, j)), that gradient still has to pass down to every stage
  t < s, and stage t then runs that microbatch's ``W`` (0 for s = 0).

After ``T`` rank r runs only ``W`` ops, ``x <= W_r`` (all of r's ``W``) seconds of them, so
``T >= head_r + work_r - x`` and the step ends at ``>= T + max(x, tail_r)``, hence at
``>= head_r + work_r + max(0, tail_r - W_r)``. With a full backward (``W_r = 0``) that is
``head_r + work_r + tail_r``. ``bound_s`` is the largest over ranks, and with data parallelism
the slowest replica's (``plan_bound``). It depends on the microbatches (their costs and P2P
times) and the stage-to-rank map, not on their order nor the schedule's, so a schedule's gap
to it, ``makespan / bound - 1``, is what the order, the sizes at the ends and the schedule
leave on the table. The minima are over *all* microbatches, not the first / last in the
plan's order: a schedule may start or end with any of them.

Equal microbatches (``F``, ``B``, ``c`` the same everywhere), P stages on P ranks: the last
stage gives ``(P - 1)(F + c) + m (F + B) + (P - 1)(B + c) = (m + P - 1)(F + B) + 2 (P - 1) c``.
GPipe's makespan is exactly that; so is 1F1B's when ``c = 0``. With ``c > 0`` the simulator's 1F1B
is slower than the bound: in its steady state a stage's next ``F`` is sent only after the
previous backward came back from its successor, so steady-state cycles wait round trips ``2c``
(how many depends on F, B and c; none with two microbatches or fewer, where 1F1B is GPipe): the
price of 1F1B's bounded in-flight window, part of the gap by design (``tests/test_bounds.py``
checks both equalities and that 1F1B's excess is a whole number of ``2c``). Interleaved, R ranks
of v chunks, m a multiple of R, ``c = 0``: ``v m (F + B) + (R - 1)(F + B)``, its makespan. Split
backward with unit ``F = I = W``: ``3m + P - 1``, the zero-bubble paper's ZB-H1 makespan (the
bubble ``(P - 1)(F + I - W)``; ``zb-h1``'s list schedule runs ``P - 1`` above it in this
simulator). One microbatch, one stage per rank: the bound is the makespan of every schedule.

``ideal_s`` (``ideal_bound``): the same three terms with the batch's real tokens only. Each
sequence costs ``d_op(s, l) = predict(s, op, 1 row, l, l^2) - predict(s, op, 1, 0, 0)``: one
row of its own length, no padding, no per-op overhead (the runtime overhead and the model's
fixed cost ``c0`` cancel in the difference). ``work_r = sum_i d_F + d_B`` over the stages of r
(divided by ``dp``: the slowest replica carries at least the mean); ``head_r`` / ``tail_r`` are
those of the shortest piece (sequence or slice) run alone, P2P of its own bytes; with a split
backward the tail is 0 (a split schedule can hide the drain behind ``W``).

Why ``ideal_s <= bound_s`` for any plan of the batch. For every cost model whose per-microbatch
cost is, above its zero-length intercept, superadditive over the sequences it holds and
non-decreasing in rows, padded length and attention work (the *assumption*):

- work: a microbatch of b rows x L holds sequences with ``sum l_i <= b L`` and attention work
  ``A >= sum l_i^2`` (``b L^2`` for one document per row, ``sum l_i^2`` for packed rows, and a
  sequence's slices add up to ``l^2``: ``sum n (2 p + n) = (sum n)^2``), so its cost is at least
  ``sum_i d(l_i)``; the fitted ``poly`` forms ``c0 + c1 b L + c2 A (+ c3 b + c4 ...)`` with
  non-negative coefficients and the ``analytic`` model (FLOPs linear in tokens and ``A``) are
  superadditive exactly; recomputation only adds to ``B``; a split backward's ``I + W`` is
  ``(1 + SPLIT_OVERHEAD) B >= B`` when derived (``costmodel.split``);
- head / tail: a microbatch holds at least one piece, each of its ops costs at least that piece's
  ``d`` and its message is at least that piece's bytes;
- a ``grid`` model (bilinear over measured shapes) is not superadditive by construction, and
  slices priced with ``prefix_scale < 1`` can cost less than ``l^2``; ``tests/test_bounds.py``
  checks the inequality by property tests on the shipped models (analytic, the shipped poly
  fit and a grid fitted on the shipped samples).

``dependency_terms`` / ``ideal_terms`` give each rank's three terms (``RankTerms``: ``head``, ``work``,
``tail``, the tail already ``max(0, tail_r - W_r)`` on the bound's side), whose largest ``total`` is the
bound; ``dynmb.timing.gap_terms`` compares them term by term.

``step_bound_fields`` gives a measured step's ``steps`` columns: ``bound_s`` from the measured
action times (P2P at the model's cost, as ``replay_step_s``), ``pred_bound_s`` from the cost
model, ``ideal_s`` from the cost model, and ``gap_to_bound = step_s / bound_s - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, Sequence

import numpy as np

from dynmb.costmodel.base import CostModelLike
from dynmb.core.types import Plan, Schedule
from dynmb.schedule.embedlast import dropped, is_lifted

__all__ = ["RankTerms", "dependency_terms", "ideal_terms", "replica_bound_terms", "dependency_bound", "ideal_bound",
           "plan_bound", "plan_ideal", "plan_bounds", "stage_ranks", "split_mask", "plan_lengths_pieces",
           "sequence_costs", "step_bound_fields", "MeasuredAction", "BOUND_COLUMNS"]

BOUND_COLUMNS = ("bound_s", "ideal_s", "pred_bound_s", "gap_to_bound")
"""The ``steps`` columns ``step_bound_fields`` fills."""


@dataclass(frozen=True)
class RankTerms:
    """One rank's terms of a bound (module doc): ``head + work + tail`` seconds."""

    head: float
    """The shortest time any microbatch (for ``ideal_s``: the shortest piece) reaches the rank."""
    work: float
    """Every op the rank runs (``ideal_s``: its stages' real-token work, / dp)."""
    tail: float
    """The drain after the rank's last gradient op (``bound_s``: ``max(0, tail_r - W_r)``)."""

    @property
    def total(self) -> float:
        return self.head + self.work + self.tail


class MeasuredAction(Protocol):
    """What ``step_bound_fields`` reads of a measured action (``runtime.records.ActionRow``); read-only
    (properties: a frozen dataclass's fields qualify)."""

    @property
    def dp_rank(self) -> int: ...
    @property
    def stage(self) -> int: ...
    @property
    def op(self) -> str: ...
    @property
    def mb(self) -> int: ...
    @property
    def start_s(self) -> float: ...
    @property
    def end_s(self) -> float: ...


def stage_ranks(num_stages: int, schedule: Schedule | None = None) -> np.ndarray:
    """Rank of every stage: the schedule's map, or one stage per rank."""
    rank = np.arange(num_stages, dtype=np.int64)
    if schedule is not None:
        for r, acts in enumerate(schedule.ranks):
            rank[list({a.stage for a in acts})] = r
    return rank


def split_mask(schedule: Schedule) -> np.ndarray:
    """``[S, m]`` bool: which (stage, microbatch) run a split backward (``I`` + ``W``) in ``schedule``."""
    mask = np.zeros((schedule.num_stages, schedule.num_microbatches), dtype=bool)
    split = [(a.stage, a.mb) for acts in schedule.ranks for a in acts if a.op == "I"]
    if split:
        mask[tuple(np.array(split).T)] = True
    return mask


def _hops(rank: np.ndarray) -> np.ndarray:
    """Rank changes between stage 0 and each stage (the P2P messages on the way)."""
    return np.concatenate([[0], np.cumsum(rank[1:] != rank[:-1])]).astype(np.float64)


def _excl_cumsum(x: np.ndarray) -> np.ndarray:
    """Along stages: ``out[s] = x[:s].sum(0)``."""
    out = np.zeros_like(x)
    out[1:] = np.cumsum(x[:-1], axis=0)
    return out


def dependency_terms(costs: dict[str, np.ndarray], comm_s: float | np.ndarray = 0.0,
                     stage_rank: Sequence[int] | np.ndarray | None = None,
                     split: np.ndarray | None = None) -> dict[int, RankTerms]:
    """Each rank's ``RankTerms`` of ``bound_s`` (module doc) of microbatches costing ``costs[op][stage, mb]``
    seconds, with ``comm_s`` (scalar or one per microbatch) per P2P message. ``split[stage, mb]`` marks the
    split backwards (``I`` + ``W`` in ``costs``), default: split where ``costs`` has ``I`` and no ``B``."""
    F = np.asarray(costs["F"], dtype=np.float64)
    S, m = F.shape
    if split is None:
        split = np.full((S, m), "B" not in costs and "I" in costs)
    split = np.asarray(split, dtype=bool)
    if np.any(~split) and "B" not in costs:
        raise ValueError("costs lack B for the microbatches without a split backward")
    zero = np.zeros((S, m))
    B = np.asarray(costs["B"], dtype=np.float64) if "B" in costs else zero
    if split.any():
        I, W = (np.asarray(costs[op], dtype=np.float64) for op in ("I", "W"))  # noqa: E741
        g, w = np.where(split, I, B), np.where(split, W, 0.0)
    else:
        g, w = B, zero
    comm = np.broadcast_to(np.asarray(comm_s, dtype=np.float64), (m,))
    rank = np.arange(S) if stage_rank is None else np.asarray(stage_rank, dtype=np.int64)
    hop = _hops(rank)[:, None] * comm[None, :]
    head = _excl_cumsum(F) + hop                       # [S, m]: microbatch j reaches stage s
    G = _excl_cumsum(g) + hop                          # [S, m]: the gradient's way from stage 0 up to s
    # [S, m]: after the gradient op of (s, j), the longest chain down to a stage t < s and its W there
    reach = np.maximum.accumulate(w - G, axis=0)
    tail = np.zeros((S, m))
    tail[1:] = G[1:] + reach[:-1]
    work = (F + g + w).sum(axis=1)                     # [S]
    wsum = w.sum(axis=1)
    out = {}
    for r in np.unique(rank):
        on = rank == r
        out[int(r)] = RankTerms(float(head[on].min()), float(work[on].sum()),
                                max(0.0, float(tail[on].min()) - float(wsum[on].sum())))
    return out


def dependency_bound(costs: dict[str, np.ndarray], comm_s: float | np.ndarray = 0.0,
                     stage_rank: Sequence[int] | np.ndarray | None = None, split: np.ndarray | None = None) -> float:
    """``bound_s`` (module doc): the largest rank total of ``dependency_terms`` (same arguments)."""
    return max([0.0, *(t.total for t in dependency_terms(costs, comm_s, stage_rank, split).values())])


def _comm(plan: Plan, cost_model: CostModelLike) -> np.ndarray:
    """P2P seconds per microbatch of ``plan``, as the simulator prices them (0 without a comm model)."""
    comm = getattr(cost_model, "comm", None)
    if comm is None:
        return np.zeros(plan.num_microbatches)
    shapes = plan.shapes()
    nbytes = np.asarray(cost_model.model_cfg.link_bytes(shapes[:, 0], shapes[:, 1], plan.num_stages), dtype=np.float64)
    return np.broadcast_to(np.asarray(comm.time(nbytes), dtype=np.float64), (plan.num_microbatches,))


def _op_costs(plan: Plan, cost_model: CostModelLike, split: bool) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """``(costs, comm_s)`` of ``plan``'s microbatches, as the simulator prices them."""
    return cost_model.plan_costs(plan, ops=("F", "B", "I", "W") if split else ("F", "B")), _comm(plan, cost_model)


def _replicas(plan: Plan) -> list[Plan]:
    return [plan] if plan.dp == 1 else [plan.replica(r) for r in range(plan.dp)]


def _replica_split(schedule: Schedule | None, p: Plan) -> np.ndarray:
    """The split mask of replica ``p``: the schedule's when it fits, else no split."""
    if schedule is None:
        return np.zeros((p.num_stages, p.num_microbatches), dtype=bool)
    mask = split_mask(schedule)
    if mask.shape == (p.num_stages, p.num_microbatches):
        return mask
    return np.full((p.num_stages, p.num_microbatches), bool(mask.any()))


def plan_bound(plan: Plan, cost_model: CostModelLike, schedule: Schedule | None = None) -> float:
    """``bound_s`` of ``plan`` under ``cost_model``: the slowest replica's, on ``schedule``'s
    stage-to-rank map and backward split (replica 0's schedule stands for every replica; without
    one: one stage per rank, full backwards)."""
    out = 0.0
    for p in _replicas(plan):
        out = max([out, *(t.total for t in replica_bound_terms(p, cost_model, schedule).values())])
    return out


def replica_bound_terms(replica: Plan, cost_model: CostModelLike,
                        schedule: Schedule | None = None) -> dict[int, RankTerms]:
    """Each rank's ``RankTerms`` of ``bound_s`` of one replica's plan (``plan_bound``'s pricing, map and split)."""
    split = _replica_split(schedule, replica)
    costs, comm = _op_costs(replica, cost_model, bool(split.any()))
    return dependency_terms(costs, comm, stage_ranks(replica.num_stages, schedule), split)


def plan_lengths_pieces(plan: Plan) -> tuple[np.ndarray, int]:
    """``(whole sequence lengths, shortest piece)`` of ``plan``: a sliced sequence counts once at
    its full length; the shortest piece is the shortest entry of any microbatch (slices included)."""
    if not plan.microbatches:
        return np.zeros(0, dtype=np.int64), 0
    ids = np.concatenate([mb.seq_ids for mb in plan.microbatches])
    lens = np.concatenate([mb.lengths for mb in plan.microbatches])
    uniq, inv = np.unique(ids, return_inverse=True)
    return np.bincount(inv, weights=lens, minlength=len(uniq)).astype(np.int64), int(lens.min())


def sequence_costs(cost_model: CostModelLike, lengths: np.ndarray) -> dict[str, np.ndarray]:
    """``{"F", "B"}: [S, n]``, ``d_op`` of sequences of ``lengths`` (module doc): one row each, no
    overhead, no intercept (the one cost lookup ``stage_costs`` at one row, minus its value at length 0).
    A cost model whose time per token falls as a microbatch grows (``GPUCostModel``: efficiency rises
    with the GEMM's size) prices a sequence alone above its share of a packed row, so it gives its own
    ideal (``ideal_stage_costs``: GEMMs at their best efficiency, attention at the sequence's own
    length, which packing does not change), which stays a lower bound."""
    own = getattr(cost_model, "ideal_stage_costs", None)
    if own is not None:
        return {op: np.asarray(c, dtype=np.float64) for op, c in own(np.asarray(lengths, dtype=np.float64)).items()}
    L = np.concatenate([[0.0], lengths.astype(np.float64)])     # length 0 first: the intercept
    full = cost_model.stage_costs(np.ones_like(L), L, L * L)
    out = {}
    for op in ("F", "B"):
        c = np.asarray(full[op], dtype=np.float64).reshape(cost_model.num_stages, -1)
        out[op] = np.maximum(c[:, 1:] - c[:, :1], 0.0)
    return out


def ideal_bound(lengths: Any, cost_model: CostModelLike, *, stage_rank: Sequence[int] | np.ndarray | None = None,
                split_backward: bool = False, dp: int = 1, shortest_piece: int | None = None) -> float:
    """``ideal_s`` (module doc) of the sequences ``lengths`` on ``dp`` replicas of the pipeline of
    ``cost_model``; ``shortest_piece`` (default the shortest sequence) sets the fill and drain;
    ``split_backward``: the schedule splits backwards (no drain term)."""
    terms = ideal_terms(lengths, cost_model, stage_rank=stage_rank, split_backward=split_backward, dp=dp,
                        shortest_piece=shortest_piece)
    return max([0.0, *(t.total for t in terms.values())]) if terms else 0.0


def ideal_terms(lengths: Any, cost_model: CostModelLike, *, stage_rank: Sequence[int] | np.ndarray | None = None,
                split_backward: bool = False, dp: int = 1, shortest_piece: int | None = None) -> dict[int, RankTerms]:
    """Each rank's ``RankTerms`` of ``ideal_bound`` (same arguments); empty without sequences."""
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if lengths.size == 0:
        return {}
    S = cost_model.num_stages
    rank = np.arange(S) if stage_rank is None else np.asarray(stage_rank, dtype=np.int64)
    uniq, count = np.unique(lengths, return_counts=True)
    piece = int(shortest_piece if shortest_piece is not None else uniq[0])
    d = sequence_costs(cost_model, np.append(uniq, piece))
    work = (d["F"][:, :-1] + d["B"][:, :-1]) @ count.astype(np.float64) / max(1, int(dp))   # [S]
    pF, pB = d["F"][:, -1], d["B"][:, -1]
    comm = getattr(cost_model, "comm", None)
    c = 0.0 if comm is None else float(np.asarray(
        comm.time(cost_model.model_cfg.link_bytes(1, piece, S))).reshape(-1)[0])
    hop = _hops(rank) * c
    head = np.concatenate([[0.0], np.cumsum(pF[:-1])]) + hop
    tail = np.zeros(S) if split_backward else np.concatenate([[0.0], np.cumsum(pB[:-1])]) + hop
    return {int(r): RankTerms(float(head[rank == r].min()), float(work[rank == r].sum()), float(tail[rank == r].min()))
            for r in np.unique(rank)}


def plan_ideal(plan: Plan, cost_model: CostModelLike, schedule: Schedule | None = None) -> float:
    """``ideal_s`` of the sequences of ``plan`` on its ``dp`` replicas (``schedule``: the stage-to-rank
    map and whether backwards are split)."""
    lengths, shortest = plan_lengths_pieces(plan)
    split = schedule is not None and bool(split_mask(schedule).any())
    return ideal_bound(lengths, cost_model, stage_rank=stage_ranks(plan.num_stages, schedule), split_backward=split,
                       dp=plan.dp, shortest_piece=shortest)


def plan_bounds(plan: Plan, cost_model: CostModelLike, schedule: Schedule | None = None) -> tuple[float, float]:
    """``(bound_s, ideal_s)`` of ``plan``."""
    return plan_bound(plan, cost_model, schedule), plan_ideal(plan, cost_model, schedule)


def _measured_bound(plan: Plan, schedule: Schedule, cost_model: CostModelLike,
                    actions: Sequence[MeasuredAction]) -> float | None:
    """``bound_s`` on the measured action times (None when an action of some replica is missing)."""
    rank = stage_ranks(plan.num_stages, schedule)
    out = 0.0
    for r, p in enumerate(_replicas(plan)):
        S, m = p.num_stages, p.num_microbatches
        costs = {op: np.full((S, m), np.nan) for op in ("F", "B", "I", "W")}
        for a in actions:
            if a.dp_rank == r and a.op in costs and 0 <= a.stage < S and 0 <= a.mb < m:
                costs[a.op][a.stage, a.mb] = a.end_s - a.start_s
        split = ~np.isnan(costs["I"])
        back = np.where(split, costs["I"] + costs["W"], costs["B"])
        if np.isnan(costs["F"]).any() or np.isnan(back).any():
            return None
        out = max(out, dependency_bound({op: np.nan_to_num(c) for op, c in costs.items()}, _comm(p, cost_model),
                                        rank, split))
    return out


def step_bound_fields(plan: Plan, schedule: Schedule | None, cost_model: CostModelLike,
                      actions: Sequence[MeasuredAction], step_s: float | None) -> dict[str, float | None]:
    """A step's ``steps`` columns (``BOUND_COLUMNS``; module doc): ``bound_s`` on the measured
    action times of every replica (None when some were not measured), ``pred_bound_s`` and
    ``ideal_s`` from ``cost_model``, ``gap_to_bound = step_s / bound_s - 1``. ``schedule`` is
    replica 0's (its stage-to-rank map and backward split stand for every replica); with the embedding on the
    last rank (``dynmb.schedule.embedlast``) the bounds are the plan's stages' (the embeds left out)."""
    if schedule is not None and is_lifted(schedule, plan.num_stages):
        schedule = dropped(schedule)
        actions = [_shifted(a) for a in actions if a.stage > 0]
    pred_bound, ideal = plan_bounds(plan, cost_model, schedule)
    bound = None if schedule is None else _measured_bound(plan, schedule, cost_model, actions)
    gap = None if bound is None or not bound or step_s is None else float(step_s) / bound - 1.0
    return {"bound_s": bound, "ideal_s": ideal, "pred_bound_s": pred_bound, "gap_to_bound": gap}


def _shifted(action: Any) -> Any:
    """A measured action of the schedule's stage ``s`` as the plan's stage ``s - 1`` (its embedding stage first)."""
    return _Shifted(action.dp_rank, action.op, action.stage - 1, action.mb, action.start_s, action.end_s)


class _Shifted(NamedTuple):
    dp_rank: int
    op: str
    stage: int
    mb: int
    start_s: float
    end_s: float

