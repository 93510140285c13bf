"""``offload="auto"``: which leading blocks of each stage keep their saved activations in host memory.

Activation offload (PipeOffload, Wan et al. 2025, arXiv:2503.01328, for the idea): a microbatch's activations on
stage ``s`` wait about ``(P - s)`` forward-backward pairs between its forward and its backward, so a copy to host
memory after the forward and back before the backward can run beside compute, and the stage holds fewer device
bytes per microbatch in flight (``MemoryModel.offloading``); where its admission binds, it then packs larger
microbatches. The search (``plan_offload``), one step, every method alike (a memory setting, as recompute):

1. plan without offload (the plan it must beat); a cost model without a host link (``timing.offload.host_link``:
   the CPU models), a layout that recomputes some stages' leading blocks (``ModelConfig.recompute_blocks``; the two
   are not combined), a plan with slices of long sequences (their carried keys and values stay on the device) or
   a plan that recomputes every microbatch ends here;
2. per stage, the most leading blocks whose copies hide behind that plan's own ops (``hiding_blocks``): the
   reloads within ``share`` of the forwards (the op before a backward in 1F1B's steady state, where the runtime
   issues the reload) and the copies out within ``share`` of the backwards (the op after a forward there), summed over the plan's microbatches; ``HIDE_SHARES`` gives one option per share (a margin for the
   other kinds' op orders and the larger microbatches that follow; the simulator prices what still comes late),
   and each again with at most one block per stage (copies that hide only at the plan's own sizes often stall
   at the larger microbatches offload admits);
3. from none, one more block on the stage whose admission binds (the fewest tokens one microbatch may hold there,
   in one-token rows under the tight budget, ``MemoryModel.max_rows`` per stage), while that stage may hide one
   more and the block raises its admission (``binding_blocks``);
4. plan again with each option's view of the memory model and keep the fastest simulated step that fits, the
   plan without offload included: never slower by construction. The plan records ``meta.offload_blocks`` (absent
   when none is kept).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace
from typing import Any, Callable, cast

import numpy as np

from dynmb.core.planspec import PlanSpec
from dynmb.core.types import Plan
from dynmb.costmodel.loader import Models
from dynmb.memory.coef import stage_block_count
from dynmb.packing.context import PackContext, PackingError
from dynmb.planning.search import Candidate, Planned, evaluate, fastest
from dynmb.timing import offload as timing_offload
from dynmb.timing.offload import HostLink, host_link

__all__ = ["plan_offload", "hiding_blocks", "binding_blocks", "HIDE_SHARES"]

log = logging.getLogger(__name__)

PlanFn = Callable[[PlanSpec, Models[Any]], Planned]

HIDE_SHARES = (1.0, 0.5)
"""The options step 2 weighs: the share of the op beside it that each copy may take (``hiding_blocks``)."""

_said_no_link: set[str] = set()


def plan_offload(spec: PlanSpec, models: Models[Any], plan_fn: PlanFn) -> Planned:
    """``plan_fn(spec, models)`` (the planner's step) under ``spec.offload`` (module doc); the plan keeps ``spec``."""
    plain_spec = spec.with_(offload="never")
    plain = plan_fn(plain_spec, models)
    if spec.offload != "auto":
        return plain
    plan = plain[0]
    link = host_link(models.cost)
    why = _no_offload(plan, models, link)
    if why:
        if why not in _said_no_link:
            _said_no_link.add(why)
            log.info("offload auto: nothing offloaded: %s", why)
        return _with_spec(plain, spec)
    assert link is not None
    options: dict[tuple[int, ...], str] = {}        # blocks per stage -> the option that chose them
    for share in HIDE_SHARES:
        hiding = hiding_blocks(plan, models, link, share)
        for cap, name in ((None, f"within {share:g} of an op"), (1, f"one block, within {share:g} of an op")):
            blocks = binding_blocks(plan, models.memory, hiding if cap is None else np.minimum(hiding, cap))
            if blocks.any():
                options.setdefault(tuple(int(b) for b in blocks), name)
    cands: list[Candidate[Planned]] = [Candidate("none", functools.partial(lambda made: made, plain))]
    cands += [Candidate(f"offload {name} {list(blocks_t)}",
                        functools.partial(_offloaded, plain_spec, models, plan_fn, blocks_t))
              for blocks_t, name in options.items()]
    outcomes = evaluate(cands)
    best = fastest(outcomes)
    log.debug("offload auto: %s", ", ".join(f"{o.name}: {o.score}" for o in outcomes))
    return _with_spec(cast(Planned, best.made), spec)


def _no_offload(plan: Plan, models: Models[Any], link: HostLink | None) -> str:
    """Why ``plan`` is not weighed with offload ('' where it is)."""
    if link is None:
        return f"the cost model ({type(models.cost).__name__}) has no host link (a CPU's host is its device)"
    if not hasattr(models.memory, "offloading"):
        return f"the memory model ({type(models.memory).__name__}) cannot offload"
    blocks = getattr(models.memory.model_cfg, "recompute_blocks", None)
    if blocks is not None:
        return (f"the layout recomputes leading blocks {list(blocks)} per stage (they keep only their inputs); "
                "offload counts blocks that save their activations")
    if plan.slice_groups():
        return "a plan with slices of long sequences keeps their carried keys and values on the device"
    if plan.recompute_mask().all():
        return "every microbatch recomputes: it keeps only its blocks' inputs"
    return ""


def _offloaded(spec: PlanSpec, models: Models[Any], plan_fn: PlanFn, blocks: tuple[int, ...]) -> Planned:
    """The step planned with ``blocks`` offloaded (the memory model's view), its meta recording them."""
    view = models.memory.offloading(blocks, timing_offload.in_transit())
    plan, sched, sim = plan_fn(spec, replace(models, memory=view))
    return replace(plan, meta=plan.meta.with_(offload_blocks=list(blocks))), sched, sim


def _with_spec(planned: Planned, spec: PlanSpec) -> Planned:
    plan, sched, sim = planned
    return replace(plan, spec=spec), sched, sim


def hiding_blocks(plan: Plan, models: Models[Any], link: HostLink, share: float = 1.0) -> np.ndarray:
    """``[P]``: per stage, the most leading blocks whose copies of ``plan``'s microbatches hide behind its ops,
    summed over them: reloads within ``share`` of the forwards, copies out within ``share`` of the backwards
    (module doc, step 2); 0 on the last stage, whose backward follows its forward at once."""
    mm, P = models.memory, plan.num_stages
    costs = models.cost.plan_costs(plan)
    fwd, bwd = np.asarray(costs["F"]).sum(axis=1), np.asarray(costs["B"]).sum(axis=1)
    reload_room, out_room = share * fwd, share * bwd
    shapes = plan.shapes()
    most = stage_block_count(mm.model_cfg, P)
    out = np.zeros(P, dtype=np.int64)
    for n in range(1, int(most.max()) + 1):
        moved = mm.offloading(np.minimum(n, most), timing_offload.in_transit()).offload_matrix(shapes[:, 0], shapes[:, 1],
                                                                   plan.recompute_mask()).sum(axis=1)
        hides = (moved / link.h2d_bytes_per_s <= reload_room) & (moved / link.d2h_bytes_per_s <= out_room)
        out = np.where(hides & (n <= most), n, out)
    out[-1] = 0
    return out


def binding_blocks(plan: Plan, memory_model: Any, most: np.ndarray) -> np.ndarray:
    """``[P]``: from none, one more block on the stage admitting the fewest tokens (``_stage_tokens``), while that
    stage may offload one more (``most``) and the block raises the tokens it admits (module doc, step 3)."""
    blocks = np.zeros(plan.num_stages, dtype=np.int64)
    rows = _stage_tokens(plan, memory_model, blocks)
    while rows is not None:
        stage = int(np.argmin(rows))
        if blocks[stage] >= most[stage]:
            break
        trial = blocks.copy()
        trial[stage] += 1
        more = _stage_tokens(plan, memory_model, trial)
        if more is None or more[stage] <= rows[stage]:
            break
        blocks, rows = trial, more
    return blocks


def _stage_tokens(plan: Plan, memory_model: Any, blocks: np.ndarray) -> np.ndarray | None:
    """Tokens one microbatch may hold on each stage alone with ``blocks`` offloaded: one-token rows under the tight
    budget (the row length's ``s^2`` term of dense attention left out); None where the limit is under a stage's
    states."""
    view = memory_model.offloading(blocks, timing_offload.in_transit())
    try:
        ctx = PackContext(view, plan.memory_limit_bytes, plan.num_stages, plan.schedule_kind,
                          virtual=int(plan.meta.virtual or 1))
    except PackingError:
        return None
    P = plan.num_stages
    out = np.empty(P)
    for i in range(P):
        caps = np.full(P, np.inf)
        caps[i] = ctx.caps[i]
        out[i] = float(view.max_rows(caps, [1], ctx.k, tight=True)[0])
    return out
