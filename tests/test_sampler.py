"""DynamicBatchSampler and Planner: the public planning API in a user's own training loop.

Properties (hypothesis): every dataset index exactly once per epoch over all replicas (the
documented drop_last semantics), replicas disjoint, the records' bookkeeping (global batch,
``is_last_in_batch``, token counts) consistent with the plans; the stand-in warning fires
once, and not with fitted models; bad input is one line naming dataset indices."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

import dynmb
from dynmb.core.config import model_config
from dynmb.data import load_trace
from dynmb.memory.model import MemoryModel
from dynmb.packing import PackingError
from dynmb.planning.defaults import StandInModelWarning, default_cost_model_path, reset_stand_in_warnings


@pytest.fixture(autouse=True)
def _quiet_stand_ins():
    """Most tests plan with the stand-ins on purpose; the warning tests reset and check it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StandInModelWarning)
        yield


def _lengths(n: int = 150, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(8, 600, size=n)


def _sampler(lengths, rank=0, replicas=1, global_batch=32, **kw):
    kw.setdefault("num_stages", 2)
    return dynmb.DynamicBatchSampler(lengths, global_batch, model="tiny", memory_limit="48MiB",
                                     num_replicas=replicas, rank=rank, **kw)


def _ids(sampler) -> list[list[int]]:
    return [mb.indices.tolist() for mb in sampler]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 60), global_batch=st.integers(4, 24), replicas=st.sampled_from([1, 2, 4]),
       drop_last=st.booleans(), shuffle=st.booleans(), seed=st.integers(0, 2**16), stages=st.sampled_from([1, 2]))
