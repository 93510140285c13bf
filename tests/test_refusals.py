"""What ``dynmb plan`` refuses, ``run`` and ``compare`` refuse too, before torchrun starts and before
anything is written (``dynmb.planning.spec_check``); bad input is one line, exit 2, no traceback; a
disk-full write names the file and never leaves a run saying ``ok``."""

from __future__ import annotations

import errno
import json
import pathlib
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from dynmb.cli import main
from dynmb.core.config import RunConfig
from dynmb.planning.spec_check import check_plan_spec
from dynmb.core.planspec import PlanSpec
from dynmb.runtime import launch
from dynmb.runtime.processes import Ended
from dynmb.runtime.spec import JobSpec, RunSpec
from dynmb.schedule.kinds import ScheduleKind, get_kind, register_kind, unregister_kind


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    """(exit code, stderr) of ``dynmb argv`` in this process (an argparse error exits too)."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = int(e.code or 0)
    return rc, capsys.readouterr().err


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err and "usage:" not in err, err
    return lines[0]


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if torchrun would start (run's and compare's launchers), and say CUDA is absent."""
    def refuse(*_a, **_k):
        raise AssertionError("torchrun started")
    monkeypatch.setattr("dynmb.cli.run.run_job", refuse)
    monkeypatch.setattr("dynmb.jobs.compare.launch_job", refuse)
    monkeypatch.setattr("dynmb.runtime.device.cuda_available", lambda: False)


REFUSED = [
    (["--oversize", "split", "--schedule", "memory-aware"], "--oversize split"),
    (["--virtual", "2", "--schedule", "1f1b"], "--virtual 2"),
    (["--backend", "nccl"], "CUDA is not available"),
    (["--device", "cuda"], "CUDA is not available"),
    (["--pack-len", "100"], "--pack-len 100"),
]


@pytest.mark.parametrize("flags,says", REFUSED)
def test_run_refuses_what_plan_refuses_before_anything_starts(flags, says, tmp_path, capsys, no_launch):
    out = tmp_path / "out"
    rc, err = _cli(["run", *flags, "--out", str(out)], capsys)
    assert rc == 2 and says in _one_line(err)
    assert not out.exists()                          # no spec.json, no errors/, no runs row


@pytest.mark.parametrize("flags,says", [
    (["--oversize", "split", "--schedule", "memory-aware"], "--oversize split"),
    (["--virtual", "2", "--schedule", "zb"], "--virtual 2"),
    (["--device", "cuda"], "CUDA is not available"),
    (["--methods", "packed", "--pack-len", "100000"], "pack_len 100000"),
])
def test_compare_refuses_before_its_folder_is_made(flags, says, tmp_path, capsys, no_launch):
    out = tmp_path / "out"
    rc, err = _cli(["compare", *flags, "--out", str(out)], capsys)
    assert rc == 2 and says in _one_line(err)
    assert not out.exists()


def test_plan_run_and_compare_refuse_with_the_same_line(tmp_path, capsys, no_launch):
    flags = ["--oversize", "split", "--global-batch", "8"]
    lines = [_one_line(_cli([verb, *flags, kind_flag, "memory-aware", *extra], capsys)[1]).split(": error: ", 1)[1]
             for verb, kind_flag, extra in (("plan", "--schedule-kind", []),
                                            ("run", "--schedule", ["--out", str(tmp_path / "r")]),
                                            ("compare", "--schedule", ["--out", str(tmp_path / "c")]))]
    assert lines[0] == lines[1] == lines[2]


def test_the_checks_read_the_kinds_traits_not_their_names():
    """A kind registered with ``slices`` / ``virtual_stages`` is admitted at once; one without is not."""
    base = get_kind("1f1b")
    try:
        register_kind(ScheduleKind(name="test-slicer", build=base.build, window=base.window, slices=True))
        register_kind(ScheduleKind(name="test-plain", build=base.build, window=base.window))
        check_plan_spec(PlanSpec(schedule_kind="test-slicer", oversize="split"))
        with pytest.raises(ValueError, match="cannot run slices.*test-slicer"):
            check_plan_spec(PlanSpec(schedule_kind="test-plain", oversize="split"))
        with pytest.raises(ValueError, match="--virtual 2.*interleaved"):
            check_plan_spec(PlanSpec(schedule_kind="test-slicer", num_stages=4, virtual=2))
    finally:
        unregister_kind("test-slicer")
        unregister_kind("test-plain")
    check_plan_spec(PlanSpec(schedule_kind="interleaved", num_stages=4, virtual=2))


def test_compare_gives_pack_len_to_the_packed_cases_only(tmp_path):
    from dynmb.jobs.compare import CompareSettings, prepare_compare

    job = prepare_compare(CompareSettings(methods=("packed", "dynamic"), pack_len=512, device="cpu",
                                          out=str(tmp_path / "c")))
    assert {c.method: c.spec.run.pack_len for c in job.cases} == {"packed": 512, "dynamic": None}


@pytest.fixture
def samples_csv(tmp_path):
    def write(time_value: str) -> Path:
        rows = ["stage,op,rows,padded_len,time_s"] + [f"{s},{op},{b},64,{0.1 * b}" for s in (0, 1)
                                                      for op in "FB" for b in (1, 2, 4)]
        rows[3] = f"0,F,4,64,{time_value}"
        path = tmp_path / "samples.csv"
        path.write_text("\n".join(rows) + "\n")
        return path
    return write


