"""``pack``: the dispatcher every packing method runs through.

``pack(lengths, spec, ...)`` for one global batch, ``spec`` a ``dynmb.core.planspec.PlanSpec``:

1. Check the arguments and the lengths (1-D, whole, >= 1); build the ``PackContext`` (caps,
   in-flight counts) of the memory limit, schedule kind and ``virtual`` chunks, once (the safe
   budget of step 5 shares it, ``PackContext.with_budget``).
2. Length cap: the longest admissible one-row length, a multiple of ``round_to`` up to the
   model's ``max_seq_len`` (for ``packed``: its row length, ``packed.packed_row_len``); no row
   is longer (``balanced``'s rows of several documents: a longer row is inadmissible).
   Longer sequences follow ``oversize``: ``error`` raises ``PackingError`` naming them and
   the length that fits, ``truncate`` / ``drop`` list them in ``plan.meta`` (``PlanMeta``).
3. The method's microbatches in flat form (``rows.Flat``), from the method registry
   (``methods.method_flat``: ``fixed``, ``sorted``, ``packed``, ``token-budget``, ``balanced``,
   ``dynapipe``, ``dynamic``); under the tight budget first.
4. Data parallelism ``dp = D``: microbatches are split (largest first; else the cheapest
   admissible pair merged) until their number is a positive multiple of D, then dealt
   largest-first to the least-loaded replica among those with room (``rows.assign_replicas``).
5. Estimate: every microbatch's F/B time per stage from the one cost lookup
   ``cost_model.stage_costs(rows, padded_len, attention work)`` on its ``CostFeatures``, the exact peak
   ``MemoryModel.peak_bytes`` per replica and the slowest replica's makespan from the one
   fast estimate ``dynmb.timing.makespan.makespan``. If the peak of a mix exceeds the limit, step 3 is rerun
   under the safe budget (``meta.budget`` says which was used); with an explicit ``mbs``
   of a fixed-size method, or under the safe budget, it raises ``PackingError``.
6. A ``Plan`` with ``predictions`` (``pred_peak_bytes``, ``est_makespan_s``, ``plan_s``) and
   ``meta`` (the method's settings, ``longest_fitting_length``, ``oversize``, ``round_to``,
   ``pack_len``, ``truncated``, ``dropped``), validated against the batch.

The cyclic garbage collector is paused during the call (packing allocates many small
objects and creates no cycles); its previous state is restored.
"""

from __future__ import annotations

import gc
import time
from typing import Any, Callable

import numpy as np

from dynmb.costmodel.loader import Models
from dynmb.memory.model import MemoryModelLike
from dynmb.core.features import CostFeatures
from dynmb.timing.makespan import makespans
from dynmb.timing.makespan_zb import ESTIMATES as ZB_ESTIMATES
from dynmb.timing.makespan_zb import backward_shares
from dynmb.schedule.kinds import ScheduleKind, get_kind
from dynmb.core.planspec import PlanSpec
from dynmb.core.planmeta import PlanMeta
from dynmb.core.predictions import Predictions
from dynmb.core.types import Microbatch, Plan
from dynmb.packing.context import PackContext, PackingError
from dynmb.packing.embedprice import EmbedPricing
from dynmb.packing.methods import MethodJob, get_method, method_flat, method_names
from dynmb.packing.packed import packed_row_len
from dynmb.packing.recompute import pack_with_recompute
from dynmb.packing.rows import (Flat, Group, assign_replicas, flat_to_groups, groups_to_flat, merge_groups, round_down, round_up,
                   split_group)

__all__ = ["METHODS", "pack"]

METHODS = method_names()
"""The registered packing methods (``packing.methods``)."""
_OVERSIZE = ("error", "truncate", "drop")


def _check_args(spec: PlanSpec, memory_model: MemoryModelLike) -> ScheduleKind:
    """What ``PlanSpec`` cannot check itself: the method and kind names, and the memory model's stages
    (numbers and option sets are checked when the spec is made). Returns the kind's record, resolved here once
    for the whole call."""
    get_method(spec.method)                   # unknown methods: ValueError naming the registered ones
    kind = get_kind(spec.schedule_kind)       # unknown kinds: ValueError naming the registered ones
    if spec.oversize not in _OVERSIZE:
        raise ValueError(f"oversize must be error, truncate or drop, got {spec.oversize!r}")
    if memory_model.num_stages != spec.num_stages:
        raise ValueError(f"memory model is for {memory_model.num_stages} stages, not {spec.num_stages}")
    if (refusal := mbs_refusal(spec)) is not None:
        raise ValueError(refusal)
    return kind


