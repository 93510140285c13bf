"""Where a step's gap to the ideal goes: ``step - ideal_s`` split into terms that add up exactly.

    step - ideal = schedule + ends + split + replicas + overhead + padding + passes + shape

The step is one replica's simulated makespan (the slowest replica's, in the studies), ``bound`` that
replica's ``bound_s`` and ``ideal`` the whole plan's ``ideal_s`` (``dynmb.timing.bounds``; the ideal may be priced
by its own cost model, ``ideal_model``: the scaling study prices it with GEMMs saturated). Both bounds are
a largest sum ``head + work + tail`` over ranks (``bounds.RankTerms``); every term is read on ``r*``, the
rank that decides the bound (its largest total; the first on ties), and the ideal's terms on ``r*`` are
``i_head``, ``i_work``, ``i_tail`` (``ideal_terms``, the plan's ``dp``):

- ``schedule = step - bound``: what the order, the sizes at the ends and the schedule kind leave on the
  table (the bound does not depend on the order nor the kind's op order, only on the microbatches, the
  stage-to-rank map and which backwards are split);
- ``ends = (head + tail of the bound on r*) - (i_head + i_tail)``: the fill and drain of the real
  microbatches (the shortest time any reaches r*, the drain after r*'s last gradient, net of the ``W``
  that can hide it) against those of the shortest piece run alone;
- ``split = (i_head + i_work + i_tail) - ideal <= 0``: the ideal on r* against the ideal's busiest rank
  (0 when the bound's busiest rank is the ideal's; negative when the microbatches' pricing moves the
  busiest rank away from the stage the layer split left heaviest in real-token work);
- ``replicas = own - i_work``: ``own`` is the ideal work on r* of this replica's own sequences (dp 1), and
  ``i_work`` the batch's divided by ``dp``: the slowest replica carries more than the mean (0 with dp 1);
- the bound's ``work`` on r* (every op of every microbatch on the stages of r*, as ``dependency_bound``
  sums it: ``F + B``, or ``F + I + W`` where the schedule splits the backward, recomputation included)
  against ``own``, priced by the bound's cost model ``cm`` at three shapes per microbatch j and stage s
  of r*: its plan shape ``P_j`` (``rows x padded_len``, attention work as ``plan_costs``), its real
  tokens' shape ``R_j`` (one row of the ``T_j`` real tokens, attention work of its documents,
  ``sum l^2`` over whole sequences plus the slices' ``prefix_work``, prefix scale as ``plan_costs``) and
  zero tokens ``Z`` (one row, length 0, attention 0):
  - ``padding = work - sum cm_ops(R_j)``: the same ops at the plan shape against the real tokens' shape
    (padded rows, and causal attention over the pads of one-document rows);
  - ``passes = sum cm_ops(R_j) - sum cm_FB(R_j)``: what a split backward (``I + W`` against one ``B``,
    ``costmodel.split.SPLIT_OVERHEAD`` where derived) and recomputation add (0 under a full backward
    without recomputation); ``cm_FB`` and ``overhead`` price the layout saving every block (a layout's
    recomputed leading blocks, ``ModelConfig.recompute_blocks``, count here);
  - ``overhead = sum cm_FB(Z)``: the per-op fixed cost (intercept, launch overhead, runtime overhead
    and receive latency when calibrated), once per F and per B of every microbatch on r*;
  - ``shape = sum cm_FB(R_j) - overhead - own``: the rest, GEMM and attention efficiency at the
    microbatch's size against the ideal's pricing (the saturated GEMMs of the study; 0 when
    ``ideal_model`` is ``cm`` and the model is additive over sequences above its intercept, as the
    analytic one with one sequence per microbatch) and any non-additivity over sequences.

``schedule_wire`` splits ``schedule`` further (a diagnostic, not one of ``TERMS``): ``wire = (step - step0) -
(bound - bound0)``, where ``step0`` / ``bound0`` are the same schedule's makespan and bound with every P2P time 0
(``dynmb.timing.simulate.simulate_costs``, ``bounds.dependency_terms``): what the messages' latency costs the
schedule beyond what the bound charges for it (the bound charges P2P in the head only); ``schedule - wire`` is
the order's own excess over the bound at zero latency.

The sum telescopes: ``schedule + ends + split + replicas`` is ``step - ideal`` minus ``work - own``, and
the last four add up to ``work - own``. ``GapTerms.check`` verifies it (floating-point rounding only);
``GapTerms.fractions`` gives each term over ``ideal`` (the study's ``gap_<term>`` columns, summing to
``gap_to_ideal = step / ideal - 1``). With the embedding on the last rank (``dynmb.schedule.embedlast``) the
bound and the ideal are the plan's stages' (the schedule without its embedding stage): the embeds' work and
their two messages per microbatch are in ``schedule``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Sequence

import numpy as np

from dynmb.timing.bounds import (RankTerms, dependency_terms, ideal_terms, plan_lengths_pieces, replica_bound_terms,
                                 split_mask, stage_ranks)
from dynmb.timing.simulate import comm_times, plan_op_costs, simulate_costs
from dynmb.costmodel.base import CostModelLike
from dynmb.core.types import Plan, Schedule
from dynmb.schedule.embedlast import dropped, is_lifted

__all__ = ["GapTerms", "gap_terms", "TERMS", "schedule_wire"]

TERMS = ("schedule", "ends", "split", "replicas", "overhead", "padding", "passes", "shape")
"""The terms of ``step - ideal``, in the order of the module doc."""


@dataclass(frozen=True)
class GapTerms:
    """``step - ideal`` term by term, seconds on ``rank`` (the rank that decides the bound; module doc)."""

    step: float
    bound: float
    ideal: float
    rank: int
    schedule: float
    ends: float
    split: float
    replicas: float
    overhead: float
    padding: float
    passes: float
    shape: float

    TERMS: ClassVar[tuple[str, ...]] = TERMS

    @property
    def total(self) -> float:
        """The sum of the terms: ``step - ideal`` up to rounding."""
        return float(sum(getattr(self, t) for t in TERMS))

    def check(self, rel: float = 1e-9) -> "GapTerms":
        """``self``, or ValueError when the terms do not add up to ``step - ideal``."""
        want = self.step - self.ideal
        if abs(self.total - want) > rel * max(abs(self.step), abs(self.ideal), 1e-300):
            raise ValueError(f"gap terms add up to {self.total!r}, not step - ideal = {want!r}: {asdict(self)}")
        return self

    def fractions(self, prefix: str = "gap_") -> dict[str, float]:
        """Each term over ``ideal`` (``prefix`` + name): they add up to ``step / ideal - 1``."""
        return {f"{prefix}{t}": getattr(self, t) / self.ideal if self.ideal else float("nan") for t in TERMS}


def _real_attention(plan: Plan) -> np.ndarray:
    """Per microbatch: the attention work of its documents alone (whole sequences' ``l^2``, slices' prefix work)."""
    return np.array([float(np.sum(mb.lengths[~mb.slice_mask].astype(np.int64) ** 2) + mb.prefix_work())
                     for mb in plan.microbatches], dtype=np.float64)


def _priced(cm: CostModelLike, tokens: np.ndarray, attn: np.ndarray, cross: np.ndarray, ops: tuple[str, ...],
            recompute: np.ndarray | None) -> dict[str, np.ndarray]:
    """``stage_costs`` of one row of ``tokens`` each, the slices' prefix attention priced as ``plan_costs`` does."""
    ones = np.ones_like(tokens)
    scale = getattr(cm, "prefix_scale", {}) or {}
    if not np.any(cross) or set(scale.values()) <= {1.0}:
        return cm.stage_costs(ones, tokens, attn, ops=ops, recompute=recompute)
    return {op: cm.stage_costs(ones, tokens, attn + (scale.get(op, scale.get("B", 1.0)) - 1.0) * cross, ops=(op,),
                               recompute=recompute)[op] for op in ops}


