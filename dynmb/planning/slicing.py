"""``oversize="split"``: plan sequences longer than any row that fits as chains of slices.

Algorithm (one global batch, ``dp`` pipeline replicas):

1. The longest row the method runs (``row_cap``): the longest admissible one-row
   microbatch (``PackContext.length_cap``), or ``packed``'s row length. Sequences up to it
   are packed by the method as usual (``dynmb.packing.pack`` with the spec's ``dp``, any
   ``recompute`` policy; with ``dp > 1`` a batch the packer cannot give every replica the same
   number of microbatches is packed as for one replica).
2. Every longer sequence is cut into consecutive slices of at most ``S`` tokens: of equal cost
   (``equal_cost_lengths``, Seq1F1B: later slices, attending to a longer prefix, shorter) or
   ``k = ceil(L / S)`` of near-equal length (``packed``: rows of its pack length, the last one
   shorter, as a packed trainer cuts a document at row boundaries), each slice one single-row
   microbatch (``Microbatch.offsets`` / ``continued``). The slice length ``S`` is chosen jointly with
   the rest of the plan: for ``S`` in ``row_cap / {1, 2, 4, 8}`` (multiples of ``round_to``,
   at least 128 tokens), the chains placed before, after or spread among the short sequences'
   microbatches (``PLACEMENTS``), and the slices recomputed or not (``recompute``: ``never`` - not;
   ``always`` - always; ``auto`` - only when the plan does not fit otherwise, then also only the
   longest ``RC_SHARES`` of the chains); a first round tries the equal-cost cuts of every ``S``
   first or spread, ``_refine`` the rest around the best (and, for ``dynamic``, its short sequences
   packed as ``SHORT_PACKERS`` pack them); for each candidate the whole
   plan is scheduled (``make_schedule`` with the plan's kind, any kind with ``slices`` in the
   registry: GPipe, 1F1B, interleaved with its virtual stages, ZB-H1 and ``zb``, every one
   running a chain's backwards -- ``B``, or ``I`` of a split backward -- in reverse slice
   order, a chain in flight until its last slice went forward) and simulated with the
   memory model's slice bytes; the fastest candidate whose every GPU's predicted peak
   (every stage's, with one stage per rank) is within the limit wins.
   Data parallelism (``dp = D > 1``): a chain runs whole on one replica (its slices in order on
   one pipeline; the prefix store is per rank). Each candidate deals its units -- every chain
   (its slices, filled or not) and every short microbatch -- to the replicas, longest predicted
   work first (the bottleneck stage's F + B, summed over a chain's slices) onto the replica with
   the least work so far (ties: the lowest id); within a replica the units keep their order
   (chains by sequence id, then the short microbatches as packed). Every replica gets at least
   one microbatch (fewer units than replicas raises ``PackingError``); the replicas may run
   different numbers of microbatches (a plan with slices only, ``Plan.validate``). Every
   replica is scheduled and simulated: a candidate's time is the slowest replica's, and every
   replica's every GPU must be within the limit. The plan is replica-major (``stitch``); its
   predictions are ``predict_replicas``'; the schedule and simulation returned are replica 0's.
   Each slice length is also tried with the slices' rows filled (``slice_fill``): a slice
   shorter than the longest row leaves room in its row, which short sequences take, packed
   after the slice in the same row (first fit, longest first; the row stays within the longest
   row), and the short sequences left over are packed by the method as usual. Fewer
   microbatches (less per-op overhead, shorter fill and drain) against longer slice rows: the
   simulator decides, as for the other choices; without room for any short sequence the
   candidate is not tried. None fitting raises ``PackingError`` naming the longest
   sequence and the smallest predicted peak.
   ``dynamic`` then weighs the plain methods' sliced plans (``_weigh_alternatives``; on by default): each
   method's short packing tried at its best candidate and around it (``_screen``, ``_centres``: shorter and longer
   slices, smaller recomputed shares; one that fits at none of them further out until one fits, ``_wider``: no
   lookahead, every placement, the other fill, the other slice lengths), then the whole search of the
   ``WEIGH_FINALISTS`` fastest, of any other within ``SCREEN_ERROR`` of the best, of every one the screen still
   cannot rank and of every method whose slices it cannot cut (``packed``), the fastest kept.
   The jobs of one ``plan_split`` share their simulations and their packings of short sequences. Under
   ``--schedule auto`` the weighing runs only on the kinds whose own sliced step is near the fastest kind's
   (``KIND_SCREEN``, ``kinds_to_weigh``; ``dynmb.planning.planner.plan_auto``).
3. ``meta``: ``oversize="split"``, ``sliced`` (``{seq_id: slices}``), ``slice_len``,
   ``slice_cuts``, ``slice_placement``, ``slice_recompute`` (``slice_recompute_share``), ``slice_shorts``,
   ``slice_fill``, ``longest_fitting_length``,
   ``slice_threshold``; every token of the batch is planned.

``threshold`` (``dynmb.planning.slice_fitting``): every sequence longer than ``threshold`` (below the
longest row) is sliced, with the slice lengths of step 2 that are at most ``threshold``; the rows of the
slices are filled up to the longest row as above.

Not supported (refused with one line): kinds without ``slices`` (``memory-aware``).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import numpy as np

from dynmb.costmodel.base import CostModelLike
from dynmb.costmodel.loader import Models, model_digest
from dynmb.memory.model import MemoryModelLike
from dynmb.core.config import ModelConfig
from dynmb.packing import PackingError, pack
from dynmb.packing.context import PackContext
from dynmb.packing.packed import packed_row_len
from dynmb.packing.rows import round_down, round_up
from dynmb.core.planspec import PlanSpec
from dynmb.core.predictions import Predictions
from dynmb.schedule.kinds import AUTO, ScheduleKind, auto_kinds_for, get_kind, slice_kinds
from dynmb.timing.simulate import SimResult, simulate
from dynmb.core.types import Microbatch, Plan, PlanMeta, Schedule
from dynmb.planning.replicas import predict_replicas, replicas_of
from dynmb.planning.search import step_floor

__all__ = ["plan_split", "longest_row", "slice_lengths", "MIN_SLICE", "reuse_searches", "slice_alternatives",
           "weighing_alternatives", "kinds_to_weigh", "kinds_screened", "weighs", "own_searches_only"]

MIN_SLICE = 128
"""Shortest slice length the planner tries (tokens)."""


def longest_row(spec: PlanSpec, model_cfg: ModelConfig, memory_model: MemoryModelLike) -> int:
    """The longest row ``spec.method`` runs: ``packed``'s row length, else the longest admissible
    one-row microbatch (beyond it, ``oversize='split'`` slices a sequence). ``--schedule auto``:
    the shortest over the kinds auto weighs (a longer sequence is sliced under one of them at least)."""
    if spec.schedule_kind == AUTO:
        return min(longest_row(spec.with_(schedule_kind=k), model_cfg, memory_model) for k in auto_kinds_for(spec))
    ctx = PackContext.from_spec(spec, memory_model)
    if spec.method == "packed":
        return packed_row_len(ctx, model_cfg.max_seq_len, spec.pack_len, spec.round_to)[0]
    return ctx.length_cap(model_cfg.max_seq_len, spec.round_to)


def slice_lengths(length: int, slice_len: int) -> list[int]:
    """``length`` cut into ``ceil(length / slice_len)`` near-equal slices (longest first)."""
    k = max(1, math.ceil(length / slice_len))
    base, extra = divmod(length, k)
    return [base + 1] * extra + [base] * (k - extra)


def equal_cost_lengths(length: int, slice_len: int, coef: tuple[float, float]) -> list[int]:
    """``length`` cut into slices of near-equal cost (Seq1F1B): a slice of ``n`` tokens after ``p`` costs
    ``a n + b n (2 p + n)`` for ``coef = (a, b)`` (linear work, attention over its prefix and itself), so the
    first ``x`` tokens cost ``a x + b x^2`` and the cuts are where that reaches ``j / k`` of the whole; ``k``
    is the fewest slices whose first (the longest) is at most ``slice_len`` (the later ones, attending to a
    longer prefix, are shorter), at most ``length / MIN_SLICE`` (then, or where no such cut keeps the first
    within ``slice_len``, the even cuts of ``slice_lengths``)."""
    a, b = (max(float(c), 0.0) for c in coef)
    if b <= 0.0 or length <= slice_len:
        return slice_lengths(length, slice_len)
    total = a * length + b * length * length
    fewest = math.ceil(length / slice_len)
    k = max(fewest, math.ceil(total / (a * slice_len + b * slice_len * slice_len) - 1e-9))
    k = min(k, max(fewest, length // MIN_SLICE))
    cuts = [0]
    for j in range(1, k):
        c = total * j / k                        # a x + b x^2 = c, solved without cancellation
        x = 2.0 * c / (a + math.sqrt(a * a + 4.0 * b * c))
        cuts.append(min(max(int(round(x)), cuts[-1] + 1), length - (k - j)))
    cuts.append(length)
    pieces = sorted((e - s for s, e in zip(cuts[:-1], cuts[1:])), reverse=True)     # integer cuts: keep them decreasing
    return pieces if max(pieces) <= slice_len else slice_lengths(length, slice_len)


def _chain(seq_id: int, pieces: list[int], round_to: int, recompute: bool) -> list[Microbatch]:
    out, offset = [], 0
    for j, n in enumerate(pieces):
        out.append(Microbatch([seq_id], [n], round_up(n, round_to), 1, recompute=recompute, offsets=[offset],
                              continued=[j < len(pieces) - 1]))
        offset += n
    return out


def _fill(chains: list[Microbatch], short_ids: np.ndarray, lengths: np.ndarray, row_cap: int,
          round_to: int) -> tuple[list[Microbatch], np.ndarray]:
    """The slices' rows filled with short sequences (first fit, longest first, each row within
    ``row_cap`` rounded up to ``round_to``) and the short sequences left over (module doc)."""
    cap = round_down(row_cap, round_to) or row_cap
    free = [cap - int(mb.lengths.sum()) for mb in chains]
    added: list[list[int]] = [[] for _ in chains]
    left = []
    for sid in sorted(short_ids.tolist(), key=lambda i: -int(lengths[i])):
        n = int(lengths[sid])
        k = next((k for k, f in enumerate(free) if f >= n), None)
        if k is None:
            left.append(sid)
            continue
        free[k] -= n
        added[k].append(sid)
    out = []
    for mb, more in zip(chains, added):
        if more:
            ids = [*mb.seq_ids.tolist(), *more]
            lens = [*mb.lengths.tolist(), *lengths[more].tolist()]
            extra = [0] * len(more)
            mb = Microbatch(ids, lens, min(cap, round_up(sum(lens), round_to)), 1, recompute=mb.recompute,
                            row_ids=[0] * len(ids), offsets=[*mb.offsets.tolist(), *extra],
                            continued=[*mb.continued.tolist(), *(False for _ in more)])
        out.append(mb)
    return out, np.asarray(sorted(left), dtype=np.int64)


def _deal(work: list[float], dp: int) -> list[int]:
    """Each unit's replica: largest ``work`` first onto the replica with the least work so far
    (ties: the fewest units, then the lowest id), so the first ``dp`` units go to ``dp``
    different replicas."""
    loads, counts, out = [0.0] * dp, [0] * dp, [0] * len(work)
    for u in sorted(range(len(work)), key=lambda u: -work[u]):
        r = min(range(dp), key=lambda q: (loads[q], counts[q], q))
        out[u] = r
        loads[r] += work[u]
        counts[r] += 1
    return out


def _replicas(chains: list[list[Microbatch]], shorts: list[Microbatch], placement: str, dp: int,
              cost_model: CostModelLike, plan_of: Callable[..., Plan]) -> tuple[list[Microbatch], list[int]] | None:
    """The microbatches replica-major and their replica ids: chains and short microbatches dealt
    to ``dp`` replicas (``_deal`` on each unit's bottleneck-stage F + B), each replica in the
    units' order, its chains placed among its short microbatches (``_place``).
    None when there are fewer units than replicas (a chain runs whole on one replica)."""
    units: list[list[Microbatch]] = [*chains, *([mb] for mb in shorts)]
    if len(units) < dp:
        return None
    if dp == 1:
        where = [0] * len(units)
    else:
        flat = [mb for unit in units for mb in unit]
        cost = cost_model.plan_costs(plan_of(flat), ops=("F", "B"))
        busy = (np.asarray(cost["F"]) + np.asarray(cost["B"])).max(axis=0).tolist()
        work, k = [], 0
        for unit in units:
            work.append(float(sum(busy[k:k + len(unit)])))
            k += len(unit)
        where = _deal(work, dp)
    order: list[Microbatch] = []
    rids: list[int] = []
    for r in range(dp):
        own = [u for u in range(len(units)) if where[u] == r]
        mbs = _place([units[u] for u in own if u < len(chains)], [mb for u in own if u >= len(chains) for mb in units[u]],
                     placement)
        order += mbs
        rids += [r] * len(mbs)
    return order, rids


PLACEMENTS = ("first", "last", "spread")
"""Where a replica's chains run among its short microbatches: all before them, all after them, or
``spread``: chain ``i`` of ``c`` after ``round((i + 1) n / (c + 1))`` of the ``n`` short microbatches (each
chain whole; the fill and drain are short microbatches and the chains' long ops sit in the steady
state, one chain at a time)."""


def _place(chains: list[list[Microbatch]], shorts: list[Microbatch], placement: str) -> list[Microbatch]:
    """One replica's microbatches: its ``chains`` placed among its ``shorts`` (``PLACEMENTS``)."""
    if placement == "first":
        return [mb for c in chains for mb in c] + shorts
    if placement == "last":
        return shorts + [mb for c in chains for mb in c]
    out, done = [], 0
    for i, chain in enumerate(chains):
        at = round((i + 1) * len(shorts) / (len(chains) + 1))
        out += shorts[done:at] + chain
        done = at
    return out + shorts[done:]


@dataclass
class _SplitJob:
    """One ``plan_split`` call: the batch, its settings and models, the sequences to slice, and the
    packings of short sequences already made (the fill candidates share leftovers)."""

    lengths: np.ndarray
    spec: PlanSpec
    models: Models[MemoryModelLike]
    make_schedule: Callable[..., Schedule]
    row_cap: int
    cut: int
    threshold: int | None
    packed: dict[tuple, list[Microbatch] | PackingError] = field(default_factory=dict)
    coefs: dict[int, tuple[float, float]] = field(default_factory=dict)
    sims: dict[tuple, tuple[float, float, list[Plan], list[Schedule]]] = field(default_factory=dict)

    @property
    def long_ids(self) -> np.ndarray:
        return np.flatnonzero(self.lengths > self.cut)

    @property
    def short_ids(self) -> np.ndarray:
        return np.flatnonzero(self.lengths <= self.cut)

    def pack_short(self, ids: np.ndarray, packer: tuple[str, int | None] | None = None) -> list[Microbatch]:
        """The method's (``packer``: that method's at that mbs) packing of short sequences ``ids`` for ``dp``
        replicas, else for one (cached); ``_replicas`` deals them again."""
        spec = self.spec if packer is None else self.spec.with_(method=packer[0], mbs=packer[1])
        key = (spec.method, spec.mbs, ids.tobytes())        # the jobs of one plan_split share these (``packed``)
        if key not in self.packed:
            sub: Plan | PackingError | None = None
            for d in dict.fromkeys((self.spec.dp, 1)) if ids.size else ():
                try:
                    sub = pack(self.lengths[ids], spec.with_(oversize="error", dp=d),
                               models=self.models)
                    break
                except PackingError as e:
                    if d == 1:
                        sub = e                   # refused: refused again without packing
            self.packed[key] = sub if isinstance(sub, PackingError) else [] if sub is None else \
                [replace(mb, seq_ids=ids[mb.seq_ids]) for mb in sub.microbatches]
        made = self.packed[key]
        if isinstance(made, PackingError):
            raise made
        return made

    def plan_of(self, mbs: list[Microbatch], rids: list[int] | None = None, meta: dict | None = None) -> Plan:
        s = self.spec
        return Plan(tuple(mbs), s.method, s.num_stages, int(s.memory_limit_bytes), len(self.lengths),
                    schedule_kind=s.schedule_kind, spec=s, dp=s.dp if rids is not None else 1,
                    replica_ids=None if rids is None else tuple(rids), meta=PlanMeta.from_dict(meta))

    def slice_candidates(self) -> list[int]:
        """The slice lengths tried: ``packed``'s row, else the longest row / 1, 2, 4, 8 up to ``cut``."""
        if self.spec.method == "packed":
            return [self.row_cap]
        rt = self.spec.round_to
        out = sorted({max(MIN_SLICE, round_down(self.row_cap // f, rt) or rt) for f in (1, 2, 4, 8)}, reverse=True)
        return [s for s in out if s <= self.cut] or [max(MIN_SLICE, round_down(self.cut, rt) or rt)]

    def chains(self, slice_len: int, use_rc: bool, cuts: str = "even", rc_share: float = 1.0) -> list[list[Microbatch]]:
        """Every long sequence as a chain of slices of ``slice_len`` (``packed``: rows, the last shorter;
        ``cuts="equal-cost"``: ``equal_cost_lengths`` with the cost model's ``cost_coef``); with ``use_rc`` the
        slices of the longest ``ceil(rc_share * chains)`` sequences are recomputed (ties: the lower id)."""
        out = []
        by_length = sorted(self.long_ids.tolist(), key=lambda i: (-int(self.lengths[i]), i))
        recomputed = set(by_length[:math.ceil(rc_share * len(by_length))]) if use_rc else set()
        for sid in self.long_ids:
            n = int(self.lengths[sid])
            if self.spec.method == "packed":
                pieces = [slice_len] * (n // slice_len) + ([n % slice_len] if n % slice_len else [])
            elif cuts == "equal-cost":
                pieces = equal_cost_lengths(n, slice_len, self.cost_coef(slice_len))
            else:
                pieces = slice_lengths(n, slice_len)
            out.append(_chain(int(sid), pieces, self.spec.round_to, int(sid) in recomputed))
        return out

    def cost_coef(self, slice_len: int) -> tuple[float, float]:
        """``(a, b)`` of ``equal_cost_lengths``: F + B seconds over every stage per token (its linear work)
        and per unit of attention work (``n (2 p + n)``), read off the cost model at one row of ``slice_len``."""
        if slice_len in self.coefs:
            return self.coefs[slice_len]
        n = float(slice_len)

        def cost(tokens: float, attn: float) -> float:
            c = self.models.cost.stage_costs(np.ones(1), np.array([tokens]), np.array([attn]), ops=("F", "B"))
            return float(np.sum(c["F"]) + np.sum(c["B"]))
        base = cost(n, 0.0)
        self.coefs[slice_len] = ((base - cost(0.0, 0.0)) / n, (cost(n, n * n) - base) / (n * n))
        return self.coefs[slice_len]

    def variants(self, chains: list[list[Microbatch]], packer: tuple[str, int | None] | None = None
                 ) -> list[tuple[bool, list[list[Microbatch]], list[Microbatch]]]:
        """(filled, chains, short microbatches): the chains as cut, and with their rows filled where room is;
        the short sequences packed by ``packer`` (``pack_short``)."""
        short_ids = self.short_ids
        out = [(False, chains, self.pack_short(short_ids, packer))]
        filled, left = _fill([mb for c in chains for mb in c], short_ids, self.lengths, self.row_cap,
                             self.spec.round_to)
        if left.size < short_ids.size:
            it = iter(filled)
            out.append((True, [[next(it) for _ in c] for c in chains], self.pack_short(left, packer)))
        return out

    def meta(self, slice_len: int, placement: str, use_rc: bool, fill: bool, cuts: str = "even") -> dict:
        s = self.spec
        return {"oversize": "split", "round_to": s.round_to, "longest_fitting_length": self.row_cap,
                "sliced": {int(i): len(c) for i, c in zip(self.long_ids, self.chains(slice_len, use_rc, cuts))},
                "slice_len": int(slice_len), "slice_cuts": cuts, "slice_placement": placement, "slice_recompute": use_rc,
                "slice_fill": fill, "slice_threshold": None if self.threshold is None else int(self.cut),
                "truncated": [], "dropped": [],
                "pack_len": int(self.row_cap) if s.method == "packed" else None, "virtual": int(s.virtual)}

    def floor(self, plan: Plan) -> float:
        """A lower bound of ``plan``'s simulated step (its slowest replica's) on the spec's kind, before any
        schedule is built: ``step_floor``'s order-free dependency bound (head + work, + tail where the kind
        never splits a backward), which holds for any order, so for every schedule the builder may make."""
        return step_floor(replicas_of(plan), self.models.cost, self.spec.schedule_kind, self.spec.virtual,
                          order_free=True)

    def simulate(self, plan: Plan) -> tuple[float, float, list[Plan], list[Schedule]]:
        """(slowest replica's makespan, highest GPU peak, the replicas, their schedules); a plan of the same
        microbatches, replicas and lookahead simulated before under the same kind (``sims``, shared by the jobs
        of one ``plan_split``: the plain methods' searches often make the same candidate) is not again."""
        key = _plan_key(plan, self.spec)
        if key not in self.sims:
            self.sims[key] = self._simulate(plan)
        return self.sims[key]

    def _simulate(self, plan: Plan) -> tuple[float, float, list[Plan], list[Schedule]]:
        replicas = replicas_of(plan)
        scheds, slowest, peak = [], 0.0, 0.0
        for p in replicas:
            sched = self.make_schedule(p, self.spec.schedule_kind, virtual=self.spec.virtual,
                                       models=self.models)
            sim = simulate(sched, p, self.models.cost, self.models.memory)
            gpu = sim.peak_bytes_rank if sim.peak_bytes_rank is not None else sim.peak_bytes
            peak = max(peak, float(np.max(gpu)) if gpu is not None else 0.0)
            slowest = max(slowest, sim.makespan_s)
            scheds.append(sched)
        return slowest, peak, replicas, scheds


def _plan_key(plan: Plan, spec: PlanSpec) -> tuple:
    """What a candidate's schedule and simulation read: its microbatches (rows, lengths, recomputation,
    slices), replicas and chain lookahead, and the kind (the settings besides method and mbs are one job's)."""
    mbs = tuple((mb.seq_ids.tobytes(), mb.lengths.tobytes(), mb.padded_len, mb.batch, mb.recompute,
                 None if mb.offsets is None else mb.offsets.tobytes(),
                 None if mb.continued is None else mb.continued.tobytes()) for mb in plan.microbatches)
    return (spec.schedule_kind, spec.virtual, plan.replica_ids, plan.meta.get("slice_lookahead"), mbs)


@dataclass
class _Search:
    """The best fitting candidate so far (``best_at``: its place in the order tried), the lowest peak seen (for the
    error) and the last dealing that had fewer units than replicas."""

    best: tuple[float, Plan, list[Plan], list[Schedule]] | None = None
    lowest: tuple[float, int] | None = None
    too_few: tuple[int, int] = (0, 0)
    simulated: int = 0
    pruned: int = 0
    tried: int = 0
    best_at: int = -1


@dataclass(frozen=True)
class _Try:
    """One family of candidates: slices of ``slice_len`` cut ``cuts``, recomputed or not, with the fills and
    placements to try (``fills`` None: with and without filled rows)."""

    slice_len: int
    use_rc: bool
    cuts: str = "even"
    placements: tuple[str, ...] = ("first", "last")
    fills: tuple[bool, ...] | None = None
    packer: tuple[str, int | None] | None = None
    rc_share: float = 1.0
    lookahead: int = 0


def _try_slice_len(job: _SplitJob, t: _Try, found: _Search) -> None:
    """Every fill and placement of ``t``: scheduled, simulated, the fastest fitting kept."""
    chains = job.chains(t.slice_len, t.use_rc, t.cuts, t.rc_share)
    for (fill, rows, shorts), placement in itertools.product(job.variants(chains, t.packer), t.placements):
        if (fill and not shorts and placement != "first") or (t.fills is not None and fill not in t.fills):
            continue                         # nothing left to place around the chains, or not asked for
        dealt = _replicas(rows, shorts, placement, job.spec.dp, job.models.cost, job.plan_of)
        if dealt is None:
            found.too_few = (len(rows), len(shorts))
            continue
        plan = job.plan_of(*dealt, {**job.meta(t.slice_len, placement, t.use_rc, fill, t.cuts),
                                    "slice_shorts": None if t.packer is None else "/".join(map(str, t.packer)),
                                    "slice_recompute_share": t.rc_share if t.use_rc else 0.0,
                                    "slice_lookahead": t.lookahead})
        at, found.tried = found.tried, found.tried + 1
        if found.best is not None and job.floor(plan) >= found.best[0]:
            found.pruned += 1                # cannot beat the best so far: not scheduled nor simulated
        else:
            _judge(job, found, plan, at, int(t.slice_len))


def _judge(job: _SplitJob, found: _Search, plan: Plan, at: int, slice_len: int) -> None:
    """``plan`` (the ``at``-th candidate of ``found``'s search) simulated; kept where it fits and is faster than the
    best so far (equal: the earlier)."""
    slowest, peak, replicas, scheds = job.simulate(plan)
    found.simulated += 1
    if found.lowest is None or peak < found.lowest[0]:
        found.lowest = (peak, slice_len)
    if peak <= job.spec.memory_limit_bytes and (found.best is None or (slowest, at) < (found.best[0], found.best_at)):
        found.best, found.best_at = (slowest, plan, replicas, scheds), at


def _refine(job: _SplitJob, found: _Search) -> None:
    """Around the best candidate of the first round (its slice length, recomputation and fill): its chains
    placed ``last`` and the even cuts (``slice_lengths``) in every placement; where it recomputes under
    ``recompute="auto"``, only the longest ``RC_SHARES`` of the chains recomputed (``packed``: none of these,
    its rows are its cuts); the ``chain_lookaheads`` of the best so far; for ``dynamic`` then the short
    sequences packed by ``SHORT_PACKERS`` around the best so far. A few more simulations, not another
    product of choices."""
    if found.best is None:
        return
    meta = found.best[1].meta
    slice_len, use_rc, fill = int(meta["slice_len"]), bool(meta["slice_recompute"]), bool(meta["slice_fill"])
    best = _best_try(found, _Try(slice_len, use_rc, fills=(fill,)))
    if job.spec.method != "packed":
        _try_slice_len(job, _Try(slice_len, use_rc, "equal-cost", ("last",), (fill,)), found)
        _try_slice_len(job, _Try(slice_len, use_rc, "even", PLACEMENTS, (fill,)), found)
        meta = found.best[1].meta
        best = _Try(int(meta["slice_len"]), use_rc, meta["slice_cuts"], (meta["slice_placement"],), (fill,))
        for share in RC_SHARES if use_rc and job.spec.recompute == "auto" else ():
            _try_slice_len(job, replace(best, rc_share=share), found)
        best = _best_try(found, best)
    for lookahead in chain_lookaheads(job.spec):
        _try_slice_len(job, replace(best, lookahead=lookahead), found)
    if job.spec.method != "dynamic":
        return
    best = _best_try(found, best)
    for packer in SHORT_PACKERS:
        try:
            _try_slice_len(job, replace(best, packer=packer), found)
        except PackingError:                  # that packer cannot take these short sequences: not a candidate
            continue


def _best_try(found: _Search, t: _Try) -> _Try:
    """``t`` at the slices, cuts, placement, recomputed share and lookahead of the best candidate so far."""
    assert found.best is not None
    meta = found.best[1].meta
    return replace(t, slice_len=int(meta["slice_len"]), cuts=meta["slice_cuts"], placements=(meta["slice_placement"],),
                   rc_share=float(meta["slice_recompute_share"]) or 1.0, lookahead=int(meta["slice_lookahead"]))


def chain_lookaheads(spec: PlanSpec) -> tuple[int, ...]:
    """The chain lookaheads ``_refine`` weighs (``dynmb.schedule.order.ChainOrder``): half and all of stage 0's
    1F1B window past a chain's backward (``ceil((P - 1) / 2)`` and ``P - 1``; each stage takes at most its own
    window less one), where the kind runs a lookahead (``chain_lookahead``) on one stage per rank; none else."""
    rec = get_kind(spec.schedule_kind)
    if not rec.chain_lookahead or spec.virtual != 1 or spec.num_stages < 2:
        return ()
    return tuple(sorted({math.ceil((spec.num_stages - 1) / 2), spec.num_stages - 1}))


RC_SHARES = (0.5, 0.25, 0.125)
"""``recompute="auto"``, where slices fit only recomputed: around the best such candidate, only the longest half,
quarter, eighth of the chains recomputed (the longest chains hold the most in flight; the others then run at
full speed)."""

SHORT_PACKERS: tuple[tuple[str, int | None], ...] = (("fixed", None), ("sorted", 1))
"""``dynamic``'s sliced plan also weighs, at its best slices, the short sequences packed as these plain methods
pack them (method, mbs): around long chains many small microbatches can fill the pipeline better than
``dynamic``'s own grouping of the short ones, and the plain methods' sliced plans differ from it only there."""


def _first_round(job: _SplitJob, slice_len: int, use_rc: bool) -> _Try:
    """The first round's candidates of one slice length: ``packed``'s rows first or last; the other methods'
    equal-cost cuts first or spread (``_refine`` adds the rest around the best)."""
    if job.spec.method == "packed":
        return _Try(slice_len, use_rc)
    return _Try(slice_len, use_rc, "equal-cost", ("first", "spread"))


def _no_fit(job: _SplitJob, found: _Search) -> PackingError:
    """The one-line refusal when no candidate fits."""
    if found.lowest is None:
        return PackingError(f"oversize='split' with dp={job.spec.dp}: {found.too_few[0]} chain(s) of slices and "
                            f"{found.too_few[1]} short microbatch(es) cannot give every replica a microbatch (a chain "
                            f"runs whole on one replica)")
    long_ids, lengths = job.long_ids, job.lengths
    return PackingError(
        f"oversize='split': sequence {int(long_ids[np.argmax(lengths[long_ids])])} of "
        f"{int(lengths[long_ids].max())} tokens does not fit sliced: the lowest predicted peak "
        f"{int(found.lowest[0])} B (slices of {found.lowest[1]}) exceeds the limit {int(job.spec.memory_limit_bytes)} B"
        f"{'; --recompute auto keeps only block inputs and keys/values' if job.spec.recompute == 'never' else ''}")


def _split_job(lengths: np.ndarray, spec: PlanSpec, rec: ScheduleKind, model_cfg: ModelConfig,
               models: Models[MemoryModelLike], make_schedule: Callable[..., Schedule],
               threshold: int | None) -> _SplitJob:
    """The checks of ``plan_split`` (one line each) and its job (``rec``: the record of ``spec.schedule_kind``)."""
    kind, virtual = spec.schedule_kind, spec.virtual
    if not rec.slices or (virtual != 1 and not rec.virtual_stages):
        raise ValueError(f"oversize='split' runs on the {' or '.join(slice_kinds())} schedule, not {kind!r}"
                         f"{f' with virtual={virtual}' if virtual != 1 else ''}")
    if model_cfg.learned_positions and lengths.size and int(lengths.max()) > model_cfg.max_seq_len:
        raise PackingError(f"a sequence of {int(lengths.max())} tokens is longer than the model's max_seq_len "
                           f"{model_cfg.max_seq_len} (learned positions): size them from the trace, e.g. "
                           f"--model {model_cfg.name}:max_seq_len={int(lengths.max())}")
    row_cap = longest_row(spec, model_cfg, models.memory)
    if row_cap < 1:
        raise PackingError(f"no row fits under {spec.memory_limit_bytes} B at {spec.num_stages} stages ({kind})")
    cut = row_cap if threshold is None else min(int(threshold), row_cap)
    return _SplitJob(lengths, spec, models, make_schedule, row_cap, cut, threshold)


def _search_key(job: _SplitJob) -> tuple:
    """Everything ``_search`` reads: the batch, the settings, the models (by identity and digest: a model
    refit in place is another), the schedule builder and the cut."""
    return (job.lengths.tobytes(), repr(job.spec), id(job.models.memory), id(job.models.cost),
            model_digest(job.models.memory), model_digest(job.models.cost), job.make_schedule, job.row_cap, job.cut,
            job.threshold)


_SEARCHES: dict[tuple, tuple[_Search, dict[tuple, tuple[float, float, list[Plan], list[Schedule]]]]] | None = None
"""Searches kept for reuse with the simulations their job made (``reuse_searches``; None: none kept, the default)."""
_SEARCHES_MAX = 64


WEIGH_ALTERNATIVES = True
"""``dynamic``'s sliced plan weighs the plain methods' sliced searches (``_weigh_alternatives``; on by default,
``weighing_alternatives(False)`` turns it off). It was opt-in while the slow fp64 2-rank job
(``tests/test_fp64_grads.py``) measured a kept plan over its limit; the cause was the split backward's W tape keeping
the forward's graph alive (``dynmb.runtime.splitbackward``), not this search."""

WEIGH_FINALISTS: int | None = 2
"""How many screened alternatives' whole searches ``_weigh_alternatives`` runs (``_screen``: the fastest, and any
other within ``SCREEN_ERROR`` of the best); None: every alternative's (the full weighing, ~7-15x dynamic's own plan
time at P 8; ``studies/slicing/notes.md``)."""

KIND_SCREEN: float | None = 0.20
"""``--schedule auto`` (``plan_auto``): ``dynamic``'s sliced plan is searched on every kind first, its weighing
(``_weigh_alternatives``) then runs only on the kinds whose own sliced step is within this of the fastest kind's that
fits or than the fastest weighed step so far (the kinds weighed fastest own step first), and on every kind whose own
search found no plan that fits (``kinds_to_weigh``); None: on every kind. A measured screen, not a bound: it
assumes the weighing gains less than this over a kind's own search (measured: up to 3.9% on the long-document
cells in the sixth session, but 7.5% and 15.9% out held the winners in the ninth, P 16 pycode Llama-2-7B and P 8
pycode Llama-3.1-8B: 5% then, 20% since, ``studies/slicing/README.md``). The order-free floor cannot separate the
kinds (0.35-0.97 of the simulated step, ``studies/slicing/notes.md``)."""

_KEEP = object()


_OWN_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("dynmb_slicing_own_only", default=False)


def weighs(spec: PlanSpec) -> bool:
    """Whether ``spec``'s sliced plan weighs the plain methods' (``dynamic``, ``WEIGH_ALTERNATIVES`` on, not within
    ``own_searches_only``)."""
    return spec.method == "dynamic" and WEIGH_ALTERNATIVES and not _OWN_ONLY.get()


@contextlib.contextmanager
def own_searches_only() -> Iterator[None]:
    """Within it (this thread or task only) ``dynamic``'s sliced plans skip the weighing: ``plan_auto``'s first pass."""
    token = _OWN_ONLY.set(True)
    try:
        yield
    finally:
        _OWN_ONLY.reset(token)


def kinds_to_weigh(own: dict[str, tuple[float, bool] | None], weighed: float = math.inf) -> set[str]:
    """The kinds whose sliced plan the weighing runs on (``KIND_SCREEN``), of ``own``: each kind's own sliced step
    and whether it fits (None: it planned none); ``weighed``: the fastest weighed step that fits so far."""
    fitting = [step for step, fits in (v for v in own.values() if v is not None) if fits]
    if KIND_SCREEN is None or not fitting:
        return set(own)
    bar = min(*fitting, weighed) * (1 + KIND_SCREEN)
    return {kind for kind, v in own.items() if v is None or not v[1] or v[0] <= bar}


@contextlib.contextmanager
def kinds_screened(margin: float | None) -> Iterator[None]:
    """Within it ``KIND_SCREEN`` is ``margin`` (None: the weighing on every kind, as before the sixth session)."""
    global KIND_SCREEN
    if margin is not None and not margin >= 0:
        raise ValueError(f"kinds_screened: margin must be None or >= 0, not {margin!r}")
    was, KIND_SCREEN = KIND_SCREEN, margin
    try:
        yield
    finally:
        KIND_SCREEN = was


@contextlib.contextmanager
def weighing_alternatives(on: bool = True, finalists: object = _KEEP) -> Iterator[None]:
    """Within it ``dynamic`` weighs the plain methods' sliced searches (``on``) or not (``WEIGH_ALTERNATIVES``;
    on by default); ``finalists`` (an int, or None: every alternative's whole search) sets ``WEIGH_FINALISTS``."""
    global WEIGH_ALTERNATIVES, WEIGH_FINALISTS
    was = WEIGH_ALTERNATIVES, WEIGH_FINALISTS
    WEIGH_ALTERNATIVES = on
    if finalists is not _KEEP:
        if finalists is not None and (not isinstance(finalists, int) or finalists < 0):
            raise ValueError(f"weighing_alternatives: finalists must be None or an int >= 0, not {finalists!r}")
        WEIGH_FINALISTS = finalists
    try:
        yield
    finally:
        WEIGH_ALTERNATIVES, WEIGH_FINALISTS = was


@contextlib.contextmanager
def reuse_searches() -> Iterator[None]:
    """Within it, a method's sliced search (``_search_key``: the same batch, settings, models and builder) is
    made once: ``dynamic`` searches every plain method's plan of the batch (``_weigh_alternatives``), and a
    job that plans those methods next on the same batch (a comparison, ``studies/slicing/longdoc.py``) finds
    them made. The same plans as without it; the searches are dropped on leaving."""
    global _SEARCHES
    outer, _SEARCHES = _SEARCHES, {} if _SEARCHES is None else _SEARCHES
    try:
        yield
    finally:
        _SEARCHES = outer


def _search(job: _SplitJob) -> _Search:
    """The search of one method (module doc, step 2): the first round, unrecomputed before recomputed
    (``recompute``), then ``_refine`` around the best; within ``reuse_searches`` one made before is reused."""
    kept = _SEARCHES
    if kept is None:
        return _search_anew(job)
    key = _search_key(job)
    if key not in kept:
        found = _search_anew(job)
        if len(kept) >= _SEARCHES_MAX:
            kept.pop(next(iter(kept)))
        kept[key] = (found, job.sims)
    found, sims = kept[key]
    if sims is not job.sims:              # its candidates, simulated then, are not again (``plan_auto``'s weighing)
        job.sims.update(sims)
    return found


def _search_anew(job: _SplitJob) -> _Search:
    """``_search`` without the reuse."""
    found = _Search()
    for use_rc in {"never": [False], "always": [True], "auto": [False, True]}[job.spec.recompute]:
        for slice_len in job.slice_candidates():
            _try_slice_len(job, _first_round(job, slice_len, use_rc), found)
        if found.best is not None:
            break
    _refine(job, found)
    return found


SLICE_BUDGETS = (2, 4)
"""Budget divisors at which ``dynamic`` also weighs the budget methods' sliced plans (besides their own
setting, divisor 1): the budgets a user tunes them to (``studies/slicing/longdoc.py`` tunes them so)."""


def slice_alternatives() -> list[tuple[str, int | None]]:
    """The plain methods' sliced plans ``dynamic`` weighs (method, mbs): every registered method but
    ``dynamic`` at its own settings, ``fixed`` at mbs 1, the budget methods at ``SLICE_BUDGETS``."""
    from dynmb.packing import METHODS
    from dynmb.packing.methods import get_method

    out: list[tuple[str, int | None]] = [(m, None) for m in METHODS if m != "dynamic"] + [("fixed", 1)]
    out += [(m, d) for m in METHODS if get_method(m).mbs == "budget divisor" for d in SLICE_BUDGETS]
    return out


def _alternative_jobs(job: _SplitJob, model_cfg: ModelConfig) -> list[tuple[str, _SplitJob]]:
    """(name, job) of each plain method of ``slice_alternatives`` that can plan the batch (its own ``_SplitJob``:
    its own row, cuts and short packing; a method that refuses it, ``ValueError`` or ``PackingError``, is none),
    sharing ``job``'s simulations."""
    out = []
    for method, mbs in slice_alternatives():
        try:
            spec = job.spec.with_(method=method, mbs=mbs)
            alt = _split_job(job.lengths, spec, get_kind(spec.schedule_kind), model_cfg, job.models,
                             job.make_schedule, job.threshold)
            alt.sims = job.sims                   # a candidate another method made is not simulated again
            alt.packed = job.packed               # nor a packing of short sequences made again (the same spec)
            alt.pack_short(alt.short_ids)         # the method's own refusal, as plan_split's
        except ValueError:                        # PackingError is one: that method cannot plan the batch
            continue
        if alt.long_ids.size:
            out.append((method if mbs is None else f"{method}/{mbs}", alt))
    return out


def _keep(found: _Search, best: tuple[float, Plan, list[Plan], list[Schedule]] | None, name: str) -> None:
    """``best`` (an alternative's candidate) kept in ``found`` where strictly faster, ``slice_shorts`` naming it."""
    if best is not None and (found.best is None or best[0] < found.best[0]):
        t, plan, replicas, scheds = best
        found.best = (t, replace(plan, meta=plan.meta.with_(slice_shorts=name)), replicas, scheds)


SCREEN_ERROR = 0.01
"""An alternative whose screened step is within this of the best after screening is a finalist besides the
``WEIGH_FINALISTS`` fastest (near ties: the screen's error on the winners measured was 0-0.84% at P 4 and P 16, more
on source code at P 8: ``studies/slicing/notes.md``, the weighfix session)."""

SCREEN_WIDE = 0.10
"""``_screen`` tries an alternative's packing around dynamic's best candidate (``_centres``' others) only where its
step at that candidate is within this of the best so far (the winners measured were within 8.9%)."""


def _centres(job: _SplitJob, found: _Search) -> list[_Try]:
    """Where ``_screen`` tries each alternative's short packing: ``found``'s best candidate (its slices, cuts,
    recomputed share, lookahead and filled rows or not) with the chains first and as it places them, then around
    it, where another grouping fits otherwise than dynamic's: the next shorter slices as it places them, every
    longer slice length in every placement (``PLACEMENTS``: ``fixed`` won at longer slices spread on P 8 pycode
    Llama-3.1-8B), and (recomputed) the smaller ``RC_SHARES`` with the longest chain lookahead."""
    assert found.best is not None
    meta = found.best[1].meta
    best = _best_try(found, _Try(int(meta["slice_len"]), bool(meta["slice_recompute"]), fills=(bool(meta["slice_fill"]),)))
    out = [replace(best, placements=tuple(dict.fromkeys(("first", *best.placements))))]
    lens = job.slice_candidates()                 # longest first
    at = lens.index(best.slice_len) if best.slice_len in lens else -1
    if 0 <= at < len(lens) - 1:
        out.append(replace(best, slice_len=lens[at + 1]))
    out += [replace(best, slice_len=n, placements=PLACEMENTS) for n in reversed(lens[:max(at, 0)])]
    if best.use_rc and job.spec.recompute == "auto":
        look = max((best.lookahead, *chain_lookaheads(job.spec)))
        out += [replace(best, rc_share=share, lookahead=look) for share in sorted(RC_SHARES) if share < best.rc_share]
    return out


def _wider(job: _SplitJob, centres: list[_Try]) -> list[_Try]:
    """Where ``_screened`` goes on for an alternative that fits at none of ``centres``, until one fits: the first centre
    without a chain lookahead (a lookahead holds more in flight) in every placement (``PLACEMENTS``: chains last
    hold less beside them), then with its rows filled the other way (a packer may refuse the leftovers of filled
    rows), then every other slice length, shorter first, chains first, rows unfilled, without a lookahead: where the
    alternative's own search starts (``_first_round``)."""
    best = centres[0]
    fill = (best.fills or (False,))[0]
    out = [replace(best, lookahead=0, placements=PLACEMENTS), replace(best, lookahead=0, fills=(not fill,))]
    lens = sorted((n for n in job.slice_candidates() if n != best.slice_len), key=lambda n: (n > best.slice_len, -n))
    return out + [replace(best, slice_len=n, placements=("first",), fills=(False,), lookahead=0) for n in lens]


def _screened(job: _SplitJob, found: _Search, centres: list[_Try], packer: tuple[str, int | None]) -> _Search:
    """One alternative's short packing (``packer``) tried at ``centres`` (``_centres``): the first that fits as it is,
    the ones after it only where it fits within ``SCREEN_WIDE`` of ``found``'s best; of the smaller recomputed shares
    (the last centres, smallest first) only the first that fits. Where none fits, on at ``_wider``'s until one fits.
    Every one a candidate of ``found`` too."""
    assert found.best is not None
    tried = _Search()
    plain = len(centres)
    fitted = -1
    for k, centre in enumerate([*centres, *_wider(job, centres)]):
        if tried.best is not None and (k >= plain or (k == fitted + 1 and tried.best[0] > found.best[0] * (1 + SCREEN_WIDE))):
            break
        share = _Search()
        try:
            _try_slice_len(job, replace(centre, packer=packer), share)
        except PackingError:              # that packer cannot take the leftovers here: not a candidate
            continue
        if share.best is not None and tried.best is None:
            fitted = k
        if share.best is not None and (tried.best is None or share.best[0] < tried.best[0]):
            tried.best = share.best
        if share.best is not None and centre.rc_share < centres[0].rc_share:
            break                         # the smallest share that fits: the larger ones recompute more
    return tried


def _screen(job: _SplitJob, found: _Search, alts: list[tuple[str, _SplitJob]]) -> list[tuple[str, _SplitJob]]:
    """The alternatives whose whole search ``_weigh_alternatives`` runs: every one whose slices ``job`` cannot
    cut (``packed``'s rows, another longest row), and of the rest, each one's short packing tried at ``_centres``
    (``_screened``: a few simulations each, every one a candidate of ``found`` too), the ``WEIGH_FINALISTS`` fastest
    distinct groupings (``_grouping``; an alternative grouping as a finalist does is one too), every other whose
    screened step is within ``SCREEN_ERROR`` of ``found``'s best after screening, and every one the screen cannot
    rank (no candidate fits at any centre nor at ``_wider``'s: its whole search may still find a plan elsewhere, as a
    kind without a fitting plan is weighed, ``kinds_to_weigh``). One ranked only at ``_wider``'s competes as the
    others (P 16 pycode Llama-3.1-8B: ``sorted`` fits there without the lookahead, a finalist)."""
    if found.best is None:
        return alts
    centres = _centres(job, found)
    whole, scored = [], []
    for i, (name, alt) in enumerate(alts):
        if alt.spec.method == "packed" or (alt.row_cap, alt.cut) != (job.row_cap, job.cut):
            whole.append((name, alt))
            continue
        tried = _screened(job, found, centres, (alt.spec.method, alt.spec.mbs))
        _keep(found, tried.best, name)
        scored.append((math.inf if tried.best is None else tried.best[0], i, name, alt))
    scored.sort(key=lambda s: s[:2])
    bar = found.best[0] * (1 + SCREEN_ERROR)
    picked: list[tuple] = []
    for t, _, name, alt in scored:      # the fastest distinct groupings, near ties, and every one the screen missed
        if t == math.inf:
            whole.append((name, alt))
            continue
        grouping = _grouping(job, alt)
        if grouping in picked or len(set(picked)) < (WEIGH_FINALISTS or 0) or t <= bar:
            whole.append((name, alt))
            picked.append(grouping)
    return whole


def _grouping(job: _SplitJob, alt: _SplitJob) -> tuple:
    """What tells ``alt``'s short packing apart from another alternative's (``fixed`` and ``fixed/1`` may be one)."""
    return tuple((mb.seq_ids.tobytes(), mb.lengths.tobytes(), mb.padded_len, mb.batch)
                 for mb in job.pack_short(job.short_ids, (alt.spec.method, alt.spec.mbs)))


def _weigh_alternatives(job: _SplitJob, found: _Search, model_cfg: ModelConfig) -> None:
    """``dynamic``: plain methods' whole sliced searches (``_alternative_jobs``: exactly the plan each method
    makes of the batch under the same settings), each one's best kept where faster than ``found``'s
    (``meta.slice_shorts`` names it). ``WEIGH_FINALISTS`` None: every method's (never predicted slower than
    any of them, by construction); else those ``_screen`` picks (never slower than those, by construction,
    and than the others' short packings at ``_centres``; ``studies/slicing/notes.md`` measures the rest)."""
    alts = _alternative_jobs(job, model_cfg)
    for name, alt in alts if WEIGH_FINALISTS is None else _screen(job, found, alts):
        try:
            res = _search(alt)
        except ValueError:                        # PackingError is one: that method cannot plan the batch
            continue
        _keep(found, res.best, name)


def plan_split(lengths: np.ndarray, spec: PlanSpec, kind: ScheduleKind, *, model_cfg: ModelConfig,
               models: Models[MemoryModelLike], make_schedule: Callable[..., Schedule],
               threshold: int | None = None) -> tuple[Plan, Schedule, SimResult]:
    """Plan ``lengths`` with every sequence longer than the longest row (``threshold``: longer than
    it) cut into slices, each chain whole on one of the ``spec.dp`` replicas (module doc); ``kind``: the record
    of ``spec.schedule_kind``, resolved by the caller. Returns the
    plan (every replica, its predictions the slowest replica's time and every stage's highest peak)
    and replica 0's schedule and simulation."""
    t0 = time.perf_counter()
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    job = _split_job(lengths, spec, kind, model_cfg, models, make_schedule, threshold)
    job.pack_short(job.short_ids)                    # the method's own refusal comes first
    if not job.long_ids.size:
        raise ValueError("internal: plan_split called without a sequence longer than the longest row")
    found = replace(_search(job))                    # a copy: the search kept for reuse stays that method's
    if weighs(spec) and threshold is None:
        _weigh_alternatives(job, found, model_cfg)
    if found.best is None:
        raise _no_fit(job, found)
    _, plan, replicas, scheds = found.best
    plan = replace(plan, method=spec.method, spec=spec)       # an alternative's plan: dynamic's (meta names it)
    predicted = predict_replicas(replicas, scheds, models, Predictions())
    plan = replace(plan, predictions=predicted.predictions.updated(
        pred_peak_bytes=tuple(int(x) for x in np.ceil(np.max([np.asarray(s.peak_bytes) for s in predicted.sims],
                                                             axis=0))),
        est_makespan_s=predicted.predictions.pred_step_s, plan_s=time.perf_counter() - t0))
    plan.validate(lengths)
    return plan, scheds[0], predicted.sims[0]
