"""``DynamicBatchSampler``: dynmb's planning inside your own training loop.

A ``torch.utils.data.Sampler`` over a dataset whose sample ``i`` has ``lengths[i]`` tokens.
Each epoch:

1. the indices are permuted (``shuffle``: a generator seeded by ``(seed, epoch)``; else in
   order) and cut into global batches of ``global_batch`` indices (the last one shorter, or
   dropped with ``drop_last``);
2. every global batch is planned by a ``Planner`` for ``num_replicas`` data-parallel
   pipelines (``dp = num_replicas``): packed under the memory limit and ordered as the
   schedule runs it;
3. rank ``rank`` yields, global batch by global batch, one list of dataset indices per
   microbatch of its replica, in execution order.

Planning is deterministic, so every rank computes the same plans for the same seed and
epoch without communicating; over all replicas every index appears exactly once per epoch
(``drop_last=False``), and every microbatch fits the limit by the memory model (the plan's
invariant). Plans of an epoch are computed once, on first use (``__len__`` or
``__iter__``), and kept until ``set_epoch`` changes the epoch.

Use with a DataLoader as ``DataLoader(dataset, batch_sampler=sampler, collate_fn=...)``;
``sampler.plans()`` gives the epoch's ``Plan`` objects (shapes, predictions) for the
pipeline runtime.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from ..config import ModelConfig
from ..types import Plan
from .api import Planner

__all__ = ["DynamicBatchSampler"]


class DynamicBatchSampler(Sampler[list[int]]):
    """Yields this rank's microbatches (lists of dataset indices); see the module docstring.

    Extra keyword arguments (``cost_model``, ``memory_model``, ``schedule``, ``round_to``,
    ``oversize``, ``pack_len``, ``virtual``, ``recompute``, ``device``) go to the ``Planner``."""

    def __init__(self, lengths: Any, global_batch: int, *, model: ModelConfig | str, num_stages: int,
                 memory_limit: int | str, method: str = "dynamic", num_replicas: int = 1, rank: int = 0,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, **planner_kwargs: Any) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if len(self.lengths) == 0:
            raise ValueError("DynamicBatchSampler: the dataset has no samples")
        if np.any(self.lengths < 1):
            bad = np.flatnonzero(self.lengths < 1)[:10].tolist()
            raise ValueError(f"DynamicBatchSampler: samples {bad} have non-positive lengths")
        if global_batch < num_replicas:
            raise ValueError(f"global_batch {global_batch} must be >= num_replicas {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} out of range for {num_replicas} replicas")
        self.global_batch, self.method = int(global_batch), method
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.planner = Planner(model=model, num_stages=num_stages, memory_limit=memory_limit, dp=self.num_replicas,
                               **planner_kwargs)
        self.epoch = 0
        self._cache: tuple[int, list[Plan], list[np.ndarray]] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation (and plans) of ``epoch``; call before each epoch, as with DistributedSampler."""
        self.epoch = int(epoch)

    def global_batches(self) -> list[np.ndarray]:
        """The epoch's global batches as arrays of dataset indices."""
        n = len(self.lengths)
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(n)
        else:
            order = np.arange(n)
        batches = [order[i:i + self.global_batch] for i in range(0, n, self.global_batch)]
        if self.drop_last and len(batches[-1]) < self.global_batch:
            batches.pop()
        return batches

    def _epoch(self) -> tuple[list[Plan], list[np.ndarray]]:
        if self._cache is None or self._cache[0] != self.epoch:
            batches = self.global_batches()
            plans = [self.planner.plan(self.lengths[b], method=self.method,
                                       meta={"epoch": self.epoch, "global_batch_index": k}).plan
                     for k, b in enumerate(batches)]
            self._cache = (self.epoch, plans, batches)
        return self._cache[1], self._cache[2]

    def plans(self) -> list[Plan]:
        """The epoch's plans, one per global batch (all replicas; ``plan.replica(rank)`` is this rank's)."""
        return self._epoch()[0]

    def __iter__(self) -> Iterator[list[int]]:
        plans, batches = self._epoch()
        for plan, batch in zip(plans, batches):
            for microbatch, replica in zip(plan.microbatches, plan.replica_ids):
                if replica == self.rank:
                    yield batch[microbatch.seq_ids].tolist()

    def __len__(self) -> int:
        plans, _ = self._epoch()
        return sum(sum(1 for r in plan.replica_ids if r == self.rank) for plan in plans)
