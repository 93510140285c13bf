"""Slices of long sequences (issue 15): prefix attention, plan invariants, schedule order,
exact gradients against the whole document, the split planner, and real gloo runs."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst
import torch.nn.functional as F

import dynmb.models.prefix as prefix_mod
from dynmb.core.config import ModelConfig, PipelineConfig, RunConfig, parse_bytes
from dynmb.costmodel import AnalyticCostModel
from dynmb.memory.model import MemoryModel
from dynmb.models import build_stages, make_inputs, reference_grads, synthetic_tokens, whole_documents
from dynmb.packing import PackingError
from dynmb.planning import make_schedule
from dynmb.planning.planner import plan_step
from dynmb.models.prefix import PrefixStore, SliceOrderError, prefix_attention
from dynmb.io.results import load_results
from dynmb.runtime.spec import RunSpec
from dynmb.runtime.splitbackward import backward_input, backward_weight, record_linears
from dynmb.schedule import ScheduleError, get_kind, validate
from dynmb.schedule.kinds import slice_kinds
from dynmb.schedule.validate import check_slice_order
from dynmb.timing.simulate import simulate
from dynmb.core.types import Action, Microbatch, Plan, PlanError, Schedule
from dynmb.core.planspec import PlanSpec
from tests.gloo_jobs import register
from dynmb.costmodel.loader import Models

TINY = ModelConfig.preset("tiny")


# --------------------------------------------------------------------------
# prefix attention: exact against causal SDPA over the whole sequence
# --------------------------------------------------------------------------
@pytest.mark.parametrize("pieces,block", [((20, 30), 64), ((7,), 1 << 20), ((), 256), ((64, 1, 33), 96)])
@pytest.mark.parametrize("fused", [True, False])
def test_prefix_attention_matches_causal_sdpa(monkeypatch, pieces, block, fused):
    """Both kernels: the fused CPU flash kernel per part, and the plain-torch key blocks."""
    monkeypatch.setattr(prefix_mod, "KEY_BLOCK_ELEMENTS", block)
    if not fused:
        monkeypatch.setattr(prefix_mod, "_FLASH_CPU", None)
    g = torch.Generator().manual_seed(0)
    h, n, dh = 3, 37, 8
    p = sum(pieces)
    q, k, v = (torch.randn(h, p + n, dh, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, p:]
    cuts = np.cumsum((0,) + pieces)
    out = prefix_attention(q[:, p:], k[:, p:], v[:, p:], [k[:, a:b] for a, b in zip(cuts, cuts[1:])],
                           [v[:, a:b] for a, b in zip(cuts, cuts[1:])])
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    d_out = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), d_out), torch.autograd.grad(ref, (q, k, v), d_out)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------
# plan invariants
# --------------------------------------------------------------------------
def _sliced_plan(splits=(100, 120, 80), neighbours="padded", recompute=False) -> tuple[Plan, np.ndarray]:
    """Sequence 0 (sum(splits) tokens) in len(splits) slices, one per microbatch, each beside
    short sequences: in rows of their own (``padded``) or packed into the slice's row."""
    n = len(splits)
    lengths = np.array([sum(splits)] + [17 + 5 * i for i in range(2 * n)], dtype=np.int64)
    mbs, off = [], 0
    for j, s in enumerate(splits):
        a, b = 1 + 2 * j, 2 + 2 * j
        cont = [j < n - 1, False, False]
        if neighbours == "padded":
            mb = Microbatch([0, a, b], [s, lengths[a], lengths[b]], max(s, lengths[b]), 3, offsets=[off, 0, 0],
                            continued=cont, recompute=recompute)
        else:   # the slice shares its row with one short sequence; another row holds the other
            mb = Microbatch([a, 0, b], [lengths[a], s, lengths[b]], max(s + lengths[a], lengths[b]), 2, row_ids=[0, 0, 1],
                            offsets=[0, off, 0], continued=[False, j < n - 1, False], recompute=recompute)
        mbs.append(mb)
        off += s
    plan = Plan(tuple(mbs), "dynamic", 2, 1 << 30, len(lengths))
    plan.validate(lengths)
    return plan, lengths


