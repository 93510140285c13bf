"""``PlanSpec.state_shards`` / ``MemoryModel.sharded``: the planner counts model states sharded by FSDP2 over the
replicas (``dynmb run --dp N --shard``) as dynmb's runtime holds them (``dynmb.memory.model``, "Sharded states").

The runtime's side (the CPU meter's peaks against these predictions on 2 and 4 gloo ranks, fp64 gradients) is in
``tests/test_fsdp.py``."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dynmb
from dynmb.core.config import RunConfig, model_config
from dynmb.core.planspec import PlanSpec
from dynmb.costmodel.loader import Models, spec_models
from dynmb.memory.model import MemoryModel, sharded_state_ratio
from dynmb.planning import plan_step


def _n(cfg, num_stages):
    return np.array([cfg.stage_params(s, num_stages) for s in range(num_stages)], dtype=np.float64)


@pytest.mark.parametrize("dtype,per_whole", [("bfloat16", 12), ("float32", 16), ("float64", 32)])
@pytest.mark.parametrize("k", [1, 2, 8])
def test_the_count_is_whole_weights_and_gradients_plus_the_shards(dtype, per_whole, k):
    """``n (2e + (e + o) / k)``: gathered weights and whole gradients, the weight and Adam shards (o = 2 max(4, e));
    k 1 is the whole count ``n (2e + o)``."""
    cfg = model_config(f"llama-small:dtype={dtype}")
    e = cfg.dtype_bytes
    o = 2 * max(4, e)
    n = _n(cfg, 4)
    base = MemoryModel.analytic(cfg, 4)
    assert np.allclose(base.state_bytes, n * per_whole)
    view = base.sharded(k)
    assert np.allclose(view.state_bytes, n * (2 * e + (e + o) / k if k > 1 else per_whole))
    assert view.state_shards == k and (k == 1) == (view is base)
    assert np.array_equal(view.act_coef, base.act_coef) and np.array_equal(view.transient_coef, base.transient_coef)


def test_sgd_sharded_holds_more_than_whole():
    """With no optimizer states the shards sit beside the gathered weights: FSDP2 without resharding saves nothing."""
    assert sharded_state_ratio(2, "sgd", 8) > 1 > sharded_state_ratio(2, "adam", 8)


@settings(max_examples=30, deadline=None)
@given(k=st.integers(1, 64), j=st.integers(1, 64), last=st.booleans(), rc=st.booleans())
def test_the_view_is_idempotent_and_composes_with_the_others(k, j, last, rc):
    """Sharded from any other sharding equals sharded from the whole count, in any order with ``embedding_last``
    and ``recomputing`` (which keep the shards); the embedding's moved states are scaled alike."""
    base = MemoryModel.analytic(model_config("llama-small"), 4)
    one = base.sharded(j).sharded(k)
    other = (base.embedding_last().sharded(k) if last else base.sharded(k))
    other = other.recomputing() if rc else other
    if last:
        one = one.embedding_last()
    assert np.allclose(one.state_bytes, other.state_bytes)
    assert one.embed_state_bytes == pytest.approx(other.embed_state_bytes)
    assert other.state_shards == k and one.sharded(k) is one
    assert base.sharded(k).sharded(1).state_bytes == pytest.approx(base.state_bytes)


@settings(max_examples=30, deadline=None)
@given(k=st.integers(1, 64), last=st.booleans(), rc=st.booleans())
def test_as_planned_is_the_one_place_of_both_views(k, last, rc):
    """``as_planned(embedding, k)`` is ``embedding_last()`` then ``sharded(k)`` byte for byte, idempotent, and what
    ``spec_models`` gives a plan's spec (the same object: one implementation)."""
    cfg = model_config("llama-small")
    base = MemoryModel.analytic(cfg, 4)
    base = base.recomputing() if rc else base
    view = base.as_planned("last" if last else "first", k)
    by_hand = (base.embedding_last() if last else base).sharded(k)
    for name in ("state_bytes", "act_coef", "transient_coef", "rc_transient_coef"):
        assert np.array_equal(getattr(view, name), getattr(by_hand, name)), name
    assert view.embed_state_bytes == by_hand.embed_state_bytes and view.state_shards == k
    assert view.as_planned("last" if last else "first", k) is view
    spec = PlanSpec(num_stages=4, state_shards=k, embedding="last" if last else "first")
    assert np.array_equal(spec_models(Models(None, base), spec).memory.state_bytes, view.state_bytes)


