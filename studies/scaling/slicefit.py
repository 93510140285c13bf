"""``--slice-fitting auto`` in ``studies/scaling/scaling.py``: the ``dynamic`` row weighed, after the Planner's final
check (``_scaling_final``), against plans that slice sequences which fit (``dynmb.planning.slice_fitting``).

For each kind the row's ``--schedule`` weighs that runs slices (``auto``: 1f1b, zb-h1, zb), the batch is cut
as ``--oversize`` cuts it for that kind (``truncate``: at the kind's longest row, ``slicing.longest_row``, as the
packers cut; ``drop``: the longer ones out; ``error``: none longer) and planned by the library's
``plan_threshold`` at each of its thresholds (the longest row / 2, / 4): every sequence longer than the
threshold a chain of slices, the rest packed by ``dynamic``, EVERY replica scheduled and simulated (not only
the ``--sim-replicas`` slowest), within the limit per GPU. The fastest such plan replaces the row's plan
if its predicted step (the slowest replica's) is strictly shorter (by more than 1e-9 relative).

Columns: ``slice_threshold`` (the threshold of the plan kept; empty: the row's own plan stays), ``sliced``
(sequences sliced), ``slice_step_s`` (the fastest fitting-slice plan's step, kept or not), ``slice_fitting_s``
(CPU s of this check, added to ``plan_s``). A replaced row's step columns are the new plan's:
``pred_step_s``, ``schedule``, ``ideal_s`` / ``ideal_dynmb_s`` (``plan_ideal_v``: whole sequences), the gap to
ideal, ``attainable`` / ``efficiency`` / ``tokens_per_s`` of its kept tokens at its step, ``real_tokens``,
``truncated``, ``dropped``, ``num_microbatches`` (per replica), ``padding_fraction``,
``pred_peak_over_limit``; ``mean_bubble`` is replica 0's; ``bound_s``, ``gap_to_bound``, ``ideal_whole_s`` and
the ``gap_<term>`` columns (``_scaling_gap``) are left empty (``plan_split`` keeps no bound of its slowest replica).
"""

from __future__ import annotations

import time

import numpy as np
from studies.scaling.gap import GAP_COLUMNS
from studies.scaling.sched import kinds_for
from studies.scaling.virtual import plan_ideal_v, real_flops, real_work

from dynmb.packing import PackingError
from dynmb.planning.slice_fitting import plan_threshold, thresholds
from dynmb.planning.slicing import longest_row
from dynmb.core.planspec import PlanSpec
from dynmb.schedule.kinds import get_kind
from dynmb.costmodel.loader import Models

__all__ = ["slice_check"]


def _cut(batch: np.ndarray, cap: int, oversize: str) -> tuple[np.ndarray, dict] | None:
    """(kept tokens per sequence, the base meta) of ``batch`` under ``oversize`` at ``cap``; None: ``error``
    with a sequence longer than ``cap``."""
    over = np.flatnonzero(batch > cap)
    if oversize == "truncate":
        return np.minimum(batch, cap), {"truncated": over.tolist(), "longest_fitting_length": cap}
    if oversize == "drop":
        return np.where(batch > cap, 0, batch), {"dropped": over.tolist(), "longest_fitting_length": cap}
    return (None if over.size else (batch, {"longest_fitting_length": cap}))


def slice_check(cell, c: dict, row: dict) -> dict:
    """``row`` (the ``dynamic`` row after the final check), or with ``--slice-fitting auto`` the faster plan with
    fitting slices (module doc)."""
    if c.get("slice_fitting", "never") != "auto":
        return row
    t0 = time.process_time()
    cfg, cm, cm_sat, mm = cell.models(c["stage_split"], c)
    V, P, limit = cell.V, int(c["num_stages"]), int(c["memory_limit_bytes"])
    best = None
    for kind in kinds_for(c["schedule_key"], V):
        if not get_kind(kind).slices:
            continue
        spec = PlanSpec(method="dynamic", num_stages=P * V, virtual=V, schedule_kind=kind, reorder="auto",
                        memory_limit_bytes=limit, dp=int(c["dp"]), oversize=c["oversize"], slice_fitting="auto",
                        attention=cfg.attention)
        cap = longest_row(spec, cfg, mm)
        got = _cut(cell.batch, cap, c["oversize"])
        if got is None:
            continue
        cut, meta = got
        for t in thresholds(cap, int(cut.max()), spec.round_to):
            try:
                plan, _, sim = plan_threshold(cell.batch, cut, meta, spec, t, kind=get_kind(spec.schedule_kind),
                                              model_cfg=cfg, models=Models(cm, mm))
            except PackingError:
                continue
            step = float(plan.predictions["pred_step_s"])
            if best is None or step < best[0]:
                best = (step, plan, sim, kind, cut)
    check_s = time.process_time() - t0
    out = {**row, "slice_threshold": None, "sliced": 0, "slice_step_s": None if best is None else best[0],
           "slice_fitting_s": check_s, "plan_s": row["plan_s"] + check_s}
    out["plan_over_step"] = out["plan_s"] / out["pred_step_s"]
    if best is None or not best[0] < row["pred_step_s"] * (1 - 1e-9):
        return out
    step, plan, sim, kind, cut = best
    lengths = cut[cut > 0]
    ideal = plan_ideal_v(plan, cm_sat, V)
    out.update(pred_step_s=step, schedule=kind, ideal_s=ideal, ideal_dynmb_s=plan_ideal_v(plan, cm, V),
               ideal_whole_s=None, bound_s=None, gap_to_bound=None, gap_to_ideal=step / ideal - 1, gap_rank=None,
               **dict.fromkeys(GAP_COLUMNS),
               attainable=real_work(cm_sat, lengths, int(c["dp"])) / (P * step),
               efficiency=real_flops(cfg, P * V, lengths) / (int(c["dp"]) * P * step * cm.spec.peak_flops),
               mean_bubble=sim.mean_bubble, padding_fraction=plan.padding_fraction,
               num_microbatches=plan.num_microbatches // plan.dp, real_tokens=plan.real_tokens,
               tokens_per_s=plan.real_tokens / step, truncated=len(plan.meta.get("truncated", [])),
               dropped=len(plan.meta.get("dropped", [])), plan_over_step=out["plan_s"] / step,
               pred_peak_over_limit=max(plan.predictions["pred_peak_bytes"]) / limit,
               slice_threshold=int(plan.meta["slice_threshold"]), sliced=len(plan.meta["sliced"]))
    return out