def test_plan_validates_slice_chains():
    plan, lengths = _sliced_plan()
    assert plan.slice_groups() == {0: (0, 1, 2)}
    assert plan.real_tokens == lengths.sum()
    assert Plan.from_json(plan.to_json()).digest() == plan.digest()
    mbs = list(plan.microbatches)
    bad_gap = replace(mbs[1], offsets=np.array([101, 0, 0]))
    with pytest.raises(PlanError, match="starts at token 101, expected 100"):
        replace(plan, microbatches=(mbs[0], bad_gap, mbs[2])).validate(lengths)
    with pytest.raises(PlanError, match="starts at token"):             # slices out of order
        replace(plan, microbatches=(mbs[1], mbs[0], mbs[2])).validate(lengths)
    bad_cont = replace(mbs[2], continued=np.array([True, False, False]))
    with pytest.raises(PlanError, match="continued=True"):
        replace(plan, microbatches=(mbs[0], mbs[1], bad_cont)).validate(lengths)
    last_dropped = (mbs[0], replace(mbs[1], continued=np.zeros(3, bool)), Microbatch([5, 6], lengths[[5, 6]], 80, 2))
    with pytest.raises(PlanError, match="differ from the global batch"):     # the last slice missing
        replace(plan, microbatches=last_dropped).validate(lengths)
    with pytest.raises(PlanError, match="twice"):
        Microbatch([0, 0], [5, 5], 5, 2, offsets=[0, 5], continued=[True, False])


def test_plan_json_records_slices_as_token_ranges_and_a_digest(tmp_path):
    import json
    plan, lengths = _sliced_plan()
    d = plan.to_dict()
    assert d["digest"] == plan.digest()
    assert [m["slices"] for m in d["microbatches"]] == [[[0, 0, 100]], [[0, 100, 220]], [[0, 220, 300]]]
    back = Plan.from_dict(json.loads(json.dumps(d)))
    assert back.digest() == plan.digest()
    assert [mb.continued.tolist() for mb in back.microbatches] == [mb.continued.tolist() for mb in plan.microbatches]
    path = tmp_path / "p.json"
    plan.save(path)
    assert Plan.load(path).digest() == plan.digest()
    d["microbatches"][2]["padded_len"] += 8            # still a valid plan, but not the one written
    path.write_text(json.dumps(d))
    with pytest.raises(PlanError, match="edited after it was written"):
        Plan.load(path)


def test_backward_order_reverses_each_chain():
    plan, _ = _sliced_plan()
    short = Microbatch([7], [3], 3, 1)
    p = Plan(plan.microbatches + (short,), "dynamic", 2, 1 << 30, 8, meta={})
    assert p.backward_order() == [2, 1, 0, 3]
    assert Plan((short,), "dynamic", 2, 1 << 30, 8).backward_order() == [0]


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages", [2, 4])
def test_schedules_run_slices_in_order_and_violations_are_refused(kind, stages):
    rng = np.random.default_rng(stages)
    for trial in range(20):
        m = int(rng.integers(3, 10))
        chain = sorted(rng.choice(m, size=int(rng.integers(2, min(m, 5) + 1)), replace=False).tolist())
        mbs, short = [], 1
        for i in range(m):
            if i in chain:
                j = chain.index(i)
                mbs.append(Microbatch([0], [10], 10, 1, offsets=[10 * j], continued=[j < len(chain) - 1]))
            else:
                mbs.append(Microbatch([short], [5], 5, 1))
                short += 1
        plan = Plan(tuple(mbs), "dynamic", stages, 1 << 30, short)
        plan.validate()
        sched = make_schedule(plan, kind)          # validates: complete, deadlock-free, slice order
        validate(sched, plan)
    # a plain 1F1B order runs slice 0's backward first: refused
    with pytest.raises(ScheduleError, match="reverse order"):
        validate(make_schedule(replace(plan, microbatches=tuple(Microbatch([i], [5], 5, 1) for i in range(m)),
                                       num_sequences=m), kind), plan)
    with pytest.raises(ValueError, match="'memory-aware' .*does not run their backwards in reverse"):
        make_schedule(plan, "memory-aware", models=Models(AnalyticCostModel(TINY, stages),
                                                          MemoryModel.analytic(TINY, stages)))


DEEP = replace(TINY, name="tiny-12", n_layers=12)       # up to 12 stages: interleaved with 2 chunks on 6 ranks


@hst.composite
def slice_chains(draw):
    """A plan of 2..10 single-row microbatches, each a slice of one of one or two long sequences
    or a short sequence, on 2..6 pipeline ranks."""
    ranks = draw(hst.integers(2, 6))
    m = draw(hst.integers(2, 10))
    owner = draw(hst.lists(hst.sampled_from([0, 0, 1, -1]), min_size=m, max_size=m))
    if owner.count(0) < 2:
        owner[:2] = [0, 0]
    last = {c: max(i for i, o in enumerate(owner) if o == c) for c in (0, 1) if c in owner}
    mbs, offset, short = [], {0: 0, 1: 0}, 2
    for i, o in enumerate(owner):
        n = draw(hst.sampled_from([16, 48, 100, 256]))
        if o < 0:
            mbs.append(Microbatch([short], [n], n, 1))
            short += 1
        else:
            mbs.append(Microbatch([o], [n], n, 1, offsets=[offset[o]], continued=[i < last[o]]))
            offset[o] += n
    if 1 not in owner:                                   # sequence 1 is not in the batch: a 1-token stand-in
        mbs.append(Microbatch([1], [1], 1, 1))
    return Plan(tuple(mbs), "dynamic", ranks, 1 << 40, short)


