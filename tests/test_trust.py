"""Results you can trust (issue 13): files are validated on load and user errors are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynmb.core.types import Microbatch, Plan, PlanError


def _plan(seq_groups, *, limit=1 << 30, peaks=(1000, 1000)) -> Plan:
    mbs = [Microbatch(seq_ids=g, lengths=[10] * len(g), padded_len=10, batch=len(g)) for g in seq_groups]
    return Plan(microbatches=tuple(mbs), method="dynamic", num_stages=2, memory_limit_bytes=limit,
                num_sequences=4, predictions={"pred_peak_bytes": list(peaks)})


@pytest.mark.parametrize("groups, word", [([[0, 1], [1, 2, 3]], "repeated"), ([[0, 1], [2]], "missing")])
def test_plan_load_refuses_repeated_or_lost_sequences(tmp_path, groups, word):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_plan(groups).to_dict()))
    with pytest.raises(PlanError) as e:
        Plan.load(path)
    msg = str(e.value)
    assert str(path) in msg and word in msg and "\n" not in msg


def test_plan_load_refuses_a_row_longer_than_its_padded_len(tmp_path):
    d = _plan([[0, 1], [2, 3]]).to_dict()
    d["microbatches"][0]["lengths"] = [10, 30]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(d))
    with pytest.raises(PlanError, match="rows.json"):
        Plan.load(path)


def test_plan_load_refuses_a_plan_over_its_limit_unless_allowed(tmp_path):
    path = tmp_path / "over.json"
    _plan([[0, 1], [2, 3]], limit=1500, peaks=(1000, 2000)).save(path)
    with pytest.raises(PlanError, match="over.json.*exceeds"):
        Plan.load(path)
    assert Plan.load(path, allow_over_limit=True).num_microbatches == 2
    good = tmp_path / "good.json"
    _plan([[0, 1], [2, 3]]).save(good)
    assert Plan.load(good).num_sequences == 4


def test_cli_simulate_of_a_plan_losing_sequences_is_exit_2(tmp_path, capsys):
    from dynmb.cli import main
    path = tmp_path / "lost.json"
    _plan([[0, 1], [2]]).save(path)
    assert main(["simulate", "--plan", str(path), "--schedule", str(tmp_path / "s.csv"), "--model", "tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lost.json" in err[0]


def test_simulate_refuses_the_unreordered_plan_of_a_reordered_schedule(tmp_path, capsys):
    from dynmb.cli import main
    from dynmb.schedule import from_csv
    plan_path, sched = tmp_path / "plan.json", tmp_path / "schedule.csv"
    _plan([[0], [1], [2, 3]]).save(plan_path)
    assert main(["schedule", "--plan", str(plan_path), "--reorder", "descending", "--model", "tiny",
                 "-o", str(sched)]) == 0
    meta = json.loads((tmp_path / "schedule.meta.json").read_text())
    reordered = Plan.load(meta["plan"])
    assert meta["plan_digest"] == reordered.digest() != Plan.load(plan_path).digest()
    assert from_csv(sched, num_microbatches=3).num_microbatches == 3      # the CSV stays torch's format
    assert "digest" not in sched.read_text()
    capsys.readouterr()
    assert main(["simulate", "--plan", str(plan_path), "--schedule", str(sched), "--model", "tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "plan.json" in err[0] and "schedule.csv" in err[0] and meta["plan"] in err[0]
    assert main(["simulate", "--plan", meta["plan"], "--schedule", str(sched), "--model", "tiny"]) == 0


def _one_error_line(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.strip().splitlines()
           if "stand-in(s)" not in ln]                  # the once-said notice of a model without a fit

    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_plan_into_an_unwritable_path_is_one_line_and_leaves_no_temp_file(tmp_path, capsys):
    from dynmb.cli import main
    target = tmp_path / "adir"
    target.mkdir()
    (target / "keep").write_text("x")                  # a non-empty folder cannot be replaced by a file
    argv = ["plan", "--model", "tiny", "--dataset", "gsm8k", "--global-batch", "8", "--stages", "2"]
    assert main([*argv, "-o", str(target)]) == 2
    assert str(target) in _one_error_line(capsys)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["adir", "keep"]
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    assert main([*argv, "-o", str(blocker / "p.json")]) == 2
    assert "afile" in _one_error_line(capsys)


def test_a_corrupt_cost_or_memory_model_file_is_one_line_naming_it(tmp_path, capsys):
    from dynmb.cli import main
    bad = tmp_path / "garbage.json"
    bad.write_text("")
    argv = ["plan", "--model", "tiny", "--dataset", "gsm8k", "--global-batch", "8", "--stages", "2"]
    for flag in ("--cost-model", "--memory-model"):
        assert main([*argv, flag, str(bad)]) == 2
        assert "garbage.json" in _one_error_line(capsys)


@pytest.mark.parametrize("flags", [["--repeats", "0"], ["--warmup", "-1"]])
def test_profile_refuses_zero_repeats_before_writing_anything(tmp_path, capsys, flags):
    from dynmb.cli import main
    out = tmp_path / "samples.csv"
    assert main(["profile", "--model", "tiny", "--stages", "2", "--quick", "--no-memory", *flags, "-o", str(out)]) == 2
    assert "repeats" in _one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_fit_refuses_samples_of_another_architecture_with_the_same_name(tmp_path, capsys):
    from dynmb.cli import main
    from dynmb.core.config import ModelConfig
    from tests.test_costmodel import synthetic_samples
    small = ModelConfig.preset("small")
    samples = synthetic_samples(repeats=2).assign(num_stages=2, **{k: v for k, v in small.to_dict().items()
                                                                  if k not in ("name", "attention")})
    samples.assign(d_model=2 * small.d_model).to_csv(tmp_path / "wide.csv", index=False)
    assert main(["fit", str(tmp_path / "wide.csv"), "--model", "small", "--stages", "2",
                 "-o", str(tmp_path / "c.json")]) == 2
    line = _one_error_line(capsys)
    assert "wide.csv" in line and f"d_model=[{2 * small.d_model}]" in line and "small" in line
    assert not (tmp_path / "c.json").exists()
    samples.to_csv(tmp_path / "ok.csv", index=False)
    assert main(["fit", str(tmp_path / "ok.csv"), "--model", "small", "--stages", "2",
                 "-o", str(tmp_path / "c.json")]) == 0


def test_profile_records_every_model_field():
    from dynmb.core.config import ModelConfig
    from dynmb.measure import profile
    tiny = ModelConfig.preset("tiny")
    samples = profile(tiny, 2, grid=[(1, 8, 1)], repeats=1, warmup=0, memory=False, progress=False)
    for k, v in tiny.to_dict().items():
        col = samples["model" if k == "name" else k]
        assert (col.isna() if v is None else col == v).all(), k


@pytest.mark.parametrize("bad", [-1e-3, float("nan"), float("inf")])
def test_cost_and_memory_model_files_with_bad_coefficients_are_refused(tmp_path, bad):
    from dynmb.core.config import ModelConfig
    from dynmb.costmodel import CostModel
    from dynmb.planning import default_cost_model_path
    from dynmb.memory.model import MemoryModel
    d = json.loads(Path(default_cost_model_path("small", 2)).read_text())
    d["params"]["fits"][0]["coef"]["c1_tok"] = bad
    cm_path = tmp_path / "cm.json"
    cm_path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="cm.json.*c1_tok"):
        CostModel.load(cm_path)
    mm = MemoryModel.analytic(ModelConfig.preset("tiny"), 2).to_dict()
    mm["act_coef"][1][1] = bad
    mm_path = tmp_path / "mm.json"
    mm_path.write_text(json.dumps(mm))
    with pytest.raises(ValueError, match="mm.json.*act_coef"):
        MemoryModel.load(mm_path)
    mm["act_coef"][1][1] = 1.0
    mm_path.write_text(json.dumps(mm))
    assert MemoryModel.load(mm_path).num_stages == 2


def test_unparsable_csv_inputs_are_one_line_naming_the_file(tmp_path, capsys):
    from dynmb.cli import main
    bad = tmp_path / "broken.csv"
    bad.write_text("a,b\n1,2,3,4\n\"unclosed\n")
    assert main(["fit", str(bad), "--model", "small", "-o", str(tmp_path / "c.json")]) == 2
    assert "broken.csv" in _one_error_line(capsys)
    (tmp_path / "other.csv").write_text("x,y\n1,2\n")
    assert main(["fit", str(tmp_path / "other.csv"), "--model", "small", "-o", str(tmp_path / "c.json")]) == 2
    assert "other.csv" in _one_error_line(capsys)
    plan = tmp_path / "plan.json"
    _plan([[0, 1], [2, 3]]).save(plan)
    sched = tmp_path / "sched.csv"
    sched.write_text("rank,0,1\n0,0X0,zz\n")
    assert main(["simulate", "--plan", str(plan), "--schedule", str(sched), "--model", "tiny"]) == 2
    assert "sched.csv" in _one_error_line(capsys)


def test_simulate_takes_a_plan_over_its_limit_only_when_allowed(tmp_path, capsys):
    from dynmb.cli import main
    plan, sched = tmp_path / "over.json", tmp_path / "s.csv"
    _plan([[0, 1], [2, 3]], limit=1500, peaks=(1000, 2000)).save(plan)
    from dynmb.schedule import build_schedule, to_csv
    to_csv(build_schedule("1f1b", 2, 2), sched)
    argv = ["simulate", "--plan", str(plan), "--schedule", str(sched), "--model", "tiny"]
    assert main(argv) == 2
    assert "over.json" in _one_error_line(capsys)
    assert main([*argv, "--allow-over-limit"]) == 0


RUN = ["run", "--model", "tiny", "--global-batch", "4", "--steps", "1", "--warmup", "0"]


@pytest.mark.parametrize("argv, word", [
    ([*RUN, "--method", "dynamc"], "dynamc"),
    ([*RUN, "--schedule", "1f1bb"], "1f1bb"),
    ([*RUN, "--timeout", "-1"], "timeout"),
    ([*RUN, "--timeout", "0"], "timeout"),
    ([*RUN, "--cost-model", "{d}/nosuch.json"], "nosuch.json"),
    ([*RUN, "--memory-model", "{d}/nosuch.json"], "nosuch.json"),
    ([*RUN, "--reorder", "nosuch"], "nosuch"),
    ([*RUN, "--dataset", "nosuch"], "nosuch"),
    ([*RUN, "--lengths", "{d}/nosuch.csv"], "nosuch.csv"),
    ([*RUN, "--plan", "{d}/nosuch.json"], "nosuch.json"),
    (["compare", "--model", "tiny", "--methods", "fixed,dynamc"], "dynamc"),
    (["compare", "--model", "tiny", "--device", "cpu", "--cost-model", "{d}/nosuch.json"], "nosuch.json"),
])
def test_a_typo_in_run_or_compare_is_one_line_before_torchrun_and_writes_no_runs_row(tmp_path, capsys, argv, word):
    """Checked before torchrun starts (issue 13: was 6-37 s and a torchrun traceback later, with a
    ``runs`` row for a run that never ran)."""
    from dynmb.cli import main
    out = tmp_path / "out"
    assert main([a.format(d=tmp_path) for a in argv] + ["--out", str(out)]) == 2
    assert word in _one_error_line(capsys)
    assert not (out / "runs.csv").exists() and not (out / "spec.json").exists()


@pytest.mark.parametrize("verb", [RUN, ["compare", "--model", "tiny", "--device", "cpu"]])
def test_run_into_an_unwritable_folder_is_one_line_before_torchrun(tmp_path, capsys, verb):
    from dynmb.cli import main
    (tmp_path / "afile").write_text("")
    assert main([*verb, "--out", str(tmp_path / "afile" / "out")]) == 2
    assert "afile" in _one_error_line(capsys)
