"""Runtime tests on real gloo ranks (CPU): gradients equal the single-process reference for
every method x schedule, multi-step runs with changing shapes, 4 ranks, PP x DP, faults,
memory checks, trace export.

Start-up is amortised: one torchrun launch runs many cases one after another in the
same process group (a ``JobSpec`` of several cases). Faults are injected through step
hooks the spec names (``tests.runtime_faults``), never by the worker itself.
"""

from __future__ import annotations

import gc
import json
import os
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dynmb.core.config import ModelConfig, PipelineConfig, RunConfig
from dynmb.costmodel import CalibrationStep, get_cost_model, job_calibration
from dynmb.io.results import load_results
from dynmb.runtime import worker
from dynmb.runtime.checks import StepCheckError
from dynmb.runtime.comm import sender_order
from dynmb.runtime.launch import LaunchResult, failure_lines, launch_job
from dynmb.runtime.spec import JobSpec, RunSpec
from dynmb.runtime.trace import export_trace
from dynmb.schedule import build_schedule
from tests.gloo_jobs import register
from tests.runtime_faults import REPO, Fault, fault_hooks

LIMIT = 24 * 2**20
METHODS = ("fixed", "packed", "dynamic")
SCHEDULES = (("gpipe", 1, "none"), ("1f1b", 1, "none"), ("interleaved", 2, "none"), ("1f1b", 1, "descending"))


def _cfg(method="dynamic", kind="1f1b", virtual=1, reorder="none", stages=2, dp=1, steps=1, warmup=0,
         global_batch=8, seed=0, limit=LIMIT, timeout=60.0) -> RunConfig:
    return RunConfig(model=ModelConfig.preset("tiny"),
                     pipeline=PipelineConfig(num_stages=stages, virtual=virtual, schedule=kind, reorder=reorder,
                                             memory_limit_bytes=limit),
                     dataset="gsm8k", global_batch=global_batch, method=method, mbs=2 if method == "fixed" else None,
                     dp=dp, seed=seed, steps=steps, warmup=warmup, backend="gloo", device="cpu", timeout_s=timeout)


def _case(out: Path, name: str, cfg: RunConfig) -> RunSpec:
    return RunSpec.create(cfg, out / name, verify=True, run_id=name)


def _job(out: Path, cases: list[RunSpec]) -> JobSpec:
    return JobSpec(out_dir=str(out.resolve()), cases=tuple(cases))


def _faulty(out: Path, cfg: RunConfig, rank: int, step: int, kind: str, *, verify: bool = False) -> JobSpec:
    """One run in ``out`` whose rank ``rank`` breaks step ``step`` as ``kind`` says."""
    return JobSpec.single(RunSpec.create(cfg, out, verify=verify, hooks=fault_hooks(rank, step, kind)))


