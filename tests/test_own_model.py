"""A model of your own everywhere a model is taken (issue 22, items 2 and 3).

- ``experiments/own_model.py`` (a decoder written only against the stage contract) goes through
  ``dynmb profile -> fit -> memory -> plan -> run --plan --verify`` on 2 gloo ranks from the command
  line; gradients equal the single-process reference built from the same factory and the measured
  peak of every stage stays under the limit.
- ``dynmb run --model tests.hf_models:tiny_llama --verify`` (a transformers ``LlamaForCausalLM``) on 2
  gloo ranks with packed rows; skipped without transformers.
- A dynmb Llama's weights copied into a transformers model (``llama_to_hf``) give the same loss and
  gradients (fp32, 1e-5).
- The pieces: the factory's attention kind in the cost feature, the planner and sampler taking a
  factory (and warning about stand-ins once), profile and memory measuring a factory's stages, the run
  spec recording the factory, the launcher's import check, the reference built from a factory.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import dynmb
from dynmb.core.config import RunConfig
from dynmb.core.features import CostFeatures
from dynmb.models.contract import check_importable, factory_spec, planning_config, resolve_model
from dynmb.planning.defaults import StandInModelWarning, reset_stand_in_warnings
from dynmb.runtime.spec import JobSpec, RunSpec
from dynmb.core.types import Microbatch

ROOT = Path(__file__).resolve().parents[1]
EXP = ROOT / "experiments"


def _own():
    if str(EXP) not in sys.path:
        sys.path.insert(0, str(EXP))
    return importlib.import_module("own_model")


def _env(*extra: Path) -> dict[str, str]:
    paths = [str(ROOT), *map(str, extra), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def _packed_mb() -> Microbatch:
    return Microbatch([0, 1, 2, 3], [10, 20, 5, 7], 32, 2, [0, 0, 1, 1])


# --------------------------------------------------------------------------- the pieces
def test_a_masked_factory_plans_packed_rows_at_the_full_masked_work():
    own = _own().tiny_decoder()
    cfg = planning_config(own)
    assert own.attention_work == "masked" and cfg.attention == "dense"
    mb = _packed_mb()
    masked = CostFeatures.of([mb], cfg.attention).attn[0]
    document = CostFeatures.of([mb], "auto").attn[0]
    assert masked == 2 * 32 ** 2                     # rows x padded_len^2, like a padded row
    assert document == 10 ** 2 + 20 ** 2 + 5 ** 2 + 7 ** 2
    family = resolve_model("tiny")
    assert planning_config(family) is family.config and family.attention_work == "document"


def test_planner_and_sampler_take_a_factory_and_warn_once_about_stand_ins():
    reset_stand_in_warnings()
    own = _own().tiny_decoder()
    with pytest.warns(StandInModelWarning, match="analytic cost model.*analytic memory model"):
        planner = dynmb.Planner(model=own, num_stages=2, memory_limit="16MiB")
    assert planner.model_cfg.attention == "dense" and planner.model_cfg.name == "own-tiny"
    with warnings.catch_warnings():
        warnings.simplefilter("error", StandInModelWarning)          # said once
        dynmb.Planner(model=own, num_stages=2, memory_limit="16MiB")
    step = planner.plan(np.array([30, 40, 50, 20, 10]))
    assert step.plan.num_sequences == 5
    sampler = dynmb.DynamicBatchSampler(np.array([30, 40, 50, 20, 10, 60]), 3, model=own, num_stages=2,
                                        memory_limit="16MiB", shuffle=False)
    assert sampler.planner.model_cfg == planner.model_cfg
    reset_stand_in_warnings()
    with pytest.warns(StandInModelWarning):                          # a spec string resolves the same
        by_name = dynmb.Planner(model="own_model:tiny_decoder", num_stages=2, memory_limit="16MiB")
    assert by_name.model_cfg == planner.model_cfg


def test_profile_and_memory_measure_a_factorys_stages():
    from dynmb.measure.memory import measure_stage_memory
    from dynmb.measure.profiler import profile

    own = _own().tiny_decoder()
    samples = profile(own, 2, grid=[(1, 32, 1), (2, 32, 2)], repeats=1, warmup=0, memory=False, progress=False)
    fb = samples[samples["op"].isin(["F", "B"])]
    assert set(fb["stage"]) == {0, 1} and (fb["time_s"] > 0).all()
    assert set(fb["model"]) == {"own-tiny"} and set(fb["attention"]) == {"dense"}
    assert (fb["attn_work"] == fb["rows"] * fb["padded_len"] ** 2).all()     # packed rows too: masked work
    one = measure_stage_memory(own, 2, 0, 2, 64)
    two = measure_stage_memory(own, 2, 0, 4, 64)
    params = sum(p.numel() * 4 for p in own.build_stage(0, 2).parameters())
    assert one["state_bytes"] == two["state_bytes"] >= 4 * params          # params, grads, Adam's two
    assert two["act_bytes"] > one["act_bytes"] > 0


def test_reference_from_a_factory_equals_the_stages_composed():
    from dynmb.models import reference_grads, synthetic_tokens
    from dynmb.core.types import Plan

    own = _own().tiny_decoder()
    mb = _packed_mb()
    plan = Plan((mb,), method="packed", num_stages=2, memory_limit_bytes=1 << 30, num_sequences=4)
    tokens = synthetic_tokens(mb.lengths, own.config.vocab_size, seed=1)
    loss, grads = reference_grads(own, 2, plan, tokens, seed=3)
    whole = own.build_stage(0, 1, seed=3)                          # one stage holding every layer
    from dynmb.models import make_inputs
    out = whole(None, make_inputs(mb, tokens, cfg=planning_config(own)))
    (out / plan.real_tokens).backward()
    assert abs(loss - float(out.detach()) / plan.real_tokens) <= 1e-6 * abs(loss)
    mine = dict(whole.named_parameters())
    assert set(grads) == set(mine)
    for name, g in grads.items():
        assert torch.allclose(g, mine[name].grad, rtol=1e-5, atol=1e-7), name


def test_run_spec_records_the_factory_and_the_launcher_checks_it_imports(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    assert factory_spec("own_model:tiny_decoder") == "own_model:tiny_decoder"
    assert factory_spec("small:d_model=64") is None and factory_spec("tiny") is None
    own = _own().tiny_decoder()
    run = RunConfig(model=planning_config(own), global_batch=4, dataset="gsm8k")
    spec = RunSpec.create(run, tmp_path / "out", model_factory="own_model:tiny_decoder")
    again = JobSpec.from_dict(JobSpec.single(spec).to_dict()).cases[0]
    assert again.model_factory == "own_model:tiny_decoder"
    assert again.factory().config == own.config and again.factory() is not again.factory()   # fresh each call
    # importable here (experiments/ is on this process's sys.path) but not by the ranks: one line, no torchrun
    with pytest.raises(ValueError, match=r"--model own_model:tiny_decoder: module 'own_model' is not importable "
                                         r"by the ranks") as e:
        JobSpec.single(spec).check()
    assert "\n" not in str(e.value)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), str(EXP)]))
    check_importable("own_model:tiny_decoder")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        check_importable("own_model:nope")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        resolve_model("no_such_module_xyz:f")


def test_compare_cases_build_their_stages_with_the_factory(tmp_path):
    from dynmb.jobs.compare import CompareSettings, prepare_compare

    _own()
    settings = CompareSettings(model="own_model:tiny_decoder", methods=("fixed", "dynamic"), dataset="gsm8k",
                               global_batch=8, stages=2, steps=1, warmup=0, device="cpu", memory_limit="16MiB",
                               fixed_best=False, out=str(tmp_path))
    job = prepare_compare(settings.resolved())
    assert [c.method for c in job.cases] == ["fixed", "dynamic"]
    for case in job.cases:
        assert case.spec.model_factory == "own_model:tiny_decoder"
        assert case.spec.run.model == planning_config(_own().tiny_decoder())
    family = prepare_compare(CompareSettings(model="tiny", methods=("dynamic",), dataset="gsm8k", global_batch=8,
                                             device="cpu", out=str(tmp_path / "f")).resolved())
    assert family.cases[0].spec.model_factory is None


def test_cli_points_a_python_file_or_a_transformers_config_to_the_factory_spec(tmp_path, capsys):
    from dynmb.cli.main import main

    hf_json = tmp_path / "config.json"
    hf_json.write_text('{"hidden_size": 256, "num_hidden_layers": 4}')
    for spec, says in (("mymodel.py", "--model mymodel:<factory>"), (str(hf_json), "package.module:factory")):
        assert main(["plan", "--model", spec, "--dataset", "gsm8k"]) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, err


def test_a_factory_keeps_whole_layers_and_is_refused_a_half_block_split(tmp_path):
    """Half-block splits are for dynmb's own families: a factory's stages split whole layers."""
    own = _own().tiny_decoder()
    n = own.config.n_layers
    half = f"{n / 2 - 0.5:g},{n / 2 + 0.5:g}"
    with pytest.raises(ValueError, match="parts of blocks"):
        dynmb.Planner(model=own, num_stages=2, memory_limit="16MiB", stage_split=half)
    reset_stand_in_warnings()                        # said once per config: an earlier test may have said it
    with pytest.warns(StandInModelWarning):
        auto = dynmb.Planner(model=own, num_stages=2, memory_limit="16MiB", stage_split="auto")
    assert not auto.model_cfg.half_split
    done = subprocess.run([sys.executable, "-m", "dynmb.cli", "run", "--model", "own_model:tiny_decoder", "--stages",
                           "2", "--stage-split", half, "--out", str(tmp_path / "run")], capture_output=True, text=True,
                          env=_env(EXP), cwd=ROOT)
    assert done.returncode != 0 and "--stage-split" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()


def test_cli_refuses_a_bad_factory_in_one_line_before_torchrun(tmp_path):
    done = subprocess.run([sys.executable, "-m", "dynmb.cli", "run", "--model", "no_such_module_xyz:f",
                           "--out", str(tmp_path / "run")], capture_output=True, text=True, env=_env(), cwd=ROOT)
    assert done.returncode != 0
    assert "no_such_module_xyz" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- the judged chain
def test_own_model_uses_only_the_public_api_and_none_of_dynmbs_model_classes():
    from tests.test_scripts import dynmb_names as _dynmb_names

    names, submodules = _dynmb_names(EXP / "own_model.py")
    assert submodules == [] and names and names <= set(dynmb.__all__), names - set(dynmb.__all__)
    assert names <= {"ModelConfig", "StageFactory", "StageModule"}      # sizes only; the stages are its own
    own = _own().tiny_decoder()
    assert isinstance(own, dynmb.StageFactory) and isinstance(own.build_stage(1, 2), dynmb.StageModule)


def test_own_model_profile_fit_plan_run_verify_on_two_gloo_ranks(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    own_model = _own()
    assert own_model.main(["--factory", "tiny", "--repeats", "1", "--global-batch", "12", "--memory-limit", "5MiB",
                           "--max-len", "256", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for verb in ("profile", "fit", "memory", "plan", "run"):
        assert f"$ dynmb {verb} " in out or f"$ dynmb -q {verb} " in out, verb
    samples = pd.read_csv(tmp_path / "samples.csv")
    assert set(samples["model"]) == {"own-tiny"} and set(samples["attention"]) == {"dense"}
    runs = pd.read_csv(tmp_path / "run" / "runs.csv")
    assert runs["verify"].astype(bool).all() and set(runs["status"]) == {"ok"}
    assert set(runs["model.name"]) == {"own-tiny"}
    mem = pd.read_csv(tmp_path / "run" / "memory.csv")
    assert len(mem) == 2 and (mem["peak_bytes"] <= mem["limit_bytes"]).all()
    assert (mem["limit_bytes"] == 5 * 2 ** 20).all()
    assert mem["peak_bytes"].max() > 0.5 * mem["limit_bytes"].max()      # the limit shaped the plan
    plan = dynmb.Plan.load(tmp_path / "plan.json")
    assert plan.num_microbatches > 1 and plan.meta["model_factory"] == "own_model:tiny_decoder"
    assert plan.meta["model"]["name"] == "own-tiny"           # the resolved sizes, not a path


# --------------------------------------------------------------------------- transformers
def test_hf_llama_runs_verified_on_two_gloo_ranks_with_packed_rows(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "dynmb.cli", "run", "--model", "tests.hf_models:tiny_llama",
                           "--stages", "2", "--method", "packed", "--pack-len", "512", "--dataset", "gsm8k",
                           "--global-batch", "8", "--memory-limit", "256MiB", "--verify", "--steps", "1",
                           "--warmup", "0", "--device", "cpu", "--out", str(out)],
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "stand-in" in done.stderr                 # planned without fitted models: said
    runs = pd.read_csv(out / "runs.csv")
    assert runs["verify"].astype(bool).all() and set(runs["model.name"]) == {"hf-tiny-llama"}
    actions = pd.read_csv(out / "actions.csv")
    assert (actions["docs"] > actions["batch"]).any()                # packed rows ran
    assert actions["docs"].max() >= 2 and actions.groupby("mb").ngroups > 1


def test_dynmb_llama_weights_into_transformers_give_the_same_loss_and_gradients():
    pytest.importorskip("transformers")
    import torch.nn.functional as F

    from dynmb.models import build_stages, make_inputs, synthetic_tokens
    from dynmb.models.hf import llama_to_hf

    cfg = dynmb.model_config("llama-tiny")
    stages = build_stages(cfg, 2, seed=5)
    hf = llama_to_hf(stages, cfg)
    lengths = np.array([23, 9, 17])
    tokens = synthetic_tokens(lengths, cfg.vocab_size, seed=2)
    mb = Microbatch([0, 1, 2], lengths, 40, 2, [0, 0, 1])
    inputs = make_inputs(mb, tokens, cfg=cfg)
    ours = stages[1](stages[0](None, inputs), inputs)
    ours.backward()
    theirs = sum(F.cross_entropy(hf(input_ids=t[:-1][None]).logits[0].float(), t[1:], reduction="sum")
                 for t in tokens)
    theirs.backward()
    assert abs(float(ours.detach()) - float(theirs.detach())) <= 1e-5 * abs(float(theirs.detach()))
    mine = {n: p for st in stages for n, p in st.named_parameters()}
    f = cfg.d_ff
    for name, rows, param in [("embed.weight", slice(None), hf.model.embed_tokens.weight),
                              ("lm_head.weight", slice(None), hf.lm_head.weight),
                              ("blocks.1.mlp.gate_up.weight", slice(f, None), hf.model.layers[1].mlp.up_proj.weight),
                              ("blocks.0.attn.proj.weight", slice(None), hf.model.layers[0].self_attn.o_proj.weight),
                              ("norm_f.weight", slice(None), hf.model.norm.weight)]:
        err = float((mine[name].grad[rows] - param.grad).norm() / param.grad.norm())
        assert err <= 1e-5, (name, err)
    with pytest.raises(ValueError, match="lack blocks.1"):
        llama_to_hf({n: p for n, p in mine.items() if not n.startswith("blocks.1.")}, cfg)
