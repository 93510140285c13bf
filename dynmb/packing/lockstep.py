"""``lockstep``: fixed-length rows for engines with static shapes, balanced across the rows run together.

A static-shape pipeline engine (torchtitan's ``PipelineStage``, Megatron with THD rows of a fixed
token count) runs every microbatch as ``b`` rows of ``T`` tokens. A step is ``G`` accumulation groups,
each one pipeline call of ``M`` microbatches on each of ``D`` data-parallel replicas; the replicas
consume microbatch ``j`` together (their FSDP all-gathers and reduce-scatters meet at every
microbatch), so slot ``(g, j)`` costs the slowest of its ``D`` microbatches on every stage and op, and
a group costs the pipeline makespan of those maxima. Algorithm for one global batch (documents of at
most ``T`` tokens: the oversize policy ran before):

1. Each document's predicted weight from the one cost lookup: ``stage_costs(1, T, T + s^2)`` minus
   ``stage_costs(1, T, T)``, F + B summed over stages (every row runs the same linear work of ``T``
   tokens; documents differ by their attention work ``s^2``). Attention work as dynmb prices and runs
   it (``Microbatch.attention_work``, ``auto``): a microbatch of packed rows costs ``sum s^2`` over its
   documents, one whose rows hold one document each runs causal attention over the whole rows,
   ``rows x T^2``; so every candidate's rows of one document take a second where one can be had
   (``pair_lone_documents``).
2. Rows: ``K = G x M x D x b``; ``M`` derived, when not given, as the fewest whose rows hold the
   best-fit-decreasing packing of the batch (``rows.bfd_rows``).
3. Candidate rows: (i) the balanced fill -- documents longest first, each into the row of least
   weight among those with room (ties: the lowest row) -- and (ii) ``packed``'s best-fit-decreasing
   rows, every row left empty given the later half of the row of most documents (as ``pack`` splits
   ``packed``'s rows) or not; with one row per microbatch, each also dealt as ``pack`` deals
   ``packed``'s plan (largest first to the replica of least work, ``rows.assign_replicas``); and (iii)
   ``light ends``: the balanced fill over the rows of every group's middle slots first, the shortest
   documents left over balanced over the rows of its end slots (``END_SLOTS``: first and last, last only,
   first and last two), so the pipeline's fill and drain (1F1B: about ``(P - 1) (F_first + B_last)``) run
   the lightest rows while the middle carries the attention work.
4. Slots: rows sorted by predicted cost; consecutive runs of ``D x b`` rows form a lockstep slot (filled
   heaviest first in slot order; (iii): the middle slots, then the end slots), so
   the rows run together differ least, dealt heaviest first to the replicas of least work so far (snake-
   wise over a slot's ``b`` rounds), so every replica's total stays even too; the slots,
   heaviest first, fill the ``G`` groups ``M`` at a time (similar slots share a pipeline call); each
   group runs its slots in the order (as packed, descending, ascending, small at both ends) of the
   shortest predicted makespan (``dynmb.timing.makespan.makespans`` of the slot maxima).
5. The candidate of the shortest predicted step (the sum of its groups' makespans) is kept, so the
   plan is never predicted slower than ``packed``'s rows in either arrangement; then the pools of one
   dimension at a time (``POLISH``: M, D, G) are re-filled by the balanced fill (``rebalance``), each
   kept where it shortens the predicted step.

Lower bound (``step_lower_bound``, any row planner of the shape, 1F1B / GPipe, one stage per rank): a plan
puts whole documents (at most ``T`` tokens) into ``K >= K_min`` rows (``fewest_rows``: Martello and Toth's L2 bin-packing
bound, at least ``ceil(tokens / T)``), so every group runs ``M >= M_min = ceil(K_min / (G D b))`` microbatches. At a
fixed shape ``(b, T)`` a stage op's cost is affine in the microbatch's attention work, ``c(a) = c0 + k a`` (checked;
``GPUCostModel`` and ``AnalyticCostModel`` are), and a microbatch's work is ``a >= sum s^2`` of its documents (``T^2``
per lone row, ``>= s^2``), 1 for an empty one. A slot costs the slowest of its D microbatches, at least their mean, so
stage s's ops over a step take at least ``W_s = G M_min (c0F + c0B) + (kF + kB) sum_i s_i^2 / D`` (the batch's
attention, fixed by the documents, spread at best evenly over the replicas). Each group's stage s cannot start
before one forward passed stages ``< s`` (``H_s = sum_{q<s} (c_F,q(1) + p2p)``, the cheapest microbatch) and cannot
end before one backward passed them back (``R_s``, likewise); groups run one after another, so
``step >= max_s G (H_s + R_s) + W_s`` (``StepBound.lb_s``), for every placement, slot order and deal.

Documents longer than ``T``: ``--oversize truncate`` (cut at ``T``; the documented path) or ``drop``. ``split``
is refused (``planning.spec_check.lockstep_refusal``): a slice chain (``planning.slicing``) attends to its
earlier slices' keys and values across microbatches and runs its backwards in reverse slice order; a static-
shape engine's rows attend within themselves and torch's schedules run backwards in forward order.

Balance (``LockstepLayout.report``): per slot, the spread of its ``D`` microbatches' predicted
bottleneck-stage F + B (``max - min``, seconds and relative to the max), the worst over slots; per
group, the spread of the slot maxima over its ``M`` microbatches. The study's ablations
(``rebalance``) re-fill the rows of one dimension only (D: the rows of one slot; M: the microbatches
of one replica's pipeline call; G: the same position in every group) of a layout (the study's: ``in-order``'s,
``layout_of_plan``).
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, cast

import numpy as np

from dynmb.costmodel.base import CostModelLike
from dynmb.packing.context import PackingError
from dynmb.packing.embedprice import EmbedPricing
from dynmb.packing.rows import Flat, assign_replicas, bfd_rows
from dynmb.schedule.kinds import get_kind
from dynmb.timing.makespan import makespans
from dynmb.timing.makespan_zb import ESTIMATES as ZB_ESTIMATES
from dynmb.timing.makespan_zb import backward_shares

__all__ = ["LockstepShape", "LockstepLayout", "plan_lockstep", "layout_of_rows", "layout_of_plan", "doc_weights", "balanced_fill",
           "rebalance", "pair_lone_documents", "lockstep_flat", "derived_microbatches", "ORDERS", "StepBound",
           "step_lower_bound", "fewest_rows", "forgetful"]

ORDERS = ("packed", "descending", "ascending", "ends")
"""The slot orders each group is tried in (step 4)."""
POLISH = ("M", "D", "G")
"""The dimensions whose pools the kept candidate is re-filled along, one after another (step 5)."""


@dataclass(frozen=True, kw_only=True)
class LockstepShape:
    """The static shape of one step."""

    pack_len: int
    """T: tokens per row."""
    dp: int = 1
    """D: data-parallel replicas that run each microbatch together."""
    groups: int = 1
    """G: accumulation groups (pipeline calls) per step."""
    microbatches: int | None = None
    """M: microbatches per pipeline call; None: the fewest that hold the batch (step 2)."""
    rows_per_mb: int = 1
    """b: rows per microbatch."""
    kind: str = "1f1b"
    """The schedule kind whose makespan estimate prices a group."""
    virtual: int = 1
    """Model chunks per rank (interleaved)."""
    embedding: str = "first"
    """Where the token embedding runs (``PlanSpec.embedding``): ``last`` adds its embeds to each group's estimate."""

    def __post_init__(self) -> None:
        for name in ("pack_len", "dp", "groups", "rows_per_mb", "virtual"):
            if int(getattr(self, name)) != getattr(self, name) or getattr(self, name) < 1:
                raise ValueError(f"LockstepShape.{name} must be a whole number >= 1, got {getattr(self, name)!r}")
        if self.microbatches is not None and (int(self.microbatches) != self.microbatches or self.microbatches < 1):
            raise ValueError(f"LockstepShape.microbatches must be >= 1 or None, got {self.microbatches!r}")


