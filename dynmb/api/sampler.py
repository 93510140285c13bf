"""``DynamicBatchSampler``: dynmb's planning inside your own training loop.

A ``torch.utils.data.Sampler`` over a dataset whose sample ``i`` (its *dataset index*) has
length ``lengths[i]``: the tokens it trains, its ids less the end-of-text id appended to it (the one
convention of ``dynmb plan`` / ``run``, docs/design.md "Lengths": a ``dynmb lengths`` trace is such a
list, and ``dynmb.api.collate`` reads ``lengths[i] + 1`` ids). Each epoch:

1. the dataset indices are permuted (``shuffle``: a generator seeded by ``(seed, epoch)``;
   else in order) and cut into global batches of ``global_batch`` indices. The last,
   shorter one is kept (``drop_last=False``: every index appears exactly once per epoch over
   all replicas) or dropped (``drop_last=True``: ``len(dataset) % global_batch`` indices are
   left out of the epoch); a last batch with fewer indices than ``num_replicas`` (each replica
   needs one) joins the one before it. A dataset smaller than ``global_batch`` makes one
   global batch of all its indices (never sampled with replacement; a warning says so).
2. every global batch is planned by a ``Planner`` for ``num_replicas`` data-parallel
   pipelines (``dp = num_replicas``) with the given cost and memory models: packed under the
   memory limit (documents may share a row: the ``row_ids`` of the record) and ordered as
   the schedule runs it. Every replica gets the same number of microbatches per global batch.
3. rank ``rank`` yields, global batch by global batch, one ``SampledMicrobatch`` per
   microbatch of its replica, in execution order: the dataset indices of its documents,
   their row layout and padded length, the global batch it belongs to, whether it is this
   rank's last of that global batch (``is_last_in_batch``: step the optimizer after it),
   and the real token and document counts of the whole global batch (all replicas), from
   which the token-weighted loss is normalised (``dynmb.api.collate``).

Planning is deterministic, so every rank computes the same plans for the same seed and
epoch without communicating. Replicas given different settings (another ``seed``, a missed
``set_epoch``, other lengths) would sample overlapping global batches without a word, so when
``torch.distributed`` is initialized (world size > 1) the first planning of each epoch shares
the sampler's settings (seed, epoch, shuffle, drop_last, global_batch, num_replicas, method, a digest
of ``lengths``) through the default group's key-value store and raises on every rank, naming the ranks and
the settings that differ from rank 0's; a rank that never checks within ``REPLICA_CHECK_TIMEOUT_S`` (a
sampler built on some ranks only) is named in a ``RuntimeError`` on the others (``check_replicas=False``:
no check). Plans of an epoch are computed once, on first use (``len``,
``iter``, ``plans``), and kept until ``set_epoch`` changes the epoch. ``len(sampler)`` is the
number of microbatches (records) this rank yields in the current epoch, over all its global
batches; ``num_global_batches()`` the number of optimizer steps of the epoch.

Models: the plans are only as good as the cost and memory models. Pass the ones fitted for
*your* model (``cost_model=`` from ``dynmb profile && dynmb fit``, ``memory_model=`` from
``dynmb memory``, objects or JSON paths). Without them the sampler plans with stand-ins
(analytic FLOP costs, the memory accounting of dynmb's own GPT stages) and says so once
(``dynmb.planning.defaults.warn_stand_ins``).

Documents that no microbatch can hold follow ``oversize`` (``error``: a ``PackingError``
naming their dataset indices; ``truncate``: the record's ``lengths`` are shorter than the
documents, a collate uses their first tokens; ``drop``: they are left out of the epoch).
``oversize='split'`` is refused: slices of one document in different microbatches need
dynmb's runtime to attend across them.

Use: iterate the sampler and collate each record (``dynmb.api.collate.collate_padded`` /
``collate_packed``), or hand it to a DataLoader as ``DataLoader(MicrobatchDataset(tokens),
sampler=sampler, batch_size=None)`` (collation in the workers). A record is also a sequence
of its dataset indices, so ``DataLoader(dataset, batch_sampler=sampler, collate_fn=...)``
works as before (the collate function then gets the items, not the layout).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from dynmb.core.config import ModelConfig
from dynmb.costmodel.base import CostModelLike
from dynmb.data.lengths import check_lengths
from dynmb.memory.model import MemoryModelLike
from dynmb.packing import METHODS, PackingError
from dynmb.core.types import Plan
from dynmb.api.planner import Planner
from dynmb.planning.defaults import stand_ins_of, suppress_stand_in_warnings, warn_stand_ins

__all__ = ["DynamicBatchSampler", "SampledMicrobatch"]

log = logging.getLogger(__name__)


def _frozen(a: Any) -> np.ndarray:
    out = np.asarray(a, dtype=np.int64).reshape(-1)
    out.setflags(write=False)
    return out


@dataclass(frozen=True, eq=False)
class SampledMicrobatch:
    """One microbatch as the sampler yields it (this rank's, in execution order).

    Entry ``k`` is document ``indices[k]`` (a dataset index) with ``lengths[k]`` tokens in
    row ``row_ids[k]`` of ``rows`` rows of ``padded_len`` tokens; documents sharing a row are
    concatenated in entry order. ``global_batch``: the index of its global batch in the
    epoch; ``microbatch``: its index in that global batch's plan (all replicas);
    ``local_index`` / ``local_count``: its place among this rank's microbatches of the global
    batch. ``batch_tokens`` / ``batch_documents``: real tokens and documents of the whole
    global batch over all replicas. Iterating it gives the dataset indices (``len``: the
    number of documents).
    """

    indices: np.ndarray
    lengths: np.ndarray
    row_ids: np.ndarray
    rows: int
    padded_len: int
    epoch: int
    global_batch: int
    microbatch: int
    local_index: int
    local_count: int
    batch_tokens: int
    batch_documents: int
    recompute: bool = False
    dataset_lengths: np.ndarray | None = None
    """The lengths the sampler was given for ``indices`` (``lengths`` is shorter where a plan truncated a
    document); ``collate`` refuses a token list of another length. None: not known."""

    def __post_init__(self) -> None:
        if self.dataset_lengths is not None:
            object.__setattr__(self, "dataset_lengths", _frozen(self.dataset_lengths))
        for name in ("indices", "lengths", "row_ids"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    @property
    def is_last_in_batch(self) -> bool:
        """This rank's last microbatch of its global batch: step the optimizer after its backward."""
        return self.local_index == self.local_count - 1

    @property
    def tokens(self) -> int:
        """Real tokens of this microbatch."""
        return int(self.lengths.sum())

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, padded_len)``: the shape the memory model budgeted."""
        return (self.rows, self.padded_len)

    def row_layout(self) -> list[np.ndarray]:
        """The dataset indices of each row, in the order they are concatenated."""
        return [self.indices[self.row_ids == r] for r in range(self.rows)]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices.tolist())

    def __len__(self) -> int:
        return len(self.indices)


REPLICA_CHECK_TIMEOUT_S = 300.0
"""How long a rank waits for every other rank's sampler settings (their first planning of the epoch)."""

