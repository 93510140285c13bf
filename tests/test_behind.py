"""``dynamic`` never behind a plain method (issue 39): the three screens that left it behind on the long-document
cells (``studies/slicing/README.md``, the ninth and tenth sessions) each with a case that fails on the code before:
the final check's budgets (``budget_divisors``' neighbours), the kind screen (``KIND_SCREEN``) and the alternatives'
screen at the longer slice lengths (``slicing._centres``: every placement). The three cells themselves are checked by
``studies/slicing/test_behind_cells.py`` (slow; the package's suite imports no study)."""

from __future__ import annotations


import numpy as np
import pytest

import dynmb.planning.slicing as slicing
from dynmb.costmodel.loader import Models
from dynmb.packing.balanced import budget_divisors
from dynmb.packing.context import PackContext
from dynmb.planning import planner as planner_module
from dynmb.planning.replicas import make_schedule
from dynmb.schedule.kinds import get_kind

from tests.test_slices_weigh import BATCH, SPEC, TINY

def _ctx_models(lengths: np.ndarray, stages: int):
    spec = SPEC.with_(method="balanced", num_stages=stages, oversize="error")
    models = Models.analytic(TINY, stages)
    return PackContext.from_spec(spec, models.memory, get_kind("1f1b")), models


@pytest.mark.parametrize("stages", [2, 4])
def test_budget_divisors_neighbours_add_each_kept_divisors_neighbours(stages):
    """``neighbours=True``: the kept divisors and each one's neighbours (x 2, / 2) among the distinct budgets, in
    order; the kept ones are still there."""
    lengths = np.random.default_rng(stages).integers(20, 400, 300)
    ctx, models = _ctx_models(lengths, stages)
    kept = budget_divisors(lengths, ctx, models.cost, keep=3)
    every = budget_divisors(lengths, ctx, models.cost, keep=64)
    near = budget_divisors(lengths, ctx, models.cost, keep=3, neighbours=True)
    assert set(kept) <= set(near) <= set(every) and near == sorted(near)
    at = {every.index(d) for d in kept}
    assert near == [every[i] for i in sorted({j for i in at for j in (i - 1, i, i + 1) if 0 <= j < len(every)})]


def test_the_final_check_weighs_the_ranked_budgets_neighbours(monkeypatch):
    """Where the fast estimate keeps the first, third and fourth budgets (as 1, 4, 8 on P 16 longtail
    Llama-3.1-8B), the final check weighs ``balanced`` and ``token-budget`` at the second too (``balanced/2`` won
    there). Fails on the code before (it weighed the three kept ones only)."""
    real = budget_divisors
    every: list[int] = []

    def ranked(lens, ctx, cost, **kw):
        every[:] = real(lens, ctx, cost, **{k: v for k, v in kw.items() if k not in ("neighbours", "keep")}, keep=64)
        at = {0, 2, 3} | ({1, 4} if kw.get("neighbours") else set())
        return [every[i] for i in sorted(at) if i < len(every)]
    names: list[str] = []
    real_candidates = planner_module.final_candidates

    def seen(job):
        out = real_candidates(job)
        names.extend(c.name for c in out)
        return out
    monkeypatch.setattr(planner_module, "budget_divisors", ranked)
    monkeypatch.setattr(planner_module, "final_candidates", seen)
    lengths = np.random.default_rng(0).integers(4, 40, 600)
    planner_module.plan_step(lengths, SPEC.with_(oversize="error", num_stages=4), model_cfg=TINY)
    assert len(every) >= 4                                                   # the case as constructed
    assert {f"{m}/{every[1]}" for m in planner_module.FINAL_METHODS} <= set(names)


def test_a_kind_whose_own_sliced_step_is_16_percent_out_is_weighed():
    """The kind screen weighs a kind 15.9% above the fastest kind's own sliced step (P 8 pycode Llama-3.1-8B: ``zb``,
    where ``fixed`` won) and 7.5% (P 16 pycode Llama-2-7B); one further out is not. Fails at the 5% screen."""
    own = {"zb-h1": (10.5475, True), "zb": (12.2219, True), "1f1b": (10.5475 * 1.3, True)}
    assert slicing.kinds_to_weigh(own) == {"zb-h1", "zb"}
    assert "zb" in slicing.kinds_to_weigh({"zb-h1": (6.1242, True), "zb": (6.5849, True)})


def test_the_screen_tries_the_longer_slice_lengths_in_every_placement():
    """``_centres``: each slice length longer than dynamic's best is tried in every placement (``fixed`` won at
    7153-token slices spread on P 8 pycode Llama-3.1-8B, dynamic's best 1788: ranked there at 14306 chains first
    only, 19% slow). Fails on the screen that tried them with the chains first only."""
    spec = SPEC.with_(schedule_kind="zb")
    job = slicing._split_job(BATCH, spec, get_kind("zb"), TINY, Models.analytic(TINY, spec.num_stages), make_schedule,
                             None)
    found = slicing._search_anew(job)
    assert found.best is not None
    own_len = int(found.best[1].meta["slice_len"])
    longer = [c for c in slicing._centres(job, found) if c.slice_len > own_len]
    assert longer                                                            # the case: a longer slice length
    assert all(set(c.placements) == set(slicing.PLACEMENTS) for c in longer)
