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

    def plan():                                                # dynamic's own search (no plain methods' plans)
        return plan_step(LONG, PlanSpec(method="dynamic", num_stages=2, schedule_kind=kind,
                         memory_limit_bytes=parse_bytes("16MiB"), oversize="split", recompute="auto"), model_cfg=TINY)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(slicing, "slice_alternatives", lambda: [])
        best, sched, sim = plan()
    best.validate(LONG)
    validate(sched, best)
    assert best.meta["slice_cuts"] in ("even", "equal-cost") and best.meta["slice_placement"] in PLACEMENTS
    assert max(best.predictions["pred_peak_bytes"]) <= parse_bytes("16MiB")
    with pytest.MonkeyPatch.context() as mp:                   # the candidates before: even cuts, first or last
        mp.setattr(slicing, "slice_alternatives", lambda: [])
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


def test_dynamic_weighs_a_plain_methods_whole_sliced_search(monkeypatch):
    """Fast: with one alternative (``fixed`` at mbs 1), ``dynamic``'s sliced plan is no slower than that
    method's own plan of the batch, and is that plan's microbatches where those are faster."""
    import dynmb.planning.slicing as slicing

    monkeypatch.setattr(slicing, "slice_alternatives", lambda: [("fixed", 1)])
    monkeypatch.setattr(slicing, "SHORT_PACKERS", ())
    monkeypatch.setattr(slicing, "WEIGH_ALTERNATIVES", True)      # the default (weighing_alternatives(False): off)
    monkeypatch.setattr(slicing, "WEIGH_FINALISTS", None)         # the one alternative's whole search
    spec = PlanSpec(method="dynamic", num_stages=2, schedule_kind="1f1b", memory_limit_bytes=parse_bytes("16MiB"),
                    oversize="split", recompute="auto")
    plan, _, sim = plan_step(LONG, spec, model_cfg=TINY)
    other, _, other_sim = plan_step(LONG, spec.with_(method="fixed", mbs=1), model_cfg=TINY)
    assert plan.method == "dynamic" and sim.makespan_s <= other_sim.makespan_s * (1 + 1e-12)
    if plan.meta["slice_shorts"] == "fixed/1":
        assert plan.microbatches == other.microbatches and sim.makespan_s == other_sim.makespan_s


@pytest.mark.slow
def test_dynamic_sliced_plan_is_not_slower_than_the_plain_methods_sliced_plans():
    """``dynamic`` weighs every plain method's whole sliced search (``slice_alternatives``: each at its own
    settings, ``fixed`` at mbs 1, the budget methods at budgets / 2, / 4), so it is never predicted slower than
    any of those methods' sliced plans of the batch; an alternative kept is named in ``slice_shorts``."""
    from dynmb.planning.slicing import slice_alternatives

    def step(method, mbs=None):
        plan, _, sim = plan_step(LONG, PlanSpec(method=method, mbs=mbs, num_stages=2, schedule_kind="zb-h1",
                                 memory_limit_bytes=parse_bytes("16MiB"), oversize="split", recompute="auto"),
                                 model_cfg=TINY)
        return plan, sim.makespan_s
    from dynmb.planning.slicing import weighing_alternatives
    with weighing_alternatives(finalists=None):          # the full weighing: every method's whole search
        plan, dynamic = step("dynamic")
    alternatives = slice_alternatives()
    assert {("fixed", None), ("fixed", 1), ("sorted", None), ("packed", None), ("balanced", 4),
            ("token-budget", 2), ("dynapipe", None)} <= set(alternatives)
    names = {None, "fixed/None", "sorted/1", *(m if b is None else f"{m}/{b}" for m, b in alternatives)}
    assert plan.method == "dynamic" and plan.meta["slice_shorts"] in names
    for method, mbs in alternatives:
        try:
            other = step(method, mbs)[1]
        except ValueError:                                      # that method cannot plan the batch
            continue
        assert dynamic <= other * (1 + 1e-12), (method, mbs)


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
    monkeypatch.setattr(slicing, "slice_alternatives", lambda: [])       # dynamic's own search only
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


