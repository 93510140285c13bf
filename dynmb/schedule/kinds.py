"""The one registry of schedule kinds: each kind is a record of its builder and its traits.

Every place that behaves differently per schedule kind reads the kind's record here instead of
comparing names: the memory model (``dynmb.memory.model``: in-flight microbatches, the peak rule),
the packers (``dynmb.packing.context``: per-stage windows and caps), the planner
(``dynmb.planning.planner.make_schedule``: which inputs the builder takes), the reorder pass
(``dynmb.planning.reorder``: split-backward costs, order-dependent schedules) and the fast
makespan estimate (``estimate_as``).

A kind's traits (``ScheduleKind``):

- ``build(BuildInputs) -> Schedule``: the builder (``dynmb.schedule.builders``,
  ``dynmb.schedule.zerobubble``); ``BuildInputs`` carries every input any builder takes.
- ``window(stage, P)``: microbatches stage ``stage`` of ``P`` holds in flight at most (None:
  every microbatch of the step, GPipe). The memory peak rule (``dynmb.memory.model.peak_from_matrix``)
  charges every stage the largest sum of ``min(m, window)`` consecutive activations.
- ``chunk_window(rank, ranks, virtual, m=None)``: with virtual stages (``virtual_stages`` and
  ``virtual > 1``), the chunk-microbatches one GPU holds at most (the interleaved warm-up bound);
  the peak rule is then per GPU, its stages' states added up.
- ``split_backward``: the builder may emit ``I``/``W`` (costs of all four ops are needed).
- ``slices``: the kind runs slices of long sequences (``BuildInputs.backward_order``): on
  every stage a sequence's slices go forward in slice order and backward (``B``, or ``I`` of
  a split backward; ``W`` anywhere after its ``I``) in reverse, which ``validate(schedule,
  plan)`` checks for every kind. Today all but ``memory-aware``.
- ``chain_lookahead``: the builder runs a ``ChainOrder``'s lookahead (``dynmb.schedule.order``): 1F1B and
  the zero-bubble kinds (their orders are ``windowed_order``'s).
- ``memory``: ``"none"``, ``"optional"`` or ``"required"``: whether the builder takes the
  per-(stage, microbatch) bytes and the limit (``memory-aware`` needs them).
- ``costs``: the builder takes per-(stage, microbatch) times and the simulator as judge
  (``BuildInputs.zb_inputs``, ``evaluate``).
- ``window_exact``: the window rule is the exact peak of every order (an order-free fit check
  is exact); ``fits_by_construction``: the builder keeps the peak under the limit itself.
- ``cache_key(BuildInputs)``: for a builder that reads the bytes (so its schedule follows the
  microbatch order), a key equal for inputs that build the same schedule (memory-aware: its
  windows), so a reorder search builds each schedule once.
- ``estimate_as``: the key of this kind's fast makespan estimator in the estimator registry
  (``dynmb.timing.estimators``: ``gpipe``, ``1f1b``, ``zb-h1``, ``zb``, ``interleaved``, ``zb-v`` or any
  registered later); the registry holds the callable and its traits (the timing layer, below this one, so the
  record names the entry), and ``dynmb.timing.makespan.makespans`` calls it. Every entry is tested against the
  simulator on random pipelines (``tests/test_estimators.py``).

- ``auto``: ``--schedule auto`` weighs this kind (``auto_kinds``).
- ``placement``: which rank holds each stage (``dynmb.schedule.vshape.placement_rank``; ``loop``: stage
  ``s`` on rank ``s % R``; ``v``: ZB-V's, ``zb-v``); the memory peak rule, the packers' per-GPU sums
  and the runtime's topology read it; ``auto`` weighs the kinds of one placement per run (``auto_kinds``).
- ``chunks``: the model chunks per rank a kind runs with exactly (``zb-v``: 2), refused otherwise.

Adding a kind is one new module with its builder and its record, plus one
``register_kind(record)`` call. ``SCHEDULE_KINDS`` is a live view of the registered names.

``AUTO`` (``"auto"``) is not a kind but a choice among kinds, made per step by the planner
(``dynmb.planning.planner``): it plans the step for each kind of ``auto_kinds_for(spec)``
(the dynamic packer packs for the kind it will run; kinds of equal ``packing_key`` share one
packing, since the packers read nothing else of a kind), simulates each under the memory limit
and keeps the fastest that fits. The plan records the chosen kind (``Plan.schedule_kind``) and
its spec keeps ``"auto"``; ``resolve_kind(name, plan)`` is the kind a plan runs on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

import dynmb.schedule.builders as builders
from dynmb.schedule.vshape import PLACEMENTS, placement_rank, v_inflight, zb_v
from dynmb.schedule.order import lookahead_of
from dynmb.schedule.zerobubble import Evaluate, ZBInputs, zb_h1, zb_limit_aware
from dynmb.core.types import Schedule

__all__ = ["BuildInputs", "ScheduleKind", "register_kind", "unregister_kind", "get_kind", "kind_names", "kinds_with",
           "SCHEDULE_KINDS", "build_schedule", "interleaved_inflight", "AUTO", "AUTO_PLACEMENTS", "auto_kinds",
           "auto_kinds_for", "auto_placement", "is_schedule_name",
           "resolve_kind"]


@dataclass(frozen=True, kw_only=True)
class BuildInputs:
    """Everything a builder may take; each kind reads what its traits say it needs."""

    num_stages: int
    """Pipeline stages."""
    num_microbatches: int
    """Microbatches of one replica, in execution order."""
    virtual: int = 1
    """Model chunks per rank (kinds with ``virtual_stages``)."""
    backward_order: Sequence[int] | None = None
    """Backward order of a plan with slices (``Plan.backward_order``), kinds with ``slices`` only."""
    act_bytes: np.ndarray | None = None
    """``[P, m]`` bytes held from a microbatch's F to its B (``memory`` kinds)."""
    state_bytes: np.ndarray | Sequence[float] | None = None
    """``[P]`` model-state bytes (default 0)."""
    limit_bytes: float | None = None
    """The per-GPU memory limit."""
    transient_bytes: np.ndarray | None = None
    """``[P, m]`` buffers of the running op, not held."""
    zb_inputs: ZBInputs | None = None
    """Per-(stage, microbatch) times, P2P times and bytes (``costs`` kinds)."""
    evaluate: Evaluate | None = None
    """schedule -> (predicted makespan, peak per stage): the simulator as judge (``costs`` kinds)."""


