"""zb / zb-h1 judge only the list schedules that could still win (``zerobubble.JUDGE_CONTENDERS_ONLY``): the list
scheduler's makespan is the judge's (``planning.zerobubble.zb_evaluator``, the simulator's recurrence) bit for bit,
so a candidate whose own makespan already loses is skipped; the schedules chosen are the same as judging all."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynmb.core.types import Plan
from dynmb.costmodel.loader import Models
from dynmb.planning.zerobubble import zb_evaluator, zb_inputs
from dynmb.schedule import build_schedule
from dynmb.schedule import zerobubble
from dynmb.schedule.zerobubble import list_schedule
from tests.test_plan_speed import _random_inputs
from tests.test_zerobubble import _models, variable_plans


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 6), st.integers(1, 14), st.booleans(), st.booleans(),
       st.sampled_from([None, "span", "makespan"]), st.sampled_from(["none", "all", "stage"]), st.booleans(),
       st.booleans())
def test_list_makespan_is_the_judges_bit_for_bit(seed, P, m, unit, memory, fill, defer, permuted, pump):
    """What the skip rests on: every list schedule's own makespan equals the judge's exactly (not within a
    tolerance: the skip compares it with the judged times as the judge's own comparisons do)."""
    rng = np.random.default_rng(seed + 7)
    inp = _random_inputs(seed, P, m, unit, memory)
    inflight = sorted((P - s + int(rng.integers(0, P + 1)) for s in range(P)), reverse=True)
    caps = zerobubble.one_f_one_b_peaks(inp) * rng.uniform(1.0, 2.5) if memory and not unit else None
    w_defer = {"none": None, "all": [m] * P, "stage": list(range(P))}[defer]
    order = rng.permutation(m).tolist() if permuted else None
    sched, own = list_schedule(inp, inflight, caps, backward_order=order, w_defer=w_defer, fill=fill, pump=pump)
    judge = zb_evaluator(SimpleNamespace(num_stages=P), SimpleNamespace(memory=None), inp)
    assert judge(sched)[0] == own


def _built(plan: Plan, kind: str, contenders_only: bool, monkeypatch) -> tuple[list, int, int]:
    """``kind``'s schedule of ``plan`` built afresh, the judge's calls and the list schedules built."""
    P, m = plan.num_stages, plan.num_microbatches
    models = Models(*_models(P))
    inp = zb_inputs(plan, models)
    judge = zb_evaluator(plan, models, inp)
    built, judged = [0], [0]

    def counted(sched):
        judged[0] += 1
        return judge(sched)
    counted.judge = judge.judge                     # type: ignore[attr-defined]

    def listed(*args, **kw):
        built[0] += 1
        return real(*args, **kw)
    real = zerobubble.listed
    with monkeypatch.context() as mp:
        mp.setattr(zerobubble, "REMEMBERED", 0)
        mp.setattr(zerobubble, "JUDGE_CONTENDERS_ONLY", contenders_only)
        mp.setattr(zerobubble, "listed", listed)
        kw = {"limit_bytes": plan.memory_limit_bytes, "state_bytes": models.memory.state_bytes} if kind == "zb" else {}
        sched = build_schedule(kind, P, m, zb_inputs=inp, evaluate=counted, **kw)
    return [[(a.op, a.mb) for a in r] for r in sched.ranks], judged[0], built[0]


@settings(max_examples=30, deadline=None)
@given(variable_plans(), st.floats(1.0, 3.0), st.sampled_from(["zb", "zb-h1"]))
def test_judging_contenders_only_is_the_same_choice(plan, slack, kind):
    """The schedule chosen with the skip is the one chosen judging every candidate, with no more judgements."""
    with pytest.MonkeyPatch.context() as mp:
        P = plan.num_stages
        cm, mm = _models(P)
        limit = int(max(mm.state_bytes) * slack + 2**26)
        plan = Plan(plan.microbatches, "test", P, limit, plan.num_sequences)
        skip, judged_skip, built = _built(plan, kind, True, mp)
        every, judged_all, built_all = _built(plan, kind, False, mp)
    assert skip == every and built == built_all
    assert judged_skip <= judged_all


def test_a_losing_window_is_not_judged(monkeypatch):
    """``zb``'s sweep of windows stops at the first that is no faster: that one loses on its own makespan and is
    not judged, so ``zb`` judges fewer schedules than it builds plus 1F1B (judging every one -- the code before
    -- judges exactly that many)."""
    from tests.test_zerobubble import _plan
    plan = _plan([(b, s) for b, s in zip([1, 4, 2, 8, 1, 2, 3, 1, 6, 2, 1, 4], [2048, 256, 1024, 64, 2048, 512,
                                                                                 256, 1024, 128, 512, 2048, 256])],
                 4, 2**36)
    sched, judged, built = _built(plan, "zb", True, monkeypatch)
    _, judged_all, _ = _built(plan, "zb", False, monkeypatch)
    assert judged_all == built + 1                   # every list schedule and 1F1B
    assert judged < judged_all
