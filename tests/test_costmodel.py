"""Cost model: scipy fits (attention work as the quadratic feature, packed rows), grid interpolation
and its packing correction, I/O (old files too), refusal, the shared lookup, refit from actions."""

from __future__ import annotations

import json
import logging

import numpy as np
import pandas as pd
import pytest

from dynmb.core.config import ModelConfig
from dynmb.costmodel import (
    FORMS, AnalyticCostModel, CommModel, CostModel, FittedCostModel, GridCostModel, nnls_rel,
    fit_cost_model, get_cost_model, kfold_error, noise_floor, point_medians, samples_from_actions,
)
from dynmb.planning import default_cost_model_path
from dynmb.core.types import Microbatch, Plan

CFG = ModelConfig.preset("small")
SHIPPED = default_cost_model_path("small", 2)
TRUE = {  # (stage, op) -> (c0, c1_tok, c2_attn)
    (0, "F"): (1e-3, 2e-7, 1e-10), (0, "B"): (2e-3, 4e-7, 2e-10),
    (1, "F"): (5e-4, 3e-7, 1e-10), (1, "B"): (1e-3, 6e-7, 2e-10),
}
ROWS = [1, 2, 4, 8, 16, 32, 64]
LENS = [32, 64, 128, 256, 512, 1024, 2048]
PACKED = [(b, s, k) for b in (1, 2, 4) for s in (512, 1024, 2048) for k in (4, 16, 64)]  # rows, padded_len, docs/row


def _truth(stage, op, b, s, a=None):
    c0, c1, c2 = TRUE[(stage, op)]
    return c0 + c1 * b * s + c2 * (b * s * s if a is None else a)


def packed_microbatch(rows: int, padded_len: int, docs_per_row: int, seed: int = 0) -> Microbatch:
    """Rows filled exactly with ``docs_per_row`` documents of random lengths (>= 1)."""
    rng = np.random.default_rng([seed, rows, padded_len, docs_per_row])
    cuts = [np.sort(rng.choice(np.arange(1, padded_len), size=docs_per_row - 1, replace=False)) for _ in range(rows)]
    lens = np.concatenate([np.diff(np.concatenate([[0], c, [padded_len]])) for c in cuts])
    return Microbatch(np.arange(lens.size), lens, padded_len, rows, np.repeat(np.arange(rows), docs_per_row))


def synthetic_samples(noise=0.02, repeats=5, seed=0, cap=16384, lens=LENS, packed=True) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    points = [(b, s, 1, b * s * s) for b in ROWS for s in lens if b * s <= cap]
    if packed:
        points += [(b, s, k, packed_microbatch(b, s, k).attention_work("auto")) for b, s, k in PACKED
                   if s in lens and b * s <= cap]
    rows = []
    for b, s, k, a in points:
        for (p, op) in TRUE:
            for r in range(repeats):
                t = _truth(p, op, b, s, a) * (1 + noise * rng.standard_normal())
                rows.append({"stage": p, "op": op, "rows": b, "padded_len": s, "tokens": b * s, "packed": k > 1,
                             "docs_per_row": k, "attn_work": a, "time_s": t, "repeat": r, "model": "small",
                             "device": "cpu", "threads": 1})
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def samples():
    return synthetic_samples()


def test_fit_recovers_known_coefficients(samples):
    assert (samples["attn_work"] < samples["rows"] * samples["padded_len"] ** 2).sum() > 0   # packed points differ
    m = fit_cost_model(samples, CFG, 2, kind="poly")
    coefs = m.coefficients()
    mb = packed_microbatch(3, 1500, 10, seed=7)
    for (p, op), want in TRUE.items():
        row = coefs[(coefs.stage == p) & (coefs.op == op)].iloc[0]
        assert row["form"] in ("quad", "quad_b")
        got = [row["c0"], row["c1_tok"], row["c2_attn"]]
        np.testing.assert_allclose(got, want, rtol=0.15)
        b, s = np.array([3, 24, 5]), np.array([700, 96, 1800])
        np.testing.assert_allclose(m.predict(p, op, b, s), _truth(p, op, b, s), rtol=0.03)
        a = mb.attention_work("auto")                                 # a packed microbatch off the grid
        np.testing.assert_allclose(m.predict(p, op, 3, 1500, a), _truth(p, op, 3, 1500, a), rtol=0.03)
        assert m.predict(p, op, 3, 1500, a) < 0.8 * m.predict(p, op, 3, 1500)
    assert all(np.all(c >= 0) for _, c in m.params.values())


