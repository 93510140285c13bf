"""One planning step: pack a global batch, order it, build and validate the schedule, simulate.

``plan_step`` is what ``dynmb plan``, ``dynmb run`` (on every rank, deterministically)
and ``dynmb compare`` call, so the plan that is simulated is the plan that runs:

    lengths --pack--> Plan --reorder--> Plan --build_schedule--> Schedule --simulate--> SimResult

It takes the settings as one ``PlanSpec`` (``dynmb.core.planspec``), which the plan records.
With ``schedule_kind="auto"`` (``plan_auto``) the step is planned for every kind that
``dynmb.schedule.kinds.auto_kinds`` admits, each packed, ordered and scheduled for its own kind,
and the fastest simulated step that fits the memory limit is kept; the plan records the chosen
kind, the spec ``auto`` (``dynamic`` with slices of long sequences: each kind's own sliced search first, then
the weighing of the plain methods' sliced plans on the kinds near the fastest, ``slicing.kinds_to_weigh``).
``dynamic`` weighs its own plan against the baselines at their best budgets and every other method's plan under the same settings (``final_candidates``; each packed and ordered first, and
scheduled and simulated only when its lower bound, ``step_floor``, could still beat the best alternative made).
Both are the one candidate search of ``dynmb.planning.search`` (candidates, each planned and simulated, one
choice rule).
Each data-parallel replica is reordered, scheduled and simulated by the helpers of
``dynmb.planning.replicas``, which stitch the replicas back into one plan.

With ``slice_fitting="auto"`` each kind's plan is weighed against plans that slice sequences which fit
(``dynmb.planning.slice_fitting``) and the fastest that fits is that kind's plan.

The plan records the models it was made with (``meta.models``: each one's digest, whether the cost
model was calibrated and its online-refit version; ``dynmb.costmodel.loader.models_record``).

The plan's ``predictions`` are filled from the simulator (``pred_step_s``,
``pred_peak_bytes`` per stage, ``mean_bubble``) and the wall time of packing +
reordering + scheduling (``plan_s``). With data parallelism each replica's
schedule is the same shape (same microbatch count; with slices of long sequences
the replicas may differ, ``dynmb.planning.slicing``); the step's predicted time is
the slowest replica's.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import functools
import hashlib
import itertools
import logging
import math
import pickle
import time
from dataclasses import dataclass, replace
from typing import Any, Iterator, cast

import numpy as np

from dynmb.memory.model import MemoryModelLike
from dynmb.core.config import ModelConfig
from dynmb.costmodel.loader import Models, models_record, spec_models
from dynmb.packing import METHODS, pack
from dynmb.packing.balanced import budget_divisors
from dynmb.packing.context import PackContext
from dynmb.packing.methods import get_method, shared_plans
from dynmb.packing import methods as packing_methods
from dynmb.core.planspec import PlanSpec
from dynmb.schedule.kinds import AUTO, ScheduleKind, auto_kinds_for, get_kind
from dynmb.timing.makespan_zb import ranking_kind
from dynmb.timing.simulate import SimResult
from dynmb.core.types import Plan, Schedule
from dynmb.planning.search import Candidate, Outcome, Planned, evaluate, fastest, fits, robust, step_floor
from dynmb.planning.defaults import reorder_for
from dynmb.planning.reorder import reorder as reorder_plan
from dynmb.planning import reorder as reorder_module
from dynmb.packing.lockstep import forgetful
from dynmb.packing import dynapipe
from dynmb.schedule import zerobubble
from dynmb.timing import makespan_zb
from dynmb.costmodel.gpu import GPUCostModel
from dynmb.planning.replicas import (ReplicaPrediction, make_schedule, predict_replicas, replica_schedules,
                                     replicas_of, stitch)
from dynmb.planning.ramped import BODY_SCALES, ramped_plan
from dynmb.planning.slice_fitting import plan_fitting
from dynmb.planning.offload import plan_offload
from dynmb.planning.slicing import kinds_to_weigh, longest_row, own_searches_only, plan_split, reuse_searches, weighs
from dynmb.planning.spec_check import lockstep_refusal

schedule_validate = importlib.import_module("dynmb.schedule.validate")  # dynmb.schedule.validate: the function

__all__ = ["plan_step", "plan_auto", "make_schedule", "final_settings", "unpruned_final_check", "unremembered"]

log = logging.getLogger(__name__)


def plan_step(lengths: np.ndarray, spec: PlanSpec, *, model_cfg: ModelConfig,
              models: Models[MemoryModelLike] | None = None,
              meta: dict[str, Any] | None = None) -> tuple[Plan, Schedule, SimResult]:
    """Pack, reorder, schedule and simulate one global batch under the settings ``spec``.

    Returns ``(plan, schedule, sim)``; for ``dp > 1`` the schedule and simulation
    are replica 0's and the plan's predictions hold the slowest replica's time.
    ``models``: the cost and memory models (``dynmb.costmodel.loader.Models``; None: the analytic stand-ins,
    ``Models.analytic``); ``meta`` is added to the plan's. The plan records ``spec`` (``Plan.spec``).
    ``spec.schedule_kind == "auto"``: the step is planned for each kind of
    ``dynmb.schedule.kinds.auto_kinds`` and the fastest that fits is returned (``plan_auto``).
    ``spec.offload == "auto"``: also planned with activation offload and the faster kept (``plan_offload``).
    """
    if not isinstance(spec, PlanSpec):
        raise TypeError(f"plan_step takes the settings as one PlanSpec, got {type(spec).__name__}")
    if (refusal := lockstep_refusal(spec)) is not None:
        raise ValueError(refusal)
    models = spec_models(models or Models.analytic(model_cfg, spec.num_stages), spec)  # embedding, shards
    lengths = np.asarray(lengths, dtype=np.int64)

    def step(s: PlanSpec, m: Models[MemoryModelLike]) -> Planned:
        return plan_auto(lengths, s, model_cfg, m, meta) if s.schedule_kind == AUTO else \
            _plan_checked(lengths, s, model_cfg, m, meta)
    with shared_plans():                                      # the step's kinds and candidates share plans
        plan, sched, sim = plan_offload(spec, models, step)  # offload "auto": dynmb.planning.offload
    # which models made it: every consumer of the plan checks (or, calibrated, re-predicts) against these
    return replace(plan, meta=plan.meta.with_(models=models_record(models))), sched, sim


def _sliced(lengths: np.ndarray, spec: PlanSpec, model_cfg: ModelConfig, memory_model: MemoryModelLike) -> bool:
    return spec.oversize == "split" and bool(lengths.size) and \
        lengths.max() > longest_row(spec, model_cfg, memory_model)


def _plan_kind(lengths: np.ndarray, spec: PlanSpec, kind: ScheduleKind, model_cfg: ModelConfig,
               models: Models[MemoryModelLike], meta: dict[str, Any] | None,
               packs: dict[tuple, tuple[Plan, float]] | None = None) -> tuple[Plan, Schedule, SimResult]:
    """``plan_step`` for one schedule kind (``kind``: the record of ``spec.schedule_kind``); ``packs``: packings already made in this step, by the kind's
    ``packing_key`` (with the seconds they took), shared by kinds the packers cannot tell apart."""
    packed = _pack_kind(lengths, spec, kind, model_cfg, models, meta, packs)
    return packed if isinstance(packed, tuple) else _schedule_kind(packed, spec, models, meta)


@dataclass(frozen=True)
class _Packed:
    """One kind's plan packed and each replica in its order, before any schedule (what ``step_floor`` reads)."""

    plan: Plan
    replicas: list[Plan]
    reorder: str
    plan_s: float
    """Seconds packing and ordering took."""


