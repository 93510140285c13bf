"""Where a step's gap to the ideal goes (dynmb.timing.gap_terms): the terms add up to step - ideal on random
plans and cost models, and hand-computed cases (one sequence per microbatch, a packed row, a padded
microbatch, a split backward, equal and unequal replicas)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dynmb.timing.bounds import ideal_bound, plan_bound, plan_ideal, sequence_costs
from dynmb.core.config import ModelConfig
from dynmb.costmodel import AnalyticCostModel, CommModel
from dynmb.costmodel.gpu import GPUCostModel
from dynmb.timing.gap_terms import TERMS, GapTerms, gap_terms
from dynmb.memory.model import MemoryModel
from dynmb.packing import PackingError
from dynmb.planning import make_schedule, plan_step
from dynmb.timing.simulate import simulate
from dynmb.core.types import Microbatch, Plan
from dynmb.core.planspec import PlanSpec
from dynmb.costmodel.loader import Models

SMALL = ModelConfig.preset("small")
NO_COMM = CommModel(0.0, 1e30)
EPS = 1e-9


def _plan(mbs, P, dp=1, replica_ids=None):
    n = sum(len(mb.seq_ids) for mb in mbs)
    return Plan(microbatches=tuple(mbs), method="fixed", num_stages=P, memory_limit_bytes=1 << 40, num_sequences=n,
                dp=dp, replica_ids=replica_ids)


def _run(plan, cm, kind="1f1b", virtual=1):
    """(replica, schedule, sim) of the slowest replica."""
    runs = []
    for r in range(plan.dp):
        sub = plan.replica(r) if plan.dp > 1 else plan
        sched = make_schedule(sub, kind, virtual=virtual, models=Models(cm, None))
        runs.append((sub, sched, simulate(sched, sub, cm)))
    return max(runs, key=lambda x: x[2].makespan_s)


def _zero_but(t: GapTerms, keep: tuple[str, ...]):
    scale = max(t.step, t.ideal)
    for name in TERMS:
        if name not in keep:
            assert abs(getattr(t, name)) <= 1e-12 * scale, (name, t)


def _sat(cm: GPUCostModel) -> GPUCostModel:
    return GPUCostModel(cm.model_cfg, cm.num_stages, spec=replace(cm.spec, gemm_m_half=1e-9), comm=cm.comm)


# --- the terms add up --------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 1500), min_size=2, max_size=40), P=st.sampled_from([1, 2, 3, 4]),
       dp=st.sampled_from([1, 1, 2]), method=st.sampled_from(["fixed", "packed", "token-budget", "dynamic"]),
       kind=st.sampled_from(["1f1b", "gpipe", "zb-h1", "zb", "interleaved"]), which=st.integers(0, 3),
       overhead=st.floats(0.0, 3e-3), comm=st.floats(0.0, 5e-4),
       recompute=st.sampled_from(["never", "auto", "always"]))
def test_terms_add_up_to_step_minus_ideal(lengths, P, dp, method, kind, which, overhead, comm, recompute):
    """Random plans (methods, schedule kinds, dp, recomputation) on random analytic models and the GPU
    model (its ideal priced by itself or saturated): the terms sum to step - ideal; bound and ideal are
    ``dynmb.timing.bounds``'."""
    virtual = 2 if kind == "interleaved" and P == 2 else 1         # the small model has 4 layers
    kind = "1f1b" if kind == "interleaved" and virtual == 1 else kind
    S = P * virtual
    cm = (AnalyticCostModel(SMALL, S, overhead_s=overhead, comm=CommModel(comm, 1e9)) if which < 2
          else GPUCostModel(SMALL, S))
    ideal_model = _sat(cm) if which == 3 else cm
    mm = MemoryModel.analytic(SMALL, S)
    try:
        plan, _, _ = plan_step(np.array(lengths), PlanSpec(method=method, num_stages=S, virtual=virtual,
                                                           memory_limit_bytes=int(mm.state_bytes.max() * 3),
                                                           schedule_kind=kind, dp=dp, oversize="truncate",
                                                           recompute=recompute), model_cfg=SMALL, models=Models(cm, mm))
    except (PackingError, ValueError):
        event("not planned")
        return
    event(f"planned: dp {dp}, {kind}")
    sub, sched, sim = _run(plan, cm, kind, virtual)
    t = gap_terms(plan, sched, cm, sim.makespan_s, replica=sub, ideal_model=ideal_model).check(EPS)
    assert t.total == pytest.approx(sim.makespan_s - t.ideal, rel=EPS, abs=EPS * t.ideal)
    assert t.bound == pytest.approx(sim.bound_s, rel=1e-12)
    assert t.ideal == plan_ideal(plan, ideal_model, sched)
    assert sum(t.fractions().values()) == pytest.approx(sim.makespan_s / t.ideal - 1, rel=1e-9, abs=1e-12)
    assert t.schedule >= -EPS * t.step and t.split <= 0 and t.overhead >= 0
    if dp == 1:
        assert t.replicas == pytest.approx(0.0, abs=1e-12 * t.ideal)
    if not sched_splits(sched) and not sub.recompute_mask().any():
        assert t.passes == 0.0


