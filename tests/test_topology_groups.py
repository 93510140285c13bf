"""The cases of a job share the process groups of their grid (``runtime.topology.make_process_groups``)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from dynmb.runtime.topology import Topology, make_process_groups

CPU = torch.device("cpu")


def _one_rank_world(path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)


def test_a_grid_makes_its_groups_once_per_default_group(tmp_path):
    grid = Topology(num_stages=2, pipeline_size=1, dp_size=1, rank=0)
    _one_rank_world(tmp_path / "store1")
    try:
        first = make_process_groups(grid, timedelta(seconds=60), CPU)
        assert make_process_groups(grid, timedelta(seconds=60), CPU) is first
        assert make_process_groups(Topology(num_stages=1, pipeline_size=1, dp_size=1, rank=0),
                                   timedelta(seconds=60), CPU) is first      # same grid, other stage count
        assert make_process_groups(grid, timedelta(seconds=30), CPU) is not first   # another timeout
    finally:
        dist.destroy_process_group()
    _one_rank_world(tmp_path / "store2")
    try:
        again = make_process_groups(grid, timedelta(seconds=60), CPU)
        assert again is not first                 # the old groups died with their default group
        assert again.data_parallel is not None and again.pipeline is not None
        t = torch.ones(1)
        dist.all_reduce(t, group=again.data_parallel)
        assert t.item() == 1.0
    finally:
        dist.destroy_process_group()