def _pack_kind(lengths: np.ndarray, spec: PlanSpec, kind: ScheduleKind, model_cfg: ModelConfig,
               models: Models[MemoryModelLike], meta: dict[str, Any] | None,
               packs: dict[tuple, tuple[Plan, float]] | None = None) -> _Packed | Planned:
    """``_plan_kind``'s packing and order (a plan with slices of long sequences: planned whole)."""
    t0 = time.perf_counter()
    if _sliced(lengths, spec, model_cfg, models.memory):
        if spec.reorder not in ("none", "auto"):
            raise ValueError(f"reorder {spec.reorder!r}: a plan with slices of long sequences runs in its planned "
                             f"order (reorder 'none' or 'auto')")
        plan, sched, sim = plan_split(lengths, spec, kind, model_cfg=model_cfg, models=models,
                                      make_schedule=make_schedule)
        preds = plan.predictions.updated(plan_s=time.perf_counter() - t0)     # the slowest replica's step
        return replace(plan, predictions=preds, spec=spec,
                       meta=plan.meta.merged(meta).with_(reorder="none")), sched, sim
    key = kind.packing_key
    shared = packs.get(key) if packs is not None else None
    if shared is None:
        plan = pack(lengths, spec.with_(oversize="error") if spec.oversize == "split" else spec,
                    models=models)
        pack_s = time.perf_counter() - t0
        if packs is not None:
            packs[key] = (plan, pack_s)
    else:                                           # the same packing: only the kind differs
        plan, pack_s = replace(shared[0], schedule_kind=spec.schedule_kind, spec=spec), shared[1]
    t1 = time.perf_counter()
    replicas = replicas_of(plan)
    reorder = reorder_for(spec.method, spec.reorder)          # "auto": the method's own order
    if reorder != "none":
        replicas = [reorder_plan(p, reorder, models=models, schedule_kind=kind, virtual=spec.virtual)
                    for p in replicas]
    return _Packed(plan, replicas, reorder, pack_s + time.perf_counter() - t1)


