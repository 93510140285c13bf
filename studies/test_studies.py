"""Smoke tests of the studies (not the package's suite: ``python -m pytest -q studies`` from the repo root).

Each study's scripts run in-process (their ``main(argv)``) on tiny settings into ``tmp_path``: tidy rows, one
per configuration, resuming adds nothing; every script's ``--help``. The last tests run real gloo jobs (marked
``dist``): the calibration study's replay of a tiny ``dynmb compare`` and the loss-parity study.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pandas as pd
import pytest

from tests.test_scripts import dynmb_names as _dynmb_names

STUDIES = Path(__file__).resolve().parent
MODULES = {"sweep_traces": "sweeps.sweep_traces", "fixed_mbs_sweep": "sweeps.fixed_mbs_sweep",
           "reorder_ablation": "reorder.ablation", "costmodel_ablation": "costmodel.ablation",
           "scaling": "scaling.scaling", "calibration_study": "prediction.calibration_study",
           "loss_parity": "loss_parity.loss_parity", "slicing": "slicing.slicing",
           "prediction_breakdown": "prediction.breakdown", "common": "common",
           "scaling_virtual": "scaling.virtual", "scaling_summary": "scaling.summary"}
SCRIPTS = ("sweep_traces", "fixed_mbs_sweep", "reorder_ablation", "costmodel_ablation", "scaling",
           "calibration_study", "loss_parity", "slicing", "prediction_breakdown")


def _script(name: str):
    return importlib.import_module(f"studies.{MODULES[name]}")


def _path(name: str) -> Path:
    return STUDIES / (MODULES[name].replace(".", "/") + ".py")


ALL_MODULES = sorted(".".join(p.relative_to(STUDIES.parent).with_suffix("").parts) for p in STUDIES.rglob("*.py")
                     if not p.name.startswith(("test_", "__")))


@pytest.mark.parametrize("module", ALL_MODULES)
def test_every_study_module_imports(module):
    """Every script of every study imports from the repo root (``python -m studies.<study>.<script>``)."""
    assert importlib.import_module(module).__doc__


@pytest.mark.parametrize("name", SCRIPTS)
def test_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        _script(name).main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out and "--out" in out


def test_sweep_simulate_only_rows_and_resume(tmp_path):
    sweep = _script("sweep_traces")
    argv = ["--simulate-only", "--traces", "gsm8k,humaneval", "--memory-limits", "512MiB,1GiB", "--methods",
            "fixed,dynamic", "--global-batch", "16", "--steps", "1", "--out", str(tmp_path), "--no-progress"]
    assert sweep.main(argv) == 0
    df = pd.read_csv(tmp_path / "sim.csv")
    assert len(df) == 2 * 2 * 2                                    # traces x limits x methods, one step each
    for col in ("dataset", "memory_limit_bytes", "method", "mbs", "global_batch", "num_stages", "step", "status",
                "pred_step_s", "pred_tokens_per_s", "padding_fraction", "pred_mean_bubble", "pred_peak_over_limit",
                "plan_s", "num_microbatches", "real_tokens"):
        assert col in df.columns, col
    keys = ["dataset", "memory_limit_bytes", "method"]
    assert not df.duplicated(keys).any()
    assert set(df["status"]) == {"ok"} and (df["pred_peak_over_limit"] <= 1).all()
    assert (df["pred_tokens_per_s"] > 0).all()
    # resuming adds nothing; a new method adds only its configurations
    assert sweep.main(argv) == 0
    assert len(pd.read_csv(tmp_path / "sim.csv")) == 8
    argv[argv.index("fixed,dynamic")] = "fixed,sorted,dynamic"
    assert sweep.main(argv) == 0
    df2 = pd.read_csv(tmp_path / "sim.csv")
    assert len(df2) == 12 and (df2["method"] == "sorted").sum() == 4


def test_scaling_small_batch_rows_and_resume(tmp_path):
    scaling = _script("scaling")
    argv = ["--small-batch", "--quick", "--stages", "4,64", "--dp", "1,8", "--traces", "sharegpt", "--per-replica", "16",
            "--methods", "fixed,dynamic", "--out", str(tmp_path), "--no-progress"]
    assert scaling.main(argv) == 0
    df = pd.read_csv(tmp_path / "scaling.csv")
    assert len(df) == 2 * 2 * 2
    assert set(df["status"]) == {"ok"}
    assert not df.duplicated(["num_stages", "dp", "method"]).any()
    assert ((df["efficiency"] > 0) & (df["efficiency"] <= df["mfu"])).all()
    assert ((df["mean_bubble"] >= 0) & (df["mean_bubble"] < 1)).all()
    assert (df["global_batch"] == 16 * df["dp"]).all() and (df["plan_s"] >= df["pack_s"]).all()
    assert scaling.main(argv) == 0
    assert len(pd.read_csv(tmp_path / "scaling.csv")) == 8


def test_scaling_realistic_tiny_grid(tmp_path, capsys):
    """The realistic-load study on a tiny grid: every step at or above its bound and the batch's
    ideal (GEMMs saturated: a true lower bound), the tuned budget no slower than the memory maximum,
    batches of whole sequences per replica, resuming adds nothing, the summary tables print."""
    scaling = _script("scaling")
    names, submodules = _dynmb_names(_path("scaling"))
    assert names <= set(__import__("dynmb").__all__) and not [m for m in submodules if m.startswith("dynmb.runtime")]
    argv = ["--traces", "gsm8k", "--tokens", "20k", "--stages", "2", "--dp", "2", "--methods",
            "fixed,token-budget,token-budget-best,dynamic", "--out", str(tmp_path), "--no-progress"]
    assert scaling.main(argv) == 0
    out = capsys.readouterr().out
    assert "gemm_eff_max = 0.78" in out and "Sources of the constants" in out and "link ib" in out
    df = pd.read_csv(tmp_path / "scaling.csv")
    assert len(df) == 5 and set(df["status"]) == {"ok"}                 # dynamic twice: even and auto splits
    assert sorted(df.loc[df["method"] == "dynamic", "stage_split"]) == ["auto", "even"]
    assert (df["pred_step_s"] >= df["bound_s"] * (1 - 1e-9)).all() and (df["pred_step_s"] >= df["ideal_s"]).all()
    assert ((df["attainable"] > 0) & (df["attainable"] <= 1)).all() and (df["gap_to_ideal"] >= 0).all()
    gaps = df[[c for c in df if c.startswith("gap_") and c not in ("gap_to_ideal", "gap_to_bound", "gap_rank")]]
    assert gaps.shape[1] == 8 and (gaps.sum(axis=1) - df["gap_to_ideal"]).abs().max() < 1e-9   # where the gap goes
    assert (df["num_sequences"] % 2 == 0).all() and (df["real_tokens"] >= 20_000).all()
    assert (df["plan_s"] >= df["pack_s"]).all() and (df["plan_over_step"] > 0).all()
    tb = df.set_index("method")["pred_step_s"]
    assert tb["token-budget-best"] <= tb["token-budget"]
    assert df.loc[df["method"] == "token-budget-best", "budgets_tried"].item() >= 2
    assert scaling.main(argv) == 0 and len(pd.read_csv(tmp_path / "scaling.csv")) == 5
    capsys.readouterr()
    assert scaling.main(["--summary", "--out", str(tmp_path)]) == 0
    md = capsys.readouterr().out
    assert "Gap to `ideal_s`" in md and "| gsm8k | 2 |" in md and "dynamic (auto)" in md and "never behind" in md


def test_scaling_schedule_auto_keeps_the_fastest_kind_that_fits(tmp_path, capsys):
    """``--schedule auto``: every method's step is the fastest fitting kind of ``auto_kinds()``, each kind's
    step recorded; ``schedule_key`` keeps 1f1b and auto rows apart (and rows without it count as 1f1b);
    the 1f1b rows are the study as before; the summary labels the auto rows and checks the choice."""
    from dynmb.schedule.kinds import auto_kinds
    scaling = _script("scaling")
    base = ["--traces", "gsm8k", "--tokens", "20k", "--stages", "2", "--dp", "2", "--methods", "packed,dynamic",
            "--stage-split", "even", "--out", str(tmp_path), "--no-progress"]
    assert scaling.main(base) == 0
    old = pd.read_csv(tmp_path / "scaling.csv")
    old.drop(columns=[c for c in old if c.startswith("sched") or c.startswith("step_") or c == "kinds_over_limit"]
             ).to_csv(tmp_path / "scaling.csv", index=False)             # as written before --schedule
    assert scaling.main(base) == 0 and len(pd.read_csv(tmp_path / "scaling.csv")) == 2
    assert scaling.main([*base, "--schedule", "auto"]) == 0
    df = pd.read_csv(tmp_path / "scaling.csv")
    auto = df[df["schedule_key"] == "auto"].set_index("method")
    assert len(df) == 4 and sorted(auto.index) == ["dynamic", "packed"]
    kinds = auto_kinds()
    assert len(kinds) >= 2 and set(auto["schedule"]) <= set(kinds)
    steps = auto[[f"step_{k}_s" for k in kinds]]
    assert auto["kinds_over_limit"].isna().all()                        # 80 GiB: every kind fits here
    assert (auto["pred_step_s"] <= steps.min(axis=1) * (1 + 1e-12)).all()
    assert (auto["pred_step_s"] == steps.min(axis=1)).all()
    before = df[df["schedule_key"].isna()].set_index("method")                  # the rows of before
    one, same = before["pred_step_s"], auto["grouping"].fillna("") == before.loc[auto.index, "grouping"].fillna("")
    assert same["packed"] and (auto["step_1f1b_s"] == one[auto.index])[same].all()   # the same plan (dynamic: if
    assert (auto["pred_step_s"] <= one[auto.index]).all()                             # the final check kept the same)
    assert auto.loc["packed", "pred_step_s"] < auto.loc["packed", "step_1f1b_s"]  # 2 microbatches: zero bubble helps
    capsys.readouterr()
    assert scaling.main(["--summary", "--out", str(tmp_path)]) == 0
    md = capsys.readouterr().out
    assert "dynamic [sched auto]" in md and "| gap ideal 1f1b |" in md
    assert "auto never slower (predicted) than any fixed kind it weighed: met (0 of 2 rows slower" in md
    assert "auto never slower than the same method's `--schedule 1f1b` row of the cell: met (0 of 2" in md


@pytest.mark.parametrize("schedule", ["1f1b", "auto"])
def test_scaling_dynamic_rows_get_the_planners_final_check_against_balanced(tmp_path, monkeypatch, schedule):
    """The Planner's final check in the study (``_scaling_final``): a dynamic packing made deliberately poor
    (one sequence per microbatch) is replaced by ``balanced`` at a checked budget, planned as the
    ``balanced-best`` rows plan it; the row stays dynamic's, is never slower than the best balanced row of the
    cell, names the winner in ``grouping`` and counts the check in ``plan_s``."""
    scaling = _script("scaling")
    real = scaling.pack

    def poor_dynamic(batch, spec, **kw):
        return real(batch, spec.with_(method="fixed", mbs=1) if spec.method == "dynamic" else spec, **kw)

    monkeypatch.setattr(scaling, "pack", poor_dynamic)
    argv = ["--traces", "gsm8k", "--tokens", "20k", "--stages", "2", "--dp", "2", "--methods", "dynamic,balanced-best",
            "--stage-split", "even", "--schedule", schedule, "--out", str(tmp_path), "--no-progress"]
    assert scaling.main(argv) == 0
    df = pd.read_csv(tmp_path / "scaling.csv").set_index("method")
    dyn, bal = df.loc["dynamic"], df.loc["balanced-best"]
    assert dyn["pred_step_s"] <= bal["pred_step_s"] * (1 + 1e-12) < dyn["own_step_s"]
    assert str(dyn["grouping"]).startswith("balanced/") and dyn["base_method"] == "dynamic"
    weighed = dict(a.split(":") for a in str(dyn["final_alternatives"]).split())   # every alternative the check planned
    assert float(weighed[dyn["grouping"]].removesuffix("(over)")) == pytest.approx(dyn["pred_step_s"], rel=1e-5)
    assert dyn["final_check_s"] > 0
    assert dyn["plan_s"] == pytest.approx(dyn["pack_s"] + dyn["reorder_s"] + dyn["sched_s"] + dyn["final_check_s"])
    assert dyn["pred_peak_over_limit"] <= 1


def test_scaling_virtual_stages_run_interleaved_rows_beside_one_chunk_rows(tmp_path, capsys):
    """``--virtual 1,2``: the V = 2 rows pack P V chunks (the layer split lists them), run the kind auto weighs at
    two chunks per GPU without slices (``auto_kinds(virtual=2)``: zb-v, the V placement) on P GPUs, under the memory limit, at or above their GPU-level ideal; the row
    key keeps them beside the V = 1 rows (resuming adds nothing), the summary labels them; a setting whose
    chunks the layers do not cover, or a one-chunk kind with V > 1, is refused in one line."""
    from dynmb.schedule.kinds import auto_kinds
    scaling = _script("scaling")
    base = ["--traces", "gsm8k", "--tokens", "20k", "--stages", "2", "--dp", "2", "--methods", "packed,dynamic",
            "--stage-split", "even", "--schedule", "auto", "--out", str(tmp_path), "--no-progress"]
    assert scaling.main([*base, "--virtual", "1,2"]) == 0
    df = pd.read_csv(tmp_path / "scaling.csv")
    assert len(df) == 4 and set(df["status"]) == {"ok"} and sorted(df["virtual"]) == [1, 1, 2, 2]
    v2 = df[df["virtual"] == 2]
    assert set(v2["schedule"]) == set(auto_kinds(virtual=2)) == {"zb-v"}
    assert (v2["layer_split"].str.split().map(len) == 4).all()
    assert (df["pred_peak_over_limit"] <= 1).all() and (df["pred_step_s"] >= df["ideal_s"]).all()
    assert ((df["attainable"] > 0) & (df["attainable"] <= 1)).all()
    assert scaling.main([*base, "--virtual", "2"]) == 0 and len(pd.read_csv(tmp_path / "scaling.csv")) == 4
    capsys.readouterr()
    assert scaling.main(["--summary", "--out", str(tmp_path)]) == 0
    md = capsys.readouterr().out
    assert "dynamic [sched auto v2]" in md and "dynamic [sched auto]" in md and "| V | dynamic |" in md
    with pytest.raises(SystemExit, match="32 x virtual 2 = 64 chunks, but the even split has 32 whole layers"):
        scaling.main([*base, "--stages", "32", "--virtual", "2"])
    with pytest.raises(SystemExit, match="--virtual 2 needs a kind with virtual stages"):
        scaling.main([*base[:-5], "--out", str(tmp_path), "--virtual", "2"])


def test_scaling_virtual_auto_plans_the_chosen_v(tmp_path, capsys):
    """``--virtual auto``: the row (key ``virtual`` = auto) plans at the V chosen by simulated step
    (``virtual_chosen``, one the layers allow), the same plan as that V's own row; a folder of both kinds of
    rows writes its parquet copy, resumes, and the summary lists the auto rows apart."""
    scaling = _script("scaling")
    base = ["--traces", "gsm8k", "--tokens", "20k", "--stages", "2", "--dp", "2", "--methods", "dynamic",
            "--stage-split", "even", "--schedule", "auto", "--out", str(tmp_path), "--no-progress"]
    assert scaling.main([*base, "--virtual", "auto,1,2,4"]) == 0
    df = pd.read_csv(tmp_path / "scaling.csv")
    assert len(df) == 4 and set(df["status"]) == {"ok"} and (tmp_path / "scaling.parquet").exists()
    auto = df[df["virtual"].astype(str) == "auto"].iloc[0]
    assert auto["virtual_chosen"] in (1, 2, 4) and auto["virtual_cpu_s"] > 0
    same = df[df["virtual"].astype(str) == str(int(auto["virtual_chosen"]))].iloc[0]
    assert auto["pred_step_s"] == same["pred_step_s"] and auto["layer_split"] == same["layer_split"]
    assert scaling.main([*base, "--virtual", "auto"]) == 0 and len(pd.read_csv(tmp_path / "scaling.csv")) == 4
    capsys.readouterr()
    assert scaling.main(["--summary", "--out", str(tmp_path)]) == 0
    assert "`--virtual auto` rows" in capsys.readouterr().out


def test_scaling_token_batch_is_deterministic_and_whole():
    import numpy as np
    scaling = _script("scaling")
    trace = np.array([10, 200, 3000, 45, 7])
    a, b = scaling.token_batch(trace, 50_000, 8, seed=3), scaling.token_batch(trace, 50_000, 8, seed=3)
    assert np.array_equal(a, b) and a.size % 8 == 0 and a.sum() >= 50_000
    assert a[:-8].sum() < 50_000                                       # stops at the target (then whole replicas)
    assert scaling.parse_tokens("0.5M") == 500_000 and scaling.parse_tokens("20k") == 20_000
    with pytest.raises(ValueError, match="--tokens"):
        scaling.parse_tokens("lots")


def test_scaling_real_work_is_the_same_for_every_split():
    """``attainable``'s work counts compute only: the same sum under every layout, a split inside a half-block
    (whose wider message is priced on the links, ``link_bytes``) too."""
    import numpy as np
    from dataclasses import replace

    from dynmb.core.config import model_config
    from dynmb.costmodel.gpu import GPUCostModel

    real_work = _script("scaling_virtual").real_work
    cfg, lengths = model_config("llama2-7b"), np.array([100, 2000, 5000, 300])
    even = real_work(GPUCostModel(cfg, 8), lengths, 1)
    chunked = replace(cfg, layer_split=(4.0625,) * 7 + (3.5625,))
    assert float(GPUCostModel(chunked, 8).comm_s(1, 5000)) > float(GPUCostModel(cfg, 8).comm_s(1, 5000))
    assert real_work(GPUCostModel(chunked, 8), lengths, 1) == pytest.approx(even, rel=1e-12)


def test_common_plans_and_launches_through_the_public_api(tmp_path, monkeypatch):
    import dynmb
    from dynmb.runtime import api, launch
    from dynmb.runtime.spec import JobSpec
    common = _script("common")
    names, submodules = _dynmb_names(_path("common"))
    assert names <= set(dynmb.__all__) and "run" in names
    assert not [m for m in submodules if m.startswith("dynmb.runtime")], submodules
    settings = {"dataset": "gsm8k", "model": "tiny", "num_stages": 2, "dp": 1, "global_batch": 8,
                "memory_limit_bytes": 2**30, "method": "dynamic", "mbs": None, "schedule": "1f1b", "reorder": "none",
                "cost_model": "analytic", "seed": 0, "oversize": "error"}
    from dynmb.costmodel import get_cost_model
    from dynmb.data import load_trace
    cfg = dynmb.model_config("tiny")
    rows = common.simulate_rows(settings, load_trace("gsm8k"), model_cfg=cfg, cost_model=get_cost_model(None, cfg, 2),
                                memory_model=None, steps=2)
    assert [r["status"] for r in rows] == ["ok", "ok"] and all(r["pred_step_s"] > 0 for r in rows)
    jobs = []

    def fake_launch_job(job, nproc, **kw):
        jobs.append((job, nproc))
        return launch.LaunchResult(returncode=1, failures=("rank 1: RuntimeError: boom",))
    monkeypatch.setattr(api, "launch_job", fake_launch_job)     # what dynmb.run launches through
    out = common.run_real([settings], tmp_path, steps=1, warmup=0, timeout=30.0, quiet=True)
    (job, nproc), = jobs
    assert isinstance(job, JobSpec) and nproc == 2 and job.cases[0].run.model.name == "tiny"
    assert not job.interleave                                        # one case: nothing to interleave
    assert out[0]["status"] == "failed" and "boom" in out[0]["error"] and out[0]["run_id"] == job.cases[0].run_id
    assert pd.read_csv(tmp_path / "configs.csv")["status"].tolist() == ["failed"]


def test_common_interleaves_cpu_cases_then_reruns_them_one_by_one(tmp_path, monkeypatch):
    """Several CPU cases run round by round (``dynmb.run(..., interleave=True)``); when that job
    fails, its unfinished cases run again one after another, and the first failure is recorded."""
    from dynmb.runtime import api, launch
    common = _script("common")
    monkeypatch.setattr(common, "_backend_device", lambda: ("gloo", "cpu"))
    base = {"dataset": "gsm8k", "model": "tiny", "num_stages": 2, "dp": 1, "global_batch": 8,
            "memory_limit_bytes": 2**30, "mbs": None, "schedule": "1f1b", "reorder": "none",
            "cost_model": "analytic", "seed": 0, "oversize": "error"}
    jobs = []

    def fake_launch_job(job, nproc, **kw):
        jobs.append(job)
        return launch.LaunchResult(returncode=1, failures=(f"boom {len(jobs)}",))
    monkeypatch.setattr(api, "launch_job", fake_launch_job)
    out = common.run_real([{**base, "method": "fixed"}, {**base, "method": "dynamic"}], tmp_path, steps=1, warmup=0,
                          timeout=30.0, quiet=True)
    assert [(job.interleave, [c.run.method for c in job.cases]) for job in jobs] == [
        (True, ["fixed", "dynamic"]), (False, ["fixed", "dynamic"]), (False, ["dynamic"])]
    assert [(r["method"], r["status"], r["error"]) for r in out] == [("fixed", "failed", "boom 2"),
                                                                     ("dynamic", "failed", "boom 3")]


def test_slicing_sim_sizes_a_position_table_only_for_learned_positions(tmp_path, capsys):
    """``slicing.py --sim``: a rotary model (llama-tiny) is planned as it is, a learned-position one
    (tiny) gets a table as long as the trace's longest sequence, so that its long articles can be
    sliced (unsized, ``split`` fails for it: a document longer than the table)."""
    from dynmb.data import load_trace, sample_batch
    longest = int(load_trace("longtail").max())
    argv = ["--sim", "--sim-model", "llama-tiny,tiny", "--sim-stages", "2", "--steps", "1", "--sim-global-batch", "16",
            "--sim-memory-limit", "64MiB", "--methods", "dynamic", "--out", str(tmp_path)]
    assert _script("slicing").main(argv) == 0
    df = pd.read_csv(tmp_path / "simulated.csv")
    assert len(df) == 2 * 3 and set(df["status"]) == {"ok"}, df[["model", "case", "status"]]
    tables = df.groupby("model")["position_table"].unique().to_dict()
    assert list(tables["llama-tiny"]) == [0] and list(tables["tiny"]) == [longest]
    assert "tiny: learned positions" in capsys.readouterr().err
    split, cut = df[df["case"] == "split"], df[df["case"] == "truncate"]
    assert (split["longest_row"] < sample_batch(load_trace("longtail"), 16, 0, step=0).max()).all()  # sliced
    assert (split["tokens_kept"] == 1).all() and (cut["tokens_kept"] < 1).all()
    assert (df["max_pred_peak_over_limit"] <= 1).all()


def test_slicing_reach_rotary_slices_longer_documents_than_a_sized_table(tmp_path):
    """``slicing.py --reach``: the longest document planned sliced is bracketed (it fits, the next
    tried does not) and is longer for rotary llama-tiny than for tiny, whose table grows with it."""
    slicing = _script("slicing")
    argv = ["--reach", "--reach-models", "llama-tiny,tiny", "--reach-limits", "32MiB", "--reach-tol", "0.05",
            "--out", str(tmp_path)]
    assert slicing.main(argv) == 0
    df = pd.read_csv(tmp_path / "reach.csv").set_index("model")
    assert list(df["learned_positions"]) == [False, True]
    assert (df["first_refused"] > df["longest_document"]).all()
    assert (df["first_refused"] - df["longest_document"] <= 0.05 * df["longest_document"] + 1).all()
    for model, row in df.iterrows():
        assert slicing._fits_sliced(model, int(row["longest_document"]), 2, "32MiB")
        assert not slicing._fits_sliced(model, int(row["first_refused"]), 2, "32MiB")
    assert df.loc["llama-tiny", "longest_document"] > df.loc["tiny", "first_refused"]


def test_slicing_real_runs_llama_small_through_the_public_api(tmp_path, monkeypatch):
    """``slicing.py --real`` launches one interleaved ``dynmb.run`` job (no runtime internals):
    llama-small by default, unsized, with its shipped cost model; a failed job exits non-zero."""
    import dynmb
    from dynmb.runtime import api, launch
    names, submodules = _dynmb_names(_path("slicing"))
    assert "run" in names and not [m for m in submodules if m.startswith("dynmb.runtime")], submodules
    jobs = []

    def fake_launch_job(job, nproc, **kw):
        jobs.append((job, nproc))
        return launch.LaunchResult(returncode=1, failures=("rank 1: RuntimeError: boom",))
    monkeypatch.setattr(api, "launch_job", fake_launch_job)
    with pytest.raises(SystemExit) as e:
        _script("slicing").main(["--real", "--steps", "1", "--warmup", "0", "--out", str(tmp_path), "--quiet"])
    assert e.value.code == 1
    (job, nproc), = jobs
    assert nproc == 2 and job.interleave and len(job.cases) == 2 * 3
    assert [c.label for c in job.cases[:3]] == ["dynamic-split", "dynamic-truncate", "dynamic-truncate+rc"]
    preset = dynmb.model_config("llama-small")
    for c in job.cases:
        assert c.run.model == preset and Path(c.run.cost_model).name == "llama-small-p2-cpu.json"
        assert (c.run.oversize, c.run.recompute) in {("split", "auto"), ("truncate", "never"), ("truncate", "auto")}


def test_loss_parity_spread_is_max_minus_min_over_min_per_step():
    parity = _script("loss_parity")
    steps = pd.DataFrame({"label": ["fixed", "packed", "dynamic"] * 2, "step": [0, 0, 0, 1, 1, 1],
                          "loss": [2.0, 2.002, 2.001, 1.5, 1.5, 1.5], "real_tokens": 10, "num_microbatches": 1,
                          "step_s": 0.1})
    rows, worst, at = parity.parity_table(steps)
    assert worst == pytest.approx(1e-3) and at == 0 and len(rows) == 6
    assert rows.loc[rows["step"] == 1, "rel_spread"].eq(0).all()


@pytest.mark.dist
def test_loss_parity_on_a_tiny_corpus(tmp_path, capsys):
    """The script end to end: public names only, 3 methods x 2 steps on 2 gloo ranks, tidy CSV, PNG, the spread."""
    import dynmb
    pytest.importorskip("tokenizers")
    from tests.test_corpus_runs import write_corpus

    names, submodules = _dynmb_names(_path("loss_parity"))
    assert submodules == [] and names and names <= set(dynmb.__all__), names - set(dynmb.__all__)
    corpus, tok = write_corpus(tmp_path / "data")
    out = tmp_path / "res"
    assert _script("loss_parity").main(["--corpus", str(corpus), "--tokenizer", str(tok), "--model", "tiny",
                                        "--steps", "2", "--global-batch", "4", "--pack-len", "64",
                                        "--out", str(out)]) == 0
    df = pd.read_csv(out / "loss_parity.csv")
    assert sorted(set(df["method"])) == ["dynamic", "fixed", "packed"] and len(df) == 6
    assert not df.duplicated(["method", "step"]).any() and (df["model"] == "tiny").all()
    assert (df.loc[df["method"] == "fixed", "num_microbatches"] == 2).all()      # 4 documents, mbs 2
    assert (df["rel_spread"] <= 1e-5).all() and (df.groupby("step")["real_tokens"].nunique() == 1).all()
    assert (out / "loss_parity.png").stat().st_size > 0
    assert "largest relative difference between methods" in capsys.readouterr().out


def test_planners_needed_is_plan_over_step_rounded_up():
    summary = _script("scaling_summary")
    got = summary.planners_needed(pd.Series([0.05, 1.0, 1.2, 8.3]))
    assert list(got) == [1, 1, 2, 9]
    # the job's ranks share the planning: 8.3 steps of plan over 4 ranks need 3 planners each, over 16 one
    assert list(summary.planners_needed(pd.Series([8.3, 8.3, 12.6]), pd.Series([4, 16, 256]))) == [3, 1, 1]


def test_scaling_slice_fitting_keeps_the_tokens_and_records_the_threshold(tmp_path, capsys):
    """``--slice-fitting auto`` (``_scaling_slicefit``): the dynamic row on longtail at P 8 keeps the tokens of
    ``never``, slices sequences that fit only where predicted faster, and records its threshold and check time."""
    scaling = _script("scaling")
    argv = ["--traces", "longtail", "--tokens", "200k", "--stages", "8", "--dp", "1", "--sim-replicas", "1",
            "--schedule", "auto", "--methods", "dynamic", "--stage-split", "even", "--no-progress"]
    assert scaling.main([*argv, "--out", str(tmp_path / "never")]) == 0
    assert scaling.main([*argv, "--slice-fitting", "auto", "--out", str(tmp_path / "auto")]) == 0
    never, auto = (pd.read_csv(tmp_path / d / "scaling.csv").iloc[0] for d in ("never", "auto"))
    assert auto["slice_fitting"] == "auto" and auto["real_tokens"] == never["real_tokens"]
    assert auto["pred_step_s"] <= never["pred_step_s"] and auto["slice_fitting_s"] > 0
    assert auto["pred_step_s"] >= auto["ideal_s"]
    if auto["sliced"] > 0:        # slices only where predicted faster (since zb defers W as published, this
        assert auto["slice_threshold"] > 0 and auto["pred_step_s"] < never["pred_step_s"]   # cell keeps none)
    else:
        assert auto["pred_step_s"] == never["pred_step_s"]


@pytest.mark.dist
def test_calibration_study_replays_every_step_of_a_tiny_compare(tmp_path):
    """The recorded tables hold everything a step's prediction came from: replaying every step's schedule with
    ``job_calibration`` on the job's earlier actions gives back the ``pred_step_s`` the run printed, and with the
    measured action times the ``replay_step_s`` it recorded (moved here from tests/test_compare.py)."""
    from dynmb.cli import main
    out = tmp_path / "cmp"
    assert main(["compare", "--model", "tiny", "--dataset", "gsm8k", "--global-batch", "8", "--steps", "2",
                 "--warmup", "0", "--methods", "fixed,dynamic", "--memory-limit", "24MiB", "--no-fixed-best",
                 "--out", str(out)]) == 0
    steps = pd.read_csv(out / "steps.csv")
    study = _script("calibration_study").study(out, recent=2)
    assert len(study) == len(steps)
    assert study["job"].to_numpy() == pytest.approx(study["recorded"].to_numpy(), rel=1e-6)
    replay = steps.set_index(["label", "step"])["replay_step_s"]
    assert study["measured_actions"].to_numpy() == pytest.approx(
        replay.loc[list(zip(study["label"], study["step"]))].to_numpy(), rel=1e-6)


def test_compare_headroom_prints_every_budget(capsys):
    """The headroom script: dynamic's predicted total, and each baseline's at every budget it is swept over."""
    headroom = importlib.import_module("studies.compare.headroom")
    assert headroom.main(["--model", "small", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "dynamic" in out and out.count("tuned /") == 2
    assert all(f"/{d} " in out for budgets in headroom.SWEEPS.values() for d in budgets)