def _break_slice_order(sched: Schedule, plan: Plan) -> Schedule:
    """``sched`` with the backwards (B or I) of a chain's last two slices swapped on its first rank."""
    where = next(iter(plan.slice_groups().values()))
    early, late = where[-2], where[-1]
    acts = list(sched.ranks[0])
    stage = acts[0].stage
    i = next(k for k, a in enumerate(acts) if a.stage == stage and a.op in "BI" and a.mb == late)
    j = next(k for k, a in enumerate(acts) if a.stage == stage and a.op in "BI" and a.mb == early)
    acts[i], acts[j] = acts[j], acts[i]
    return Schedule((tuple(acts),) + tuple(sched.ranks[1:]), sched.num_stages, sched.num_microbatches)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(slice_chains())
def test_every_slice_kind_schedules_random_chains_above_the_bound(plan):
    """Every kind with ``slices`` (interleaved with 2 chunks per rank) validates on random chains,
    slice order included, never simulates below its dependency bound, and refuses its own schedule
    with one chain's last two backwards swapped (validator and simulator)."""
    plan.validate()
    assert set(slice_kinds()) >= {"gpipe", "1f1b", "interleaved", "zb-h1", "zb"}
    for kind in slice_kinds():
        virtual = 2 if get_kind(kind).virtual_stages else 1
        p = replace(plan, num_stages=plan.num_stages * virtual, schedule_kind=kind)
        cm, mm = AnalyticCostModel(DEEP, p.num_stages), MemoryModel.analytic(DEEP, p.num_stages)
        sched = make_schedule(p, kind, virtual=virtual, models=Models(cm, mm))
        validate(sched, p)
        sim = simulate(sched, p, cm, mm)
        assert sim.makespan_s >= sim.bound_s * (1 - 1e-12), kind
        bad = _break_slice_order(sched, p)
        with pytest.raises(ScheduleError, match="reverse order"):
            check_slice_order(bad, p)
        with pytest.raises(ScheduleError):
            simulate(bad, p, cm, mm)


def test_forward_out_of_slice_order_is_refused():
    plan, _ = _sliced_plan((10, 10))
    bad = Schedule(((Action(0, "F", 1), Action(0, "F", 0), Action(0, "B", 1), Action(0, "B", 0)),), 1, 2)
    with pytest.raises(ScheduleError, match="goes forward before"):
        validate(bad, replace(plan, num_stages=1))


# --------------------------------------------------------------------------
# exact gradients in one process: every stage, slices in 2..8 microbatches
# --------------------------------------------------------------------------
def _run_local(plan: Plan, tokens, cfg: ModelConfig, num_stages: int, dtype, order=None, split=False, w_late=True):
    """Run ``plan`` through ``num_stages`` stages in one process the way the runtime does:
    forwards in plan order, backwards in ``order`` (default ``plan.backward_order()``), extra
    backward roots and releases from one PrefixStore. ``split``: every backward of a microbatch
    that is not recomputed is an ``I`` (``backward_input`` with the store's roots and the leaves
    it read), its ``W`` at the very end (``w_late``) or right after the next microbatch's ``I``.
    Returns the stages."""
    stages = build_stages(cfg, num_stages, 0, dtype=dtype)
    store, total, saved, tapes = PrefixStore(), plan.real_tokens, [], []
    for i, mb in enumerate(plan.microbatches):
        inp = replace(make_inputs(mb, tokens, cfg=cfg), prefix=store, microbatch=i)
        xs, x, tp = [], None, []
        for st in stages:
            if x is not None:
                x = x.detach().requires_grad_(True)
            xs.append(x)
            with (record_linears(st) if split and not mb.recompute else nullcontext()) as tape:
                x = st(x, inp, recompute=mb.recompute)
            tp.append(tape)
            xs.append(x)
        saved.append(xs)
        tapes.append(tp)
    pending: list = []
    for i in (plan.backward_order() if order is None else order):
        xs = saved[i]
        grad = None
        for s in reversed(range(num_stages)):
            x_in, out = xs[2 * s], xs[2 * s + 1]
            if s == num_stages - 1:
                out, grad = out / total, None
            layers = list(stages[s].layers)
            roots = store.backward_roots(layers, i)
            if tapes[i][s] is not None:
                g = backward_input(stages[s], out, grad, x_in, tapes[i][s], roots, store.read_leaves(layers, i))
                pending.append(tapes[i][s])
            else:
                g0 = torch.ones_like(out) if grad is None else grad
                torch.autograd.backward([out, *(t for t, _ in roots)], [g0, *(g for _, g in roots)])
                g = None if x_in is None else x_in.grad
            store.release(layers, i)
            grad = g
        while not w_late and len(pending) > num_stages:
            backward_weight(pending.pop(0))
    for tape in pending:
        backward_weight(tape)
    assert len(store) == 0
    return stages