def _schedule_kind(packed: _Packed, spec: PlanSpec, models: Models[MemoryModelLike],
                   meta: dict[str, Any] | None) -> Planned:
    """``_plan_kind``'s schedules of a packed plan, simulated, stitched into one plan."""
    t1 = time.perf_counter()
    replicas = packed.replicas
    scheds, predicted = _simulated(packed, spec, models)
    plan_s = packed.plan_s + time.perf_counter() - t1
    plan = stitch(packed.plan, replicas, {"reorder": packed.reorder, "virtual": spec.virtual, **(meta or {})})
    plan = replace(plan, schedule_kind=spec.schedule_kind, spec=spec,
                   predictions=predicted.predictions.updated(plan_s=plan_s))
    return plan, scheds[0], predicted.sims[0]


REMEMBER = True
"""``plan_auto`` schedules and simulates a packed plan once: a candidate whose replicas (every field), base
predictions and settings equal an earlier one's of the same step (``zb``'s ramped fills at two body scales often
come out the same plan) reuses its schedules and simulations (``_simulated``). False: every one afresh."""

_MADE: contextvars.ContextVar[dict[bytes, tuple[list[Schedule], ReplicaPrediction]] | None] = \
    contextvars.ContextVar("dynmb_planner_made", default=None)


def _simulated(packed: _Packed, spec: PlanSpec,
               models: Models[MemoryModelLike]) -> tuple[list[Schedule], ReplicaPrediction]:
    """Each replica's schedule and the replicas' simulations (``REMEMBER``: once per step for equal inputs, keyed
    by a digest of their pickled form)."""
    memo = _MADE.get() if REMEMBER else None
    key = None
    if memo is not None:
        try:
            key = hashlib.sha256(pickle.dumps((packed.replicas, packed.plan.predictions, spec))).digest()
        except (pickle.PicklingError, TypeError, AttributeError):      # not picklable: made afresh
            key = None
        if key is not None and key in memo:
            log.debug("plan: %s on %s as packed before: its schedules and simulations reused", spec.method,
                      spec.schedule_kind)
            return memo[key]
    scheds = replica_schedules(packed.replicas, spec, models=models)
    predicted = predict_replicas(packed.replicas, scheds, models, packed.plan.predictions)
    if memo is not None and key is not None:
        memo[key] = (scheds, predicted)
    return scheds, predicted


