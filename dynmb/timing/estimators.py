"""The one registry of fast makespan estimators: each schedule kind's record names its entry here.

A schedule kind (``dynmb.schedule.kinds.ScheduleKind``) names its estimator by ``estimate_as``, a key of this
registry (the schedule layer may not import the timing layer, so the record holds the key and this registry the
callable). ``dynmb.timing.makespan.makespans`` looks the entry up and calls it; nothing compares estimator
names. An entry (``Estimator``) is the callable ``makespans(F, B, comm, sizes, exact=, shares=, virtual=)`` of
many pipelines at once (pipeline k: the next ``sizes[k]`` columns of ``F`` / ``B`` ``[stages, M]`` and of
``comm`` ``[M]``; 0 for an empty one) and the traits its callers read:

- ``bound_regime``: above ``dynmb.timing.makespan.exact_regime`` it returns a lower bound, not the recurrence
  (GPipe / 1F1B); the others are one regime for every m.
- ``split_backward``: it reads the ``I / B``, ``W / B`` shares (``shares``, ``dynmb.timing.makespan_zb``).
- ``guarantee`` and ``tolerance``: what it is against ``dynmb.timing.simulate`` (the reference) of the schedule
  the kind's builder makes, on random pipelines (``tests/test_estimators.py`` checks every entry): ``exact``
  (equal up to ``tolerance``, relative), ``upper`` (never below it, at most ``tolerance`` above), ``approx``
  (within ``tolerance`` either way).

**Embedding last** (``PlanSpec.embedding = "last"``): the schedule gets the embedding stage on the last rank
(``dynmb.schedule.embedlast``); an entry's estimate of the plan's stages plus ``dynmb.timing.makespan.embed_terms``
(the embeds' work and two messages) is then, against the simulated step of that lifted schedule: for ``exact``
entries (where exact: not GPipe / 1F1B's bound regime) an upper bound, at most the terms above; for the ``upper``
and ``approx`` ones their own guarantee and tolerance, with embeds up to 5% of a stage's forward (the GPU model's:
0.4-1.7% for Llama-2-7B at P 8; the property tests draw them up to 5%). Without the terms an ``exact`` entry's
estimate falls below the step: by the first embed and its message at least.

The entries register themselves where they are implemented: ``gpipe`` and ``1f1b`` (``dynmb.timing.makespan``),
``zb-h1`` and ``zb`` (``dynmb.timing.makespan_zb``), ``interleaved`` (``dynmb.timing.makespan_interleaved``),
``zb-v`` (``dynmb.timing.makespan_zbv``). A new estimator is one module with its function and one
``register_estimator(Estimator(...))`` call, imported by ``dynmb.timing.makespan``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from dynmb.schedule.kinds import get_kind

__all__ = ["Estimator", "register_estimator", "get_estimator", "estimator_of", "estimator_names", "GUARANTEES"]

GUARANTEES = ("exact", "upper", "approx")
"""What an estimate is against the simulated step of the built schedule (module doc)."""

MakespansFn = Callable[..., np.ndarray]
"""``(F, B, comm, sizes, *, exact, shares, virtual) -> [len(sizes)]`` seconds (module doc)."""


@dataclass(frozen=True, kw_only=True)
class Estimator:
    """One fast makespan estimator (module doc)."""

    name: str
    """The key a kind's ``estimate_as`` names."""
    makespans: MakespansFn
    """The estimate of many pipelines at once."""
    guarantee: str
    """``exact``, ``upper`` or ``approx`` against the simulated step (module doc)."""
    tolerance: float
    """Relative margin of ``guarantee`` on random pipelines (the property test holds it)."""
    bound_regime: bool = False
    """Returns the pipeline / round-trip lower bound above ``exact_regime`` (GPipe / 1F1B)."""
    split_backward: bool = False
    """Reads the stages' ``I / B``, ``W / B`` shares."""

    def __post_init__(self) -> None:
        if self.guarantee not in GUARANTEES:
            raise ValueError(f"estimator {self.name!r}: guarantee must be one of {GUARANTEES}, got {self.guarantee!r}")
        if not self.tolerance >= 0:
            raise ValueError(f"estimator {self.name!r}: tolerance must be >= 0, got {self.tolerance!r}")


_REGISTRY: dict[str, Estimator] = {}


def register_estimator(est: Estimator, *, replace: bool = False) -> Estimator:
    """Add ``est`` (``replace``: overwrite an entry of the same name)."""
    if est.name in _REGISTRY and not replace:
        raise ValueError(f"estimator {est.name!r} is already registered")
    _REGISTRY[est.name] = est
    return est


def get_estimator(name: str) -> Estimator:
    """The entry ``name``; ``ValueError`` naming the registered ones otherwise."""
    est = _REGISTRY.get(name)
    if est is None:
        raise ValueError(f"unknown makespan estimator {name!r}; registered: {', '.join(_REGISTRY)}")
    return est


def estimator_of(kind: str) -> Estimator:
    """The estimator schedule kind ``kind``'s record names (``estimate_as``)."""
    rec = get_kind(kind)
    if rec.estimate_as not in _REGISTRY:
        raise ValueError(f"schedule kind {kind!r} names makespan estimator {rec.estimate_as!r}, which is not "
                         f"registered; registered: {', '.join(_REGISTRY)}")
    return _REGISTRY[rec.estimate_as]


def estimator_names() -> tuple[str, ...]:
    """Registered estimator names, in registration order."""
    return tuple(_REGISTRY)
