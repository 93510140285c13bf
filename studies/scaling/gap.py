"""Where a row's gap to ``ideal_s`` goes, for ``studies/scaling/scaling.py`` (``dynmb.timing.gap_terms``).

For the row's chosen kind, the slowest simulated replica (the one whose makespan is ``pred_step_s``,
as reordered and scheduled) is split against the row's ``ideal_s`` (the whole plan's, GEMMs saturated,
each chunk's work on its GPU, no split-backward drain dropped: ``plan_ideal_v``'s pricing) into
``gap_schedule`` (step - bound), ``gap_ends``, ``gap_split``, ``gap_replicas``, ``gap_overhead``,
``gap_padding``, ``gap_passes``, ``gap_shape``: seconds over ``ideal_s``, summing to ``gap_to_ideal``
(``dynmb.timing.gap_terms`` defines each); ``gap_rank`` is the GPU that decides the bound. ``terms_text`` writes
them for the summary's list of cells that miss the ideal criterion.
"""

from __future__ import annotations

import pandas as pd
from studies.scaling.virtual import ranks

from dynmb.timing.gap_terms import TERMS, gap_terms

__all__ = ["GAP_COLUMNS", "gap_columns", "terms_text"]

GAP_COLUMNS = tuple(f"gap_{t}" for t in TERMS)


def gap_columns(run, cm, cm_sat, virtual: int) -> dict:
    """The row's ``gap_<term>`` columns and ``gap_rank`` of ``run`` (``_scaling_sched.KindRun``, the kind kept)."""
    i = max(range(len(run.sims)), key=lambda k: run.sims[k].makespan_s)       # KindRun.worst: the first slowest
    t = gap_terms(run.plan, run.schedules[i], cm, run.sims[i].makespan_s, replica=run.subs[i], ideal_model=cm_sat,
                  ideal_rank=ranks(run.plan.num_stages, virtual), ideal_split=False).check()
    return {**t.fractions(), "gap_rank": t.rank}


def terms_text(row) -> str:
    """``; gap: schedule +3%, ends +1%, ...`` (the terms of at least 0.5% in size), or "" without the columns."""
    vals = [(c[len("gap_"):], getattr(row, c, None)) for c in GAP_COLUMNS]
    if any(v is None or pd.isna(v) for _, v in vals):
        return ""
    return "; gap: " + ", ".join(f"{n} {100 * v:+.0f}%" for n, v in vals if abs(v) >= 0.005)
