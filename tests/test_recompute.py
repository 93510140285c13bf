"""Per-microbatch recomputation: exact gradients, memory as the model says, plan JSON, the costs,
never / always / auto packing at a limit where ``never`` must truncate, and real gloo runs."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from dynmb.core.config import ModelConfig, PipelineConfig, RunConfig
from dynmb.costmodel import get_cost_model
from dynmb.data import load_trace, sample_batch
from dynmb.memory.model import get_memory_model
from dynmb.models import build_stage, build_stages, make_inputs, synthetic_tokens
from dynmb.packing import PackingError, pack
from dynmb.planning import plan_step
from dynmb.measure import synthetic_microbatch
from dynmb.packing.recompute import fits, needs_recompute
from dynmb.costmodel.split import RECOMPUTE_F_SHARE, stage_role
from dynmb.runtime.spec import RunSpec
from dynmb.core.types import Microbatch, Plan
from dynmb.core.planspec import PlanSpec
from tests.gloo_jobs import register
from dynmb.costmodel.loader import Models

SMALL = ModelConfig.preset("small")
TINY = ModelConfig.preset("tiny")
TIGHT = 8 * 2**20          # tiny at 2 stages: 117 tokens fit without recomputation, 341 with it


def _grads(cfg: ModelConfig, P: int, recompute: bool) -> dict[str, torch.Tensor]:
    stages = build_stages(cfg, P, 0)
    for i, (b, s, d) in enumerate([(2, 64, 1), (1, 128, 4)]):
        mb = synthetic_microbatch(b, s, d, i)
        inp = make_inputs(mb, synthetic_tokens(mb.lengths, cfg.vocab_size, i), cfg=cfg)
        x = None
        for st in stages:
            x = st(x, inp, recompute=recompute)
        x.backward()
    return {n: p.grad.clone() for st in stages for n, p in st.named_parameters()}


def test_recomputed_gradients_are_exact():
    a, b = _grads(SMALL, 2, False), _grads(SMALL, 2, True)
    for n in a:
        assert torch.equal(a[n], b[n]), n          # deterministic kernels: bit for bit


@pytest.mark.parametrize("stage", [0, 1])
def test_recompute_memory_is_what_the_model_says(stage):
    """The meter (saved tensors, the recomputed block's included) stays within the model's
    recomputed activation and transient bytes, and holds far less than without recomputation."""
    from dynmb.runtime.meter import MemoryMeter

    P, b, s = 2, 1, 512
    mm = get_memory_model(None, SMALL, P)
    st = build_stage(SMALL, stage, P, 0)
    got = {}
    for rc in (False, True):
        mb = synthetic_microbatch(b, s, 1, 0)
        inp = make_inputs(mb, synthetic_tokens(mb.lengths, SMALL.vocab_size), cfg=SMALL)
        meter = MemoryMeter("cpu", [st])
        x = None if stage == 0 else torch.randn(b, s, SMALL.d_model, requires_grad=True)
        meter.reset_peak()
        with meter.saving(stage):
            y = st(x, inp, recompute=rc)
        held = meter.current_bytes - meter.state_bytes
        with meter.saving(stage), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.autograd.backward(y, None if stage == P - 1 else torch.ones_like(y))
        got[rc] = (held, meter.peak_bytes - meter.state_bytes)
        meter.close()
        st.zero_grad(set_to_none=True)
    act = float(mm.activation_bytes(stage, b, s, recompute=True)[0])
    peak = act + float(mm.transient_bytes(stage, b, s, recompute=True)[0])
    assert got[True][0] <= act and got[True][0] >= 0.9 * act
    assert got[True][1] <= peak
    assert got[True][0] < 0.35 * got[False][0]


def test_plan_json_records_recompute_only_when_true():
    mbs = (Microbatch([0], [5], 5, 1), Microbatch([1, 2], [3, 4], 4, 2, recompute=True))
    plan = Plan(mbs, "dynamic", 2, 2**30, 3)
    d = plan.to_dict()
    assert "recompute" not in d["microbatches"][0] and d["microbatches"][1]["recompute"] is True
    back = Plan.from_json(plan.to_json())
    assert back.recompute_mask().tolist() == [False, True]
    assert back.digest() == plan.digest() != Plan(mbs[:1] + (Microbatch([1, 2], [3, 4], 4, 2),), "d", 2, 2**30,
                                                   3).digest()


def test_costs_add_the_recomputed_forward():
    cm = get_cost_model(None, SMALL, 2)
    rows, plen = np.array([2, 1]), np.array([128, 512])
    base = cm.stage_costs(rows, plen, ops=("F", "B", "I", "W"))
    rc = cm.stage_costs(rows, plen, ops=("F", "B", "I", "W"), recompute=[False, True])
    np.testing.assert_allclose(rc["B"][:, 0], base["B"][:, 0])
    for p in range(2):
        share = RECOMPUTE_F_SHARE[stage_role(p, 2)]
        assert rc["B"][p, 1] == pytest.approx(base["B"][p, 1] + share * base["F"][p, 1])
        assert rc["I"][p, 1] == pytest.approx(rc["B"][p, 1]) and rc["W"][p, 1] == 0.0


# --------------------------------------------------------------------------- packing
def _batch(seed: int = 0) -> np.ndarray:
    return sample_batch(load_trace("gsm8k"), 8, seed, step=0)


def _pack(lengths, recompute: str, oversize: str = "error", limit: int = TIGHT, method: str = "dynamic") -> Plan:
    return pack(lengths, PlanSpec(method=method, num_stages=2, memory_limit_bytes=limit, oversize=oversize,
                                  recompute=recompute), models=Models(get_cost_model(None, TINY, 2), get_memory_model(None, TINY, 2)))


def test_auto_places_what_never_must_truncate():
    lengths = _batch()
    mm = get_memory_model(None, TINY, 2)
    assert not fits(mm, TIGHT, 1, lengths.max())
    with pytest.raises(PackingError):
        _pack(lengths, "never")
    cut = _pack(lengths, "never", oversize="truncate")
    assert cut.meta["truncated"]
    plan = _pack(lengths, "auto")
    plan.validate(lengths)                                   # every sequence, at its full length
    assert not plan.meta.get("truncated")
    rc = plan.recompute_mask()
    assert rc.any()
    assert np.all(np.asarray(plan.predictions["pred_peak_bytes"]) <= TIGHT)
    # exactly those that need it: every flagged microbatch is inadmissible without recomputation
    # (or the plan is the all-recompute fallback)
    need = needs_recompute(mm, plan)
    assert np.array_equal(rc, need) or rc.all()
    assert np.all(mm.peak_bytes(plan.shapes()[:, 0], plan.shapes()[:, 1], recompute=rc) <= TIGHT)


def test_auto_is_never_when_nothing_needs_it_and_always_flags_all():
    lengths = _batch()
    roomy = 64 * 2**20
    plain = _pack(lengths, "never", limit=roomy)
    auto = _pack(lengths, "auto", limit=roomy)
    assert not auto.recompute_mask().any()
    assert [mb.padded_len for mb in auto.microbatches] == [mb.padded_len for mb in plain.microbatches]
    every = _pack(lengths, "always", limit=TIGHT)
    assert every.recompute_mask().all() and every.meta["recompute"] == "always"


def test_plan_step_predicts_recompute_under_the_limit():
    lengths = _batch()
    plan, sched, sim = plan_step(lengths, PlanSpec(method="dynamic", num_stages=2, memory_limit_bytes=TIGHT,
                                                   schedule_kind="1f1b", recompute="auto"), model_cfg=TINY)
    assert plan.recompute_mask().any() and sim.fits
    for kind in ("zb-h1", "zb"):
        plan, sched, sim = plan_step(lengths, PlanSpec(method="dynamic", num_stages=2, memory_limit_bytes=TIGHT,
                                                       schedule_kind=kind, recompute="auto"), model_cfg=TINY)
        assert sim.fits, kind


# --------------------------------------------------------------------------- real gloo ranks
def _rc_cfg(kind: str, recompute: str, limit: int = TIGHT) -> RunConfig:
    return RunConfig(model=TINY, pipeline=PipelineConfig(num_stages=2, schedule=kind, memory_limit_bytes=limit),
                     dataset="gsm8k", global_batch=8, method="dynamic", seed=0, steps=1, warmup=0,
                     backend="gloo", device="cpu", timeout_s=60.0, recompute=recompute)


RC_CASES = {"rc-auto-1f1b": ("1f1b", "auto", TIGHT), "rc-auto-zb-h1": ("zb-h1", "auto", TIGHT),
            "rc-always-1f1b": ("1f1b", "always", 24 * 2**20)}


@register(2)
def _rc_two(out: Path) -> list[RunSpec]:
    return [RunSpec.create(_rc_cfg(*args), out / name, verify=True, run_id=name) for name, args in RC_CASES.items()]


@pytest.mark.dist
def test_two_ranks_recompute_matches_reference_under_the_limit(gloo_job):
    from dynmb.io.results import load_results

    job = gloo_job(2)
    assert job.returncode == 0, job.errors
    for n in RC_CASES:
        t = load_results(job.out / n)
        assert t["steps"]["verified"].all() and (t["steps"]["truncated"] == 0).all(), n
        mem = t["memory"]
        assert (mem["peak_bytes"] <= mem["limit_bytes"]).all(), n


# --------------------------------------------------------------------------- the row-length cap
LLAMA = ModelConfig.preset("llama-small")


@pytest.mark.parametrize("limit", [384 * 2**20, 768 * 2**20])
def test_auto_truncates_every_method_at_max_seq_len(limit):
    """Under truncate + auto every method cuts at the same cap min(max_seq_len, longest row
    admissible with recomputation) -- the split candidate's recomputed singletons too -- builds
    no row past max_seq_len, and records that cap as longest_fitting_length. At 384 MiB a
    document of 3/4 max_seq_len fits only with recomputation (candidate (c) is in play)."""
    from dynmb.packing import METHODS
    from dynmb.packing.context import PackContext

    mm, cm = get_memory_model(None, LLAMA, 2), get_cost_model(None, LLAMA, 2)
    top = LLAMA.max_seq_len
    lengths = np.array([top + top // 2, 3 * top // 4, 300, 200, 150, 900, 1200, 64, 500])
    rc_cap = PackContext(mm.recomputing(), limit, 2, "1f1b").length_cap(top)
    assert rc_cap == top and not fits(mm, limit, 1, lengths[0])      # the case: recomputation would fit it whole
    kept = {}
    for method in METHODS:
        plan = pack(lengths, PlanSpec(method=method, num_stages=2, memory_limit_bytes=limit, oversize="truncate",
                                      recompute="auto"), models=Models(cm, mm))
        assert max(mb.padded_len for mb in plan.microbatches) <= top, (method, plan.meta.get("recompute_choice"))
        assert plan.meta["truncated"] == [0] and plan.meta["longest_fitting_length"] == rc_cap, method
        kept[method] = sum(int(mb.lengths.sum()) for mb in plan.microbatches)
    assert {k for k, v in kept.items() if v != lengths.sum() - lengths[0] + rc_cap} <= {"packed"}, kept