def test_epoch_covers_every_index_once_and_replicas_are_disjoint(n, global_batch, replicas, drop_last, shuffle, seed,
                                                                   stages):
    lengths = np.random.default_rng(seed).integers(1, 300, size=n)
    global_batch = max(global_batch, replicas)
    if n < replicas:
        with pytest.raises(ValueError, match="fewer than the .* replicas"):
            _sampler(lengths, 0, replicas, global_batch, num_stages=stages)
        return
    if drop_last and n < global_batch:
        with pytest.raises(ValueError, match="drop_last=True leaves no global batch"):
            _sampler(lengths, 0, replicas, global_batch, drop_last=True, num_stages=stages)
        return
    samplers = [_sampler(lengths, r, replicas, global_batch, drop_last=drop_last, shuffle=shuffle, seed=seed,
                         num_stages=stages) for r in range(replicas)]
    records = [list(s) for s in samplers]
    per_rank = [sorted(i for mb in recs for i in mb.indices.tolist()) for recs in records]
    everything = sorted(i for ids in per_rank for i in ids)
    batches = samplers[0].global_batches()
    assert len(batches) == samplers[0].num_global_batches()
    if drop_last:      # the first n // global_batch full batches of the permutation, each index once
        assert everything == sorted(np.concatenate(batches).tolist())
        assert len(everything) == (n // global_batch) * global_batch
    else:
        assert everything == list(range(n))
        sizes = [len(b) for b in batches]      # full batches; a remainder too small for every replica joins the last
        assert sizes == [global_batch] * (n // global_batch) + ([n % global_batch] if n % global_batch else []) \
            or (n % global_batch < replicas and sizes[-1] == global_batch + n % global_batch)
    assert all(set(a).isdisjoint(b) for i, a in enumerate(per_rank) for b in per_rank[i + 1:])
    counts = [[sum(mb.global_batch == k for mb in recs) for k in range(len(batches))] for recs in records]
    assert all(c == counts[0] for c in counts)            # every replica steps its optimizer after as many
    for rank, (s, recs) in enumerate(zip(samplers, records)):
        assert len(s) == len(recs)
        assert [mb.is_last_in_batch for mb in recs].count(True) == len(batches)      # one optimizer step per batch
        for k, batch in enumerate(batches):
            mine = [mb for mb in recs if mb.global_batch == k]
            assert [mb.local_index for mb in mine] == list(range(len(mine))) and mine[-1].is_last_in_batch
            assert all(mb.local_count == len(mine) and mb.epoch == 0 for mb in mine)
            assert all(mb.batch_tokens == int(lengths[batch].sum()) and mb.batch_documents == len(batch) for mb in mine)
            assert all(set(mb.indices.tolist()) <= set(batch.tolist()) for mb in mine)
        for mb in recs:
            assert np.array_equal(mb.lengths, lengths[mb.indices])         # dataset indices, not batch positions
            row_tokens = np.bincount(mb.row_ids, weights=mb.lengths, minlength=mb.rows)
            assert row_tokens.max() <= mb.padded_len and len(mb.row_layout()) == mb.rows


def test_ranks_plan_identically_and_epochs_differ():
    lengths = _lengths()
    a, b = _sampler(lengths, 0, 2, seed=1), _sampler(lengths, 1, 2, seed=1)
    assert [p.digest() for p in a.plans()] == [p.digest() for p in b.plans()]
    assert len(a) == len(list(a)) and len(a) == len(b)       # every replica runs as many microbatches
    first = _ids(a)
    a.set_epoch(1)
    assert _ids(a) != first and all(mb.epoch == 1 for mb in a)
    a.set_epoch(0)
    assert _ids(a) == first                                   # deterministic per (seed, epoch)


def test_microbatches_fit_the_limit_and_run_in_schedule_order():
    s = _sampler(_lengths(), seed=2)
    mm = s.planner.memory_model
    for plan in s.plans():
        shapes = plan.shapes()
        peak = mm.peak_bytes(shapes[:, 0], shapes[:, 1], "1f1b")
        assert np.max(peak) <= plan.memory_limit_bytes
    batches = s.global_batches()
    expected = [(k, j, batches[k][mb.seq_ids].tolist(), mb.batch, mb.padded_len)
                for k, plan in enumerate(s.plans()) for j, mb in enumerate(plan.microbatches)]
    assert [(mb.global_batch, mb.microbatch, mb.indices.tolist(), mb.rows, mb.padded_len) for mb in s] == expected


def test_drop_last_and_no_shuffle():
    s = _sampler(_lengths(70), shuffle=False, drop_last=True)
    assert sorted(i for mb in s for i in mb) == list(range(64))   # two full batches of 32; the last 6 dropped
    assert s.num_global_batches() == 2


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(ValueError, match="rank 2 out of range"):
        _sampler(_lengths(), rank=2, replicas=2)
    with pytest.raises(ValueError, match=r"non-positive length\(s\) at \[1\]=0"):
        _sampler(np.array([5, 0, 3]))
    with pytest.raises(ValueError, match=r"non-integer values at \[2\]=3.5"):   # was silently truncated to 3
        _sampler(np.array([5.0, 7.0, 3.5]))
    with pytest.raises(ValueError, match=r"must be 1-D .* got shape \(2, 3\)"):  # was silently flattened
        _sampler(np.arange(1, 7).reshape(2, 3))
    with pytest.raises(ValueError, match="whole numbers, got dtype"):
        _sampler(np.array(["5", "6"]))
    with pytest.raises(ValueError, match="oversize='split'"):
        _sampler(_lengths(), oversize="split")
    with pytest.raises(ValueError, match="unknown method 'dynamc'"):
        _sampler(_lengths(), method="dynamc")
    for bad in (_sampler(np.array([5.0, 7.0, 3.0]), global_batch=3),):              # whole floats are lengths
        assert [i for mb in bad for i in mb] and bad.lengths.dtype == np.int64


def test_oversize_errors_name_dataset_indices():
    lengths = np.full(40, 20)
    lengths[[7, 33]] = 100_000                                # cannot fit alone under the limit
    s = _sampler(lengths, global_batch=40, seed=5)
    batch = s.global_batches()[0]
    positions = sorted(np.flatnonzero(np.isin(batch, [7, 33])).tolist())
    assert positions != [7, 33]                               # shuffled: positions differ from dataset indices
    with pytest.raises(PackingError, match=r"global batch 0\): .*dataset indices \[(7, 33|33, 7)\]") as e:
        list(s)
    assert "\n" not in str(e.value)


def test_a_dataset_smaller_than_the_global_batch_is_one_batch_with_a_note(caplog):
    with caplog.at_level(logging.WARNING, logger="dynmb.api.sampler"):
        s = _sampler(_lengths(10), global_batch=32)
    assert "10 samples < global_batch 32" in caplog.text and "not sampled with replacement" in caplog.text
    assert sorted(i for mb in s for i in mb) == list(range(10)) and s.num_global_batches() == 1


def _fitted_memory_model(cfg, stages):
    """A memory model fitted (``MemoryModel.fit``) to measurements 10% above the analytic count."""
    base = MemoryModel.analytic(cfg, stages)
    rows, plen = np.meshgrid([1, 2, 4], [64, 256, 1024])
    pts = [(i, b, s) for i in range(stages) for b, s in zip(rows.ravel(), plen.ravel())]
    act = [1.1 * float(base.act_coef[i] @ [1, b * s, b * s * s]) for i, b, s in pts]
    samples = {"stage": [p[0] for p in pts], "rows": [p[1] for p in pts], "padded_len": [p[2] for p in pts],
               "act_bytes": act}
    return base.fit(samples)


def test_stand_in_warning_fires_once_and_not_with_fitted_models(caplog):
    reset_stand_in_warnings()
    lengths = _lengths(64)
    with pytest.warns(StandInModelWarning) as rec, caplog.at_level(logging.WARNING):
        _sampler(lengths)
        _sampler(lengths, seed=1)                                 # the same model: not again
        dynmb.Planner(model="tiny", num_stages=2)                 # the same stand-in, already said
    assert len(rec) == 1
    msg = str(rec[0].message)
    assert "analytic cost model" in msg and "analytic memory model" in msg
    assert "dynmb profile --model tiny --stages 2" in msg and "dynmb fit" in msg and "dynmb memory" in msg
    assert caplog.text.count("stand-in") == 1
    assert rec[0].filename == __file__                            # points at the caller's line

    reset_stand_in_warnings()                                     # the Planner alone: only its cost fallback
    with pytest.warns(StandInModelWarning) as rec:
        dynmb.Planner(model="tiny", num_stages=2)
    assert len(rec) == 1 and "analytic cost model" in str(rec[0].message) and "memory model" not in str(rec[0].message)

    reset_stand_in_warnings()
    cfg = model_config("small")
    fitted_cost = default_cost_model_path("small", 2, "cpu")
    assert fitted_cost is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error", StandInModelWarning)
        dynmb.Planner(model="small", num_stages=2)                # shipped fitted cost model: nothing to say
        s = dynmb.DynamicBatchSampler(lengths, 32, model=cfg, num_stages=2, memory_limit="1GiB",
                                      cost_model=fitted_cost, memory_model=_fitted_memory_model(cfg, 2))
    assert s.planner.memory_model.source == "fitted" and s.planner.cost_model.kind != "analytic"
    with pytest.warns(StandInModelWarning, match="analytic memory model") as rec:   # the memory stand-in alone
        dynmb.DynamicBatchSampler(lengths, 32, model=cfg, num_stages=2, memory_limit="1GiB", cost_model=fitted_cost)
    assert "analytic cost model" not in str(rec[0].message)
    reset_stand_in_warnings()


class _Tokens(Dataset):
    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return torch.full((int(self.lengths[i]),), i)


def test_still_a_batch_sampler_for_a_dataloader():
    """A record iterates its dataset indices: ``DataLoader(batch_sampler=sampler)`` works as before."""
    lengths = _lengths(100)
    sampler = _sampler(lengths, seed=4)

    def collate(items):
        rows = max(len(t) for t in items)
        return torch.stack([torch.nn.functional.pad(t, (0, rows - len(t)), value=-1) for t in items])

    loader = DataLoader(_Tokens(lengths), batch_sampler=sampler, collate_fn=collate)
    assert len(loader) == len(sampler)
    seen = []
    for batch, mb in zip(loader, sampler):
        assert batch.shape[0] == len(mb) and [int(r[0]) for r in batch] == mb.indices.tolist()
        seen.extend(int(r[0]) for r in batch)
    assert sorted(seen) == list(range(100))


def test_planner_plans_a_shipped_trace_with_auto_reorder():
    planner = dynmb.Planner(model="small", num_stages=2, memory_limit="1GiB")
    batch = load_trace("sharegpt")[:32]
    step = planner.plan(batch, method="dynamic")                 # reorder="auto"
    assert step.plan.meta["reorder"] == "search"
    assert sorted(np.concatenate([mb.seq_ids for mb in step.plan.microbatches]).tolist()) == list(range(32))
    assert step.sim.makespan_s == pytest.approx(step.plan.predictions["pred_step_s"])
    again = dynmb.simulate(step.schedule, step.plan, planner.cost_model, planner.memory_model)
    assert again.makespan_s == pytest.approx(step.sim.makespan_s)


def test_the_package_exports_what_its_docstring_advertises():
    import re

    names = set(re.findall(r"``(\w+)``", dynmb.__doc__)) - {"dynmb"}
    advertised = {n for n in names if n[0].isupper() or n in ("run", "simulate", "summarise", "load_results")}
    missing = sorted(n for n in advertised if not hasattr(dynmb, n))
    assert missing == []
    assert {"MemoryModelLike", "CostModelLike", "SampledMicrobatch"} <= set(dynmb.__all__)


def test_a_trace_smaller_than_the_global_batch_is_sampled_with_replacement_with_a_note(caplog):
    from dynmb.data import sample_batch

    with caplog.at_level(logging.WARNING, logger="dynmb.data.lengths"):
        sample_batch(np.arange(1, 11), 8, seed=0)                     # enough records: no note
        assert caplog.text == ""
        for step in range(3):
            sample_batch(np.arange(1, 11), 16, seed=0, step=step)
    assert caplog.text.count("10 records < global batch 16: batches are drawn with replacement") == 1


def test_the_sampler_plans_with_the_memory_model_it_is_given():
    """A fitted memory model 10% above the analytic count: every microbatch of the epoch fits under
    the limit by the model given, and the analytic stand-in's plans would not."""
    lengths = _lengths(128, seed=7)
    cfg = model_config("tiny")
    fitted = _fitted_memory_model(cfg, 2)
    given_mm = _sampler(lengths, memory_model=fitted, seed=1)
    stand_in = _sampler(lengths, seed=1)
    assert given_mm.planner.memory_model is fitted

    def worst(s, mm):
        return max(float(np.max(mm.peak_bytes(p.shapes()[:, 0], p.shapes()[:, 1], "1f1b")) / p.memory_limit_bytes)
                   for p in s.plans())

    assert worst(given_mm, fitted) <= 1.0
    assert worst(stand_in, fitted) > 1.0


@pytest.mark.parametrize("oversize", ["truncate", "drop"])
def test_documents_that_fit_nowhere_follow_oversize(oversize):
    lengths = np.full(40, 20)
    lengths[11] = 100_000
    s = _sampler(lengths, global_batch=40, oversize=oversize)
    recs = list(s)
    seen = {i: int(n) for mb in recs for i, n in zip(mb.indices.tolist(), mb.lengths.tolist())}
    assert all(seen[i] == 20 for i in range(40) if i != 11)
    if oversize == "drop":
        assert 11 not in seen and recs[0].batch_documents == 39
    else:
        assert 0 < seen[11] < 100_000 and recs[0].batch_tokens == 39 * 20 + seen[11]
