"""Data-parallel replicas start from the same weights.

``sync_replicas(modules, group)`` runs once, before the first step, on every rank of a data-parallel
group (the ranks holding the same stages in every replica): a digest of each parameter and buffer (its
float64 sum and sum of squares, in name order) is all-reduced as a max and a min; where they differ,
the group's first rank logs one warning naming the first tensor that differs (the factory's build is
not seeded alike on every rank: a user's model, a transformers model initialised from the global RNG).
Then every tensor is broadcast from the group's first rank (the first replica), so the replicas train
one model whatever the factory did. A group of one rank does nothing. Used by dynmb's runtime
(``RunState``) and by ``dynmb.integrations.torch_pipelining`` (``dp_group=``).
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["sync_replicas", "replica_digest"]

logger = logging.getLogger(__name__)


def _tensors(modules: Iterable[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    named = [(n, t) for m in modules for n, t in [*m.named_parameters(), *m.named_buffers()]]
    return sorted(named, key=lambda item: item[0])


def replica_digest(modules: Iterable[nn.Module]) -> torch.Tensor:
    """Per tensor (name order), its float64 sum and sum of squares: equal weights give equal digests."""
    rows = [torch.stack([t.detach().double().sum(), t.detach().double().square().sum()]) for _, t in _tensors(modules)]
    return torch.stack(rows).flatten() if rows else torch.zeros(0, dtype=torch.float64)


def sync_replicas(modules: Iterable[nn.Module], group: dist.ProcessGroup | None) -> list[str]:
    """Broadcast every parameter and buffer of ``modules`` from ``group``'s first rank (module docstring);
    returns the names of the tensors whose digests differed before (empty when the replicas agreed)."""
    modules = list(modules)
    if group is None or dist.get_world_size(group) < 2:
        return []
    named = _tensors(modules)
    if not named:
        return []
    digest = replica_digest(modules).to(named[0][1].device)
    high, low = digest.clone(), digest.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    differ = sorted({int(i) // 2 for i in torch.nonzero(high != low).flatten().tolist()})
    source = dist.get_global_rank(group, 0)
    if differ and dist.get_rank() == source:
        logger.warning("data-parallel replicas built different weights (%d tensor(s), first %s): the stage "
                       "factory is not seeded alike on every rank; replica 0's weights are broadcast to the others",
                       len(differ), named[differ[0]][0])
    with torch.no_grad():
        for _, tensor in named:
            dist.broadcast(tensor.data, src=source, group=group)
    return [named[i][0] for i in differ]