MBS_METHODS = tuple(m for m in METHODS if get_method(m).mbs)
"""Methods that take ``mbs`` (rows per microbatch, or the divisor of their token budget: the
registry's ``MethodRecord.mbs``); ``dynamic`` and ``dynapipe`` choose their own sizes."""


def mbs_refusal(spec: PlanSpec) -> str | None:
    """The one-line refusal of an ``mbs`` given to a method that chooses its own sizes, else None."""
    if spec.mbs is None or get_method(spec.method).mbs:
        return None
    takes = {kind: ", ".join(m for m in method_names() if get_method(m).mbs == kind)
             for kind in ("rows", "budget divisor")}
    return (f"--mbs {spec.mbs}: {spec.method} chooses its own microbatch sizes (mbs is the size of "
            f"{takes['rows']} and the budget divisor of {takes['budget divisor']}); leave it out")


def _check_lengths(lengths: Any) -> np.ndarray:
    a = np.asarray(lengths)
    if a.ndim != 1:
        raise PackingError(f"lengths must be a 1-D array, got shape {a.shape}")
    if a.size == 0:
        raise PackingError("empty global batch: no sequence to pack")
    if not np.issubdtype(a.dtype, np.integer):
        if not np.all(np.isfinite(a)) or np.any(a != np.round(a)):
            raise PackingError("lengths must be whole numbers")
    a = a.astype(np.int64)
    bad = np.flatnonzero(a < 1)
    if len(bad):
        raise PackingError(f"non-positive lengths for sequences {bad[:10].tolist()} "
                           f"(lengths {a[bad[:10]].tolist()}){' ...' if len(bad) > 10 else ''}")
    return a


def _oversize_message(over: np.ndarray, lengths: np.ndarray, len_cap: int, ctx: PackContext, *, packed: bool,
                      max_seq_len: int, round_to: int, longest_row: int) -> str:
    named = f"ids {over[:10].tolist()} with lengths {lengths[over[:10]].tolist()}{' ...' if len(over) > 10 else ''}"
    notes = [f"model max_seq_len {max_seq_len}"] if longest_row == round_down(max_seq_len, round_to) else []
    notes += [f"a multiple of round_to {round_to}"] if round_to > 1 else []
    bound = (f"the longest {'row' if packed else 'length'} that fits is {longest_row}"
             f"{' (' + ', '.join(notes) + ')' if notes else ''} under {ctx.limit} B at {ctx.p} stages ({ctx.kind})")
    if packed:
        return (f"{len(over)} document(s) longer than pack_len {len_cap}: {named}; {bound}; "
                f"oversize='truncate' or 'drop' keeps going")
    return f"{len(over)} sequence(s) cannot fit even alone: {named}; {bound}"


def _apply_oversize(lengths: np.ndarray, len_cap: int, oversize: str,
                    message: Callable[[np.ndarray], str]) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """(lengths after truncation, ids kept, meta) under the ``oversize`` policy."""
    meta: dict[str, Any] = {"truncated": [], "dropped": []}
    kept_lengths = lengths.copy()
    over = np.flatnonzero(lengths > len_cap)
    if len(over):
        if oversize == "error" or len_cap < 1:
            raise PackingError(message(over))
        if oversize == "truncate":
            kept_lengths[over] = len_cap
            meta["truncated"] = over.tolist()
        else:
            meta["dropped"] = over.tolist()
            if len(over) == len(lengths):
                raise PackingError(f"every sequence is longer than the longest that fits ({len_cap}); nothing left")
    ids = np.setdiff1d(np.arange(len(lengths)), np.asarray(meta["dropped"], dtype=np.int64))
    return kept_lengths, ids, meta


