"""Per-stage recomputation of leading blocks (``ModelConfig.recompute_blocks``) in planning: the analytic memory
count (``dynmb.memory.coef``), the price (``dynmb.costmodel.split.apply_block_recompute``) and the choice of
``stage_split="auto"``'s memory relief (``dynmb.planning.memory_split``).

On the code before it (bc7c598, the field read by nothing) the byte, cost and choice tests fail: the activations,
transient, I-to-W bytes and B / I / W do not move with the field, and relief never sets it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dynmb
from dynmb.core.config import ModelConfig
from dynmb.costmodel.analytic import AnalyticCostModel
from dynmb.costmodel.gpu import GPUCostModel
from dynmb.memory.coef import piece_act_coef, w_coef
from dynmb.memory.model import MemoryModel
from dynmb.planning import memory_split as ms
from dynmb.planning.stage_split import resolve_stage_split

SPLITS = {2: [(1.75, 2.25), (2.5, 1.5), (3, 1), (1.875, 2.125)],
          3: [(1.5, 1.25, 1.25), (2, 1, 1), (1.25, 1.5, 1.25)],
          4: [(1, 1, 1, 1), (1.5, 1, 1, 0.5), (0.75, 1.25, 1.5, 0.5)]}
"""Layer splits of llama-tiny / tiny (4 layers) with whole, half and chunk boundaries."""


def _layout(name: str, split: tuple[float, ...], blocks: list[int] | None = None) -> ModelConfig:
    cfg = replace(dynmb.model_config(name), layer_split=tuple(split))
    return cfg if blocks is None else replace(cfg, recompute_blocks=tuple(blocks))


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[ModelConfig, ModelConfig, int]:
    """(layout without recomputed blocks, the same with some, P)."""
    P = draw(st.sampled_from(sorted(SPLITS)))
    split = draw(st.sampled_from(SPLITS[P]))
    name = draw(st.sampled_from(["llama-tiny", "tiny"]))
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    plain = replace(_layout(name, split), dtype=dtype)
    held = [len(b) for b in plain.stage_blocks(P)]
    blocks = [draw(st.integers(0, n)) for n in held]
    return plain, replace(plain, recompute_blocks=tuple(blocks)), P


def _recomputed_pieces(cfg: ModelConfig, P: int, stage: int) -> list[list]:
    """The pieces of each recomputed block of ``stage``, block by block (``stage_blocks`` order)."""
    k = cfg.stage_recompute_blocks(P)[stage]
    layers = [layer for layer, _ in cfg.stage_blocks(P)[stage]][:k]
    pieces = cfg.stage_pieces(P)[stage]
    return [[pc for pc in pieces if pc.layer == layer] for layer in layers]


# --- memory ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("P", sorted(SPLITS))
def test_an_all_zero_field_counts_bit_equal_bytes(P: int) -> None:
    for split in SPLITS[P]:
        plain = _layout("llama-tiny", split)
        zero = replace(plain, recompute_blocks=(0,) * P)
        assert zero.recompute_blocks is None
        a, b = MemoryModel.analytic(plain, P), MemoryModel.analytic(zero, P)
        for f in ("act_coef", "transient_coef", "w_coef", "rc_act_coef", "rc_transient_coef", "state_bytes"):
            assert np.array_equal(getattr(a, f), getattr(b, f)), f


@settings(max_examples=40, deadline=None)
@given(_layouts())
def test_a_recomputed_block_keeps_only_its_input(case: tuple[ModelConfig, ModelConfig, int]) -> None:
    """Activations: each recomputed block's pieces (``piece_act_coef``) out, its input in (``e d``; ``2 e d`` for a
    block that starts inside a half); transient: the largest recomputed block (less an LM-head stage's logits
    gradient); I-to-W: none of its bytes (a stage recomputing all holds the LM head's only); a full-recompute
    microbatch's counts unchanged."""
    plain, rc, P = case
    a, b = MemoryModel.analytic(plain, P), MemoryModel.analytic(rc, P)
    e, d = plain.dtype_bytes, plain.d_model
    for i in range(P):
        blocks = _recomputed_pieces(rc, P, i)
        saved = sum((piece_act_coef(plain, pc) for blk in blocks for pc in blk), np.zeros(2))
        inputs = sum(e * d * (2 if blk[0].chunks.start else 1) for blk in blocks)
        np.testing.assert_allclose(a.act_coef[i, 1:] - b.act_coef[i, 1:], saved - [inputs, 0], rtol=1e-12, atol=1e-9)
        largest = max((sum(piece_act_coef(plain, pc) for pc in blk) for blk in blocks), key=lambda x: x[0],
                      default=np.zeros(2))
        rows = len(plain.stage_vocab(P)[i])
        want = np.array([max(largest[0] - 4 * rows, 0.0) if rows else largest[0], largest[1]])
        np.testing.assert_allclose(b.transient_coef[i, 1:] - a.transient_coef[i, 1:], want, atol=1e-9)
        if blocks and len(blocks) == len(plain.stage_blocks(P)[i]):
            head = e * (d + rows) if rows and not plain.tie_embeddings else 0.0
            assert b.w_coef[i, 1] == pytest.approx(head)
        elif blocks:
            assert b.w_coef[i, 1] < a.w_coef[i, 1]
        else:
            assert b.w_coef[i, 1] == a.w_coef[i, 1]
    np.testing.assert_allclose(b.rc_act_coef, a.rc_act_coef, atol=1e-9)
    np.testing.assert_allclose(b.rc_transient_coef, a.rc_transient_coef, atol=1e-9)
    assert np.array_equal(a.state_bytes, b.state_bytes)
    assert np.array_equal(w_coef(rc, P), b.w_coef)


@settings(max_examples=25, deadline=None)
@given(_layouts(), st.integers(0, 2**31 - 1), st.sampled_from(["1f1b", "zb-h1"]))
def test_the_simulated_peak_is_the_counted_one(case: tuple[ModelConfig, ModelConfig, int], seed: int,
                                               kind: str) -> None:
    """A plan on a recomputing layout: the simulator's peak (act, transient, I-to-W bytes of the view) stays within
    the limit and, under 1F1B, is ``MemoryModel.peak_bytes``'s exactly; the recomputing layout admits at least as
    many tokens a microbatch on every stage."""
    plain, rc, P = case
    lengths = np.random.default_rng(seed).integers(8, 200, 48)
    mm = MemoryModel.analytic(rc, P)
    limit = int(mm.state_bytes.max() + 6 * (mm.act_coef[:, 1].max() + mm.transient_coef[:, 1].max()) * 400)
    planner = dynmb.Planner(model=rc, num_stages=P, memory_limit=limit, cost_model=GPUCostModel(rc, P),
                            schedule=kind, stage_split="even")
    assert planner.model_cfg.recompute_blocks == rc.recompute_blocks
    step = planner.plan(lengths)
    peak = np.asarray(step.sim.peak_bytes)
    assert np.all(peak <= limit)
    if kind == "1f1b":
        shapes = step.plan.shapes()
        np.testing.assert_allclose(peak, planner.memory_model.peak_bytes(shapes[:, 0], shapes[:, 1], "1f1b"),
                                   rtol=1e-12)
    a = MemoryModel.analytic(plain, P)
    caps = np.full(P, float(limit)) - a.state_bytes
    assert np.all(mm.max_rows(caps, [1], np.arange(P, 0, -1), tight=True)
                  >= a.max_rows(caps, [1], np.arange(P, 0, -1), tight=True))


def test_offload_is_refused_on_a_recomputing_layout() -> None:
    rc = _layout("llama-tiny", (2, 2), [1, 0])
    with pytest.raises(ValueError, match="recomputes blocks"):
        MemoryModel.analytic(rc, 2).offloading([1, 0])
    assert MemoryModel.analytic(rc, 2).offloading(None).offload_blocks is None


# --- cost ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_cls", [GPUCostModel, AnalyticCostModel])
def test_b_i_w_follow_the_rule_on_whole_layers(model_cls: type) -> None:
    """A stage of whole layers and no head recomputing k: B and I gain k layers' forward (the stage's F less its
    fixed per-op cost, times k / layers), I also those layers' W, which W loses; F unchanged; a microbatch flagged
    ``recompute`` priced as before; no field: bit-equal."""
    cfg = replace(dynmb.model_config("llama3.1-8b"), layer_split=(8, 8, 8, 8))
    rc = replace(cfg, recompute_blocks=(1, 2, 0, 0))
    rows, lens = np.array([1.0, 4.0, 2.0]), np.array([4096.0, 512.0, 1000.0])
    ops = ("F", "B", "I", "W")
    a = model_cls(cfg, 4).stage_costs(rows, lens, ops=ops)
    b = model_cls(rc, 4).stage_costs(rows, lens, ops=ops)
    fixed = model_cls(cfg, 4).stage_costs(np.zeros(1), np.ones(1), ops=("F",))["F"][:, 0]
    if model_cls is GPUCostModel:
        fixed = fixed - GPUCostModel(cfg, 4).spec.overhead_per_layer_s * 8     # its launches are per layer
    for i, k in enumerate((1, 2, 0, 0)):
        f_blk = (a["F"][i] - fixed[i]) * k / 8
        w_blk = a["W"][i] * k / 8 if model_cls is GPUCostModel else None
        np.testing.assert_array_equal(b["F"][i], a["F"][i])
        np.testing.assert_allclose(b["B"][i] - a["B"][i], f_blk, rtol=1e-9, atol=1e-15)
        w_moved = a["W"][i] - b["W"][i]
        if w_blk is not None:
            np.testing.assert_allclose(w_moved, w_blk, rtol=1e-9, atol=1e-15)
        assert np.all(w_moved >= 0) and (k > 0) == bool(np.all(w_moved > 0))
        np.testing.assert_allclose(b["I"][i] - a["I"][i], f_blk + w_moved, rtol=1e-9, atol=1e-15)
    flagged = [True, False, True]
    a_rc = model_cls(cfg, 4).stage_costs(rows, lens, ops=ops, recompute=flagged)
    b_rc = model_cls(rc, 4).stage_costs(rows, lens, ops=ops, recompute=flagged)
    for op in ops:
        np.testing.assert_array_equal(b_rc[op][:, [0, 2]], a_rc[op][:, [0, 2]])
        np.testing.assert_allclose(b_rc[op][:, 1], b[op][:, 1])
    zero = model_cls(replace(cfg, recompute_blocks=(0, 0, 0, 0)), 4).stage_costs(rows, lens, ops=ops)
    for op in ops:
        np.testing.assert_array_equal(zero[op], a[op])


@settings(max_examples=30, deadline=None)
@given(_layouts())
def test_the_price_of_any_recomputing_layout(case: tuple[ModelConfig, ModelConfig, int]) -> None:
    """Pieces, halves, the LM-head stage, a stage recomputing all its blocks: F unchanged, B + k blocks' forward,
    I + W = B where the split adds nothing (GPU), W never below 0, more blocks never cheaper."""
    plain, rc, P = case
    rows, lens = np.array([1.0, 3.0]), np.array([300.0, 64.0])
    ops = ("F", "B", "I", "W")
    a, b = GPUCostModel(plain, P).stage_costs(rows, lens, ops=ops), GPUCostModel(rc, P).stage_costs(rows, lens, ops=ops)
    np.testing.assert_array_equal(a["F"], b["F"])
    np.testing.assert_allclose(b["I"] + b["W"], b["B"], rtol=1e-9)
    assert np.all(b["W"] >= 0)
    for i, k in enumerate(rc.stage_recompute_blocks(P)):
        assert np.all(b["B"][i] >= a["B"][i]) and (k == 0) == np.array_equal(b["B"][i], a["B"][i])
        assert np.all(b["B"][i] - a["B"][i] <= a["F"][i])


def test_a_fitted_model_of_another_recompute_layout_is_refused_by_name() -> None:
    cfg = _layout("llama-tiny", (2, 2))
    rc = replace(cfg, recompute_blocks=(1, 0))
    with pytest.raises(ValueError, match=r"recomputing blocks \[1, 0\] per stage, not None"):
        GPUCostModel(rc, 2).check(cfg, 2)
    GPUCostModel(rc, 2).check(rc, 2)
    with pytest.raises(ValueError, match=r"recomputing blocks None per stage, not \[1, 0\]"):
        MemoryModel.analytic(cfg, 2).check(rc, 2)


# --- the choice --------------------------------------------------------------------------------------------------


def _gsm8k_inputs(name: str, P: int, limit: int) -> tuple[ModelConfig, ms.ReliefInputs]:
    trace = dynmb.data.load_trace("gsm8k")
    cfg = replace(dynmb.model_config(name), max_seq_len=int(trace.max()))
    cfg = resolve_stage_split(cfg, P, "auto", workload=trace, cost_model=GPUCostModel(cfg, P))
    return cfg, ms.ReliefInputs(memory_limit_bytes=limit, schedule_kind="auto", workload=trace,
                                cost_model=GPUCostModel(cfg, P))


def test_llama3_p8_at_24gib_recomputes_on_the_binding_first_stage() -> None:
    """The judged cell (issue 39): stage 0 binds (P in flight and the 128k-row embedding's states); relief takes a
    layout recomputing leading blocks of stage 0, whose proxy is ``RELIEF_GAIN`` below every split without
    recomputation."""
    cfg, inputs = _gsm8k_inputs("llama3.1-8b", 8, 24 << 30)
    out, relief = ms.relieve(cfg, 8, inputs)
    assert relief.recompute_blocks is not None and relief.recompute_blocks[0] > 0
    assert out.recompute_blocks == relief.recompute_blocks and tuple(out.stage_layer_counts(8)) == relief.split
    mean_len = max(1, int(round(float(np.asarray(inputs.workload, dtype=float).mean()))))
    without = min(ms.step_proxy(ms.layout_of(cfg, 8, s), 8, inputs, mean_len)[0]
                  for s in ms.relief_candidates(cfg, 8, inputs))
    assert relief.proxy_s < without * (1 - ms.RELIEF_GAIN) and relief.proxy_s < relief.balanced_proxy_s
    assert relief.tokens > relief.balanced_tokens


def test_where_memory_does_not_bind_nothing_is_recomputed() -> None:
    cfg, inputs = _gsm8k_inputs("llama3.1-8b", 8, 80 << 30)
    out, relief = ms.relieve(cfg, 8, inputs)
    assert relief.recompute_blocks is None and not relief.relieved and out == cfg


def test_the_planner_plans_the_recomputing_layout_within_the_limit() -> None:
    cfg = dynmb.model_config("llama-small")
    workload = np.array([40, 90, 150, 200, 260, 320, 700, 1200], dtype=np.int64)
    planner = dynmb.Planner(model=cfg, num_stages=2, memory_limit="64MiB", cost_model=GPUCostModel(cfg, 2),
                            schedule="1f1b", stage_split="auto", workload=workload)
    relief = planner.split_relief
    assert relief is not None and relief.recompute_blocks is not None
    assert planner.model_cfg.recompute_blocks == relief.recompute_blocks
    assert planner.memory_model.model_cfg.recompute_blocks == relief.recompute_blocks
    step = planner.plan(np.random.default_rng(0).choice(workload[workload <= 320], 32))
    assert np.all(np.asarray(step.plan.predictions["pred_peak_bytes"]) <= planner.memory_limit_bytes)


# --- gap terms -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1"])
def test_the_gap_terms_count_recomputed_blocks_in_passes(kind: str) -> None:
    """``dynmb.timing.gap_terms``: the same plan priced on a layout recomputing each stage's first block has the same
    ``shape`` and ``overhead`` as without it and a larger ``passes`` (the recomputed forward), the terms still
    adding up to the step's gap; before ``without_block_recompute`` the extra forward landed in ``shape``."""
    from dynmb.timing.gap_terms import gap_terms
    from dynmb.timing.simulate import simulate

    plain = _layout("llama-tiny", (2.5, 1.5))
    redone = replace(plain, recompute_blocks=(1, 1))          # the terms are read on the bound's rank: both
    planner = dynmb.Planner(model=plain, num_stages=2, memory_limit="1GiB", cost_model=GPUCostModel(plain, 2),
                            schedule=kind)
    step = planner.plan(np.random.default_rng(0).integers(8, 200, size=48))
    terms = []
    for cfg in (plain, redone):
        cm = GPUCostModel(cfg, 2)
        step_s = simulate(step.schedule, step.plan, cm).makespan_s
        terms.append(gap_terms(step.plan, step.schedule, cm, step_s).check())
    assert terms[1].shape == pytest.approx(terms[0].shape, rel=1e-12)
    assert terms[1].overhead == pytest.approx(terms[0].overhead, rel=1e-12)
    assert terms[1].passes > terms[0].passes + 1e-9
