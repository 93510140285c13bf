"""Plan time's speed-ups change no plan: the list scheduler against a stored copy of the one before it was
sped up, ``GPUCostModel.stage_costs`` remembered against computed afresh, ``ModelSizes.stage_pieces`` /
``stage_parts`` against the plain loops, ``zb`` / ``zb-h1`` schedules remembered against built afresh, the
reorder search's batched makespans under a memory limit against
one order at a time, and whole planned steps (plans, every op's order and simulated timing) with every old
path switched back in."""

from __future__ import annotations

import heapq
import signal
from collections import deque
from contextlib import contextmanager
from dataclasses import replace
from typing import Sequence

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dynmb
from dynmb import data
from dynmb.core import model_sizes
from dynmb.core.config import ModelConfig
from dynmb.core.model_sizes import PARTS, SUB_CHUNKS, UNITS_PER_LAYER, HalfPiece, _count
from dynmb.core.types import Action, Schedule
from dynmb.costmodel.gpu import GPUCostModel
from dynmb.packing import dynapipe
from dynmb.planning import reorder
from dynmb.schedule import zerobubble
from dynmb.schedule.order import check_order, windowed_order
from dynmb.schedule.zerobubble import ZBInputs, _check_fill, list_schedule, op_bytes
from dynmb.timing import makespan_zb