def test_fit_finds_a_per_token_cost_of_packed_microbatches(samples):
    """The document-causal path's gather/scatter costs per computed token, on packed
    microbatches only (a < b*s^2): a form with c4_packed_tok is chosen and recovers it."""
    surcharge = 0.3 * np.array([TRUE[(p, op)][1] for p, op in zip(samples["stage"], samples["op"])])
    packed = samples["attn_work"] < samples["rows"] * samples["padded_len"] ** 2
    df = samples.assign(time_s=samples["time_s"] + packed * surcharge * samples["rows"] * samples["padded_len"])
    m = fit_cost_model(df, CFG, 2)
    coefs = m.coefficients()
    assert set(coefs["form"]) <= {"quad_p", "quad_bp"}
    np.testing.assert_allclose(coefs["c4_packed_tok"] / coefs["c1_tok"], 0.3, rtol=0.2)
    mb = packed_microbatch(2, 1800, 12)
    a = mb.attention_work("auto")
    truth = _truth(0, "F", 2, 1800, a) + 0.3 * TRUE[(0, "F")][1] * 2 * 1800
    assert m.predict(0, "F", 2, 1800, a) == pytest.approx(truth, rel=0.03)
    assert m.predict(0, "F", 2, 1800) == pytest.approx(_truth(0, "F", 2, 1800), rel=0.03)   # one document per row


def test_fit_on_packed_points_needs_the_attention_work(samples):
    """Fitted as if every row held one document (a = b*s^2), the packed points pull the attention
    coefficient away from the truth; with the attention work it is recovered."""
    wrong = samples.assign(attn_work=samples["rows"] * samples["padded_len"] ** 2)
    right_err = kfold_error(samples, "poly", 5, model_cfg=CFG, num_stages=2, by=("stage", "op", "packed"))
    wrong_err = kfold_error(wrong.assign(time_s=samples["time_s"]), "poly", 5, model_cfg=CFG, num_stages=2)
    assert (right_err["mape"] < 0.03).all() and set(right_err["packed"]) == {False, True}
    assert wrong_err["mape"].min() > right_err["mape"].max()


def test_packed_documents_predicted_cheaper_than_one_long_row(samples, tmp_path):
    """64 documents of 64 tokens in one 4096-token row attend over 64 * 64^2 positions, not 4096^2."""
    packed = Microbatch(np.arange(64), np.full(64, 64), 4096, 1, row_ids=np.zeros(64, int))
    one_row = Microbatch([0], [4096], 4096, 1)
    assert packed.attention_work("auto") == 64 * 64 ** 2 and one_row.attention_work("auto") == 4096 ** 2
    models = [fit_cost_model(samples, CFG, 2), fit_cost_model(samples, CFG, 2, kind="grid"), AnalyticCostModel(CFG, 2),
              CostModel.load(SHIPPED)]
    for m in models:
        plan = Plan((packed, one_row), "packed", 2, 2**30, 65)
        c = m.plan_costs(plan)
        for op in ("F", "B"):
            assert (c[op][:, 0] < c[op][:, 1]).all(), (m.kind, op, c[op])
    dense = fit_cost_model(samples, ModelConfig.preset("small", attention="dense"), 2)
    c = dense.plan_costs(Plan((packed, one_row), "packed", 2, 2**30, 65))
    np.testing.assert_allclose(c["F"][:, 0], c["F"][:, 1])            # the (s, s) mask ablation: no saving


def test_plan_costs_is_stage_costs_with_the_attention_work(samples):
    mbs = (Microbatch([0, 1], [300, 200], 300, 2), packed_microbatch(2, 1024, 8, seed=1),
           Microbatch([100, 101, 102], [40, 60, 20], 128, 1, row_ids=[0, 0, 0]))
    mbs = (mbs[0], Microbatch(np.arange(2, 18), mbs[1].lengths, 1024, 2, mbs[1].row_ids), mbs[2])
    plan = Plan(mbs, "packed", 2, 2**30, 103)
    for m in (fit_cost_model(samples, CFG, 2), fit_cost_model(samples, CFG, 2, kind="grid"), AnalyticCostModel(CFG, 2)):
        shapes = plan.shapes()
        work = [mb.attention_work(CFG.attention) for mb in mbs]
        want = m.stage_costs(shapes[:, 0], shapes[:, 1], work)
        got = m.plan_costs(plan)
        for op in ("F", "B"):
            np.testing.assert_allclose(got[op], want[op], rtol=1e-12)
            np.testing.assert_allclose(got[op][:, 0], m.stage_costs(2, 300)[op][:, 0], rtol=1e-12)   # one doc/row
            assert (got[op][:, 1:] < m.stage_costs(shapes[1:, 0], shapes[1:, 1])[op]).all()          # packed: less