def sched_splits(sched) -> bool:
    return any(a.op == "I" for acts in sched.ranks for a in acts)


def test_check_refuses_terms_that_do_not_add_up():
    t = GapTerms(step=2.0, bound=1.5, ideal=1.0, rank=0, schedule=0.5, ends=0.2, split=0.0, replicas=0.0,
                 overhead=0.1, padding=0.1, passes=0.0, shape=0.1)
    assert t.check() is t and t.fractions()["gap_schedule"] == 0.5
    with pytest.raises(ValueError, match="add up"):
        replace(t, shape=0.2).check()


# --- hand cases ----------------------------------------------------------------------------------------

def test_one_microbatch_of_one_sequence_no_padding_no_overhead_has_no_gap():
    """The bound is the makespan and the ideal: every term 0."""
    cm = AnalyticCostModel(SMALL, 3, overhead_s=0.0, comm=CommModel(1e-4, 1e9))
    plan = _plan([Microbatch(seq_ids=[0], lengths=[700], padded_len=700, batch=1)], 3)
    sub, sched, sim = _run(plan, cm)
    t = gap_terms(plan, sched, cm, sim.makespan_s).check()
    assert t.step == pytest.approx(t.ideal, rel=1e-12) and t.rank == 2
    _zero_but(t, ())


def test_one_sequence_per_microbatch_leaves_only_the_schedule():
    """No padding, no overhead, an additive model: bound = ideal (the fill and drain of the shortest
    sequence, the work of every sequence), so only ``schedule = step - bound`` is left."""
    cm = AnalyticCostModel(SMALL, 3, overhead_s=0.0, comm=CommModel(1e-4, 1e9))
    L = [900, 150, 400, 1200, 60]
    plan = _plan([Microbatch(seq_ids=[i], lengths=[x], padded_len=x, batch=1) for i, x in enumerate(L)], 3)
    sub, sched, sim = _run(plan, cm)
    t = gap_terms(plan, sched, cm, sim.makespan_s).check()
    assert t.schedule == pytest.approx(sim.makespan_s - sim.bound_s, rel=1e-9) and t.schedule > 0
    _zero_but(t, ("schedule",))


def test_a_packed_row_leaves_only_the_ends():
    """One row packing 200 and 500 tokens, two stages, no P2P time: the last rank's fill and drain are
    the whole row's F and B on stage 0, the ideal's those of the 200-token sequence alone: ends = F + B of
    the 500-token one on stage 0; one microbatch: schedule 0; additive model: no other term."""
    cm = AnalyticCostModel(SMALL, 2, overhead_s=0.0, comm=NO_COMM)
    row = Microbatch(seq_ids=[0, 1], lengths=[200, 500], padded_len=700, batch=1, row_ids=[0, 0])
    plan = _plan([row], 2)
    sub, sched, sim = _run(plan, cm)
    t = gap_terms(plan, sched, cm, sim.makespan_s).check()
    want = float(cm.predict(0, "F", 1, 500, 500 ** 2) + cm.predict(0, "B", 1, 500, 500 ** 2))
    assert t.rank == 1 and t.ends == pytest.approx(want, rel=1e-9)
    _zero_but(t, ("ends",))


