"""Slices of long sequences with data parallelism (``--oversize split --dp 2``): the split planner
keeps each chain whole and in order on one replica, plans every token with every replica under
the limit, and real gloo runs (PP1 x DP2 on 2 ranks, PP2 x DP2 on 4) give the gradients of every
document run whole (``--verify``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dynmb.core.config import ModelConfig, PipelineConfig, RunConfig, parse_bytes
from dynmb.costmodel import get_cost_model
from dynmb.memory.model import get_memory_model
from dynmb.planning import make_schedule, replicas_of
from dynmb.planning.planner import plan_step
from dynmb.planning.spec_check import check_plan_spec
from dynmb.core.planspec import PlanSpec
from dynmb.io.results import load_results
from dynmb.runtime.spec import RunSpec
from dynmb.schedule import validate
from dynmb.timing.simulate import simulate
from dynmb.core.types import Microbatch, Plan, PlanError
from tests.gloo_jobs import register
from dynmb.costmodel.loader import Models

TINY = ModelConfig.preset("tiny")
TWO_LONG = np.array([40, 100, 2400, 70, 300, 25, 90, 150, 1800, 60, 33, 500], dtype=np.int64)
"""Two sequences longer than the longest row (2400 and 1800 tokens) beside ten short ones."""
CASES = {1: "25MiB", 2: "16MiB"}      # stages -> a limit under which both long sequences are sliced


def _chain_replicas(plan: Plan) -> dict[int, set[int]]:
    return {sid: {plan.replica_ids[i] for i in where} for sid, where in plan.slice_groups().items()}


@pytest.mark.parametrize("method", ["dynamic", "fixed", "packed"])
@pytest.mark.parametrize("stages", sorted(CASES))
@pytest.mark.parametrize("kind", ["1f1b", "zb"])
def test_split_with_dp_keeps_each_chain_on_one_replica_under_the_limit(method, stages, kind):
    limit = parse_bytes(CASES[stages])
    plan, sched, sim = plan_step(TWO_LONG, PlanSpec(method=method, num_stages=stages, dp=2, schedule_kind=kind,
                                                    memory_limit_bytes=limit, oversize="split", recompute="auto"),
                                 model_cfg=TINY)
    plan.validate(TWO_LONG)
    assert plan.dp == 2 and plan.real_tokens == TWO_LONG.sum()           # every token planned
    groups = plan.slice_groups()
    assert set(groups) == {2, 8} and all(len(w) >= 2 for w in groups.values())
    assert all(len(r) == 1 for r in _chain_replicas(plan).values())     # each chain whole on one replica
    replicas = replicas_of(plan)
    assert all(p.num_microbatches >= 1 for p in replicas)
    makespans = []
    for p in replicas:
        for sid, where in p.slice_groups().items():                      # in order, back to back
            offsets = [int(p.microbatches[i].offsets[p.microbatches[i].seq_ids == sid][0]) for i in where]
            assert offsets == sorted(offsets) and offsets[0] == 0, (sid, offsets)
    cm, mm = get_cost_model(None, TINY, stages), get_memory_model(None, TINY, stages)
    for p in replicas:                  # every replica scheduled and simulated: every GPU within the limit
        s = make_schedule(p, kind, models=Models(cm, mm))
        validate(s, p)
        r_sim = simulate(s, p, cm, mm)
        assert float(np.max(r_sim.peak_bytes_rank)) <= limit
        makespans.append(r_sim.makespan_s)
    assert max(plan.predictions["pred_peak_bytes"]) <= limit
    assert plan.predictions["pred_step_s"] == pytest.approx(max(makespans))   # the slowest replica's step
    validate(sched, replicas[0])
    assert sim.makespan_s == pytest.approx(makespans[0])


def test_split_with_dp_that_cannot_fill_every_replica_says_why():
    """One long sequence and nothing else cannot give two replicas a microbatch each."""
    with pytest.raises(ValueError, match=r"dp=2: 1 chain\(s\) .* every replica"):
        plan_step(np.array([2400]), PlanSpec(method="dynamic", num_stages=2, dp=2,
                                             memory_limit_bytes=parse_bytes("16MiB"), oversize="split",
                                             recompute="auto"), model_cfg=TINY)


def test_spec_check_admits_split_with_dp_and_still_refuses_kinds_without_slices():
    check_plan_spec(PlanSpec(num_stages=2, dp=2, oversize="split"))
    with pytest.raises(ValueError, match="--oversize split: the memory-aware schedule cannot run slices"):
        check_plan_spec(PlanSpec(num_stages=2, dp=2, oversize="split", schedule_kind="memory-aware"))


def test_replicas_of_a_plan_with_slices_may_differ_in_count_but_none_may_be_empty():
    lengths = np.array([300, 20, 30], dtype=np.int64)
    chain = [Microbatch([0], [150], 150, 1, offsets=[0], continued=[True]),
             Microbatch([0], [150], 150, 1, offsets=[150], continued=[False])]
    shorts = [Microbatch([1, 2], [20, 30], 30, 2)]
    Plan((*chain, *shorts), "dynamic", 2, 1 << 30, 3, dp=2, replica_ids=(0, 0, 1)).validate(lengths)
    with pytest.raises(PlanError, match="at least one microbatch"):
        Plan((*chain, *shorts), "dynamic", 2, 1 << 30, 3, dp=2, replica_ids=(0, 0, 0)).validate(lengths)
    with pytest.raises(PlanError, match="different data-parallel replicas"):
        Plan((*chain, *shorts), "dynamic", 2, 1 << 30, 3, dp=2, replica_ids=(0, 1, 1)).validate(lengths)
    whole = [Microbatch([0], [300], 300, 1), Microbatch([1], [20], 20, 1), Microbatch([2], [30], 30, 1)]
    with pytest.raises(PlanError, match="same number of microbatches"):
        Plan(tuple(whole), "dynamic", 2, 1 << 30, 3, dp=2, replica_ids=(0, 0, 1)).validate(lengths)


# --------------------------------------------------------------------------
# real gloo runs with --verify: PP1 x DP2 (2 ranks), PP2 x DP2 (4 ranks)
# --------------------------------------------------------------------------
GLOO = {2: (1, "25MiB"), 4: (2, "16MiB")}      # ranks -> (stages, limit); dp 2: at 25 MiB dynamic keeps packed's recomputed slices


def _dp_case(out: Path, ranks: int) -> list[RunSpec]:
    stages, limit = GLOO[ranks]
    trace = out / f"two-long-dp{ranks}.csv"
    trace.write_text("length\n" + "\n".join(str(x) for x in TWO_LONG) + "\n")
    cfg = RunConfig(model=TINY, pipeline=PipelineConfig(num_stages=stages, memory_limit_bytes=parse_bytes(limit)),
                    dataset=str(trace), global_batch=len(TWO_LONG), method="dynamic", dp=2, seed=0, steps=1,
                    warmup=0, backend="gloo", device="cpu", timeout_s=90.0, oversize="split", recompute="auto")
    cases = [RunSpec.create(cfg, out / f"slices-dp2-pp{stages}", verify=True, run_id=f"slices-dp2-pp{stages}")]
    if ranks == 2:                      # the same batch as a plan file (``dynmb run --plan``)
        plan, _, _ = plan_step(TWO_LONG, cfg.plan_spec, model_cfg=TINY)
        plan.save(out / "slices-dp2-plan.json")
        cases.append(RunSpec.create(cfg, out / "slices-dp2-plan", verify=True, run_id="slices-dp2-plan",
                                    plan=out / "slices-dp2-plan.json"))
    return cases


register(2)(lambda out: _dp_case(out, 2))
register(4)(lambda out: _dp_case(out, 4))


@pytest.mark.dist
@pytest.mark.parametrize("ranks", sorted(GLOO))
def test_split_with_dp_runs_verify_on_gloo(gloo_job, ranks):
    """Both long sequences sliced, each replica running its own schedule (their microbatch counts
    may differ); the gradients summed over the replicas equal every document run whole in one
    process (the runtime's --verify), every token trained, measured peaks within the limit."""
    job = gloo_job(ranks)
    assert job.returncode == 0, job.errors
    stages = GLOO[ranks][0]
    t = load_results(job.out / f"slices-dp2-pp{stages}")
    steps, acts = t["steps"], t["actions"]
    assert steps["verified"].all()
    assert (steps["real_tokens"] == TWO_LONG.sum()).all() and (steps["sliced"] == 2).all()
    assert set(acts["dp_rank"]) == {0, 1} and acts["stage"].nunique() == stages
    forwards = acts[(acts["op"] == "F") & (acts["stage"] == 0)]
    assert sum(forwards.groupby("dp_rank")["mb"].nunique()) == int(steps["num_microbatches"].iloc[0])
    mem = t["memory"]
    assert (mem["peak_bytes"] <= mem["limit_bytes"]).all()
    if ranks == 2:      # packed's recomputed slices, kept by dynamic: their backward's kept keys and values priced
        assert (mem["pred_peak_bytes"] >= mem["peak_bytes"]).all(), mem[["rank", "peak_bytes", "pred_peak_bytes"]]
        assert mem["pred_peak_bytes"].max() <= 1.04 * mem["peak_bytes"].max()
    # (not on 4 ranks: the CPU meter charges a backward the logits and input gradients of the oldest forward
    # still held, first in first out, so a chain's later slices, backwarded first, measure its first slices')
    if ranks == 2:                      # the same plan run from its file (dynmb run --plan)
        p = load_results(job.out / "slices-dp2-plan")["steps"]
        assert p["verified"].all() and (p["sliced"] == 2).all() and (p["real_tokens"] == TWO_LONG.sum()).all()
