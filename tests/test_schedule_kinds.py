"""The registry of schedule kinds: a kind added by one file's worth of code plus one registry call
is built, validated, simulated, packed and planned for, and run on 2 gloo ranks.

The kind here, ``lifo-test``, is GPipe whose backwards run last-in first-out (every stage runs
its forwards in microbatch order, then its backwards from the last microbatch down). It is
written the way a contributor adds a kind (``docs/design.md``, "Extending dynmb"): a builder
taking ``BuildInputs`` and a ``ScheduleKind`` record of its traits, then ``register_kind``.
The workers of the gloo job register it by importing this module: the case names
``LifoHooks`` (below) as its step hooks, which every rank builds.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from dynmb import Planner
from dynmb.core.config import ModelConfig, PipelineConfig, RunConfig
from dynmb.costmodel import get_cost_model
from dynmb.memory.model import MemoryModel
from dynmb.planning import plan_step
from dynmb.io.results import load_results
from dynmb.runtime.hooks import NoHooks
from dynmb.runtime.spec import HookRef, RunSpec
from dynmb.schedule import (SCHEDULE_KINDS, BuildInputs, ScheduleKind, build_schedule, get_kind, register_kind,
                            validate)
from dynmb.timing.simulate import simulate, simulate_costs
from dynmb.core.types import Action, Schedule
from dynmb.core.planspec import PlanSpec
from tests.gloo_jobs import register
from tests.runtime_faults import REPO
from dynmb.costmodel.loader import Models


# --- the new kind: one file's worth of code ---------------------------------------------------------
def lifo(inp: BuildInputs) -> Schedule:
    """Every forward in microbatch order, then every backward from the last microbatch down."""
    P, m = inp.num_stages, inp.num_microbatches
    ranks = [[Action(s, "F", j) for j in range(m)] + [Action(s, "B", j) for j in reversed(range(m))]
             for s in range(P)]
    return Schedule(ranks, P, m, kind="lifo-test")


LIFO = ScheduleKind(name="lifo-test", build=lifo, window=None, estimate_as="gpipe")
register_kind(LIFO, replace=True)      # the one registry line (replace: this module may be imported twice)


class LifoHooks(NoHooks):
    """Step hooks that change nothing: naming them makes every worker import this module."""


# --- build, validate, simulate ----------------------------------------------------------------------
def test_registered_kind_is_known_everywhere():
    assert "lifo-test" in SCHEDULE_KINDS and get_kind("lifo-test") is LIFO
    with pytest.raises(ValueError, match="lifo-test"):         # the unknown-kind error lists it
        get_kind("no-such-kind")


@pytest.mark.parametrize("P,m", [(1, 1), (2, 5), (4, 3), (3, 8)])
def test_build_validate_simulate(P, m):
    sched = build_schedule("lifo-test", P, m)
    validate(sched)
    assert [str(a) for a in sched.ranks[0][m:]] == [f"0B{j}" for j in reversed(range(m))]
    ones = np.ones((P, m))
    sim = simulate_costs(sched, {"F": ones, "B": ones})
    # unit costs, free sends: the forwards fill in m + P - 1, the last microbatch's backward runs
    # first on the last stage, so the backwards drain in m + P - 1 as well
    assert sim.makespan_s == pytest.approx(2 * (m + P - 1))
    with pytest.raises(ValueError, match="virtual"):
        build_schedule("lifo-test", P, m, virtual=2)


def test_plan_step_packs_and_simulates_for_the_new_kind():
    cfg = ModelConfig.preset("tiny")
    cm, mm = get_cost_model(None, cfg, 2), MemoryModel.analytic(cfg, 2)
    lengths = np.random.default_rng(0).integers(16, 200, size=12)
    limit = 64 * 2**20
    plan, sched, sim = plan_step(lengths, PlanSpec(method="dynamic", num_stages=2, memory_limit_bytes=limit,
                                                   schedule_kind="lifo-test"), model_cfg=cfg, models=Models(cm, mm))
    assert plan.schedule_kind == "lifo-test" and sched.kind == "lifo-test"
    validate(sched, plan)
    again = simulate(sched, plan, cm, mm)
    assert again.makespan_s == pytest.approx(plan.predictions["pred_step_s"])
    assert np.all(again.peak_bytes <= limit)
    # a window of every microbatch (window=None): the packer's peak holds the whole batch
    shapes = plan.shapes()
    act, tr = mm.act_matrix(shapes[:, 0], shapes[:, 1])
    assert np.all(np.asarray(plan.predictions["pred_peak_bytes"]) >= mm.state_bytes + act.sum(axis=1))
    step = Planner(model=cfg, num_stages=2, memory_limit=limit, schedule="lifo-test").plan(lengths, "fixed")
    assert step.schedule.kind == "lifo-test" and step.sim.fits


# --- run on 2 gloo ranks (a case of the session's shared 2-rank job) --------------------------------
def _cases(out: Path) -> list[RunSpec]:
    # workers import this module through the hooks: the repository must be importable there
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(REPO) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), *paths]))
    cfg = RunConfig(model=ModelConfig.preset("tiny"),
                    pipeline=PipelineConfig(num_stages=2, schedule="lifo-test", memory_limit_bytes=24 * 2**20),
                    dataset="gsm8k", global_batch=8, method="dynamic", steps=1, warmup=0, backend="gloo",
                    device="cpu", timeout_s=60.0)
    return [RunSpec.create(cfg, out / "kind-lifo", verify=True, run_id="kind-lifo",
                           hooks=HookRef(target=f"{__name__}:LifoHooks"))]


register(2)(_cases)


@pytest.mark.dist
def test_new_kind_runs_on_two_gloo_ranks(gloo_job):
    job = gloo_job(2)
    assert job.returncode == 0, job.errors
    t = load_results(job.out / "kind-lifo")
    assert t["steps"]["verified"].all()
    acts = t["actions"]
    m = int(t["steps"]["num_microbatches"].iloc[0])
    stage0_b = acts[(acts["stage"] == 0) & (acts["op"] == "B")].sort_values("start_s")["mb"].tolist()
    assert stage0_b == list(reversed(range(m)))
