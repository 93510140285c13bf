"""Ramped fills of the ``dynamic`` packer (``dynmb.packing.dynamic.ramp``, issue 39) and ``--schedule auto`` running
``zb`` on ``zb-h1``'s packing: the ramp grows by ``1 + 2 / P`` from a sixteenth of the body, holds every document of
the body once, runs first; where the simulator says a ramp pays, ``auto``'s choice is never slower than any kind."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import dynmb
from dynmb.packing.dynamic.ramp import RAMP_SPAN, growth, ramp_targets, ramped
from dynmb.packing.dynamic.rank import Candidate
from dynmb.packing.rows import Group, groups_to_flat
from dynmb.planning.ramped import BODY_SCALES, ramped_plan


def _body(lengths: np.ndarray, per: int) -> Candidate:
    """One packed row of ``per`` documents per microbatch, in order."""
    groups = [Group(np.arange(a, min(a + per, len(lengths))), np.zeros(min(per, len(lengths) - a), dtype=np.int64),
                    int(lengths[a:a + per].sum()), 1) for a in range(0, len(lengths), per)]
    return Candidate(np.ones(len(groups), dtype=np.int64), np.array([g.padded_len for g in groups]),
                     np.array([float(np.sum(lengths[g.items] ** 2)) for g in groups]),
                     lambda order: groups_to_flat([groups[i] for i in order]), key=("test", per))


def test_targets_grow_by_one_plus_two_over_p_from_a_sixteenth_of_the_body():
    for P in (4, 8, 16):
        t = ramp_targets(4000.0, P)
        assert np.isclose(t[0], 4000.0 / RAMP_SPAN) and t[-1] < 4000.0 <= t[-1] * growth(P)
        assert np.allclose(t[1:] / t[:-1], 1 + 2 / P)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), P=st.sampled_from([4, 8, 16]), per=st.integers(8, 40))
def test_ramp_holds_every_document_once_and_runs_first_growing(seed, P, per):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(20, 400, size=per * 60).astype(np.int64)
    cand = ramped(_body(lengths, per), lengths, P, row_cap=100_000, round_to=1, admissible=lambda s: np.ones(len(s)))
    assert cand is not None
    flat = cand.emit(np.arange(len(cand.rows)))
    assert np.array_equal(np.sort(flat.items), np.arange(len(lengths)))            # every document once
    tokens = np.add.reduceat(lengths[flat.items], np.concatenate([[0], np.cumsum(flat.nseq)[:-1]]))
    k = len(ramp_targets(float(np.median(np.add.reduceat(lengths, np.arange(0, len(lengths), per)))), P))
    assert tokens[0] < np.median(tokens) / 4                                   # the fill starts small
    assert np.all(np.diff(tokens[:k]) >= -int(lengths.max()))                    # and grows (up to one document)
    assert np.array_equal(cand.padded, flat.padded_len) and np.all(flat.batch == 1)


def test_no_ramp_where_no_row_fits_or_the_body_is_short():
    lengths = np.full(400, 100, dtype=np.int64)
    assert ramped(_body(lengths, 20), lengths, 8, 100_000, 1, admissible=lambda s: np.zeros(len(s))) is None
    assert ramped(_body(lengths[:60], 20), lengths[:60], 8, 100_000, 1, admissible=lambda s: np.ones(len(s))) is None


def _planner(schedule: str) -> dynmb.Planner:
    return dynmb.Planner(model="tiny", num_stages=4, memory_limit="64MiB", cost_model="analytic", schedule=schedule)


def _lengths() -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.minimum(rng.lognormal(5.0, 0.8, 600).astype(np.int64) + 8, 1500)


def test_ramped_plan_keeps_every_sequence_and_starts_small():
    planner = _planner("zb")
    plan = planner.plan(_lengths()).plan
    for scale in BODY_SCALES:
        out = ramped_plan(plan, plan.spec, planner.memory_model, scale)   # a Plan: every sequence exactly once
        assert out is not None and out.num_sequences == plan.num_sequences
        tokens = [mb.real_tokens for mb in out.microbatches]
        assert tokens[0] < np.median(tokens) / 4 and sum(tokens) == plan.real_tokens
    assert ramped_plan(plan, plan.spec.with_(attention="dense"), planner.memory_model) is None


def test_auto_weighs_zb_on_other_packings_and_keeps_the_fastest():
    planner, lengths = _planner("auto"), _lengths()
    step = planner.plan(lengths)
    scores = step.plan.meta.schedule_auto
    assert {"zb@zb-h1", "zb+ramp"} <= set(scores)
    fits = float(np.max(step.sim.peak_bytes)) <= planner.memory_limit_bytes
    assert not fits or step.sim.makespan_s <= min(v for v in scores.values() if v is not None) + 1e-12
    assert step.plan.schedule_kind in ("1f1b", "zb-h1", "zb")
    assert "zb@zb-h1" not in planner.plan(lengths, method="balanced").plan.meta.schedule_auto