@pytest.mark.parametrize("splits,neighbours,recompute", [((150, 150), "padded", False), ((150, 150), "packed", True),
                                                        ((40, 90, 60, 10), "packed", False),
                                                        ((40, 90, 60, 10), "padded", True),
                                                        ((25,) * 8, "padded", False), ((25,) * 8, "packed", True)])
def test_sliced_document_gradients_equal_whole_document(splits, neighbours, recompute):
    plan, lengths = _sliced_plan(splits, neighbours, recompute)
    tokens = synthetic_tokens(lengths, TINY.vocab_size, seed=3)
    stages = _run_local(plan, tokens, TINY, 2, torch.float32)
    assert len(whole_documents(plan)) == len(splits) + 1
    _, ref = reference_grads(TINY, 2, plan, tokens, 0, dtype=torch.float32)
    for st in stages:
        for name, p in st.named_parameters():
            err = float((p.grad - ref[name]).abs().max())
            assert err <= 1e-5 * float(ref[name].abs().max()) + 1e-9, (name, err)


@pytest.mark.parametrize("splits,neighbours,recompute,w_late", [((150, 150), "padded", False, True),
                                                               ((40, 90, 60, 10), "packed", False, False),
                                                               ((25,) * 8, "padded", False, True),
                                                               ((40, 90, 60, 10), "padded", True, False)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_split_backward_of_slices_equals_whole_document(splits, neighbours, recompute, w_late, dtype):
    """I/W with prefix-attention slices: each I adds its continued slices' key/value gradients as
    roots and accumulates the earlier slices' leaves it read; W any time after (fails without
    ``read_leaves``: the earlier slices' keys then get no gradient from later slices)."""
    plan, lengths = _sliced_plan(splits, neighbours, recompute)
    tokens = synthetic_tokens(lengths, TINY.vocab_size, seed=5)
    stages = _run_local(plan, tokens, TINY, 2, dtype, split=True, w_late=w_late)
    _, ref = reference_grads(TINY, 2, plan, tokens, 0, dtype=dtype)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for st in stages:
        for name, p in st.named_parameters():
            err = float((p.grad - ref[name]).abs().max())
            assert err <= tol * float(ref[name].abs().max()) + 1e-12, (name, err)


def test_split_backward_of_llama_slices_equals_whole_document():
    """The same with grouped-query K/V and rotary positions (llama-tiny), fp64."""
    cfg = ModelConfig.preset("llama-tiny")
    plan, lengths = _sliced_plan((40, 90, 60, 10), "packed", False)
    tokens = synthetic_tokens(lengths, cfg.vocab_size, seed=5)
    stages = _run_local(plan, tokens, cfg, 2, torch.float64, split=True, w_late=False)
    _, ref = reference_grads(cfg, 2, plan, tokens, 0, dtype=torch.float64)
    for st in stages:
        for name, p in st.named_parameters():
            assert float((p.grad - ref[name]).abs().max()) <= 1e-10 * float(ref[name].abs().max()) + 1e-12, name


def test_backward_before_a_later_slice_is_refused():
    plan, lengths = _sliced_plan((30, 30, 30))
    tokens = synthetic_tokens(lengths, TINY.vocab_size, seed=1)
    with pytest.raises(SliceOrderError, match="reverse"):
        _run_local(plan, tokens, TINY, 2, torch.float32, order=[0, 1, 2])


def test_forward_before_an_earlier_slice_is_refused():
    plan, lengths = _sliced_plan((30, 30))
    tokens = synthetic_tokens(lengths, TINY.vocab_size, seed=1)
    stage = build_stages(TINY, 1, 0)[0]
    with pytest.raises(SliceOrderError, match="forward in order"):
        stage(None, replace(make_inputs(plan.microbatches[1], tokens, cfg=TINY), prefix=PrefixStore(), microbatch=1))


# --------------------------------------------------------------------------
# planning: every token planned, within the limit
# --------------------------------------------------------------------------
LONG_BATCH = np.array([40, 100, 2400, 70, 300, 25, 90, 150], dtype=np.int64)
TEN_X_BATCH = np.array([40, 100, 4000, 70, 300, 25, 90, 150], dtype=np.int64)   # 10x the longest row at P=4, 12MiB


def test_split_plans_a_sequence_ten_times_the_longest_row():
    limit_bytes = parse_bytes("12MiB")
    plan, sched, _ = plan_step(TEN_X_BATCH, PlanSpec(method="dynamic", num_stages=4, memory_limit_bytes=limit_bytes,
                                                     oversize="split", recompute="auto"), model_cfg=TINY)
    assert TEN_X_BATCH.max() >= 10 * plan.meta["longest_fitting_length"]
    assert plan.real_tokens == TEN_X_BATCH.sum() and max(plan.predictions["pred_peak_bytes"]) <= limit_bytes
    validate(sched, plan)


@pytest.mark.parametrize("method,stages,limit", [("dynamic", 2, "16MiB"), ("fixed", 2, "16MiB"),
                                                 ("dynamic", 4, "12MiB"), ("packed", 4, "16MiB")])
def test_split_plans_every_token_under_the_limit(method, stages, limit):
    limit_bytes = parse_bytes(limit)
    plan, sched, sim = plan_step(LONG_BATCH, PlanSpec(method=method, num_stages=stages, memory_limit_bytes=limit_bytes,
                                                      oversize="split", recompute="auto"), model_cfg=TINY)
    plan.validate(LONG_BATCH)
    assert plan.real_tokens == LONG_BATCH.sum()                 # every token planned
    assert 2 in plan.slice_groups() and len(plan.slice_groups()[2]) >= 2
    assert max(plan.predictions["pred_peak_bytes"]) <= limit_bytes
    assert LONG_BATCH.max() >= 3.5 * plan.meta["longest_fitting_length"]
    validate(sched, plan)
    # the memory model charges each continued slice's keys/values (and their gradients)
    mm = MemoryModel.analytic(TINY, stages)
    assert (mm.slice_coef(True) == mm.slice_grad_coef()).all() and (mm.slice_coef(False) == 0).all()


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1"])
def test_split_fills_slice_rows_with_short_sequences_when_predicted_faster(monkeypatch, kind):
    """Short sequences packed into the rows of slices shorter than the longest row: chosen here
    because the simulator predicts a shorter step than every plan without it (fails without
    ``_fill``: no row then holds a slice beside another sequence)."""
    import dynmb.planning.slicing as slicing

    def plan():
        return plan_step(LONG_BATCH, PlanSpec(method="dynamic", num_stages=2, schedule_kind=kind,
                                              memory_limit_bytes=parse_bytes("16MiB"), oversize="split",
                                              recompute="auto"), model_cfg=TINY)

    filled, sched, sim = plan()
    filled.validate(LONG_BATCH)
    validate(sched, filled)
    assert filled.meta["slice_fill"] and filled.real_tokens == LONG_BATCH.sum()
    rows = [mb for mb in filled.microbatches if mb.has_slices and mb.num_seqs > 1]
    assert rows and all(mb.batch == 1 and mb.padded_len <= filled.meta["longest_fitting_length"] for mb in rows)
    assert max(filled.predictions["pred_peak_bytes"]) <= parse_bytes("16MiB")
    monkeypatch.setattr(slicing, "_fill", lambda chains, short_ids, *a: (chains, short_ids))
    plain, _, plain_sim = plan()
    assert not plain.meta["slice_fill"]
    assert sim.makespan_s < plain_sim.makespan_s


def test_a_packed_split_plan_records_its_row_length():
    """Issue 25: the ``steps``/``runs`` ``pack_len`` of a packed plan with slices is its row length
    (was None: ``plan_split`` did not record it); other methods record none."""
    packed, _, _ = plan_step(LONG_BATCH, PlanSpec(method="packed", num_stages=2,
                                                  memory_limit_bytes=parse_bytes("16MiB"), oversize="split",
                                                  recompute="auto"), model_cfg=TINY)
    assert packed.meta["sliced"] and packed.meta["pack_len"] == packed.meta["longest_fitting_length"] > 0
    assert max(mb.padded_len for mb in packed.microbatches) <= packed.meta["pack_len"]
    dynamic, _, _ = plan_step(LONG_BATCH, PlanSpec(method="dynamic", num_stages=2,
                                                   memory_limit_bytes=parse_bytes("16MiB"), oversize="split",
                                                   recompute="auto"), model_cfg=TINY)
    assert dynamic.meta["pack_len"] is None


def test_split_that_cannot_fit_names_the_sequence():
    with pytest.raises(PackingError, match=r"sequence 2 of 2400 tokens does not fit sliced.*--recompute auto"):
        plan_step(LONG_BATCH, PlanSpec(method="dynamic", num_stages=2, memory_limit_bytes=parse_bytes("16MiB"),
                                       oversize="split", recompute="never"), model_cfg=TINY)
    with pytest.raises(PackingError, match="max_seq_len"):
        plan_step(np.array([5000, 10]), PlanSpec(method="dynamic", num_stages=2,
                                                 memory_limit_bytes=parse_bytes("16MiB"), oversize="split",
                                                 recompute="auto"), model_cfg=TINY)


# --------------------------------------------------------------------------
# real gloo runs with --verify: 2 and 4 ranks
# --------------------------------------------------------------------------
def _split_case(out: Path, name: str, method: str, stages: int, limit: str, trace: Path, kind: str = "1f1b",
                virtual: int = 1) -> RunSpec:
    cfg = RunConfig(model=TINY, pipeline=PipelineConfig(num_stages=stages * virtual, virtual=virtual, schedule=kind,
                                                        memory_limit_bytes=parse_bytes(limit)),
                    dataset=str(trace), global_batch=8, method=method, seed=0, steps=1, warmup=0,
                    backend="gloo", device="cpu", timeout_s=90.0, oversize="split", recompute="auto")
    return RunSpec.create(cfg, out / name, verify=True, run_id=name)


def _plan_case(out: Path, name: str, plan: Plan, ranks: int, kind: str = "1f1b", virtual: int = 1,
               model: ModelConfig = TINY) -> RunSpec:
    path = out / f"{name}.json"
    replace(plan, num_stages=ranks * virtual, schedule_kind=kind).save(path)
    cfg = RunConfig(model=model, pipeline=PipelineConfig(num_stages=ranks * virtual, virtual=virtual, schedule=kind,
                                                         memory_limit_bytes=1 << 30),
                    dataset="gsm8k", global_batch=plan.num_sequences, method="dynamic", steps=1, warmup=0,
                    backend="gloo", device="cpu", timeout_s=90.0)
    return RunSpec.create(cfg, out / name, verify=True, run_id=name, plan=path)


RANK_CASES = {2: (LONG_BATCH, "16MiB"), 4: (TEN_X_BATCH, "12MiB")}
SPLIT_METHODS = {2: ("dynamic", "fixed"), 4: ("dynamic",)}
MADE_PLANS = {2: (("padded3", (100, 120, 80), "padded", False), ("packed4rc", (40, 90, 60, 10), "packed", True)),
              4: (("packed4rc", (40, 90, 60, 10), "packed", True), ("padded8", (25,) * 8, "padded", False))}


KIND_PLANS = {   # hand-made plans with slices on the other kinds: (name, splits, neighbours, recompute, kind, virtual)
    2: (("il-padded3", (100, 120, 80), "padded", False, "interleaved", 2),
        ("zbh1-packed4", (40, 90, 60, 10), "packed", False, "zb-h1", 1),
        ("zb-padded8", (25,) * 8, "padded", False, "zb", 1)),
    4: (("zbh1-padded8", (25,) * 8, "padded", False, "zb-h1", 1),
        ("zb-packed4", (40, 90, 60, 10), "packed", False, "zb", 1),
        ("il-packed4", (40, 90, 60, 10), "packed", False, "interleaved", 2)),
}
SPLIT_KINDS = {2: (("interleaved", 2),), 4: (("zb", 1),)}
"""The split planner's plan of the batch on these kinds too (``dynamic``)."""
TINY8 = replace(TINY, name="tiny-8", n_layers=8)         # 8 stages: interleaved with 2 chunks on 4 ranks


def _kind_cases(out: Path, ranks: int) -> list[RunSpec]:
    """Sliced documents on interleaved (2 chunks per rank), ZB-H1 and zb: hand-made plans (slices
    beside padded rows or packed with another document, no recomputation, so every slice runs a
    split backward I/W on the zero-bubble kinds) and the split planner's plan for those kinds."""
    batch, limit = RANK_CASES[ranks]
    trace = out / f"long{ranks}.csv"
    made = [_plan_case(out, f"slices-{name}", _sliced_plan(splits, neighbours, rc)[0], ranks, kind, virtual,
                       TINY8 if virtual * ranks > TINY.n_layers else TINY)
            for name, splits, neighbours, rc, kind, virtual in KIND_PLANS[ranks]]
    split = [_split_case(out, f"slices-split-{kind}", "dynamic", ranks, limit, trace, kind, virtual)
             for kind, virtual in SPLIT_KINDS[ranks]]
    return made + split


def _slice_cases(out: Path, ranks: int) -> list[RunSpec]:
    """The split planner's plans of a batch with a long sequence (on 4 ranks 10x the longest row
    that fits), and hand-made plans with slices beside padded rows or packed into a row with
    another document (3 or 4 slices on 2 ranks, 4 or 8 on 4; with and without recomputation) run
    by ``run --plan``; every case with ``--verify``."""
    batch, limit = RANK_CASES[ranks]
    trace = out / f"long{ranks}.csv"
    trace.write_text("length\n" + "\n".join(str(x) for x in batch) + "\n")
    split = [_split_case(out, f"slices-{m}-split", m, ranks, limit, trace) for m in SPLIT_METHODS[ranks]]
    made = [_plan_case(out, f"slices-{name}", _sliced_plan(splits, neighbours, rc)[0], ranks)
            for name, splits, neighbours, rc in MADE_PLANS[ranks]]
    return split + made + _kind_cases(out, ranks)


register(2)(lambda out: _slice_cases(out, 2))
register(4)(lambda out: _slice_cases(out, 4))


@pytest.mark.dist
@pytest.mark.parametrize("ranks", [2, 4])
def test_split_runs_verify_on_gloo(gloo_job, ranks):
    """Every token trained, gradients equal to running each document whole, measured peak
    within the limit; on 4 ranks the long sequence is 10x the longest row that fits."""
    job, batch = gloo_job(ranks), RANK_CASES[ranks][0]
    assert job.returncode == 0, job.errors
    for m in SPLIT_METHODS[ranks]:
        t = load_results(job.out / f"slices-{m}-split")
        assert t["steps"]["verified"].all()                      # gradients = whole documents in one pass
        assert (t["steps"]["real_tokens"] == batch.sum()).all()
        mem = t["memory"]
        assert (mem["peak_bytes"] <= mem["limit_bytes"]).all()


@pytest.mark.dist
@pytest.mark.parametrize("ranks", [2, 4])
def test_hand_made_sliced_plans_verify_on_gloo(gloo_job, ranks):
    job = gloo_job(ranks)
    assert job.returncode == 0, job.errors
    for name, *_ in MADE_PLANS[ranks]:
        assert load_results(job.out / f"slices-{name}")["steps"]["verified"].all(), name


def _zero_bubble_cases(out: Path, ranks: int):
    """The hand-made zero-bubble plans of ``KIND_PLANS[ranks]``: (name, plan, the schedule ``run --plan``
    builds for it with the run's models, the builder's inputs and judge)."""
    from dynmb.planning.zerobubble import zb_evaluator, zb_inputs

    for name, splits, neighbours, rc, kind, virtual in KIND_PLANS[ranks]:
        if kind == "interleaved":
            continue
        spec = _plan_case(out, f"slices-{name}", _sliced_plan(splits, neighbours, rc)[0], ranks, kind, virtual)
        plan, models = Plan.load(spec.plan), spec.models()
        inp = zb_inputs(plan, models)
        yield name, plan, make_schedule(plan, kind, virtual=virtual, models=models), inp, zb_evaluator(plan, models, inp)


def _check_zero_bubble_backwards(name: str, n: int, ops: dict[int, list[tuple[str, int]]]) -> None:
    """Every stage runs each of the ``n`` slices' backwards once, in reverse slice order, as a full ``B``
    or as an ``I`` whose ``W`` follows; at least one of them split (the split backward is exercised)."""
    for stage, seq in ops.items():
        backwards = [mb for op, mb in seq if op in ("I", "B")]
        assert backwards == list(reversed(range(n))), (name, stage, seq)
        i_mbs = [mb for op, mb in seq if op == "I"]
        assert i_mbs, (name, stage, seq)
        for j in i_mbs:
            assert seq.index(("W", j)) > seq.index(("I", j)), (name, stage, j)
        assert sorted(mb for op, mb in seq if op == "W") == sorted(i_mbs), (name, stage, seq)


@pytest.mark.filterwarnings("ignore::dynmb.planning.defaults.StandInModelWarning")
def test_zero_bubble_runs_a_slice_backward_whole_only_where_splitting_it_is_no_faster(tmp_path):
    """The schedules the gloo test runs: a slice's backward runs whole (``B``) only where its split
    costs more (I + W > B: the CPU cost model's split shares) and the same schedule with that ``B``
    split back (its ``I`` then at once its ``W``) is predicted no faster -- zb's ``_unsplit_adjacent``
    candidate, which its short-wait rule (Qi et al. 3.1) makes the fastest for zb-packed4 on 4 ranks
    (stage 0's last slice: its ``W`` would run right after its ``I``, and stage 0 sends no input gradient)."""
    for ranks in (2, 4):
        for name, plan, sched, inp, evaluate in _zero_bubble_cases(tmp_path, ranks):
            ops = {acts[0].stage: [(a.op, a.mb) for a in acts] for acts in sched.ranks}
            _check_zero_bubble_backwards(name, plan.num_microbatches, ops)
            t = evaluate(sched)[0]
            for r, acts in enumerate(sched.ranks):
                for k, a in enumerate(acts):
                    if a.op != "B":
                        continue
                    assert inp.I[a.stage, a.mb] + inp.W[a.stage, a.mb] > inp.B[a.stage, a.mb], (name, a)
                    split = acts[:k] + (Action(a.stage, "I", a.mb), Action(a.stage, "W", a.mb)) + acts[k + 1:]
                    resplit = replace(sched, ranks=sched.ranks[:r] + (split,) + sched.ranks[r + 1:])
                    validate(resplit, plan)
                    assert evaluate(resplit)[0] >= t - 1e-12, (name, a)


@pytest.mark.dist
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.filterwarnings("ignore::dynmb.planning.defaults.StandInModelWarning")
def test_slices_on_interleaved_and_zero_bubble_verify_on_gloo(gloo_job, ranks, tmp_path):
    """Gradients equal to running each document whole (fp32, the runtime's --verify: 1e-5
    relative) for sliced documents on interleaved, ZB-H1 and zb; on the zero-bubble kinds every
    stage runs exactly the schedule the builder makes for the plan: each slice's backward once, in
    reverse slice order, split (I, then later its W) except where the builder runs it whole because
    the split is predicted no faster (test_zero_bubble_runs_a_slice_backward_whole_only_where_...)."""
    job = gloo_job(ranks)
    assert job.returncode == 0, job.errors
    for name, _, _, _, kind, virtual in KIND_PLANS[ranks]:
        t = load_results(job.out / f"slices-{name}")
        assert t["steps"]["verified"].all(), name
        assert t["actions"]["stage"].nunique() == ranks * virtual, name
    for name, plan, sched, _, _ in _zero_bubble_cases(tmp_path, ranks):
        ran = {}
        for stage, rows in load_results(job.out / f"slices-{name}")["actions"].groupby("stage"):
            order = rows.sort_values("start_s")
            ran[int(stage)] = list(zip(order["op"], order["mb"].astype(int)))
        assert ran == {acts[0].stage: [(a.op, a.mb) for a in acts] for acts in sched.ranks}, name
        _check_zero_bubble_backwards(name, plan.num_microbatches, ran)
    for kind, _ in SPLIT_KINDS[ranks]:
        t = load_results(job.out / f"slices-split-{kind}")
        assert t["steps"]["verified"].all(), kind
        assert (t["steps"]["real_tokens"] == RANK_CASES[ranks][0].sum()).all()
        assert (t["memory"]["peak_bytes"] <= t["memory"]["limit_bytes"]).all(), kind


def test_cli_schedules_a_sliced_plan_in_slice_order_and_refuses_what_breaks_it(tmp_path, capsys):
    """`dynmb schedule` builds 1F1B and ZB-H1 with the chain's backwards (B, I) reversed;
    memory-aware and reordering are refused; `dynmb run --plan` refuses, before launching, a
    schedule that runs the slices' backwards in plain 1F1B order."""
    import json

    from dynmb.cli.main import main
    from dynmb.schedule import from_csv, one_f_one_b, to_csv

    trace = tmp_path / "long.csv"
    trace.write_text("length\n" + "\n".join(str(x) for x in LONG_BATCH) + "\n")
    common = ["--model", "tiny"]
    assert main(["plan", "--lengths", str(trace), "--global-batch", "8", "--memory-limit", "16MiB", "--oversize",
                 "split", "--recompute", "auto", *common, "-o", str(tmp_path / "p.json")]) == 0
    assert main(["schedule", "--plan", str(tmp_path / "p.json"), "--kind", "1f1b", *common,
                 "-o", str(tmp_path / "s.csv")]) == 0
    plan = Plan.load(tmp_path / "s.plan.json")
    validate(from_csv(tmp_path / "s.csv", num_microbatches=plan.num_microbatches), plan)
    capsys.readouterr()
    assert main(["schedule", "--plan", str(tmp_path / "p.json"), "--kind", "zb-h1", *common,
                 "-o", str(tmp_path / "z.csv")]) == 0
    validate(from_csv(tmp_path / "z.csv", num_microbatches=plan.num_microbatches), plan)   # slices reversed
    capsys.readouterr()
    assert main(["schedule", "--plan", str(tmp_path / "p.json"), "--kind", "memory-aware", *common,
                 "-o", str(tmp_path / "m.csv")]) == 2
    assert "not 'memory-aware'" in capsys.readouterr().err
    assert main(["schedule", "--plan", str(tmp_path / "p.json"), "--kind", "1f1b", "--reorder", "search", *common,
                 "-o", str(tmp_path / "r.csv")]) == 2
    assert "planned order" in capsys.readouterr().err
    to_csv(one_f_one_b(plan.num_stages, plan.num_microbatches), tmp_path / "bad.csv")
    meta = json.loads((tmp_path / "s.meta.json").read_text())
    meta.pop("digest")                  # a sidecar written by hand for the hand-made CSV (no digest to check)
    (tmp_path / "bad.meta.json").write_text(json.dumps(meta))
    assert main(["run", "--plan", str(tmp_path / "s.plan.json"), "--schedule", str(tmp_path / "bad.csv"),
                 "--steps", "1", "--out", str(tmp_path / "res")]) == 2
    assert "backward before the later slice" in capsys.readouterr().err
    assert not (tmp_path / "res").exists()
