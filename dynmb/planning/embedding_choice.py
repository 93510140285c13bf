"""``embedding="auto"``: the token embedding's pipeline rank (first or last) chosen once per run by simulated step.

The token embedding is a layer, so where it runs is part of the layout search: with it on the last rank
(``PlanSpec.embedding = "last"``, ``dynmb.schedule.embedlast``) stage 0 holds no table and admits larger
microbatches, at the price of the embeds' ops and messages on the last rank. Which is faster depends on the model,
the limit and the workload, and a proxy that leaves out the fill (``memory_split.step_proxy``) prefers ``last`` where
``first`` is faster, so the choice is by the simulated step:

1. **Setting** (``core.planspec.embedding_setting``): ``None`` is ``auto`` where the stage split is ``auto`` (the layout is
   searched), else ``first`` (plans, plan files and digests as before).
2. **Where ``last`` may run** (``last_refusal``): at least 2 pipeline ranks, an untied embedding (a tied one is the
   head's table, on the last stage already), dynmb's own families, a loop-placed kind or ``auto`` (the V placement
   holds the last stage on rank 0), the analytic memory model (a fitted one prices its own placement only); else
   ``first``, the reason said once (``say``).
3. **Choice on sample batches** (``choose_on_samples``), where a workload and a global batch size are given (the
   ``Planner``'s ``workload`` and ``global_batch``; ``dynmb plan`` / ``run`` / ``compare`` always): the sample batches
   the layout searches plan (``SplitSearch.sample_batches``: one replica's share of the global batch, drawn from the
   workload, stream ``seed``, steps 0, 1, ...), each planned at ``dp = 1`` under each placement's settings, resolved
   layout and models (the caller's: ``Planner`` and the command line resolve the stage split and its memory relief
   per placement). The smaller mean simulated step per real token wins (``split_search.batch_scores``: each batch's
   step scaled to ``first``'s real tokens on it, as the split and V searches score; ``first`` on a tie); a placement
   that cannot plan a sample batch loses; where neither can, ``first`` (the plan then says why). The choice is made
   once, before the first step (the ``Planner`` at construction), so every step and every verb sees the same place
   whatever its first batch; the first plan costs what a fixed place's costs.
4. **Choice on the first batch** (``choose_embedding``), without a workload or a global batch size: the first
   global batch is planned under each placement and the smaller simulated step wins, ``first`` on a tie; a
   placement that cannot plan the batch (``ValueError``) loses; where both cannot, the ``first`` error is raised.
   The winner's plan is returned too, so the batch is not planned a third time.

The choice is fixed for the run (its states live in one place).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from dynmb.core.config import ModelConfig
from dynmb.core.planspec import EMBEDDING_PLACES, EMBEDDING_SETTINGS, PlanSpec, embedding_setting
from dynmb.core.types import Plan, Schedule
from dynmb.costmodel.loader import Models
from dynmb.memory.model import MemoryModelLike
from dynmb.planning.planner import plan_step
from dynmb.planning.split_search import SplitSearch, batch_scores, sample_runs
from dynmb.planning.split_work import workload_lengths
from dynmb.schedule.kinds import AUTO, get_kind, is_schedule_name
from dynmb.timing.simulate import SimResult

__all__ = ["AUTO_EMBEDDING", "EMBEDDING_SETTINGS", "EmbeddingChoice", "Placement", "Workload", "embedding_setting",
           "last_refusal", "choose_embedding", "choose_on_samples", "fallback", "say"]

logger = logging.getLogger(__name__)

AUTO_EMBEDDING = EMBEDDING_SETTINGS[-1]
_SAID: set[str] = set()


@dataclass(frozen=True)
class EmbeddingChoice:
    """Where ``embedding="auto"`` put the token embedding, each placement's simulated step of the first batch, or
    its mean over the sample batches (None: not planned, or it could not plan them), and why."""

    place: str
    first_s: float | None
    last_s: float | None
    why: str
    batches: int = 1
    """How many batches were weighed: the first batch (1) or the workload's sample batches."""

    def describe(self) -> str:
        """One line: the place and why."""
        return f"embedding auto: {self.place} ({self.why})"


@dataclass(frozen=True)
class Placement:
    """One placement's settings (its ``embedding`` the place), the layout resolved for it and its models."""

    spec: PlanSpec
    model_cfg: ModelConfig
    models: Models[MemoryModelLike]


def last_refusal(spec: PlanSpec, model_cfg: ModelConfig, *, own_model: bool, memory_model_given: bool) -> str | None:
    """Why the embedding cannot be placed ``last`` under ``spec`` (module doc, step 2), or None where it can;
    ``spec.num_stages // spec.virtual`` counts the pipeline ranks."""
    kind = spec.schedule_kind
    if spec.num_ranks < 2:
        return "one pipeline rank: first and last are the same rank"
    if model_cfg.tie_embeddings:
        return "a tied embedding is the LM head's table, on the last stage already"
    if own_model:
        return "a model of your own places its own embedding"
    if kind != AUTO and (not is_schedule_name(kind) or get_kind(kind).placement != "loop"):
        return f"the {kind} schedule's placement holds the last stage on rank 0 with the first"
    if memory_model_given:
        return "a fitted memory model prices the placement it was measured on"
    return None


