"""``slice_fitting="auto"``: slice sequences that fit too, where the simulator predicts a shorter step.

``oversize="split"`` slices only the sequences longer than the longest row that fits
(``dynmb.planning.slicing``). On a deep pipeline a long sequence that does fit is still one whole
microbatch whose fill and drain the others wait on; cut into a chain of slices it fills the pipeline.
Algorithm (one global batch, one schedule kind; ``dynmb.planning.planner`` calls ``plan_fitting`` with
the plan without fitting slices, ``base``, already made and checked):

1. The tokens ``base`` trains (``kept_lengths``): each sequence's planned tokens, its slices summed, so
   under ``oversize="truncate"`` a sequence longer than the longest fitting length counts at the length
   it was cut to, under ``drop`` a dropped one is out, under ``split`` every sequence is whole.
2. The longest row ``row_cap`` (``slicing.longest_row``) and the thresholds ``row_cap / k`` for k in
   ``DIVISORS`` (2, 4), each a multiple of ``round_to``, at least ``MIN_SLICE``; a threshold not below
   ``row_cap`` or not below the longest kept sequence is not tried.
3. Each threshold ``t`` is planned by ``plan_split(kept, spec, threshold=t)``: every kept sequence longer
   than ``t`` is a chain of slices (slice lengths among ``row_cap / {1, 2, 4, 8}`` of at most ``t``,
   placement, fill of the slices' rows up to ``row_cap`` and recomputation chosen by simulating the whole
   plan, every replica, as ``oversize="split"`` does), the rest is packed by the method. A threshold for
   which no candidate fits the limit (``PackingError``) drops out.
4. Kept: the fastest predicted step among ``base`` and the threshold plans, among those that ``fits``
   (within the limit; none fits: ``base``); ties keep ``base``. A threshold plan takes ``base``'s
   ``oversize``, ``truncated``, ``dropped`` and ``longest_fitting_length``: every kept token is trained
   exactly once, the token count is ``base``'s. ``meta["slice_threshold"]``: the threshold of the plan
   kept (None: no fitting slices); ``meta["slice_fitting"]``: each option's predicted step (``"none"``
   for ``base``, then each threshold; None: no plan within the limit).

Not tried (``base`` as it is): ``packed`` (its rows are its pack length), kinds without ``slices``
(``memory-aware``) or without virtual stages for ``virtual > 1``, and a reorder other than ``none`` /
``auto`` (a plan with slices runs in its planned order). Cost: one ``plan_split`` per threshold, each
several whole-plan simulations (every replica).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable, Mapping

import numpy as np

from dynmb.costmodel.loader import Models
from dynmb.memory.model import MemoryModelLike
from dynmb.core.config import ModelConfig
from dynmb.packing import PackingError
from dynmb.packing.rows import round_down
from dynmb.core.planspec import PlanSpec
from dynmb.schedule.kinds import ScheduleKind
from dynmb.timing.simulate import SimResult
from dynmb.core.types import Plan, Schedule
from dynmb.planning.replicas import make_schedule
from dynmb.planning.slicing import MIN_SLICE, longest_row, plan_split

__all__ = ["DIVISORS", "kept_lengths", "thresholds", "applies", "plan_threshold", "plan_fitting"]

log = logging.getLogger(__name__)

DIVISORS = (2, 4)
"""Thresholds tried: the longest row divided by these."""

Planned = tuple[Plan, Schedule, SimResult]


def kept_lengths(plan: Plan) -> np.ndarray:
    """Tokens ``plan`` trains of each sequence of its batch (slices summed; dropped: 0)."""
    ids = np.concatenate([mb.seq_ids for mb in plan.microbatches])
    lens = np.concatenate([mb.lengths for mb in plan.microbatches])
    return np.bincount(ids, weights=lens, minlength=plan.num_sequences).astype(np.int64)


def thresholds(row_cap: int, longest: int, round_to: int) -> list[int]:
    """The thresholds tried for the longest row ``row_cap`` and longest kept sequence ``longest`` (step 2)."""
    out: list[int] = []
    for k in DIVISORS:
        t = max(MIN_SLICE, round_down(row_cap // k, round_to) or round_to)
        if t < row_cap and t < longest and t not in out:
            out.append(t)
    return out


def applies(spec: PlanSpec, rec: ScheduleKind) -> bool:
    """Whether fitting slices are tried for ``spec`` of kind ``rec`` (module doc: what is not tried)."""
    return (spec.slice_fitting == "auto" and spec.method != "packed" and rec.slices
            and (spec.virtual == 1 or rec.virtual_stages) and spec.reorder in ("none", "auto"))


def plan_threshold(lengths: np.ndarray, cut: np.ndarray, base_meta: Mapping[str, Any], spec: PlanSpec, threshold: int, *,
                   kind: ScheduleKind, model_cfg: ModelConfig, models: Models[MemoryModelLike]) -> Planned:
    """The kept tokens ``cut`` (``kept_lengths`` of the plan without fitting slices, whose ``base_meta`` gives
    ``truncated``, ``dropped`` and ``longest_fitting_length``) of the batch ``lengths`` planned with every
    sequence longer than ``threshold`` sliced (step 3), validated against ``lengths``; ``PackingError`` where
    no candidate fits."""
    cut = np.asarray(cut, dtype=np.int64)
    kept = np.flatnonzero(cut > 0)
    plan, sched, sim = plan_split(cut[kept], spec, kind, model_cfg=model_cfg, models=models,
                                  make_schedule=make_schedule, threshold=threshold)
    if kept.size < cut.size:                       # dropped sequences: back to the batch's ids
        plan = replace(plan, num_sequences=int(cut.size),
                       microbatches=tuple(replace(mb, seq_ids=kept[mb.seq_ids]) for mb in plan.microbatches))
    meta = plan.meta.with_(oversize=spec.oversize, sliced={int(kept[s]): n for s, n in (plan.meta.sliced or {}).items()},
                           truncated=list(base_meta.get("truncated", [])), dropped=list(base_meta.get("dropped", [])),
                           longest_fitting_length=base_meta.get("longest_fitting_length",
                                                                plan.meta.longest_fitting_length))
    plan = replace(plan, meta=meta)
    plan.validate(lengths)
    return plan, sched, sim


def _step(planned: Planned) -> float:
    return float(planned[0].predictions["pred_step_s"])


def plan_fitting(lengths: np.ndarray, spec: PlanSpec, base: Planned, *, kind: ScheduleKind, model_cfg: ModelConfig,
                 models: Models[MemoryModelLike], fits: Callable[[Plan, Schedule, SimResult], bool]) -> Planned:
    """``base`` or the fastest plan with fitting slices that ``fits`` (module doc); the plan kept records
    ``slice_threshold`` and ``slice_fitting``."""
    if not applies(spec, kind):
        return base
    lengths = np.asarray(lengths, dtype=np.int64)
    row_cap = longest_row(spec, model_cfg, models.memory)
    cut = kept_lengths(base[0])
    steps: dict[str, float | None] = {"none": _step(base)}
    best = base
    for t in thresholds(row_cap, int(cut.max()), spec.round_to):
        try:
            alt = plan_threshold(lengths, cut, base[0].meta, spec, t, kind=kind, model_cfg=model_cfg, models=models)
        except PackingError as e:
            log.debug("slice_fitting: threshold %d: %s", t, e)
            steps[str(t)] = None
            continue
        ok = fits(*alt)
        steps[str(t)] = _step(alt) if ok else None
        if ok and (not fits(*best) or _step(alt) < _step(best) * (1 - 1e-9)):
            best = alt
    plan, sched, sim = best
    meta = plan.meta.with_(slice_threshold=plan.meta.slice_threshold, slice_fitting=steps)
    return replace(plan, meta=meta), sched, sim
