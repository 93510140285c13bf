"""A results folder has one writer, and a file that is not a whole dynmb table is refused naming it."""

from __future__ import annotations

import pandas as pd
import pytest

from dynmb.io.outdir import lock_out_dir
from dynmb.io.results import ResultsError, TableWriter, load_results

STEP = dict(run_id="r", method="dynamic", dataset="d", step=0, step_s=1.0, pred_step_s=1.0, real_tokens=10,
            computed_tokens=12, tokens_per_s=10.0, num_microbatches=2)


def test_a_foreign_table_is_refused_untouched(tmp_path) -> None:
    foreign = tmp_path / "steps.csv"
    foreign.write_text("a,b\n1,2\n")
    before = foreign.read_bytes()
    with pytest.raises(ResultsError, match=r"steps\.csv: not a dynmb steps table \(no column\(s\) run_id"):
        with lock_out_dir(tmp_path):
            pass
    with pytest.raises(ResultsError, match="steps.csv"):
        TableWriter(tmp_path)
    assert foreign.read_bytes() == before


@pytest.mark.parametrize("content,message", [
    (b"run_id,step\nr,0\nr,", "the last row is cut"),
    ("run_id,step\n".encode("utf-16"), "UTF-16"),
    (b"run_id,step\n\xff\xfe\xfa,1\n", "not UTF-8"),
    (b'run_id,step\n"r,0\n', "not a CSV table"),
])
def test_load_results_names_the_bad_file(tmp_path, content: bytes, message: str) -> None:
    (tmp_path / "memory.csv").write_bytes(content)
    with pytest.raises(ResultsError, match=message) as e:
        load_results(tmp_path)
    assert str(tmp_path / "memory.csv") in str(e.value) and "\n" not in str(e.value)


def test_one_writer_per_folder(tmp_path) -> None:
    with lock_out_dir(tmp_path):
        with pytest.raises(ResultsError, match=r"being written by another dynmb run \(pid \d+"):
            with lock_out_dir(tmp_path):
                pass
    with lock_out_dir(tmp_path):                # released on exit
        TableWriter(tmp_path).append("steps", [STEP])
    assert load_results(tmp_path)["steps"]["run_id"].tolist() == ["r"]
    assert isinstance(load_results(tmp_path)["steps"], pd.DataFrame)


def test_a_second_job_into_a_held_folder_is_refused_before_anything_runs(tmp_path, monkeypatch) -> None:
    import dynmb
    from dynmb.runtime import launch

    monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: pytest.fail("torchrun started"))
    cfg = dynmb.RunConfig(model=dynmb.model_config("tiny"), global_batch=8, steps=1, warmup=0)
    with lock_out_dir(tmp_path):
        with pytest.raises(ResultsError, match="being written by another dynmb run"):
            dynmb.run(cfg, out=tmp_path)
    assert not (tmp_path / "spec.json").exists()


def test_sighup_stops_a_job_and_is_named_as_itself() -> None:
    import os
    import signal
    import time

    from dynmb.runtime.processes import StopSignals

    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.05)
    assert stop.received == signal.SIGHUP        # the job stops as on SIGTERM; its line says SIGHUP (129)
