"""The interleaved schedule's own fast makespan estimate (dynmb.timing.makespan_interleaved): the hand-checked
makespan of equal microbatches, the simulator's on random pipelines, its two sweeps, and the packers
planning an interleaved step with it (``virtual`` reaches the estimate)."""

from __future__ import annotations

import numpy as np
import pytest

import dynmb.timing.makespan_interleaved as mi
from dynmb.core.config import ModelConfig
from dynmb.timing.makespan import has_bound_regime, makespan, makespans
from dynmb.schedule.kinds import build_schedule, get_kind
from dynmb.timing.simulate import simulate_costs
from dynmb.core.planspec import PlanSpec
from dynmb.costmodel.loader import Models

SMALL = ModelConfig.preset("small")


def test_the_interleaved_kind_has_an_estimate_of_its_own():
    assert get_kind("interleaved").estimate_as == "interleaved"
    assert not has_bound_regime("interleaved") and has_bound_regime("1f1b") and not has_bound_regime("zb-h1")


@pytest.mark.parametrize("R,v,k", [(2, 2, 1), (2, 2, 3), (4, 2, 2), (4, 4, 1), (8, 2, 2), (3, 3, 2)])
def test_equal_microbatches_give_the_interleaved_makespan(R, v, k):
    """F = 1, B = 2 per chunk, no sends, m = k R: every GPU does v m (F + B) of work and the bubble is
    (R - 1)(F + B), a chunk's (docs/design.md, dynmb.timing.bounds): 3 (v m + R - 1). As 1F1B over the R v chunks
    (the estimate the kind had before) the same costs give 3 (m + R v - 1): a GPU's chunks in parallel."""
    S, m = R * v, k * R
    F, B = np.ones((S, m)), 2 * np.ones((S, m))
    want = 3 * (v * m + R - 1)
    assert makespan(F, B, 0.0, "interleaved", virtual=v) == pytest.approx(want)
    assert simulate_costs(build_schedule("interleaved", S, m, virtual=v), {"F": F, "B": B}, 0.0).makespan_s == \
        pytest.approx(want)
    assert makespan(F, B, 0.0, "1f1b") == pytest.approx(3 * (m + S - 1))


def _random(rng, R, v, m):
    S = R * v
    tok = rng.lognormal(0, 1.0, m)
    F = rng.uniform(0.8, 1.3, S)[:, None] * (tok + 0.1 * tok ** 2)
    B = rng.uniform(1.8, 2.4, S)[:, None] * F
    return F, B, rng.uniform(0, 0.3) * tok


def test_random_pipelines_match_the_simulator():
    """The estimate sweeps the builder's own order with the simulator's recurrence: the measured error
    on random pipelines (studies/interleaved/estimate.py, 200 of them) is 0 up to rounding,
    uneven last rounds (m not a multiple of R) and one microbatch included."""
    rng = np.random.default_rng(3)
    for _ in range(60):
        R, v = int(rng.choice([2, 3, 4, 8])), int(rng.choice([1, 2, 3, 4]))
        m = int(rng.integers(1, 6 * R + 1))
        F, B, comm = _random(rng, R, v, m)
        sim = simulate_costs(build_schedule("interleaved", R * v, m, virtual=v), {"F": F, "B": B}, comm).makespan_s
        assert makespan(F, B, comm, "interleaved", virtual=v) == pytest.approx(sim, rel=1e-9), (R, v, m)


def test_levels_and_scalar_sweep_agree(monkeypatch):
    """Pipelines of several sizes in one call: the merged level-by-level sweep and the op-by-op one."""
    rng = np.random.default_rng(4)
    R, v, sizes = 4, 2, [3, 8, 8, 13, 1]
    parts = [_random(rng, R, v, m) for m in sizes]
    F, B, comm = (np.concatenate([p[i] for p in parts], axis=-1) for i in range(3))
    levels = mi.interleaved_makespans(F, B, comm, np.array(sizes), v)
    monkeypatch.setattr(mi, "SCALAR_OPS", 10 ** 9)
    scalar = mi.interleaved_makespans(F, B, comm, np.array(sizes), v)
    assert levels == pytest.approx(scalar, rel=1e-12)
    one = [makespan(p[0], p[1], p[2], "interleaved", virtual=v) for p in parts]
    assert levels == pytest.approx(one, rel=1e-12)
    assert makespans(F, B, comm, sizes + [0], "interleaved", virtual=v)[-1] == 0.0
    with pytest.raises(ValueError, match="multiple of virtual"):
        makespans(F, B, comm, sizes, "interleaved", virtual=3)


def test_fold_chunks_sums_each_gpus_chunks():
    X = np.arange(12.0).reshape(6, 2)              # 6 chunks on 3 GPUs: chunk s on GPU s % 3
    assert mi.fold_chunks(X, 2).tolist() == [[6, 8], [10, 12], [14, 16]]
    assert mi.fold_chunks(X, 1) is X


@pytest.mark.parametrize("method,mbs", [("dynamic", None), ("balanced", 8)])
def test_the_packers_estimate_an_interleaved_plan_as_it_runs(method, mbs):
    """``pack`` under ``interleaved`` with 2 chunks per GPU reports the interleaved estimate of each replica
    (``virtual`` reaches the estimate), which is the simulated step of the schedule it runs."""
    from dynmb.costmodel import get_cost_model
    from dynmb.data import load_trace, sample_batch
    from dynmb.memory.model import get_memory_model
    from dynmb.packing import pack
    from dynmb.planning.replicas import make_schedule
    from dynmb.timing.simulate import comm_times, simulate

    S, v = 4, 2
    lengths = sample_batch(load_trace("sharegpt"), 96, 1)
    mm, cm = get_memory_model(None, SMALL, S), get_cost_model(None, SMALL, S)
    plan = pack(lengths, PlanSpec(method=method, num_stages=S, virtual=v, memory_limit_bytes=4 << 30,
                                  schedule_kind="interleaved", mbs=mbs), models=Models(cm, mm))
    sim = simulate(make_schedule(plan, "interleaved", virtual=v, models=Models(cm, mm)), plan, cm, mm)
    assert plan.num_microbatches > 4
    assert plan.predictions["est_makespan_s"] == pytest.approx(sim.makespan_s, rel=1e-6)
    cost = cm.plan_costs(plan)
    as_1f1b = makespan(cost["F"], cost["B"], comm_times(cm, plan), "1f1b")
    assert abs(as_1f1b / sim.makespan_s - 1) > 0.05        # what the kind was estimated as before