@dataclass(frozen=True)
class LockstepLayout:
    """Documents in rows, rows in slots: row ``r`` of microbatch ``(g, j, d)`` is global row
    ``((g * M + j) * D + d) * b + r``."""

    row_of: np.ndarray
    """Global row of every document."""
    grid: tuple[int, int, int, int]
    """(G, M, D, b)."""
    F: np.ndarray
    """[P, G, M, D] predicted forward seconds of every microbatch."""
    B: np.ndarray
    """[P, G, M, D] predicted backward seconds."""
    step_s: float
    """Predicted step: the sum over groups of the makespan of the slot maxima."""
    report: dict[str, Any] = field(default_factory=dict)
    """Balance achieved (module doc) and the candidate kept."""


def doc_weights(lens: np.ndarray, pack_len: int, cost_model: CostModelLike) -> np.ndarray:
    """Every document's predicted weight in a row of ``pack_len`` tokens (step 1)."""
    s = np.asarray(lens, dtype=np.float64)
    T = float(pack_len)
    c = cost_model.stage_costs(np.ones(len(s) + 1), np.full(len(s) + 1, T), np.append(T + s * s, T))
    total = (c["F"] + c["B"]).sum(axis=0)
    return np.maximum(total[:-1] - total[-1], 0.0)


def balanced_fill(lens: np.ndarray, weights: np.ndarray, num_rows: int, pack_len: int) -> np.ndarray | None:
    """Row of every document, the rows' weights balanced under ``pack_len`` tokens each (step 3 (i)), then
    ``pair_lone_documents``; None when a document finds no row with room (``_least_loaded``)."""
    row = _least_loaded(lens, weights, np.zeros(num_rows, dtype=np.int64), pack_len)
    return None if row is None else pair_lone_documents(row, np.asarray(lens, dtype=np.int64), num_rows, pack_len)


FILL_MEMO = 512
"""Fills ``_least_loaded`` remembers (keyed by a digest of its inputs; 0: none). The fills are pure functions of
the lengths, weights, tiers and row length, not of the schedule kind, and ``schedule="auto"`` packs ``lockstep``
once per kind it weighs (``dynamic``'s final check): the second and third kind reuse the first's fills."""
_fills: OrderedDict[bytes, np.ndarray | None] = OrderedDict()
_fills_lock = threading.Lock()

REMEMBER = True
"""``plan_lockstep`` remembers its fills (``FILL_MEMO``) and its cost lookups (``_RememberedCosts``); False: it
computes every one (``forgetful``: the same plans, the plan time as before)."""


