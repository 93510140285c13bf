"""``planner.final_settings``: the one list of ``dynamic``'s final-check alternatives, which the planner's check and
``studies/scaling/final.py`` (the scaling study's copy of the check) both plan. Before it the study kept its own
list (``FINAL_METHODS`` at the ranked budgets, no neighbours, no other method) and fell behind the Planner's."""

from __future__ import annotations

import numpy as np

from dynmb.costmodel.loader import Models
from dynmb.packing import METHODS
from dynmb.packing.balanced import budget_divisors
from dynmb.packing.context import PackContext
from dynmb.packing.methods import get_method
from dynmb.planning import planner as planner_module
from dynmb.schedule.kinds import get_kind

from tests.test_slices_weigh import SPEC, TINY


def test_the_check_plans_exactly_final_settings(monkeypatch):
    """The candidates ``_plan_final`` weighs are ``final_settings``' names and specs, in its order."""
    seen: list[tuple[list[str], list[str]]] = []
    real = planner_module.final_candidates

    def spy(job):
        out = real(job)
        listed = planner_module.final_settings(job.lengths, job.spec, job.kind, job.models)
        seen.append(([c.name for c in out], list(listed)))
        return out
    monkeypatch.setattr(planner_module, "final_candidates", spy)
    lengths = np.random.default_rng(1).integers(4, 40, 400)
    planner_module.plan_step(lengths, SPEC.with_(oversize="error", num_stages=4), model_cfg=TINY)
    assert seen and all(names == listed for names, listed in seen)


def test_final_settings_holds_the_neighbour_budgets_and_every_other_method():
    """``FINAL_METHODS`` at ``budget_divisors(..., neighbours=True)``, then each other registered method once at its own
    settings (a budget method's named ``/1``, mbs None); never ``dynamic`` itself."""
    stages = 4
    spec = SPEC.with_(oversize="error", num_stages=stages, schedule_kind="1f1b")
    models = Models.analytic(TINY, stages)
    lengths = np.random.default_rng(2).integers(20, 400, 300)
    kind = get_kind("1f1b")
    settings = planner_module.final_settings(lengths, spec, kind, models)
    divisors = budget_divisors(lengths, PackContext.from_spec(spec, models.memory, kind), models.cost,
                               round_to=spec.round_to, dp=spec.dp, keep=planner_module.FINAL_CHECK, neighbours=True)
    budgets = [f"{m}/{d}" for m in planner_module.FINAL_METHODS for d in divisors]
    assert list(settings)[:len(budgets)] == budgets
    assert all(settings[f"{m}/{d}"].method == m and settings[f"{m}/{d}"].mbs == d
               for m in planner_module.FINAL_METHODS for d in divisors)
    for m in METHODS:
        if m == "dynamic":
            continue
        name = f"{m}/1" if get_method(m).mbs == "budget divisor" else m
        assert name in settings and settings[name].method == m
    assert not any(s.method == "dynamic" for s in settings.values())
