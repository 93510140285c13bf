"""Cost model: scipy fits, grid interpolation, I/O, refusal, the shared lookup, refit from actions."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from dynmb.config import ModelConfig
from dynmb.costmodel import (
    FORMS, AnalyticCostModel, CommModel, CostModel, FittedCostModel, GridCostModel, _nnls_rel,
    fit_cost_model, get_cost_model, kfold_error, noise_floor, point_medians, samples_from_actions,
)

CFG = ModelConfig.preset("small")
TRUE = {  # (stage, op) -> (c0, c1_tok, c2_tok_len)
    (0, "F"): (1e-3, 2e-7, 1e-10), (0, "B"): (2e-3, 4e-7, 2e-10),
    (1, "F"): (5e-4, 3e-7, 1e-10), (1, "B"): (1e-3, 6e-7, 2e-10),
}
ROWS = [1, 2, 4, 8, 16, 32, 64]
LENS = [32, 64, 128, 256, 512, 1024, 2048]


def _truth(stage, op, b, s):
    c0, c1, c2 = TRUE[(stage, op)]
    return c0 + c1 * b * s + c2 * b * s * s


def synthetic_samples(noise=0.02, repeats=5, seed=0, cap=16384, lens=LENS) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for b in ROWS:
        for s in lens:
            if b * s > cap:
                continue
            for (p, op) in TRUE:
                for r in range(repeats):
                    t = _truth(p, op, b, s) * (1 + noise * rng.standard_normal())
                    rows.append({"stage": p, "op": op, "rows": b, "padded_len": s, "tokens": b * s, "packed": False,
                                 "time_s": t, "repeat": r, "model": "small", "device": "cpu", "threads": 1})
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def samples():
    return synthetic_samples()


def test_fit_recovers_known_coefficients(samples):
    m = fit_cost_model(samples, CFG, 2, kind="poly")
    coefs = m.coefficients()
    for (p, op), want in TRUE.items():
        row = coefs[(coefs.stage == p) & (coefs.op == op)].iloc[0]
        assert row["form"] in ("quad", "quad_b")
        got = [row["c0"], row["c1_tok"], row["c2_tok_len"]]
        np.testing.assert_allclose(got, want, rtol=0.15)
        b, s = np.array([3, 24, 5]), np.array([700, 96, 1800])
        np.testing.assert_allclose(m.predict(p, op, b, s), _truth(p, op, b, s), rtol=0.03)
    assert all(np.all(c >= 0) for _, c in m.params.values())


def test_relative_error_weighting_protects_small_times():
    # times span 4 decades; unweighted least squares sacrifices the small ones
    b = np.array([1, 1, 2, 64, 64, 64], float)
    s = np.array([32, 64, 32, 1024, 2048, 1536], float)
    t = 1e-3 + 1e-7 * b * s + 1e-10 * b * s * s
    t = t * np.array([1.0, 1.0, 1.0, 1.1, 0.9, 1.05])  # noise on the large ones only
    x = np.stack([np.ones_like(b), b * s, b * s * s], axis=1)
    rel = _nnls_rel(x, t)
    from scipy.optimize import nnls
    absc, _ = nnls(x, t)
    rel_err = lambda c: np.abs(x @ c - t) / t  # noqa: E731
    assert np.sum(rel_err(rel) ** 2) <= np.sum(rel_err(absc) ** 2) + 1e-12
    assert rel_err(rel)[:3].max() < rel_err(absc)[:3].max()
    assert rel_err(rel)[:3].max() < 0.05


def test_form_choice_prefers_simple_when_enough():
    df = synthetic_samples(noise=0.01)
    # purely linear truth: the quadratic term is not needed
    df["time_s"] = 1e-3 + 2e-7 * df["rows"] * df["padded_len"] * (1 + 0.01 * np.random.default_rng(1).standard_normal(len(df)))
    m = FittedCostModel.fit(df, CFG, 2)
    assert {f for f, _ in m.params.values()} <= {"lin", "lin_b"}
    assert set(FORMS) >= set(m.meta["form_cv_mape"]["0F"])


def test_grid_interpolates_exactly_at_grid_points(samples):
    m = fit_cost_model(samples, CFG, 2, kind="grid")
    med = point_medians(samples)
    for (p, op), g in med.groupby(["stage", "op"]):
        pred = m.predict(int(p), op, g["rows"].to_numpy(), g["padded_len"].to_numpy())
        np.testing.assert_allclose(pred, g["time_s"].to_numpy(), rtol=1e-9)
    # between grid points it lies between the neighbours; rows beyond the grid scale linearly
    mid = m.predict(0, "F", 4, 96)
    assert m.predict(0, "F", 4, 64) < mid < m.predict(0, "F", 4, 128)
    assert m.predict(0, "F", 1, 5000) > m.predict(0, "F", 1, 2048) > 0


def test_kfold_error_and_noise_floor(samples):
    err = kfold_error(samples, "poly", 5, model_cfg=CFG, num_stages=2)
    assert list(err.columns[:4]) == ["stage", "op", "mape", "max_ape"] and (err["n"] > 10).all()
    assert (err["mape"] < 0.05).all()
    gerr = kfold_error(samples, "grid", 5, model_cfg=CFG, num_stages=2)
    assert len(gerr) == 4 and np.isfinite(gerr["mape"]).all()
    nf = noise_floor(samples)
    assert ((nf["noise"] > 0.005) & (nf["noise"] < 0.03)).all()  # 2% Gaussian -> median |dev| ~ 1.35%


@pytest.mark.parametrize("kind", ["poly", "grid", "analytic"])
def test_save_load_roundtrip(samples, tmp_path, kind):
    m = AnalyticCostModel(CFG, 2) if kind == "analytic" else fit_cost_model(samples, CFG, 2, kind=kind)
    m.comm = CommModel(1e-4, 3e9)
    path = tmp_path / "cost.json"
    m.save(path)
    d = json.loads(path.read_text())
    assert d["kind"] == kind and d["num_stages"] == 2 and d["model"]["d_model"] == CFG.d_model
    m2 = get_cost_model(path, CFG, 2)
    assert type(m2) is type(m) and m2.comm.alpha_s == 1e-4
    rows, lens = np.array([1, 3, 17, 64]), np.array([2048, 333, 100, 32])
    for op in ("F", "B"):
        for p in range(2):
            np.testing.assert_allclose(m2.predict(p, op, rows, lens), m.predict(p, op, rows, lens), rtol=1e-12)


def test_refuses_other_config(samples, tmp_path):
    m = fit_cost_model(samples, CFG, 2)
    m.save(tmp_path / "c.json")
    with pytest.raises(ValueError, match="tiny") as e:
        get_cost_model(tmp_path / "c.json", ModelConfig.preset("tiny"), 2)
    assert "small" in str(e.value)
    with pytest.raises(ValueError, match="4 stages"):
        get_cost_model(tmp_path / "c.json", CFG, 4)
    with pytest.raises(ValueError, match="stages"):
        fit_cost_model(samples[samples.stage == 0], CFG, 2)


def test_stage_costs_shapes_and_the_lookup(samples):
    for m in (AnalyticCostModel(CFG, 2), fit_cost_model(samples, CFG, 2), fit_cost_model(samples, CFG, 2, kind="grid")):
        c = m.stage_costs([1, 8, 4], [2048, 512, 128])
        assert set(c) == {"F", "B"} and c["F"].shape == (2, 3) and c["B"].shape == (2, 3)
        assert (c["F"] > 0).all() and (c["B"] > c["F"]).all()
        assert m.stage_costs(4, 256)["F"].shape == (2, 1)
        np.testing.assert_allclose(c["F"][1, 1], m.predict(1, "F", 8, 512))
        assert m.predict(0, "W", [1, 2], 64).tolist() == [0.0, 0.0]
        assert m.comm_s(4, 256) == pytest.approx(m.comm.time(CFG.message_bytes(4, 256)))
    with pytest.raises(ValueError):
        AnalyticCostModel(CFG, 2).predict(2, "F", 1, 1)
    with pytest.raises(ValueError):
        AnalyticCostModel(CFG, 2).predict(0, "X", 1, 1)
    assert isinstance(get_cost_model(None, CFG, 2), AnalyticCostModel)


def test_comm_model_fit():
    n = np.array([4096 * 4**i for i in range(8)], float)
    m = CommModel.fit(n, 5e-5 + n / 2e9)
    assert m.alpha_s == pytest.approx(5e-5, rel=1e-3) and m.bytes_per_s == pytest.approx(2e9, rel=1e-3)


def test_samples_from_actions_refit(samples):
    rng = np.random.default_rng(0)
    rows = []
    for step in range(3):
        for i, (b, s) in enumerate([(1, 2048), (4, 512), (16, 128), (2, 1024), (8, 256), (32, 64), (64, 32), (3, 700)]):
            for p, op in TRUE:
                t0 = float(rng.uniform(0, 10))
                rows.append({"run_id": "r", "step": step, "rank": p, "stage": p, "op": op, "mb": i, "batch": b,
                             "padded_len": s, "start_s": t0, "end_s": t0 + _truth(p, op, b, s), "pred_s": 0.0})
    acts = pd.DataFrame(rows)
    sm = samples_from_actions(acts)
    assert {"stage", "op", "rows", "padded_len", "time_s"} <= set(sm.columns) and len(sm) == len(acts)
    np.testing.assert_allclose(sm["time_s"], acts["end_s"] - acts["start_s"])
    m = fit_cost_model(sm, CFG, 2)
    np.testing.assert_allclose(m.predict(1, "B", 6, 300), _truth(1, "B", 6, 300), rtol=0.02)
    with pytest.raises(ValueError, match="end_s"):
        samples_from_actions(acts.drop(columns=["end_s"]))


def test_cli_fit(samples, tmp_path, capsys):
    from dynmb.cli import main
    samples.to_csv(tmp_path / "s.csv", index=False)
    assert main(["fit", str(tmp_path / "s.csv"), "--model", "small", "--stages", "2", "-o", str(tmp_path / "c.json"),
                 "--plot", str(tmp_path / "fit.png")]) == 0
    out = capsys.readouterr().out
    assert "mape" in out and "c2_tok_len" in out and (tmp_path / "fit.png").exists()
    assert isinstance(CostModel.load(tmp_path / "c.json"), FittedCostModel)
    assert isinstance(get_cost_model(tmp_path / "c.json", CFG, 2), FittedCostModel)
    assert main(["fit", str(tmp_path / "s.csv"), "--model", "tiny", "-o", str(tmp_path / "x.json")]) == 2


def test_tiny_real_profile(tmp_path):
    pytest.importorskip("dynmb.model")
    from dynmb.profile import default_grid, profile, synthetic_microbatch
    tiny = ModelConfig.preset("tiny")
    out = tmp_path / "samples.csv"
    df = profile(tiny, 2, grid=[(1, 32, False), (2, 64, True)], repeats=2, warmup=1, output=out, progress=False, memory=False)
    assert len(df) == 2 * 2 * 2 * 2 and out.exists()
    assert {"stage", "op", "rows", "padded_len", "tokens", "packed", "time_s", "repeat", "device", "threads",
            "torch_version", "model"} <= set(df.columns)
    assert (df["time_s"] > 0).all() and set(df["op"]) == {"F", "B"}
    again = profile(tiny, 2, grid=[(1, 32, False), (2, 64, True)], repeats=2, warmup=1, output=out, progress=False)
    assert len(again) == len(df)  # resumed: nothing re-measured
    mb = synthetic_microbatch(3, 64, packed=True)
    assert mb.is_packed and mb.batch == 3 and mb.padded_len == 64
    assert all(b * s <= 2048 for b, s, _ in default_grid(quick=True))


def test_tiny_concurrent_profile(tmp_path):
    """Concurrent mode: one process per stage, all stages of a point timed at once; resumable;
    refuses to mix with samples measured alone; the fitted model records the mode."""
    pytest.importorskip("dynmb.model")
    from dynmb.costmodel import fit_cost_model
    from dynmb.profile import profile
    tiny = ModelConfig.preset("tiny")
    out = tmp_path / "samples.csv"
    grid = [(1, 32, False), (2, 64, False), (2, 64, True)]
    df = profile(tiny, 2, grid=grid, repeats=2, warmup=1, output=out, progress=False, memory=False, concurrent=True)
    assert len(df) == 3 * 2 * 2 * 2 and out.exists()
    assert (df["concurrent"] == 2).all() and (df["time_s"] > 0).all()
    assert set(map(tuple, df[["stage", "op"]].drop_duplicates().to_numpy())) == {(0, "F"), (0, "B"), (1, "F"), (1, "B")}
    again = profile(tiny, 2, grid=grid, repeats=3, warmup=1, output=out, progress=False, memory=False, concurrent=True)
    assert len(again) == len(df) + 3 * 2 * 2 and (again.groupby(["stage", "op", "rows", "padded_len", "packed"]).size() == 3).all()
    with pytest.raises(ValueError, match="concurrent"):
        profile(tiny, 2, grid=grid, repeats=1, output=out, progress=False, memory=False)
    m = fit_cost_model(again, tiny, 2)
    assert m.meta["concurrent"] == 2
    with pytest.raises(ValueError, match="cuda|CPU"):
        profile(tiny, 2, grid=grid, device="cuda", concurrent=True, progress=False)


def test_runtime_overhead_from_small_actions_only():
    import pandas as pd

    from dynmb.costmodel import OVERHEAD_MIN_ACTIONS, runtime_overhead

    rng = np.random.default_rng(0)
    n = 20
    pred = rng.uniform(0.002, 0.03, n)
    small = pd.DataFrame({"op": "F", "pred_s": pred, "start_s": 0.0, "end_s": pred + 0.0015})
    big = pd.DataFrame({"op": "F", "pred_s": [1.0, 2.0], "start_s": 0.0, "end_s": [1.5, 2.9]})   # noisy, ignored
    back = pd.DataFrame({"op": "B", "pred_s": pred[:OVERHEAD_MIN_ACTIONS - 1], "start_s": 0.0,
                         "end_s": pred[:OVERHEAD_MIN_ACTIONS - 1] + 0.01})                       # too few: 0
    oh = runtime_overhead(pd.concat([small, big, back], ignore_index=True))
    assert oh["F"] == pytest.approx(0.0015)
    assert oh["B"] == 0.0
    faster = small.assign(end_s=small["pred_s"] - 0.001)                                     # never negative
    assert runtime_overhead(faster)["F"] == 0.0


def test_with_overhead_adds_per_action_and_round_trips(tmp_path):
    from dynmb.costmodel import CostModel

    cfg = ModelConfig.preset("tiny")
    base = get_cost_model(None, cfg, 2)
    cm = base.with_overhead(F=0.001, B=0.002)
    c0, c1 = base.stage_costs([1, 4], [64, 128]), cm.stage_costs([1, 4], [64, 128])
    assert np.allclose(c1["F"] - c0["F"], 0.001) and np.allclose(c1["B"] - c0["B"], 0.002)
    assert base.runtime_overhead_s == {"F": 0.0, "B": 0.0}          # a copy: the base is unchanged
    cm.save(tmp_path / "c.json")
    again = CostModel.load(tmp_path / "c.json")
    assert again.runtime_overhead_s == {"F": 0.001, "B": 0.002}
    assert np.allclose(again.stage_costs([1, 4], [64, 128])["B"], c1["B"])