def _slices_free(order: Sequence[int] | None, m: int) -> bool:
    return order is None or list(order) == list(range(m))


@dataclass(frozen=True, kw_only=True)
class ScheduleKind:
    """One schedule kind: its builder and traits (module doc)."""

    name: str
    """The name users pass (``--schedule``, ``Planner(schedule=...)``)."""
    build: Callable[[BuildInputs], Schedule]
    """The builder."""
    window: Callable[[int, int], int] | None
    """``window(stage, P)``: microbatches in flight on a stage at most; None: all of them (GPipe)."""
    chunk_window: Callable[..., Any] | None = None
    """``chunk_window(rank, ranks, virtual, num_microbatches=None)``: chunk-microbatches in flight on a GPU
    with virtual stages (with ``m`` microbatches in the step; without, the count packing assumes)."""
    split_backward: bool = False
    """The builder may emit split backwards (``I`` then ``W``)."""
    slices: bool = False
    """Runs slices of long sequences (takes ``backward_order``)."""
    virtual_stages: bool = False
    """Takes ``virtual`` > 1 model chunks per rank."""
    memory: str = "none"
    """Memory inputs the builder takes: none, optional or required."""
    costs: bool = False
    """The builder takes per-microbatch times and an evaluator (``zb_inputs``, ``evaluate``)."""
    window_exact: bool = False
    """The window rule is this kind's exact peak for every microbatch order."""
    fits_by_construction: bool = False
    """The builder keeps the peak under the limit by itself (whenever it can build)."""
    estimate_as: str = "1f1b"
    """The fast makespan estimator of this kind: the key of its entry in ``dynmb.timing.estimators`` (gpipe or
    1f1b: the op order swept; zb-h1 / zb: ``dynmb.timing.makespan_zb``; interleaved:
    ``dynmb.timing.makespan_interleaved``; zb-v: ``dynmb.timing.makespan_zbv``; or one registered later)."""
    cache_key: Callable[[BuildInputs], bytes] | None = None
    """For builders that read the microbatches' bytes: a key equal for inputs that build the same
    schedule (a reorder search builds one schedule per key, not per order); None: no cache."""
    chain_lookahead: bool = False
    """Runs a ``ChainOrder``'s lookahead (``dynmb.schedule.order``: a stage forwards past a chain's backward)."""
    auto: bool = False
    """``--schedule auto`` weighs this kind (``auto_kinds``)."""
    chunks: int | None = None
    """The model chunks per rank the kind runs with exactly (``zb-v``: 2); None: any ``virtual``."""
    placement: str = "loop"
    """Which rank holds each stage (``dynmb.schedule.vshape.placement_rank``): ``loop`` (stage ``s`` on rank
    ``s % R``, interleaved) or ``v`` (chunk 0 of rank ``r`` is stage ``r``, chunk 1 stage ``S - 1 - r``)."""

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"a schedule kind needs a name, got {self.name!r}")
        if self.memory not in ("none", "optional", "required"):
            raise ValueError(f"kind {self.name!r}: memory must be none, optional or required, got {self.memory!r}")
        if not self.estimate_as or not isinstance(self.estimate_as, str):
            raise ValueError(f"kind {self.name!r}: estimate_as must name an estimator (dynmb.timing.estimators), "
                             f"got {self.estimate_as!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"kind {self.name!r}: placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.virtual_stages and self.chunk_window is None:
            raise ValueError(f"kind {self.name!r} takes virtual stages: give its chunk_window")

    @property
    def packing_key(self) -> tuple:
        """What the packers, the memory model and the fast estimate read of this kind: kinds with the
        same key get the same packing of a batch (``auto`` packs once for them)."""
        return (self.window, self.chunk_window, self.virtual_stages, self.estimate_as)

    def rank_of(self, stage: int, num_stages: int, virtual: int) -> int:
        """The rank that holds ``stage`` under this kind's placement (one stage per rank: the stage)."""
        return placement_rank(stage, num_stages, virtual if self.virtual_stages else 1, self.placement)

    def inflight(self, stage: int, num_stages: int, m: int) -> int:
        """Microbatches ``stage`` holds at once with ``m`` in the step (one stage per rank)."""
        if self.window is None:
            return m
        return max(1, min(m, int(self.window(stage, num_stages))))

    def check(self, inp: BuildInputs) -> None:
        """Refuse inputs this kind cannot take (slices, virtual stages, missing memory inputs)."""
        if inp.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {inp.num_stages}")
        if inp.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {inp.num_microbatches}")
        if not self.slices and not _slices_free(inp.backward_order, inp.num_microbatches):
            raise ValueError(f"slices of long sequences run on the {' or '.join(slice_kinds())} schedule; "
                             f"{self.name!r} does not order their backwards in reverse")
        if lookahead_of(inp.backward_order) and not self.chain_lookahead:
            raise ValueError(f"{self.name} does not take a chain lookahead (slice_lookahead); "
                             f"{', '.join(k for k, v in _REGISTRY.items() if v.chain_lookahead)} do")
        if not self.virtual_stages and inp.virtual != 1:
            raise ValueError(f"{self.name} runs one stage per rank; got virtual={inp.virtual}")
        if self.chunks is not None and (inp.virtual != self.chunks or inp.num_stages % self.chunks):
            raise ValueError(f"{self.name} runs exactly {self.chunks} model chunks per rank; got virtual={inp.virtual} "
                             f"with {inp.num_stages} stages")
        if self.memory == "required" and (inp.act_bytes is None or inp.limit_bytes is None):
            raise ValueError(f"the {self.name} schedule needs act_bytes [stages, m] and limit_bytes")


_REGISTRY: dict[str, ScheduleKind] = {}


def register_kind(kind: ScheduleKind, *, replace: bool = False) -> ScheduleKind:
    """Add ``kind`` to the registry (``replace``: overwrite a kind of the same name)."""
    if kind.name in _REGISTRY and not replace:
        raise ValueError(f"schedule kind {kind.name!r} is already registered")
    _REGISTRY[kind.name] = kind
    _BUILT.clear()
    return kind


def unregister_kind(name: str) -> None:
    """Remove a kind (tests that register one of their own)."""
    _REGISTRY.pop(name, None)
    _BUILT.clear()


def get_kind(name: "str | ScheduleKind") -> ScheduleKind:
    """The record of kind ``name``; ``ValueError`` naming the known kinds otherwise. A record is returned as
    given: a planning step resolves its kind once, at its entry, and hands the record down (issue 36)."""
    if isinstance(name, ScheduleKind):
        return name
    kind = _REGISTRY.get(name)
    if kind is None:
        raise ValueError(f"unknown schedule kind {name!r}; known: {', '.join(_REGISTRY)}")
    return kind


def kind_names() -> tuple[str, ...]:
    """Registered kind names, in registration order."""
    return tuple(_REGISTRY)


def slice_kinds() -> tuple[str, ...]:
    """The kinds that run slices of long sequences."""
    return kinds_with("slices")


def kinds_with(trait: str) -> tuple[str, ...]:
    """The registered kinds whose record's ``trait`` (a field of ``ScheduleKind``: ``slices``, ``virtual_stages``,
    ``costs``, ...) is set, in registration order."""
    return tuple(k for k, v in _REGISTRY.items() if getattr(v, trait))


AUTO = "auto"
"""The schedule choice made per step: the fastest kind of ``auto_kinds`` that fits (module doc)."""


AUTO_PLACEMENTS = ("v", "loop")
"""The placements ``auto`` prefers, first first: ZB-V's wherever a V kind runs the run's steps (at ``virtual`` 2 it
was 4-15% faster than interleaved in 12 of 12 simulated cells, docs/design.md), else the loop placement."""


def auto_kinds(virtual: int = 1, slices: bool = False, placements: tuple[str, ...] = AUTO_PLACEMENTS) -> tuple[str, ...]:
    """The kinds ``auto`` weighs, in registration order (ties go to the first): the registered kinds
    with ``auto`` that take ``virtual`` chunks per rank (with ``virtual`` > 1 a rank holds several
    model chunks, which only kinds with ``virtual_stages`` run, a kind of fixed ``chunks`` only that many;
    with 1, those kinds are their one-chunk equal and are left out) and, where the run's steps may hold
    slices of long sequences (``slices``; ``auto_kinds_for`` reads it from the settings), run them; of those,
    the kinds of ONE placement, the first of ``AUTO_PLACEMENTS`` any of them has: a run places its stages
    once (``dynmb.runtime.topology``), so ``auto`` never changes placement from step to step. At ``virtual``
    2 without slices that is ``zb-v`` (V placement), else the loop kinds (1f1b, zb-h1, zb; interleaved).
    ``placements``: those allowed, first first (the embedding on the last rank: the loop placement only)."""
    kinds = [(k, v) for k, v in _REGISTRY.items() if v.auto and v.virtual_stages == (virtual > 1)
             and (v.chunks is None or v.chunks == virtual) and (v.slices or not slices)]
    held = [p for p in placements if any(v.placement == p for _, v in kinds)]
    return tuple(k for k, v in kinds if held and v.placement == held[0])


def auto_kinds_for(spec: Any) -> tuple[str, ...]:
    """``auto_kinds`` of the settings ``spec`` (a ``PlanSpec``): its ``virtual``, and slices wherever its steps
    may hold them (``oversize="split"`` or ``slice_fitting="auto"``), the same kinds for every step of a run; with
    the embedding on the last rank (``embedding="last"``) the loop placement's only (V puts the last stage on rank 0)."""
    may_slice = spec.oversize == "split" or getattr(spec, "slice_fitting", "never") != "never"
    loop_only = getattr(spec, "embedding", "first") == "last"
    return auto_kinds(spec.virtual, slices=may_slice, placements=("loop",) if loop_only else AUTO_PLACEMENTS)


def auto_placement(spec: Any) -> str:
    """The placement of the kinds ``auto`` weighs under the settings ``spec`` (``auto_kinds_for``; ``loop`` if none)."""
    kinds = auto_kinds_for(spec)
    return _REGISTRY[kinds[0]].placement if kinds else "loop"


def is_schedule_name(name: str) -> bool:
    """A registered kind or ``auto``."""
    return name == AUTO or name in _REGISTRY


def resolve_kind(name: str, plan: Any) -> str:
    """The kind ``plan`` runs on under the schedule setting ``name``: the plan's chosen kind for ``auto``."""
    if name != AUTO:
        return name
    kind = getattr(plan, "schedule_kind", AUTO)
    if kind == AUTO or kind not in _REGISTRY:
        raise ValueError(f"schedule 'auto': the plan records no chosen kind (got {kind!r}); plan it with "
                         f"dynmb.planning.plan_step, which chooses one")
    return kind


class _KindNames(Sequence):
    """A live, read-only view of the registered names (``in``, iteration, ``join`` see new kinds)."""

    def __getitem__(self, i: Any) -> Any:
        return kind_names()[i]

    def __len__(self) -> int:
        return len(_REGISTRY)

    def __contains__(self, name: object) -> bool:
        return name in _REGISTRY

    def __iter__(self) -> Iterator[str]:
        return iter(kind_names())

    def __repr__(self) -> str:
        return repr(kind_names())


SCHEDULE_KINDS: Sequence[str] = _KindNames()
"""The registered kind names (a live view of the registry)."""


def build_schedule(kind: str, num_stages: int, num_microbatches: int, **inputs: Any) -> Schedule:
    """Build a schedule of ``kind`` (a registered name) from ``BuildInputs`` fields as keywords.

    ``interleaved`` uses ``virtual`` chunks per rank (``virtual=1`` gives 1F1B's order on
    ``num_stages`` ranks); ``memory-aware`` needs ``act_bytes[stage, mb]`` and ``limit_bytes``
    (``state_bytes[stage]`` defaults to 0; ``transient_bytes[stage, mb]``, optional, reserves the
    running op's buffers). ``zb-h1`` / ``zb`` take the times and bytes in ``zb_inputs`` and the
    simulator as ``evaluate`` (``zb`` needs both and ``limit_bytes``; without them it is ZB-H1's
    order); see ``dynmb.schedule.zerobubble``. ``backward_order`` (slices of long sequences) is
    taken by the kinds with ``slices`` only.
    """
    rec = get_kind(kind)
    inp = BuildInputs(num_stages=num_stages, num_microbatches=num_microbatches, **inputs)
    rec.check(inp)
    if rec.memory != "none" or rec.costs:              # the schedule follows the bytes or the times
        return rec.build(inp)
    order = None if inp.backward_order is None else tuple(int(i) for i in inp.backward_order)
    key = (kind, num_stages, num_microbatches, inp.virtual, order, lookahead_of(inp.backward_order))
    sched = _BUILT.get(key)
    if sched is None:                 # a Schedule is immutable: a planning step builds the same one twice
        sched = rec.build(inp)        # (the reorder search's and the plan's), a run its shapes every step
        if len(_BUILT) >= _BUILT_MAX:
            _BUILT.pop(next(iter(_BUILT)))
        _BUILT[key] = sched
    return sched


_BUILT: dict[tuple, Schedule] = {}
"""Schedules of the order-only kinds (no bytes, no times), by (kind, stages, microbatches, virtual, order)."""
_BUILT_MAX = 64


def interleaved_inflight(rank: Any, ranks: int, virtual: int, num_microbatches: int | None = None) -> Any:
    """Chunk-microbatches in flight at most on pipeline ``rank`` of an interleaved schedule: the
    builder's warm-up ``(v - 1) k + 2 (R - 1 - r)`` forwards plus the one before the first backward,
    ``k`` the first round's size (``builders.interleaved_warmup``: ``R`` when ``R`` splits ``m``,
    up to ``2R - 1`` when it does not, ``m`` itself below ``2R``), at most all ``v m``. Without
    ``num_microbatches`` (packing, before ``m`` is known): rounds of ``R``, Megatron's count; the
    packer checks the plan it made with its own ``m`` (``dynmb.packing.dispatch``)."""
    rank = np.asarray(rank)
    if num_microbatches is None:
        return 2 * (ranks - rank - 1) + (virtual - 1) * ranks + 1
    m = int(num_microbatches)
    return np.minimum(builders.interleaved_warmup(rank, ranks, virtual, m) + 1, virtual * m)


# --- the built-in kinds ----------------------------------------------------------------------------

def _one_f_one_b_window(stage: int, num_stages: int) -> int:
    return num_stages - stage


def _gpipe(inp: BuildInputs) -> Schedule:
    return builders.gpipe(inp.num_stages, inp.num_microbatches, inp.backward_order)


def _1f1b(inp: BuildInputs) -> Schedule:
    return builders.one_f_one_b(inp.num_stages, inp.num_microbatches, inp.backward_order)


def _interleaved(inp: BuildInputs) -> Schedule:
    return builders.interleaved(inp.num_stages, inp.num_microbatches, virtual=inp.virtual,
                                backward_order=inp.backward_order)


def _memory_aware(inp: BuildInputs) -> Schedule:
    assert inp.act_bytes is not None and inp.limit_bytes is not None
    return builders.memory_aware(inp.num_stages, inp.num_microbatches, inp.act_bytes, inp.state_bytes,
                                 inp.limit_bytes, inp.transient_bytes)


def _memory_aware_key(inp: BuildInputs) -> bytes:
    assert inp.act_bytes is not None and inp.limit_bytes is not None
    return builders.memory_windows(inp.act_bytes, inp.state_bytes, inp.limit_bytes, inp.transient_bytes).tobytes()


def _zb_h1(inp: BuildInputs) -> Schedule:
    sched = zb_h1(inp.num_stages, inp.num_microbatches, inp.zb_inputs, evaluate=inp.evaluate,
                  backward_order=inp.backward_order, state_bytes=inp.state_bytes)
    return Schedule(sched.ranks, inp.num_stages, inp.num_microbatches, kind="zb-h1")


def _zb(inp: BuildInputs) -> Schedule:
    P, m = inp.num_stages, inp.num_microbatches
    if inp.zb_inputs is not None and inp.evaluate is not None and inp.limit_bytes is not None:
        state = np.zeros(P) if inp.state_bytes is None else np.asarray(inp.state_bytes, dtype=np.float64)
        return zb_limit_aware(P, m, inp.zb_inputs, (float(inp.limit_bytes) - state).tolist(), float(inp.limit_bytes),
                              inp.evaluate, backward_order=inp.backward_order, state_bytes=state)
    sched = zb_h1(P, m, inp.zb_inputs, evaluate=inp.evaluate, backward_order=inp.backward_order)
    return Schedule(sched.ranks, P, m, kind="zb")


register_kind(ScheduleKind(name="gpipe", build=_gpipe, window=None, slices=True, window_exact=True,
                           estimate_as="gpipe"))
register_kind(ScheduleKind(name="1f1b", build=_1f1b, window=_one_f_one_b_window, slices=True, window_exact=True,
                           auto=True, chain_lookahead=True))
register_kind(ScheduleKind(name="interleaved", build=_interleaved, window=_one_f_one_b_window, slices=True,
                           chunk_window=interleaved_inflight, virtual_stages=True, estimate_as="interleaved",
                           auto=True))
register_kind(ScheduleKind(name="memory-aware", build=_memory_aware, window=_one_f_one_b_window, memory="required",
                           fits_by_construction=True, cache_key=_memory_aware_key))
# the zero-bubble kinds keep 1F1B's window (dynmb.memory.model) but have estimates of their own: the packers
# rank plans for them as they run (zb by its largest extra warm-up, the memory limit not weighed)
register_kind(ScheduleKind(name="zb-h1", build=_zb_h1, window=_one_f_one_b_window, split_backward=True,
                           slices=True, memory="optional", costs=True, estimate_as="zb-h1", auto=True,
                           chain_lookahead=True))
def _zb_v(inp: BuildInputs) -> Schedule:
    return zb_v(inp.num_stages, inp.num_microbatches, inp.zb_inputs, evaluate=inp.evaluate)


register_kind(ScheduleKind(name="zb", build=_zb, window=_one_f_one_b_window, split_backward=True,
                           slices=True, memory="optional", costs=True, estimate_as="zb", auto=True,
                           chain_lookahead=True))
# ZB-V: two chunks per rank placed V-wise (dynmb.schedule.vshape); the packers count its chunk window per GPU,
# rank candidates with the interleaved estimate (dynmb.timing.makespan_zb.RANK_AS) and choose with its own. ``auto``
# weighs it at virtual 2 where no slices may run (``auto_kinds``: one placement per run).
register_kind(ScheduleKind(name="zb-v", build=_zb_v, window=_one_f_one_b_window, chunk_window=v_inflight,
                           virtual_stages=True, split_backward=True, memory="optional", costs=True,
                           estimate_as="zb-v", chunks=2, placement="v", auto=True))
