"""Slices cut to equal cost and chains spread among short microbatches (issue 39, long documents):
the cuts, the placement, the split planner's choice, and exact gradients on real gloo ranks."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from dynmb.costmodel import AnalyticCostModel
from dynmb.core.config import ModelConfig, PipelineConfig, RunConfig, parse_bytes
from dynmb.core.types import Microbatch, Plan
from dynmb.io.results import load_results
from dynmb.memory.model import MemoryModel
from dynmb.planning import make_schedule
from dynmb.core.planspec import PlanSpec
from dynmb.planning.planner import plan_step
from dynmb.planning.slicing import MIN_SLICE, PLACEMENTS, _place, equal_cost_lengths, slice_lengths
from dynmb.runtime.spec import RunSpec
from dynmb.schedule import validate
from tests.gloo_jobs import register
from dynmb.costmodel.loader import Models

TINY = ModelConfig.preset("tiny")


def _costs(pieces: list[int], a: float, b: float) -> np.ndarray:
    """Each slice's ``a n + b n (2 p + n)``."""
    offsets = np.cumsum([0, *pieces[:-1]])
    n = np.asarray(pieces, dtype=np.float64)
    return a * n + b * n * (2 * offsets + n)


@settings(max_examples=200, deadline=None)
@given(length=hst.integers(1, 500_000), slice_len=hst.integers(MIN_SLICE, 20_000),
       ratio=hst.floats(0.0, 1e-2))