@pytest.fixture
def fault_path(monkeypatch):
    """Workers import ``tests.runtime_faults``: put the repository on their ``PYTHONPATH``."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def _failed(result: LaunchResult) -> str:
    assert not result.ok
    return "\n".join(result.failures)


def _tables(d: Path) -> dict:
    return load_results(d)


# --------------------------------------------------------------------------
# pure: message order
# --------------------------------------------------------------------------
@pytest.mark.parametrize("kind,stages,virtual", [("gpipe", 2, 1), ("1f1b", 4, 1), ("interleaved", 4, 2)])
def test_sender_order_covers_every_receive(kind, stages, virtual):
    """Every message a rank receives is in its sender's order exactly once; for
    GPipe/1F1B the receive order per pair even equals the send order."""
    sch = build_schedule(kind, stages, 6, virtual=virtual)
    where = sch.stage_to_rank()
    for dst, acts in enumerate(sch.ranks):
        needs: dict[int, list] = {}
        for a in acts:
            if a.op == "F" and a.stage > 0:
                needs.setdefault(where[a.stage - 1], []).append(("act", a.stage, a.mb))
            if a.op == "B" and a.stage < stages - 1:
                needs.setdefault(where[a.stage + 1], []).append(("grad", a.stage, a.mb))
        for src, want in needs.items():
            if src == dst:
                continue
            sent = sender_order(sch, src, dst, where)
            assert sorted(sent) == sorted(want)
            if virtual == 1:
                assert sent == want


def test_failure_lines_names_dead_rank(tmp_path):
    log = ("Root Cause (first observed failure):\n[1]:\n  time      : x\n  host      : h\n"
           "  rank      : 1 (local_rank: 1)\n  exitcode  : 13 (pid: 5)\n")
    assert failure_lines(tmp_path, log) == ["dynmb run: rank 1 died (exit code 13) without a Python error"]


# --------------------------------------------------------------------------
# 2 ranks: every method x schedule, then three steps with changing shapes
# --------------------------------------------------------------------------
def _rt_two_cases(out: Path) -> list[RunSpec]:
    cases = []
    for method in METHODS:
        for kind, virtual, reorder in SCHEDULES:
            name = f"rt-{method}-{kind}-{reorder}"
            cases.append(_case(out, name, _cfg(method, kind, virtual, reorder, stages=2 * virtual)))
    cases.append(_case(out, "rt-dynamic-memory-aware-none", _cfg("dynamic", "memory-aware")))
    cases.append(_case(out, "rt-multistep", _cfg("dynamic", steps=3, warmup=1, global_batch=8, seed=3)))
    return cases


RT_FOUR = {"rt-pp4": lambda: _cfg("dynamic", stages=4, global_batch=8, limit=32 * 2**20),
           "rt-pp2dp2": lambda: _cfg("fixed", stages=2, dp=2, global_batch=8),
           "rt-pp2dp2dyn": lambda: _cfg("dynamic", stages=2, dp=2, global_batch=8, seed=1)}

register(2)(_rt_two_cases)
register(4)(lambda out: [_case(out, name, cfg()) for name, cfg in RT_FOUR.items()])


@pytest.fixture
def two_rank_run(gloo_job):
    """Every method x schedule on 2 ranks, verified (cases of the session's shared 2-rank job)."""
    job = gloo_job(2)
    names = [c.run_id for c in _rt_two_cases(job.out)]
    errs = [job.errors] if job.errors else []
    return job.returncode, job.out, names, errs


@pytest.mark.dist
def test_two_ranks_match_reference(two_rank_run):
    rc, out, names, errs = two_rank_run
    assert rc == 0, "\n".join(errs)
    for name in names:
        t = _tables(out / name)
        assert t["steps"]["verified"].all(), name          # --verify passed (else rc != 0)
        assert len(t["actions"]) > 0 and (t["actions"]["end_s"] >= t["actions"]["start_s"]).all()


@pytest.mark.dist
def test_three_steps_change_shapes(two_rank_run):
    rc, out, _, _ = two_rank_run
    assert rc == 0
    t = _tables(out / "rt-multistep")
    assert list(t["steps"]["step"]) == [0, 1, 2, 3] and list(t["steps"]["warmup"]) == [True, False, False, False]
    shapes = t["actions"].groupby("step").apply(lambda d: tuple(sorted(set(zip(d["batch"], d["padded_len"])))))
    assert len(set(shapes)) == 4                            # every step runs other shapes
    # each step's cost model is calibrated on the steps before it (CPU default): the scale and
    # overhead a steps row carries are job_calibration's of the earlier steps' actions, priced
    # by the uncalibrated model (raw_pred_s); the first step's are 1 and 0
    acts = t["actions"]
    cfg = _cfg("dynamic", steps=3, warmup=1, global_batch=8, seed=3)     # the run's P2P time (RunState.record)
    comm = get_cost_model(cfg.cost_model, cfg.model, 2).comm_s(acts["batch"].to_numpy(), acts["padded_len"].to_numpy())
    priced = acts.assign(pred_s=acts["raw_pred_s"], comm_s=comm)
    for k in range(4):
        history = [CalibrationStep("rt", priced[priced["step"] == j]) for j in range(k)]
        cal = job_calibration(history, "rt", 2)
        row = t["steps"].iloc[k]
        for op in ("F", "B"):
            assert row[f"scale_{op}"] == pytest.approx(float(np.mean(cal.scale.get(op, [1.0, 1.0]))))
            assert row[f"overhead_{op}_s"] == pytest.approx(cal.per_action_s.get(op, 0.0))
        assert row["recv_latency_s"] == pytest.approx(cal.latency_s)
        # every action's pred_s is its raw prediction under that calibration, plus the receive
        # latency on the actions that receive (F of stage 1, B of stage 0)
        step = acts[acts["step"] == k]
        scale = [cal.scale[op][st] if op in cal.scale else 1.0 for op, st in zip(step["op"], step["stage"])]
        receives = ((step["op"] == "F") & (step["stage"] == 1)) | ((step["op"] == "B") & (step["stage"] == 0))
        expect = (step["raw_pred_s"] * scale + [cal.per_action_s.get(op, 0.0) for op in step["op"]]
                  + cal.latency_s * receives)
        assert step["pred_s"].to_numpy() == pytest.approx(expect.to_numpy(), rel=1e-9)
    # every action's thread CPU time is within its wall time; the replay of each step (the
    # simulator on the measured action times) never exceeds the measured step by more than the
    # P2P time the cost model charges, and is at least the busiest rank's compute
    a = t["actions"]
    assert (a["cpu_s"] > 0).all() and (a["cpu_s"] <= a["end_s"] - a["start_s"] + 2e-3).all()
    busiest = a.assign(d=a["end_s"] - a["start_s"]).groupby(["step", "rank"])["d"].sum().groupby("step").max()
    steps = t["steps"].set_index("step")
    assert (steps["replay_step_s"] >= busiest - 1e-9).all()
    assert (steps["replay_step_s"] <= steps["step_s"] + 0.05).all()
    # (how many microbatches a step gets is the planner's choice, tested in test_packing)
    assert (t["steps"]["num_microbatches"] == t["actions"].groupby("step")["mb"].nunique().to_numpy()).all()


@pytest.mark.dist
def test_memory_measured_below_limit(two_rank_run):
    rc, out, names, _ = two_rank_run
    assert rc == 0
    for name in names:
        mem = _tables(out / name)["memory"]
        steps = _tables(out / name)["steps"]
        assert len(mem) == len(steps) * (4 if "interleaved" in name else 2)
        assert (mem["peak_bytes"] > 0).all() and (mem["peak_bytes"] <= mem["limit_bytes"]).all(), name


@pytest.mark.dist
def test_trace_export(two_rank_run, tmp_path):
    _, out, _, _ = two_rank_run
    p = export_trace(_tables(out / "rt-dynamic-1f1b-none")["actions"], tmp_path / "t.json")
    ev = json.loads(p.read_text())["traceEvents"]
    assert {e["tid"] for e in ev} == {0, 1} and any(e["name"] == "1B0" for e in ev)


# --------------------------------------------------------------------------
# 4 ranks: P = 4, and PP 2 x DP 2
# --------------------------------------------------------------------------
@pytest.mark.dist
def test_four_ranks_pp4_and_pp2_dp2(gloo_job):
    job = gloo_job(4)
    assert job.returncode == 0, job.errors
    for name in RT_FOUR:
        assert _tables(job.out / name)["steps"]["verified"].all(), name
    acts = _tables(job.out / "rt-pp2dp2")["actions"]
    assert set(acts["rank"]) == {0, 1, 2, 3} and set(acts["dp_rank"]) == {0, 1}


# --------------------------------------------------------------------------
# faults
# --------------------------------------------------------------------------
@pytest.mark.dist
def test_killed_rank_fails_fast_and_is_named(tmp_path, fault_path):
    t0 = time.monotonic()
    result = launch_job(_faulty(tmp_path, _cfg("dynamic", steps=3, timeout=30), 1, 1, "exit"), 2, quiet=True)
    took = time.monotonic() - t0
    err = _failed(result)
    assert took < 60, (result, took)
    assert "rank 1 died" in err, err
    assert len(_tables(tmp_path)["steps"]) == 1                  # the finished step was kept


@pytest.mark.dist
def test_divergent_plan_is_refused(tmp_path, fault_path):
    # a generous timeout: on a loaded machine a slow peer must not turn the refusal into a timeout
    err = _failed(launch_job(_faulty(tmp_path, _cfg("dynamic", steps=2, timeout=90), 1, 1, "diverge"), 2,
                             quiet=True))
    assert "PlanDivergenceError" in err or "differs from rank 0" in err, err
    assert "rank(s) [1]" in err, err


@pytest.mark.dist
def test_verify_catches_a_wrong_gradient(tmp_path, fault_path):
    err = _failed(launch_job(_faulty(tmp_path, _cfg("fixed", timeout=30), 0, 0, "corrupt", verify=True), 2,
                             quiet=True))
    assert "rank 0 step 0 param" in err and "max abs error" in err, err
    tables = _tables(tmp_path)
    assert tables["steps"]["verified"].tolist() == [False]      # recorded, but not as verified
    assert len(tables["actions"]) > 0 and len(tables["memory"]) == 2   # written before the steps row


@pytest.mark.dist
def test_peak_over_the_limit_fails_the_run(tmp_path, fault_path):
    """The fault checks this rank's peak against a limit 1 byte below it."""
    err = _failed(launch_job(_faulty(tmp_path, _cfg("fixed", timeout=30), 1, 0, "overlimit"), 2, quiet=True))
    assert "rank 1 stage 1: measured peak" in err and "exceeds the memory limit" in err, err
    assert len(_tables(tmp_path)["memory"]) == 2                # the step's rows were still written


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_run_spec_frees_its_model_before_the_next_case(tmp_path):
    """Cases of one job run back to back in one process: each must release its model,
    gradients and optimizer states (reference cycles included) before the next starts, or a
    CUDA peak of the next case counts them. In-process, one gloo rank."""
    refs = []
    orig = worker.RunState.__init__

    def spy(self, *a, **k):
        orig(self, *a, **k)
        refs.append(weakref.ref(next(iter(self.stages.values()))))

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    was = gc.isenabled()
    gc.disable()                       # the run must not rely on the collector happening to run
    try:
        worker.RunState.__init__ = spy
        spec = _case(tmp_path, "one", _cfg("dynamic", "interleaved", virtual=2))
        worker.run_spec(spec, torch.device("cpu"))
        assert refs and refs[0]() is None
    finally:
        worker.RunState.__init__ = orig
        if was:
            gc.enable()
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_hooks_passed_in_process_reach_the_step(tmp_path):
    """``run_spec(..., hooks=...)``: a raise before an action and a limit below the peak, in
    process on one gloo rank (no torchrun); the second still writes the step's rows."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        cfg = _cfg("fixed", "interleaved", virtual=2)
        with pytest.raises(RuntimeError, match="injected fault before action"):
            worker.run_spec(_case(tmp_path, "raise", cfg), torch.device("cpu"), hooks=Fault(0, 0, "raise"))
        with pytest.raises(StepCheckError, match="rank 0 stage 1: measured peak .* exceeds the memory limit"):
            worker.run_spec(_case(tmp_path, "over", cfg), torch.device("cpu"), hooks=Fault(0, 0, "overlimit"))
    finally:
        dist.destroy_process_group()
    assert len(_tables(tmp_path / "over")["memory"]) == 2
