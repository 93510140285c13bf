"""Friendly output of the commands: fixed-point numbers and sizes in plan output, one-line errors
with plain numbers, memory-model files refused on load naming the file."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from dynmb.cli import main
from dynmb.cli.main import _one_line

PLAN = ["plan", "--model", "tiny", "--dataset", "gsm8k", "--global-batch", "16", "--stages", "2",
        "--memory-limit", "1GiB", "--method", "dynamic"]


def test_plan_prints_fixed_point_numbers_and_sizes(capsys):
    assert main(PLAN) == 0
    out = capsys.readouterr().out
    values = dict(line.split(": ", 1) for line in (ln.strip() for ln in out.splitlines()) if ": " in line)
    assert values["memory_limit_bytes"] == "1.00GiB"
    assert re.fullmatch(r"\[\d+\.\d\d[MK]iB, \d+\.\d\d[MK]iB\]", values["pred_peak_bytes"])
    assert re.fullmatch(r"\d+\.\d{3}", values["pred_step_s"]) and re.fullmatch(r"0\.\d{4}", values["mean_bubble"])
    assert not re.search(r"\de[+-]\d", out) and "np." not in out
    assert main([*PLAN, "--json"]) == 0                     # --json keeps the raw numbers
    summary = json.loads(capsys.readouterr().out)
    assert summary["memory_limit_bytes"] == 2**30 and isinstance(summary["pred_step_s"], float)


def test_error_lines_show_numpy_scalars_as_numbers():
    msg = f"stage {np.int64(3)!r} of {[np.int64(1), np.float64(0.5)]}\nnext line"
    assert _one_line(msg) == "stage 3 of [1, 0.5] next line"


@pytest.mark.parametrize("key,value,match", [("act_coef", float("nan"), "finite"),
                                             ("transient_coef", -1.0, "non-negative"),
                                             ("state_bytes", float("inf"), "finite")])
def test_bad_memory_model_file_is_refused_naming_the_file(tmp_path, capsys, key, value, match):
    from dynmb.core.config import ModelConfig
    from dynmb.memory.model import MemoryModel
    d = MemoryModel.analytic(ModelConfig.preset("tiny"), 2).to_dict()
    d[key][1] = [value] * 3 if isinstance(d[key][1], list) else value
    path = tmp_path / "bad-mem.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=match) as e:
        MemoryModel.load(path)
    assert str(e.value).startswith(f"{path}:") and "\n" not in str(e.value)
    assert main([*PLAN, "--memory-model", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err
