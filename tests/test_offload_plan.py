"""Activation offload, the planning side: the memory view's bytes, the packer's admission, the copies' stall in the
simulator, ``offload="auto"`` never slower, the settings' errors (``dynmb.planning.offload``,
``dynmb.timing.offload``, ``MemoryModel.offloading``)."""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynmb.cli.flags import add_packing_flags, spec_from_flags
from dynmb.core.config import ModelConfig
from dynmb.core.planspec import PlanSpec
from dynmb.costmodel import AnalyticCostModel
from dynmb.costmodel.gpu import H100_SXM, GPUCostModel
from dynmb.costmodel.loader import Models
from dynmb.memory.coef import BUCKET_PADDING, stage_block_count
from dynmb.memory.model import MemoryModel
from dynmb.packing.context import PackContext
from dynmb.planning import offload as planning_offload
from dynmb.planning.planner import plan_step
from dynmb.schedule import build_schedule
from dynmb.timing.offload import OffloadCopies, host_link, in_transit, plan_copies
from dynmb.timing.simulate import simulate, simulate_costs

FAST = replace(H100_SXM, host_d2h_bytes_per_s=1e15, host_h2d_bytes_per_s=1e15)
"""A host link so fast that every copy hides: offload is then worth it wherever admission binds."""
MiB = 2**20


def _tiny_block_bytes() -> float:
    """Bytes per token one ``tiny`` block (gpt2, float32, ``auto`` attention) saves, counted by hand from
    ``dynmb.memory.coef.half_act_coef``'s formula: attention half = its LayerNorm's input and statistics
    (``e d + 8``) + the sublayer's input (``e d``) + q/k/v, the SDPA output and the logsumexp (``4 e d + 4 h``),
    the sublayer's two terms times ``1 + BUCKET_PADDING``; MLP half = LayerNorm (``e d + 8``) + fc input (``e d``)
    + GELU input and proj input (``2 e f``); less the stage's input (the first LayerNorm's, ``e d``), which the
    stage keeps for its backward."""
    e, d, f, h = 4, 64, 256, 4
    g = 1 + BUCKET_PADDING
    return (e * d + 8) + g * e * d + g * (4 * e * d + 4 * h) + (e * d + 8) + e * d + 2 * e * f - e * d


def test_offloading_moves_the_leading_blocks_bytes_by_hand() -> None:
    cfg = ModelConfig.preset("tiny")
    mm = MemoryModel.analytic(cfg, 2)
    assert list(stage_block_count(cfg, 2)) == [2, 2]
    view = mm.offloading([1, 0])
    block = _tiny_block_bytes()
    assert view.act_coef[0] == pytest.approx(mm.act_coef[0] - [0, block, 0])
    assert view.transient_coef[0] == pytest.approx(mm.transient_coef[0] + [0, block, 0])
    assert np.array_equal(view.act_coef[1], mm.act_coef[1]) and view.in_transit == in_transit() == 3
    # act_matrix: each op's own offloaded bytes plus three others in transit, at the batch's largest
    rows, plen = np.array([1, 2]), np.array([100, 300])
    act, tr = view.act_matrix(rows, plen)
    base_act, base_tr = mm.act_matrix(rows, plen)
    assert act[0] == pytest.approx(base_act[0] - block * rows * plen)
    assert tr[0] == pytest.approx(base_tr[0] + block * rows * plen + 3 * block * 600)
    assert view.offload_matrix(rows, plen)[0] == pytest.approx(block * rows * plen)
    # a recomputed microbatch moves its blocks' inputs only (e d per token each), the stage's input not
    assert view.offload_matrix([1], [100], [True])[0, 0] == 0.0
    assert mm.offloading([2, 0]).offload_matrix([1], [100], [True])[0, 0] == pytest.approx(4 * 64 * 100)
    assert view.offloading(None) is mm and view.offloading([1, 0]) is view
    assert mm.offloading([2, 0]).recomputing().transit_coef[0, 1] == pytest.approx(4 * 64)
    assert mm.embedding_last().offloading([1, 0]).transit_coef[0, 1] == pytest.approx(block)