# ------------------------------------------------------------------ chain lookahead (issue 39: the chain term)
def _chain_plan(chains: list[int], shorts: int, placement: str) -> Plan:
    """Chains of ``chains[i]`` slices among ``shorts`` one-sequence microbatches, placed ``placement``."""
    units = [[Microbatch([c], [8], 8, 1, offsets=[8 * k], continued=[k < n - 1]) for k in range(n)]
             for c, n in enumerate(chains)]
    short = [Microbatch([len(chains) + i], [5], 5, 1) for i in range(shorts)]
    mbs = _place(units, short, placement)
    return Plan(tuple(mbs), "dynamic", 2, 1 << 30, len(chains) + shorts)


def _forwards_before_backwards(ops: list[tuple[str, int]]) -> list[int]:
    """Per backward (in order): the forwards the stage ran before it."""
    out, f = [], 0
    for op, _ in ops:
        if op == "F":
            f += 1
        else:
            out.append(f)
    return out


@settings(max_examples=150, deadline=None)
@given(chains=hst.lists(hst.integers(1, 6), min_size=1, max_size=3), shorts=hst.integers(0, 9),
       placement=hst.sampled_from(PLACEMENTS), stages=hst.integers(2, 6), lookahead=hst.integers(0, 8))
def test_chain_lookahead_orders_are_valid_and_forward_up_to_the_window_past_a_chain(chains, shorts, placement,
                                                                                      stages, lookahead):
    """1F1B with a chain lookahead: deadlock-free and in slice order (``validate``); lookahead 0 is the old
    order; each stage runs, before its b-th backward (of microbatch j), exactly
    ``min(m, max(b + k, j + 1 + min(lookahead, k - 1)))`` forwards (or as many as before: never fewer)."""
    from dynmb.schedule.builders import one_f_one_b
    from dynmb.schedule.order import ChainOrder, stage_order

    plan = replace(_chain_plan(chains, shorts, placement), num_stages=stages)
    order, m = plan.backward_order(), plan.num_microbatches
    sched = one_f_one_b(stages, m, ChainOrder(order, lookahead))
    validate(sched, plan)
    assert one_f_one_b(stages, m, ChainOrder(order, 0)).ranks == one_f_one_b(stages, m, order).ranks
    for s in range(stages):
        k = stages - s
        want, done = [], 0
        for b, j in enumerate(order):
            done = max(done, min(m, max(b + k, j + 1 + min(lookahead, k - 1))))
            want.append(done)
        got = _forwards_before_backwards(stage_order(s, stages, m, "1f1b", ChainOrder(order, lookahead)))
        assert got == want


def test_a_chain_lookahead_runs_on_the_kinds_that_take_it_and_is_refused_elsewhere():
    """``make_schedule`` reads the plan's ``slice_lookahead``: 1F1B and ZB-H1 run more forwards before a chain's
    backwards (the order stays valid), and a kind without ``chain_lookahead`` refuses it in one line."""
    from dynmb.schedule import build_schedule
    from dynmb.schedule.order import ChainOrder

    plan, _ = spread_plan()
    cm, mm = AnalyticCostModel(TINY, 2), MemoryModel.analytic(TINY, 2)
    for kind in ("1f1b", "zb-h1"):
        ahead = replace(plan, schedule_kind=kind, meta=plan.meta.with_(slice_lookahead=1))
        plain = make_schedule(replace(plan, schedule_kind=kind), kind, models=Models(cm, mm))
        sched = make_schedule(ahead, kind, models=Models(cm, mm))
        validate(sched, ahead)
        first_back = [next(i for i, a in enumerate(s.ranks[0]) if a.op in ("B", "I") and a.mb == 3)
                      for s in (plain, sched)]
        forwards = [sum(a.op == "F" for a in s.ranks[0][:i]) for s, i in zip((plain, sched), first_back)]
        assert forwards[1] == forwards[0] + 1, kind              # one more forward before chain A's backwards
    with pytest.raises(ValueError, match="chain lookahead"):
        build_schedule("interleaved", 2, plan.num_microbatches, backward_order=ChainOrder(plan.backward_order(), 1))


