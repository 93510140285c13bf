"""Pure tests of the runtime's typed pieces: run/job specs and their JSON form, the topology,
step hooks, the compare settings. No process group."""

from __future__ import annotations

import json

import pytest

from dynmb.jobs.compare import CompareSettings
from dynmb.core.config import ModelConfig, PipelineConfig, RunConfig
from dynmb.runtime.hooks import NoHooks, load_hooks
from dynmb.runtime.launch import write_spec
from dynmb.runtime.spec import HookRef, JobSpec, RunSpec
from dynmb.runtime.topology import Topology
from tests.runtime_faults import Fault, fault_hooks


def _run(stages=2, virtual=1, dp=1, method="dynamic") -> RunConfig:
    return RunConfig(model=ModelConfig.preset("tiny"),
                     pipeline=PipelineConfig(num_stages=stages, virtual=virtual, memory_limit_bytes=2**25),
                     dataset="gsm8k", global_batch=8, method=method, dp=dp)


def test_run_spec_round_trips_through_json(tmp_path):
    spec = RunSpec.create(_run(), tmp_path / "a", verify=True, label="fixed mbs=2", memory_model="m.json",
                          hooks=fault_hooks(1, 2, "exit"))
    assert spec.out_dir == str((tmp_path / "a").resolve()) and spec.run_id.startswith("dynamic-1f1b-")
    again = RunSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec and again.display_label == "fixed mbs=2"
    assert RunSpec.create(_run(), tmp_path).display_label == "dynamic"


def test_job_spec_json_forms(tmp_path):
    one = RunSpec.create(_run(), tmp_path, run_id="one")
    single = JobSpec.single(one)
    assert single.to_dict() == one.to_dict()                   # a one-run job is the run's spec
    assert JobSpec.load(single.save(tmp_path / "spec.json")) == single
    job = JobSpec(out_dir=str(tmp_path), cases=(one, RunSpec.create(_run(method="fixed"), tmp_path / "b")),
                  interleave=True)
    data = job.to_dict()
    assert set(data) == {"out_dir", "cases", "interleave", "order_seed"} and len(data["cases"]) == 2
    assert JobSpec.from_dict(data) == job and job.total_steps == 2 * (1 + 3)


def test_specs_refuse_unknown_keys_and_bad_files(tmp_path):
    data = RunSpec.create(_run(), tmp_path).to_dict()
    with pytest.raises(ValueError, match="unknown key"):
        RunSpec.from_dict({**data, "fault": {"rank": 1}})
    with pytest.raises(ValueError, match="package.module:name"):
        HookRef(target="no_colon")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json is not valid JSON"):
        JobSpec.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="at least one case"):
        JobSpec(out_dir=str(tmp_path), cases=())


def test_topology_pp_by_dp():
    grid = [Topology.for_run(_run(stages=2, dp=2), rank, 4) for rank in range(4)]
    assert [(t.dp_index, t.pp_index) for t in grid] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert grid[3].pipeline_ranks() == [2, 3] and grid[3].data_parallel_ranks() == [1, 3]
    assert grid[2].local_stages == (0,)
    interleaved = Topology.for_run(_run(stages=4, virtual=2), 1, 2)
    assert interleaved.local_stages == (1, 3) and interleaved.pipeline_size == 2
    with pytest.raises(ValueError, match="world size 3 != pipeline ranks 2"):
        Topology.for_run(_run(), 0, 3)


def test_hooks_load_by_name():
    assert isinstance(load_hooks(None), NoHooks)
    fault = load_hooks(fault_hooks(1, 0, "overlimit"))
    assert isinstance(fault, Fault) and fault.memory_limit(1, 0, 0, 100, 90) == 89
    assert fault.memory_limit(0, 0, 0, 100, 90) == 100
    with pytest.raises(ValueError, match="cannot load step hooks"):
        load_hooks(HookRef(target="tests.runtime_faults:Nope"))


def test_compare_settings_resolve_defaults():
    s = CompareSettings(virtual=2, stages=2, device="cpu", model="tiny").resolved()
    assert (s.schedule, s.dataset, s.memory_limit, s.trace) == ("interleaved", "sharegpt", "1GiB", "sharegpt")
    with pytest.raises(ValueError, match="--stages 3 is not a multiple of --virtual 2"):
        CompareSettings(stages=3, virtual=2, device="cpu").resolved()


def test_scripts_json_specs_are_read(tmp_path):
    """``write_spec`` gives the JSON form scripts put into a job dict (``launch_spec`` reads it)."""
    data = write_spec(_run(), tmp_path, run_id="x", oversize="drop", label="fixed mbs=1")
    job = JobSpec.from_dict({"out_dir": str(tmp_path), "cases": [data], "interleave": True})
    case = job.cases[0]
    assert (case.run_id, case.run.oversize, case.label, job.interleave) == ("x", "drop", "fixed mbs=1", True)