def test_as_planned_refuses_what_no_view_holds():
    """One line each: a tied embedding on the last rank (also in the stage split's memory proxy, which counted it as
    an untied table moved), ``first`` on a view with the embedding last, an unknown place, and a memory model
    without the view asked for more than the defaults."""
    from dynmb.costmodel.gpu import GPUCostModel
    from dynmb.planning.memory_split import ReliefInputs, step_proxy

    tied = replace(model_config("llama-small"), tie_embeddings=True)
    with pytest.raises(ValueError, match="ties its embedding"):
        MemoryModel.analytic(tied, 1).as_planned("last", 2)
    inputs = ReliefInputs(memory_limit_bytes=8 << 30, schedule_kind="1f1b", workload=np.array([100, 200]),
                          cost_model=GPUCostModel(tied, 1), embedding="last")
    with pytest.raises(ValueError, match="ties its embedding"):
        step_proxy(tied, 1, inputs, 100)
    last = MemoryModel.analytic(model_config("llama-small"), 4).embedding_last()
    with pytest.raises(ValueError, match="has the embedding on the last stage"):
        last.as_planned("first", 2)
    with pytest.raises(ValueError, match="embedding must be 'first' or 'last'"):
        last.as_planned("middle", 1)

    class Foreign:
        state_bytes = np.zeros(4)

    spec = PlanSpec(num_stages=4, state_shards=2)
    with pytest.raises(ValueError, match="has no as_planned"):
        spec_models(Models(None, Foreign()), spec)
    plain = Models(None, Foreign())
    assert spec_models(plain, PlanSpec(num_stages=4)) is plain


def test_a_saved_sharded_model_loads_as_it_was(tmp_path):
    view = MemoryModel.analytic(model_config("tiny"), 2).sharded(4)
    view.save(tmp_path / "m.json")
    back = MemoryModel.load(tmp_path / "m.json")
    assert back.state_shards == 4 and np.allclose(back.state_bytes, view.state_bytes)
    assert back.sharded(4) is back and np.allclose(back.sharded(1).state_bytes,
                                                   MemoryModel.analytic(model_config("tiny"), 2).state_bytes)
    assert "state_shards" not in MemoryModel.analytic(model_config("tiny"), 2).to_dict()


def test_the_spec_field_is_checked_and_left_out_at_one():
    assert "state_shards" not in PlanSpec().to_dict()
    spec = PlanSpec(state_shards=8)
    assert PlanSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    for bad in (0, -1, 1.5, True, "2", None):
        with pytest.raises(ValueError, match="state_shards must be a whole number >= 1"):
            PlanSpec(state_shards=bad)


LIMIT = "104MiB"                 # 128 MiB before the lean Llama blocks: there both now fit 2 sequences


def _planner(shards):
    cfg = replace(model_config("llama-small"), n_layers=8)
    return dynmb.Planner(model=cfg, num_stages=4, memory_limit=LIMIT, schedule="1f1b", state_shards=shards)


def test_sharded_plans_use_the_room_and_the_default_is_unchanged():
    """A planner with ``state_shards`` 8 sees the smaller states (``fixed``'s largest fitting microbatch grows, the
    simulated peaks stay under the limit); 1 plans exactly what a planner without the keyword plans (JSON, no
    key)."""
    lengths = np.random.default_rng(3).integers(40, 300, 200)
    whole_planner, planner = _planner(1), _planner(8)
    cfg = replace(model_config("llama-small"), n_layers=8)
    plain = dynmb.Planner(model=cfg, num_stages=4, memory_limit=LIMIT, schedule="1f1b").plan(lengths)
    whole = whole_planner.plan(lengths)
    assert whole.plan.digest() == plain.plan.digest() and whole.plan.spec == plain.plan.spec
    assert '"state_shards"' not in whole.plan.to_json()
    sharded = planner.plan(lengths)
    assert (planner.memory_model.state_bytes < whole_planner.memory_model.state_bytes).all()
    assert sharded.plan.spec.state_shards == 8 and sharded.sim.fits and whole.sim.fits
    assert planner.plan(lengths, method="fixed").plan.meta.mbs > whole_planner.plan(lengths, method="fixed").plan.meta.mbs


