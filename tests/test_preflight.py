"""What ``plan`` refuses, ``run`` and ``compare`` refuse before torchrun starts, in one line (issue 40, item 6),
and the odd inputs that were taken silently: each case is refused with one line, exit 2, nothing written."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from dynmb.api.collate import CollateError, collate
from dynmb.api.sampler import DynamicBatchSampler
from dynmb.cli import main
from dynmb.cli.flags import virtual_enable
from dynmb.cli.outcome import run_summary
from dynmb.core.config import PipelineConfig, RunConfig, model_config
from dynmb.io.results import write_table
from dynmb.runtime.preflight import check_stages
from dynmb.runtime.spec import RunSpec

TINY = ["--model", "tiny", "--dataset", "gsm8k", "--global-batch", "8", "--steps", "1", "--warmup", "0"]


def _refused(argv: list[str], capsys) -> str:
    """Run ``dynmb argv``: it must exit 2 with one line on stderr; returns that line."""
    try:
        rc = main(argv)
    except SystemExit as e:               # argparse's refusals
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("dynmb compare: ") or "error" in ln]
    lines = [ln for ln in lines if "stand-in(s)" not in ln]     # the once-said notice of a model without a fit
    assert len(lines) == 1 and "Traceback" not in err, err          # (a compare's header line may come first)
    return lines[0]


def test_an_empty_stage_split_is_refused(capsys, tmp_path) -> None:
    line = _refused(["plan", "--dataset", "gsm8k", "--stage-split", "", "-o", str(tmp_path / "p.json")], capsys)
    assert "--stage-split" in line and "empty" in line


def test_a_plan_run_refuses_another_stage_split(capsys, tmp_path) -> None:
    plan = tmp_path / "p.json"
    assert main(["plan", "--model", "tiny", "--dataset", "gsm8k", "--global-batch", "8", "--memory-limit", "64MiB",
                 "--stage-split", "3,1", "-o", str(plan)]) == 0
    capsys.readouterr()
    line = _refused(["run", "--plan", str(plan), "--stage-split", "2,2", "--out", str(tmp_path / "r")], capsys)
    assert "--stage-split 2,2 conflicts with the plan" in line and "3,1" in line
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("flags, says", [
    (["--memory-limit", "-1GiB"], "cannot parse memory size '-1GiB'"),
    (["--dp", "2", "--global-batch", "1"], "--global-batch 1 is smaller than --dp 2"),
    (["--memory-limit", "1KiB"], "below the model states"),                      # the launcher's plan of step 0
    (["--model", "tiny:max_seq_len=16", "--memory-limit", "64MiB"], "trace rows"),  # rows, not batch positions
    (["--model", "tests.bad_factories:raising"], "the factory raised RuntimeError: the checkpoint shard is missing"),
])
def test_run_refuses_before_torchrun(flags: list[str], says: str, capsys, tmp_path) -> None:
    out = tmp_path / "r"
    line = _refused(["run", *TINY, *flags, "--out", str(out)], capsys)
    assert says in line
    assert not out.exists()


def test_a_stage_that_is_not_a_stage_module_is_refused_naming_the_rank() -> None:
    from tests.bad_factories import not_stages

    cfg = RunConfig(model=not_stages().config, pipeline=PipelineConfig(num_stages=2, memory_limit_bytes=2**26))
    spec = RunSpec.create(cfg, "unused", model_factory="tests.bad_factories:not_stages")
    with pytest.raises(ValueError, match=r"rank 0: build_stage\(0, 2\) returned a dict, not a stage module"):
        check_stages(spec)
    check_stages(RunSpec.create(RunConfig(model=model_config("tiny"), pipeline=PipelineConfig(num_stages=2)),
                                "unused", model_factory="tests.bad_factories:tiny"))   # a good one passes


def test_a_folder_with_another_jobs_tables_is_refused_unless_appending(capsys, tmp_path) -> None:
    out = tmp_path / "r"
    write_table(pd.DataFrame([dict(run_id="x", method="fixed", dataset="d", step=0, step_s=1.0, pred_step_s=1.0,
                                   real_tokens=1, computed_tokens=1, tokens_per_s=1.0, num_microbatches=1)]),
                out / "steps.csv")
    for verb in (["run", *TINY], ["compare", *TINY]):
        line = _refused([*verb, "--out", str(out)], capsys)
        assert "--out" in line and "--append" in line
    assert sorted(p.name for p in out.iterdir()) == ["steps.csv", "steps.parquet"]


def test_the_sampler_refuses_fractional_counts() -> None:
    with pytest.raises(ValueError, match="num_replicas must be a whole number, got 2.5"):
        DynamicBatchSampler(np.full(16, 10), 8, model="tiny", num_stages=1, memory_limit="64MiB", num_replicas=2.5)


def test_collate_refuses_a_token_list_longer_than_the_sampler_was_told() -> None:
    lengths = [22, 30, 12, 40]
    sampler = DynamicBatchSampler(lengths, 4, model="tiny", num_stages=1, memory_limit="64MiB", shuffle=False)
    mb = next(iter(sampler))
    tokens = [np.arange(n + 1) for n in lengths]                # a length's tokens, then the end-of-text id
    collate(tokens, mb)                                         # the lengths it was told: fine
    tokens[int(mb.indices[0])] = np.arange(62)
    with pytest.raises(CollateError, match="has 62 ids, the sampler was given length"):
        collate(tokens, mb)


def test_virtual_auto_asks_only_for_what_is_missing() -> None:
    from argparse import Namespace

    asked = virtual_enable(Namespace(cost_model=None, dataset="sharegpt", global_batch=16))
    assert "--cost-model" in asked and "--dataset" not in asked and "--global-batch" not in asked


def test_run_says_the_gradients_were_checked(tmp_path) -> None:
    write_table(pd.DataFrame([dict(run_id="a", step=k, warmup=False, step_s=1.0, pred_step_s=1.0, tokens_per_s=5.0,
                                   mean_bubble=0.1, verified=True) for k in range(3)]), tmp_path / "steps.csv")
    assert "gradients checked against a single-process reference: 3 of 3" in run_summary(tmp_path, "a")


def test_schedule_names_an_unknown_kind_without_a_note_first(capsys, tmp_path) -> None:
    plan = tmp_path / "p.json"
    assert main(["plan", "--dataset", "gsm8k", "--global-batch", "8", "-o", str(plan)]) == 0
    capsys.readouterr()
    line = _refused(["schedule", "--plan", str(plan), "--kind", "1fb1", "-o", str(tmp_path / "s.csv")], capsys)
    assert "unknown schedule kind '1fb1'" in line and json.loads(plan.read_text())


@pytest.mark.parametrize("flags, says", [
    (["--memory-limit", "1KiB"], "below the model states"),
    (["--model", "tests.bad_factories:not_stages", "--methods", "fixed,dynamic", "--no-fixed-best"],
     "returned a dict, not a stage module"),
])
def test_compare_refuses_before_torchrun_and_leaves_no_folder(flags: list[str], says: str, capsys, tmp_path) -> None:
    out = tmp_path / "c"
    line = _refused(["compare", *TINY, *flags, "--out", str(out)], capsys)
    assert says in line and not out.exists()