@pytest.mark.parametrize("value,says", [("abc", "non-numeric"), ("", "empty (NaN)"), ("-0.5", "negative")])
def test_fit_refuses_bad_times_naming_the_file_and_line(value, says, samples_csv, tmp_path, capsys):
    path = samples_csv(value)
    rc, err = _cli(["fit", str(path), "--folds", "2", "-o", str(tmp_path / "m.json")], capsys)
    line = _one_line(err)
    assert rc == 2 and says in line and str(path) in line and "line(s) 4" in line
    assert not (tmp_path / "m.json").exists()


@pytest.mark.parametrize("argv,says", [
    (["profile", "--threads", "0", "--quick", "-o", "{tmp}/p.csv"], "--threads: must be >= 1"),
    (["memory", "--stages", "0", "--quick", "-o", "{tmp}/m.json"], "--stages: must be >= 1"),
    (["fit", "{tmp}/s.csv", "--folds", "1", "-o", "{tmp}/m.json"], "--folds: must be >= 2"),
    (["plan", "--global-batch", str(10**12)], "--global-batch: must be at most"),
    (["run", "--global-batch", str(10**12), "--out", "{tmp}/o"], "--global-batch: must be at most"),
    (["memory", "--device", "cuda", "--quick", "-o", "{tmp}/m.json"], "--device cuda: CUDA is not available"),
    (["profile", "--device", "cuda", "--quick", "-o", "{tmp}/p.csv"], "--device cuda: CUDA is not available"),
])
def test_bad_numbers_and_devices_are_one_line(argv, says, tmp_path, capsys, no_launch):
    rc, err = _cli([a.format(tmp=tmp_path) for a in argv], capsys)
    assert rc == 2 and says in _one_line(err)
    assert list(tmp_path.iterdir()) == []


def test_an_argparse_error_is_one_line_from_the_shell():
    out = subprocess.run([sys.executable, "-m", "dynmb.cli", "plan", "--stages", "0"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 2 and _one_line(out.stderr).startswith("dynmb plan: error: argument --stages")


def _disk_full(self, *_a, **_k):
    raise OSError(errno.ENOSPC, "No space left on device", str(self))


def test_a_full_disk_names_the_destination_not_the_temp_file(tmp_path, capsys, monkeypatch):
    target = tmp_path / "p.json"
    monkeypatch.setattr(pathlib.Path, "write_text", _disk_full)
    rc, err = _cli(["plan", "--global-batch", "8", "-o", str(target)], capsys)
    line = _one_line(err)
    assert rc == 2 and f"{target}: No space left on device" in line and ".tmp" not in line
    assert list(tmp_path.iterdir()) == []             # the temporary file is gone too


def test_a_table_write_on_a_full_disk_names_the_table(tmp_path, monkeypatch):
    from dynmb.io.results import TableWriter

    monkeypatch.setattr(pd.DataFrame, "to_csv", lambda self, path, **_k: _disk_full(Path(path)))
    with pytest.raises(OSError) as e:
        TableWriter(tmp_path).append("memory", [{"run_id": "r", "step": 0, "stage": 0, "peak_bytes": 1,
                                                 "limit_bytes": 2}])
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "memory.csv")


class _Exited:
    returncode = 1


def test_a_job_that_fails_after_rank_0_said_ok_is_not_left_ok(tmp_path):
    """The worker wrote ``ok``, then its last write failed (ENOSPC) and the command exits 1: the
    launcher's status says failed."""
    spec = RunSpec.create(RunConfig(), tmp_path, run_id="r1")
    pd.DataFrame([{"run_id": "r1", "git_sha": "x", "torch_version": "x", "backend": "gloo", "device": "cpu",
                   "world_size": 2, "date": "d", "status": "ok", "error": ""}]).to_csv(tmp_path / "runs.csv",
                                                                                        index=False)
    (tmp_path / "errors").mkdir()
    (tmp_path / "errors" / "rank0.txt").write_text(f"rank: 0\nerror: OSError: [Errno 28] No space left on device: "
                                                   f"'{tmp_path / 'steps.parquet'}'\n")
    result = launch._finish(JobSpec.single(spec), _Exited(), Ended("exited"), "", 60.0)
    runs = pd.read_csv(tmp_path / "runs.csv")
    assert result.returncode == 1
    assert runs["status"].tolist() == ["failed"] and "No space left" in runs["error"][0]


@pytest.mark.parametrize("content,says", [(b"length\n100\n\xff200\n", "not UTF-8 text (byte 11)"),
                                          (b"\xff\xfel\x00e\x00n\x00\n\x00", "UTF-16 text")])
def test_an_input_that_is_not_utf8_is_named(content, says, tmp_path, capsys, no_launch):
    trace = tmp_path / "trace.csv"
    trace.write_bytes(content)
    for argv in (["plan"], ["run", "--out", str(tmp_path / "o")], ["compare", "--out", str(tmp_path / "c")]):
        rc, err = _cli([*argv, "--lengths", str(trace)], capsys)
        line = _one_line(err)
        assert rc == 2 and f"{trace}: {says}" in line
    assert [p.name for p in tmp_path.iterdir()] == ["trace.csv"]


def test_a_packed_plan_with_slices_reports_its_pack_len(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    trace.write_text("length\n100\n200\n3000\n150\n")
    rc = main(["plan", "--lengths", str(trace), "--global-batch", "4", "--method", "packed", "--pack-len", "100",
               "--oversize", "split", "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert rc == 0 and summary["sliced"] > 0 and summary["pack_len"] == 100