DEEP = replace(ModelConfig.preset("llama-small"), name="llama-small-8", n_layers=8)
"""``llama-small`` with 8 layers: one block per stage at P 8, eight microbatches in flight on stage 0."""


def test_the_packer_admits_more_with_offload() -> None:
    mm = MemoryModel.analytic(DEEP, 8)
    plain = PackContext(mm, 160 * MiB, 8, "1f1b")
    lengths = [PackContext(mm.offloading([1] * n + [0] * (8 - n)), 160 * MiB, 8, "1f1b").max_len(4096)
               for n in range(5)]
    assert plain.max_len(4096) == lengths[0] and all(a < b for a, b in zip(lengths, lengths[1:]))
    assert lengths[3] > 1.5 * lengths[0]
    # offloading where only one microbatch is in flight costs room: the ones in transit sit beside it
    last = PackContext(mm.offloading([0] * 7 + [1]), 160 * MiB, 8, "1f1b")
    assert last.bmax([64])[0] <= plain.bmax([64])[0]


def test_a_reload_that_cannot_hide_is_charged_exactly() -> None:
    """2 stages, 1 microbatch, F = 1, B = 2 s: stage 0's copy out (3 s) starts when its forward ends, its reload
    (3 s) after that, so its backward waits until 1 + 3 + 3 = 7 s instead of 4 s: step 9 s, stall 3 s."""
    sched = build_schedule("1f1b", 2, 1)
    costs = {"F": np.ones((2, 1)), "B": 2 * np.ones((2, 1))}
    plain = simulate_costs(sched, costs)
    copies = OffloadCopies(np.array([[3.0], [0.0]]), np.array([[3.0], [0.0]]))
    slow = simulate_costs(sched, costs, offload=copies)
    assert plain.makespan_s == pytest.approx(6.0)
    assert slow.makespan_s == pytest.approx(9.0) and slow.extra["offload_stall_s"] == pytest.approx(3.0)


def test_a_forward_waits_for_the_copy_out_depth_forwards_back() -> None:
    """One copy out in flight (``out_depth=1``), 2 stages, 2 microbatches: stage 0's second forward starts when the
    first copy out (3 s) is done (stall 3 s), which delays the pipeline by 1 s (step 10 s against 9 s). Two in flight
    (the default), 3 stages: stage 0's first two forwards run at once, the third waits for the first copy out (done
    at 1 + 3 = 4 s; ready at 2 s: stall 2 s)."""
    sched = build_schedule("1f1b", 2, 2)
    costs = {"F": np.ones((2, 2)), "B": 2 * np.ones((2, 2))}
    copies = OffloadCopies(np.array([[3.0, 3.0], [0.0, 0.0]]), np.zeros((2, 2)), out_depth=1)
    assert simulate_costs(sched, costs).makespan_s == pytest.approx(9.0)
    res = simulate_costs(sched, costs, offload=copies)
    assert res.makespan_s == pytest.approx(10.0) and res.extra["offload_stall_s"] == pytest.approx(3.0)
    sched3 = build_schedule("1f1b", 3, 3)
    costs3 = {"F": np.ones((3, 3)), "B": 2 * np.ones((3, 3))}
    d2h = np.zeros((3, 3))
    d2h[0] = 3.0
    res3 = simulate_costs(sched3, costs3, offload=OffloadCopies(d2h, np.zeros((3, 3))))
    tl = res3.timeline
    starts = tl[(tl.stage == 0) & (tl.op == "F")].sort_values("mb").start_s.tolist()
    assert starts == pytest.approx([0.0, 1.0, 4.0]) and res3.extra["offload_stall_s"] == pytest.approx(2.0)