def test_relative_error_weighting_protects_small_times():
    # times span 4 decades; unweighted least squares sacrifices the small ones
    b = np.array([1, 1, 2, 64, 64, 64], float)
    s = np.array([32, 64, 32, 1024, 2048, 1536], float)
    t = 1e-3 + 1e-7 * b * s + 1e-10 * b * s * s
    t = t * np.array([1.0, 1.0, 1.0, 1.1, 0.9, 1.05])  # noise on the large ones only
    x = np.stack([np.ones_like(b), b * s, b * s * s], axis=1)
    rel = nnls_rel(x, t)
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
    for (p, op), g in med[~med["packed"]].groupby(["stage", "op"]):
        pred = m.predict(int(p), op, g["rows"].to_numpy(), g["padded_len"].to_numpy())
        np.testing.assert_allclose(pred, g["time_s"].to_numpy(), rtol=1e-9)
    # between grid points it lies between the neighbours; rows beyond the grid scale linearly
    mid = m.predict(0, "F", 4, 96)
    assert m.predict(0, "F", 4, 64) < mid < m.predict(0, "F", 4, 128)
    assert m.predict(0, "F", 1, 5000) > m.predict(0, "F", 1, 2048) > 0


def test_grid_corrects_packed_microbatches(samples):
    """The grid sees shapes only; its correction -k (b s^2 - a) brings packed points to the truth,
    fitted from packed samples or, without any, from the one-document table's quad fit."""
    with_packed = fit_cost_model(samples, CFG, 2, kind="grid")
    plain_only = fit_cost_model(samples[~samples["packed"]], CFG, 2, kind="grid")
    ignoring = GridCostModel(CFG, 2, with_packed.grids)                    # an old file: no correction
    mb = packed_microbatch(2, 1024, 16, seed=3)
    a = mb.attention_work("auto")
    for (p, op) in TRUE:
        truth = _truth(p, op, 2, 1024, a)
        for m in (with_packed, plain_only):
            assert abs(m.predict(p, op, 2, 1024, a) / truth - 1) < 0.08, (p, op)
            assert m.attn_slope[(p, op)] == pytest.approx(TRUE[(p, op)][2], rel=0.25)
        assert ignoring.predict(p, op, 2, 1024, a) > 1.1 * truth
    gerr = kfold_error(samples, "grid", 5, model_cfg=CFG, num_stages=2, by=("stage", "op", "packed"))
    assert len(gerr) == 8 and np.isfinite(gerr["mape"]).all()


def test_grid_beyond_its_longest_row_corrects_against_what_the_table_holds(samples):
    """Past the longest measured padded_len (2,048 here) the table goes on linearly, so it holds the
    secant's attention, not b s^2: a long packed row of short documents is priced near the truth
    (subtracting k (b s^2 - a) took it to 0 s), the price rises with every document added, and a
    one-document row past the grid gains the quadratic attention the extrapolation misses."""
    m = fit_cost_model(samples, CFG, 2, kind="grid")
    for (p, op) in TRUE:
        docs = np.arange(1, 41)
        s = 1000.0 * docs                                                    # rows of 1..40 documents of 1,000
        pred = m.predict(p, op, np.ones_like(s), s, docs * 1000.0 ** 2)
        truth = _truth(p, op, 1, s, docs * 1000.0 ** 2)
        assert (np.diff(pred) > 0).all(), (p, op)
        np.testing.assert_allclose(pred, truth, rtol=0.15)
        one_doc = m.predict(p, op, 1, 16384)
        assert abs(one_doc / _truth(p, op, 1, 16384) - 1) < 0.15, (p, op)


def test_kfold_error_and_noise_floor(samples):
    err = kfold_error(samples, "poly", 5, model_cfg=CFG, num_stages=2)
    assert list(err.columns[:4]) == ["stage", "op", "mape", "max_ape"] and (err["n"] > 10).all()
    assert (err["mape"] < 0.05).all()
    gerr = kfold_error(samples, "grid", 5, model_cfg=CFG, num_stages=2)
    assert len(gerr) == 4 and np.isfinite(gerr["mape"]).all()
    nf = noise_floor(samples)
    assert ((nf["noise"] > 0.005) & (nf["noise"] < 0.03)).all()  # 2% Gaussian -> median |dev| ~ 1.35%
    assert len(noise_floor(samples, by=("stage", "op", "packed"))) == 8


def test_old_samples_without_attention_work(samples, caplog):
    """Samples profiled before attn_work was recorded: one-document rows get b*s^2, packed rows
    (attention work unknown) are skipped with a warning."""
    old = samples.drop(columns=["attn_work", "docs_per_row"])
    with caplog.at_level(logging.WARNING, logger="dynmb.costmodel"):
        med = point_medians(old)
    assert not med["packed"].any() and (med["attn_work"] == med["rows"] * med["padded_len"] ** 2).all()
    assert "packed sample rows without attn_work" in caplog.text
    assert len(med) == len(point_medians(samples[~samples["packed"]]))
    m = fit_cost_model(old, CFG, 2)
    np.testing.assert_allclose(m.predict(0, "F", 4, 1000), _truth(0, "F", 4, 1000), rtol=0.03)


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
    rows, lens, work = np.array([1, 3, 17, 64]), np.array([2048, 333, 100, 32]), np.array([2e5, 3e5, 1.7e5, 65536])
    for op in ("F", "B"):
        for p in range(2):
            np.testing.assert_allclose(m2.predict(p, op, rows, lens), m.predict(p, op, rows, lens), rtol=1e-12)
            np.testing.assert_allclose(m2.predict(p, op, rows, lens, work), m.predict(p, op, rows, lens, work),
                                       rtol=1e-12)