# --------------------------------------------------------------------------- the list scheduler before (a copy)
class _OldListRun:
    """One run of the list scheduler: each stage's clock, held bytes, in-flight count, queued Ws and emitted order."""

    STEP = {"F": 1, "B": -1, "I": 0, "W": -1}   # in-flight count change per op

    def __init__(self, inp: ZBInputs, inflight: Sequence[int], caps: Sequence[float] | np.ndarray | None,
                 backward_order: Sequence[int] | None, w_defer: Sequence[int] | None,
                 fill: str | None = None) -> None:
        P, m = inp.shape
        self.P = P
        self.fill = _check_fill(fill)
        # the span each stage would have if it waited no more: its work, plus its waits once started
        self.span = (inp.F + np.where(inp.split, inp.I + inp.W, inp.B)).sum(axis=1).tolist()
        self.first = [0.0] * P                      # start of each stage's first op
        self.free = [0.0] * P                       # end of each stage's last op
        check_order(m, backward_order)              # refused here, before any stage
        self.k = [max(1, min(m, int(x))) for x in inflight]
        self.defer = [0] * P if w_defer is None else [max(0, int(x)) for x in w_defer]
        mem = caps is not None and inp.act is not None
        self.cap = [float(c) + 1e-6 for c in caps] if mem and caps is not None else [np.inf] * P
        zero = np.zeros((P, m))
        # plain Python lists: the loop reads one scalar at a time
        self.act, self.wb, self.tr = ((zero if a is None else a).tolist() for a in (inp.act, inp.w, inp.tr))
        self.F, self.B, self.I, self.W = inp.F.tolist(), inp.B.tolist(), inp.I.tolist(), inp.W.tolist()
        self.comm, self.split = inp.comm.tolist(), inp.split.tolist()
        self.est_bwd = np.where(inp.split, inp.I, inp.B).tolist()
        self.fend = [[-1.0] * m for _ in range(P)]
        self.bend = [[-1.0] * m for _ in range(P)]
        self.clock = [0.0] * P
        # 1F1B's greedy order per stage for its window (X: the backward, I or B)
        self.todo = [deque(windowed_order(m, self.k[s], backward_order, "X")) for s in range(P)]  # its lookahead
        self.pend: list[deque] = [deque() for _ in range(P)]
        self.held, self.live = [0.0] * P, [0] * P
        self.ranks: list[list[tuple[str, int]]] = [[] for _ in range(P)]
        self.makespan = 0.0

    def ready(self, s: int, op: str, j: int) -> tuple[float, bool]:
        """(time op j's input is there, known?) -- else a lower bound from the producer's clock."""
        comm = self.comm
        if op == "F":
            if s == 0:
                return 0.0, True
            if self.fend[s - 1][j] >= 0:
                return self.fend[s - 1][j] + comm[j], True
            return self.clock[s - 1] + self.F[s - 1][j] + comm[j], False
        if s == self.P - 1:
            return self.fend[s][j], self.fend[s][j] >= 0
        if self.bend[s + 1][j] >= 0:
            return self.bend[s + 1][j] + comm[j], True
        return self.clock[s + 1] + self.est_bwd[s + 1][j] + comm[j], False

    def run(self, s: int, op: str, j: int, dur: float) -> None:
        self.held[s] += op_bytes(op, self.act[s][j], self.wb[s][j], self.tr[s][j])[0]
        self.live[s] += self.STEP[op]
        if not self.ranks[s]:
            self.first[s] = self.clock[s]
        self.ranks[s].append((op, j))
        # a W needs no input: it starts where the stage's last op ended (the simulator's recurrence), even
        # where the clock had moved on to a later bound on an input; every other op runs at the clock
        end = (self.free[s] if op == "W" else self.clock[s]) + dur
        self.free[s], self.clock[s] = end, max(self.clock[s], end)
        self.makespan = max(self.makespan, end)
        if op == "F":
            self.fend[s][j] = end
        elif op != "W":
            self.bend[s][j] = end
            if op == "I":
                self.pend[s].append(j)

    def wait_is_critical(self, s: int, wait: float) -> bool:
        """Would waiting ``wait`` make stage ``s`` the one with the largest projected span (``fill`` "span")
        or end (``"makespan"``: its first op's start + span; a stage not started yet from its clock)?"""
        if self.fill == "span":
            return self.span[s] + wait > max(self.span) + 1e-12
        ends = [(self.first[k] if self.ranks[k] else self.clock[k]) + self.span[k] for k in range(self.P)]
        return ends[s] + wait > max(ends) + 1e-12

    def run_w(self, s: int) -> None:
        j = self.pend[s].popleft()
        self.run(s, "W", j, self.W[s][j])

    def window_full(self, s: int) -> bool:
        return self.live[s] - len(self.pend[s]) >= self.k[s] or self.live[s] >= self.k[s] + self.defer[s]

    def next_op(self, s: int, j: int) -> tuple[str, bool]:
        """(the op stage ``s`` runs next for microbatch ``j``'s template slot, blocked by its window or cap?)."""
        act, wb, tr, cap, held = self.act[s][j], self.wb[s][j], self.tr[s][j], self.cap[s], self.held[s]
        if self.todo[s][0][0] == "F":
            return "F", self.window_full(s) or held + act + tr > cap
        op = "I" if self.split[s][j] else "B"
        extra = op_bytes(op, act, wb, tr)[1]
        if op == "I" and held + extra > cap and not self.pend[s]:
            op = "B"                                          # I would hold w > a past the cap: no split
            extra = op_bytes(op, act, wb, tr)[1]
        return op, held + extra > cap

    def advance(self, s: int, t: float) -> None:
        """One decision on stage ``s`` at time ``t``: run an op, a queued W, or wait for an input."""
        if not self.todo[s]:
            while self.pend[s]:                               # the template is done: the last W
                self.run_w(s)
            return
        j = self.todo[s][0][1]
        op, blocked = self.next_op(s, j)
        r, known = self.ready(s, op, j)
        pend = self.pend[s]
        if blocked and pend:
            self.run_w(s)                                     # frees an in-flight slot and bytes
        elif known and r <= t + 1e-12:
            self.todo[s].popleft()
            self.run(s, op, j, self.F[s][j] if op == "F" else self.I[s][j] if op == "I" else self.B[s][j])
        elif pend and t + self.W[s][pend[0]] <= r + 1e-12:
            self.run_w(s)                                     # fills the gap before the input arrives
        elif pend and self.fill is not None and self.ranks[s] and t == self.free[s] and self.wait_is_critical(s, r - t):
            self.run_w(s)                                     # a W past the arrival: this stage is critical
        elif r > t:
            if self.ranks[s]:
                self.span[s] += r - t
            self.clock[s] = r
        else:                                                 # known is False and r <= t: cannot happen
            raise RuntimeError(f"zero-bubble list scheduler stuck on stage {s} at t={t}")


