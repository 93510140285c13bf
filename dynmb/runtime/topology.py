"""Where every rank sits: pipeline and data-parallel coordinates, and the process groups.

Global rank = ``dp_index * R + pp_index`` with ``R = num_stages / virtual`` pipeline ranks
per replica; stage ``s`` lives on pipeline rank ``s % R`` (``virtual`` > 1: the interleaved
placement, several stages per rank), or where the schedule kind's ``placement`` puts it (``zb-v``:
chunk 0 of rank ``r`` is stage ``r``, chunk 1 stage ``S - 1 - r``; ``dynmb.schedule.vshape``). Process groups, created collectively by every rank in
the same order and passed to whoever needs them (no global singletons):

- pair groups: one two-rank group per ordered pair of neighbouring pipeline ranks, for the
  P2P messages (``comm.make_pair_groups``);
- data-parallel groups: the ranks holding the same stages in every replica (gradient
  all-reduce);
- pipeline groups: the ranks of one replica (the weight gather of ``--verify``).

The cases of one job (``worker.run_cases``) run in one default group, one step at a time, each step
draining its messages: they share the groups of a layout (``make_process_groups`` remembers them per
default group, grid and timeout). A gloo group keeps a transport thread that wakes now and then;
a job of 77 cases that made new ones per case held over 1,000 threads a rank and kept cores busy.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dynmb.core.config import RunConfig
from dynmb.runtime.comm import make_pair_groups
from dynmb.schedule.kinds import AUTO, auto_placement, get_kind
from dynmb.schedule.embedlast import lifted
from dynmb.schedule.vshape import placement_rank

__all__ = ["Topology", "ProcessGroups", "make_process_groups"]


@dataclass(frozen=True, kw_only=True)
class Topology:
    """One rank's place in a ``pipeline_size`` x ``dp_size`` grid of ranks."""

    num_stages: int
    """Pipeline stages (model chunks)."""
    pipeline_size: int
    """Pipeline ranks per replica (``num_stages / virtual``)."""
    dp_size: int
    """Data-parallel replicas."""
    rank: int
    """This process's global rank."""
    placement: str = "loop"
    """Stage -> pipeline rank rule (``dynmb.schedule.vshape.placement_rank``): loop or v."""
    embedding: str = "first"
    """``PlanSpec.embedding``: ``last`` adds the embedding stage on the last stage's rank and numbers the stages as
    the schedule does (``dynmb.schedule.embedlast``: the plan's stage ``s`` is ``s + 1``)."""

    def __post_init__(self) -> None:
        if self.num_stages % self.pipeline_size:
            raise ValueError(f"{self.num_stages} stages do not spread over {self.pipeline_size} pipeline ranks")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a world of {self.world_size}")

    @classmethod
    def for_run(cls, run: RunConfig, rank: int, world_size: int) -> Topology:
        """This rank's topology for ``run``; the world must be pipeline ranks x dp."""
        pipeline = run.spec
        if world_size != pipeline.num_ranks * run.spec.dp:
            raise ValueError(f"world size {world_size} != pipeline ranks {pipeline.num_ranks} (stages "
                             f"{pipeline.num_stages} / virtual {pipeline.virtual}) x dp {run.spec.dp}")
        placement = auto_placement(run.plan_spec) if pipeline.schedule_kind == AUTO else get_kind(pipeline.schedule_kind).placement
        return cls(num_stages=pipeline.num_stages, pipeline_size=pipeline.num_ranks, dp_size=run.spec.dp, rank=rank,
                   placement=placement, embedding=run.spec.embedding)

    @property
    def world_size(self) -> int:
        return self.pipeline_size * self.dp_size

    @property
    def dp_index(self) -> int:
        """Which replica this rank belongs to."""
        return self.rank // self.pipeline_size

    @property
    def pp_index(self) -> int:
        """This rank's position in its replica's pipeline."""
        return self.rank % self.pipeline_size

    @property
    def local_stages(self) -> tuple[int, ...]:
        """The stages this rank holds, numbered as its schedule does (with the embedding last: its stage 0 on the
        last stage's rank, every plan stage one up)."""
        virtual = self.num_stages // self.pipeline_size
        plain = [s for s in range(self.num_stages)
                 if placement_rank(s, self.num_stages, virtual, self.placement) == self.pp_index]
        if self.embedding != "last":
            return tuple(plain)
        embeds = placement_rank(self.num_stages - 1, self.num_stages, virtual, self.placement) == self.pp_index
        return tuple([0] * embeds + [lifted(s) for s in plain])

    def pipeline_ranks(self, dp_index: int | None = None) -> list[int]:
        """Global ranks of replica ``dp_index`` (default: this rank's), by pipeline index."""
        d = self.dp_index if dp_index is None else dp_index
        return [d * self.pipeline_size + i for i in range(self.pipeline_size)]

    def data_parallel_ranks(self, pp_index: int | None = None) -> list[int]:
        """Global ranks at pipeline index ``pp_index`` (default: this rank's) in every replica."""
        i = self.pp_index if pp_index is None else pp_index
        return [d * self.pipeline_size + i for d in range(self.dp_size)]


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's process groups."""

    pairs: dict[tuple[int, int], dist.ProcessGroup]
    """``{(src, dst): group}`` of every ordered pair of neighbouring pipeline ranks."""
    data_parallel: dist.ProcessGroup | None
    """The gradient all-reduce group of this rank's stages."""
    pipeline: dist.ProcessGroup | None
    """This rank's replica."""


_MADE: dict[tuple, ProcessGroups] = {}
"""This process's groups per (grid, timeout, device), for the default group in ``_MADE_FOR``."""
_MADE_FOR: list[object] = []


def make_process_groups(topology: Topology, timeout: timedelta, device: torch.device) -> ProcessGroups:
    """This rank's groups of ``topology``'s grid: made once per default group, grid, timeout and device
    (every rank runs the same cases in the same order, so every rank asks for the same ones: the
    collective ``new_group`` calls stay matched)."""
    world = dist.group.WORLD
    if not _MADE_FOR or _MADE_FOR[0] is not world:     # a new default group: the old groups died with it
        _MADE.clear()
        _MADE_FOR[:] = [world]
    key = (topology.world_size, topology.pipeline_size, timeout, str(device))
    if key not in _MADE:
        _MADE[key] = _new_process_groups(topology, timeout, device)
    return _MADE[key]


def _new_process_groups(topology: Topology, timeout: timedelta, device: torch.device) -> ProcessGroups:
    """Create every group on every rank (``new_group`` is collective) and keep this rank's."""
    pairs = make_pair_groups(topology.world_size, topology.pipeline_size, timeout, device)
    data_parallel = pipeline = None
    for i in range(topology.pipeline_size):
        group = dist.new_group(topology.data_parallel_ranks(i), timeout=timeout)
        if i == topology.pp_index:
            data_parallel = group
    for d in range(topology.dp_size):
        group = dist.new_group(topology.pipeline_ranks(d), timeout=timeout)
        if d == topology.dp_index:
            pipeline = group
    return ProcessGroups(pairs=pairs, data_parallel=data_parallel, pipeline=pipeline)
