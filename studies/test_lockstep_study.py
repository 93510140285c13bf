"""Smoke tests of ``studies/lockstep``: the study's one small cell (its columns, (e) never slower than (a0)
in-order or (a) packed, the lower bound below every method), the bound-only mode, the real runs' paired ratios
and the actions' re-predictions on made-up run folders."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pandas as pd

HERE = Path(__file__).resolve().parent / "lockstep"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_one_cell(tmp_path):
    mod = _load("lockstep_study")
    assert mod.main(["--traces", "wikitext2", "--models", "llama2-7b", "--P", "2", "--D", "2", "--T", "4096",
                     "--dynamic-max-tokens", "1e5", "--out", str(tmp_path)]) == 0
    df = pd.read_csv(tmp_path / "lockstep.csv")
    assert len(df) == 1
    row = df.iloc[0]
    assert row.e_lockstep_s <= row.a_packed_s * (1 + 1e-12) and row.e_lockstep_s <= row.a0_in_order_s * (1 + 1e-12)
    assert row.ideal_s < min(row.e_lockstep_s, row.f_dynamic_s)
    for col in ("gap_a_packed", "gap_a0_in_order", "gap_b_D", "gap_c_M", "gap_d_G", "gap_e_lockstep", "gap_f_dynamic",
                "share_M", "floor_vs_a", "e_vs_per_group", "e_vs_a0", "lb_vs_a0", "lb_vs_a"):
        assert col in df
    assert row.lb_s <= min(row.e_lockstep_s, row.a_packed_s, row.a0_in_order_s, row.b_D_s, row.c_M_s, row.d_G_s)


def test_bound_only(tmp_path, capsys):
    mod = _load("lockstep_study")
    assert mod.main(["--traces", "longtail", "--models", "llama2-7b", "--P", "2,4", "--D", "2", "--T", "4096",
                     "--bound-only", "--out", str(tmp_path)]) == 0
    df = pd.read_csv(tmp_path / "bound.csv")
    assert len(df) == 2 and "e_lockstep_s" not in df
    assert (df.lb_s <= df.a_packed_s).all() and (df.lb_s <= df.a0_in_order_s).all() and (df.lb_M <= df.M).all()
    capsys.readouterr()
    assert mod.main(["--tables", str(tmp_path / "bound.csv")]) == 0
    assert "lb/in-order > 0.95 in" in capsys.readouterr().out


def test_real_actions_reprices_made_up_runs(tmp_path):
    """Two one-replica runs of two stages whose ops take known seconds: the makespans and ratios come out exact."""
    mod = _load("real_actions")
    for method, cost in (("packed", 1.0), ("lockstep", 0.5)):
        d = tmp_path / f"{method}_1"
        d.mkdir()
        acts = [{"run_id": method, "step": 1, "rank": s, "dp_rank": 0, "stage": s, "op": op, "mb": j, "batch": 1,
                 "padded_len": 64, "docs": 1 + j, "attn_work": 64 * 64, "start_s": 0.0, "end_s": 2 * cost,
                 "pred_s": cost, "raw_pred_s": cost, "cpu_s": cost} for s in (0, 1) for op in "FB" for j in (0, 1)]
        pd.DataFrame(acts).to_csv(d / "actions.csv", index=False)
        pd.DataFrame({"step": [0, 1], "warmup": [True, False], "step_s": [9.0, 6 * cost],
                      "pred_step_s": [9.0, 6 * cost]}).to_csv(d / "steps.csv", index=False)
        (d / "spec.json").write_text('{"run": {"cost_model": "no-such-file.json"}}')
    a, steps = mod.load(tmp_path)
    a["comm_s"] = mod.comm_seconds(tmp_path, a)
    t = mod.per_step(a, steps, cores=2)
    assert np.allclose(t.makespan_cpu_s, 6 * t.cpu_work / 8)          # 1F1B, 2 stages, 2 equal microbatches: 6 ops
    assert np.allclose(t.shared_cpu_s, t.cpu_work / 2)
    r = mod.ratios(t)
    assert np.isclose(r.loc[("packed", "lockstep"), "step_s"], 0.5)
    assert set(mod.per_op(a).row_class) == {"lone", "multi"}
    rounds = mod.per_round(t)
    assert rounds.run.tolist() == ["lockstep_1"] and np.isclose(rounds.step_s.iloc[0], 0.5)


def test_real_runs_pair_each_run_with_its_baselines(tmp_path):
    """Runs A B C D A B C D whose step times are known: the all-pairs and neighbour ratios come out exact."""
    mod = _load("real_runs")
    scale = {"in-order": 2.0, "packed": 1.5, "lockstep": 1.2, "dynamic": 1.0}
    for r in (1, 2):
        for k, m in enumerate(mod.METHODS):
            d = tmp_path / f"{m}_{r}"
            d.mkdir()
            pd.DataFrame({"step": [0, 1, 2], "step_s": [9.0, scale[m], scale[m] * 2],
                          "pred_step_s": [1.0, scale[m], scale[m]]}).to_csv(d / "steps.csv", index=False)
            pd.DataFrame({"date": [f"2026-01-01T00:{r}{k}"]}).to_csv(d / "runs.csv", index=False)
    runs, order = mod.load_runs(tmp_path)
    assert order[:4] == [f"{m}_1" for m in mod.METHODS]
    row = mod.paired(runs, order, "lockstep", "in-order")
    assert row["pairs"] == 4 and abs(row["step_s / baseline"] - 0.6) < 1e-12
    assert row["neighbour pairs"] == 3 and abs(row["step_s / baseline (neighbours)"] - 0.6) < 1e-12
    args = mod.build_parser().parse_args([str(tmp_path)])
    assert "--pack-len" not in mod.run_command("dynamic", tmp_path, args)
    assert "--pack-len" in mod.run_command("in-order", tmp_path, args)