def test_copies_that_hide_cost_nothing() -> None:
    sched = build_schedule("1f1b", 4, 8)
    rng = np.random.default_rng(3)
    costs = {"F": rng.uniform(1, 2, (4, 8)), "B": rng.uniform(2, 4, (4, 8))}
    small = np.full((4, 8), 1e-3)
    small[-1] = 0.0                       # the last stage's backward follows its forward at once: nothing hides
    tiny = OffloadCopies(small, small)
    assert simulate_costs(sched, costs, offload=tiny).makespan_s == pytest.approx(simulate_costs(sched, costs).makespan_s)


def _models(cfg: ModelConfig, P: int, spec=FAST) -> Models:
    return Models(GPUCostModel(cfg, P, spec=spec), MemoryModel.analytic(cfg, P))


def test_auto_offloads_where_admission_binds_and_is_faster() -> None:
    cfg = DEEP
    models = _models(cfg, 8)
    lengths = np.random.default_rng(0).integers(16, 512, 64)
    spec = PlanSpec(num_stages=8, memory_limit_bytes=160 * MiB, schedule_kind="1f1b")
    never = plan_step(lengths, spec, model_cfg=cfg, models=models)
    auto = plan_step(lengths, spec.with_(offload="auto"), model_cfg=cfg, models=models)
    assert auto[0].meta.offload_blocks and auto[0].meta.offload_blocks[0] == 1 and auto[0].spec.offload == "auto"
    assert auto[2].makespan_s < 0.95 * never[2].makespan_s
    assert never[0].meta.offload_blocks is None and "offload_blocks" not in never[0].to_dict()["meta"]
    # the plan alone (its meta) tells the simulator what it offloads: the same step, bytes and copies
    again = simulate(auto[1], auto[0], models.cost, models.memory)
    assert again.makespan_s == pytest.approx(auto[2].makespan_s)
    assert np.allclose(again.peak_bytes, auto[2].peak_bytes) and again.fits
    unmarked = replace(auto[0], meta=auto[0].meta.without("offload_blocks"))
    assert again.peak_bytes[0] < simulate(auto[1], unmarked, models.cost, models.memory).peak_bytes[0]


def test_no_host_link_offloads_nothing_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    cfg = ModelConfig.preset("llama-small")
    models = Models(AnalyticCostModel(cfg, 4), MemoryModel.analytic(cfg, 4))
    assert host_link(models.cost) is None
    lengths = np.random.default_rng(0).integers(16, 512, 32)
    spec = PlanSpec(num_stages=4, memory_limit_bytes=120 * MiB, schedule_kind="1f1b")
    planning_offload._said_no_link.clear()
    with caplog.at_level(logging.INFO, logger="dynmb.planning.offload"):
        auto = plan_step(lengths, spec.with_(offload="auto"), model_cfg=cfg, models=models)
        plan_step(lengths, spec.with_(offload="auto"), model_cfg=cfg, models=models)
    never = plan_step(lengths, spec, model_cfg=cfg, models=models)
    assert auto[0].meta.offload_blocks is None and auto[2].makespan_s == never[2].makespan_s
    said = [r for r in caplog.records if "no host link" in r.getMessage()]
    assert len(said) == 1                                        # once
    assert plan_copies(models.memory.offloading([1, 0, 0, 0]), auto[0], models.cost) is None


