"""Every fast makespan estimator against the simulator (the reference), on random pipelines.

For every kind in the schedule registry, hypothesis draws a pipeline: microbatch sizes (equal, lognormal or
heavy-tailed) with per-stage speeds, per-stage ``I`` / ``W`` shares of the backward, a P2P time per
microbatch, P 2-8 ranks, m 1-24 microbatches, ``virtual`` chunks per rank where the kind takes them (its
``chunks`` where fixed, else 2 or 3). The kind's builder makes the schedule from those costs (the simulator as
its judge where it takes one; no memory limit binding), ``dynmb.timing.simulate.simulate_costs`` times it, and
the estimate the kind's record names (``dynmb.timing.makespan.makespans`` with the true shares) keeps its
entry's ``guarantee`` within its ``tolerance`` (``dynmb.timing.estimators``): ``exact`` (gpipe, 1f1b,
memory-aware with a limit that does not bind, interleaved: equal up to 1e-9), ``upper`` (zb-v: never below,
at most 10% above), ``approx`` (zb-h1 15%, zb 25%, either way).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynmb.schedule.kinds import build_schedule, get_kind, kind_names, register_kind, unregister_kind
from dynmb.schedule import zerobubble
from dynmb.schedule.zerobubble import ZBInputs
from dynmb.timing.estimators import Estimator, estimator_names, estimator_of, get_estimator, register_estimator
from dynmb.schedule.embedlast import embed_last
from dynmb.timing.embedding import lifted_costs
from dynmb.timing.embedplace import embed_times
from dynmb.timing.makespan import embed_terms, makespan, makespans
from dynmb.timing.simulate import simulate_costs

BUILT_IN = ("gpipe", "1f1b", "interleaved", "memory-aware", "zb-h1", "zb", "zb-v")


def _pipeline(rng: np.random.Generator, S: int, m: int) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Costs ``{F, B, I, W}`` ``[S, m]``, P2P time ``[m]`` and the true shares ``[2, S]`` of one random pipeline."""
    dist = rng.integers(3)
    tok = np.ones(m) if dist == 0 else rng.lognormal(0, 0.5 if dist == 1 else 1.2, m)
    F = rng.uniform(0.8, 1.3, S)[:, None] * (tok + 0.1 * tok ** 2)
    B = rng.uniform(1.8, 2.4, S)[:, None] * F
    w_share = rng.uniform(0.3, 0.55, S)
    i_share = rng.uniform(1.0, 1.06, S) - w_share                  # a split backward may cost a few % more
    costs = {"F": F, "B": B, "I": i_share[:, None] * B, "W": w_share[:, None] * B}
    return costs, rng.uniform(0, 0.3) * tok, np.stack([i_share, w_share])


def _virtual(kind: str, rng: np.random.Generator) -> int:
    rec = get_kind(kind)
    if rec.chunks is not None:
        return rec.chunks
    return int(rng.choice([2, 3])) if rec.virtual_stages else 1


def estimate_and_simulate(kind: str, ranks: int, m: int, seed: int) -> tuple[float, float]:
    """(the kind's estimate, the simulated step of the schedule its builder makes) for one random pipeline."""
    rng = np.random.default_rng(seed)
    v = _virtual(kind, rng)
    S = ranks * v
    costs, comm, shares = _pipeline(rng, S, m)

    def evaluate(schedule):
        return simulate_costs(schedule, costs, comm).makespan_s, np.zeros(S)

    inp = ZBInputs(costs["F"], costs["B"], costs["I"], costs["W"], comm, np.ones((S, m), dtype=bool))
    sched = build_schedule(kind, S, m, virtual=v, act_bytes=np.ones((S, m)), limit_bytes=float("inf"),
                           zb_inputs=inp, evaluate=evaluate)
    sim = evaluate(sched)[0]
    est = float(makespans(costs["F"], costs["B"], comm, [m], kind, shares=shares, virtual=v)[0])
    return est, sim


