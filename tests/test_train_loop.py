"""experiments/train_loop.py: the loop example runs, and its accumulation gives the global batch's gradient.

fp64: the gradient accumulated over the sampler's microbatches with the token-weighted loss
equals the gradient of the whole global batch's loss at once (every document on its own, summed,
divided by the loss tokens), in both collate layouts, in one process and over 2 gloo replicas;
the naive mean of per-microbatch mean losses does not."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dynmb
from dynmb.api.collate import collate_packed, global_loss_tokens, planned_loss_tokens, token_loss_sum
from dynmb.planning.defaults import StandInModelWarning, reset_stand_in_warnings

EXP = Path(__file__).resolve().parents[1] / "experiments"
pytestmark = pytest.mark.filterwarnings("ignore::dynmb.planning.defaults.StandInModelWarning")


def _loop():
    if str(EXP) not in sys.path:
        sys.path.insert(0, str(EXP))
    return importlib.import_module("train_loop")


def _setup(replicas: int = 1, rank: int = 0):
    t = _loop()
    cfg = t.model_config()
    tokens = t.dataset(48, cfg, seed=1)
    sampler = dynmb.DynamicBatchSampler([len(x) - 1 for x in tokens], 16, model=cfg, num_stages=1,
                                        memory_limit="1500KiB", num_replicas=replicas, rank=rank, seed=2)
    return t, cfg, tokens, sampler


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _reference(t, cfg, tokens, indices) -> torch.Tensor:
    """The global batch at once: every document alone (its own row), summed, over the batch's loss tokens."""
    model = t.TinyLM(cfg, dtype=torch.float64)
    count = sum(len(tokens[i]) - 1 for i in indices)
    total = 0.0
    for i in indices:
        n = len(tokens[i]) - 1                  # a length: the tokens trained (ids less the end-of-text)
        one = dynmb.SampledMicrobatch(indices=[i], lengths=[n], row_ids=[0], rows=1,
                                      padded_len=n, epoch=0, global_batch=0, microbatch=0, local_index=0,
                                      local_count=1, batch_tokens=n, batch_documents=1)
        b = collate_packed(tokens, one)
        total = total + token_loss_sum(model(b), b.labels)
    (total / count).backward()
    return _grads(model)


def test_main_runs_two_steps_and_warns_about_its_stand_ins_once(capsys, caplog):
    reset_stand_in_warnings()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert _loop().main(["--steps", "2", "--samples", "40"]) == 0
    said = [r for r in caplog.records if "train-loop-example" in r.getMessage() and "stand-in" in r.getMessage()]
    assert len(said) == 1                                           # the log line, once
    assert not [w for w in seen if issubclass(w.category, StandInModelWarning)]   # not a second time as a warning
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert len(lines) == 2 and all(float(ln.split()[-1]) > 0 for ln in lines)
    reset_stand_in_warnings()


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_accumulated_gradient_is_the_global_batch_gradient(layout):
    t, cfg, tokens, sampler = _setup()
    first = [mb for mb in sampler if mb.global_batch == 0]
    # several microbatches, some holding several documents (in several rows, or packed in one)
    assert len(first) > 1 and any(len(mb) > 1 for mb in sampler)
    model = t.TinyLM(cfg, dtype=torch.float64)
    for mb in first:
        t.microbatch_backward(model, tokens, mb, layout)
    ref = _reference(t, cfg, tokens, sampler.global_batches()[0].tolist())
    got = _grads(model)
    assert torch.allclose(got, ref, rtol=1e-10, atol=1e-13)

    naive = t.TinyLM(cfg, dtype=torch.float64)                  # mean of per-microbatch mean losses
    for mb in first:
        b = t.collate(tokens, mb, layout=layout)
        (token_loss_sum(naive(b), b.labels) / b.loss_tokens / len(first)).backward()
    assert (_grads(naive) - ref).norm() > 1e-3 * ref.norm()


def test_train_steps_the_optimizer_once_per_global_batch():
    t, cfg, tokens, sampler = _setup()
    model = t.TinyLM(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    opt.register_step_post_hook(lambda *_: steps.append(1))
    losses = t.train(model, tokens, sampler, opt, steps=sampler.num_global_batches() + 1)   # into a second epoch
    assert len(losses) == len(steps) == sampler.num_global_batches() + 1
    assert all(p.grad is None for p in model.parameters())         # nothing left accumulated after the last step


def _trained(t, cfg, tokens, sampler, group=None) -> tuple[torch.Tensor, list[float]]:
    """Parameters and losses after the example's ``train`` runs 2 SGD steps (fp64)."""
    model = t.TinyLM(cfg, dtype=torch.float64)
    losses = t.train(model, tokens, sampler, torch.optim.SGD(model.parameters(), lr=0.5), steps=2, group=group)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), losses


def _dp_rank(rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        t, cfg, tokens, sampler = _setup(world, rank)
        model = t.TinyLM(cfg, dtype=torch.float64)
        mine = [mb for mb in sampler if mb.global_batch == 0]
        batches = [t.collate(tokens, mb) for mb in mine]
        counted = global_loss_tokens(batches, group=dist.group.WORLD)
        for mb in mine:
            t.microbatch_backward(model, tokens, mb)
        for p in model.parameters():
            dist.all_reduce(p.grad)
        trained = _trained(t, cfg, tokens, sampler, dist.group.WORLD)
        torch.save({"grads": _grads(model), "counted": counted, "planned": planned_loss_tokens(mine[0]),
                    "indices": [i for mb in mine for i in mb.indices.tolist()], "trained": trained},
                   os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_data_parallel_replicas_sum_to_the_global_batch_gradient(tmp_path):
    world = 2
    mp.start_processes(_dp_rank, args=(world, f"file://{tmp_path / 'init'}", str(tmp_path)), nprocs=world,
                       start_method="spawn")
    res = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    t, cfg, tokens, sampler = _setup()
    batch = sampler.global_batches()[0].tolist()
    assert sorted(res[0]["indices"] + res[1]["indices"]) == sorted(batch)          # replicas disjoint, complete
    assert not set(res[0]["indices"]) & set(res[1]["indices"])
    assert res[0]["counted"] == res[1]["counted"] == res[0]["planned"] == sum(len(tokens[i]) - 1 for i in batch)
    ref = _reference(t, cfg, tokens, batch)
    for r in res:
        assert torch.allclose(r["grads"], ref, rtol=1e-10, atol=1e-13)
    params, losses = _trained(t, cfg, tokens, sampler)          # the loop on one process: same steps
    start = torch.cat([p.detach().reshape(-1) for p in t.TinyLM(cfg, dtype=torch.float64).parameters()])
    assert not torch.allclose(params, start)
    for r in res:
        assert torch.allclose(r["trained"][0], params, rtol=1e-9, atol=1e-12)
        assert r["trained"][1] == pytest.approx(losses, rel=1e-10)