def fallback(why: str) -> EmbeddingChoice:
    """``first`` for the reason ``why``, said once per process."""
    choice = EmbeddingChoice(place="first", first_s=None, last_s=None, why=f"last not weighed: {why}")
    say(choice)
    return choice


def say(choice: EmbeddingChoice) -> None:
    """Log the choice once per distinct line in this process."""
    line = choice.describe()
    if line not in _SAID:
        _SAID.add(line)
        logger.info("%s", line)


Planned = tuple[Plan, Schedule, SimResult]


@dataclass(frozen=True)
class Workload:
    """What the choice on sample batches draws them from (module doc, step 3): the workload (lengths, a trace name
    or a length-trace CSV: ``split_work.workload_lengths``), the global batch size and the sample stream's seed."""

    lengths: Any
    global_batch: int
    seed: int = 0

    def sample_batches(self, spec: PlanSpec, model_cfg: ModelConfig) -> list[np.ndarray]:
        """The layout searches' sample batches (``SplitSearch.sample_batches``) of ``spec``'s dp."""
        search = SplitSearch(spec=spec, global_batch=int(self.global_batch), seed=int(self.seed))
        return search.sample_batches(workload_lengths(self.lengths, model_cfg))


def _check_places(placements: Sequence[Placement]) -> list[str]:
    places = [p.spec.embedding for p in placements]
    if places != list(EMBEDDING_PLACES):
        raise ValueError(f"the embedding's choice weighs the placements {list(EMBEDDING_PLACES)}, got {places}")
    return places


def _planned(lengths: np.ndarray, placement: Placement, meta: dict[str, Any] | None) -> Planned | ValueError:
    try:
        return plan_step(lengths, placement.spec, model_cfg=placement.model_cfg, models=placement.models, meta=meta)
    except ValueError as e:
        return e


def choose_embedding(lengths: Any, placements: Sequence[Placement],
                     meta: dict[str, Any] | None = None) -> tuple[EmbeddingChoice, Placement, Planned]:
    """``lengths`` planned under each of ``placements`` (``first`` then ``last``); the faster simulated step wins
    (module doc, step 4): the choice (said), the winning placement and its plan of ``lengths``."""
    places = _check_places(placements)
    batch = np.asarray(lengths, dtype=np.int64)
    outcomes = [_planned(batch, p, meta) for p in placements]
    steps = [None if isinstance(o, ValueError) else float(o[2].makespan_s) for o in outcomes]
    if steps[0] is None and steps[1] is None:
        assert isinstance(outcomes[0], ValueError)
        raise outcomes[0]
    best = 1 if steps[0] is None or (steps[1] is not None and steps[1] < steps[0]) else 0
    shown = ", ".join(f"{place} {'cannot plan it' if s is None else f'{s:.4f} s'}" for place, s in zip(places, steps))
    choice = EmbeddingChoice(place=places[best], first_s=steps[0], last_s=steps[1],
                             why=f"the first batch's simulated step: {shown}")
    say(choice)
    won = outcomes[best]
    assert not isinstance(won, ValueError)
    return choice, placements[best], won


def choose_on_samples(workload: Workload, placements: Sequence[Placement]) -> tuple[EmbeddingChoice, Placement]:
    """The workload's sample batches planned under each of ``placements`` (``first`` then ``last``); the smaller
    mean simulated step per real token wins (module doc, step 3): the choice (said) and the winning placement."""
    places = _check_places(placements)
    batches = workload.sample_batches(placements[0].spec, placements[0].model_cfg)
    runs = [sample_runs(batches, p.spec.with_(dp=1), p.model_cfg, p.models) for p in placements]
    scores = [float(np.mean(row)) for row in batch_scores(runs)]
    best = 1 if scores[1] < scores[0] else 0
    steps = [float(np.mean(r[0])) if np.isfinite(s) else None for r, s in zip(runs, scores)]
    shown = ", ".join(f"{place} {'cannot plan them' if s is None else f'{s:.4f} s'}" for place, s in zip(places, steps))
    why = f"mean simulated step per real token of {len(batches)} sample batches of the workload: {shown}"
    if steps[0] is None and steps[1] is None:
        why = f"neither place plans the {len(batches)} sample batches of the workload: first"
    choice = EmbeddingChoice(place=places[best], first_s=steps[0], last_s=steps[1], why=why, batches=len(batches))
    say(choice)
    return choice, placements[best]
