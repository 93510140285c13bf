"""Per-microbatch recomputation: which microbatches of a plan recompute, and packing with it.

A microbatch with ``recompute`` runs every stage with full activation recomputation
(``dynmb.models.RecomputedBlock``): it holds only its blocks' inputs from F to B
(``MemoryModel.rc_act_coef``), one block's activations more during its backward
(``rc_transient_coef``), and its backward reruns the blocks' forward
(``dynmb.costmodel.split.RECOMPUTE_F_SHARE``). Modes (``RECOMPUTE_MODES``, ``--recompute``):

- ``never``: no microbatch recomputes (the packers' own behaviour).
- ``always``: every microbatch recomputes; the packer sizes them under recomputation's
  admissibility (``MemoryModel.recomputing()``).
- ``auto``: recompute exactly the microbatches for which it pays. Candidates, each a complete
  plan whose predicted peak (``MemoryModel.peak_bytes`` with the flags) is under the limit:

  (a) the plain plan, when every sequence fits without recomputation;
  (b) the plan packed under recomputation's admissibility (bigger microbatches, longer
      sequences), where only the microbatches that do not fit without it
      (``needs_recompute``) are flagged; if the mix of flagged and plain microbatches
      exceeds the limit, all of them are flagged (what the packer packed for);
  (c) with sequences that fit only with recomputation (one pipeline, no data parallelism):
      the plain plan of the others plus each such sequence as its own one-row recomputed
      microbatch.

  Every candidate cuts the batch as (b) does: at the cap ``min(max_seq_len, longest row
  admissible with recomputation)`` under ``oversize`` (truncate / drop; ``error`` raises), so
  every method truncates alike and ``meta.longest_fitting_length``, ``truncated`` and
  ``dropped`` are (b)'s; (a) only when it cut the batch the same way.

  The one with the smallest estimated makespan (``dynmb.timing.makespan.makespan`` on the one cost
  lookup, each microbatch's recompute cost included) among those under the limit wins, the first of
  equals (the candidate search ``dynmb.timing.search``, rule ``fastest``); ``meta.recompute`` records
  the mode, ``meta.recompute_choice`` the candidate and ``meta.recomputed`` how many microbatches recompute.

Admissibility of one microbatch (``fits``) is the packers' per-microbatch rule
(``MemoryModel.max_rows`` with the stage caps and in-flight counts of ``dynmb.packing``).
Numpy only, like the packers.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace
from typing import Any, Callable, cast

import numpy as np

from dynmb.costmodel.loader import Models
from dynmb.memory.model import MemoryModelLike
from dynmb.core.features import CostFeatures
from dynmb.timing.makespan import makespan
from dynmb.timing.search import Candidate, Verdict, evaluate, fastest
from dynmb.core.planspec import PlanSpec
from dynmb.schedule.kinds import get_kind
from dynmb.core.types import Microbatch, Plan
from dynmb.packing.context import stage_windows
from dynmb.packing.embedprice import EmbedPricing

__all__ = ["RECOMPUTE_MODES", "fits", "needs_recompute", "mark_recompute", "pack_with_recompute"]

logger = logging.getLogger(__name__)

RECOMPUTE_MODES = ("never", "always", "auto")


def _caps_inflight(memory_model: MemoryModelLike, limit: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
    P = memory_model.num_stages
    k = stage_windows(get_kind(kind), P)
    return float(limit) - np.asarray(memory_model.state_bytes, dtype=np.float64), k


def fits(memory_model: MemoryModelLike, limit: int, rows: Any, padded_len: Any, *, kind: str = "1f1b", tight: bool = True,
         recompute: bool = False) -> np.ndarray:
    """Whether microbatches (rows, padded_len) are admissible (``dynmb.packing``'s rule), with or
    without recomputation; vectorised."""
    caps, k = _caps_inflight(memory_model, limit, kind)
    b = np.atleast_1d(np.asarray(rows, dtype=np.int64))
    s = np.atleast_1d(np.asarray(padded_len, dtype=np.int64))
    return b <= memory_model.max_rows(caps, s, k, tight=tight, recompute=recompute)


def needs_recompute(memory_model: MemoryModelLike, plan: Plan, *, tight: bool = True) -> np.ndarray:
    """``(m,)`` bool: the plan's microbatches that are not admissible without recomputation."""
    shapes = plan.shapes()
    return ~fits(memory_model, plan.memory_limit_bytes, shapes[:, 0], shapes[:, 1], kind=plan.schedule_kind,
                 tight=tight)


def mark_recompute(plan: Plan, flags: Any, **meta: Any) -> Plan:
    """The same plan with ``Microbatch.recompute`` set to ``flags[m]``."""
    flags = np.broadcast_to(np.asarray(flags, dtype=bool), (plan.num_microbatches,))
    mbs = tuple(mb if bool(getattr(mb, "recompute", False)) == bool(f) else _with_flag(mb, bool(f))
                for mb, f in zip(plan.microbatches, flags))
    return replace(plan, microbatches=mbs, meta=plan.meta.with_(recomputed=int(flags.sum()), **meta))


def _with_flag(mb: Microbatch, flag: bool) -> Microbatch:
    return Microbatch(mb.seq_ids, mb.lengths, mb.padded_len, mb.batch, mb.row_ids, recompute=flag)


def _estimate(plan: Plan, models: Models[MemoryModelLike]) -> tuple[float, np.ndarray]:
    """(estimated makespan of the slowest replica, predicted peak per stage) with the plan's flags."""
    cost_model, memory_model = models.cost, models.memory
    replicas = range(plan.dp) if plan.dp > 1 else [None]
    worst, peak = 0.0, np.zeros(plan.num_stages)
    virtual = plan.spec.virtual if plan.spec is not None else 1
    embeds = EmbedPricing.of(plan.spec.embedding if plan.spec is not None else "first", cost_model)
    for r in replicas:
        sub = plan if r is None else plan.replica(r)
        shapes, flags = sub.shapes(), sub.recompute_mask()
        cost = CostFeatures.of(sub.microbatches, memory_model.model_cfg.attention).costs(cost_model)
        comm = np.broadcast_to(np.asarray(cost_model.comm_s(shapes[:, 0], shapes[:, 1]), dtype=np.float64),
                               (sub.num_microbatches,)) if hasattr(cost_model, "comm_s") else 0.0
        est = makespan(cost["F"], cost["B"], comm, plan.schedule_kind, virtual=virtual)
        if embeds is not None:
            est = float(embeds.added([est], embeds.seconds(shapes[:, 0], shapes[:, 1]), comm, [len(shapes)])[0])
        worst = max(worst, est)
        peak = np.maximum(peak, memory_model.peak_bytes(shapes[:, 0], shapes[:, 1], plan.schedule_kind,
                                                        virtual=virtual, recompute=flags))
    return worst, peak


def _with_predictions(plan: Plan, models: Models[MemoryModelLike]) -> tuple[Plan, float, bool]:
    est, peak = _estimate(plan, models)
    preds = plan.predictions.updated(pred_peak_bytes=np.ceil(peak), est_makespan_s=est)
    return replace(plan, predictions=preds), est, bool(np.all(peak <= plan.memory_limit_bytes))


def _remap(plan: Plan, ids: np.ndarray) -> list[Microbatch]:
    """The microbatches of a plan over ``lengths[ids]`` with sequence ids of the full batch."""
    return [Microbatch(ids[mb.seq_ids], mb.lengths, mb.padded_len, mb.batch, mb.row_ids, recompute=mb.recompute)
            for mb in plan.microbatches]


Judged = tuple[Plan, float, bool]
"""A candidate of ``recompute="auto"``: the plan with its predictions, its estimated makespan, whether it fits."""


def pack_with_recompute(pack_fn: Callable[..., Plan], lengths: Any, spec: PlanSpec, *,
                        models: Models[MemoryModelLike]) -> Plan:
    """``pack_fn`` (``dynmb.packing.pack``) under the recompute mode ``spec.recompute`` (module doc)."""
    memory_model = models.memory
    if spec.recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {spec.recompute!r}")
    method, memory_limit_bytes = spec.method, spec.memory_limit_bytes
    plain = spec.with_(recompute="never")

    def run(lens: Any, model: MemoryModelLike) -> Plan:
        return replace(pack_fn(lens, plain, models=replace(models, memory=model)), spec=spec)

    if spec.recompute == "never":
        return run(lengths, memory_model)
    rc_model = memory_model.recomputing()
    if spec.recompute == "always":
        plan = run(lengths, rc_model)
        return _with_predictions(mark_recompute(plan, True, recompute="always"), models)[0]
    lengths = np.asarray(lengths, dtype=np.int64)
    kind = spec.schedule_kind

    def candidate(name: str, plan: Plan) -> Candidate[Judged]:     # the search's candidates (module doc)
        return Candidate(name, functools.partial(_with_predictions, plan, models))

    cands: list[Candidate[Judged]] = []
    rc_plan = run(lengths, rc_model)           # cut at the cap with recomputation (PackingError under oversize error)
    cut, keep = _after_oversize(lengths, rc_plan)
    plain_ok = fits(memory_model, memory_limit_bytes, np.ones(len(cut)), cut, kind=kind)
    if plain_ok[keep].all():
        plain_plan = run(lengths, memory_model)
        same = _after_oversize(lengths, plain_plan)
        if np.array_equal(same[0][keep], cut[keep]) and np.array_equal(same[1], keep):
            cands.append(candidate("plain", plain_plan))    # (it cut the batch as rc_plan did: else not one)
    flags = needs_recompute(memory_model, rc_plan, tight=(rc_plan.meta.budget or "tight") == "tight")
    mixed = mark_recompute(rc_plan, flags, recompute="auto")
    cands.append(candidate("mixed", mixed) if _with_predictions(mixed, models)[2] else
                 candidate("all", mark_recompute(rc_plan, True, recompute="auto")))
    rc_ok = fits(memory_model, memory_limit_bytes, np.ones(len(cut)), cut, kind=kind, recompute=True)
    plain_ok &= keep
    if plain_ok.any() and not plain_ok[keep].all() and rc_ok[keep].all() and spec.dp == 1:
        cands.append(candidate("split", _plain_plus_singletons(run, lengths, plain_ok, memory_model, rc_plan)))
    outcomes = evaluate(cands, _judge, drop=())           # an error of the estimate is raised
    if not any(o.fits for o in outcomes):
        raise ValueError(f"recompute auto: no plan of {method} fits under {memory_limit_bytes} B")
    best = fastest(outcomes)
    plan = cast(Judged, best.made)[0]
    return replace(plan, meta=plan.meta.merged(_cap_meta(rc_plan)).with_(recompute="auto", recompute_choice=best.name))


def _judge(judged: Judged) -> Verdict:
    """The search's verdict of a candidate (``_with_predictions``: estimate and fit), logged."""
    plan, est, ok = judged
    logger.debug("recompute auto: candidate: %d microbatches, %d recomputed, est %.4g s, fits %s",
                 plan.num_microbatches, int(plan.recompute_mask().sum()), est, ok)
    return Verdict(est, ok)


_CAP_KEYS = ("longest_fitting_length", "truncated", "dropped")


def _cap_meta(rc_plan: Plan) -> dict[str, Any]:
    """The length cap of every candidate: the plan packed with recomputation's admissibility
    (``min(max_seq_len, longest admissible row)``) and its truncated / dropped sequences."""
    return {k: getattr(rc_plan.meta, k) for k in _CAP_KEYS if k in rc_plan.meta.given}


def _after_oversize(lengths: np.ndarray, rc_plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    """(lengths as ``rc_plan`` runs them: truncated ones at its length, mask of the sequences not dropped)."""
    cut = lengths.copy()
    for mb in rc_plan.microbatches:
        cut[mb.seq_ids] = mb.lengths
    keep = np.ones(len(lengths), dtype=bool)
    keep[np.asarray(rc_plan.meta.dropped or [], dtype=np.int64)] = False
    return cut, keep


def _plain_plus_singletons(run: Callable[[Any, MemoryModelLike], Plan], lengths: np.ndarray, plain_ok: np.ndarray,
                           memory_model: MemoryModelLike, rc_plan: Plan) -> Plan:
    """Candidate (c): the plain plan of the sequences that fit without recomputation, then each
    other sequence ``rc_plan`` keeps alone in a recomputed one-row microbatch (at the packer's
    rounding), every sequence at the length ``rc_plan`` cut it to (``plain_ok``: False for dropped ones)."""
    cut, keep = _after_oversize(lengths, rc_plan)
    ids = np.flatnonzero(plain_ok)
    base = run(cut[ids], memory_model)
    round_to = int(rc_plan.meta.round_to or 1)
    extra = [Microbatch([i], [int(cut[i])], -(-int(cut[i]) // round_to) * round_to, 1, recompute=True)
             for i in np.flatnonzero(keep & ~plain_ok)]
    mbs = tuple(_remap(base, ids) + extra)
    plan = Plan(microbatches=mbs, method=base.method, num_stages=base.num_stages,
                memory_limit_bytes=base.memory_limit_bytes, num_sequences=len(cut),
                schedule_kind=base.schedule_kind, predictions=base.predictions, spec=base.spec,
                meta=base.meta.merged(_cap_meta(rc_plan)).with_(recomputed=len(extra), recompute="auto"))
    plan.validate(lengths)
    return plan