def _gather_settings(mine: dict[str, Any], rank: int, world: int) -> list[dict[str, Any]]:
    """Every rank's ``settings()`` through the default group's key-value store, not a collective: a rank whose
    sampler never checks (a sampler built on some ranks only) makes the others raise after
    ``REPLICA_CHECK_TIMEOUT_S`` naming it, instead of waiting in a collective until the group's timeout."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    made = store.add(f"dynmb/sampler-checks/{rank}", 1)   # this rank's checks in this group, kept by the store
    prefix = f"dynmb/sampler-check/{made}/"
    store.set(prefix + str(rank), json.dumps(mine))
    keys = [prefix + str(r) for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=REPLICA_CHECK_TIMEOUT_S))
    except RuntimeError:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise RuntimeError(f"DynamicBatchSampler: rank(s) {', '.join(map(str, missing))} did not check their sampler's "
                           f"settings within {REPLICA_CHECK_TIMEOUT_S:g} s: every rank of the group must build and "
                           "iterate the sampler (or pass check_replicas=False)") from None
    return [json.loads(store.get(key)) for key in keys]


_POSITIONS = re.compile(r"\b(ids|sequences) \[([0-9, ]*)\]")


def _name_dataset_indices(message: str, batch: np.ndarray) -> str:
    """``message`` with the lists of global-batch positions it names (``ids [..]``,
    ``sequences [..]``) replaced by the dataset indices at those positions."""
    def sub(m: re.Match) -> str:
        pos = [int(p) for p in m.group(2).split(",") if p.strip()]
        return f"dataset indices {[int(batch[p]) for p in pos]}"
    return _POSITIONS.sub(sub, message)


def _lengths(lengths: Any) -> np.ndarray:
    a = np.asarray(lengths)
    if a.ndim != 1:
        raise ValueError(f"DynamicBatchSampler: lengths must be 1-D (one token count per dataset index), "
                         f"got shape {a.shape}")
    if a.size and a.dtype.kind not in "iuf":
        raise ValueError(f"DynamicBatchSampler: lengths must be whole numbers, got dtype {a.dtype}")
    return check_lengths(a, "DynamicBatchSampler: lengths (by dataset index)")


class DynamicBatchSampler(Sampler[SampledMicrobatch]):
    """Yields this rank's ``SampledMicrobatch`` records; see the module docstring.

    ``model``: the model trained: a ``ModelConfig``, a ``--model`` spec (``package.module:factory``
    too) or a ``StageFactory`` (its ``config`` sizes the stand-in models, its ``attention_work``
    sets the cost model's attention feature; see ``Planner``); ``cost_model`` / ``memory_model``: its fitted models (objects or JSON
    paths). ``mbs``: rows per microbatch of the methods that take it. Extra keyword arguments (``schedule``,
    ``round_to``, ``oversize``, ``pack_len``,
    ``virtual``, ``recompute``, ``device``, ``stage_split``) go to the ``Planner``; ``stage_split="auto"``
    balances the dataset's ``lengths`` (the ``Planner``'s ``workload``)."""

    def __init__(self, lengths: Any, global_batch: int, *, model: ModelConfig | str | Any, num_stages: int,
                 memory_limit: int | str, cost_model: CostModelLike | str | None = None,
                 memory_model: MemoryModelLike | str | None = None, method: str = "dynamic", num_replicas: int = 1,
                 rank: int = 0, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 check_replicas: bool = True, **planner_kwargs: Any) -> None:
        self.lengths = _lengths(lengths)
        n = len(self.lengths)
        for name, value in (("num_replicas", num_replicas), ("rank", rank), ("global_batch", global_batch)):
            if isinstance(value, bool) or not float(value).is_integer():
                raise ValueError(f"DynamicBatchSampler: {name} must be a whole number, got {value!r}")
        if int(num_replicas) < 1:
            raise ValueError(f"DynamicBatchSampler: num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= int(rank) < int(num_replicas):
            raise ValueError(f"DynamicBatchSampler: rank {rank} out of range for {num_replicas} replicas")
        if int(global_batch) < int(num_replicas):
            raise ValueError(f"DynamicBatchSampler: global_batch {global_batch} must be >= num_replicas {num_replicas}")
        if method not in METHODS:
            raise ValueError(f"DynamicBatchSampler: unknown method {method!r}; expected one of {', '.join(METHODS)}")
        if planner_kwargs.get("oversize") == "split":
            raise ValueError("DynamicBatchSampler: oversize='split' puts slices of one document in different "
                             "microbatches, which only dynmb's runtime attends across; use 'error', 'truncate' or 'drop'")
        self.global_batch, self.method = int(global_batch), method
        self.mbs = planner_kwargs.pop("mbs", None)        # rows per microbatch (fixed, sorted, packed, lockstep)
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.check_replicas = bool(check_replicas)
        if n < self.num_replicas:
            raise ValueError(f"DynamicBatchSampler: the dataset has {n} samples, fewer than the {self.num_replicas} "
                             f"replicas (each needs at least one per global batch)")
        if n < self.global_batch:
            if self.drop_last:
                raise ValueError(f"DynamicBatchSampler: the dataset has {n} samples < global_batch {self.global_batch}: "
                                 f"drop_last=True leaves no global batch")
            log.warning("DynamicBatchSampler: the dataset has %d samples < global_batch %d: each epoch is one global "
                        "batch of all %d (not sampled with replacement)", n, self.global_batch, n)
        with suppress_stand_in_warnings():           # one warning below names every stand-in at once
            self.planner = Planner(model=model, num_stages=num_stages, memory_limit=memory_limit, dp=self.num_replicas,
                                   cost_model=cost_model, memory_model=memory_model,
                                   **{"workload": self.lengths, "global_batch": self.global_batch,
                                      **planner_kwargs})   # stage_split="auto": the dataset
        warn_stand_ins(self.planner.model_cfg, self.planner.num_stages,
                       stand_ins_of(self.planner.models), who="DynamicBatchSampler")
        self.epoch = 0
        self._cache: tuple[int, list[Plan], list[np.ndarray]] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation (and plans) of ``epoch``; call before each epoch, as with DistributedSampler."""
        self.epoch = int(epoch)

    def global_batches(self) -> list[np.ndarray]:
        """The epoch's global batches as arrays of dataset indices (see the module docstring)."""
        n = len(self.lengths)
        order = np.random.default_rng([self.seed, self.epoch]).permutation(n) if self.shuffle else np.arange(n)
        batches = [order[i:i + self.global_batch] for i in range(0, n, self.global_batch)]
        if self.drop_last and len(batches[-1]) < self.global_batch:
            batches.pop()
        elif len(batches) > 1 and len(batches[-1]) < self.num_replicas:   # too few to give every replica one
            tail = batches.pop()
            batches[-1] = np.concatenate([batches[-1], tail])
        return batches

    def num_global_batches(self) -> int:
        """Global batches (optimizer steps) in an epoch; needs no planning."""
        return len(self.global_batches())

    def _plan(self, k: int, batch: np.ndarray) -> Plan:
        try:
            return self.planner.plan(self.lengths[batch], method=self.method, mbs=self.mbs,
                                     meta={"epoch": self.epoch, "global_batch_index": k}).plan
        except PackingError as e:
            raise PackingError(f"DynamicBatchSampler (epoch {self.epoch}, global batch {k}): "
                               f"{_name_dataset_indices(str(e), batch)}") from None

    def settings(self) -> dict[str, Any]:
        """What every replica must share for the epoch's global batches not to overlap."""
        return {"seed": self.seed, "epoch": self.epoch, "shuffle": self.shuffle, "drop_last": self.drop_last,
                "global_batch": self.global_batch, "num_replicas": self.num_replicas, "method": self.method,
                "lengths": hashlib.sha256(self.lengths.tobytes()).hexdigest()[:12]}

    def _check_replicas_agree(self) -> None:
        """Raise on every rank when the group's samplers differ in ``settings()``, or name the ranks that
        never checked theirs within ``REPLICA_CHECK_TIMEOUT_S`` (module docstring)."""
        import torch.distributed as dist

        if not self.check_replicas or not dist.is_available() or not dist.is_initialized() \
                or dist.get_world_size() < 2:
            return
        every = _gather_settings(self.settings(), dist.get_rank(), dist.get_world_size())
        differ = {r: [k for k, v in s.items() if v != every[0][k]] for r, s in enumerate(every) if s != every[0]}
        if differ:
            r, keys = next(iter(differ.items()))
            said = ", ".join(f"{k} {every[r][k]!r} (rank 0: {every[0][k]!r})" for k in keys)
            raise ValueError(f"DynamicBatchSampler: rank(s) {', '.join(map(str, differ))} sample with other settings "
                             f"than rank 0 (rank {r}: {said}); data-parallel replicas given different settings "
                             "sample overlapping global batches: give every rank the same seed, lengths and "
                             "settings, and call set_epoch(epoch) on each")

    def _epoch(self) -> tuple[list[Plan], list[np.ndarray]]:
        if self._cache is None or self._cache[0] != self.epoch:
            self._check_replicas_agree()
            batches = self.global_batches()
            plans = [self._plan(k, b) for k, b in enumerate(batches)]
            self._cache = (self.epoch, plans, batches)
        return self._cache[1], self._cache[2]

    def plans(self) -> list[Plan]:
        """The epoch's plans, one per global batch (all replicas; ``plan.replica(rank)`` is this
        rank's). Their ``seq_ids`` are positions in the global batch: ``global_batches()[k]``
        maps them to dataset indices."""
        return self._epoch()[0]

    def records(self, k: int, plan: Plan, batch: np.ndarray) -> list[SampledMicrobatch]:
        """This rank's records of global batch ``k`` (planned as ``plan`` from the indices ``batch``)."""
        mine = [j for j, r in enumerate(plan.replica_of) if r == self.rank]
        tokens = int(sum(mb.real_tokens for mb in plan.microbatches))
        docs = int(sum(mb.num_seqs for mb in plan.microbatches))
        return [SampledMicrobatch(indices=batch[mb.seq_ids], lengths=mb.lengths, row_ids=mb.row_ids, rows=mb.batch,
                                  padded_len=mb.padded_len, epoch=self.epoch, global_batch=k, microbatch=j,
                                  local_index=i, local_count=len(mine), batch_tokens=tokens, batch_documents=docs,
                                  recompute=mb.recompute, dataset_lengths=self.lengths[batch[mb.seq_ids]])
                for i, j in enumerate(mine) for mb in (plan.microbatches[j],)]

    def __iter__(self) -> Iterator[SampledMicrobatch]:
        plans, batches = self._epoch()
        for k, (plan, batch) in enumerate(zip(plans, batches)):
            yield from self.records(k, plan, batch)

    def __len__(self) -> int:
        """Microbatches (records) this rank yields in the current epoch, over all its global batches."""
        plans, _ = self._epoch()
        return sum(sum(1 for r in plan.replica_of if r == self.rank) for plan in plans)
