"""``dynmb.run`` and ``dynmb run --plan``: real runs from Python, this run's rows only, the
``status`` of every run, and a given plan run as it is (issue 13)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest

import dynmb
from dynmb.cli.main import main
from dynmb.core.config import ModelConfig, PipelineConfig, RunConfig
from dynmb.runtime.spec import RunSpec
from tests.runtime_faults import REPO, fault_hooks


def _cfg(method: str = "dynamic", steps: int = 1) -> RunConfig:
    return RunConfig(model=ModelConfig.preset("tiny"),
                     pipeline=PipelineConfig(num_stages=2, memory_limit_bytes=256 << 20),
                     dataset="gsm8k", global_batch=4, method=method, steps=steps, warmup=0, backend="gloo",
                     device="cpu", timeout_s=60.0)


def test_import_dynmb_is_torch_free_and_run_is_public():
    code = ("import sys, dynmb; assert 'torch' not in sys.modules; "
            "assert callable(dynmb.run) and dynmb.RunResult; assert 'torch' not in sys.modules; "
            "assert 'run' in dynmb.__all__")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_run_returns_the_tables_of_this_run_only_and_a_new_run_id_each_time(tmp_path):
    out = tmp_path / "res"
    first = dynmb.run(_cfg(steps=2), out=out)
    assert first.ok and first.failures == () and len(first.run_ids) == 1
    assert sorted(first.tables["steps"]["step"]) == [0, 1]
    second = dynmb.run([_cfg("fixed"), _cfg("dynamic")], out=out)   # two cases, one torchrun job
    assert second.ok and len(set(second.run_ids)) == 2 and not set(second.run_ids) & set(first.run_ids)
    for table in ("steps", "actions", "memory", "runs"):
        assert set(second.tables[table]["run_id"]) == set(second.run_ids), table
    runs = pd.read_csv(out / "runs.csv")
    assert len(runs) == 3 and runs["run_id"].is_unique
    assert list(runs["status"]) == ["ok"] * 3 and runs["error"].isna().all()


def test_a_run_id_already_in_the_folder_is_refused_before_torchrun(tmp_path):
    out = tmp_path / "res"
    out.mkdir()
    pd.DataFrame([{"run_id": "mine", "status": "ok"}]).to_csv(out / "runs.csv", index=False)
    with pytest.raises(ValueError, match="already in"):
        dynmb.run(RunSpec.create(_cfg(), out, run_id="mine"), out=out)
    assert not (out / "spec.json").exists()


def test_a_bad_config_raises_before_torchrun_and_writes_nothing(tmp_path):
    with pytest.raises(ValueError, match="unknown method 'dynamc'"):
        dynmb.run(_cfg("dynamc"), out=tmp_path / "res")
    assert not (tmp_path / "res").exists()


@pytest.mark.parametrize("rank, kind, says", [(1, "raise", "rank 1 failed"), (0, "exit", "rank 0 died")])
def test_a_failed_run_is_marked_failed_with_its_error(tmp_path, monkeypatch, rank, kind, says):
    """Rank 0 marks its row when it survives; when it died, the launcher does."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    out = tmp_path / "res"
    spec = RunSpec.create(_cfg(steps=2), out, hooks=fault_hooks(rank, 1, kind))
    result = dynmb.run(spec, out=out)
    assert result.returncode != 0 and result.failures
    runs = pd.read_csv(out / "runs.csv")
    assert list(runs["status"]) == ["failed"]
    assert says in runs["error"][0] and "\n" not in runs["error"][0]
    assert sorted(result.tables["steps"]["step"]) == [0]          # the failed step left no rows
    assert set(result.tables["actions"]["step"]) <= {0} and set(result.tables["memory"]["step"]) <= {0}


@pytest.fixture
def plan_files(tmp_path):
    """A plan, the schedule `dynmb schedule` built for it (with its sidecar), and another plan."""
    common = ["--model", "tiny", "--dataset", "gsm8k", "--global-batch", "6", "--stages", "2",
              "--memory-limit", "256MiB", "--method", "dynamic"]
    assert main(["plan", *common, "-o", str(tmp_path / "p.json")]) == 0
    assert main(["plan", *common, "--seed", "5", "-o", str(tmp_path / "other.json")]) == 0
    assert main(["schedule", "--plan", str(tmp_path / "p.json"), "--kind", "gpipe", "--model", "tiny",
                 "-o", str(tmp_path / "s.csv")]) == 0
    return tmp_path


def test_run_plan_runs_exactly_that_plan_every_step(plan_files, capsys):
    out = plan_files / "res"
    rc = main(["run", "--plan", str(plan_files / "s.plan.json"), "--schedule", str(plan_files / "s.csv"),
               "--steps", "2", "--warmup", "0", "--device", "cpu", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    plan = json.loads((plan_files / "s.plan.json").read_text())
    steps = pd.read_csv(out / "steps.csv")
    assert list(steps["num_microbatches"]) == [len(plan["microbatches"])] * 2
    assert list(steps["real_tokens"]) == [sum(sum(mb["lengths"]) for mb in plan["microbatches"])] * 2
    assert set(steps["schedule"]) == {"gpipe"}
    actions = pd.read_csv(out / "actions.csv")
    assert set(actions["mb"]) == set(range(len(plan["microbatches"])))
    assert "dynmb run: ok, run " in capsys.readouterr().out


@pytest.mark.parametrize("extra, word", [
    (["--plan", "{d}/other.json", "--schedule", "{d}/s.csv"], "built for another plan"),
    (["--plan", "{d}/p.json", "--stages", "4"], "--stages 4 conflicts with the plan"),
    (["--plan", "{d}/p.json", "--model", "small"], "--model small conflicts with the plan"),
    (["--plan", "{d}/p.json", "--memory-limit", "1GiB"], "--memory-limit 1GiB conflicts"),
    (["--plan", "{d}/p.json", "--reorder", "search"], "--reorder plans a batch"),
    (["--schedule", "{d}/s.csv"], "runs only with the plan it was built for"),
])
def test_run_plan_refuses_another_plans_schedule_and_conflicting_flags(plan_files, capsys, extra, word):
    out = plan_files / "res"
    capsys.readouterr()
    rc = main(["run", *[e.format(d=plan_files) for e in extra], "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and word in err[0], err
    assert not out.exists()