def old_list_schedule(inp: ZBInputs, inflight: Sequence[int], caps: Sequence[float] | np.ndarray | None = None,
                  kind: str = "zb", backward_order: Sequence[int] | None = None,
                  w_defer: Sequence[int] | None = None, fill: str | None = None) -> tuple[Schedule, float]:
    """The order the list scheduler (module doc) emits and its makespan under ``inp``'s times;
    each stage's backwards in ``backward_order`` (slices of a sequence in reverse); ``fill``: None, or the
    objective (``FILL_OBJECTIVES``) by which a ``W`` may also fill a wait shorter than it (module doc, rule 4)."""
    P, m = inp.shape
    st = _OldListRun(inp, inflight, caps, backward_order, w_defer, fill)
    heap = [(0.0, -s) for s in range(P)]           # ties: the later stage first (backwards flow up)
    while heap:
        t, neg = heapq.heappop(heap)
        s = -neg
        done = not st.todo[s]
        st.advance(s, t)
        if not done:
            heapq.heappush(heap, (st.clock[s], -s))
    return Schedule([[Action(s, op, j) for op, j in acts] for s, acts in enumerate(st.ranks)], P, m, kind=kind), \
        st.makespan




def _random_inputs(seed: int, P: int, m: int, unit: bool, memory: bool) -> ZBInputs:
    """Random (or the paper's unit, tie-heavy) times, a random split mask and optionally bytes."""
    if unit:
        return ZBInputs.unit(P, m)
    rng = np.random.default_rng(seed)
    F = rng.uniform(0.5, 2.0, (P, m))
    B = F * rng.uniform(1.5, 2.5, (P, m))
    W = B * rng.uniform(0.3, 0.5, (P, m))
    I = B * (1.0 + rng.choice([0.0, 0.05])) - W  # noqa: E741
    split = rng.random((P, m)) < 0.8
    inp = ZBInputs(F, B, I, W, rng.uniform(0.0, 0.2, m), split)
    if memory:
        act = rng.uniform(1.0, 3.0, (P, m))
        inp = replace(inp, act=act, w=act * rng.uniform(0.2, 1.5, (P, m)), tr=rng.uniform(0.0, 0.5, (P, m)))
    return inp


@contextmanager
def _time_limit(seconds: float):
    """Fail (not hang) where a scheduler would loop: SIGALRM after ``seconds`` raises in the test's thread."""
    def expire(signum, frame):
        raise TimeoutError(f"list scheduler still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _grows_downstream(m: int, windows: Sequence[int]) -> bool:
    k = [max(1, min(m, w)) for w in windows]
    return any(a < b for a, b in zip(k, k[1:]))


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 6), st.integers(1, 14), st.booleans(), st.booleans(),
       st.sampled_from([None, "span", "makespan"]), st.sampled_from(["none", "all", "stage"]), st.booleans(),
       st.booleans())
def test_list_schedule_is_the_old_one(seed, P, m, unit, memory, fill, defer, permuted, planner_windows):
    """Every op's order on every stage and the makespan, bit for bit, over windows, caps, deferral, fills
    and backward orders. ``planner_windows``: windows that never grow downstream (``_inflight``'s, all the
    planner gives); else any: under some of those both schedulers looked forever for forwards that their
    upstream stage sends only after the wait (found with ``_time_limit``), which the new one now refuses."""
    rng = np.random.default_rng(seed + 1)
    inp = _random_inputs(seed, P, m, unit, memory)
    inflight = [P - s + int(rng.integers(0, P + 1)) for s in range(P)]
    if planner_windows:
        inflight.sort(reverse=True)
    caps = None
    if memory and not unit:
        caps = zerobubble.one_f_one_b_peaks(inp) * rng.uniform(1.0, 2.5)
    w_defer = {"none": None, "all": [m] * P, "stage": list(range(P))}[defer]
    order = rng.permutation(m).tolist() if permuted else None
    try:
        with _time_limit(10.0):
            new, t_new = list_schedule(inp, inflight, caps, backward_order=order, w_defer=w_defer, fill=fill)
    except ValueError as e:
        assert "deadlock" in str(e) and _grows_downstream(m, inflight)
        return
    with _time_limit(10.0):
        old, t_old = old_list_schedule(inp, inflight, caps, backward_order=order, w_defer=w_defer, fill=fill)
    assert [[(a.stage, a.op, a.mb) for a in r] for r in new.ranks] == \
        [[(a.stage, a.op, a.mb) for a in r] for r in old.ranks]
    assert t_new == t_old


