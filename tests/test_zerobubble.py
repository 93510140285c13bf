"""Split backward (I, W) and the zero-bubble schedules: exactness, torch's IR checks, simulator
properties, memory accounting, and real gloo runs (2 and 4 ranks) against the single-process reference."""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynmb.core.config import ModelConfig, PipelineConfig, RunConfig
from dynmb.costmodel import get_cost_model
from dynmb.memory.model import get_memory_model
from dynmb.models import build_stage, build_stages, make_inputs, synthetic_tokens
from dynmb.measure import synthetic_microbatch
from dynmb.runtime.spec import RunSpec
from dynmb.runtime.splitbackward import backward_input, backward_weight, record_linears
from dynmb.schedule import build_schedule, from_str, to_csv, validate
from dynmb.schedule.zerobubble import ZBInputs, list_schedule, one_f_one_b_peaks
from dynmb.timing.simulate import simulate, simulate_costs
from dynmb.core.types import Microbatch, Plan
from dynmb.planning.zerobubble import build_zb, zb_evaluator, zb_inputs
from tests.gloo_jobs import register
from dynmb.costmodel.loader import Models

torch_sched = pytest.importorskip("torch.distributed.pipelining.schedules")
CFG = ModelConfig.preset("small")


def _plan(shapes: list[tuple[int, int]], P: int, limit: int = 2**30) -> Plan:
    mbs, sid = [], 0
    for b, s in shapes:
        mbs.append(Microbatch(np.arange(sid, sid + b), [s] * b, s, b))
        sid += b
    return Plan(tuple(mbs), "test", P, limit, sid)


DEEP = replace(CFG, name="small-12", n_layers=12)       # up to 12 stages for the simulator properties


def _models(P: int, cfg: ModelConfig = DEEP):
    return get_cost_model(None, cfg, P), get_memory_model(None, cfg, P)


# --------------------------------------------------------------------------- split backward, one process
def _grads(P: int, shapes, split: bool, w_late: bool = True) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    stages = build_stages(CFG, P, 0)
    pending = []
    for i, (b, s, d) in enumerate(shapes):
        mb = synthetic_microbatch(b, s, d, i)
        inp = make_inputs(mb, synthetic_tokens(mb.lengths, CFG.vocab_size, i), cfg=CFG)
        x, saved = None, []
        for stg in stages:
            xin = None if x is None else x.detach().requires_grad_()
            if split:
                with record_linears(stg) as tape:
                    y = stg(xin, inp)
            else:
                tape, y = None, stg(xin, inp)
            saved.append((stg, xin, y, tape))
            x = y
        g = None
        for stg, xin, y, tape in reversed(saved):
            if split:
                g = backward_input(stg, y, g, xin, tape)
                pending.append(tape) if w_late else backward_weight(tape)
            else:
                torch.autograd.backward(y, g)
                g = None if xin is None else xin.grad
    for tape in pending:
        backward_weight(tape)
    return {n: p.grad.clone() for stg in stages for n, p in stg.named_parameters()}


@pytest.mark.parametrize("P", [2, 4])
def test_split_backward_equals_full_backward(P):
    shapes = [(2, 96, 1), (1, 256, 8), (3, 48, 1)]        # padded rows and a packed one (bucketed attention)
    full, split = _grads(P, shapes, False), _grads(P, shapes, True)
    assert full.keys() == split.keys()
    for n in full:
        err = float((full[n] - split[n]).abs().max())
        assert err <= 1e-5 * float(full[n].abs().max()) + 1e-12, n


def test_w_later_holds_what_the_memory_model_says():
    """The meter's bytes held from I to W: at most ``MemoryModel.w_matrix``, within 3% for one document per row."""
    from dynmb.runtime.meter import MemoryMeter

    P = 2
    mm = get_memory_model(None, CFG, P)
    for s in range(P):
        stg = build_stage(CFG, s, P, 0)
        mb = synthetic_microbatch(2, 128, 1, 0)
        inp = make_inputs(mb, synthetic_tokens(mb.lengths, CFG.vocab_size), cfg=CFG)
        meter = MemoryMeter("cpu", [stg])
        x = None if s == 0 else torch.randn(2, 128, CFG.d_model, requires_grad=True)
        with meter.saving(s), record_linears(stg) as tape:
            y = stg(x, inp)
        act = meter.current_bytes - meter.state_bytes
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            backward_input(stg, y, None if s == P - 1 else torch.ones_like(y), x, tape)
        del y, x
        meter.hold(tape.hold_tensors(), s)
        held = meter.current_bytes - meter.state_bytes     # all that is left after I (+ the token ids on stage 0)
        w = float(mm.w_matrix([2], [128])[s, 0])
        assert 0.97 * w <= held <= w, s        # the model charges the bucket padding bound (1/16 of attention)
        assert held < act
        backward_weight(tape)
        meter.close()