def test_the_split_planner_weighs_chain_lookaheads():
    """``_refine`` tries the chain lookaheads on the kinds that take them; the plan it keeps is no slower than
    the best without them, and its schedule is the one its ``slice_lookahead`` builds."""
    import dynmb.planning.slicing as slicing

    spec = PlanSpec(method="fixed", num_stages=2, schedule_kind="1f1b", memory_limit_bytes=parse_bytes("16MiB"),
                    oversize="split", recompute="auto")
    assert slicing.chain_lookaheads(spec) == (1,)
    assert slicing.chain_lookaheads(spec.with_(schedule_kind="interleaved", virtual=2, num_stages=4)) == ()
    assert slicing.chain_lookaheads(spec.with_(num_stages=8, schedule_kind="zb")) == (4, 7)
    plan, sched, sim = plan_step(LONG, spec, model_cfg=TINY)
    validate(sched, plan)
    assert plan.meta["slice_lookahead"] in (0, 1)
    assert sched.ranks == make_schedule(plan, "1f1b").ranks
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(slicing, "chain_lookaheads", lambda spec: ())
        _, _, old = plan_step(LONG, spec, model_cfg=TINY)
    assert sim.makespan_s <= old.makespan_s * (1 + 1e-12)


def _lookahead_case(out: Path, ranks: int, kind: str) -> RunSpec:
    """``spread_plan`` with every stage's whole window of lookahead past a chain, float64, ``--verify``."""
    from dynmb.core.config import model_config

    plan, _ = spread_plan()
    name = f"lookahead-{kind}-{ranks}"
    path = out / f"{name}.json"
    replace(plan, num_stages=ranks, schedule_kind=kind, meta=plan.meta.with_(slice_lookahead=ranks - 1)).save(path)
    cfg = RunConfig(model=model_config("tiny:dtype=float64,n_layers=4"),
                    pipeline=PipelineConfig(num_stages=ranks, schedule=kind, memory_limit_bytes=1 << 30),
                    dataset="gsm8k", global_batch=plan.num_sequences, method="dynamic", steps=1, warmup=0,
                    backend="gloo", device="cpu", timeout_s=90.0)
    return RunSpec.create(cfg, out / name, verify=True, run_id=name, plan=path)


register(2)(lambda out: [_lookahead_case(out, 2, k) for k in SPREAD_KINDS])
register(4)(lambda out: [_lookahead_case(out, 4, k) for k in SPREAD_KINDS])


@pytest.mark.dist
@pytest.mark.parametrize("ranks", [2, 4])
def test_chain_lookahead_fp64_gradients_equal_the_reference_on_gloo(gloo_job, ranks):
    """Gradients (float64, the runtime's 1e-10 check) of a plan run with a chain lookahead of ``ranks - 1``
    under 1F1B and ZB-H1 equal every document run whole in one process; the run's schedule holds the
    lookahead's extra forward."""
    from dynmb.runtime.checks import VERIFY_RTOL_FP64
    from dynmb.schedule.order import ChainOrder, stage_order

    job = gloo_job(ranks)
    assert job.returncode == 0, job.errors
    for kind in SPREAD_KINDS:
        t = load_results(job.out / f"lookahead-{kind}-{ranks}")
        steps = t["steps"]
        assert steps["verified"].all(), kind
        assert (steps["grad_rel_err"] <= VERIFY_RTOL_FP64).all(), (kind, steps["grad_rel_err"].max())
        assert (steps["real_tokens"] == spread_plan()[1].sum()).all(), kind
        acts = t["actions"]
        order = spread_plan()[0].backward_order()
        for stage in range(ranks):                 # each stage ran the lookahead's order (W aside, I as B)
            ran = acts[acts["stage"] == stage].sort_values("start_s")
            ops = [("B" if op == "I" else op, int(mb)) for op, mb in zip(ran["op"], ran["mb"]) if op != "W"]
            assert ops == stage_order(stage, ranks, len(order), "1f1b", ChainOrder(order, ranks - 1)), (kind, stage)
        assert stage_order(0, ranks, len(order), "1f1b", ChainOrder(order, ranks - 1)) != \
            stage_order(0, ranks, len(order), "1f1b", order)
