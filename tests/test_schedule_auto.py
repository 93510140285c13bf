"""``--schedule auto``: per step, the fastest predicted of the kinds ``auto_kinds`` admits that fits.

Property: on random batches, auto's predicted step is no slower than any fixed kind's that fits,
and every kind's prediction auto records is the one ``plan_step`` gives for that kind alone
(auto plans each kind as that kind is planned: packed for it, ordered and scheduled for it).
End to end: a ``dynmb run --schedule auto`` case on 2 gloo ranks, gradients verified, records
the chosen kind per step and runs that kind's schedule.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynmb.core.config import ModelConfig, PipelineConfig, RunConfig
from dynmb.costmodel import AnalyticCostModel
from dynmb.memory.model import MemoryModel
from dynmb.packing import pack
from dynmb.planning import make_schedule, plan_step
from dynmb.core.planspec import PlanSpec
from dynmb.io.results import load_results
from dynmb.runtime.spec import RunSpec
from dynmb.schedule.kinds import AUTO, auto_kinds, get_kind, is_schedule_name, kind_names, resolve_kind
from tests.gloo_jobs import register
from dynmb.costmodel.loader import Models

TINY = ModelConfig.preset("tiny")


def _models(P: int):
    mm = MemoryModel.analytic(TINY, P)
    return mm, AnalyticCostModel(TINY, P), int(mm.state_bytes.max() * 6)


def test_auto_kinds_follow_the_registry():
    assert auto_kinds(1) == tuple(k for k in ("1f1b", "zb-h1", "zb") if get_kind(k).auto)
    assert auto_kinds(2) == ("zb-v",) and auto_kinds(2, slices=True) == ("interleaved",)   # one placement each
    assert auto_kinds(4) == ("interleaved",)                    # zb-v runs exactly 2 chunks per rank
    assert auto_kinds(1, slices=True) == auto_kinds(1)          # slices run on every auto kind
    assert auto_kinds(2, slices=True) == ("interleaved",)
    assert is_schedule_name(AUTO) and is_schedule_name("zb") and not is_schedule_name("lifo")
    with pytest.raises(ValueError, match="no chosen kind"):
        resolve_kind(AUTO, object())


def test_kinds_of_one_packing_key_pack_alike():
    """auto packs once per packing key: the packers must give those kinds the same plan. Each zero-bubble
    kind has an estimate of its own (dynmb.timing.makespan_zb), so a key of its own."""
    mm, cm, limit = _models(4)
    lengths = np.random.default_rng(3).integers(8, 900, 48)
    assert len({get_kind(k).packing_key for k in auto_kinds(1)}) == 3
    assert [get_kind(k).estimate_as for k in ("1f1b", "zb-h1", "zb")] == ["1f1b", "zb-h1", "zb"]
    alike = [k for k in kind_names() if get_kind(k).packing_key == get_kind("1f1b").packing_key]
    assert "memory-aware" in alike                    # 1F1B's window and estimate
    plans = [pack(lengths, PlanSpec(method="dynamic", num_stages=4, schedule_kind=k, memory_limit_bytes=limit),
                  models=Models(cm, mm)) for k in ("1f1b", "memory-aware")]
    for p in plans[1:]:
        assert [(mb.seq_ids.tolist(), mb.row_ids.tolist(), mb.padded_len) for mb in p.microbatches] == \
            [(mb.seq_ids.tolist(), mb.row_ids.tolist(), mb.padded_len) for mb in plans[0].microbatches]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), n=st.integers(2, 40), P=st.sampled_from([2, 4]),
       method=st.sampled_from(["dynamic", "sorted", "balanced"]), dp=st.sampled_from([1, 2]))
def test_auto_is_never_slower_than_a_fixed_kind(seed, n, P, method, dp):
    mm, cm, limit = _models(P)
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(5.0, 1.0, max(n, dp)).astype(np.int64) + 1, 1500)
    spec = PlanSpec(method=method, num_stages=P, memory_limit_bytes=limit, reorder="auto", dp=dp,
                    schedule_kind=AUTO)
    plan, sched, sim = plan_step(lengths, spec, model_cfg=TINY, models=Models(cm, mm))
    assert plan.spec.schedule_kind == AUTO and plan.schedule_kind in auto_kinds(1)
    assert sched.kind == plan.schedule_kind
    chosen = plan.predictions["pred_step_s"]
    scores = plan.meta["schedule_auto"]
    # every kind, and for dynamic zb on zb-h1's packing and ramped (issue 39: "zb@zb-h1", "zb+ramp ...")
    assert set(auto_kinds(1)) <= set(scores) and all(k.partition("@")[0].partition("+")[0] in auto_kinds(1)
                                                     for k in scores)
    assert method == "dynamic" or set(scores) == set(auto_kinds(1))
    for kind in auto_kinds(1):
        fixed, _, fsim = plan_step(lengths, spec.with_(schedule_kind=kind), model_cfg=TINY, models=Models(cm, mm))
        assert scores[kind] == pytest.approx(fixed.predictions["pred_step_s"], rel=1e-12)
        if fsim.fits and np.all(np.asarray(fixed.predictions["pred_peak_bytes"]) <= limit):
            assert chosen <= fixed.predictions["pred_step_s"] * (1 + 1e-12), (kind, scores)
    assert any(chosen == pytest.approx(v, rel=1e-12) for k, v in scores.items()
               if k.partition("@")[0].partition("+")[0] == plan.schedule_kind)
    # every replica's schedule is built for the chosen kind from the spec's "auto"
    replica = plan.replica(dp - 1) if dp > 1 else plan
    again = make_schedule(replica, AUTO, models=Models(cm, mm))
    assert again.kind == plan.schedule_kind


def test_auto_with_two_chunks_per_rank_is_zb_v_unless_slices_may_run():
    """At virtual 2 auto weighs one placement for every step of a run: ZB-V's V where no slices may run, the
    loop placement (interleaved) where they may (``oversize="split"``), even on a step that holds none."""
    mm, cm, limit = _models(4)
    lengths = np.random.default_rng(1).integers(8, 600, 24)
    spec = PlanSpec(method="dynamic", num_stages=4, virtual=2, memory_limit_bytes=limit, reorder="auto",
                    schedule_kind=AUTO)
    plan, sched, _ = plan_step(lengths, spec, model_cfg=TINY, models=Models(cm, mm))
    assert plan.schedule_kind == "zb-v" and sched.num_ranks == 2
    plan, sched, _ = plan_step(lengths, spec.with_(oversize="split"), model_cfg=TINY, models=Models(cm, mm))
    assert not plan.has_slices and plan.schedule_kind == "interleaved" and sched.num_ranks == 2


def test_auto_weighs_the_zero_bubble_kinds_for_a_plan_with_slices():
    """A batch with a sequence 3.5x the longest row (``--oversize split``): auto plans the step for
    1F1B, ZB-H1 and zb alike (each a plan with slices, scheduled in reverse slice order), keeps the
    fastest predicted, and its schedule runs the slices' backwards in reverse (fails when the
    zero-bubble kinds do not take slices: auto then weighs 1F1B only)."""
    from dynmb.schedule import validate

    lengths = np.array([40, 100, 2400, 70, 300, 25, 90, 150], dtype=np.int64)
    mm, cm = MemoryModel.analytic(TINY, 2), AnalyticCostModel(TINY, 2)
    spec = PlanSpec(method="dynamic", num_stages=2, memory_limit_bytes=16 * 2**20, schedule_kind=AUTO,
                    oversize="split", recompute="auto")
    plan, sched, _ = plan_step(lengths, spec, model_cfg=TINY, models=Models(cm, mm))
    scores = plan.meta["schedule_auto"]
    assert set(scores) == {"1f1b", "zb-h1", "zb"} and all(v is not None for v in scores.values()), scores
    assert plan.slice_groups() and plan.schedule_kind in scores
    assert scores[plan.schedule_kind] == min(scores.values())
    validate(sched, plan)
    for kind in ("zb-h1", "zb"):           # each as plan_step gives it alone
        alone, _, _ = plan_step(lengths, spec.with_(schedule_kind=kind), model_cfg=TINY, models=Models(cm, mm))
        assert alone.predictions["pred_step_s"] == pytest.approx(scores[kind], rel=1e-12)
        assert alone.slice_groups()


def test_auto_raises_what_no_kind_can_take():
    mm, cm, _ = _models(2)
    spec = PlanSpec(method="dynamic", num_stages=2, memory_limit_bytes=int(mm.state_bytes.max() * 1.01),
                    schedule_kind=AUTO)
    with pytest.raises(ValueError, match="cannot fit|longest"):
        plan_step(np.array([4000, 3000]), spec, model_cfg=TINY, models=Models(cm, mm))


def test_cli_plan_and_schedule_auto(tmp_path, capsys):
    """``dynmb plan --schedule-kind auto`` records the chosen kind (the spec keeps auto); ``dynmb schedule
    --kind auto`` weighs every kind for the plan and writes the chosen one's schedule and sidecar."""
    import json

    from dynmb.cli import main
    from dynmb.core.types import Plan

    plan_path, sched_path = tmp_path / "p.json", tmp_path / "s.csv"
    assert main(["plan", "--model", "tiny", "--dataset", "gsm8k", "--global-batch", "16", "--stages", "2",
                 "--memory-limit", "1GiB", "--schedule-kind", "auto", "-o", str(plan_path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    plan = Plan.load(plan_path)
    assert summary["schedule_kind"] == plan.schedule_kind in auto_kinds(1) and plan.spec.schedule_kind == AUTO
    assert main(["schedule", "--plan", str(plan_path), "--kind", "auto", "--model", "tiny", "-o", str(sched_path)]) == 0
    out = capsys.readouterr().out
    sidecar = json.loads(sched_path.with_name("s.meta.json").read_text())
    assert sidecar["kind"] in auto_kinds(1) and f"chose {sidecar['kind']}" in out
    assert Plan.load(sidecar["plan"]).schedule_kind == sidecar["kind"]


# --- dynmb run --schedule auto on 2 gloo ranks (a case of the session's shared 2-rank job) ---------
def _cases(out: Path) -> list[RunSpec]:
    cfg = RunConfig(model=TINY, pipeline=PipelineConfig(num_stages=2, schedule=AUTO, reorder="auto",
                                                        memory_limit_bytes=24 * 2**20),
                    dataset="gsm8k", global_batch=12, method="dynamic", steps=2, warmup=0, backend="gloo",
                    device="cpu", timeout_s=60.0, oversize="truncate")
    return [RunSpec.create(cfg, out / "schedule-auto", verify=True, run_id="schedule-auto"),
            RunSpec.create(replace(cfg, method="sorted"), out / "schedule-auto", verify=True,
                           run_id="schedule-auto-sorted")]


register(2)(_cases)


@pytest.mark.dist
def test_run_schedule_auto_on_two_gloo_ranks(gloo_job):
    job = gloo_job(2)
    assert job.returncode == 0, job.errors
    t = load_results(job.out / "schedule-auto")
    steps, acts = t["steps"], t["actions"]
    assert len(steps) == 4 and steps["verified"].all()        # gradients equal the one-process reference
    assert (steps["schedule"] == AUTO).all()
    assert set(steps["schedule_kind"]) <= set(auto_kinds(1))
    for (run_id, step), kind in steps.set_index(["run_id", "step"])["schedule_kind"].items():
        ops = set(acts[(acts["run_id"] == run_id) & (acts["step"] == step)]["op"])
        # the runtime ran the chosen kind's schedule: split backwards only under the zero-bubble kinds
        assert not (ops & {"I", "W"}) or get_kind(kind).split_backward, (run_id, step, kind, ops)


@pytest.mark.parametrize("kind,virtual", [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("gpipe", 1)])
def test_batched_order_evaluation_is_the_simulator(kind, virtual):
    """The reorder search simulates neighbour orders in batches: every makespan equals the one-at-a-time
    simulator's exactly, and the search returns the same order as without batching."""
    from dynmb.planning import reorder as ro
    from dynmb.planning.batchsim import batch_makespans

    mm, cm, limit = _models(4)
    lengths = np.random.default_rng(7).integers(8, 700, 40)
    spec = PlanSpec(method="dynamic", num_stages=4, virtual=virtual, schedule_kind=kind,
                    memory_limit_bytes=limit * 8)
    plan = pack(lengths, spec, models=Models(cm, mm))
    ev = ro.OrderEvaluator(plan, Models(cm, None), kind, virtual)       # no memory model: every order is batched
    perms = np.array([np.random.default_rng(s).permutation(plan.num_microbatches) for s in range(9)])
    batched = batch_makespans(ev._flat, ev.cube, ev.comm, perms)
    assert batched.tolist() == [ev(p.tolist())[0] for p in perms]
    fresh = ro.OrderEvaluator(plan, Models(cm, None), kind, virtual)
    fresh.prefetch = lambda orders, limit: None                 # one at a time
    assert ro.reorder_order(plan, "search", models=Models(cm, None), schedule_kind=kind, virtual=virtual, max_evals=60) == \
        ro.reorder_order(plan, "search", models=Models(cm, None), schedule_kind=kind, virtual=virtual, max_evals=60,
                         evaluator=fresh)