def test_list_schedule_refuses_windows_that_deadlock():
    """The input the random comparison hung on (both schedulers): stage 1's window 2, stage 2's 4 -- stage 2
    waits for forward 2 before its first backward, stage 1 sends it only after its own first backward."""
    rng = np.random.default_rng(752401869)
    inp = _random_inputs(752401868, 3, 10, True, False)
    assert [3 - s + int(rng.integers(0, 4)) for s in range(3)] == [6, 2, 4]
    with _time_limit(10.0), pytest.raises(ValueError, match=r"windows \[6, 2, 4\] deadlock: stage 2 runs 4 forwards"):
        list_schedule(inp, [6, 2, 4], fill="span")
    with _time_limit(10.0):                    # growing downstream is fine where the order needs no wait
        sched, _ = list_schedule(inp, [3, 3, 4], backward_order=list(range(9, -1, -1)))
    assert len(sched.ranks[2]) == 3 * 10


# --------------------------------------------------------------------------- the GPU model's remembered lookups
def test_gpu_stage_costs_remembered_are_the_computed(monkeypatch):
    cfg = dynmb.model_config("llama2-7b")
    cm = GPUCostModel(cfg, 4)
    rows, lens = np.array([1, 2, 4, 1]), np.array([4096, 1024, 512, 100])
    attn = rows * lens * lens * 0.5
    got = cm.stage_costs(rows, lens, attn, ops=("F", "B", "I", "W"), recompute=np.array([0, 1, 0, 0], bool))
    again = cm.stage_costs(rows.copy(), lens.copy(), attn.copy(), ops=("F", "B", "I", "W"),
                           recompute=np.array([0, 1, 0, 0], bool))
    monkeypatch.setattr(GPUCostModel, "COSTS_REMEMBERED", 0)
    fresh = cm.stage_costs(rows, lens, attn, ops=("F", "B", "I", "W"), recompute=np.array([0, 1, 0, 0], bool))
    for op in fresh:
        assert got[op].tobytes() == fresh[op].tobytes() and again[op] is got[op]
        assert not got[op].flags.writeable and fresh[op].flags.writeable
    with pytest.raises(ValueError):
        got["F"][0, 0] = 1.0


def test_gpu_stage_costs_remembered_apart_per_calibration_and_input(monkeypatch):
    """A copy with another overhead, scale or receive latency shares the memory but not the answers; a
    different dtype or shape is another lookup; the memory is bounded."""
    cfg = dynmb.model_config("llama2-7b")
    cm = GPUCostModel(cfg, 2)
    base = cm.stage_costs([2], [512])["F"]
    over = cm.with_overhead(F=1.0).stage_costs([2], [512])["F"]
    scaled = cm.with_scale({"F": [2.0, 2.0]}).stage_costs([2], [512])["F"]
    late = cm.with_recv_latency(0.5).stage_costs([2], [512])["F"]
    assert np.allclose(over, base + 1.0) and np.allclose(scaled, 2 * base) and late[1, 0] == pytest.approx(base[1, 0] + 0.5)
    assert cm.stage_costs([2, 2], [512, 512])["F"].shape == (2, 2)
    assert cm.stage_costs(np.array([2.0]), np.array([512.0]))["F"].tobytes() == base.tobytes()
    monkeypatch.setattr(GPUCostModel, "COSTS_REMEMBERED", 3)
    for n in range(10):
        cm.stage_costs([1], [100 + n])
    assert len(cm._costs_seen) <= 3