def _microbatches(flat: Flat, ids: np.ndarray, L: np.ndarray) -> list[Microbatch]:
    """Microbatches of the flat groups; their invariants (non-empty, rows in range, no row
    empty or over padded_len) are checked for all at once, then built without per-object checks, with what
    ``Microbatch`` derives from its fields known here (no slices; packed where it holds more sequences than rows,
    every row holding one at least)."""
    items, rows, nseq, plen, batch = flat
    mb = np.repeat(np.arange(len(nseq)), nseq)
    first_row = np.concatenate([[0], np.cumsum(batch)[:-1]])
    if np.any(nseq < 1) or np.any(rows < 0) or np.any(rows >= batch[mb]):
        raise PackingError("internal: a microbatch is empty or has a row id out of range")
    key = first_row[mb] + rows
    fill = np.bincount(key, weights=L[items], minlength=int(batch.sum()))
    if np.any(fill > np.repeat(plen, batch)) or np.any(np.bincount(key, minlength=int(batch.sum())) == 0):
        raise PackingError("internal: a row overflows its padded_len or is empty")
    ends = np.cumsum(nseq).tolist()
    a_ids, a_len, a_row = ids[items], L[items], np.array(rows, dtype=np.int64)
    a_off, a_cont = np.zeros(len(items), dtype=np.int64), np.zeros(len(items), dtype=bool)
    for arr in (a_ids, a_len, a_row, a_off, a_cont):
        arr.setflags(write=False)
    out = []
    new = object.__new__
    for a, e, pl, b, packed in zip([0] + ends[:-1], ends, plen.tolist(), batch.tolist(), (nseq > batch).tolist()):
        m = new(Microbatch)
        m.__dict__.update(seq_ids=a_ids[a:e], lengths=a_len[a:e], row_ids=a_row[a:e], padded_len=pl, batch=b,
                          offsets=a_off[a:e], continued=a_cont[a:e], slice_mask=a_cont[a:e], has_slices=False,
                          is_packed=packed)
        out.append(m)
    return out


MERGE_BLOCK = 256
"""Rows of the pair table ``_merge_cheapest`` builds at once (its memory: this many times the microbatches)."""


