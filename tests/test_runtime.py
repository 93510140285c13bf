"""Runtime tests on real gloo ranks (CPU): gradients equal the single-process reference for
every method x schedule, multi-step runs with changing shapes, 4 ranks, PP x DP, faults,
memory checks, trace export.

Start-up is amortised: one torchrun launch runs many cases one after another in the
same process group (the worker's test-only ``{"cases": [...]}`` spec).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dynmb.config import ModelConfig, PipelineConfig, RunConfig
from dynmb.schedule import build_schedule
from dynmb.runtime.comm import sender_order
from dynmb.runtime.launch import failure_lines, launch_spec, write_spec

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


def _case(out: Path, name: str, cfg: RunConfig, **kw) -> dict:
    return write_spec(cfg, out / name, verify=True, run_id=name, **kw)


def _tables(d: Path) -> dict:
    from dynmb.results import load_results

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
@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("rt2")
    cases = []
    for method in METHODS:
        for kind, virtual, reorder in SCHEDULES:
            name = f"{method}-{kind}-{reorder}"
            cases.append(_case(out, name, _cfg(method, kind, virtual, reorder, stages=2 * virtual)))
    cases.append(_case(out, "dynamic-memory-aware-none", _cfg("dynamic", "memory-aware")))
    cases.append(_case(out, "multistep", _cfg("dynamic", steps=3, warmup=0, global_batch=8, seed=3)))
    rc = launch_spec({"out_dir": str(out), "cases": cases}, 2, quiet=True)
    return rc, out, [c["run_id"] for c in cases]


@pytest.mark.dist
def test_two_ranks_match_reference(two_rank_run):
    rc, out, names = two_rank_run
    errs = list((out / "errors").glob("*.txt")) if (out / "errors").exists() else []
    assert rc == 0, "\n".join(e.read_text() for e in errs)
    for name in names:
        t = _tables(out / name)
        assert t["steps"]["verified"].all(), name          # --verify passed (else rc != 0)
        assert len(t["actions"]) > 0 and (t["actions"]["end_s"] >= t["actions"]["start_s"]).all()


@pytest.mark.dist
def test_three_steps_change_shapes(two_rank_run):
    rc, out, _ = two_rank_run
    assert rc == 0
    t = _tables(out / "multistep")
    assert list(t["steps"]["step"]) == [0, 1, 2]
    shapes = t["actions"].groupby("step").apply(lambda d: tuple(sorted(set(zip(d["batch"], d["padded_len"])))))
    assert len(set(shapes)) == 3                            # every step runs other shapes
    assert t["steps"]["num_microbatches"].nunique() >= 2


@pytest.mark.dist
def test_memory_measured_below_limit(two_rank_run):
    rc, out, names = two_rank_run
    assert rc == 0
    for name in names:
        mem = _tables(out / name)["memory"]
        steps = _tables(out / name)["steps"]
        assert len(mem) == len(steps) * (4 if "interleaved" in name else 2)
        assert (mem["peak_bytes"] > 0).all() and (mem["peak_bytes"] <= mem["limit_bytes"]).all(), name


@pytest.mark.dist
def test_trace_export(two_rank_run, tmp_path):
    from dynmb.runtime.trace import export_trace

    _, out, _ = two_rank_run
    p = export_trace(_tables(out / "dynamic-1f1b-none")["actions"], tmp_path / "t.json")
    ev = json.loads(p.read_text())["traceEvents"]
    assert {e["tid"] for e in ev} == {0, 1} and any(e["name"] == "1B0" for e in ev)


# --------------------------------------------------------------------------
# 4 ranks: P = 4, and PP 2 x DP 2
# --------------------------------------------------------------------------
@pytest.mark.dist
def test_four_ranks_pp4_and_pp2_dp2(tmp_path):
    cases = [_case(tmp_path, "pp4", _cfg("dynamic", stages=4, global_batch=8, limit=32 * 2**20)),
             _case(tmp_path, "pp2dp2", _cfg("fixed", stages=2, dp=2, global_batch=8)),
             _case(tmp_path, "pp2dp2dyn", _cfg("dynamic", stages=2, dp=2, global_batch=8, seed=1))]
    rc = launch_spec({"out_dir": str(tmp_path), "cases": cases}, 4, quiet=True)
    errs = list((tmp_path / "errors").glob("*.txt")) if (tmp_path / "errors").exists() else []
    assert rc == 0, "\n".join(e.read_text() for e in errs)
    acts = _tables(tmp_path / "pp2dp2")["actions"]
    assert set(acts["rank"]) == {0, 1, 2, 3} and set(acts["dp_rank"]) == {0, 1}


# --------------------------------------------------------------------------
# faults
# --------------------------------------------------------------------------
@pytest.mark.dist
def test_killed_rank_fails_fast_and_is_named(tmp_path, capsys):
    spec = write_spec(_cfg("dynamic", steps=3, timeout=30), tmp_path, fault={"rank": 1, "step": 1, "kind": "exit"})
    t0 = time.monotonic()
    rc = launch_spec(spec, 2, quiet=True)
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert rc != 0 and took < 60, (rc, took)
    assert "rank 1 died" in err, err
    assert len(_tables(tmp_path)["steps"]) == 1                  # the finished step was kept


@pytest.mark.dist
def test_divergent_plan_is_refused(tmp_path, capsys):
    spec = write_spec(_cfg("dynamic", steps=2, timeout=30), tmp_path, fault={"rank": 1, "step": 1, "kind": "diverge"})
    rc = launch_spec(spec, 2, quiet=True)
    err = capsys.readouterr().err
    assert rc != 0
    assert "PlanDivergenceError" in err or "differs from rank 0" in err, err
    assert "rank(s) [1]" in err, err


@pytest.mark.dist
def test_verify_catches_a_wrong_gradient(tmp_path, capsys):
    spec = write_spec(_cfg("fixed", timeout=30), tmp_path, verify=True, fault={"rank": 0, "step": 0, "kind": "corrupt"})
    rc = launch_spec(spec, 2, quiet=True)
    err = capsys.readouterr().err
    assert rc != 0
    assert "rank 0 step 0 param" in err and "max abs error" in err, err


@pytest.mark.dist
def test_peak_over_the_limit_fails_the_run(tmp_path, capsys):
    """Fault injection checks this rank's peak against a limit 1 byte below it."""
    spec = write_spec(_cfg("fixed", timeout=30), tmp_path, fault={"rank": 1, "step": 0, "kind": "overlimit"})
    rc = launch_spec(spec, 2, quiet=True)
    err = capsys.readouterr().err
    assert rc != 0
    assert "rank 1 stage 1: measured peak" in err and "exceeds the memory limit" in err, err
    assert len(_tables(tmp_path)["memory"]) == 2                # the step's rows were still written


def test_run_spec_frees_its_model_before_the_next_case(tmp_path):
    """Cases of one job run back to back in one process: each must release its model,
    gradients and optimizer states (reference cycles included) before the next starts, or a
    CUDA peak of the next case counts them. In-process, one gloo rank."""
    import gc
    import weakref

    import torch
    import torch.distributed as dist

    from dynmb.runtime import worker

    refs = []
    orig = worker._Setup.__init__

    def spy(self, *a, **k):
        orig(self, *a, **k)
        refs.append(weakref.ref(next(iter(self.stages.values()))))

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    was = gc.isenabled()
    gc.disable()                       # the run must not rely on the collector happening to run
    try:
        worker._Setup.__init__ = spy
        spec = _case(tmp_path, "one", _cfg("dynamic", "interleaved", virtual=2))
        worker.run_spec(spec, torch.device("cpu"))
        assert refs and refs[0]() is None
    finally:
        worker._Setup.__init__ = orig
        if was:
            gc.enable()
        dist.destroy_process_group()