def _saving_every_block(cm: CostModelLike) -> CostModelLike:
    """``cm`` pricing the layout without its recomputed leading blocks (``CostModel.without_block_recompute``),
    so their extra forward counts in ``passes``, not in ``shape`` or ``overhead``; ``cm`` where it has no such view."""
    view = getattr(cm, "without_block_recompute", None)
    return cm if view is None else view()


def _rank_sum(costs: dict[str, np.ndarray], on: np.ndarray, split: np.ndarray | None) -> float:
    """Seconds of every op on the stages ``on``: ``F + B``, or ``F + I + W`` where ``split``."""
    back = costs["B"] if split is None else np.where(split, costs["I"] + costs["W"], costs["B"])
    return float((costs["F"][on] + back[on]).sum())


def _busiest(terms: dict[int, RankTerms]) -> int:
    return max(sorted(terms), key=lambda r: terms[r].total)


def gap_terms(plan: Plan, schedule: Schedule, cost_model: CostModelLike, step_s: float, *,
              replica: Plan | None = None, ideal_model: CostModelLike | None = None,
              ideal_rank: Sequence[int] | np.ndarray | None = None, ideal_split: bool | None = None) -> GapTerms:
    """``GapTerms`` (module doc) of a step of ``step_s`` seconds: ``replica`` (the plan ``schedule`` runs,
    as reordered; default ``plan`` when its ``dp`` is 1) under ``schedule``, priced by ``cost_model``, against
    the ``ideal_s`` of the whole ``plan`` priced by ``ideal_model`` (default ``cost_model``) with the
    stage-to-rank map ``ideal_rank`` (default the schedule's) and ``ideal_split`` (the drain term dropped;
    default: whether the schedule splits a backward, as ``plan_ideal``)."""
    if replica is None:
        if plan.dp != 1:
            raise ValueError(f"gap_terms: a plan of dp {plan.dp} needs the replica its schedule runs")
        replica = plan
    if is_lifted(schedule, replica.num_stages):     # the embedding on the last rank: its ops count in ``schedule``
        schedule = dropped(schedule)
    if (schedule.num_stages, schedule.num_microbatches) != (replica.num_stages, replica.num_microbatches):
        raise ValueError(f"gap_terms: the schedule ({schedule.num_stages} stages, {schedule.num_microbatches} "
                         f"microbatches) is not the replica's ({replica.num_stages}, {replica.num_microbatches})")
    ideal_model = cost_model if ideal_model is None else ideal_model
    split = split_mask(schedule)
    if ideal_split is None:
        ideal_split = bool(split.any())
    rank_map = stage_ranks(plan.num_stages, schedule) if ideal_rank is None else np.asarray(ideal_rank, dtype=np.int64)
    kw: dict[str, Any] = dict(stage_rank=rank_map, split_backward=ideal_split)
    # the bound's rank terms, and the ideal's, whole batch (/ dp) and this replica's sequences
    bound_terms = replica_bound_terms(replica, cost_model, schedule)
    r = _busiest(bound_terms)
    b = bound_terms[r]
    lengths, shortest = plan_lengths_pieces(plan)
    whole = ideal_terms(lengths, ideal_model, dp=plan.dp, shortest_piece=shortest, **kw)
    if r not in whole:
        raise ValueError(f"gap_terms: the bound's rank {r} is not a rank of the ideal's stage-to-rank map {rank_map}")
    ideal = max(t.total for t in whole.values())
    i = whole[r]
    own = ideal_terms(plan_lengths_pieces(replica)[0], ideal_model, dp=1, shortest_piece=shortest, **kw)[r].work
    # the bound's work on r at the real tokens' shape and at zero tokens
    on = stage_ranks(replica.num_stages, schedule) == r
    tokens = np.array([mb.real_tokens for mb in replica.microbatches], dtype=np.float64)
    attn, cross = _real_attention(replica), replica.prefix_cross_work()
    mask = replica.recompute_mask()
    rc = mask if mask.any() else None
    ops = ("F", "B", "I", "W") if split.any() else ("F", "B")
    real_ops = _rank_sum(_priced(cost_model, tokens, attn, cross, ops, rc), on, split if split.any() else None)
    saving = _saving_every_block(cost_model)
    real_fb = _rank_sum(_priced(saving, tokens, attn, cross, ("F", "B"), None), on, None)
    zero = np.zeros_like(tokens)
    overhead = _rank_sum(saving.stage_costs(np.ones_like(tokens), zero, zero, ops=("F", "B")), on, None)
    step_s = float(step_s)
    return GapTerms(step=step_s, bound=b.total, ideal=ideal, rank=r, schedule=step_s - b.total,
                    ends=(b.head + b.tail) - (i.head + i.tail), split=i.total - ideal, replicas=own - i.work,
                    overhead=overhead, padding=b.work - real_ops, passes=real_ops - real_fb,
                    shape=real_fb - overhead - own)


def schedule_wire(replica: Plan, schedule: Schedule, cost_model: CostModelLike) -> float:
    """Seconds of the ``schedule`` term that P2P latency makes (module doc): ``(step - step0) - (bound - bound0)``
    for ``replica`` (one pipeline) under ``schedule`` priced by ``cost_model``, ``0`` marking every P2P time 0."""
    if (schedule.num_stages, schedule.num_microbatches) != (replica.num_stages, replica.num_microbatches):
        raise ValueError(f"schedule_wire: the schedule ({schedule.num_stages} stages, {schedule.num_microbatches} "
                         f"microbatches) is not the replica's ({replica.num_stages}, {replica.num_microbatches})")
    costs = plan_op_costs(cost_model, replica, schedule)
    comm = comm_times(cost_model, replica)
    ranks, split = stage_ranks(replica.num_stages, schedule), split_mask(schedule)

    def excess(p2p: float | np.ndarray) -> float:
        bound = max(t.total for t in dependency_terms(costs, p2p, ranks, split).values())
        return simulate_costs(schedule, costs, p2p).makespan_s - bound
    return excess(comm) - excess(0.0)