@contextlib.contextmanager
def unremembered() -> Iterator[None]:
    """Within it nothing a plan computes is remembered: the planner's ``REMEMBER``, ``lockstep.forgetful``, the
    ``zb`` schedules (``zerobubble.REMEMBERED``), the flattened schedules (``validate.REMEMBERED``), the zb
    estimate's pipelines (``makespan_zb.REMEMBERED``), ``dynapipe``'s splits, ``GPUCostModel``'s cost lookups, the
    plans a step's kinds share (``packing.methods.SHARE_PLANS``) and the reorder search's orders
    (``reorder.REMEMBERED``) all off: the same plans, every schedule, simulation, fill, split, cost lookup, packing
    and order made afresh (the plan time as before)."""
    global REMEMBER
    memos = [(zerobubble, "REMEMBERED"), (schedule_validate, "REMEMBERED"), (makespan_zb, "REMEMBERED"),
             (dynapipe, "REMEMBERED"), (GPUCostModel, "COSTS_REMEMBERED"), (packing_methods, "SHARE_PLANS"),
             (reorder_module, "REMEMBERED")]
    was = [REMEMBER, *(getattr(owner, name) for owner, name in memos)]
    REMEMBER = False
    for owner, name in memos:
        setattr(owner, name, 0)
    try:
        with forgetful():
            yield
    finally:
        REMEMBER = was[0]
        for (owner, name), value in zip(memos, was[1:]):
            setattr(owner, name, value)


FINAL_CHECK = 3
"""``dynamic``'s plan is weighed against ``FINAL_METHODS`` at this many token budgets, those the fast
estimate ranks best for ``balanced`` (``packing.balanced.budget_divisors``), and at each one's neighbours
(budget x 2 and / 2: the estimate misses by a few per cent, e.g. ``balanced/2`` on P 16 longtail)."""

FINAL_METHODS = ("balanced", "token-budget")
"""The token-budget groupings of the final check: verl's dynamic batching and the plain token budget, each
at the ``FINAL_CHECK`` budgets (as ``dynmb compare``'s ``-best`` rows tune them in hindsight)."""

FINAL_PRUNE = True
"""The final check schedules and simulates only the candidates whose ``step_floor`` is not above the best
alternative's step that fits found so far (``dynmb.planning.search``: the choice is the same); False: every one."""


@contextlib.contextmanager
def unpruned_final_check() -> Iterator[None]:
    """Within it ``dynamic``'s final check schedules and simulates every candidate (``FINAL_PRUNE`` off): the
    same plans, the plan time as before pruning (``benchmarks/plan_cores.py --full-check``, the tests)."""
    global FINAL_PRUNE
    was, FINAL_PRUNE = FINAL_PRUNE, False
    try:
        yield
    finally:
        FINAL_PRUNE = was


def _plan_checked(lengths: np.ndarray, spec: PlanSpec, model_cfg: ModelConfig, models: Models[MemoryModelLike],
                  meta: dict[str, Any] | None,
                  packs: dict[tuple, tuple[Plan, float]] | None = None) -> tuple[Plan, Schedule, SimResult]:
    """``_plan_final``; with ``spec.slice_fitting == "auto"`` the plans that slice sequences which fit are
    weighed against it and the fastest that fits is kept (``dynmb.planning.slice_fitting``); ``plan_s``
    counts both. The step's entry for one kind: ``spec.schedule_kind`` (never ``auto`` here) is resolved here,
    once, and its record handed down (the packers, the reorder search, slicing)."""
    t0 = time.perf_counter()
    kind = get_kind(spec.schedule_kind)
    best = _plan_final(lengths, spec, kind, model_cfg, models, meta, packs)
    if spec.slice_fitting == "never":
        return best
    plan, sched, sim = plan_fitting(lengths, spec, best, kind=kind, model_cfg=model_cfg, models=models, fits=fits)
    if plan.meta.slice_threshold is not None:            # a plan with fitting slices: in its planned order
        plan = replace(plan, spec=spec, meta=plan.meta.merged(meta).with_(reorder="none"))
    return replace(plan, predictions=plan.predictions.updated(plan_s=time.perf_counter() - t0)), sched, sim


