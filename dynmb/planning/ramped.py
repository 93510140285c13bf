"""A packed plan with its fill ramped: ``dynmb.packing.dynamic.ramp`` on a ``Plan``'s microbatches.

``--schedule auto`` weighs it (``dynmb.planning.planner.plan_auto``) where the packer's ranking estimate cannot
see what a ramp gains: ``zb``'s packing is ranked by ``zb-h1``'s estimate and chosen by ``zb``'s fast estimate,
both of which leave out ``zb``'s extra warm-up that a ramped fill lets run early (issue 39: at P 16 the
simulated ``zb`` step of a ramped plan, body re-packed 1.5x larger, was 2.3% shorter than of the plan the estimate
chose on humaneval, Llama-2-7B). The ramped plan runs in the ramp's order (no reorder search) and is simulated like
every kind's; it is kept only where it is the fastest that fits.

``ramped_plan(plan, spec, memory_model, scale)``: the microbatches' documents (``seq_ids``) as the ramp's body
(``scale`` > 1: every document, longest first, next-fit in packed rows of ``scale`` times the median
microbatch's tokens); the ramp's
rows (one packed row each, document-causal attention) and the emptied microbatches' other documents become new
microbatches of one row; the ramp runs first, then the kept microbatches and the rest in the plan's order. None
where the plan has slices or several replicas, the settings interleave stages or keep documents in rows of their
own (``attention`` other than ``auto``), or a ramp row does not fit the memory budget (``PackContext.bmax``).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from dynmb.core.planspec import PlanSpec
from dynmb.core.types import Microbatch, Plan
from dynmb.memory.model import MemoryModelLike
from dynmb.packing.context import PackContext
from dynmb.packing.dynamic.ramp import fill_runs, ramp_of
from dynmb.packing.rows import round_up

__all__ = ["ramped_plan"]


def _row(docs: np.ndarray, lengths: np.ndarray, round_to: int) -> Microbatch:
    """One packed row of the documents ``docs`` (global sequence ids)."""
    return Microbatch(seq_ids=docs, lengths=lengths[docs], padded_len=int(round_up(int(lengths[docs].sum()), round_to)),
                      batch=1, row_ids=np.zeros(len(docs), dtype=np.int64))


BODY_SCALES = (1.0, 1.25, 1.5)
"""``plan_auto`` weighs the ramped plan with the packer's body and with bodies re-packed this much larger (a ramp
lets the body grow where the fill bounded it; the packer's estimate does not see that under ``zb``)."""


def _body(plan: Plan, lengths: np.ndarray, scale: float, row_cap: int) -> list[np.ndarray]:
    """The plan's microbatches' documents (``scale`` 1), or every document, longest first, in packed rows of at
    most ``row_cap`` tokens, each closed at ``scale`` times the microbatches' median tokens (``fill_runs``)."""
    if scale == 1.0:
        return [mb.seq_ids for mb in plan.microbatches]
    target = min(scale * float(np.median([mb.real_tokens for mb in plan.microbatches])), float(row_cap))
    docs = np.concatenate([mb.seq_ids for mb in plan.microbatches])
    docs = docs[np.argsort(-lengths[docs], kind="stable")]
    return fill_runs(docs, lengths, [target], row_cap)


def ramped_plan(plan: Plan, spec: PlanSpec, memory_model: MemoryModelLike, scale: float = 1.0) -> Plan | None:
    """``plan`` with its fill ramped (module doc), its body re-packed ``scale`` times larger (``_body``), or None
    where it cannot be."""
    if plan.dp != 1 or plan.has_slices or spec.virtual != 1 or (spec.attention or "auto") != "auto" \
            or plan.num_microbatches < 2:
        return None
    lengths = np.zeros(plan.num_sequences, dtype=np.int64)
    for mb in plan.microbatches:
        lengths[mb.seq_ids] = mb.lengths
    row_cap = int(plan.meta.get("longest_fitting_length") or max(mb.padded_len for mb in plan.microbatches))
    body = _body(plan, lengths, scale, row_cap)
    r = ramp_of(body, lengths, plan.num_stages, row_cap)
    if r is None:
        return None
    kept = [plan.microbatches[i] for i in r.kept] if scale == 1.0 else \
        [_row(body[i], lengths, spec.round_to) for i in r.kept]
    new = [_row(d, lengths, spec.round_to) for d in r.ramp + r.rest]
    if np.any(PackContext.from_spec(spec, memory_model).bmax(np.array([mb.padded_len for mb in new + kept])) < 1):
        return None
    mbs = new[:len(r.ramp)] + kept + new[len(r.ramp):]
    return replace(plan, microbatches=tuple(mbs), replica_ids=None)
