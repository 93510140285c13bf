"""``dynamic``'s weighing of the plain methods' sliced searches (on by default) and what keeps its plan time
down without changing a plan: candidates whose order-free dependency floor cannot beat the search's best so far
are not simulated, and the jobs of one ``plan_split`` share their simulations."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import dynmb.planning.slicing as slicing
from dynmb.core.config import ModelConfig, parse_bytes
from dynmb.core.planspec import PlanSpec
from dynmb.planning.planner import plan_step

TINY = ModelConfig.preset("tiny")
BATCH = np.array([3000, 2200, 60, 90, 120, 30, 500, 250, 40, 700, 80, 100], dtype=np.int64)
SPEC = PlanSpec(method="dynamic", num_stages=2, schedule_kind="1f1b", memory_limit_bytes=parse_bytes("16MiB"),
                oversize="split", recompute="auto")


def test_weighing_is_opt_in_and_can_be_turned_on_and_off(monkeypatch):
    assert not slicing.WEIGH_ALTERNATIVES       # off by default (its docstring says why)
    seen = []
    monkeypatch.setattr(slicing, "_weigh_alternatives", lambda job, found, cfg: seen.append(job.spec.method))
    with slicing.weighing_alternatives(False):
        plan_step(BATCH, SPEC, model_cfg=TINY)
    assert seen == [] and not slicing.WEIGH_ALTERNATIVES
    with slicing.weighing_alternatives():
        plan_step(BATCH, SPEC, model_cfg=TINY)
    assert seen == ["dynamic"]


@pytest.mark.parametrize("kind", ["1f1b", "zb"])
def test_pruning_and_shared_simulations_change_no_plan(monkeypatch, kind):
    """The same plan (microbatches, meta, predicted step) with every candidate simulated anew, and fewer
    simulations with the floor and the shared simulations; the floor never exceeds a simulated step."""
    spec = SPEC.with_(schedule_kind=kind)
    calls, floors = [], []
    real_sim, real_floor = slicing._SplitJob._simulate, slicing._SplitJob.floor

    def counted(job, plan):
        out = real_sim(job, plan)
        calls.append(out[0])
        floors.append(real_floor(job, plan))
        return out
    monkeypatch.setattr(slicing._SplitJob, "_simulate", counted)
    fast, _, fast_sim = plan_step(BATCH, spec, model_cfg=TINY)
    n_fast = len(calls)
    assert all(f <= t * (1 + 1e-9) for f, t in zip(floors, calls))
    fresh = itertools.count()
    monkeypatch.setattr(slicing._SplitJob, "floor", lambda job, plan: 0.0)
    monkeypatch.setattr(slicing, "_plan_key", lambda plan, spec: next(fresh))
    calls.clear()
    slow, _, slow_sim = plan_step(BATCH, spec, model_cfg=TINY)
    assert [repr(mb) for mb in fast.microbatches] == [repr(mb) for mb in slow.microbatches] and fast.meta == slow.meta
    assert fast_sim.makespan_s == slow_sim.makespan_s
    assert n_fast < len(calls)