def test_equal_cost_cuts_cover_the_sequence_within_the_slice_length(length, slice_len, ratio):
    pieces = equal_cost_lengths(length, slice_len, (1.0, ratio))
    assert sum(pieces) == length and min(pieces) >= 1 and max(pieces) <= slice_len
    if ratio > 0 and length > slice_len and len(pieces) > 1:
        assert pieces[0] == max(pieces)                       # later slices attend to more: shorter
        even = slice_lengths(length, slice_len)
        spread = _costs(pieces, 1.0, ratio)
        per_token = 1.0 + ratio * 2 * length                   # the most one token can cost
        assert spread.max() <= _costs(even, 1.0, ratio).max() + per_token
        # near-equal: slices within two tokens' cost of each other (integer cuts), unless the count was capped
        capped = len(pieces) == max(len(even), length // MIN_SLICE) or pieces == even
        assert spread.max() - spread.min() <= max(2 * per_token, 1e-6 * spread.max()) or capped


def test_equal_cost_cuts_without_attention_cost_are_the_even_cuts():
    assert equal_cost_lengths(30_000, 8_000, (1.0, 0.0)) == slice_lengths(30_000, 8_000)
    assert equal_cost_lengths(5_000, 8_000, (1.0, 1e-3)) == [5_000]


def _mb(i: int, n: int) -> Microbatch:
    return Microbatch([i], [n], n, 1)


@settings(deadline=None)
@given(chains=hst.lists(hst.integers(1, 5), max_size=4), shorts=hst.integers(0, 12))
def test_spread_keeps_every_microbatch_and_each_chain_whole(chains, shorts):
    units = [[_mb(100 * c + k, 5) for k in range(n)] for c, n in enumerate(chains)]
    short = [_mb(1000 + i, 3) for i in range(shorts)]
    for placement in PLACEMENTS:
        out = _place(units, short, placement)
        assert sorted(int(mb.seq_ids[0]) for mb in out) == sorted(int(mb.seq_ids[0]) for mb in [*sum(units, []), *short])
        ids = [int(mb.seq_ids[0]) for mb in out]
        for unit in units:                                     # a chain's slices run back to back, in order
            where = [ids.index(int(mb.seq_ids[0])) for mb in unit]
            assert where == list(range(where[0], where[0] + len(unit)))
    spread = [int(mb.seq_ids[0]) for mb in _place(units, short, "spread")]
    if units and shorts >= len(units) + 1:                     # short microbatches at both ends
        assert spread[0] >= 1000 and spread[-1] >= 1000


LONG = np.array([2400, 1800, *([60, 90, 120, 30] * 4)], dtype=np.int64)
"""Two documents longer than the longest row that fits at 16 MiB on ``tiny``, 2 stages, and short ones."""


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1"])
def test_the_split_planner_weighs_equal_cost_cuts_and_spread_chains(kind):
    """The planner's candidates now include equal-cost cuts and spread chains; the plan it keeps is valid,
    fits, and is no slower than the plan of the even cuts placed first or last (the old candidates)."""
    import dynmb.planning.slicing as slicing

    def plan():
        return plan_step(LONG, PlanSpec(method="dynamic", num_stages=2, schedule_kind=kind,
                         memory_limit_bytes=parse_bytes("16MiB"), oversize="split", recompute="auto"), model_cfg=TINY)
    best, sched, sim = plan()
    best.validate(LONG)
    validate(sched, best)
    assert best.meta["slice_cuts"] in ("even", "equal-cost") and best.meta["slice_placement"] in PLACEMENTS
    assert max(best.predictions["pred_peak_bytes"]) <= parse_bytes("16MiB")
    with pytest.MonkeyPatch.context() as mp:                   # the candidates before: even cuts, first or last
        mp.setattr(slicing, "_refine", lambda job, found: None)
        mp.setattr(slicing, "_first_round", lambda job, slice_len, use_rc: slicing._Try(slice_len, use_rc))
        old, _, old_sim = plan()
    assert old.meta["slice_cuts"] == "even" and old.meta["slice_placement"] in ("first", "last")
    assert sim.makespan_s <= old_sim.makespan_s * (1 + 1e-12)


def spread_plan() -> tuple[Plan, np.ndarray]:
    """Two documents in chains of decreasing (equal-cost-like) slices, each between short microbatches:
    short, A0 A1 A2, short + short, B0 B1, short; only chain A recomputed (``RC_SHARES``)."""
    lengths = np.array([210, 150, 23, 31, 17, 40, 12], dtype=np.int64)
    chain_a = [Microbatch([0], [n], n, 1, offsets=[o], continued=[k < 2], recompute=True) for k, (n, o) in
               enumerate(zip((100, 64, 46), (0, 100, 164)))]
    chain_b = [Microbatch([1], [n], n, 1, offsets=[o], continued=[k < 1]) for k, (n, o) in enumerate(zip((90, 60), (0, 90)))]
    shorts = [Microbatch([2], [23], 23, 1), Microbatch([3, 4], [31, 17], 31, 2), Microbatch([5, 6], [40, 12], 40, 2)]
    mbs = _place([chain_a, chain_b], shorts, "spread")
    plan = Plan(tuple(mbs), "dynamic", 2, 1 << 30, len(lengths))
    plan.validate(lengths)
    return plan, lengths


def test_spread_plan_schedules_each_chain_backward_in_reverse():
    plan, _ = spread_plan()
    assert [int(mb.seq_ids[0]) for mb in plan.microbatches] == [2, 0, 0, 0, 3, 1, 1, 5]
    cm, mm = AnalyticCostModel(TINY, 2), MemoryModel.analytic(TINY, 2)
    for kind in ("1f1b", "zb-h1"):
        sched = make_schedule(replace(plan, schedule_kind=kind), kind, models=Models(cm, mm))
        validate(sched, plan)
        for rank in sched.ranks:                               # each chain's backwards (B, or I) in reverse
            back = [a.mb for a in rank if a.op in ("B", "I") and a.mb in (1, 2, 3, 5, 6)]
            assert [j for j in back if j in (1, 2, 3)] == [3, 2, 1] and [j for j in back if j in (5, 6)] == [6, 5]


def _spread_case(out: Path, ranks: int, kind: str) -> RunSpec:
    plan, _ = spread_plan()
    name = f"spread-{kind}-{ranks}"
    path = out / f"{name}.json"
    replace(plan, num_stages=ranks, schedule_kind=kind).save(path)
    cfg = RunConfig(model=TINY, pipeline=PipelineConfig(num_stages=ranks, schedule=kind, memory_limit_bytes=1 << 30),
                    dataset="gsm8k", global_batch=plan.num_sequences, method="dynamic", steps=1, warmup=0,
                    backend="gloo", device="cpu", timeout_s=90.0)
    return RunSpec.create(cfg, out / name, verify=True, run_id=name, plan=path)


SPREAD_KINDS = ("1f1b", "zb-h1")
register(2)(lambda out: [_spread_case(out, 2, k) for k in SPREAD_KINDS])
register(4)(lambda out: [_spread_case(out, 4, k) for k in SPREAD_KINDS])


@pytest.mark.dist
@pytest.mark.parametrize("ranks", [2, 4])
def test_spread_equal_cost_slices_verify_on_gloo(gloo_job, ranks):
    """Gradients of two documents cut into decreasing slices, each chain between short microbatches, one chain
    recomputed and the other not, equal to every document run whole in one process (the runtime's --verify),
    on 1F1B and ZB-H1."""
    job = gloo_job(ranks)
    assert job.returncode == 0, job.errors
    for kind in SPREAD_KINDS:
        steps = load_results(job.out / f"spread-{kind}-{ranks}")["steps"]
        assert steps["verified"].all(), kind
        assert (steps["real_tokens"] == spread_plan()[1].sum()).all(), kind


def test_dynamic_sliced_plan_is_not_slower_than_the_plain_methods_sliced_plans():
    """``dynamic`` weighs the short sequences packed as ``fixed`` and ``sorted`` pack them at its best slices
    (``SHORT_PACKERS``), so around the same chains it is never behind those plain methods' sliced plans."""
    def step(method, mbs=None):
        plan, _, sim = plan_step(LONG, PlanSpec(method=method, mbs=mbs, num_stages=2, schedule_kind="1f1b",
                                 memory_limit_bytes=parse_bytes("16MiB"), oversize="split", recompute="auto"),
                                 model_cfg=TINY)
        return plan, sim.makespan_s
    plan, dynamic = step("dynamic")
    assert plan.meta["slice_shorts"] in (None, "fixed/None", "sorted/1")
    assert dynamic <= step("fixed")[1] * (1 + 1e-12) and dynamic <= step("sorted", 1)[1] * (1 + 1e-12)


def test_recompute_auto_weighs_recomputing_only_the_longest_chains(monkeypatch):
    """Where slices fit only recomputed, the longest half / quarter / eighth of the chains recomputed are
    candidates too: the chains recomputed are the longest, whole chains at a time."""
    import dynmb.planning.slicing as slicing
    tried = []
    real = slicing._try_slice_len

    def spy(job, t, found):
        tried.append(t)
        return real(job, t, found)
    monkeypatch.setattr(slicing, "_try_slice_len", spy)
    batch = np.array([4000, 3400, 2900, 2400, *([60, 90, 120, 30] * 4)], dtype=np.int64)
    plan, sched, _ = plan_step(batch, PlanSpec(method="dynamic", num_stages=2, schedule_kind="1f1b",
                               memory_limit_bytes=parse_bytes("18MiB"), oversize="split", recompute="auto"),
                               model_cfg=TINY)
    plan.validate(batch)
    validate(sched, plan)
    assert plan.meta["slice_recompute"]                        # these slices fit only recomputed
    assert {t.rc_share for t in tried if t.use_rc} >= set(slicing.RC_SHARES)
    share = plan.meta["slice_recompute_share"]
    recomputed = {int(mb.seq_ids[0]) for mb in plan.microbatches if mb.recompute and mb.has_slices}
    assert len(recomputed) == int(np.ceil(share * 4)) and recomputed == set(range(len(recomputed)))
