"""``embedding="auto"`` (``dynmb.planning.embedding_choice``): the token embedding's place chosen by the first batch's
simulated step, each place with its own layout.

Quick: auto picks ``last`` where it is faster and ``first`` where that is (constructed cases; in the ``first`` case
the relief's ``step_proxy`` prefers ``last``, so a choice by the proxy or a fixed place fails one of them), auto's step
equals the faster explicit place's (hypothesis), the fallbacks to ``first`` with their reasons, the default
(``first`` unless ``stage_split="auto"``) bit-equal to an explicit ``first``, the command line's ``--embedding auto``.
Slow, real gloo ranks: ``dynmb run`` with ``--stage-split auto`` (so ``auto`` by default) resolving to ``last`` on 2
ranks, float64 gradients against the single-process reference. Every test here fails on the code before
``embedding="auto"`` (``PlanSpec`` refused ``auto`` and the flag took first / last only).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dynmb
from dynmb.core.config import model_config
from dynmb.memory.model import MemoryModel
from dynmb.planning.memory_split import ReliefInputs, step_proxy

LENGTHS = np.random.default_rng(0).integers(40, 400, 64)


def _planner(model: str, P: int, limit: str, embedding: str | None, **kw) -> dynmb.Planner:
    return dynmb.Planner(model=model, num_stages=P, memory_limit=limit, schedule="1f1b", stage_split="auto",
                         workload=LENGTHS, embedding=embedding, **kw)


def _steps(model: str, P: int, limit: str, lengths: np.ndarray) -> dict[str, float]:
    return {place: _planner(model, P, limit, place).plan(lengths).sim.makespan_s for place in ("first", "last")}


def _proxy(model: str, P: int, limit: str, place: str) -> float:
    """The relief's ``step_proxy`` of ``place`` on its own planner's layout."""
    planner = _planner(model, P, limit, place)
    inputs = ReliefInputs(memory_limit_bytes=planner.memory_limit_bytes, schedule_kind="1f1b", workload=LENGTHS,
                          cost_model=planner.cost_model, embedding=place)
    return step_proxy(planner.model_cfg, planner.num_stages, inputs, int(LENGTHS.mean()))[0]


@pytest.mark.parametrize("model,P,limit,place", [("llama-tiny", 4, "24MiB", "last"),
                                                 ("llama-tiny", 4, "32MiB", "first")])
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_auto_picks_the_place_of_the_faster_simulated_step(model, P, limit, place):
    """24 MiB over 4 stages: ``last`` is faster and chosen; 32 MiB: ``first`` is, and chosen although the proxy (fill
    left out) prefers ``last`` there."""
    steps = _steps(model, P, limit, LENGTHS)
    assert min(steps, key=steps.__getitem__) == place and steps["first"] != steps["last"]
    planner = _planner(model, P, limit, None)                 # the default under stage_split="auto"
    step = planner.plan(LENGTHS)
    choice = planner.embedding_choice
    assert choice is not None and choice.place == place and step.plan.spec.embedding == place
    assert (choice.first_s, choice.last_s) == (steps["first"], steps["last"])
    assert step.sim.makespan_s == steps[place] and planner.spec.embedding == place
    if place == "first":                                      # a choice by the proxy would take last here
        assert _proxy(model, P, limit, "last") < _proxy(model, P, limit, "first")
    again = planner.plan(LENGTHS[::-1])                       # fixed from then on: planned once, in that place
    assert again.plan.spec.embedding == place and planner.embedding_choice is choice


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(4, 40), P=st.sampled_from([2, 3, 4]),
       limit=st.sampled_from(["20MiB", "28MiB", "48MiB"]), hi=st.sampled_from([200, 600]))
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_auto_is_the_faster_place_never_the_slower(seed, n, P, limit, hi):
    lengths = np.random.default_rng(seed).integers(8, hi, n)
    try:
        steps = _steps("llama-tiny", P, limit, lengths)
    except ValueError:                                        # one place cannot plan the batch: auto takes the other
        return
    auto = _planner("llama-tiny", P, limit, "auto").plan(lengths)
    assert auto.sim.makespan_s == min(steps.values()) <= max(steps.values())
    assert auto.plan.spec.embedding == ("last" if steps["last"] < steps["first"] else "first")


@pytest.mark.parametrize("case", ["tied", "one rank", "memory model", "zb-v"])
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_where_last_cannot_run_auto_is_first_with_the_reason(case, caplog):
    kw: dict = dict(model="llama-tiny", num_stages=2, memory_limit="64MiB", stage_split="auto", workload=LENGTHS)
    why = {"tied": "tied embedding", "one rank": "one pipeline rank", "memory model": "fitted memory model",
           "zb-v": "zb-v schedule"}[case]
    if case == "tied":
        kw["model"] = replace(model_config("llama-tiny"), tie_embeddings=True)
    elif case == "one rank":
        kw["num_stages"] = 1
    elif case == "memory model":
        kw.update(memory_model=MemoryModel.analytic(model_config("llama-tiny"), 2), stage_split="even",
                  embedding="auto")
    else:
        kw.update(num_stages=4, virtual=2, schedule="zb-v", stage_split="even", embedding="auto")
    with caplog.at_level(logging.INFO, logger="dynmb.planning.embedding_choice"):
        planner = dynmb.Planner(**kw)
        planner.plan(LENGTHS[:16])
    choice = planner.embedding_choice
    assert choice is not None and choice.place == "first" and why in choice.why
    assert choice.first_s is None and choice.last_s is None and planner.spec.embedding == "first"
    said = [r.getMessage() for r in caplog.records if why in r.getMessage()]
    assert len(said) <= 1                                     # once per process (an earlier test may have said it)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_default_is_first_unless_the_split_is_auto():
    """``stage_split="even"``: the default plans bit-equal to an explicit ``first`` (no choice made, no ``embedding``
    key in the plan's JSON); ``stage_split="auto"`` with ``embedding="first"`` plans as the old default did."""
    cfg = "llama-tiny"
    plain = dynmb.Planner(model=cfg, num_stages=4, memory_limit="24MiB", schedule="1f1b")
    first = dynmb.Planner(model=cfg, num_stages=4, memory_limit="24MiB", schedule="1f1b", embedding="first")
    a, b = plain.plan(LENGTHS), first.plan(LENGTHS)
    assert [mb.to_dict() for mb in a.plan.microbatches] == [mb.to_dict() for mb in b.plan.microbatches]
    assert a.plan.spec == b.plan.spec and '"embedding"' not in a.plan.to_json()
    assert a.schedule.ranks == b.schedule.ranks and a.sim.makespan_s == b.sim.makespan_s
    assert plain.embedding_choice is None and plain._weighed == ()
    with pytest.raises(ValueError, match="embedding must be first, last or auto"):
        dynmb.Planner(model=cfg, num_stages=2, memory_limit="24MiB", embedding="middle")


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_choose_embedding_chooses_without_a_plan_and_the_cli_takes_auto(tmp_path, capsys):
    planner = _planner("llama-tiny", 4, "24MiB", "auto")
    assert planner.embedding_choice is None and planner.spec.embedding == "first"    # the first place's until then
    assert planner.choose_embedding(LENGTHS).place == "last" and planner.spec.embedding == "last"
    assert planner.memory_model.state_bytes[0] < _planner("llama-tiny", 4, "24MiB", "first").memory_model.state_bytes[0]
    from dynmb.cli.main import main

    lengths = tmp_path / "l.csv"
    lengths.write_text("length\n" + "\n".join(map(str, LENGTHS)) + "\n")
    args = ["plan", "--model", "llama-tiny", "--stages", "4", "--memory-limit", "24MiB", "--lengths", str(lengths),
            "--global-batch", "64", "--stage-split", "auto", "--json"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert '"embedding": "last"' in out and "embedding auto: last" in out
    assert main([*args, "--embedding", "first"]) == 0
    out = capsys.readouterr().out
    assert '"embedding": "first"' in out and "embedding_choice" not in out
    tied = [a if a != "llama-tiny" else "llama-tiny:tie_embeddings=true" for a in args]   # first, said why
    assert main(tied) == 0
    assert "last not weighed: a tied embedding" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_run_with_the_split_auto_resolves_to_last_and_its_gradients_are_exact(tmp_path, capsys):
    """``dynmb run --stage-split auto`` (so ``--embedding auto``) on 2 gloo ranks, float64: the first batch puts the
    embedding last (0.0829 against 0.0842 s simulated when written), the embeds run on rank 1 and every
    parameter's gradient equals the one-process reference."""
    from dynmb.cli.main import main
    from dynmb.io.results import load_results
    from dynmb.runtime.checks import VERIFY_RTOL_FP64

    out = tmp_path / "run"
    code = main(["run", "--model", "llama-tiny:dtype=float64", "--stages", "2", "--memory-limit", "16MiB",
                 "--stage-split", "auto", "--dataset", "gsm8k", "--global-batch", "12", "--seed", "3", "--steps", "2",
                 "--warmup", "0", "--verify", "--backend", "gloo", "--device", "cpu", "--out", str(out)])
    assert code == 0
    assert "--embedding auto: last" in capsys.readouterr().err
    t = load_results(out)
    steps, acts = t["steps"], t["actions"]
    assert len(steps) == 2 and steps["verified"].all() and (steps["grad_rel_err"] <= VERIFY_RTOL_FP64).all()
    assert set(acts[acts.stage == 0]["rank"]) == {1}          # the embeds on the last rank