OLD_POLY = {  # a cost-model file as written before the attention work was a feature
    "kind": "poly", "num_stages": 2, "comm": {"alpha_s": 1e-4, "bytes_per_s": 1.7e9},
    "model": {"name": "small", "vocab_size": 2048, "d_model": 256, "n_layers": 4, "n_heads": 4, "d_ff": 1024,
              "max_seq_len": 8192, "dtype": "float32"},
    "meta": {"device": "cpu", "threads": 1, "model": "small", "n_samples": 2270},
    "params": {"fits": [
        {"stage": 0, "op": "B", "form": "quad_b", "coef": {"c0": 3e-3, "c1_tok": 1e-4, "c2_tok_len": 1e-7, "c3_row": 1e-4}},
        {"stage": 0, "op": "F", "form": "quad", "coef": {"c0": 1.5e-3, "c1_tok": 5e-5, "c2_tok_len": 4e-8}},
        {"stage": 1, "op": "B", "form": "quad", "coef": {"c0": 2.6e-3, "c1_tok": 1.3e-4, "c2_tok_len": 1e-7}},
        {"stage": 1, "op": "F", "form": "lin", "coef": {"c0": 1.5e-3, "c1_tok": 7e-5}}]},
}


def test_old_cost_model_files_load_or_are_refused_in_one_line(tmp_path):
    """A poly file from before the attention-work feature (``c2_tok_len``) is refused, naming the
    missing coefficient and the fix; an old grid file (no coefficient names) still loads."""
    path = tmp_path / "old.json"
    path.write_text(json.dumps(OLD_POLY))
    with pytest.raises(ValueError, match=r"old\.json.*lacks the coefficients \['c2_attn'\].*refit") as e:
        get_cost_model(path, CFG, 2)
    assert "\n" not in str(e.value)
    old_grid = {**OLD_POLY, "kind": "grid", "params": {"tables": [
        {"stage": p, "op": op, "rows": [1, 4], "padded_len": [64, 256], "time_s": [[0.01, 0.04], [0.04, 0.16]]}
        for p in range(2) for op in ("F", "B")]}}
    path.write_text(json.dumps(old_grid))
    g = get_cost_model(path, CFG, 2)
    assert g.attn_slope == {(p, op): 0.0 for p in range(2) for op in ("F", "B")}      # ignores documents
    assert g.predict(1, "B", 4, 256, 1000) == pytest.approx(0.16)
    shipped = CostModel.load(SHIPPED)
    assert shipped.predict(0, "F", 4, 512) > shipped.predict(0, "F", 4, 512, 4 * 64**2) > 0


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
        i, w, b = (m.predict(0, op, [1, 2], 64) for op in ("I", "W", "B"))
        assert (w > 0).all() and (i > 0).all() and (i + w >= b).all() and (w < b).all()
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


def test_samples_from_actions_with_attention_work():
    """Actions carrying attn_work (and docs) refit a model that knows packed microbatches; without
    attn_work, packed actions (docs > batch) are skipped."""
    rng = np.random.default_rng(1)
    shapes = [(1, 2048, 1), (4, 512, 1), (16, 128, 1), (2, 1024, 1), (8, 256, 1), (32, 64, 1), (3, 700, 1),
              (1, 2048, 16), (2, 1024, 4), (4, 512, 32), (1, 1536, 8), (2, 2048, 64), (8, 256, 4)]
    rows = []
    for step in range(3):
        for i, (b, s, k) in enumerate(shapes):
            mb = packed_microbatch(b, s, k, seed=step) if k > 1 else Microbatch(np.arange(b), np.full(b, s), s, b)
            for p, op in TRUE:
                a = mb.attention_work("auto")
                rows.append({"step": step, "stage": p, "op": op, "mb": i, "batch": b, "padded_len": s,
                             "docs": mb.num_seqs, "attn_work": a, "start_s": 1.0,
                             "end_s": 1.0 + _truth(p, op, b, s, a), "pred_s": 0.0})
    acts = pd.DataFrame(rows)
    sm = samples_from_actions(acts)
    assert (sm["packed"] == (acts["docs"] > acts["batch"])).all() and (sm["attn_work"] == acts["attn_work"]).all()
    m = fit_cost_model(sm, CFG, 2)
    a = packed_microbatch(2, 1800, 12).attention_work("auto")
    np.testing.assert_allclose(m.predict(0, "B", 2, 1800, a), _truth(0, "B", 2, 1800, a), rtol=0.03)
    assert rng is not None
    no_work = samples_from_actions(acts.drop(columns=["attn_work"]))
    assert no_work["packed"].sum() == (acts["docs"] > acts["batch"]).sum()
    assert not point_medians(no_work)["packed"].any()