def _merge_cheapest(groups: list[Group], ctx: PackContext, dp: int) -> list[Group]:
    """Merge the admissible pair of microbatches with the fewest padded tokens (used when no
    microbatch can be split further and their number does not divide by ``dp``). Ties: the first pair
    (i, j), i < j, in row-major order. The pair table is built ``MERGE_BLOCK`` rows at a time (thousands of
    single-document microbatches made the whole table gigabytes)."""
    plen = np.array([g.padded_len for g in groups], dtype=np.float64)
    rows = np.array([g.batch for g in groups], dtype=np.int64)
    bm = ctx.bmax(plen.astype(np.int64))
    n, best, pair = len(groups), np.inf, (-1, -1)
    col = np.arange(n)
    for r0 in range(0, n if n > dp else 0, MERGE_BLOCK):
        i = np.arange(r0, min(r0 + MERGE_BLOCK, n))[:, None]
        together = rows[i] + rows[None, :]
        ok = (col[None, :] > i) & (together <= np.minimum(bm[i], bm[None, :]))
        cost = np.where(ok, np.maximum(plen[i], plen[None, :]) * together, np.inf)
        k = int(np.argmin(cost))
        if cost.flat[k] < best:
            best, pair = float(cost.flat[k]), (int(r0 + k // n), int(k % n))
    if not np.isfinite(best):
        raise PackingError(f"cannot give {dp} data-parallel replicas the same number of microbatches: "
                           f"{n} microbatches of single sequences that cannot be merged under the limit")
    merged = merge_groups(groups[pair[0]], groups[pair[1]])
    return [g for q, g in enumerate(groups) if q not in pair] + [merged]


def _balance_replicas(flat: Flat, ctx: PackContext, dp: int) -> Flat:
    """Split the largest splittable microbatches (else merge the cheapest pairs) until their
    number is a positive multiple of ``dp``."""
    groups = flat_to_groups(flat)
    while len(groups) % dp or len(groups) < dp:
        splittable = [j for j, g in enumerate(groups) if g.batch >= 2 or len(g.items) >= 2]
        if not splittable:
            break
        big = max(splittable, key=lambda j: (groups[j].batch, len(groups[j].items)))
        groups[big:big + 1] = split_group(groups[big])
    while len(groups) % dp:
        groups = _merge_cheapest(groups, ctx, dp)
    return groups_to_flat(groups)


def flat_features(flat: Flat, L: np.ndarray, attention: str) -> CostFeatures:
    """``CostFeatures.of`` of the microbatches ``_microbatches`` makes of ``flat`` (whole sequences, no
    recomputation), at once: a microbatch whose rows hold more than one document (more items than rows:
    every row holds one at least) costs the sum of its documents' s^2 under ``auto``, else rows x padded_len^2."""
    items, _, nseq, plen, batch = flat
    rows, padded = batch.astype(np.float64), plen.astype(np.float64)
    attn = rows * padded ** 2
    if attention == "auto" and np.any(nseq > batch):
        docs = np.add.reduceat(L[items].astype(np.int64) ** 2, np.cumsum(nseq) - nseq)
        attn = np.where(nseq > batch, docs.astype(np.float64), attn)
    elif attention not in ("auto", "dense"):
        return CostFeatures.of([], attention)          # its error names the settings
    return CostFeatures(rows, padded, attn, np.zeros(len(rows)), np.zeros(len(rows), dtype=bool))


def _estimate(microbatches: list[Microbatch], features: CostFeatures, models: Models[MemoryModelLike],
              spec: PlanSpec, rec: ScheduleKind) -> tuple[list[Microbatch], list[int] | None, np.ndarray, list[float]]:
    """(microbatches replica by replica, replica ids, predicted peak bytes per stage, estimated
    makespan of each replica), from the one cost lookup with each microbatch's attention work (``features``)."""
    cost_model, memory_model = models.cost, models.memory
    shapes = np.stack([features.rows, features.padded_len], axis=1)
    cost = features.costs(cost_model)
    comm_s = np.broadcast_to(np.asarray(cost_model.comm_s(shapes[:, 0], shapes[:, 1]) if hasattr(cost_model, "comm_s")
                                        else 0.0, dtype=np.float64), (len(microbatches),))
    kind, virtual, dp = spec.schedule_kind, spec.virtual, spec.dp
    replica_ids = None
    replicas = [np.arange(len(microbatches))]
    if dp > 1:
        busy = (cost["F"] + cost["B"]).max(axis=0)
        m = len(microbatches)              # a lockstep method's plan is replica-major already: kept
        perm, replica_ids = ((list(range(m)), [j * dp // m for j in range(m)]) if get_method(spec.method).lockstep
                             else assign_replicas(busy, dp))
        microbatches = [microbatches[j] for j in perm]
        shapes, comm_s = shapes[perm], comm_s[perm]
        cost = {op: v[:, perm] for op, v in cost.items()}
        replicas = [np.flatnonzero(np.asarray(replica_ids) == r) for r in range(dp)]
    peak = np.zeros(memory_model.num_stages)
    shares = (backward_shares(cost_model, np.concatenate([mb.lengths for mb in microbatches]), memory_model.num_stages)
              if rec.estimate_as in ZB_ESTIMATES and microbatches else None)
    for sel in replicas:
        peak = np.maximum(peak, memory_model.peak_bytes(shapes[sel, 0], shapes[sel, 1], kind, virtual=virtual))
    cols = np.concatenate(replicas)                 # every replica's estimate in one call (one level loop)
    sizes = [len(sel) for sel in replicas]
    estimates = makespans(cost["F"][:, cols], cost["B"][:, cols], comm_s[cols], sizes, kind, shares=shares,
                          virtual=virtual)
    embeds = EmbedPricing.of(spec.embedding, cost_model)
    if embeds is not None:
        estimates = embeds.added(estimates, embeds.seconds(shapes[cols, 0], shapes[cols, 1]), comm_s[cols], sizes)
    return microbatches, replica_ids, peak, estimates.tolist()


def pack(lengths: Any, spec: PlanSpec, *, models: Models[MemoryModelLike]) -> Plan:
    """Pack the global batch ``lengths`` under the settings ``spec``, priced by ``models`` (the cost and memory
    models, ``dynmb.costmodel.loader.Models``); see the module docstring.

    ``spec.mbs``: rows per microbatch of ``fixed`` / ``sorted`` / ``packed`` (``packed`` default 1);
    ``spec.pack_len``: the row length of ``packed`` (the other methods ignore it); ``spec.round_to``:
    every ``padded_len`` is a multiple of it; ``spec.recompute``: never, always or auto
    (``dynmb.packing.recompute``). ``spec.reorder`` is the planner's (packing ignores it).
    The cyclic garbage collector is paused during the call (packing
    allocates many small objects and creates no cycles); its previous state is restored.
    """
    if not isinstance(spec, PlanSpec):
        raise TypeError(f"pack takes the settings as one PlanSpec, got {type(spec).__name__}")
    if spec.recompute != "never":
        return pack_with_recompute(pack, lengths, spec, models=models)
    gc_was = gc.isenabled()
    gc.disable()
    try:
        return _pack(lengths, spec, models)
    finally:
        if gc_was:
            gc.enable()


class _OverLimit(PackingError):
    """A packing whose exact peak is over the limit under both budgets (``counts``: its microbatches
    per replica, for ``PackContext.for_microbatch_counts``)."""

    def __init__(self, message: str, counts: Any) -> None:
        super().__init__(message)
        self.counts = counts


def _pack(lengths: Any, spec: PlanSpec, models: Models[MemoryModelLike]) -> Plan:
    """``pack`` under ``PackContext.from_spec``. With virtual stages the exact peak counts the chunks in
    flight with the plan's own m; where that is more than packing assumed (interleaved rounds that R does
    not split warm up more), the batch is packed again with the in-flight counts of every m near the
    plan's, until it fits or the counts stop growing."""
    t0 = time.perf_counter()
    rec = _check_args(spec, models.memory)
    orig = _check_lengths(lengths)
    base = PackContext.from_spec(spec, models.memory, rec)
    while True:
        try:
            return _pack_under(base, orig, spec, models, t0)
        except _OverLimit as e:
            lo, hi = max(1, int(min(e.counts)) // 2), 2 * int(max(e.counts)) + 2 * spec.num_stages
            wider = base.for_microbatch_counts(range(lo, hi))
            if np.array_equal(wider.k, base.k):
                raise PackingError(str(e)) from None
            base = wider


def _pack_under(base: PackContext, orig: np.ndarray, spec: PlanSpec, models: Models[MemoryModelLike],
                t0: float) -> Plan:
    method, round_to, dp = spec.method, int(spec.round_to), spec.dp
    cfg = models.memory.model_cfg
    attention = spec.attention or cfg.attention
    packed = get_method(method).pack_len_rows
    if packed:
        len_cap, longest_row = packed_row_len(base, cfg.max_seq_len, spec.pack_len, round_to)
    else:
        len_cap = longest_row = base.length_cap(cfg.max_seq_len, round_to)

    def message(over: np.ndarray) -> str:
        return _oversize_message(over, orig, len_cap, base, packed=packed, max_seq_len=cfg.max_seq_len,
                                 round_to=round_to, longest_row=longest_row)

    lens, ids, meta = _apply_oversize(orig, len_cap, spec.oversize, message)
    L = lens[ids]
    for tight in (True, False):
        # tight budget (k * act + tr) first; if the exact peak of a mix exceeds the limit, the safe one
        ctx = base.with_budget(tight)
        flat, chosen = method_flat(method, MethodJob(L, ctx, models.cost, spec.mbs, round_to, len_cap, attention, dp))
        if dp > 1:
            flat = _balance_replicas(flat, ctx, dp)
        microbatches, replica_ids, peak, est = _estimate(_microbatches(flat, ids, L), flat_features(flat, L, attention),
                                                         models, spec, ctx.rec)
        if not np.any(peak > spec.memory_limit_bytes):
            meta.update(chosen, budget="tight" if tight else "safe")
            break
        if tight and not (spec.mbs is not None and get_method(method).mbs == "rows"):
            continue
        counts = np.bincount(replica_ids, minlength=dp) if replica_ids is not None else [len(microbatches)]
        raise _OverLimit(_over_limit_message(method, peak, ctx, round_up(int(L.max()), round_to), len_cap), counts)
    plan = Plan(microbatches=tuple(microbatches), method=method, num_stages=spec.num_stages,
                memory_limit_bytes=int(spec.memory_limit_bytes), num_sequences=len(orig),
                schedule_kind=spec.schedule_kind, dp=dp, spec=spec,
                replica_ids=None if replica_ids is None else tuple(replica_ids),
                predictions=Predictions(pred_peak_bytes=tuple(int(x) for x in np.ceil(peak)), est_makespan_s=max(est),
                                        est_replica_makespan_s=tuple(est) if dp > 1 else None,
                                        plan_s=time.perf_counter() - t0),
                meta=PlanMeta.from_dict(meta).with_(longest_fitting_length=longest_row, oversize=spec.oversize,
                                                    round_to=round_to, pack_len=len_cap if packed else None))
    plan.validate(orig)
    return plan


def _over_limit_message(method: str, peak: np.ndarray, ctx: PackContext, longest_padded: int, pack_len: int) -> str:
    i = int(np.argmax(peak - ctx.limit))
    hint, record = "", get_method(method)
    if record.mbs == "rows" and record.pack_len_rows:
        hint = f"; the largest mbs (rows of pack_len {pack_len}) that fits is {int(ctx.bmax([pack_len])[0])}"
    elif record.mbs == "rows":
        hint = f"; the largest mbs whose worst case fits is {int(ctx.bmax([longest_padded])[0])}"
    return (f"{method}: predicted peak {int(peak[i])} B on stage {i} exceeds the limit {ctx.limit} B "
            f"under {ctx.kind}{hint}")
