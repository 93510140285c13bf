"""``Predictions``: what the planner predicted for a plan (``Plan.predictions``), typed.

Fields are filled in two passes: the packer's (``pred_peak_bytes`` per stage from the memory
model's peak rule, ``est_makespan_s`` from the fast estimate ``dynmb.timing.makespan``, per replica in
``est_replica_makespan_s`` with data parallelism, ``plan_s``), then the planner's
(``pred_step_s`` and ``mean_bubble`` from the simulator, ``pred_peak_bytes`` replaced by the
simulated peaks, ``pred_rank_peak_bytes`` the simulated peak of each replica's GPUs, ``plan_s`` the whole
step's planning time). A field not predicted is None (a plan file written before a field existed lacks it).

It is also a read-only ``Mapping`` of its set fields (``plan.predictions["pred_step_s"]``,
``.get(...)``, ``{**plan.predictions}``), which is the JSON form (``to_dict`` / ``from_dict``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Iterator

__all__ = ["Predictions"]


@dataclass(frozen=True, kw_only=True)
class Predictions(Mapping):
    """The planner's predictions for one plan (module doc)."""

    pred_step_s: float | None = None
    """Simulated step time: the slowest replica's makespan (seconds)."""
    pred_peak_bytes: tuple[int, ...] | None = None
    """Predicted peak bytes per stage (the highest over the replicas)."""
    pred_rank_peak_bytes: tuple[tuple[int, ...], ...] | None = None
    """Predicted peak bytes of each GPU, ``[replica][pipeline rank]``: the simulator's ``peak_bytes_rank`` of the
    replica's schedule, rounded up (the stages the rank holds at once: interleaved chunks, the embedding stage
    beside the last)."""
    mean_bubble: float | None = None
    """Mean bubble fraction over the ranks of the slowest replica."""
    plan_s: float | None = None
    """Wall time of planning (packing, reordering, scheduling)."""
    est_makespan_s: float | None = None
    """The packer's fast makespan estimate (the slowest replica's)."""
    est_replica_makespan_s: tuple[float, ...] | None = None
    """The packer's estimate per data-parallel replica (dp > 1 only)."""

    def __post_init__(self) -> None:
        for name in ("pred_step_s", "mean_bubble", "plan_s", "est_makespan_s"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, float(v))
        if self.pred_peak_bytes is not None:
            object.__setattr__(self, "pred_peak_bytes", tuple(int(x) for x in self.pred_peak_bytes))
        if self.pred_rank_peak_bytes is not None:
            object.__setattr__(self, "pred_rank_peak_bytes",
                               tuple(tuple(int(x) for x in ranks) for ranks in self.pred_rank_peak_bytes))
        if self.est_replica_makespan_s is not None:
            object.__setattr__(self, "est_replica_makespan_s", tuple(float(x) for x in self.est_replica_makespan_s))

    # --- the mapping view of the set fields -----------------------------------------------------
    def _set(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    def __getitem__(self, key: str) -> Any:
        value = getattr(self, key, None) if isinstance(key, str) and not key.startswith("_") else None
        if value is None:
            raise KeyError(key)
        return list(value) if isinstance(value, tuple) else value

    def __iter__(self) -> Iterator[str]:
        return iter(self._set())

    def __len__(self) -> int:
        return len(self._set())

    def updated(self, **changes: Any) -> "Predictions":
        """A copy with ``changes`` (None clears a field)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The set fields, JSON-ready (tuples as lists)."""
        return {k: self[k] for k in self}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "Predictions":
        """From a mapping of fields (a plan JSON's ``predictions``); unknown keys are refused."""
        if isinstance(data, Predictions):
            return data
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"predictions: unknown field(s) {unknown}; expected some of {sorted(known)}")
        return cls(**data)