def test_the_h100_pcie_link_hides_no_llama_block_at_p16() -> None:
    """One Llama-2-7B block's saved bytes per token (about 190 KB) take 3.8 us each way at 50 GB/s, more than the
    forward and backward of a whole two-block stage: nothing hides, nothing is offloaded."""
    cfg = ModelConfig.preset("llama2-7b")
    models = _models(cfg, 16, H100_SXM)
    link = host_link(models.cost)
    assert link is not None and link.h2d_bytes_per_s == 50e9
    lengths = np.full(512, 1000)
    spec = PlanSpec(num_stages=16, memory_limit_bytes=24 * 2**30, schedule_kind="1f1b")
    plan = plan_step(lengths, spec, model_cfg=cfg, models=models)[0]
    assert not planning_offload.hiding_blocks(plan, models, link).any()


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1", "auto"])
@given(seed=st.integers(0, 10_000), P=st.sampled_from([2, 3, 4]), limit_mib=st.integers(60, 200))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_auto_is_never_slower_and_fits_with_the_bytes_in_transit(kind: str, seed: int, P: int,
                                                                  limit_mib: int) -> None:
    cfg = ModelConfig.preset("llama-small")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, 400, int(rng.integers(8, 48)))
    link = FAST if seed % 2 else replace(H100_SXM, host_d2h_bytes_per_s=2e9, host_h2d_bytes_per_s=2e9)
    models = _models(cfg, P, link)
    spec = PlanSpec(num_stages=P, memory_limit_bytes=limit_mib * MiB, schedule_kind=kind)
    try:
        never = plan_step(lengths, spec, model_cfg=cfg, models=models)
    except ValueError:
        return
    plan, sched, sim = plan_step(lengths, spec.with_(offload="auto"), model_cfg=cfg, models=models)
    assert sim.makespan_s <= never[2].makespan_s * (1 + 1e-12)
    plan.validate()
    if never[2].fits:
        assert sim.fits
    blocks = plan.meta.offload_blocks
    if blocks:
        assert len(blocks) == P and all(0 <= b <= n for b, n in zip(blocks, stage_block_count(cfg, P)))
        view = models.memory.offloading(blocks, in_transit())
        act, tr = view.act_matrix(plan.shapes()[:, 0], plan.shapes()[:, 1], plan.recompute_mask())
        moved = view.offload_matrix(plan.shapes()[:, 0], plan.shapes()[:, 1], plan.recompute_mask())
        base_tr = models.memory.act_matrix(plan.shapes()[:, 0], plan.shapes()[:, 1], plan.recompute_mask())[1]
        assert np.allclose(tr, base_tr + moved + in_transit() * moved.max(axis=1, keepdims=True))
        assert np.all(sim.peak_bytes <= plan.memory_limit_bytes)


def test_settings_errors() -> None:
    with pytest.raises(ValueError, match="offload must be never or auto"):
        PlanSpec(offload="always")
    mm = MemoryModel.analytic(ModelConfig.preset("tiny"), 2)
    with pytest.raises(ValueError, match="offload_blocks must hold one count >= 0 per stage"):
        mm.offloading([1])
    with pytest.raises(ValueError, match="offload_blocks"):
        mm.offloading([-1, 0])
    parser = argparse.ArgumentParser()
    add_packing_flags(parser)
    assert spec_from_flags(parser.parse_args(["--offload", "auto"])).offload == "auto"
    assert spec_from_flags(parser.parse_args([])).offload == "never"
    with pytest.raises(SystemExit):
        parser.parse_args(["--offload", "sometimes"])


def test_the_planner_takes_offload_and_plans_as_plan_step() -> None:
    """``Planner(offload="auto")`` is ``PlanSpec.offload``: the same offloading plan and step as ``plan_step``; fails
    where the keyword is dropped (no offload_blocks) or refused."""
    from dynmb import Planner
    models = _models(DEEP, 8)
    lengths = np.random.default_rng(0).integers(16, 512, 64)
    planner = Planner(model=DEEP, num_stages=8, memory_limit=160 * MiB, cost_model=models.cost,
                      memory_model=models.memory, schedule="1f1b", offload="auto")
    step = planner.plan(lengths)
    direct = plan_step(lengths, planner.spec, model_cfg=DEEP, models=models)
    assert planner.spec.offload == "auto" and step.plan.meta.offload_blocks == direct[0].meta.offload_blocks
    assert step.plan.meta.offload_blocks and step.plan.meta.offload_blocks[0] >= 1
    assert step.sim.makespan_s == pytest.approx(direct[2].makespan_s)
