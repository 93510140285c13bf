"""Plan time (issue 39, deliverable 3): what the planner and ``plan_lockstep`` remember changes no layout, no plan.

``dynmb.packing.lockstep`` remembers its fills across calls (keyed by their inputs; ``schedule="auto"`` packs
``lockstep`` once per kind) and its cost lookups within one call (``forgetful()``: the old path);
``dynmb.planning.planner.plan_auto`` schedules and simulates equal packed plans once per step
(``unremembered()``: the old path, both). Every layout and every chosen plan must be bit-equal both ways.
"""

from __future__ import annotations

import heapq

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dynmb
from dynmb.core.planspec import PlanSpec
from dynmb.costmodel import gpu
from dynmb.costmodel.loader import Models
from dynmb.memory.model import get_memory_model
from dynmb.packing import dynapipe, lockstep
from dynmb.packing.lockstep import LockstepShape, forgetful, plan_lockstep
from dynmb.planning.planner import plan_step, unremembered
from dynmb.timing import makespan_zb

CFG = dynmb.model_config("llama-tiny")


def _lens(n: int, T: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.minimum(rng.pareto(1.0, n) * T / 8 + 1, T).astype(np.int64)


def _layout_key(lay: lockstep.LockstepLayout) -> tuple:
    return lay.row_of.tolist(), lay.grid, lay.step_s, lay.F.tolist(), lay.B.tolist(), sorted(lay.report.items())


SHAPES = [dict(pack_len=512, dp=1), dict(pack_len=512, dp=2, rows_per_mb=2), dict(pack_len=256, dp=2, groups=2)]


@pytest.mark.parametrize("shape", SHAPES)
def test_lockstep_layouts_same_remembered_or_not(shape):
    """Every kind in turn (the later ones find the earlier ones' fills remembered), several batches: the layout is
    bit-equal to the one computed afresh."""
    cm = gpu.GPUCostModel(CFG, 4)
    lockstep._fills.clear()
    got: dict[bool, list[tuple]] = {True: [], False: []}
    for remember in (True, False):
        for seed in range(3):
            lens = _lens(60 + 20 * seed, shape["pack_len"], seed)
            for kind in ("1f1b", "zb-h1", "zb", "gpipe"):
                s = LockstepShape(**shape, kind=kind)
                if remember:
                    got[True].append(_layout_key(plan_lockstep(lens, s, cm, every_microbatch=True)))
                else:
                    with forgetful():
                        got[False].append(_layout_key(plan_lockstep(lens, s, cm, every_microbatch=True)))
    assert got[True] == got[False]
    assert len(lockstep._fills) > 0                      # the fills were remembered (and so could be wrong)


def test_remembered_fill_is_a_copy():
    """A caller that changes the rows it got back does not change what the next caller gets."""
    lens = _lens(40, 512, 1)
    w = lens.astype(np.float64) ** 2
    first = lockstep._least_loaded(lens, w, np.zeros(40, dtype=np.int64), 512)
    assert first is not None
    want = first.copy()
    first[:] = -1
    again = lockstep._least_loaded(lens, w, np.zeros(40, dtype=np.int64), 512)
    assert again is not None and again.tolist() == want.tolist()
    with forgetful():
        fresh = lockstep._least_loaded(lens, w, np.zeros(40, dtype=np.int64), 512)
    assert fresh is not None and fresh.tolist() == want.tolist()


def test_remembered_costs_are_the_models_and_read_only():
    cm = gpu.GPUCostModel(CFG, 4)
    rem = lockstep._RememberedCosts(cm)
    rows, T, a = np.ones(5), np.full(5, 256.0), np.arange(1.0, 6.0) * 1e4
    one = rem.stage_costs(rows, T, a)
    two = rem.stage_costs(rows, T, a)
    ref = cm.stage_costs(rows, T, a)
    assert all(np.array_equal(one[op], ref[op]) and one[op] is two[op] for op in ("F", "B"))
    with pytest.raises(ValueError):
        one["F"][0, 0] = 0.0
    other = rem.stage_costs(rows, T, a * 2)                 # other inputs: another answer
    assert not np.array_equal(other["F"], ref["F"])
    assert rem.num_stages == cm.num_stages


@pytest.mark.parametrize("schedule", ["auto", "1f1b", "zb"])
def test_dynamic_plan_same_remembered_or_not(schedule):
    """``dynamic`` (its final check packs ``lockstep`` for every kind ``auto`` weighs), several batches: method,
    microbatches, kind, predicted step, every kind's score (``schedule_auto``) and the microbatches' contents
    bit-equal with and without remembering."""
    P = 4
    models = Models(gpu.GPUCostModel(CFG, P), get_memory_model(None, CFG, P))
    spec = PlanSpec(method="dynamic", num_stages=P, memory_limit_bytes=2 * 2**30, schedule_kind=schedule)

    def key(plan):
        return (plan.method, plan.num_microbatches, plan.schedule_kind, float(plan.predictions["pred_step_s"]),
                plan.meta.candidate, plan.meta.schedule_auto, [(mb.seq_ids.tolist(), mb.padded_len, mb.batch) for mb in plan.microbatches])
    for seed in range(2):
        lens = _lens(120, 1024, seed + 7)
        lockstep._fills.clear()
        new = key(plan_step(lens, spec, model_cfg=CFG, models=models)[0])
        with unremembered():
            old = key(plan_step(lens, spec, model_cfg=CFG, models=models)[0])
        assert new == old


def test_remembered_fills_tell_their_inputs_apart():
    """The same lengths under other weights, tiers or row length: each fill as computed afresh (a memo keyed by less
    than every input would hand back another's rows)."""
    lens = _lens(80, 512, 3)
    inputs = [(lens.astype(np.float64) ** 2, np.zeros(30, dtype=np.int64), 512),
              (1.0 / lens.astype(np.float64), np.zeros(30, dtype=np.int64), 512),
              (lens.astype(np.float64) ** 2, np.repeat([0, 1], 15), 512),
              (lens.astype(np.float64) ** 2, np.zeros(30, dtype=np.int64), 640)]
    got = [lockstep._least_loaded(lens, *x) for x in inputs]
    with forgetful():
        fresh = [lockstep._least_loaded(lens, *x) for x in inputs]
    assert [None if g is None else g.tolist() for g in got] == [None if f is None else f.tolist() for f in fresh]
    assert len({None if f is None else tuple(f.tolist()) for f in fresh}) > 1     # the inputs do differ


def test_lockstep_layouts_same_under_two_cost_models():
    """One batch, one shape, two cost models (other weights): each layout as computed afresh."""
    lens = _lens(90, 512, 5)
    for P in (2, 4):
        cm = gpu.GPUCostModel(CFG, P)
        new = _layout_key(plan_lockstep(lens, LockstepShape(pack_len=512, dp=2), cm))
        with forgetful():
            old = _layout_key(plan_lockstep(lens, LockstepShape(pack_len=512, dp=2), cm))
        assert new == old


# --------------------------------------------------------------------------- the balanced fill before (a copy)
OLD_HEAP_POPS = 32
"""Rows without room the old fill's heap looked past before it scanned every row."""


def _old_heap_row(heap, room, load, size):
    passed, found = [], None
    while heap and len(passed) < OLD_HEAP_POPS:
        entry = heapq.heappop(heap)
        if entry[1] != load[entry[2]]:
            continue
        if room[entry[2]] >= size:
            found = entry[2]
            break
        passed.append(entry)
    for entry in passed:
        heapq.heappush(heap, entry)
    return found


def _old_least_fill(sizes, weights, tiers, pack_len):
    """``lockstep._least_fill`` before its loop read plain lists (numpy scalars)."""
    w = weights.tolist()
    heap = [(t, 0.0, r) for r, t in enumerate(tiers.tolist())]
    heapq.heapify(heap)
    room, load = np.full(len(tiers), int(pack_len), dtype=np.int64), [0.0] * len(tiers)
    load_np = np.zeros(len(tiers))
    row = np.empty(len(sizes), dtype=np.int64)
    for i in np.lexsort((np.arange(len(sizes)), -weights, -sizes)).tolist():
        size, r = int(sizes[i]), _old_heap_row(heap, room, load, int(sizes[i]))
        if r is None:
            fits = room >= size
            if not fits.any():
                return None
            r = int(np.argmin(np.where(fits & (tiers == tiers[fits].min()), load_np, np.inf)))
        row[i], room[r] = r, room[r] - size
        load[r] += w[i]
        load_np[r] = load[r]
        heapq.heappush(heap, (int(tiers[r]), load[r], r))
    return row


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 400), rows=st.integers(1, 120), tiers=st.integers(1, 3),
       pack_len=st.sampled_from([64, 256, 1024]), ties=st.booleans())