def test_cli_fit(samples, tmp_path, capsys):
    from dynmb.cli import main
    samples.to_csv(tmp_path / "s.csv", index=False)
    assert main(["fit", str(tmp_path / "s.csv"), "--model", "small", "--stages", "2", "-o", str(tmp_path / "c.json"),
                 "--plot", str(tmp_path / "fit.png")]) == 0
    out = capsys.readouterr().out
    assert "mape" in out and "c2_attn" in out and (tmp_path / "fit.png").exists()
    assert isinstance(CostModel.load(tmp_path / "c.json"), FittedCostModel)
    assert isinstance(get_cost_model(tmp_path / "c.json", CFG, 2), FittedCostModel)
    assert main(["fit", str(tmp_path / "s.csv"), "--model", "tiny", "-o", str(tmp_path / "x.json")]) == 2


def test_tiny_real_profile(tmp_path):
    pytest.importorskip("dynmb.models")
    from dynmb.measure import default_grid, profile, synthetic_microbatch
    tiny = ModelConfig.preset("tiny")
    out = tmp_path / "samples.csv"
    grid = [(1, 32, 1), (2, 64, 4), (1, 128, 16)]
    df = profile(tiny, 2, grid=grid, repeats=2, warmup=1, output=out, progress=False, memory=False)
    assert len(df) == 3 * 2 * 2 * 2 and out.exists()
    assert {"stage", "op", "rows", "padded_len", "tokens", "packed", "docs_per_row", "attn_work", "time_s", "repeat",
            "device", "threads", "torch_version", "model", "attention"} <= set(df.columns)
    assert (df["time_s"] > 0).all() and set(df["op"]) == {"F", "B"}
    for (b, s, k), g in df.groupby(["rows", "padded_len", "docs_per_row"]):
        assert (g["attn_work"] == synthetic_microbatch(b, s, k).attention_work(tiny.attention)).all()
        assert (g["packed"] == (k > 1)).all()
    again = profile(tiny, 2, grid=grid, repeats=2, warmup=1, output=out, progress=False)
    assert len(again) == len(df)  # resumed: nothing re-measured
    comm_only = tmp_path / "comm.csv"   # `--comm` writes its ping-pong rows before the grid starts
    pd.DataFrame({"nbytes": [4096], "repeat": [0], "time_s": [1e-4], "stage": [-1], "op": ["comm"], "rows": [0],
                  "padded_len": [0], "model": ["tiny"], "num_stages": [2]}).to_csv(comm_only, index=False)
    resumed = profile(tiny, 2, grid=grid[:1], repeats=1, warmup=0, output=comm_only, progress=False, memory=False)
    assert (resumed["op"] == "comm").sum() == 1 and len(resumed) == 1 + 2 * 2
    legacy = tmp_path / "legacy.csv"
    df.drop(columns=["attn_work"]).to_csv(legacy, index=False)
    with pytest.raises(ValueError, match="attn_work"):
        profile(tiny, 2, grid=grid, repeats=1, output=legacy, progress=False, memory=False)
    assert all(b * s <= 2048 for b, s, _ in default_grid(quick=True))