def test_profile_times_i_and_w_and_the_fit_predicts_them():
    from dynmb.costmodel import fit_cost_model
    from dynmb.measure import profile

    tiny = ModelConfig.preset("tiny")
    grid = [(1, 32, 1), (2, 32, 1), (1, 64, 1), (2, 64, 1), (4, 32, 1), (1, 128, 1)]
    df = profile(tiny, 2, grid=grid, repeats=1, warmup=0, split=True, memory=False, progress=False)
    assert set(df["op"]) == {"F", "B", "I", "W"}
    model = fit_cost_model(df, tiny, 2)
    assert (0, "I") in model.params and (1, "W") in model.params        # fitted, not derived from B
    assert float(model.predict(1, "W", 2, 64)) > 0


# --------------------------------------------------------------------------- torch's IR
def _torch_actions(sched):
    return {r: [torch_sched._Action.from_str(str(a)) for a in acts] for r, acts in enumerate(sched.ranks)}


@pytest.mark.parametrize("kind,P", [("zb-h1", 2), ("zb-h1", 4), ("zb", 4), ("zb", 3)])
def test_zero_bubble_csv_passes_torch_checks(tmp_path, kind, P):
    rng = np.random.default_rng(P)
    shapes = [(int(rng.integers(1, 5)), int(rng.choice([64, 128, 512, 1024]))) for _ in range(9)]
    plan = _plan(shapes, P)
    cm, mm = _models(P)
    sched = build_zb(plan, kind, models=Models(cm, mm))
    validate(sched)
    assert any(a.op == "I" for acts in sched.ranks for a in acts)
    path = tmp_path / "zb.csv"
    to_csv(sched, path)
    actions = _torch_actions(from_str(path.read_text()))
    m = plan.num_microbatches
    assert torch_sched._validate_schedule(actions, P, P, m) == {s: s for s in range(P)}
    with_comms = torch_sched._add_send_recv(actions, lambda s: s, P)
    torch_sched._simulate_comms_compute(with_comms, lambda s: s, P)
    # and torch's runtime loads the file itself (its loader lowers it with comms and validates it)
    from types import SimpleNamespace
    stage = SimpleNamespace(num_stages=P, group_size=P, group_rank=0, stage_index=0)
    rt = torch_sched._PipelineScheduleRuntime([stage], m)
    rt._load_csv(str(path), format="compute_only")
    assert [[str(a) for a in rt.pipeline_order[r]] for r in range(P)] == [[str(a) for a in acts] for acts in sched.ranks]


def test_unit_costs_give_zb_h1_bubble():
    """F = I = W = 1, B = 2: 1F1B takes (m + P - 1) * 3, ZB-H1 m * 3 + (P - 1) (the paper's
    (P - 1)(T_F + T_B - T_W) bubble, Table 2, its T_B being dynmb's I)."""
    for P, m in [(4, 8), (4, 4), (8, 16), (3, 7)]:
        one = np.ones((P, m))
        c = {"F": one, "B": 2 * one, "I": one, "W": one}
        assert simulate_costs(build_schedule("1f1b", P, m), c).makespan_s == (m + P - 1) * 3
        assert simulate_costs(build_schedule("zb-h1", P, m), c).makespan_s == m * 3 + (P - 1) * (1 + 1 - 1)


# --------------------------------------------------------------------------- simulator properties
@st.composite
def variable_plans(draw):
    P = draw(st.integers(2, 6))
    m = draw(st.integers(1, 14))
    shapes = [(draw(st.integers(1, 8)), draw(st.sampled_from([32, 64, 128, 256, 512, 1024, 2048]))) for _ in range(m)]
    return _plan(shapes, P)


@settings(max_examples=40, deadline=None)
@given(variable_plans())
def test_zb_h1_never_slower_nor_higher_than_1f1b(plan):
    P, m = plan.num_stages, plan.num_microbatches
    cm, mm = _models(P)
    one = simulate(build_schedule("1f1b", P, m), plan, cm, mm)
    zb = build_zb(plan, "zb-h1", models=Models(cm, mm))
    validate(zb)
    got = simulate(zb, plan, cm, mm)
    assert got.makespan_s <= one.makespan_s * (1 + 1e-12)
    # ZB-H1's guarantee (Qi et al. 2.1): no GPU above 1F1B's fullest; a later stage holds its deferred W there
    assert np.max(got.peak_bytes) <= np.max(one.peak_bytes) + 1e-6


@settings(max_examples=25, deadline=None)
@given(variable_plans(), st.floats(1.0, 1.6))
def test_zb_stays_under_the_limit_and_beats_1f1b(plan, slack):
    P, m = plan.num_stages, plan.num_microbatches
    cm, mm = _models(P)
    one = simulate(build_schedule("1f1b", P, m), plan, cm, mm)
    limit = int(max(one.peak_bytes) * slack)
    plan = Plan(plan.microbatches, "test", P, limit, plan.num_sequences)
    got = simulate(build_zb(plan, "zb", models=Models(cm, mm)), plan, cm, mm)
    assert np.all(got.peak_bytes <= limit + 1e-6)
    assert got.makespan_s <= one.makespan_s * (1 + 1e-12)