def _plan_final(lengths: np.ndarray, spec: PlanSpec, kind: ScheduleKind, model_cfg: ModelConfig,
                models: Models[MemoryModelLike], meta: dict[str, Any] | None,
                packs: dict[tuple, tuple[Plan, float]] | None = None) -> tuple[Plan, Schedule, SimResult]:
    """``_plan_kind``, and for ``dynamic`` the robust choice (``dynmb.planning.search.robust``) among its own
    plan and the candidates of ``final_candidates``, each planned whole (packed, in its own order,
    scheduled, simulated; one whose ``step_floor`` is above the best alternative that fits is not scheduled,
    ``FINAL_PRUNE``): the packer's own plan is kept only when it is predicted faster than the best
    alternative that fits by more than the model's residuals on both plans' shapes can resolve. The plan
    stays ``dynamic``'s (its method and spec); ``meta`` records the choice (``candidate``,
    ``pred_margin_s``, ``error_bound_s``, ``robust_candidate``; ``grouping`` names an alternative chosen);
    ``plan_s`` counts the whole choice. Where the packer cannot take the batch (``ValueError``), the best
    alternative that fits is the plan; none fits: the packer's error is raised."""
    t0 = time.perf_counter()
    if spec.method != "dynamic":
        return _plan_kind(lengths, spec, kind, model_cfg, models, meta, packs)
    try:
        own: Planned | None = _plan_kind(lengths, spec, kind, model_cfg, models, meta, packs)
    except ValueError as e:             # the packer cannot take the batch: an alternative that fits may
        own, refusal = None, e
    if own is not None and own[0].slice_groups():
        return own
    outcomes = evaluate(final_candidates(_Job(lengths, spec, kind, model_cfg, models, meta)), prune=FINAL_PRUNE)
    if own is None and not any(o.fits for o in outcomes):
        raise refusal
    (plan, sched, sim), choice = robust(own, outcomes, models.cost)
    preds = plan.predictions.updated(plan_s=time.perf_counter() - t0)
    grouping = {} if choice.candidate == "dynamic" else {"grouping": choice.candidate}
    return replace(plan, method="dynamic", spec=spec, predictions=preds,
                   meta=plan.meta.merged(grouping).merged(choice.meta())), sched, sim


@dataclass(frozen=True)
class _Job:
    """One step's batch, settings (with the record of their kind) and models: what every candidate of its
    searches is planned from."""

    lengths: np.ndarray
    spec: PlanSpec
    kind: ScheduleKind
    model_cfg: ModelConfig
    models: Models[MemoryModelLike]
    meta: dict[str, Any] | None


def final_settings(lengths: np.ndarray, spec: PlanSpec, kind: ScheduleKind,
                   models: Models[MemoryModelLike]) -> dict[str, PlanSpec]:
    """The settings of ``dynamic``'s alternatives for the step ``lengths`` under ``spec`` (``kind``: its kind's record),
    by name: each of ``FINAL_METHODS`` at the ``FINAL_CHECK`` budgets the fast estimate ranks best and their
    neighbours (``balanced/2``), then every other registered method under the step's own settings (its default
    sizes; a budget method's is divisor 1, named so), so that ``dynamic`` is never predicted slower than a method
    that fits (issue 39). ``studies/scaling/final.py`` plans the same list on the study's path."""
    try:
        ctx = PackContext.from_spec(spec, models.memory, kind)
        divisors = budget_divisors(lengths, ctx, models.cost, round_to=spec.round_to, dp=spec.dp, keep=FINAL_CHECK,
                                   neighbours=True)
    except ValueError:
        divisors = []
    settings = {f"{m}/{d}": spec.with_(method=m, mbs=d) for m, d in itertools.product(FINAL_METHODS, divisors)}
    for m in METHODS:
        name = f"{m}/1" if get_method(m).mbs == "budget divisor" else m
        if m != spec.method and name not in settings:
            settings[name] = spec.with_(method=m, mbs=None)
    return settings


