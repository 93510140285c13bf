"""A plan carries everything it was made for: schedule, simulate and run --plan take it from the plan."""

from __future__ import annotations

import json
import shutil

import pytest

from dynmb.cli.main import build_parser, main
from dynmb.cli.run import plan_run_config
from dynmb.data.lengths import shipped_dir
from dynmb.core.types import Plan


def _plan(tmp_path, *flags: str) -> str:
    out = str(tmp_path / "p.json")
    assert main(["plan", "--dataset", "sharegpt", "--global-batch", "16", "-o", out, *flags]) == 0
    return out


def _simulated(capsys, plan: str, *flags: str) -> dict:
    sched = plan.replace(".json", ".csv")
    assert main(["schedule", "--plan", plan, "-o", sched, *flags]) == 0
    capsys.readouterr()
    assert main(["simulate", "--plan", sched.replace(".csv", ".plan.json"), "--schedule", sched, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_schedule_and_simulate_use_the_plans_model_and_attention(tmp_path, capsys) -> None:
    plan = _plan(tmp_path, "--model", "gpt2", "--memory-limit", "8GiB", "--attention", "dense")
    recorded = Plan.load(plan)
    assert recorded.meta["model"]["name"] == "gpt2" and recorded.meta["cost_model"] == {"kind": "analytic"}
    sim = _simulated(capsys, plan)
    # the 1F1B schedule of the plan's own order: the plan's prediction, the plan's model and attention
    assert sim["makespan_s"] == pytest.approx(recorded.predictions["pred_step_s"], rel=1e-9)
    assert max(sim["peak_bytes"]) == pytest.approx(max(recorded.predictions["pred_peak_bytes"]), rel=1e-9)
    for verb_flags in (["--model", "small"], ["--attention", "auto"]):
        assert main(["schedule", "--plan", plan, "-o", str(tmp_path / "x.csv"), *verb_flags]) == 2
        assert "conflicts with the plan" in capsys.readouterr().err


def test_an_edited_model_file_changes_nothing_and_an_edited_cost_model_is_refused(tmp_path, capsys) -> None:
    model_file = tmp_path / "model.json"
    model_file.write_text(json.dumps({"name": "mine", "d_model": 128, "n_layers": 4, "n_heads": 4, "d_ff": 512,
                                      "vocab_size": 2048}))
    cost = tmp_path / "cost.json"
    shutil.copy(shipped_dir("costmodels").joinpath("small-p2-cpu.json"), cost)
    plan = _plan(tmp_path, "--model", "small", "--cost-model", str(cost))
    plan2 = str(tmp_path / "q.json")
    assert main(["plan", "--dataset", "sharegpt", "--global-batch", "16", "--model", str(model_file), "-o", plan2]) == 0
    before = _simulated(capsys, plan2)
    model_file.write_text(json.dumps({"name": "mine", "d_model": 512, "n_layers": 8, "n_heads": 8, "d_ff": 2048}))
    assert _simulated(capsys, plan2)["makespan_s"] == before["makespan_s"]
    assert Plan.load(plan).meta["cost_model"]["path"] == str(cost.resolve())
    _simulated(capsys, plan)                                      # the recorded cost model, untouched: fine
    cost.write_text(cost.read_text().replace('"meta": {', '"meta": {"edited": 1, ', 1))
    assert main(["schedule", "--plan", plan, "-o", str(tmp_path / "y.csv")]) == 2
    err = capsys.readouterr().err
    assert "missing or has changed since" in err and str(cost.resolve()) in err


def test_run_plan_takes_recompute_oversize_and_the_memory_model_from_the_plan(tmp_path) -> None:
    plan = _plan(tmp_path, "--model", "tiny", "--recompute", "always", "--memory-limit", "512MiB")
    args = build_parser().parse_args(["run", "--plan", plan, "--out", str(tmp_path / "out")])
    cfg, schedule_file, memory_file = plan_run_config(args)
    assert (cfg.recompute, cfg.oversize, cfg.model.name, schedule_file, memory_file) == (
        "always", "error", "tiny", None, None)
    args = build_parser().parse_args(["run", "--plan", plan, "--out", str(tmp_path / "o"), "--model", "small"])
    with pytest.raises(ValueError, match="--model small conflicts with the plan"):
        plan_run_config(args)


def test_an_edited_sidecar_or_schedule_is_refused(tmp_path, capsys) -> None:
    plan = _plan(tmp_path, "--model", "tiny", "--memory-limit", "512MiB")
    sched = str(tmp_path / "s.csv")
    assert main(["schedule", "--plan", plan, "-o", sched]) == 0
    args = ["simulate", "--plan", str(tmp_path / "s.plan.json"), "--schedule", sched, "--json"]
    assert main(args) == 0
    side = tmp_path / "s.meta.json"
    original = side.read_text()
    side.write_text(original.replace('"kind": "1f1b"', '"kind": "gpipe"'))
    capsys.readouterr()
    assert main(args) == 2 and "was edited after" in capsys.readouterr().err
    side.write_text(original)
    with open(sched, "a") as f:
        f.write("\n")
    assert main(args) == 2 and "does not match" in capsys.readouterr().err


def test_mbs_is_refused_by_methods_that_choose_their_own_sizes(tmp_path, capsys) -> None:
    for method in ("dynamic", "dynapipe"):
        assert main(["plan", "--dataset", "sharegpt", "--global-batch", "8", "--method", method, "--mbs", "4",
                     "-o", str(tmp_path / "p.json")]) == 2
        assert f"--mbs 4: {method} chooses its own microbatch sizes" in capsys.readouterr().err


def test_a_schedule_csv_without_its_sidecar_is_labelled_file(tmp_path):
    """Issue 25: a hand-written schedule (no ``.meta.json``) is recorded as ``schedule=file``, not as the
    plan's kind; one written by ``dynmb schedule`` (sidecar present) keeps its kind."""
    from dynmb.core.config import RunConfig
    from dynmb.runtime.records import schedule_label
    from dynmb.runtime.spec import RunSpec
    from dynmb.schedule.io import sidecar_path

    csv_path = tmp_path / "s.csv"
    csv_path.write_text("0F0,0B0\n")
    spec = RunSpec(run=RunConfig(), out_dir=str(tmp_path), run_id="r", schedule=str(csv_path))
    assert schedule_label(spec) == "file"
    sidecar_path(csv_path).write_text("{}")
    assert schedule_label(spec) == spec.run.pipeline.schedule == "1f1b"
    assert schedule_label(RunSpec(run=RunConfig(), out_dir=str(tmp_path), run_id="r")) == "1f1b"