@settings(max_examples=30, deadline=None)
@given(variable_plans())
def test_list_scheduler_times_and_bytes_are_the_simulators(plan):
    """The builder's own clock and byte count agree with the simulator on the order it emits."""
    P, m = plan.num_stages, plan.num_microbatches
    cm, mm = _models(P)
    inp = zb_inputs(plan, Models(cm, mm))
    for k in ([P - s for s in range(P)], [2 * (P - s) - 1 for s in range(P)]):
        sched, t = list_schedule(inp, k, one_f_one_b_peaks(inp))
        t_sim, peak = zb_evaluator(plan, Models(cm, mm), inp)(sched)
        assert t == pytest.approx(t_sim, rel=1e-12)
    assert np.all(one_f_one_b_peaks(inp) + mm.state_bytes
                  == pytest.approx(simulate(build_schedule("1f1b", P, m), plan, cm, mm).peak_bytes, rel=1e-12))


def test_zb_pure_without_costs_is_zb_h1():
    assert build_schedule("zb", 4, 6).ranks == build_schedule("zb-h1", 4, 6).ranks
    with pytest.raises(ValueError, match="one stage per rank"):
        build_schedule("zb-h1", 4, 6, virtual=2)


def test_recomputed_microbatches_keep_full_backward():
    plan = _plan([(2, 256), (1, 512), (4, 128)], 2)
    plan = Plan(tuple(Microbatch(mb.seq_ids, mb.lengths, mb.padded_len, mb.batch, recompute=(j == 1))
                      for j, mb in enumerate(plan.microbatches)), "test", 2, 2**30, plan.num_sequences)
    cm, mm = _models(2)
    inp = zb_inputs(plan, Models(cm, mm))
    assert not inp.split[:, 1].any() and inp.split[:, [0, 2]].all()
    sched = build_zb(plan, "zb-h1", models=Models(cm, mm))
    assert {a.op for acts in sched.ranks for a in acts if a.mb == 1} == {"F", "B"}


# --------------------------------------------------------------------------- real gloo ranks
LIMIT = 24 * 2**20


def _cfg(kind: str, stages: int = 2, seed: int = 0, limit: int = LIMIT, global_batch: int = 8, steps: int = 1,
         recompute: str = "never", method: str = "dynamic") -> RunConfig:
    return RunConfig(model=ModelConfig.preset("tiny"),
                     pipeline=PipelineConfig(num_stages=stages, schedule=kind, memory_limit_bytes=limit),
                     dataset="gsm8k", global_batch=global_batch, method=method, seed=seed, steps=steps, warmup=0,
                     backend="gloo", device="cpu", timeout_s=60.0, recompute=recompute)


ZB_CASES = {
    2: {"split-1f1b": _cfg("1f1b", seed=1), "split-zb-h1": _cfg("zb-h1", seed=1), "split-zb": _cfg("zb", seed=1),
        "split-zb-h1-steps": _cfg("zb-h1", seed=2, steps=2)},
    4: {"split-zb-h1-p4": _cfg("zb-h1", stages=4, limit=32 * 2**20, seed=3),
        "split-zb-p4": _cfg("zb", stages=4, limit=32 * 2**20, seed=3)},
}


@register(2)
def _zb_two(out: Path) -> list[RunSpec]:
    return [RunSpec.create(cfg, out / name, verify=True, run_id=name) for name, cfg in ZB_CASES[2].items()]


@register(4)
def _zb_four(out: Path) -> list[RunSpec]:
    return [RunSpec.create(cfg, out / name, verify=True, run_id=name) for name, cfg in ZB_CASES[4].items()]


def _tables(job, names) -> dict:
    from dynmb.io.results import load_results

    assert job.returncode == 0, job.errors
    return {name: load_results(job.out / name) for name in names}


def _check(tables: dict) -> None:
    for name, t in tables.items():
        assert t["steps"]["verified"].all(), name                 # gradients == single-process reference
        mem = t["memory"]
        assert (mem["peak_bytes"] <= mem["limit_bytes"]).all(), name
        if "zb" in name:
            ops = set(t["actions"]["op"])
            assert {"I", "W"} <= ops, (name, ops)


@pytest.mark.dist
def test_two_ranks_split_backward_matches_reference(gloo_job):
    _check(_tables(gloo_job(2), ZB_CASES[2]))


@pytest.mark.dist
def test_four_ranks_split_backward_matches_reference(gloo_job):
    _check(_tables(gloo_job(4), ZB_CASES[4]))


def test_one_f_one_b_peaks_without_transients_is_the_held_bytes():
    """A memory model with activations but no ``act_matrix`` gives no transients (``simulate.memory_inputs``):
    the 1F1B peaks the zero-bubble builders cap with are then the held bytes alone (it raised TypeError)."""
    from dataclasses import replace as dc_replace
    P, m = 2, 4
    act = np.arange(1.0, 1.0 + P * m).reshape(P, m)
    z = np.zeros((P, m))
    inp = ZBInputs(np.ones((P, m)), 2 * np.ones((P, m)), z, z, np.zeros(m), np.zeros((P, m), bool), act, None, None)
    with_tr = one_f_one_b_peaks(dc_replace(inp, tr=np.zeros((P, m))))
    np.testing.assert_allclose(one_f_one_b_peaks(inp), with_tr)
    assert np.all(with_tr > 0)