def estimate_and_simulate_embedding_last(kind: str, ranks: int, m: int, seed: int) -> tuple[float, float, float]:
    """(the kind's estimate plus ``embed_terms``, the simulated step of its schedule with the embedding stage on the
    last rank, the terms' slack: the embeds' work and two longest messages) for one random pipeline whose embeds
    cost up to 5% of stage 0's forward (module doc of ``dynmb.timing.estimators``), placed as the planner places
    them (``dynmb.timing.embedplace`` with the pipeline's costs)."""
    rng = np.random.default_rng(seed)
    v = _virtual(kind, rng)
    S = ranks * v
    costs, comm, shares = _pipeline(rng, S, m)
    fe = rng.uniform(0.0, 0.05) * costs["F"][0]
    embed = (fe, rng.uniform(1.0, 2.0) * fe)

    def evaluate(schedule):
        return simulate_costs(schedule, costs, comm).makespan_s, np.zeros(S)

    inp = ZBInputs(costs["F"], costs["B"], costs["I"], costs["W"], comm, np.ones((S, m), dtype=bool))
    sched = build_schedule(kind, S, m, virtual=v, act_bytes=np.ones((S, m)), limit_bytes=float("inf"),
                           zb_inputs=inp, evaluate=evaluate)
    used = {a.op for acts in sched.ranks for a in acts}
    own = {op: costs[op] for op in ("FB" if used <= {"F", "B"} else "FBIW")}
    lifted = embed_last(sched, embed_times(sched, own, comm, embed))
    sim = simulate_costs(lifted, lifted_costs(own, embed), comm).makespan_s
    terms = float(embed_terms(embed, comm, [m])[0])
    est = float(makespans(costs["F"], costs["B"], comm, [m], kind, shares=shares, virtual=v)[0]) + terms
    return est, sim, terms


def check_guarantee(kind: str, est: float, sim: float) -> None:
    entry = estimator_of(kind)
    err = est / sim - 1
    if entry.guarantee == "exact":
        assert abs(err) <= entry.tolerance, (kind, est, sim)
    elif entry.guarantee == "upper":
        assert -1e-9 <= err <= entry.tolerance, (kind, est, sim)
    else:
        assert abs(err) <= entry.tolerance, (kind, est, sim)


def test_every_kind_names_a_registered_estimator():
    assert set(BUILT_IN) <= set(kind_names())
    assert {get_kind(k).estimate_as for k in kind_names()} <= set(estimator_names())
    assert {k: estimator_of(k).guarantee for k in BUILT_IN} == {
        "gpipe": "exact", "1f1b": "exact", "interleaved": "exact", "memory-aware": "exact", "zb-h1": "approx",
        "zb": "approx", "zb-v": "upper"}
    assert get_kind("zb-v").estimate_as == "zb-v" and estimator_of("zb-v").split_backward


@pytest.mark.parametrize("kind", kind_names())
@settings(max_examples=12, deadline=None)
@given(ranks=st.integers(2, 8), m=st.integers(1, 24), seed=st.integers(0, 2**31 - 1))
def test_every_estimate_keeps_its_guarantee_against_the_simulator(kind, ranks, m, seed):
    """Random pipelines; ``zb``'s pumped candidates left out, as in the slow sibling below (the estimate models
    ``zb`` without them: with them ``ranks=3, m=18, seed=192`` simulates 310.1 against an estimate of 387.7, 25.02%
    over the tolerance, found by a clean clone's CI run)."""
    pumped = zerobubble.PUMPED
    zerobubble.PUMPED = False
    try:
        est, sim = estimate_and_simulate(kind, ranks, m, seed)
    finally:
        zerobubble.PUMPED = pumped
    check_guarantee(kind, est, sim)


LOOP_KINDS = [k for k in kind_names() if get_kind(k).placement == "loop"]
"""The kinds that take the embedding on the last rank (V placement holds the last stage on rank 0)."""


def check_embedding_last(kind: str, est: float, sim: float, terms: float) -> None:
    """``exact`` entries: an upper bound, at most ``terms`` above; the others: their own guarantee."""
    if estimator_of(kind).guarantee == "exact":
        assert sim * (1 - 1e-9) <= est <= sim + terms * (1 + 1e-9), (kind, est, sim, terms)
    else:
        check_guarantee(kind, est, sim)


@pytest.mark.parametrize("kind", LOOP_KINDS)
@settings(max_examples=8, deadline=None)
@given(ranks=st.integers(2, 8), m=st.integers(1, 24), seed=st.integers(0, 2**31 - 1))
def test_every_estimate_with_the_embeds_keeps_its_guarantee_with_the_embedding_last(kind, ranks, m, seed):
    """The estimate plus ``embed_terms`` against the simulated step of the schedule with the embedding stage
    (``zb``'s pumped candidates left out, as above). Fails without the terms: the first embed's message alone puts
    every ``exact`` estimate below the step."""
    pumped = zerobubble.PUMPED
    zerobubble.PUMPED = False
    try:
        est, sim, terms = estimate_and_simulate_embedding_last(kind, ranks, m, seed)
    finally:
        zerobubble.PUMPED = pumped
    check_embedding_last(kind, est, sim, terms)