def final_candidates(job: _Job) -> list[Candidate]:
    """``dynamic``'s alternatives (``final_settings``), each packed, ordered, scheduled and simulated whole."""
    return [_staged(name, job, s)
            for name, s in final_settings(job.lengths, job.spec, job.kind, job.models).items()]


def _staged(name: str, job: _Job, spec: PlanSpec) -> Candidate[Planned]:
    """The candidate ``name`` of ``job`` under ``spec``: packed and ordered once, for its ``floor``
    (``dynmb.planning.search.step_floor``) and for ``make``, which schedules and simulates it."""
    packed = functools.cache(functools.partial(_pack_kind, job.lengths, spec, job.kind,
                                               job.model_cfg, job.models, job.meta))

    def make() -> Planned:
        done = packed()
        return done if isinstance(done, tuple) else _schedule_kind(done, spec, job.models, job.meta)

    def floor() -> float:
        done = packed()
        return float(done[0].predictions["pred_step_s"]) if isinstance(done, tuple) else \
            step_floor(done.replicas, job.models.cost, spec.schedule_kind, spec.virtual)
    return Candidate(name, make, floor)


def _plan_on(job: _Job, packing_kind: str, ramp: float | None,
             packs: dict[tuple, tuple[Plan, float]]) -> tuple[Plan, Schedule, SimResult]:
    """``_plan_kind`` of ``job.spec``'s kind on the packing made for ``packing_kind`` in this step (``packs``), its
    fill ramped where ``ramp`` is a body scale (``dynmb.planning.ramped``)."""
    spec = job.spec
    made = packs.get(get_kind(packing_kind).packing_key)
    plan = None if made is None else made[0] if ramp is None else ramped_plan(made[0], spec, job.models.memory, ramp)
    if made is None or plan is None:
        raise ValueError(f"no {'ramped ' if ramp else ''}{packing_kind} packing of this step for {spec.schedule_kind}")
    view = {**packs, job.kind.packing_key: (plan, made[1])}
    return _plan_kind(job.lengths, spec, job.kind, job.model_cfg, job.models, job.meta, view)


def _ranked_elsewhere(job: _Job, kinds: tuple[str, ...], packs: dict[tuple, tuple[Plan, float]]) -> list[Candidate]:
    """``plan_auto``'s extra candidates for ``dynamic`` without slices: each kind whose packing is ranked by another
    kind's estimate (``makespan_zb.ranking_kind``) on that kind's packing (``"zb@zb-h1"``) and on its own packing
    with the fill ramped, its body as packed and re-packed larger (``"zb+ramp"``, ``"zb+ramp x1.5"``:
    ``ramped.BODY_SCALES``), run in the ramp's order (``reorder="none"``: the reorder search's estimate, ``zb``'s,
    does not see the ramp either and spreads it over both ends)."""
    if job.spec.method != "dynamic" or _sliced(job.lengths, job.spec, job.model_cfg, job.models.memory):
        return []
    out = []
    for kind in kinds:
        other = ranking_kind(kind)
        if other != kind and other in kinds:
            job_k = replace(job, spec=job.spec.with_(schedule_kind=kind), kind=get_kind(kind))
            out.append(Candidate(f"{kind}@{other}", functools.partial(_plan_on, job_k, other, None, packs)))
            as_built = replace(job_k, spec=job_k.spec.with_(reorder="none"))          # the ramp's order
            out += [Candidate(f"{kind}+ramp" + ("" if x == 1.0 else f" x{x:g}"),
                              functools.partial(_plan_on, as_built, kind, x, packs)) for x in BODY_SCALES]
    return out


