"""DynamicBatchSampler and Planner: the public planning API in a user's own training loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import dynmb
from dynmb.data import load_trace


def _lengths(n: int = 150, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(8, 600, size=n)


def _sampler(lengths, rank=0, replicas=1, **kw):
    return dynmb.DynamicBatchSampler(lengths, 32, model="tiny", num_stages=2, memory_limit="48MiB",
                                     num_replicas=replicas, rank=rank, **kw)


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_every_index_exactly_once_per_epoch(replicas):
    lengths = _lengths()
    seen = []
    for rank in range(replicas):
        for mb in _sampler(lengths, rank, replicas, seed=3):
            seen.extend(mb)
    assert sorted(seen) == list(range(len(lengths)))


def test_ranks_plan_identically_and_epochs_differ():
    lengths = _lengths()
    a, b = _sampler(lengths, 0, 2, seed=1), _sampler(lengths, 1, 2, seed=1)
    assert [p.digest() for p in a.plans()] == [p.digest() for p in b.plans()]
    assert len(a) == len(list(a)) and len(a) == len(b)       # every replica runs as many microbatches
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    a.set_epoch(0)
    assert list(a) == first                                   # deterministic per (seed, epoch)


def test_microbatches_fit_the_limit_and_run_in_schedule_order():
    s = _sampler(_lengths(), seed=2)
    mm = s.planner.memory_model
    for plan in s.plans():
        shapes = plan.shapes()
        peak = mm.peak_bytes(shapes[:, 0], shapes[:, 1], "1f1b")
        assert np.max(peak) <= plan.memory_limit_bytes
    # yielded in plan (execution) order, global batch by global batch
    batches = s.global_batches()
    expected = [batches[k][mb.seq_ids].tolist() for k, plan in enumerate(s.plans()) for mb in plan.microbatches]
    assert list(s) == expected


def test_drop_last_and_no_shuffle():
    lengths = _lengths(70)
    s = _sampler(lengths, shuffle=False, drop_last=True)
    got = sorted(i for mb in s for i in mb)
    assert got == list(range(64))                             # two full batches of 32; the last 6 dropped


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(ValueError, match="rank 2 out of range"):
        _sampler(_lengths(), rank=2, replicas=2)
    with pytest.raises(ValueError, match="non-positive"):
        _sampler(np.array([5, 0, 3]))


class _Tokens(Dataset):
    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return torch.full((int(self.lengths[i]),), i)


def test_dataloader_end_to_end():
    lengths = _lengths(100)
    sampler = _sampler(lengths, seed=4)

    def collate(items):
        rows = max(len(t) for t in items)
        return torch.stack([torch.nn.functional.pad(t, (0, rows - len(t)), value=-1) for t in items])

    loader = DataLoader(_Tokens(lengths), batch_sampler=sampler, collate_fn=collate)
    seen = []
    for batch, plan_mb in zip(loader, (mb for p in sampler.plans() for mb in p.microbatches)):
        assert batch.shape[0] == plan_mb.num_seqs          # one sample per sequence (a row may hold several)
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