def test_a_padded_microbatch_has_its_padding_priced():
    """Two rows of 100 and 60 tokens padded to 100: on the rank that decides the bound (the last, stage 1),
    padding = F + B at 2 x 100 (causal attention over the pads: 2 x 100^2) - F + B of one row of the 160
    real tokens (attention 100^2 + 60^2); overhead = F + B at zero tokens."""
    cm = AnalyticCostModel(SMALL, 2, overhead_s=1e-3, comm=NO_COMM)
    plan = _plan([Microbatch(seq_ids=[0, 1], lengths=[100, 60], padded_len=100, batch=2)], 2)
    sub, sched, sim = _run(plan, cm)
    t = gap_terms(plan, sched, cm, sim.makespan_s).check()

    def fb(b, s, a):
        return float(cm.predict(1, "F", b, s, a) + cm.predict(1, "B", b, s, a))

    assert t.rank == 1
    assert t.padding == pytest.approx(fb(2, 100, 2 * 100 ** 2) - fb(1, 160, 100 ** 2 + 60 ** 2), rel=1e-9)
    assert t.padding > 0 and t.overhead == pytest.approx(fb(1, 0, 0), rel=1e-12)
    assert t.schedule == pytest.approx(0.0, abs=1e-12) and t.passes == 0.0


def test_a_split_backward_is_priced_in_passes():
    """zb-h1 on one sequence: passes = (I + W) - B on the deciding rank's stage at the sequence's shape."""
    cm = AnalyticCostModel(SMALL, 2, overhead_s=0.0, comm=NO_COMM)
    plan = _plan([Microbatch(seq_ids=[0], lengths=[800], padded_len=800, batch=1)], 2)
    sub, sched, sim = _run(plan, cm, "zb-h1")
    assert sched_splits(sched)
    t = gap_terms(plan, sched, cm, sim.makespan_s).check()
    a = 800 ** 2
    want = sum(float(cm.predict(s, "I", 1, 800, a) + cm.predict(s, "W", 1, 800, a) - cm.predict(s, "B", 1, 800, a))
               for s in range(2) if s == t.rank)
    assert want > 0 and t.passes == pytest.approx(want, rel=1e-9)


def _two_replicas(first, second):
    mbs = [Microbatch(seq_ids=[i], lengths=[x], padded_len=x, batch=1) for i, x in enumerate([*first, *second])]
    return _plan(mbs, 2, dp=2, replica_ids=[0] * len(first) + [1] * len(second))


def test_equal_replicas_have_no_replica_term():
    cm = AnalyticCostModel(SMALL, 2, overhead_s=0.0, comm=NO_COMM)
    plan = _two_replicas([300, 500], [500, 300])
    sub, sched, sim = _run(plan, cm)
    t = gap_terms(plan, sched, cm, sim.makespan_s, replica=sub).check()
    assert t.replicas == pytest.approx(0.0, abs=1e-15) and t.ideal == pytest.approx(plan_ideal(plan, cm))
    _zero_but(t, ("schedule",))


def test_the_slowest_replica_carries_its_excess_over_the_mean():
    """Replicas of (200, 400) and (200, 200): the first is slower; replicas = half the 400- and 200-token
    sequences' difference in ideal work on the deciding rank's stage."""
    cm = AnalyticCostModel(SMALL, 2, overhead_s=0.0, comm=NO_COMM)
    plan = _two_replicas([200, 400], [200, 200])
    sub, sched, sim = _run(plan, cm)
    assert sub.meta["replica"] == 0
    t = gap_terms(plan, sched, cm, sim.makespan_s, replica=sub).check()
    d = sequence_costs(cm, np.array([200, 400]))
    work = d["F"][t.rank] + d["B"][t.rank]
    assert t.replicas == pytest.approx((work[1] - work[0]) / 2, rel=1e-9) and t.replicas > 0
    assert t.bound == pytest.approx(plan_bound(plan, cm), rel=1e-12)


def test_a_saturated_ideal_puts_the_gemm_efficiency_in_shape():
    """The GPU model against its saturated self, one sequence: no padding, the overhead is the model's
    per-op cost, and shape is what the sequence's GEMMs lose at its size (> 0)."""
    cm = GPUCostModel(SMALL, 2)
    plan = _plan([Microbatch(seq_ids=[0], lengths=[256], padded_len=256, batch=1)], 2)
    sub, sched, sim = _run(plan, cm)
    t = gap_terms(plan, sched, cm, sim.makespan_s, ideal_model=_sat(cm)).check()
    assert t.ideal == pytest.approx(ideal_bound([256], _sat(cm)), rel=1e-12)
    assert t.shape > 0 and t.overhead > 0 and t.padding == pytest.approx(0.0, abs=1e-15)


def test_a_replica_is_required_with_data_parallelism():
    cm = AnalyticCostModel(SMALL, 2)
    plan = _two_replicas([300], [300])
    sub, sched, sim = _run(plan, cm)
    with pytest.raises(ValueError, match="replica"):
        gap_terms(plan, sched, cm, sim.makespan_s)
