"""The one candidate search: generate candidates, evaluate each, choose by one rule.

Every "auto" choice of dynmb that weighs a few options of one thing has this shape; the planner's
(``dynmb.planning.search``: schedule kinds, ``dynamic``'s final check), fitting slices
(``dynmb.planning.slice_fitting``), ``recompute="auto"`` (``dynmb.packing.recompute``) and the reorder
searches (``dynmb.planning.reorder``) all use it. It sits in the timing layer so that the packers may.

1. Generate: a ``Candidate`` is a name, ``make`` (which makes it: a plan, a planned step, an order) and
   optionally ``floor``, a lower bound of its score that is cheaper than ``make`` (``prune`` below).
2. Evaluate (``evaluate``): each candidate made, in order, and judged by the caller's ``judge`` into a
   ``Verdict``: its ``score`` (what the rule minimises, seconds), whether it ``fits`` (the memory limit)
   and, for one that does not, its ``miss`` (how far from fitting; None: its score). A candidate whose
   ``make`` raises one of ``drop`` (default ``ValueError``) drops out with its error. With ``prune``, the
   floors are computed first, candidates are made in ascending floor, and one whose floor is above the best
   score that fits found so far is not made (``pruned``): its score is at least its floor, so it could not be
   chosen by ``fastest`` with ``rel_tie=0`` (nor be the best alternative of ``dynamic``'s robust rule). The
   outcomes come back in the candidates' order.
3. Choose (``fastest``): scan the made outcomes in order, keeping the first unless a later one is ``better``:
   one that fits beats one that does not; then by ``Verdict.key`` (fits: score, then miss; does not fit:
   miss, then score), exactly; with ``rel_tie > 0`` only the first key counts, and only when lower by more
   than that relative margin (a near tie keeps the earlier). None fits: the closest to fitting. None made:
   the first error is raised. ``better`` is also the test of first-improvement descents (the reorder search).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Generic, Sequence, TypeVar

__all__ = ["Candidate", "Verdict", "Outcome", "evaluate", "fastest", "better"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Candidate(Generic[T]):
    """One option of a search: its ``name``, ``make`` (which makes it) and ``floor`` (None: no cheap lower
    bound of its score; module doc, step 1)."""

    name: str
    make: Callable[[], T]
    floor: Callable[[], float] | None = None


@dataclass(frozen=True)
class Verdict:
    """A made candidate judged: ``score`` (minimised), ``fits`` and ``miss`` (how far from fitting, lower is
    closer; None: the score)."""

    score: float
    fits: bool = True
    miss: float | None = None

    def key(self) -> tuple[int, float, float]:
        """What the rule compares: fits first, by score then miss; else by miss then score."""
        miss = self.score if self.miss is None else self.miss
        return (0, self.score, miss) if self.fits else (1, miss, self.score)


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """A candidate evaluated: ``made`` and its ``verdict`` (both None when it dropped out with ``error`` or was
    ``pruned``)."""

    name: str
    made: T | None
    verdict: Verdict | None
    error: Exception | None = None
    pruned: bool = False

    @property
    def fits(self) -> bool:
        return self.verdict is not None and self.verdict.fits

    @property
    def score(self) -> float | None:
        return None if self.verdict is None else self.verdict.score


def _floors(candidates: Sequence[Candidate[T]], drop: tuple[type[Exception], ...],
            out: list[Outcome[T] | None]) -> list[float]:
    """Each candidate's floor (-inf without one); one whose floor raises ``drop`` drops out into ``out``."""
    floors = []
    for i, cand in enumerate(candidates):
        try:
            floors.append(float("-inf") if cand.floor is None else float(cand.floor()))
        except drop as e:
            log.debug("search: candidate %s drops out: %s", cand.name, e)
            out[i] = Outcome(cand.name, None, None, e)
            floors.append(float("inf"))
    return floors


def evaluate(candidates: Sequence[Candidate[T]], judge: Callable[[T], Verdict], *, prune: bool = False,
             drop: tuple[type[Exception], ...] = (ValueError,)) -> list[Outcome[T]]:
    """Every candidate made and judged, or dropped out, or (``prune``) pruned (module doc, step 2)."""
    out: list[Outcome[T] | None] = [None] * len(candidates)
    order = list(range(len(candidates)))
    floors = _floors(candidates, drop, out) if prune else [float("-inf")] * len(candidates)
    if prune:
        order.sort(key=lambda i: floors[i])           # stable: equal floors in the candidates' order
    best = float("inf")
    for i in order:
        cand = candidates[i]
        if out[i] is not None:
            continue
        if floors[i] > best:
            log.debug("search: candidate %s pruned: floor %.6g above %.6g", cand.name, floors[i], best)
            out[i] = Outcome(cand.name, None, None, pruned=True)
            continue
        try:
            made = cand.make()
        except drop as e:
            log.debug("search: candidate %s drops out: %s", cand.name, e)
            out[i] = Outcome(cand.name, None, None, e)
            continue
        verdict = judge(made)
        out[i] = Outcome(cand.name, made, verdict)
        if verdict.fits:
            best = min(best, verdict.score)
    return [o for o in out if o is not None]


def better(a: Verdict, b: Verdict, rel_tie: float = 0.0) -> bool:
    """``a`` beats ``b`` (module doc, step 3)."""
    ka, kb = a.key(), b.key()
    if ka[0] != kb[0]:
        return ka[0] < kb[0]
    if rel_tie > 0:
        return ka[1] < kb[1] * (1 - rel_tie)
    return ka < kb


def fastest(outcomes: Sequence[Outcome[T]], *, rel_tie: float = 0.0) -> Outcome[T]:
    """The outcome the rule keeps (module doc, step 3); the first error when none was made."""
    best: Outcome[T] | None = None
    for o in outcomes:
        if o.verdict is not None and (best is None or better(o.verdict, best.verdict, rel_tie)):  # type: ignore[arg-type]
            best = o
    if best is None:
        errors = [o.error for o in outcomes if o.error is not None]
        raise errors[0] if errors else ValueError("search: no candidate")
    return best
