"""``embedding="auto"`` chosen on the workload's sample batches (``embedding_choice.choose_on_samples``) and
``dynmb compare --embedding``.

Quick: given a workload and a global batch size the ``Planner`` chooses at construction, on the sample batches the
layout searches plan, so two planners whose first batches the first-batch rule places differently keep one place
(the constructed case: the first-batch rule puts batch ``B0`` first and ``B7`` last, the samples say last); the choice
is the smaller mean simulated step per real token of those batches, recomputed here from the fixed places' planners
(hypothesis); without a global batch size the first-batch rule stays. The command line: ``dynmb plan --step 0``,
``--step 1`` and ``dynmb run`` (stopped at the launch) put the embedding in the same place where the first-batch rule
put step 0 last and step 1 first; ``compare --embedding`` first (default) / last / auto reaches every case's spec, a
bad value is one line naming the flag. Slow, 2 gloo ranks: ``compare --embedding last`` with float64 gradients equal
to the one-process reference. Each test but the first-batch one fails on the code before (the planner chose at its
first plan on that batch, the verbs on the first step's batch, and ``compare`` had no ``--embedding``).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dynmb
from dynmb.data import sample_batch
from dynmb.planning.embedding_choice import Placement, choose_embedding

WORKLOAD = np.random.default_rng(0).integers(40, 400, 64)
B0 = np.random.default_rng(100).choice(WORKLOAD, 64)
B7 = np.random.default_rng(107).choice(WORKLOAD, 64)


def _planner(limit: str, embedding: str | None, P: int = 4, **kw) -> dynmb.Planner:
    return dynmb.Planner(model="llama-tiny", num_stages=P, memory_limit=limit, schedule="1f1b", stage_split="auto",
                         workload=WORKLOAD, embedding=embedding, **kw)


def _fixed(limit: str, P: int = 4) -> list[dynmb.Planner]:
    """One planner per place, each with its own layout, as ``auto`` resolves them (workload and global batch)."""
    return [_planner(limit, place, P, global_batch=64) for place in ("first", "last")]


def _placements(planners: list[dynmb.Planner]) -> list[Placement]:
    return [Placement(spec=p.spec, model_cfg=p.model_cfg, models=p.models) for p in planners]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_planner_keeps_the_sample_choice_whatever_its_first_batch():
    """24 MiB over 4 stages: the first-batch rule puts ``B0`` first and ``B7`` last; on the sample batches last is
    faster, chosen at construction, and both planners plan their first batch there, ``B0``'s step the fixed last
    planner's."""
    fixed = _fixed("24MiB")
    by_batch = {name: choose_embedding(b, _placements(fixed))[0].place for name, b in (("B0", B0), ("B7", B7))}
    assert by_batch == {"B0": "first", "B7": "last"}                    # the premise: the first batch decides
    for batch in (B0, B7):
        planner = _planner("24MiB", None, global_batch=64)              # the default under stage_split="auto"
        choice = planner.embedding_choice
        assert choice is not None and choice.place == "last" and choice.batches == 2 and "sample" in choice.why
        assert planner.spec.embedding == "last" and planner._weighed == ()          # chosen before any plan
        step = planner.plan(batch)
        assert step.plan.spec.embedding == "last" and planner.embedding_choice is choice
    assert planner.plan(B0).sim.makespan_s == fixed[1].plan(B0).sim.makespan_s


@settings(max_examples=4, deadline=None)
@given(limit=st.sampled_from(["24MiB", "28MiB", "32MiB", "48MiB"]), P=st.sampled_from([2, 4]))
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_sample_choice_is_the_smaller_mean_step_per_real_token(limit, P):
    """The place kept is the one whose sample batches (the workload's draws of the global batch, stream 0, steps 0
    and 1) plan to the smaller mean simulated step per real token under its own layout, ``first`` on a tie."""
    fixed = _fixed(limit, P)
    samples = [sample_batch(WORKLOAD, 64, 0, step=k) for k in range(2)]
    scores, steps = [], []
    for planner in fixed:
        planned = [planner.plan(b) for b in samples]
        steps.append(float(np.mean([s.sim.makespan_s for s in planned])))
        scores.append(float(np.mean([s.sim.makespan_s * f.plan.real_tokens / s.plan.real_tokens
                                     for s, f in zip(planned, [fixed[0].plan(b) for b in samples])])))
    auto = _planner(limit, "auto", P, global_batch=64)
    choice = auto.embedding_choice
    assert choice is not None and (choice.first_s, choice.last_s) == pytest.approx(tuple(steps), rel=1e-12)
    assert choice.place == ("last" if scores[1] < scores[0] else "first") == auto.spec.embedding


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_without_a_global_batch_size_the_first_batch_chooses():
    planner = _planner("24MiB", None)
    assert planner.embedding_choice is None and planner.spec.embedding == "first"
    planner.plan(B0)
    assert planner.embedding_choice is not None and planner.embedding_choice.batches == 1


# ------------------------------------------------------------------ the command line

LENGTHS_256 = np.random.default_rng(1).integers(40, 400, 256)


def _lengths_file(tmp_path) -> str:
    path = tmp_path / "l256.csv"
    path.write_text("length\n" + "\n".join(map(str, LENGTHS_256)) + "\n")
    return str(path)