def test_embed_terms_by_hand():
    """Two pipelines (3 and 1 columns) and an empty one: each its embeds' work plus two of its longest messages."""
    fe, be, comm = np.array([1.0, 2.0, 3.0, 4.0]), np.array([0.5, 0.5, 0.5, 0.5]), np.array([0.1, 0.3, 0.2, 0.7])
    got = embed_terms((fe, be), comm, [3, 0, 1])
    assert got == pytest.approx([6.0 + 1.5 + 0.6, 0.0, 4.5 + 1.4])
    assert embed_terms((fe, be), 0.25, [4]) == pytest.approx([10.0 + 2.0 + 0.5])


def test_the_example_the_pumped_candidates_broke_keeps_the_guarantee_without_them(monkeypatch):
    monkeypatch.setattr(zerobubble, "PUMPED", False)
    check_guarantee("zb", *estimate_and_simulate("zb", 3, 18, 192))


def test_a_kind_may_name_an_estimator_registered_later():
    """The registry is open: a kind names a new entry, ``makespans`` calls its callable; an unknown name is one
    line naming the registered ones."""
    calls = []

    def doubled(F, B, comm, sizes, **kw):
        calls.append(kw)
        return 2 * get_estimator("gpipe").makespans(F, B, comm, sizes, **kw)

    register_estimator(Estimator(name="test-doubled", makespans=doubled, guarantee="approx", tolerance=1.0))
    register_kind(replace(get_kind("gpipe"), name="test-gpipe2", estimate_as="test-doubled"))
    register_kind(replace(get_kind("gpipe"), name="test-nowhere", estimate_as="test-missing"))
    try:
        F = np.arange(1.0, 7.0).reshape(2, 3)
        assert makespan(F, 2 * F, 0.1, "test-gpipe2") == pytest.approx(2 * makespan(F, 2 * F, 0.1, "gpipe"))
        assert calls and set(calls[0]) == {"exact", "shares", "virtual"}
        with pytest.raises(ValueError, match="names makespan estimator 'test-missing', which is not registered"):
            makespan(F, 2 * F, 0.1, "test-nowhere")
    finally:
        unregister_kind("test-gpipe2")
        unregister_kind("test-nowhere")


def test_zb_v_estimate_is_the_builders_step_on_equal_microbatches():
    """Equal microbatches, no P2P: the list scheduler's clocks are the simulated times (no rank waits past an
    input), so the zb-v estimate equals the simulated step of the built schedule."""
    for R, m in [(1, 3), (2, 8), (4, 16)]:
        S = 2 * R
        one = np.ones((S, m))
        costs = {"F": one, "B": 2 * one, "I": one, "W": one}
        inp = ZBInputs(one, 2 * one, one, one, np.zeros(m), np.ones((S, m), dtype=bool))

        def evaluate(s, costs=costs, m=m):
            return simulate_costs(s, costs, np.zeros(m)).makespan_s, None

        sim = evaluate(build_schedule("zb-v", S, m, virtual=2, zb_inputs=inp, evaluate=evaluate))[0]
        est = makespan(one, 2 * one, 0.0, "zb-v", shares=np.full((2, S), 0.5), virtual=2)
        assert est == pytest.approx(sim, rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("kind", kind_names())
def test_every_estimate_keeps_its_guarantee_on_many_pipelines(kind, monkeypatch):
    """The bigger sibling: 150 pipelines per kind, P 2-8, m 1-24 (the range the tolerances are stated for).
    ``zb``'s pumped candidates (``zerobubble.PUMPED``) are left out, as ``tests/test_makespan_zb.py`` leaves them
    out: the estimate models ``zb`` without them, and they are only ever faster (with them one of these 150
    ``zb`` pipelines simulates 559.3 against an estimate of 801.9)."""
    monkeypatch.setattr(zerobubble, "PUMPED", False)
    rng = np.random.default_rng(11)
    for _ in range(150):
        ranks, m = int(rng.integers(2, 9)), int(rng.integers(1, 25))
        est, sim = estimate_and_simulate(kind, ranks, m, int(rng.integers(2**31)))
        check_guarantee(kind, est, sim)


@pytest.mark.slow
@pytest.mark.parametrize("kind", LOOP_KINDS)
def test_every_estimate_with_the_embeds_keeps_its_guarantee_on_many_pipelines(kind, monkeypatch):
    """The bigger sibling of the embedding-last test: 150 pipelines per kind that takes the embedding last."""
    monkeypatch.setattr(zerobubble, "PUMPED", False)
    rng = np.random.default_rng(12)
    for _ in range(150):
        ranks, m = int(rng.integers(2, 9)), int(rng.integers(1, 25))
        check_embedding_last(kind, *estimate_and_simulate_embedding_last(kind, ranks, m, int(rng.integers(2**31))))