def test_least_fill_is_the_old_one(seed, n, rows, tiers, pack_len, ties):
    """The fill on plain lists gives the old fill's rows (or its None): random and tied lengths and weights, tiers,
    rows too few (a scan, a refusal) or plenty."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, pack_len + 1, n) if not ties else np.full(n, max(1, pack_len // 3))
    lens = lens.astype(np.int64)
    w = np.ones(n) if ties else lens.astype(np.float64) ** 2 * rng.uniform(0.5, 1.5, n)
    tier = np.sort(rng.integers(0, tiers, rows)).astype(np.int64)
    new = lockstep._least_fill(lens, w, tier, pack_len)
    old = _old_least_fill(lens, w, tier, pack_len)
    assert (new is None) == (old is None)
    assert new is None or (new.dtype == old.dtype and new.tolist() == old.tolist())


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_lockstep_layouts_same_with_the_old_fill(shape, monkeypatch):
    """Whole layouts (every kind, forgetful so each fill runs) with the fill on lists and the old one."""
    cm = gpu.GPUCostModel(CFG, 4)
    got = {}
    for old in (False, True):
        with monkeypatch.context() as mp, forgetful():
            if old:
                mp.setattr(lockstep, "_least_fill", _old_least_fill)
            got[old] = [_layout_key(plan_lockstep(_lens(80 + 30 * seed, shape["pack_len"], seed),
                                                  LockstepShape(**shape, kind=kind), cm, every_microbatch=True))
                        for seed in range(2) for kind in ("1f1b", "zb")]
    assert got[False] == got[True]


def test_dynapipe_split_remembered_is_computed_afresh(monkeypatch):
    """The remembered DP split equals the one computed afresh for other lengths, row caps, cost models (other P and
    model) and P in the estimate; a copy each time; at most ``REMEMBERED`` kept."""
    monkeypatch.setattr(dynapipe, "_splits", dynapipe.OrderedDict())
    lens = np.sort(_lens(300, 2048, 4)).astype(np.float64)
    caps = np.maximum(8192 // lens.astype(np.int64), 1)
    cases = [(lens, caps, gpu.GPUCostModel(CFG, 4), 4), (lens, np.minimum(caps, 3), gpu.GPUCostModel(CFG, 4), 4),
             (lens, caps, gpu.GPUCostModel(CFG, 2), 4), (lens, caps, gpu.GPUCostModel(CFG, 4), 12),
             (np.sort(_lens(300, 2048, 5)).astype(np.float64), caps, gpu.GPUCostModel(CFG, 4), 4),
             (lens, caps, gpu.GPUCostModel(dynmb.model_config("llama2-7b"), 4), 4)]

    def run(remembered: int) -> list[list[int]]:
        monkeypatch.setattr(dynapipe, "REMEMBERED", remembered)
        return [dynapipe.dynapipe_split(s, b, cm, P).tolist() for s, b, cm, P in cases]
    fresh = run(0)
    assert len({tuple(f) for f in fresh}) >= 3                      # the inputs do change the split
    assert run(64) == fresh and run(64) == fresh and len(dynapipe._splits) == len(cases)
    first = dynapipe.dynapipe_split(*cases[0][:3], 4)
    first[:] = -1
    assert dynapipe.dynapipe_split(*cases[0][:3], 4).tolist() == fresh[0]
    dynapipe._splits.clear()
    assert run(2) == fresh and len(dynapipe._splits) == 2


@pytest.mark.parametrize("schedule", ["auto", "zb"])
def test_dynamic_plan_same_with_every_old_path(schedule, monkeypatch):
    """``dynamic`` with the fill on lists, the single sweep and the remembered zb estimates and DP splits, and with
    every one switched back to the old path: the same plan (as ``test_dynamic_plan_same_remembered_or_not`` keys
    it), twice in a row (the second reads what the first remembered)."""
    P = 4
    models = Models(gpu.GPUCostModel(CFG, P), get_memory_model(None, CFG, P))
    spec = PlanSpec(method="dynamic", num_stages=P, memory_limit_bytes=2 * 2**30, schedule_kind=schedule)

    def key(plan):
        return (plan.method, plan.num_microbatches, plan.schedule_kind, float(plan.predictions["pred_step_s"]),
                plan.meta.candidate, plan.meta.schedule_auto,
                [(mb.seq_ids.tolist(), mb.padded_len, mb.batch) for mb in plan.microbatches])
    got = {}
    for old in (False, True):
        with monkeypatch.context() as mp:
            mp.setattr(makespan_zb, "_swept", makespan_zb.OrderedDict())
            mp.setattr(dynapipe, "_splits", dynapipe.OrderedDict())
            lockstep._fills.clear()
            if old:
                mp.setattr(lockstep, "_least_fill", _old_least_fill)
                mp.setattr(makespan_zb, "SINGLE_SWEEP", False)
                mp.setattr(makespan_zb, "REMEMBERED", 0)
                mp.setattr(dynapipe, "REMEMBERED", 0)
            got[old] = [key(plan_step(_lens(400, 2048, seed), spec, model_cfg=CFG, models=models)[0])
                        for seed in (8, 8, 9)]
    assert got[False] == got[True]