CLI_CELL = ["--model", "llama-tiny", "--stages", "4", "--memory-limit", "24MiB", "--global-batch", "48",
            "--stage-split", "auto", "--schedule", "1f1b"]
"""The first-batch rule puts step 0's batch last (0.1733 against 0.1735 s) and step 1's first; the sample batches
say first (0.17347 against 0.17373 s mean)."""


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_plan_at_any_step_and_run_put_the_embedding_in_one_place(tmp_path, capsys, monkeypatch):
    import json

    from dynmb.cli import run as run_verb
    from dynmb.cli.main import main

    lengths = _lengths_file(tmp_path)
    places = []
    for step in ("0", "1"):
        assert main(["plan", *CLI_CELL, "--lengths", lengths, "--step", step, "--json"]) == 0
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert "sample batches" in summary["embedding_choice"]
        places.append(summary["embedding"])
    launched = []
    monkeypatch.setattr(run_verb, "run_job", lambda job, nproc: launched.append(job) or SimpleNamespace(
        launch=SimpleNamespace(interrupted=False), returncode=7))
    assert main(["run", *CLI_CELL, "--lengths", lengths, "--steps", "1", "--out", str(tmp_path / "run")]) == 7
    assert "sample batches" in capsys.readouterr().err
    places.append(launched[0].cases[0].run.spec.embedding)
    assert places == ["first"] * 3


def _compare_job(tmp_path, monkeypatch, *flags: str) -> tuple[int, list]:
    from dynmb.cli import compare as compare_verb
    from dynmb.cli.main import main

    jobs: list = []
    monkeypatch.setattr(compare_verb, "run_compare_job", lambda job, **kw: jobs.append(job) or SimpleNamespace(
        launch=None, returncode=7, failures=()))
    code = main(["compare", "--model", "llama-tiny", "--lengths", _lengths_file(tmp_path), "--global-batch", "48",
                 "--stages", "4", "--memory-limit", "24MiB", "--methods", "dynamic,packed", "--no-fixed-best",
                 "--device", "cpu", "--out", str(tmp_path / "cmp"), "--append", *flags])
    return code, jobs


@pytest.mark.parametrize("flags,place", [((), "first"), (("--embedding", "last"), "last"),
                                         (("--embedding", "auto", "--stage-split", "auto"), "first")])
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_compare_runs_every_case_in_the_place_given_or_chosen(tmp_path, monkeypatch, capsys, flags, place):
    """Default ``first`` (as before the flag); ``last``; ``auto``: chosen once before any worker, on the sample
    batches, with dynamic's settings (the ``plan`` cell above: first)."""
    code, jobs = _compare_job(tmp_path, monkeypatch, *flags)
    assert code == 7 and len(jobs) == 1
    assert {case.spec.run.spec.embedding for case in jobs[0].cases} == {place}
    err = capsys.readouterr().err
    assert ("embedding auto: first" in err and "sample batches" in err) == ("auto" in flags)


@pytest.mark.parametrize("verb", ["compare", "plan", "run"])
def test_a_bad_embedding_value_is_one_line_naming_the_flag(verb, capsys):
    from dynmb.cli.main import main

    with pytest.raises(SystemExit) as stop:
        main([verb, "--embedding", "middle"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--embedding" in err[0] and "invalid choice: 'middle'" in err[0]


def test_compare_refuses_the_embedding_last_on_one_rank_before_any_worker(tmp_path, capsys):
    from dynmb.cli.main import main

    out = tmp_path / "cmp"
    assert main(["compare", "--model", "llama-tiny", "--stages", "1", "--embedding", "last", "--device", "cpu",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "embedding" in err[0] and not out.exists()


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_compare_with_the_embedding_last_has_exact_fp64_gradients(tmp_path):
    """``compare --embedding last`` on 2 gloo ranks, float64, every case verified against the one-process
    reference (``RunSpec.verify``): every parameter's gradient equal, the embeds on rank 1."""
    from dynmb.cli.compare import settings_from_args
    from dynmb.cli.main import build_parser
    from dynmb.io.results import load_results
    from dynmb.jobs.compare import prepare_compare, run_compare_job
    from dynmb.runtime.checks import VERIFY_RTOL_FP64

    out = tmp_path / "cmp"
    args = build_parser().parse_args([
        "compare", "--model", "llama-tiny:dtype=float64", "--stages", "2", "--memory-limit", "16MiB", "--embedding",
        "last", "--dataset", "gsm8k", "--global-batch", "12", "--seed", "3", "--steps", "1", "--warmup", "0",
        "--methods", "dynamic,fixed", "--no-fixed-best", "--device", "cpu", "--out", str(out)])
    job = prepare_compare(settings_from_args(args))
    job = replace(job, cases=tuple(replace(c, spec=replace(c.spec, verify=True)) for c in job.cases))
    result = run_compare_job(job, quiet=True, progress=False)
    assert result.returncode == 0, result.failures
    t = load_results(out)
    steps, acts = t["steps"], t["actions"]
    assert len(steps) == 2 and steps["verified"].all() and (steps["grad_rel_err"] <= VERIFY_RTOL_FP64).all()
    assert set(acts[acts.stage == 0]["rank"]) == {1}                   # the embeds on the last rank