def plan_auto(lengths: np.ndarray, spec: PlanSpec, model_cfg: ModelConfig, models: Models[MemoryModelLike],
              meta: dict[str, Any] | None = None) -> tuple[Plan, Schedule, SimResult]:
    """``--schedule auto``: the step planned for each kind of ``auto_kinds`` (packed for that kind;
    kinds of equal ``packing_key`` share the packing), each simulated; the fastest whose simulated
    peak fits the limit is kept (none fits: the fastest, as a fixed kind would return it), by the one
    search (``dynmb.planning.search``, rule ``fastest``). Ties go to the kind registered first. The plan's
    ``schedule_kind`` is the chosen kind, its spec keeps ``auto``; ``meta.schedule_auto`` holds every
    kind's predicted step (None: it could not plan the step), ``plan_s`` the whole choice. A kind that
    cannot take the step (``ValueError``) drops out; if all do, the first one's error is raised. ``dynamic``
    without slices: a kind whose packing is ranked by another kind's estimate (``makespan_zb.ranking_kind``: ``zb``
    by ``zb-h1``'s, which misses what ``zb``'s extra warm-up makes of a ramped fill) is also run on that kind's
    packing (``"zb@zb-h1"`` in ``schedule_auto``; ``_plan_kind`` only, no second final check), issue 39."""
    t0 = time.perf_counter()
    kinds = auto_kinds_for(spec)        # one placement for every step of a run (zb-v at virtual 2 without slices)
    if not kinds:
        raise ValueError(f"schedule 'auto': no registered kind takes virtual={spec.virtual}"
                         f"{' and slices of long sequences' if _sliced(lengths, spec, model_cfg, models.memory) else ''}")
    packs: dict[tuple, tuple[Plan, float]] = {}
    made = _MADE.set({})                # this step's schedules and simulations (``REMEMBER``)
    try:
        return _plan_auto_on(lengths, spec, kinds, model_cfg, models, meta, packs, t0)
    finally:
        _MADE.reset(made)


def _plan_auto_on(lengths: np.ndarray, spec: PlanSpec, kinds: tuple[str, ...], model_cfg: ModelConfig,
                  models: Models[MemoryModelLike], meta: dict[str, Any] | None,
                  packs: dict[tuple, tuple[Plan, float]], t0: float) -> tuple[Plan, Schedule, SimResult]:
    """``plan_auto``'s search, its candidates sharing ``packs``; ``t0``: when the step began."""
    cands = [Candidate(kind, functools.partial(_plan_checked, lengths, spec.with_(schedule_kind=kind), model_cfg,
                                               models, meta, packs)) for kind in kinds]
    cands += _ranked_elsewhere(_Job(lengths, spec, get_kind(kinds[0]), model_cfg, models, meta),   # kind: per candidate
                               kinds, packs)
    outcomes = _weighed(cands) if weighs(spec) and _sliced(lengths, spec, model_cfg, models.memory) else evaluate(cands)
    plan, sched, sim = cast(Planned, fastest(outcomes).made)
    preds = plan.predictions.updated(plan_s=time.perf_counter() - t0)
    scores = {o.name: o.score for o in outcomes}
    return replace(plan, spec=spec, predictions=preds, meta=plan.meta.with_(schedule_auto=scores)), sched, sim


def _weighed(cands: list[Candidate]) -> list[Outcome[Planned]]:
    """``plan_auto``'s kinds with ``dynamic``'s sliced plans: each kind's own sliced search first (the weighing of the
    plain methods' sliced plans off), then, fastest own step first, each kind ``slicing.kinds_to_weigh`` keeps (against
    the own steps and the fastest weighed so far) planned again with it on (its own search reused,
    ``reuse_searches``); the others keep their own plans."""
    with reuse_searches():
        with own_searches_only():
            own = evaluate(cands)
        steps = {o.name: None if o.verdict is None else (o.verdict.score, o.fits) for o in own}
        again: dict[str, Outcome[Planned]] = {}
        fastest_first = {name: v[0] if v is not None and v[1] else math.inf for name, v in steps.items()}
        for cand in sorted(cands, key=lambda c: fastest_first[c.name]):
            weighed = [o.verdict.score for o in again.values() if o.verdict is not None and o.fits]
            if cand.name in kinds_to_weigh(steps, min(weighed, default=math.inf)):
                again[cand.name] = evaluate([cand])[0]
    return [again.get(o.name, o) for o in own]