# --------------------------------------------------------------------------- the layout's pieces, remembered
def _old_stage_pieces(cfg: ModelConfig, num_stages: int) -> list[list[HalfPiece]]:
    out = []
    for r in cfg.stage_units(num_stages):
        pieces: list[HalfPiece] = []
        u = r.start
        while u < r.stop:
            end = min((u // SUB_CHUNKS + 1) * SUB_CHUNKS, r.stop)
            pieces.append(HalfPiece(u // UNITS_PER_LAYER, PARTS[(u // SUB_CHUNKS) % 2],
                                    range(u % SUB_CHUNKS, u % SUB_CHUNKS + end - u)))
            u = end
        out.append(pieces)
    return out


def _old_stage_parts(cfg: ModelConfig, num_stages: int) -> list[tuple[float, float]]:
    out = []
    for pieces in _old_stage_pieces(cfg, num_stages):
        n = {p: 0 for p in PARTS}
        for piece in pieces:
            n[piece.part] += len(piece.chunks)
        out.append((_count(n["attn"]), _count(n["mlp"])))
    return out


@pytest.mark.parametrize("split", [None, (2.5, 2, 2, 1.5), (2.75, 1.25, 2, 2)])
def test_stage_pieces_and_parts_are_the_plain_loops(split):
    cfg = replace(ModelConfig.preset("small"), n_layers=8)
    if split is not None:
        cfg = replace(cfg, layer_split=split)
    for P in ([4] if split else [1, 2, 3, 4, 8]):
        assert cfg.stage_pieces(P) == _old_stage_pieces(cfg, P)
        assert cfg.stage_parts(P) == _old_stage_parts(cfg, P)
        cfg.stage_pieces(P)[0].clear()                   # the caller's copy: the remembered one is untouched
        assert cfg.stage_pieces(P) == _old_stage_pieces(cfg, P)
    assert model_sizes._pieces_of.cache_info().hits > 0


# --------------------------------------------------------------------------- whole planned steps, before and after
def _bits(value: object) -> object:
    """``value`` compared bit for bit: numbers as their bytes, a table column by column, a dict per key."""
    if isinstance(value, pd.DataFrame):
        return [(c, str(value[c].dtype), _bits(value[c].to_numpy())) for c in value.columns]
    if isinstance(value, dict):
        return {k: _bits(v) for k, v in value.items()}
    if isinstance(value, np.ndarray) and value.dtype != object:
        return (str(value.dtype), value.shape, value.tobytes())
    if isinstance(value, np.ndarray):
        return [_bits(v) for v in value.tolist()]
    return repr(value)        # repr of a float round-trips exactly


_batched_prefetch = reorder.OrderEvaluator.prefetch


def _old_prefetch(self: reorder.OrderEvaluator, orders, limit: int) -> None:
    """The reorder search before: no batched makespans where the peak of an order is needed."""
    if self.act is not None and not self._always_fits:
        return
    _batched_prefetch(self, orders, limit)


def _steps(cases, old: bool, monkeypatch) -> list:
    with monkeypatch.context() as mp:
        mp.setattr(zerobubble, "_H1", {})
        mp.setattr(zerobubble, "_ZB", {})
        mp.setattr(zerobubble, "_H1_UNIT", {})
        mp.setattr(makespan_zb, "_swept", makespan_zb.OrderedDict())
        mp.setattr(dynapipe, "_splits", dynapipe.OrderedDict())
        mp.setattr(zerobubble, "PUMPED", False)          # zb's pumped candidates came later (tests/test_zb_pump.py)
        if old:
            mp.setattr(zerobubble, "REMEMBERED", 0)
            mp.setattr(zerobubble, "list_schedule", old_list_schedule)
            mp.setattr(GPUCostModel, "COSTS_REMEMBERED", 0)
            mp.setattr(model_sizes.ModelSizes, "stage_pieces", _old_stage_pieces)
            mp.setattr(model_sizes.ModelSizes, "stage_parts", _old_stage_parts)
            mp.setattr(reorder.OrderEvaluator, "prefetch", _old_prefetch)
            mp.setattr(makespan_zb, "SINGLE_SWEEP", False)
            mp.setattr(makespan_zb, "REMEMBERED", 0)
            mp.setattr(dynapipe, "REMEMBERED", 0)
        cfg, lengths = dynmb.model_config("llama2-7b"), data.load_trace("sharegpt")
        out = []
        for P, schedule, limit, tokens, seed in cases:
            planner = dynmb.Planner(model=cfg, num_stages=P, memory_limit=limit, cost_model=GPUCostModel(cfg, P),
                                    schedule=schedule)
            rng = np.random.default_rng(seed)
            batch = np.minimum(lengths[rng.integers(len(lengths), size=tokens // 300)], 4096)
            step = planner.plan(batch, method="dynamic")
            timeless = replace(step.plan, predictions=step.plan.predictions.updated(plan_s=None))  # wall time
            out.append((repr(timeless), step.plan.schedule_kind,
                        [[(a.stage, a.op, a.mb) for a in r] for r in step.schedule.ranks],
                        {k: _bits(v) for k, v in vars(step.sim).items()}))
    return out


def test_planned_steps_are_the_old_ones(monkeypatch):
    """Plans, schedules (every op's order) and simulated timings with the speed-ups and with every old path."""
    cases = [(4, "auto", "80GiB", 40_000, 0), (4, "zb-h1", "40GiB", 30_000, 1)]
    assert _steps(cases, False, monkeypatch) == _steps(cases, True, monkeypatch)


@pytest.mark.slow
def test_planned_steps_are_the_old_ones_at_depth(monkeypatch):
    cases = [(8, "auto", "80GiB", 150_000, 2), (8, "zb", "40GiB", 100_000, 3), (16, "auto", "80GiB", 200_000, 4),
             (4, "1f1b", "80GiB", 60_000, 5)]
    assert _steps(cases, False, monkeypatch) == _steps(cases, True, monkeypatch)


# --------------------------------------------------------------------------- the reorder search's batched orders
@pytest.mark.parametrize("kind", ["1f1b", "zb-h1", "zb"])
def test_batched_orders_with_a_memory_limit_are_the_simulator(kind):
    """With a memory model whose limit some orders pass, neighbour orders' makespans are simulated in batches
    (their peaks per order): every verdict (makespan, peak, fits) equals the one-at-a-time evaluator's
    exactly, and the search returns the same order."""
    from dynmb.costmodel import AnalyticCostModel
    from dynmb.costmodel.loader import Models
    from dynmb.memory.model import MemoryModel
    from dynmb.packing import pack
    from dynmb.core.planspec import PlanSpec
    ro = reorder

    tiny = ModelConfig.preset("tiny")
    mm, cm = MemoryModel.analytic(tiny, 4), AnalyticCostModel(tiny, 4)
    lengths = np.random.default_rng(11).integers(8, 700, 48)
    spec = PlanSpec(method="dynamic", num_stages=4, schedule_kind=kind, memory_limit_bytes=int(mm.state_bytes.max() * 6))
    plan = pack(lengths, spec, models=Models(cm, mm))
    perms = [np.random.default_rng(s).permutation(plan.num_microbatches).tolist() for s in range(12)]
    peaks = [ro.OrderEvaluator(plan, Models(cm, mm), kind).peak(p).max() for p in perms]
    limit = float(np.median(peaks))                                  # half the orders fit, half do not
    plan = replace(plan, memory_limit_bytes=int(limit))
    batched, single = (ro.OrderEvaluator(plan, Models(cm, mm), kind) for _ in range(2))
    single.prefetch = lambda orders, limit: None                     # one at a time
    assert not batched._always_fits
    batched.prefetch(perms, len(perms))
    assert len(batched._pre) == len(perms)
    got = [batched(p) for p in perms]
    assert got == [single(p) for p in perms] and {ok for _, _, ok in got} == {True, False}
    fresh = ro.OrderEvaluator(plan, Models(cm, mm), kind)
    fresh.prefetch = lambda orders, limit: None
    assert ro.reorder_order(plan, "search", models=Models(cm, mm), schedule_kind=kind, max_evals=80) == \
        ro.reorder_order(plan, "search", models=Models(cm, mm), schedule_kind=kind, max_evals=80, evaluator=fresh)


# --------------------------------------------------------------------------- zb's schedules, remembered
def test_zb_remembered_is_built_afresh(monkeypatch):
    """The same inputs give the remembered schedule; another limit, state or judge is another one; the
    memory is bounded; with ``REMEMBERED`` 0 nothing is kept."""
    P, m = 4, 10
    inp = _random_inputs(5, P, m, False, True)
    calls = []

    def evaluate(sched: Schedule) -> tuple[float, np.ndarray]:
        calls.append(1)
        return float(len(sched.ranks[0])), np.zeros(P)
    evaluate.judge = ("test", 0)                                     # type: ignore[attr-defined]
    monkeypatch.setattr(zerobubble, "_ZB", {})
    monkeypatch.setattr(zerobubble, "_H1", {})
    caps = [50.0] * P
    first = zerobubble.zb_limit_aware(P, m, inp, caps, 60.0, evaluate, state_bytes=np.full(P, 10.0))
    n = len(calls)
    assert zerobubble.zb_limit_aware(P, m, inp, list(caps), 60.0, evaluate, state_bytes=np.full(P, 10.0)) is first
    assert len(calls) == n                                           # nothing built or judged again
    zerobubble.zb_limit_aware(P, m, inp, caps, 61.0, evaluate, state_bytes=np.full(P, 10.0))
    zerobubble.zb_limit_aware(P, m, inp, caps, 60.0, evaluate, state_bytes=np.full(P, 9.0))
    assert len(zerobubble._ZB) == 3 and len(calls) > n
    monkeypatch.setattr(zerobubble, "REMEMBERED", 0)
    n = len(calls)
    again = zerobubble.zb_limit_aware(P, m, inp, caps, 60.0, evaluate, state_bytes=np.full(P, 10.0))
    assert again is not first and again.ranks == first.ranks and len(calls) > n
    monkeypatch.setattr(zerobubble, "REMEMBERED", 2)
    zerobubble._remember(zerobubble._ZB, b"x", first)
    assert len(zerobubble._ZB) == 2


def test_unit_zb_h1_remembered_is_built_afresh(monkeypatch):
    """ZB-H1 on unit times (the reorder search's shape) is kept per (P, m) only: costed inputs, a backward order or
    a judge build afresh; the kept one equals one built with ``REMEMBERED`` 0."""
    monkeypatch.setattr(zerobubble, "_H1_UNIT", {})
    first = zerobubble.zb_h1(4, 9)
    assert zerobubble.zb_h1(4, 9) is first and zerobubble.zb_h1(4, 8) is not first
    assert zerobubble.zb_h1(4, 9, backward_order=list(range(8, -1, -1))) is not zerobubble.zb_h1(
        4, 9, backward_order=list(range(8, -1, -1)))
    assert len(zerobubble._H1_UNIT) == 2
    monkeypatch.setattr(zerobubble, "REMEMBERED", 0)
    fresh = zerobubble.zb_h1(4, 9)
    assert fresh is not first and fresh.ranks == first.ranks and fresh.kind == first.kind == "zb-h1"


# --------------------------------------------------------------------------- the zb estimate of one pipeline
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), P=st.integers(1, 16), m=st.integers(1, 90), unit=st.booleans(),
       shared=st.booleans(), estimate_as=st.sampled_from(["zb-h1", "zb"]))
def test_single_sweep_is_the_level_loop(seed, P, m, unit, shared, estimate_as):
    """``makespan_zb._single`` (one pipeline, op by op) gives the bits of ``_merged``'s level loop: random and equal
    (tied) costs, sends or none, the cost model's shares or the default split, both windows."""
    rng = np.random.default_rng(seed)
    F = np.ones((P, m)) if unit else rng.lognormal(0, 1, (P, m))
    B = 2 * F if unit else 2 * F * rng.uniform(0.5, 1.5, (P, m))
    comm = np.zeros(m) if unit else rng.uniform(0, 0.1, m)
    shares = rng.uniform(0.2, 0.9, (2, P)) if shared else None
    I, W = makespan_zb.split_backward(B, shares)  # noqa: E741
    win = makespan_zb.windows(P, estimate_as)
    want = makespan_zb._merged(F, I, W, comm, np.array([m]), win)
    assert [makespan_zb._single(F, I, W, comm, win)] == want.tolist()


def test_zb_estimate_same_either_sweep(monkeypatch):
    """Through ``makespans``: lone pipelines past ``SCALAR_OPS`` (the ones ``_single`` takes), several at once, the
    same pipeline twice in one call and again in later calls (remembered), the same values with ``SINGLE_SWEEP``
    and ``REMEMBERED`` on and with both off."""
    from dynmb.timing.makespan import makespans
    monkeypatch.setattr(makespan_zb, "_swept", makespan_zb.OrderedDict())
    P = 16
    got: dict[bool, list] = {}
    for new in (True, False, True):
        monkeypatch.setattr(makespan_zb, "SINGLE_SWEEP", new)
        monkeypatch.setattr(makespan_zb, "REMEMBERED", 4096 if new else 0)
        rng = np.random.default_rng(11)
        got[new] = []
        for sizes in ([136], [70], [40, 40], [5], [70, 136, 40], [136, 136]):
            F = rng.lognormal(0, 1, (P, sum(sizes)))
            B = 2 * F * rng.uniform(0.8, 1.2, F.shape)
            comm = rng.uniform(0, 0.05, sum(sizes))
            if sizes == [136, 136]:
                F[:, 136:], B[:, 136:], comm[136:] = F[:, :136], B[:, :136], comm[:136]
            for kind in ("zb-h1", "zb"):
                got[new].append(makespans(F, B, comm, sizes, kind).tolist())
    assert got[True] == got[False]
    assert 0 < len(makespan_zb._swept) <= 4096


def test_zb_remembered_bounded_and_keyed_by_every_input(monkeypatch):
    """Another F, backward, send, window or share is another value (each as computed afresh); at most
    ``REMEMBERED`` kept, the oldest dropped."""
    monkeypatch.setattr(makespan_zb, "_swept", makespan_zb.OrderedDict())
    rng = np.random.default_rng(3)
    P, m = 8, 140                                                    # past SCALAR_OPS: level-swept
    F = rng.lognormal(0, 1, (P, m))
    B, comm = 2 * F, rng.uniform(0, 0.05, m)
    shares = rng.uniform(0.2, 0.9, (2, P))
    F2, B2, comm2 = F.copy(), B.copy(), comm.copy()
    F2[:, 5:9] *= 3.0
    B2[:, 0] *= 3.0
    comm2 += 0.1
    cases = [(F, B, comm, None, "zb-h1"), (F2, B, comm, None, "zb-h1"), (F, B2, comm, None, "zb-h1"),
             (F, B, comm2, None, "zb-h1"), (F, B, comm, None, "zb"), (F, B, comm, shares, "zb-h1")]

    def run(remembered: int) -> list[float]:
        monkeypatch.setattr(makespan_zb, "REMEMBERED", remembered)
        return [float(makespan_zb.zb_recurrence(f, b, c, np.array([m]), s, e)[0]) for f, b, c, s, e in cases]
    fresh = run(0)
    assert len(set(fresh)) == len(fresh)                                     # every input does change it
    assert run(4096) == fresh and run(4096) == fresh                         # computed, then read back
    assert len(makespan_zb._swept) == len(cases)
    assert run(2) == fresh and len(makespan_zb._swept) == 2
