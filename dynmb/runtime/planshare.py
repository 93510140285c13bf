"""Planning ahead shared by the ranks: each rank plans its own steps, every rank reads them.

Planning is deterministic and every rank plans with the same calibrated model at the same point
(``dynmb.runtime.planahead``), so one rank's plan of a step is every rank's. With ``W`` ranks,
step ``k`` is *owned* by rank ``k mod W``: only the owner plans it (in its planner processes),
publishes the result in the job's key-value store (the one ``torch.distributed`` rendezvoused
with), and every other rank reads it from there. Each rank's ``n`` planner processes then plan
``n`` of every ``n x W`` steps, so a plan delays a step only when it takes longer than ``n x W``
steps, against ``n`` steps when every rank plans every step (a 256-rank job, P 32 x DP 8, keeps a
plan 12.6x the step off the critical path with one planner process per rank).

Protocol (``PlanShare``): the owner ``publish``es a plan under ``dynmb/plan/<run id>/<step>`` as
soon as it has it (pickled: the plan, its schedule and simulation, as the planner processes
return them); a reader's ``fetch`` blocks in the store's ``get`` (bounded by the process group's
timeout: a dead owner fails the job, never hangs it) and counts itself in
``.../<step>/read``; the last of the ``W - 1`` readers deletes both keys, so the store holds
only plans not yet read by everyone.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from typing import Any, Protocol, cast

__all__ = ["PlanShare", "KeyValueStore", "job_store"]


class KeyValueStore(Protocol):
    """What ``torch.distributed.Store`` offers and ``PlanShare`` (and ``ready.wait_for_ranks``) use."""

    def set(self, key: str, value: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, amount: int) -> int: ...
    def delete_key(self, key: str) -> bool: ...
    def check(self, keys: list[str]) -> bool: ...


@dataclass(frozen=True)
class PlanShare:
    """One rank's view of the shared plans of run ``run_id`` (``rank`` of ``world``)."""

    store: KeyValueStore
    rank: int
    world: int
    run_id: str

    def owner(self, step: int) -> int:
        """The rank that plans step ``step``."""
        return step % self.world

    def owns(self, step: int) -> bool:
        return self.owner(step) == self.rank

    def _key(self, step: int) -> str:
        return f"dynmb/plan/{self.run_id}/{step}"

    def publish(self, step: int, planned: Any) -> None:
        """The owner's plan of ``step``, for every other rank."""
        if self.world > 1:
            self.store.set(self._key(step), pickle.dumps(planned, protocol=pickle.HIGHEST_PROTOCOL))

    def fetch(self, step: int) -> tuple[Any, float]:
        """``(planned, wait_s)``: the owner's plan of ``step``, blocking until it is published."""
        key = self._key(step)
        t0 = time.perf_counter()
        try:
            data = self.store.get(key)
        except Exception as e:  # noqa: BLE001 - the store's timeout (DistStoreError) names only its key
            cause = " ".join(str(e).split())[:200]
            raise RuntimeError(f"plan ahead: rank {self.rank} got no plan of step {step} from rank "
                               f"{self.owner(step)}, which plans it (its planner processes, or the rank itself, "
                               f"stopped or died: {type(e).__name__}: {cause})") from None
        planned = pickle.loads(data)
        wait_s = time.perf_counter() - t0
        if self.store.add(key + "/read", 1) >= self.world - 1:      # the last reader cleans up
            self.store.delete_key(key)
            self.store.delete_key(key + "/read")
        return planned, wait_s


def job_store() -> KeyValueStore:
    """The store ``torch.distributed`` rendezvoused with (``init_process_group``'s default group)."""
    import torch.distributed as dist
    return cast(KeyValueStore, dist.distributed_c10d._get_default_store())
