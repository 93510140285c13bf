"""Planning ahead of training (``dynmb.runtime.planahead``): planner processes give the plans
in-line planning gives, errors come back to the step that needed the plan, and a 2-rank run
with ``plan_ahead`` trains the same microbatches as the same run planned in line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dynmb.core.config import ModelConfig, PipelineConfig, RunConfig
from dynmb.costmodel import get_cost_model
from dynmb.memory.model import get_memory_model
from dynmb.packing import PackingError
from dynmb.planning import plan_step
from dynmb.io.results import load_results
from dynmb.runtime.planahead import PlanAhead
from dynmb.runtime.planshare import PlanShare
from dynmb.runtime.spec import RunSpec
from tests.gloo_jobs import register
from dynmb.costmodel.loader import Models

LIMIT = 24 * 2**20


def _cfg(plan_ahead: int, steps: int = 3) -> RunConfig:
    return RunConfig(model=ModelConfig.preset("tiny"),
                     pipeline=PipelineConfig(num_stages=2, schedule="1f1b", memory_limit_bytes=LIMIT),
                     dataset="gsm8k", global_batch=8, method="dynamic", seed=5, steps=steps, warmup=1,
                     backend="gloo", device="cpu", timeout_s=60.0, plan_ahead=plan_ahead)


def _shapes(plan) -> list[tuple]:
    return [(mb.batch, mb.padded_len, tuple(mb.seq_ids.tolist())) for mb in plan.microbatches]


def test_planner_processes_give_the_in_line_plans():
    cfg = _cfg(plan_ahead=2)
    cm = get_cost_model(None, cfg.model, 2)
    mm = get_memory_model(None, cfg.model, 2)
    rng = np.random.default_rng(0)
    batches = [rng.integers(8, 200, size=8) for _ in range(4)]
    asked: list[int] = []

    def lengths_of(k: int) -> np.ndarray:
        asked.append(k)
        return batches[k]

    ahead = PlanAhead(2, lengths_of, 3, spec=cfg.plan_spec, model_cfg=cfg.model, memory_model=mm)
    try:
        for k in range(4):
            (plan, schedule, _), lengths, wait_s = ahead.get(k, cm)
            inline, _, _ = plan_step(batches[k], cfg.plan_spec, model_cfg=cfg.model, models=Models(cm, mm))
            assert _shapes(plan) == _shapes(inline) and np.array_equal(lengths, batches[k])
            assert schedule.num_microbatches == plan.num_microbatches and wait_s >= 0
            assert asked == list(range(min(k + 2, 3) + 1))     # k + n submitted, never past the last step
        with pytest.raises(RuntimeError, match="not submitted"):
            ahead.get(1, cm)
    finally:
        ahead.close()


def test_planner_error_reaches_the_step_that_needs_the_plan():
    cfg = _cfg(plan_ahead=1)
    mm = get_memory_model(None, cfg.model, 2)
    too_long = np.array([10, 10**6])          # cannot fit alone; oversize "error"
    ahead = PlanAhead(1, lambda k: too_long, 0, spec=cfg.plan_spec, model_cfg=cfg.model, memory_model=mm)
    try:
        with pytest.raises(PackingError):
            ahead.get(0, get_cost_model(None, cfg.model, 2))
    finally:
        ahead.close()


def test_shared_planning_each_rank_plans_its_own_steps():
    """Two ranks sharing one store: rank r plans the steps k with k mod 2 = r, reads the others', and
    gets the in-line plans; an owner's planning error is every rank's; read plans leave the store."""
    import torch.distributed as dist
    cfg = _cfg(plan_ahead=1)
    cm = get_cost_model(None, cfg.model, 2)
    mm = get_memory_model(None, cfg.model, 2)
    rng = np.random.default_rng(1)
    batches = [rng.integers(8, 200, size=8) for _ in range(4)] + [np.array([10, 10**6])]   # step 4 cannot fit
    store = dist.HashStore()
    ranks = [PlanAhead(1, batches.__getitem__, 4, spec=cfg.plan_spec, model_cfg=cfg.model, memory_model=mm,
                       share=PlanShare(store, r, 2, "run")) for r in (0, 1)]
    try:
        assert [a.window for a in ranks] == [2, 2]
        for k in range(4):
            owner, reader = ranks[k % 2], ranks[1 - k % 2]
            (plan, _, _), _, _ = owner.get(k, cm)
            (read, _, _), lengths, wait_s = reader.get(k, cm)
            inline, _, _ = plan_step(batches[k], cfg.plan_spec, model_cfg=cfg.model, models=Models(cm, mm))
            assert _shapes(read) == _shapes(plan) == _shapes(inline) and np.array_equal(lengths, batches[k])
            assert wait_s >= 0 and all(j % 2 == r for r, a in enumerate(ranks) for j in a._futures)
        assert store.num_keys() <= 1           # read plans are deleted; step 4's error may be published already
        for a in ranks:                        # step 4 (rank 0's) cannot be planned: both ranks raise it
            with pytest.raises(PackingError):
                a.get(4, cm)
        assert store.num_keys() == 0
    finally:
        for a in ranks:
            a.close()


def test_plan_ahead_is_bounded():
    with pytest.raises(ValueError, match="plan_ahead"):
        _cfg(plan_ahead=-1)


def _pa_cases(out: Path) -> list[RunSpec]:
    return [RunSpec.create(_cfg(n), out / f"pa-{n}", run_id=f"pa-{n}", verify=True, calibrate=False) for n in (0, 2)]


register(2)(_pa_cases)


@pytest.mark.dist
def test_run_planned_ahead_trains_the_in_line_microbatches(gloo_job):
    job = gloo_job(2)
    assert job.returncode == 0, job.errors
    inline, ahead = (load_results(job.out / f"pa-{n}") for n in (0, 2))
    assert ahead["steps"]["verified"].all() and list(ahead["steps"]["plan_ahead"]) == [2] * 4
    assert list(inline["steps"]["plan_ahead"]) == [0] * 4
    # in line, a step waits for its whole plan (the slowest rank's; plan_s is rank 0's)
    assert (inline["steps"]["plan_wait_s"] >= inline["steps"]["plan_s"]).all()
    assert (ahead["steps"]["plan_wait_s"] >= 0).all()
    # without calibration both plan every step with the same model: the same microbatches
    cols = ["step", "stage", "op", "mb", "batch", "padded_len"]
    a, b = (t["actions"].sort_values(cols)[cols].reset_index(drop=True) for t in (inline, ahead))
    assert a.equals(b)
    assert list(inline["steps"]["loss"]) == pytest.approx(list(ahead["steps"]["loss"]), rel=1e-6)
