"""Data-parallel replicas start identical (issue 40): a factory that builds different weights on every rank
(no common seed) ends with the first replica's weights on both ranks, the difference named once; the
torch.distributed.pipelining adapter does it at its first call only. Two real gloo ranks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dynmb.integrations.torch_pipelining import _start_identical
from dynmb.runtime.replicas import replica_digest, sync_replicas
from tests.spawn_ranks import spawn_ranks

pytestmark = pytest.mark.dist


def _rank(rank: int, init: str, out: str) -> None:
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(100 + rank)                        # an unseeded factory: different weights per rank
    stage = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    stage.register_buffer("steps_seen", torch.tensor([float(rank)]))
    before = replica_digest([stage]).clone()
    differed = sync_replicas([stage], dist.group.WORLD)
    weights = [torch.zeros_like(replica_digest([stage])) for _ in range(2)]
    dist.all_gather(weights, replica_digest([stage]))
    later = nn.Linear(2, 2)                              # the adapter: once per module, at its first call
    torch.manual_seed(7 + rank)
    later.reset_parameters()
    _start_identical([later], dist.group.WORLD)
    first = later.weight.detach().clone()
    with torch.no_grad():
        later.weight.add_(float(rank))                   # a later step's local change is not overwritten
    _start_identical([later], dist.group.WORLD)
    kept = bool(torch.equal(later.weight, first + float(rank)))
    torch.save({"before": before, "after": weights, "differed": differed, "kept": kept, "first": first},
               Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_replicas_take_the_first_replicas_weights(tmp_path) -> None:
    init = f"file://{tmp_path / 'store'}"
    assert spawn_ranks(_rank, 2, lambda r: (r, init, str(tmp_path)), 300) == [0, 0]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert not torch.equal(r0["before"], r1["before"])                # the factory built different weights
    assert torch.equal(r0["after"][0], r0["after"][1])                 # ... and both ranks now hold the same
    assert torch.equal(r0["after"][0], r0["before"])                   # the first replica's
    assert "0.weight" in r0["differed"] and "steps_seen" in r0["differed"] and r0["differed"] == r1["differed"]
    assert torch.equal(r0["first"], r1["first"]) and r0["kept"] and r1["kept"]


def test_a_single_replica_is_left_alone() -> None:
    assert sync_replicas([nn.Linear(2, 2)], None) == []


def test_a_failed_check_is_one_line_and_said_once_for_ranks_with_the_same_error(tmp_path) -> None:
    from dynmb.runtime.checks import problem_line
    from dynmb.runtime.launch import failure_lines

    problems = [f"rank {r} step 0 param layers.{i}.w: max abs error 0.1 > 1e-05 x max|ref| 1" for r in (0, 1)
                for i in range(5)]
    line = problem_line(0, problems)
    assert "\n" not in line and line.startswith("step 0: gradients differ from the single-process reference")
    assert "7 more on rank(s) 0, 1" in line and len(line) < 400
    (tmp_path / "errors").mkdir()
    for rank in range(4):
        (tmp_path / "errors" / f"rank{rank}.txt").write_text(f"rank: {rank}\nerror: StepCheckError: {line}\n")
    lines = failure_lines(tmp_path, "")
    assert lines == [f"dynmb run: rank 0 failed: StepCheckError: {line} (rank(s) 1, 2, 3: the same error)"]
