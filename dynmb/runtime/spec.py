"""What a torchrun job runs: typed run specs and their JSON form (``out_dir/spec.json``).

A ``RunSpec`` is one run: its ``RunConfig``, where its tables go, its run id and label,
and how it is checked (``verify``, ``allow_over_limit``, a fitted ``memory_model``). A
``JobSpec`` is the cases one torchrun job runs in the same process group (start-up paid
once): one after another, or with ``interleave`` (CPU) round by round, step k of every case
before step k + 1 (what ``dynmb compare`` does). ``hooks`` names a ``StepHooks`` factory by
import path (``"package.module:name"`` plus JSON keyword arguments); every rank builds it
and hands it to the step runner. Tests inject faults through it; runs leave it empty.

JSON form (``JobSpec.to_dict``): a job of one case written for that case's own folder is
the case itself::

    {"run": RunConfig.to_dict(), "out_dir": ..., "run_id": ..., "label": ...,
     "verify": bool, "allow_over_limit": bool, "memory_model": path | null,
     "calibrate": bool | null, "hooks": {"target": "mod:name", "kwargs": {...}} | null}

any other job is ``{"out_dir": ..., "cases": [case, ...], "interleave": bool}``.
``JobSpec.from_dict`` reads both. The worker reads it (see ``dynmb.runtime.worker``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from dynmb.atomic import write_text_atomic
from dynmb.config import RunConfig

__all__ = ["HookRef", "RunSpec", "JobSpec"]

_RUN_KEYS = ("run", "out_dir", "run_id", "label", "verify", "allow_over_limit", "memory_model", "calibrate", "hooks")
_JOB_KEYS = ("out_dir", "cases", "interleave")


def _check_keys(data: Mapping[str, Any], known: tuple[str, ...], what: str) -> None:
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{what}: unknown key(s) {unknown}; expected {list(known)}")


@dataclass(frozen=True, kw_only=True)
class HookRef:
    """A ``StepHooks`` factory named by import path, built on every rank (``runtime.hooks.load_hooks``)."""

    target: str
    """``"package.module:name"``: a callable returning the hooks object (a class works)."""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """JSON keyword arguments of that callable."""

    def __post_init__(self) -> None:
        module, sep, name = self.target.partition(":")
        if not sep or not module or not name:
            raise ValueError(f"hooks target {self.target!r} is not 'package.module:name'")

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "kwargs": dict(self.kwargs)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HookRef:
        _check_keys(data, ("target", "kwargs"), "hooks")
        return cls(target=str(data["target"]), kwargs=dict(data.get("kwargs") or {}))


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One run of a job: its configuration, its output and how it is checked."""

    run: RunConfig
    """What to run."""
    out_dir: str
    """Absolute folder of its ``steps``/``actions``/``memory``/``runs`` tables."""
    run_id: str
    """The ``run_id`` column of every row it writes."""
    label: str | None = None
    """The ``label`` column of its steps (default: the method): names a case of a compare job."""
    verify: bool = False
    """Check every step's gradients against a single-process reference."""
    allow_over_limit: bool = False
    """Report a measured peak over the memory limit instead of failing the run."""
    memory_model: str | None = None
    """Fitted memory-model JSON; None: the analytic model."""
    calibrate: bool | None = None
    """Add the runtime overhead measured on the warm-up steps to the cost model; None: on CPU."""
    hooks: HookRef | None = None
    """Step hooks every rank builds (tests: fault injection); None: none."""

    @classmethod
    def create(cls, run: RunConfig, out_dir: str | Path, *, run_id: str | None = None, label: str | None = None,
               verify: bool = False, allow_over_limit: bool = False, memory_model: str | None = None,
               calibrate: bool | None = None, hooks: HookRef | None = None) -> RunSpec:
        """A spec for ``run`` writing to ``out_dir`` (made absolute); ``run_id`` defaults to
        ``<method>-<schedule>-<8 hex digits>``."""
        rid = run_id or f"{run.method}-{run.pipeline.schedule}-{uuid.uuid4().hex[:8]}"
        return cls(run=run, out_dir=str(Path(out_dir).resolve()), run_id=rid, label=label, verify=verify,
                   allow_over_limit=allow_over_limit, memory_model=memory_model, calibrate=calibrate, hooks=hooks)

    @property
    def display_label(self) -> str:
        """The ``label`` column: the label, else the method."""
        return self.label or self.run.method

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run.to_dict(), "out_dir": self.out_dir, "run_id": self.run_id, "label": self.label,
                "verify": self.verify, "allow_over_limit": self.allow_over_limit, "memory_model": self.memory_model,
                "calibrate": self.calibrate, "hooks": self.hooks.to_dict() if self.hooks else None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunSpec:
        _check_keys(data, _RUN_KEYS, "run spec")
        hooks = data.get("hooks")
        return cls(run=RunConfig.from_dict(data["run"]), out_dir=str(data["out_dir"]),
                   run_id=str(data.get("run_id") or "run"), label=data.get("label"),
                   verify=bool(data.get("verify", False)), allow_over_limit=bool(data.get("allow_over_limit", False)),
                   memory_model=data.get("memory_model"), calibrate=data.get("calibrate"),
                   hooks=HookRef.from_dict(hooks) if hooks else None)


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """The runs of one torchrun job, in one process group."""

    out_dir: str
    """Folder of ``spec.json`` and ``errors/rank<k>.txt``."""
    cases: tuple[RunSpec, ...]
    """The runs, in order."""
    interleave: bool = False
    """CPU: round by round (step k of every case, then step k + 1) instead of one after another."""

    def __post_init__(self) -> None:
        if not self.cases:
            raise ValueError("a job needs at least one case")

    @classmethod
    def single(cls, spec: RunSpec) -> JobSpec:
        """The job of one run, in the run's own folder."""
        return cls(out_dir=spec.out_dir, cases=(spec,))

    @property
    def is_single(self) -> bool:
        """One run in its own folder: the JSON form is the run's spec itself."""
        return len(self.cases) == 1 and not self.interleave and self.cases[0].out_dir == self.out_dir

    @property
    def total_steps(self) -> int:
        """Warm-up plus measured steps over every case."""
        return sum(c.run.warmup + c.run.steps for c in self.cases)

    def to_dict(self) -> dict[str, Any]:
        if self.is_single:
            return self.cases[0].to_dict()
        return {"out_dir": self.out_dir, "cases": [c.to_dict() for c in self.cases], "interleave": self.interleave}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobSpec:
        if "cases" not in data:
            return cls.single(RunSpec.from_dict(data))
        _check_keys(data, _JOB_KEYS, "job spec")
        return cls(out_dir=str(data["out_dir"]), cases=tuple(RunSpec.from_dict(c) for c in data["cases"]),
                   interleave=bool(data.get("interleave", False)))

    def save(self, path: str | Path) -> Path:
        """Write the JSON form to ``path`` (atomically)."""
        return write_text_atomic(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> JobSpec:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"spec file {path} is not valid JSON: {e}") from None
        return cls.from_dict(data)