def test_plan_step_applies_the_spec_views_once():
    """``plan_step`` plans under the spec's views whatever models it is given (the whole ones, or the view itself:
    one plan), and records the view's digest, which a run's models (``spec_models``) reproduce."""
    cfg = replace(model_config("llama-small"), n_layers=8)
    spec = PlanSpec(num_stages=4, memory_limit_bytes=128 * 2**20, state_shards=4, embedding="last")
    models = Models.analytic(cfg, 4)
    lengths = np.random.default_rng(4).integers(40, 300, 100)
    a, _, _ = plan_step(lengths, spec, model_cfg=cfg, models=models)
    viewed = spec_models(models, spec)
    b, _, _ = plan_step(lengths, spec, model_cfg=cfg, models=viewed)
    assert a.digest() == b.digest()
    assert spec_models(viewed, spec) is viewed
    assert viewed.memory.state_shards == 4 and viewed.memory.embed_state_bytes > 0
    assert a.meta.models["memory"]["digest"] == b.meta.models["memory"]["digest"]


def _run_args(tmp_path, plan_file, shard, **extra):
    from dynmb.cli.main import build_parser

    argv = ["run", "--plan", str(plan_file), "--out", str(tmp_path / "out")] + (["--shard"] if shard else [])
    args = build_parser().parse_args(argv)
    for k, v in extra.items():
        setattr(args, k, v)
    return args


def test_the_command_line_plans_and_runs_with_the_shards(tmp_path, capsys):
    """``dynmb plan --state-shards`` writes a plan whose models a run reproduces (also with ``--embedding last``,
    which ``dynmb plan`` used to plan without its memory view: the run refused the digest); ``run --dp N --shard``
    plans with N; a plan with shards runs only with ``--shard`` (refused in one line naming the plan file before any
    process starts); a plan without runs with it too (fewer shards counted is safe)."""
    from dynmb.cli.main import main
    from dynmb.cli.planfile import plan_models
    from dynmb.cli.run import plan_run_config, run_config
    from dynmb.core.types import Plan
    from dynmb.costmodel.loader import check_plan_models
    from dynmb.runtime.spec import RunSpec

    common = ["--model", "tiny", "--stages", "2", "--memory-limit", "64MiB", "--global-batch", "8", "--dataset",
              "gsm8k", "--dp", "2"]
    for name, extra in (("s.json", ["--state-shards", "2"]), ("e.json", ["--embedding", "last", "--state-shards", "2"]),
                        ("w.json", [])):
        assert main(["plan", *common, *extra, "-o", str(tmp_path / name)]) == 0
        plan = Plan.load(tmp_path / name)
        plan_models(plan, argparse.Namespace(model=None, cost_model=None, memory_model=None), str(tmp_path / name))
    assert Plan.load(tmp_path / "s.json").spec.state_shards == 2
    for name in ("s.json", "e.json"):                     # the run's models: the digests the plan recorded
        cfg, _, memory = plan_run_config(_run_args(tmp_path, tmp_path / name, True))
        run_models = RunSpec.create(cfg, tmp_path / "o", plan=str(tmp_path / name), memory_model=memory).models()
        check_plan_models(Plan.load(tmp_path / name).meta.models, run_models, name)
    cfg, _, _ = plan_run_config(_run_args(tmp_path, tmp_path / "s.json", True))
    assert cfg.spec.state_shards == 2 and cfg.shard
    with pytest.raises(ValueError, match=r"the plan .*s\.json counts model states sharded over 2 replicas"):
        plan_run_config(_run_args(tmp_path, tmp_path / "s.json", False))
    capsys.readouterr()
    assert main(["run", "--plan", str(tmp_path / "s.json"), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "s.json" in err[0] and not (tmp_path / "r").exists()
    cfg, _, _ = plan_run_config(_run_args(tmp_path, tmp_path / "w.json", True))
    assert cfg.spec.state_shards == 1 and cfg.shard
    from dynmb.cli.main import build_parser
    args = build_parser().parse_args(["run", *common, "--shard", "--out", str(tmp_path / "x")])
    assert run_config(args).spec.state_shards == 2
    args = build_parser().parse_args(["run", *common, "--out", str(tmp_path / "x")])
    assert run_config(args).spec.state_shards == 1


def test_a_run_without_enough_shards_is_refused():
    """``RunConfig``: its plans' shards at most its own (``--dp`` with ``--shard``, else 1)."""
    with pytest.raises(ValueError, match="state_shards 4: the plans count model states sharded over 4 replicas"):
        RunConfig(dp=2, shard=True, state_shards=4)
    with pytest.raises(ValueError, match="holds them whole"):
        RunConfig(dp=2, state_shards=2)
    assert RunConfig(dp=4, shard=True, state_shards=2).spec.state_shards == 2