@contextlib.contextmanager
def forgetful() -> Iterator[None]:
    """Within it ``plan_lockstep`` remembers nothing (``REMEMBER`` off): the same layouts, computed afresh."""
    global REMEMBER
    was, REMEMBER = REMEMBER, False
    try:
        yield
    finally:
        REMEMBER = was


def _least_loaded(lens: np.ndarray, weights: np.ndarray, tier: np.ndarray, pack_len: int) -> np.ndarray | None:
    """``_least_fill``, remembered (``FILL_MEMO``); a copy of the remembered rows."""
    sizes = np.ascontiguousarray(lens, dtype=np.int64)
    w = np.ascontiguousarray(weights, dtype=np.float64)
    tiers = np.ascontiguousarray(tier, dtype=np.int64)
    if FILL_MEMO <= 0 or not REMEMBER:
        return _least_fill(sizes, w, tiers, pack_len)
    digest = hashlib.blake2b(digest_size=20)
    for part in (sizes, w, tiers, np.array([len(sizes), len(tiers), int(pack_len)], dtype=np.int64)):
        digest.update(part.tobytes())
    key = digest.digest()
    with _fills_lock:
        seen = key in _fills
        known = _fills.get(key)
        if seen:
            _fills.move_to_end(key)
    if not seen:
        known = _least_fill(sizes, w, tiers, pack_len)
        with _fills_lock:
            _fills[key] = known
            while len(_fills) > FILL_MEMO:
                _fills.popitem(last=False)
    return None if known is None else known.copy()


def _least_fill(sizes: np.ndarray, weights: np.ndarray, tiers: np.ndarray, pack_len: int) -> np.ndarray | None:
    """Row (an index into ``tiers``) of every document: documents longest first (ties: heavier, then lower index),
    each into the row of least weight with room among the rows of the lowest ``tier`` that has one (ties: the
    lowest row); None when no row has room. A heap of (tier, weight, row) over the rows with room for the
    current document answers in O(log K): a row popped without room is parked (a heap by room, most first) and
    comes back once the documents, ever shorter, fit it again, so each row is looked past once per document it
    takes. The loop reads plain Python lists."""
    w, size_of, tier_of = weights.tolist(), sizes.tolist(), tiers.tolist()
    heap = [(t, 0.0, r) for r, t in enumerate(tier_of)]
    heapq.heapify(heap)
    parked: list[tuple[int, int]] = []                  # (-room, row) of the rows looked past
    room, load = [int(pack_len)] * len(tier_of), [0.0] * len(tier_of)
    row = [0] * len(size_of)
    push, pop = heapq.heappush, heapq.heappop
    for i in np.lexsort((np.arange(len(sizes)), -weights, -sizes)).tolist():
        size = size_of[i]
        while parked and -parked[0][0] >= size:
            r = pop(parked)[1]
            push(heap, (tier_of[r], load[r], r))
        found = _heap_row(heap, parked, room, load, size)
        if found is None:
            return None
        row[i] = found
        room[found] -= size
        load[found] += w[i]
        push(heap, (tier_of[found], load[found], found))
    return np.array(row, dtype=np.int64)


def _heap_row(heap: list[tuple[int, float, int]], parked: list[tuple[int, int]], room: list[int],
              load: list[float], size: int) -> int | None:
    """The first row of ``heap`` (its entries whose weight is the row's current one) with ``size`` tokens of room,
    popped; the rows popped without room go to ``parked``; None when no row has room."""
    pop = heapq.heappop
    while heap:
        _, weight, r = pop(heap)
        if weight != load[r]:
            continue                                            # stale: the row took a document since
        if room[r] >= size:
            return r
        heapq.heappush(parked, (-room[r], r))
    return None


def pair_lone_documents(rows: np.ndarray, lens: np.ndarray, num_rows: int, pack_len: int) -> np.ndarray:
    """``rows`` with every row of one document and room given a second one where it can be had: the
    shortest document that fits, from a row of three or more (a row of one runs attention over all of
    its ``T`` tokens, step 1; with a second it runs ``sum s^2``)."""
    rows = rows.copy()
    lens = np.asarray(lens, dtype=np.int64)
    for r in np.flatnonzero(np.bincount(rows, minlength=num_rows) == 1).tolist():
        count = np.bincount(rows, minlength=num_rows)
        fill = np.bincount(rows, weights=lens, minlength=num_rows)
        ok = (count[rows] >= 3) & (lens <= pack_len - fill[r])
        if ok.any():
            rows[np.flatnonzero(ok)[np.argmin(lens[ok])]] = r
    return rows