def test_grid_varies_documents_per_row():
    from dynmb.measure import GRID_DOCS, MIN_DOC_TOKENS, default_grid, estimate_run_seconds, synthetic_microbatch
    grid = default_grid()
    docs = {k for _, _, k in grid}
    assert docs == set(GRID_DOCS) and all(s >= k * MIN_DOC_TOKENS and b * s <= 8192 for b, s, k in grid)
    assert len(grid) == len(set(grid)) < 160
    for b, s, k in [(3, 512, 16), (2, 64, 4), (1, 2048, 64), (4, 128, 1)]:
        mb = synthetic_microbatch(b, s, k, seed=2)
        assert mb.batch == b and mb.padded_len == s and mb.num_seqs == b * (k if k > 1 else 1)
        assert mb.lengths.min() >= (MIN_DOC_TOKENS if k > 1 else s // 2)
        if k > 1:
            assert (np.bincount(mb.row_ids, weights=mb.lengths) == s).all() and mb.is_packed
            assert mb.attention_work("auto") < b * s * s == mb.attention_work("dense")
    assert synthetic_microbatch(3, 64, True).is_packed and not synthetic_microbatch(3, 64, False).is_packed
    with pytest.raises(ValueError, match="docs_per_row"):
        synthetic_microbatch(1, 8, 16)
    cheap, dear = (estimate_run_seconds(CFG, 2, 0, pt) for pt in [(1, 2048, 64), (1, 2048, 1)])
    assert 0 < cheap < dear


def test_tiny_concurrent_profile(tmp_path):
    """Concurrent mode: one process per stage, all stages of a point timed at once; resumable;
    refuses to mix with samples measured alone; the fitted model records the mode."""
    pytest.importorskip("dynmb.models")
    from dynmb.costmodel import fit_cost_model
    from dynmb.measure import profile
    tiny = ModelConfig.preset("tiny")
    out = tmp_path / "samples.csv"
    grid = [(1, 32, 1), (2, 64, 1), (2, 64, 4)]
    df = profile(tiny, 2, grid=grid, repeats=2, warmup=1, output=out, progress=False, memory=False, concurrent=True)
    assert len(df) == 3 * 2 * 2 * 2 and out.exists()
    assert (df["concurrent"] == 2).all() and (df["time_s"] > 0).all()
    assert set(map(tuple, df[["stage", "op"]].drop_duplicates().to_numpy())) == {(0, "F"), (0, "B"), (1, "F"), (1, "B")}
    again = profile(tiny, 2, grid=grid, repeats=3, warmup=1, output=out, progress=False, memory=False, concurrent=True)
    assert len(again) == len(df) + 3 * 2 * 2
    assert (again.groupby(["stage", "op", "rows", "padded_len", "docs_per_row"]).size() == 3).all()
    assert (again.loc[again["docs_per_row"] == 4, "attn_work"] < 2 * 64**2).all()
    with pytest.raises(ValueError, match="concurrent"):
        profile(tiny, 2, grid=grid, repeats=1, output=out, progress=False, memory=False)
    m = fit_cost_model(again, tiny, 2)
    assert m.meta["concurrent"] == 2
    with pytest.raises(ValueError, match="cuda|CPU"):
        profile(tiny, 2, grid=grid, device="cuda", concurrent=True, progress=False)


def test_runtime_calibration_scales_big_actions_and_adds_the_overhead_of_small_ones():
    import pandas as pd

    from dynmb.costmodel import OVERHEAD_MIN_ACTIONS, SCALE_MIN_PRED_S, runtime_calibration

    big = np.array([0.05, 0.2, 0.4, 0.1])
    fwd0 = pd.DataFrame({"op": "F", "stage": 0, "pred_s": big, "start_s": 1.0, "end_s": 1.0 + big * [1.1, 1.3, 1.2, 1.0]})
    fwd1 = fwd0.assign(stage=1, end_s=1.0 + big * 0.9)
    small = np.linspace(0.002, 0.03, 12)                     # scaled like their stage's big ones, + 2 ms
    sm0 = pd.DataFrame({"op": "F", "stage": 0, "pred_s": small, "start_s": 0.0,
                        "end_s": small * float((big * [1.1, 1.3, 1.2, 1.0]).sum() / big.sum()) + 0.002})
    sm1 = sm0.assign(stage=1, end_s=small * 0.9 + 0.002)
    few = pd.DataFrame({"op": "B", "stage": 0, "pred_s": [SCALE_MIN_PRED_S * 0.9], "start_s": 0.0, "end_s": 2.0})
    tiny = pd.DataFrame({"op": "B", "stage": 1, "pred_s": [0.001] * (OVERHEAD_MIN_ACTIONS - 1), "start_s": 0.0,
                         "end_s": 0.004})
    cal = runtime_calibration(pd.concat([fwd0, fwd1, sm0, sm1, few, tiny], ignore_index=True), num_stages=2)
    assert cal.scale["F"][0] == pytest.approx(float((big * [1.1, 1.3, 1.2, 1.0]).sum() / big.sum()))
    assert cal.scale["F"][1] == pytest.approx(0.9)
    assert cal.overhead_s["F"] == pytest.approx(0.002)
    assert "B" not in cal.scale       # too little predicted work on stage 0, none on stage 1
    assert "B" not in cal.overhead_s  # too few small ones
    faster = pd.concat([sm0.assign(end_s=sm0["pred_s"] * 0.5)] * 2, ignore_index=True)
    assert runtime_calibration(faster, num_stages=2).overhead_s["F"] == 0.0      # never negative


def _calibration_step(run_id, ratio_f0, ratio_f1=1.0, pred=0.5, small=0, small_extra_s=0.0):
    """One step's actions: two big forwards per stage at ``ratio`` x their prediction, and
    ``small`` small stage-0 forwards taking ``small_extra_s`` more than predicted."""
    import pandas as pd

    from dynmb.costmodel import CalibrationStep

    rows = [{"op": "F", "stage": st, "pred_s": pred, "start_s": 0.0, "end_s": pred * r}
            for st, r in ((0, ratio_f0), (1, ratio_f1)) for _ in range(2)]
    rows += [{"op": "F", "stage": 0, "pred_s": 0.01, "start_s": 0.0, "end_s": 0.01 * ratio_f0 + small_extra_s}
             for _ in range(small)]
    return CalibrationStep(run_id, pd.DataFrame(rows))


def test_job_calibration_is_own_bias_times_the_jobs_recent_speed():
    from dynmb.costmodel import RECENT_STEPS, job_calibration

    assert RECENT_STEPS == 2 and job_calibration([], "a", 2).scale == {}
    # a run alone in its job: its own ratio of sums over all its steps
    alone = [_calibration_step("a", 1.2), _calibration_step("a", 1.4, pred=1.0)]
    assert job_calibration(alone, "a", 2).scale["F"][0] == pytest.approx((1.2 * 1.0 + 1.4 * 2.0) / 3.0)
    # run a's stage-0 forwards ran at 1.1x; the job's speed around each of them (the step and the
    # two before it) was 1.1x and 3.2 / 3 x, so a's bias is 2.2 / (1.1 + 3.2 / 3); the machine runs
    # at 1.5x over the last two steps
    hist = [_calibration_step("a", 1.1), _calibration_step("b", 1.0), _calibration_step("a", 1.1),
            _calibration_step("b", 1.0), _calibration_step("b", 1.5), _calibration_step("c", 1.5)]
    cal = job_calibration(hist, "a", 2)
    assert cal.scale["F"][0] == pytest.approx(2.2 / (1.1 + 3.2 / 3) * 1.5)
    # a run slower than the job by a fixed factor at every speed keeps that factor
    drift = [_calibration_step("a", 1.2 * v) if k % 2 == 0 else _calibration_step("b", v)
             for k, v in enumerate([1.0, 1.0, 1.3, 1.3, 1.3, 1.3, 0.9, 0.9])]
    assert job_calibration(drift, "a", 2).scale["F"][0] == pytest.approx(1.2 * 0.9, rel=0.06)
    assert cal.scale["F"][1] == pytest.approx(1.0)            # every stage-1 forward ran as predicted
    # a run with no steps yet takes the job's recent speed
    assert job_calibration(hist, "new", 2).scale["F"][0] == pytest.approx(1.5)
    # the overhead per action comes from the recent window when it has enough small actions
    noisy = hist[:-2] + [_calibration_step("b", 1.5, small=8, small_extra_s=0.004), _calibration_step("c", 1.5)]
    assert job_calibration(noisy, "a", 2).overhead_s["F"] == pytest.approx(0.004)
    # ... and from the run's own steps once it has enough small actions of its own
    own = noisy + [_calibration_step("a", 1.1, small=8, small_extra_s=0.002)]
    assert job_calibration(own, "a", 2).overhead_s["F"] == pytest.approx(0.002)


def test_with_scale_multiplies_per_stage_before_overhead_and_round_trips(tmp_path):
    from dynmb.costmodel import CostModel

    cfg = ModelConfig.preset("tiny")
    base = get_cost_model(None, cfg, 2).with_overhead(F=0.001, B=0.002)
    cm = base.with_scale({"F": [1.5, 1.0], "B": [1.0, 2.0]})
    c0, c1 = base.stage_costs([1, 4], [64, 128], ops=("F", "B", "I", "W")), \
        cm.stage_costs([1, 4], [64, 128], ops=("F", "B", "I", "W"))
    assert np.allclose(c1["F"][0] - 0.001, 1.5 * (c0["F"][0] - 0.001)) and np.allclose(c1["F"][1], c0["F"][1])
    assert np.allclose(c1["B"][1] - 0.002, 2.0 * (c0["B"][1] - 0.002)) and np.allclose(c1["B"][0], c0["B"][0])
    for op in ("I", "W"):                                     # derived from B: B's scale
        assert np.allclose(c1[op][1], 2.0 * c0[op][1]) and np.allclose(c1[op][0], c0[op][0])
    assert base.runtime_scale == {}                           # a copy: the base is unchanged
    cm.save(tmp_path / "c.json")
    again = CostModel.load(tmp_path / "c.json")
    assert again.scale_of(0, "F") == 1.5 and again.scale_of(1, "B") == 2.0
    assert np.allclose(again.stage_costs([1, 4], [64, 128])["F"], c1["F"])
    with pytest.raises(ValueError, match="runtime scale of F"):
        base.with_scale({"F": [1.0]})


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


# --- model files validated on load: finite, non-negative, non-decreasing in tokens -------------
def _grid_file(time_s):
    return {**OLD_POLY, "kind": "grid", "params": {"tables": [
        {"stage": p, "op": op, "rows": [1, 4], "padded_len": [64, 256], "time_s": time_s}
        for p in range(2) for op in ("F", "B")]}}


def _poly_file(**coef):
    d = json.loads(json.dumps(OLD_POLY))
    d["params"]["fits"][1]["coef"].update(coef)      # stage 0, op F, form quad
    return d


BAD_COST_FILES = {
    "nan": (lambda: _poly_file(c1_tok=float("nan")), "finite"),
    "negative": (lambda: _poly_file(c0=-1e-3), "non-negative"),
    "inf comm": (lambda: {**OLD_POLY, "comm": {"alpha_s": float("inf"), "bytes_per_s": 1e9}}, "finite"),
    "decreasing grid": (lambda: _grid_file([[0.04, 0.01], [0.16, 0.04]]), "decreases with tokens"),
    "nan grid": (lambda: _grid_file([[0.01, float("nan")], [0.04, 0.16]]), "finite"),
    "unordered axis": (lambda: {**_grid_file([[0.01, 0.04], [0.04, 0.16]]), "params": {"tables": [
        {"stage": p, "op": op, "rows": [4, 1], "padded_len": [64, 256], "time_s": [[0.01, 0.04], [0.04, 0.16]]}
        for p in range(2) for op in ("F", "B")]}}, "strictly increasing"),
    "wrong table shape": (lambda: _grid_file([[0.01, 0.04, 0.05], [0.04, 0.16, 0.2]]), "expected 2x2"),
}


@pytest.mark.parametrize("case", list(BAD_COST_FILES))
def test_bad_cost_model_file_is_refused_naming_the_file(tmp_path, case):
    make, match = BAD_COST_FILES[case]
    path = tmp_path / "bad-cost.json"
    path.write_text(json.dumps(make()))     # json writes NaN/Infinity, as a buggy fit would
    with pytest.raises(ValueError, match=match) as e:
        CostModel.load(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: invalid cost-model file") and "\n" not in msg


def test_decreasing_cost_model_is_refused_on_the_command_line(tmp_path, capsys):
    from dynmb.cli import main
    path = tmp_path / "bad-cost.json"
    path.write_text(json.dumps(_grid_file([[0.04, 0.01], [0.16, 0.04]])))
    rc = main(["plan", "--dataset", "gsm8k", "--global-batch", "8", "--stages", "2", "--memory-limit", "1GiB",
               "--method", "dynamic", "--cost-model", str(path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and str(path) in err and "decreases with tokens" in err


def test_shipped_and_fitted_models_pass_the_load_checks(samples, tmp_path):
    from dynmb.costmodel.validate import check_cost_model, check_memory_model
    from dynmb.memory.model import MemoryModel
    check_cost_model(CostModel.load(SHIPPED))
    check_cost_model(AnalyticCostModel(CFG, 2))
    for kind in ("poly", "grid"):
        m = fit_cost_model(samples, CFG, 2, kind=kind)
        m.save(tmp_path / f"{kind}.json")
        assert type(CostModel.load(tmp_path / f"{kind}.json")) is type(m)
    for name in ("tiny", "small", "gpt2"):
        check_memory_model(MemoryModel.analytic(ModelConfig.preset(name), 2))


def test_memory_model_check_refuses_bad_coefficients():
    from dynmb.costmodel.validate import check_memory_model
    from dynmb.memory.model import MemoryModel
    good = MemoryModel.analytic(CFG, 2)
    act = good.act_coef.copy()
    act[1, 0], act[1, 2] = 1e12, -act[1, 1] / 100     # stage 1's bytes fall beyond padded_len 50
    bad = MemoryModel(CFG, 2, good.state_bytes, act, good.transient_coef)
    with pytest.raises(ValueError, match="stage 1 activation bytes"):
        check_memory_model(bad)
    act[1, 2] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        check_memory_model(MemoryModel(CFG, 2, good.state_bytes, act, good.transient_coef))
    with pytest.raises(ValueError, match="state_bytes"):
        check_memory_model(MemoryModel(CFG, 2, [1.0, float("inf")], good.act_coef, good.transient_coef))


def test_profile_eta_is_calibrated_on_the_measured_runs():
    from dynmb.measure import Eta
    now = [0.0]
    eta = Eta([1.0] * 10 + [4.0] * 10, clock=lambda: now[0], every_s=30.0)   # 50 estimated seconds
    assert eta.remaining() is None and eta.postfix() == "ETA ?"
    lines = []
    for est in [1.0] * 10 + [4.0] * 10:
        now[0] += 2.0 * est                 # this machine is twice as slow as the estimate
        lines.append(eta.update(est))
    assert lines[0] is None and lines[1] is None and lines[2] is not None      # after the first 3 runs
    assert "3/20 runs in 6 s; about 94 s left" in lines[2]                      # (50 - 3) x 2, not 47
    assert sum(line is not None for line in lines) <= 4 and "\n" not in lines[2]
    assert "e+" not in "".join(line for line in lines if line) and "np." not in "".join(x for x in lines if x)
    assert eta.final() == ("profile: 20 runs in 100 s (first estimate 50 s; projected 100 s after 3 runs, "
                           "measured / projected 1.00)")