def derived_microbatches(lens: np.ndarray, shape: LockstepShape) -> int:
    """M of step 2: the fewest microbatches per call whose rows hold ``packed``'s rows of the batch."""
    if shape.microbatches is not None:
        return int(shape.microbatches)
    rows = int(bfd_rows(lens, shape.pack_len).max()) + 1 if len(lens) else 1
    per_call = shape.dp * shape.groups * shape.rows_per_mb
    return max(1, -(-rows // per_call))


def _slot_costs(row_of: np.ndarray, lens: np.ndarray, grid: tuple[int, int, int, int], pack_len: int,
                cost_model: CostModelLike) -> dict[str, np.ndarray]:
    """``{"F", "B"}``: [P, G, M, D] predicted seconds of every microbatch (one lookup, attention
    ``sum s^2`` of its rows, at least 1 for an empty one)."""
    G, M, D, b = grid
    slots = G * M * D
    c = cost_model.stage_costs(np.full(slots, b), np.full(slots, pack_len), _attention(row_of, lens, b, slots, pack_len))
    P = c["F"].shape[0]
    return {op: c[op].reshape(P, G, M, D) for op in ("F", "B")}


def _attention(row_of: np.ndarray, lens: np.ndarray, b: int, slots: int, pack_len: int) -> np.ndarray:
    """Attention work of every microbatch of ``b`` rows (step 1): ``sum s^2`` when it holds more documents
    than non-empty rows, else its non-empty rows x ``T^2``; 1 for an empty one."""
    slot = row_of // b
    docs = np.bincount(slot, minlength=slots)
    rows = np.bincount(np.unique(row_of) // b, minlength=slots)
    packed = np.bincount(slot, weights=np.asarray(lens, dtype=np.float64) ** 2, minlength=slots)
    return np.maximum(np.where(docs > rows, packed, rows * float(pack_len) ** 2), 1.0)


def _group_makespans(F: np.ndarray, B: np.ndarray, comm: float, shape: LockstepShape, shares: Any,
                     cost_model: CostModelLike) -> np.ndarray:
    """Makespan of every group of slot maxima ([P, G, M] each), in the given order (with the embedding last, its
    embeds of every slot's ``b`` rows x ``T`` tokens added: ``dynmb.packing.embedprice``)."""
    P, G, M = F.shape
    kind = shape.kind if shape.virtual == 1 or get_kind(shape.kind).virtual_stages else "1f1b"
    est = makespans(F.reshape(P, G * M), B.reshape(P, G * M), comm, [M] * G, kind, shares=shares,
                    virtual=shape.virtual)
    embeds = EmbedPricing.of(shape.embedding, cost_model)
    if embeds is None:
        return est
    slots = np.ones(G * M)
    return embeds.added(est, embeds.seconds(slots * shape.rows_per_mb, slots * shape.pack_len), comm, [M] * G)


def _order(name: str, cost: np.ndarray) -> np.ndarray:
    """Slot order ``name`` of one group by its slots' cost (stable)."""
    idx = np.argsort(cost, kind="stable")
    if name == "descending":
        return idx[::-1].copy()
    if name == "ascending":
        return idx
    if name == "ends":                      # small at both ends: ascending, dealt to the front and the back
        return np.concatenate([idx[0::2], idx[1::2][::-1]])
    return np.arange(len(cost))


def _prices(lens: np.ndarray, shape: LockstepShape, cost_model: CostModelLike) -> tuple[float, Any]:
    """(P2P seconds of one microbatch, the zero-bubble kinds' backward shares or None)."""
    b, T = shape.rows_per_mb, shape.pack_len
    comm = float(np.asarray(cost_model.comm_s(np.array([b]), np.array([T]))).reshape(-1)[0]) \
        if hasattr(cost_model, "comm_s") else 0.0
    shares = backward_shares(cost_model, lens, cost_model.num_stages) \
        if get_kind(shape.kind).estimate_as in ZB_ESTIMATES else None
    return comm, shares


def _priced(row_of: np.ndarray, lens: np.ndarray, grid: tuple[int, int, int, int], shape: LockstepShape,
            cost_model: CostModelLike, extra: dict[str, Any]) -> LockstepLayout:
    """The layout of ``row_of`` (rows already in their slots) with its costs, step and balance."""
    c = _slot_costs(row_of, lens, grid, shape.pack_len, cost_model)
    comm, shares = _prices(lens, shape, cost_model)
    F, B = c["F"], c["B"]
    step = float(_group_makespans(F.max(axis=3), B.max(axis=3), comm, shape, shares, cost_model).sum())
    return LockstepLayout(row_of, grid, F, B, step, {**extra, **_balance(F, B)})


def _balance(F: np.ndarray, B: np.ndarray) -> dict[str, float]:
    """Worst spread of a slot's D microbatches and of a group's M slot maxima (bottleneck stage F + B)."""
    busy = (F + B).max(axis=0)                          # [G, M, D]
    hi, lo = busy.max(axis=2), busy.min(axis=2)         # [G, M]
    slot_max = hi
    return {"replica_spread_s": float((hi - lo).max()),
            "replica_spread": float(((hi - lo) / np.maximum(hi, 1e-300)).max()),
            "microbatch_spread_s": float((slot_max.max(axis=1) - slot_max.min(axis=1)).max()),
            "microbatch_spread": float(((slot_max.max(axis=1) - slot_max.min(axis=1))
                                        / np.maximum(slot_max.max(axis=1), 1e-300)).max())}


def layout_of_rows(rows: np.ndarray, lens: np.ndarray, shape: LockstepShape, M: int, cost_model: CostModelLike,
                   name: str = "lockstep", slot_order: np.ndarray | None = None) -> LockstepLayout:
    """Step 4: put the rows of ``rows`` (row per document, ``< G M D b`` rows) into slots -- the heaviest
    into the first slots of ``slot_order`` (slot ``g M + j``; default: group by group) -- and order every
    group by the best of ``ORDERS``."""
    G, D, b = shape.groups, shape.dp, shape.rows_per_mb
    grid = (G, M, D, b)
    K = G * M * D * b
    if len(rows) and int(rows.max()) >= K:
        raise PackingError(f"lockstep: {int(rows.max()) + 1} rows do not fit {G} x {M} x {D} x {b} slots")
    # rows priced alone (one row each): busiest stage F + B, with their own attention work
    c = cost_model.stage_costs(np.ones(K), np.full(K, shape.pack_len), _attention(rows, lens, 1, K, shape.pack_len))
    row_cost = (c["F"] + c["B"]).max(axis=0)
    by_cost = np.argsort(-row_cost, kind="stable")            # heaviest first
    sets = by_cost.reshape(G * M, D * b)
    place = np.empty(K, dtype=np.int64)                       # place[row] = global row in the grid
    load = np.zeros(D)                                        # each replica's work so far
    for k, members in zip(np.arange(G * M) if slot_order is None else slot_order, sets):
        g, j = divmod(int(k), M)
        for q, r in enumerate(members.tolist()):              # members heaviest first
            if q % D == 0:                                    # a round: the least-loaded replicas first,
                turn = np.argsort(load, kind="stable")        # snake-wise over the rounds
                turn = turn if (q // D) % 2 == 0 else turn[::-1]
            d = int(turn[q % D])
            place[r] = ((g * M + j) * D + d) * b + q // D
            load[d] += row_cost[r]
    return _ordered(place[rows], lens, grid, shape, cost_model, name)


def _ordered(row_of: np.ndarray, lens: np.ndarray, grid: tuple[int, int, int, int], shape: LockstepShape,
             cost_model: CostModelLike, name: str) -> LockstepLayout:
    """``row_of`` with every group's slots in the order of ``ORDERS`` of the shortest predicted step."""
    G, M, D, b = grid
    c = _slot_costs(row_of, lens, grid, shape.pack_len, cost_model)
    comm, shares = _prices(lens, shape, cost_model)
    slot_cost = (c["F"] + c["B"]).max(axis=3).sum(axis=0)       # [G, M]
    best: tuple[float, str, list[np.ndarray]] | None = None
    for order_name in ORDERS:
        perms = [_order(order_name, slot_cost[g]) for g in range(G)]
        Fo = np.stack([c["F"].max(axis=3)[:, g, p] for g, p in enumerate(perms)], axis=1)
        Bo = np.stack([c["B"].max(axis=3)[:, g, p] for g, p in enumerate(perms)], axis=1)
        step = float(_group_makespans(Fo, Bo, comm, shape, shares, cost_model).sum())
        if best is None or step < best[0] - 1e-15:
            best = (step, order_name, perms)
    assert best is not None
    new_slot = np.empty((G, M), dtype=np.int64)               # old (g, j) -> new j
    for group, p in enumerate(best[2]):
        new_slot[group, p] = np.arange(M)
    slot, rest = divmod(row_of, D * b)
    gi, ji = divmod(slot, M)
    moved = (gi * M + new_slot[gi, ji]) * D * b + rest
    return _priced(moved, lens, grid, shape, cost_model, {"candidate": name, "order": best[1]})


class _RememberedCosts:
    """``cost_model`` whose ``stage_costs`` answers (without ``recompute``) are remembered by their inputs' bytes for
    one ``plan_lockstep`` call, read-only: its document weights, zero-bubble shares and slot costs are asked for
    again and again with the same inputs. Everything else is the model's own."""

    def __init__(self, cost_model: CostModelLike) -> None:
        self._model = cost_model
        self._answers: dict[tuple, dict[str, np.ndarray]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def stage_costs(self, rows: Any, padded_len: Any, attn: Any = None, ops: tuple[str, ...] = ("F", "B"),
                    recompute: Any = None) -> dict[str, np.ndarray]:
        if recompute is not None:
            return self._model.stage_costs(rows, padded_len, attn, ops=ops, recompute=recompute)
        key: tuple = (tuple(ops),)
        for x in (rows, padded_len, attn):
            arr = None if x is None else np.ascontiguousarray(x)
            key += (None,) if arr is None else (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._answers:
            answer = self._model.stage_costs(rows, padded_len, attn, ops=ops)
            for v in answer.values():
                v.flags.writeable = False
            self._answers[key] = answer
        return dict(self._answers[key])


def plan_lockstep(lens: np.ndarray, shape: LockstepShape, cost_model: CostModelLike, *,
                  every_microbatch: bool = False) -> LockstepLayout:
    """Steps 1-5 for one global batch (every length ``<= shape.pack_len``); ``every_microbatch``: only
    candidates whose every microbatch holds a document (a plan's microbatches are never empty)."""
    lens = np.asarray(lens, dtype=np.int64)
    cost_model = cast(CostModelLike, _RememberedCosts(cost_model)) if REMEMBER else cost_model
    if len(lens) and int(lens.max()) > shape.pack_len:
        raise PackingError(f"lockstep: a document of {int(lens.max())} tokens is longer than the row "
                           f"({shape.pack_len}); the oversize policy runs first")
    M = derived_microbatches(lens, shape)
    K = shape.groups * M * shape.dp * shape.rows_per_mb
    bfd = bfd_rows(lens, shape.pack_len)
    if int(bfd.max()) + 1 > K:
        raise PackingError(f"lockstep: the batch needs {int(bfd.max()) + 1} rows of {shape.pack_len} tokens, "
                           f"more than the {K} of {shape.groups} group(s) x {M} microbatches x {shape.dp} "
                           f"replica(s) x {shape.rows_per_mb} row(s)")
    row_sets = {"packed rows": pair_lone_documents(bfd, lens, K, shape.pack_len),
                "packed rows split": pair_lone_documents(_fill_empty_rows(bfd, K), lens, K, shape.pack_len)}
    weights = doc_weights(lens, shape.pack_len, cost_model)
    filled = balanced_fill(lens, weights, K, shape.pack_len)
    if filled is not None:
        row_sets["balanced fill"] = filled
    candidates = [layout_of_rows(rows, lens, shape, M, cost_model, name) for name, rows in row_sets.items()]
    candidates += _light_ends(lens, weights, shape, M, cost_model)
    if shape.rows_per_mb == 1:
        candidates += [_dealt_by_work(rows, lens, shape, M, cost_model, f"{name} dealt by work")
                       for name, rows in row_sets.items()]
    if every_microbatch:
        slots = K // shape.rows_per_mb
        candidates = [lay for lay in candidates
                      if len(np.unique(lay.row_of // shape.rows_per_mb)) == slots]
        if not candidates:
            raise PackingError(f"lockstep: {len(lens)} document(s) cannot give each of the {slots} microbatches "
                               f"({shape.dp} replica(s) x {M}) one; use fewer replicas or a larger batch")
    best = min(candidates, key=lambda lay: lay.step_s)
    for dims in POLISH:                                  # re-fill one dimension's pools of the best, if faster
        polished = rebalance(best, lens, dims, shape, cost_model, weights=weights)
        full = not every_microbatch or len(np.unique(polished.row_of // shape.rows_per_mb)) == K // shape.rows_per_mb
        if full and polished.step_s < best.step_s:
            best = replace(polished, report={**polished.report, "candidate": f"{best.report['candidate']}, {dims}",
                                             "order": best.report["order"]})
    return best


END_SLOTS = ((0, -1), (-1,), (0, -2, -1))
"""The slots of every group kept light by the ``light ends`` candidates (step 3 (iii)): first and last, last only,
first and the last two."""


def _light_ends(lens: np.ndarray, weights: np.ndarray, shape: LockstepShape, M: int,
                cost_model: CostModelLike) -> list[LockstepLayout]:
    """Step 3 (iii): the balanced fill over the rows of every group's middle slots first (documents longest first,
    each into the middle row of least weight with room), the documents left over (the shortest) balanced over the
    rows of the end slots (``END_SLOTS``); step 4 then places the heaviest rows in the middle slots and the
    lightest in the end slots, so the pipeline's fill and drain run the lightest rows."""
    G, D, b = shape.groups, shape.dp, shape.rows_per_mb
    out = []
    for ends in END_SLOTS if M > len(END_SLOTS[-1]) else ():
        light = np.zeros((G, M), dtype=bool)
        light[:, list(ends)] = True
        rows_light = np.repeat(light.ravel(), D * b)                              # per global row
        rows = _fill_in_tiers(lens, weights, [np.flatnonzero(~rows_light), np.flatnonzero(rows_light)],
                              shape.pack_len)
        if rows is not None:
            slot_order = np.concatenate([np.flatnonzero(~light.ravel()), np.flatnonzero(light.ravel())])
            out.append(layout_of_rows(rows, lens, shape, M, cost_model, f"light ends {ends}", slot_order))
    return out


def _fill_in_tiers(lens: np.ndarray, weights: np.ndarray, tiers: list[np.ndarray], pack_len: int) -> np.ndarray | None:
    """Global row of every document: documents longest first, each into the row of least weight with room among
    the first tier of rows (global row ids) that has one, then ``pair_lone_documents``; None when none has."""
    rows_all = np.concatenate(tiers)
    tier = np.concatenate([np.full(len(t), k, dtype=np.int64) for k, t in enumerate(tiers)])
    local = _least_loaded(lens, weights, tier, pack_len)
    if local is None:
        return None
    return pair_lone_documents(rows_all[local], np.asarray(lens, dtype=np.int64), int(rows_all.max()) + 1, pack_len)


def _dealt_by_work(rows: np.ndarray, lens: np.ndarray, shape: LockstepShape, M: int,
                   cost_model: CostModelLike, name: str) -> LockstepLayout:
    """``packed``'s arrangement of ``rows`` (one row per microbatch): dealt largest first to the replica of
    least work with room (``rows.assign_replicas``, as ``pack`` deals a plan), each replica's in row order."""
    G, D = shape.groups, shape.dp
    K = G * M * D
    used = int(rows.max()) + 1
    c = cost_model.stage_costs(np.ones(used), np.full(used, shape.pack_len), _attention(rows, lens, 1, used, shape.pack_len))
    busy = np.append((c["F"] + c["B"]).max(axis=0), np.zeros(-used % D))        # empty rows to a multiple of D
    order, replica = assign_replicas(busy, D)
    place = np.empty(len(busy), dtype=np.int64)
    seen = np.zeros(D, dtype=np.int64)
    for r, d in zip(order, replica):
        g, j = divmod(int(seen[d]), M)
        seen[d] += 1
        place[r] = (g * M + j) * D + d
    if place.max() >= K:
        raise PackingError(f"lockstep: {used} rows do not fit {G} x {M} x {D} slots")
    return _ordered(place[rows], lens, (G, M, D, 1), shape, cost_model, name)


def _fill_empty_rows(rows: np.ndarray, K: int) -> np.ndarray:
    """``rows`` with each of the ``K`` rows holding a document where there are enough: every empty row
    takes the later half (by document index) of the row holding the most, as ``pack`` splits a ``packed``
    row to give every replica the same count (``rows.split_group``)."""
    rows = rows.copy()
    for empty in np.flatnonzero(np.bincount(rows, minlength=K) == 0).tolist():
        count = np.bincount(rows, minlength=K)
        donor = int(np.argmax(count))
        if count[donor] < 2:
            break
        docs = np.flatnonzero(rows == donor)
        rows[docs[len(docs) // 2:]] = empty
    return rows


def rebalance(layout: LockstepLayout, lens: np.ndarray, dims: str, shape: LockstepShape,
              cost_model: CostModelLike, *, weights: np.ndarray | None = None) -> LockstepLayout:
    """``layout`` with the documents of the rows that share every coordinate but ``dims`` (a subset of
    "DMG") re-filled by ``balanced_fill`` (a pool whose fill fails keeps its rows); the slots keep
    their places and order (the study's ablations). ``weights``: ``doc_weights`` of ``lens``, where known."""
    G, M, D, b = layout.grid
    lens = np.asarray(lens, dtype=np.int64)
    weights = doc_weights(lens, shape.pack_len, cost_model) if weights is None else weights
    coords = np.stack(np.unravel_index(layout.row_of // b, (G, M, D)), axis=1)      # [n, 3] (g, j, d)
    keep = [a for a, name in enumerate("GMD") if name not in dims]
    pool_key = np.ravel_multi_index(tuple(coords[:, a] for a in keep), tuple((G, M, D)[a] for a in keep)) \
        if keep else np.zeros(len(lens), dtype=np.int64)
    row_of = layout.row_of.copy()
    for key in np.unique(pool_key).tolist():
        docs = np.flatnonzero(pool_key == key)
        pool_rows = _pool_rows(coords[docs[0]], keep, (G, M, D), b)
        filled = balanced_fill(lens[docs], weights[docs], len(pool_rows), shape.pack_len)
        if filled is not None:
            row_of[docs] = pool_rows[filled]
    return _priced(row_of, lens, layout.grid, shape, cost_model, {"candidate": f"rebalanced {dims}"})


def _pool_rows(coord: np.ndarray, keep: list[int], dims: tuple[int, int, int], b: int) -> np.ndarray:
    """Global rows of the pool of ``coord``: every row whose kept coordinates equal its."""
    grids = np.meshgrid(*[np.arange(n) for n in dims], indexing="ij")
    mask = np.ones(dims, dtype=bool)
    for a in keep:
        mask &= grids[a] == coord[a]
    slots = np.flatnonzero(mask.ravel())
    return (slots[:, None] * b + np.arange(b)[None, :]).ravel()


def layout_of_plan(plan: Any, shape: LockstepShape, cost_model: CostModelLike) -> LockstepLayout:
    """Another method's plan of rows of ``T`` tokens (``packed``, ``in-order``) run in lockstep as it stands: replica
    ``d``'s microbatches in their order, ``M`` (the most any replica has, over ``G``, rounded up) per group,
    microbatch ``j`` of every replica together; a replica with fewer runs empty rows. Its documents are
    the plan's sequences (``seq_ids``), at their planned lengths."""
    D, G, b = plan.dp, shape.groups, shape.rows_per_mb
    rid = np.asarray(plan.replica_ids)
    per = np.bincount(rid, minlength=D)
    M = max(1, -(-int(per.max()) // G))
    n = int(plan.num_sequences)
    row_of = np.full(n, -1, dtype=np.int64)
    lens = np.zeros(n, dtype=np.int64)
    seen = np.zeros(D, dtype=np.int64)
    for mb, d in zip(plan.microbatches, rid.tolist()):
        g, j = divmod(int(seen[d]), M)
        seen[d] += 1
        if mb.batch > b:
            raise ValueError(f"layout_of_plan: a microbatch of {mb.batch} rows, more than rows_per_mb {b}")
        row_of[mb.seq_ids] = ((g * M + j) * D + d) * b + mb.row_ids
        lens[mb.seq_ids] = mb.lengths
    kept = row_of >= 0                                         # dropped sequences are in no row
    return _priced(row_of[kept], lens[kept], (G, M, D, b), shape, cost_model, {"candidate": plan.method})


def lockstep_flat(lens: np.ndarray, shape: LockstepShape, cost_model: CostModelLike) -> tuple[Flat, dict[str, Any]]:
    """The registry's form of ``plan_lockstep`` (one group): microbatches replica-major (replica ``d``'s
    ``M`` microbatches in their order, then replica ``d + 1``'s), every one ``b`` rows of ``T`` tokens,
    and the settings and balance for ``plan.meta``. Every row of a plan must hold a document: empty
    rows are left out of their microbatch (a static-shape engine pads them, ``static_rows``)."""
    lay = plan_lockstep(lens, shape, cost_model, every_microbatch=True)
    G, M, D, b = lay.grid
    slot, local = divmod(lay.row_of, b)
    g, rest = divmod(slot, M * D)
    j, d = divmod(rest, D)
    mb = (d * G + g) * M + j                                     # replica-major microbatch index
    nmb = G * M * D
    present = np.zeros((nmb, b), dtype=bool)
    present[mb, local] = True
    kept_rank = np.cumsum(present, axis=1) - 1                   # rows renumbered without the empty ones
    items = np.lexsort((lay.row_of, mb))
    local_row = kept_rank[mb[items], local[items]]
    nseq = np.bincount(mb, minlength=nmb)
    meta = {"mbs": b, "microbatches": M, "groups": G, "step_pred_s": lay.step_s, **lay.report}
    return Flat(items, local_row, nseq, np.full(nmb, shape.pack_len, np.int64), present.sum(axis=1)), meta


@dataclass(frozen=True)
class StepBound:
    """``step_lower_bound``'s answer (module doc, lower bound)."""

    lb_s: float
    """No plan of the batch on the shape runs a shorter predicted step."""
    rows: int
    """K_min: the fewest rows of ``T`` tokens any placement of the whole documents needs."""
    microbatches: int
    """M_min per group (or the shape's M where it gives more)."""
    stage: int
    """The stage whose bound is the largest."""
    attention_s: float
    """That stage's attention seconds of the batch (F + B, every document, divided by D)."""


def fewest_rows(lens: np.ndarray, pack_len: int) -> int:
    """Martello and Toth's L2 bound on the rows of ``pack_len`` tokens that whole documents (each ``<= pack_len``)
    need. For every ``alpha <= T / 2``: documents longer than ``T - alpha`` (J1) and in ``(T / 2, T - alpha]`` (J2)
    need a row each (no two of them share one); no document of at least ``alpha`` tokens (J3, up to ``T / 2``) fits
    beside a J1 one, so J3's tokens beyond the J2 rows' room need rows of their own. ``alpha = 0``:
    ``ceil(tokens / T)``."""
    s = np.sort(np.asarray(lens, dtype=np.int64))
    if not len(s):
        return 0
    T = int(pack_len)
    csum = np.concatenate([[0], np.cumsum(s)])
    alphas = np.unique(np.concatenate([[0], s[2 * s <= T]]))
    hi = np.searchsorted(s, T // 2, side="right")                    # s[:hi] <= T / 2 < s[hi:]
    lo = np.searchsorted(s, alphas, side="left")                     # s[lo:hi]: J3 (alpha <= s <= T / 2)
    j1 = np.searchsorted(s, T - alphas, side="right")                # s[j1:]: J1 (> T - alpha)
    n1, n2 = len(s) - j1, j1 - hi
    room2 = n2 * T - (csum[j1] - csum[hi])
    rest = csum[hi] - csum[lo] - room2
    return int((n1 + n2 + np.maximum(0, -(-rest // T))).max())


def _affine_in_attention(cost_model: CostModelLike, b: int, T: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per op, ``(c0, k)`` over stages with ``c(a) = c0 + k a`` at ``b`` rows of ``T`` tokens; ValueError unless the
    cost model is affine in the attention work there (three points)."""
    a = np.array([1.0, 0.5 * b * float(T) ** 2 + 1.0, float(b) * float(T) ** 2 + 1.0])
    c = cost_model.stage_costs(np.full(3, b), np.full(3, T), a)
    out = {}
    for op in ("F", "B"):
        k = (c[op][:, 2] - c[op][:, 0]) / (a[2] - a[0])
        mid = c[op][:, 0] + k * (a[1] - a[0])
        if not np.allclose(mid, c[op][:, 1], rtol=1e-9, atol=1e-15):
            raise ValueError(f"step_lower_bound: {type(cost_model).__name__}'s {op} cost is not affine in the "
                             "attention work at a fixed shape; the bound assumes it")
        out[op] = (c[op][:, 0] - k * a[0], k)
    return out


def step_lower_bound(lens: np.ndarray, shape: LockstepShape, cost_model: CostModelLike) -> StepBound:
    """The module doc's lower bound of the predicted step of ANY plan of ``lens`` (every length ``<= T``) on
    ``shape`` (G groups, D replicas, b rows of T tokens; M the fewest that hold the batch, or ``shape.microbatches``
    where larger), as ``plan_lockstep`` and ``layout_of_plan`` price a step (1F1B / GPipe, one stage per rank)."""
    lens = np.asarray(lens, dtype=np.int64)
    T, G, D, b = shape.pack_len, shape.groups, shape.dp, shape.rows_per_mb
    if len(lens) and int(lens.max()) > T:
        raise PackingError(f"step_lower_bound: a document of {int(lens.max())} tokens is longer than the row ({T})")
    if shape.virtual != 1 or get_kind(shape.kind).estimate_as not in ("1f1b", "gpipe"):
        raise ValueError(f"step_lower_bound: only 1f1b / gpipe with one stage per rank, got {shape.kind!r} "
                         f"x {shape.virtual}")
    rows = fewest_rows(lens, T)
    M = max(1, -(-rows // (G * D * b)), int(shape.microbatches or 0))
    line = _affine_in_attention(cost_model, b, T)
    comm, _ = _prices(lens, replace(shape, kind="1f1b"), cost_model)
    cheapest = {op: line[op][0] + line[op][1] for op in ("F", "B")}          # a microbatch's cost at a = 1
    fill = np.concatenate([[0.0], np.cumsum(cheapest["F"] + cheapest["B"] + 2 * comm)[:-1]])   # H_s + R_s
    attention = (line["F"][1] + line["B"][1]) * float(np.sum(lens.astype(np.float64) ** 2)) / D
    per_stage = G * fill + G * M * (line["F"][0] + line["B"][0]) + attention
    s = int(np.argmax(per_stage))
    return StepBound(float(per_stage[s]), rows, M, s, float(attention[s]))
