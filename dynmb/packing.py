"""Packers: group a global batch of variable-length sequences into microbatches under a
per-GPU memory limit. Pure numpy; every method returns a validated ``Plan``.

Shapes: a microbatch runs at ``batch`` rows x ``padded_len``, its longest row rounded up to
a multiple of ``round_to`` (default 1), for every method; memory admissibility, costs and
the makespan estimate all see the rounded shape. The longest admissible length
(``meta["longest_fitting_length"]``) is the largest multiple of ``round_to`` up to the
model's ``max_seq_len`` whose one-row microbatch is admissible (rounded down).

Memory rule (shared by all methods): stage i may spend ``cap_i = limit - state_bytes_i``
on activations, with ``k_i`` the microbatches it holds in flight (``P - i`` under 1F1B /
memory-aware / interleaved, ``1`` under GPipe, where the whole batch is then checked). A
microbatch (b rows x s) is admissible under the tight budget ``k_i * act_i(b, s) +
transient_i(b, s) <= cap_i`` (exact for equal microbatches). The plan's
``pred_peak_bytes`` is the exact ``MemoryModel.peak_bytes`` of the result; if a mix of
sizes exceeds the limit, the method is re-run under the safe budget ``k_i * (act_i +
transient_i) <= cap_i`` (a window of k such microbatches plus one op's buffers never
exceeds the cap, in any order); ``meta["budget"]`` says which was used.

Cost: every time estimate goes through the one lookup ``cost_model.stage_costs(rows,
padded_len, attn)`` with each microbatch's attention work
``Microbatch.attention_work(model_cfg.attention)`` (sum of s_i^2 over the documents of a
packed microbatch under ``auto``, rows x padded_len^2 for one document per row), and the
one makespan estimate ``dynmb._packutil.makespan`` (``predictions["est_makespan_s"]``).

Methods (``METHODS``):

- ``fixed``: ``mbs`` sequences per microbatch in batch order, padded to the longest.
  Without ``mbs``: the largest whose worst case (every row at the batch's longest length,
  rounded) is admissible.
- ``sorted``: as ``fixed`` over sequences sorted by length (longest first).
- ``packed``: Megatron-style sequence packing as its users configure it: rows of a fixed
  ``pack_len`` tokens filled best-fit-decreasing with whole documents (each document,
  longest first, into the open row with the least room that still holds it),
  document-causal attention, ``mbs`` rows per microbatch, default 1 (Megatron's
  micro-batch-size 1 with packing: the pipeline gets one microbatch per row). Default
  ``pack_len``: the longest row admissible as a one-row microbatch, capped at the model's
  ``max_seq_len`` (a multiple of ``round_to``). An explicit ``pack_len`` is rounded up to a
  multiple of ``round_to`` and must lie in [1, that default]. Documents longer than
  ``pack_len`` follow ``oversize``.
- ``token-budget``: fairseq ``batch_by_size``: length-ascending, a microbatch grows while
  rows x padded_len <= T; T is the largest token count admissible at the longest length.
- ``dynapipe``: DynaPipe's DP (see ``dynmb._dynapipe``) over the rounded lengths.
- ``dynamic``: this project's method (see ``dynmb._dynamic``).

Data parallelism ``dp = D``: microbatches are split (largest first) until their number
divides by D, then dealt largest-first to the least-loaded replica among those with room,
so every replica runs m / D microbatches with balanced predicted time.

Oversize sequences (longer than the longest admissible length; for ``packed``, than
``pack_len``): ``oversize="error"`` raises ``PackingError`` naming them and the length
that fits; ``"truncate"`` / ``"drop"`` list them in ``plan.meta["truncated"|"dropped"]``.
``plan.meta`` also records ``round_to`` and ``pack_len`` (None for the other methods).
"""

from __future__ import annotations

import gc
import time
from typing import Any, Callable

import numpy as np

from ._dynamic import dynamic_groups
from ._dynapipe import dynapipe_groups
from ._packutil import (Flat, Group, assign_replicas, fixed_groups, flat_to_groups, groups_to_flat, makespan,
                        packed_flat, round_down, round_up, split_group, token_budget_groups)
from .memory import inflight_limit, interleaved_inflight
from .types import Microbatch, Plan

__all__ = ["METHODS", "PackingError", "pack", "max_fitting_length", "auto_mbs"]

METHODS = ("fixed", "sorted", "packed", "token-budget", "dynapipe", "dynamic")
_KINDS = ("gpipe", "1f1b", "interleaved", "memory-aware", "zb-h1", "zb")   # zb kinds pack as 1F1B (dynmb.memory)
_OVERSIZE = ("error", "truncate", "drop")


class PackingError(ValueError):
    """The global batch cannot be packed under the memory limit (names the sequences / numbers)."""


class _Ctx:
    """Per-call constants: caps, in-flight counts and the admissible-rows function."""

    def __init__(self, mm: Any, limit: int, p: int, kind: str, tight: bool = True, virtual: int = 1) -> None:
        self.mm, self.limit, self.p, self.kind, self.tight = mm, int(limit), p, kind, tight
        state = np.asarray(mm.state_bytes, dtype=np.float64)
        if kind == "interleaved" and virtual > 1:
            # one GPU holds stages r, r + R, ...: their states add up, and at most `warm` chunk-
            # microbatches are in flight on it (the bound of memory.peak_from_matrix)
            if p % virtual:
                raise PackingError(f"{p} stages are not a multiple of virtual {virtual}")
            R = p // virtual
            rank = np.arange(p) % R
            state = np.bincount(rank, weights=state, minlength=R)[rank]
            self.k = interleaved_inflight(rank, R, virtual)
        else:
            self.k = np.array([1 if kind == "gpipe" else inflight_limit(i, p, kind, 2**30) for i in range(p)])
        self.caps = float(limit) - state
        if np.any(self.caps <= 0):
            i = int(np.argmin(self.caps))
            where = f"stage {i}" if virtual == 1 or kind != "interleaved" else f"the GPU holding stage {i}"
            raise PackingError(
                f"memory limit {int(limit)} B is below the model states of {where}: "
                f"{int(state[i])} B (params + grads + optimizer); states per stage: "
                f"{[int(x) for x in mm.state_bytes]}")

    def bmax(self, s: Any) -> np.ndarray:
        return self.mm.max_rows(self.caps, s, self.k, tight=self.tight)

    def max_len(self, cap_len: int) -> int:
        """Largest s <= cap_len with one admissible row (bmax is non-increasing in s)."""
        if self.bmax([cap_len])[0] >= 1:
            return int(cap_len)
        lo, hi = 0, int(cap_len)                   # bmax(lo) >= 1 (or lo == 0), bmax(hi) == 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.bmax([mid])[0] >= 1 else (lo, mid)
        return lo

    def length_cap(self, upto: int, round_to: int = 1) -> int:
        """Largest multiple of ``round_to`` <= ``upto`` with one admissible row (0 if none)."""
        top = round_down(int(upto), round_to)
        return round_down(self.max_len(top), round_to) if top >= 1 else 0

    def token_budget(self, s: int) -> int:
        """Largest T with b = T / s (fractional) admissible at length s."""
        w = self.k[:, None] * self.mm.act_coef + (1 if self.tight else self.k[:, None]) * self.mm.transient_coef
        per_tok = w[:, 1] + w[:, 2] * s
        return int(max(0.0, np.min((self.caps - w[:, 0]) / np.maximum(per_tok, 1e-300))))


def max_fitting_length(memory_model: Any, memory_limit_bytes: int, num_stages: int,
                       schedule_kind: str = "1f1b", upto: int = 1 << 16, round_to: int = 1) -> int:
    """The longest sequence (a multiple of ``round_to``, <= ``upto``) admissible alone (one row)."""
    return _Ctx(memory_model, memory_limit_bytes, num_stages, schedule_kind).length_cap(upto, round_to)


def auto_mbs(memory_model: Any, memory_limit_bytes: int, num_stages: int, max_len: int,
             schedule_kind: str = "1f1b", round_to: int = 1) -> int:
    """The largest mbs whose worst case (every row ``max_len`` long, rounded up to a multiple
    of ``round_to``) is admissible (0 if none)."""
    ctx = _Ctx(memory_model, memory_limit_bytes, num_stages, schedule_kind)
    return int(ctx.bmax([round_up(int(max_len), round_to)])[0])


def _check_args(method: str, schedule_kind: str, oversize: str, dp: int, mbs: int | None, round_to: int,
                memory_model: Any, num_stages: int) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown packing method {method!r}; expected one of {METHODS}")
    if schedule_kind not in _KINDS:
        raise ValueError(f"unknown schedule kind {schedule_kind!r}; expected one of {_KINDS}")
    if oversize not in _OVERSIZE:
        raise ValueError(f"oversize must be error, truncate or drop, got {oversize!r}")
    if dp < 1 or (mbs is not None and mbs < 1):
        raise ValueError(f"dp and mbs must be >= 1, got dp={dp}, mbs={mbs}")
    if int(round_to) != round_to or round_to < 1:
        raise ValueError(f"round_to must be a whole number >= 1, got {round_to!r}")
    if memory_model.num_stages != num_stages:
        raise ValueError(f"memory model is for {memory_model.num_stages} stages, not {num_stages}")


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


def _packed_row_len(ctx: _Ctx, max_seq_len: int, pack_len: int | None, round_to: int) -> tuple[int, int]:
    """(row length of ``packed``, the longest row that fits): ``pack_len`` rounded up to a
    multiple of ``round_to``, by default the longest admissible one-row microbatch."""
    longest_row = ctx.length_cap(max_seq_len, round_to)
    if longest_row < 1:
        raise PackingError(f"no row fits under {ctx.limit} B at {ctx.p} stages ({ctx.kind})"
                           f"{f' at a multiple of round_to {round_to}' if round_to > 1 else ''}")
    if pack_len is None:
        return longest_row, longest_row
    if int(pack_len) != pack_len or pack_len < 1 or round_up(int(pack_len), round_to) > longest_row:
        raise PackingError(f"pack_len {pack_len!r} is out of range: rows must hold 1 to {longest_row} tokens "
                           f"(the longest one-row microbatch under {ctx.limit} B at {ctx.p} stages ({ctx.kind}), "
                           f"model max_seq_len {max_seq_len}{f', round_to {round_to}' if round_to > 1 else ''})")
    return round_up(int(pack_len), round_to), longest_row


def _oversize_message(over: np.ndarray, lengths: np.ndarray, len_cap: int, ctx: _Ctx, *, packed: bool,
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


def _method_flat(method: str, lens: np.ndarray, ctx: _Ctx, cost_model: Any, *, mbs: int | None, round_to: int,
                 len_cap: int, attention: str) -> tuple[Flat, dict[str, Any]]:
    """The microbatches of ``method`` in flat form and the settings it chose (for ``plan.meta``)."""
    longest_padded = round_up(int(lens.max()), round_to)
    if method in ("fixed", "sorted"):
        rows_per_mb = max(1, mbs or int(ctx.bmax([longest_padded])[0]))
        pos = np.arange(len(lens)) if method == "fixed" else np.argsort(-lens, kind="stable")
        return groups_to_flat(fixed_groups(pos, lens, rows_per_mb, round_to)), {"mbs": rows_per_mb}
    if method == "packed":
        return packed_flat(lens, len_cap, mbs or 1), {"mbs": mbs or 1}
    if method == "token-budget":
        max_tokens = ctx.token_budget(longest_padded)
        return groups_to_flat(token_budget_groups(lens, max_tokens, round_to)), {"max_tokens": max_tokens}
    if method == "dynapipe":
        return groups_to_flat(dynapipe_groups(lens, ctx.bmax, cost_model, ctx.p, round_to)), {}
    flat, _ = dynamic_groups(lens, ctx.bmax, cost_model, ctx.p, ctx.kind, getattr(cost_model, "comm_s", None),
                             round_to=round_to, max_len=len_cap, attention=attention)
    return flat, {}


def _microbatches(flat: Flat, ids: np.ndarray, L: np.ndarray) -> list[Microbatch]:
    """Microbatches of the flat groups; their invariants (non-empty, rows in range, no row
    empty or over padded_len) are checked for all at once, then built without per-object checks."""
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
    for arr in (a_ids, a_len, a_row):
        arr.setflags(write=False)
    out = []
    new = object.__new__
    for a, e, pl, b in zip([0] + ends[:-1], ends, plen.tolist(), batch.tolist()):
        m = new(Microbatch)
        m.__dict__.update(seq_ids=a_ids[a:e], lengths=a_len[a:e], row_ids=a_row[a:e], padded_len=pl, batch=b)
        out.append(m)
    return out


def _merge_cheapest(groups: list[Group], ctx: _Ctx, dp: int) -> list[Group]:
    """Merge the admissible pair of microbatches with the fewest padded tokens (used when no
    microbatch can be split further and their number does not divide by ``dp``)."""
    plen = np.array([g[2] for g in groups])
    rows = np.array([g[3] for g in groups])
    bm = ctx.bmax(plen)
    i, j = np.triu_indices(len(groups), 1)
    ok = rows[i] + rows[j] <= np.minimum(bm[i], bm[j])
    if not np.any(ok) or len(groups) <= dp:
        raise PackingError(f"cannot give {dp} data-parallel replicas the same number of microbatches: "
                           f"{len(groups)} microbatches of single sequences that cannot be merged under the limit")
    cost = np.where(ok, np.maximum(plen[i], plen[j]) * (rows[i] + rows[j]), np.inf)
    k = int(np.argmin(cost))
    a, b = groups[i[k]], groups[j[k]]
    merged = (np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1] + a[3]]), max(a[2], b[2]), a[3] + b[3])
    return [g for q, g in enumerate(groups) if q not in (i[k], j[k])] + [merged]


def _balance_replicas(flat: Flat, ctx: _Ctx, dp: int) -> Flat:
    """Split the largest splittable microbatches (else merge the cheapest pairs) until their
    number is a positive multiple of ``dp``."""
    groups = flat_to_groups(flat)
    while len(groups) % dp or len(groups) < dp:
        splittable = [j for j, g in enumerate(groups) if g[3] >= 2 or len(g[0]) >= 2]
        if not splittable:
            break
        big = max(splittable, key=lambda j: (groups[j][3], len(groups[j][0])))
        groups[big:big + 1] = split_group(groups[big])
    while len(groups) % dp:
        groups = _merge_cheapest(groups, ctx, dp)
    return groups_to_flat(groups)


def _estimate(microbatches: list[Microbatch], cost_model: Any, memory_model: Any, attention: str, kind: str,
              virtual: int, dp: int) -> tuple[list[Microbatch], list[int] | None, np.ndarray, float]:
    """(microbatches replica by replica, replica ids, predicted peak bytes per stage, estimated
    makespan of the slowest replica), from the one cost lookup with each microbatch's attention work."""
    shapes = np.array([[mb.batch, mb.padded_len] for mb in microbatches], dtype=np.float64)
    attn = shapes[:, 0] * shapes[:, 1] ** 2                  # one document per row (every row holds one)
    for j, mb in enumerate(microbatches):
        if mb.num_seqs > mb.batch:                            # some row holds several documents
            attn[j] = mb.attention_work(attention)
    cost = cost_model.stage_costs(shapes[:, 0], shapes[:, 1], attn)
    comm_s = np.broadcast_to(np.asarray(cost_model.comm_s(shapes[:, 0], shapes[:, 1]) if hasattr(cost_model, "comm_s")
                                        else 0.0, dtype=np.float64), (len(microbatches),))
    replica_ids = None
    replicas = [np.arange(len(microbatches))]
    if dp > 1:
        busy = (cost["F"] + cost["B"]).max(axis=0)
        perm, replica_ids = assign_replicas(busy, dp)
        microbatches = [microbatches[j] for j in perm]
        shapes, comm_s = shapes[perm], comm_s[perm]
        cost = {op: v[:, perm] for op, v in cost.items()}
        replicas = [np.flatnonzero(np.asarray(replica_ids) == r) for r in range(dp)]
    peak = np.zeros(memory_model.num_stages)
    estimates = []
    for sel in replicas:
        peak = np.maximum(peak, memory_model.peak_bytes(shapes[sel, 0], shapes[sel, 1], kind, virtual=virtual))
        estimates.append(makespan(cost["F"][:, sel], cost["B"][:, sel], comm_s[sel], kind))
    return microbatches, replica_ids, peak, max(estimates)


def pack(lengths: Any, method: str, *, num_stages: int, memory_limit_bytes: int, memory_model: Any,
         cost_model: Any, mbs: int | None = None, schedule_kind: str = "1f1b", dp: int = 1,
         oversize: str = "error", pack_len: int | None = None, round_to: int = 1, virtual: int = 1,
         recompute: str = "never") -> Plan:
    """Pack the global batch ``lengths`` with ``method``; see the module docstring.

    ``mbs``: rows per microbatch of ``fixed`` / ``sorted`` / ``packed`` (``packed`` default 1).
    ``pack_len``: the row length of ``packed`` (the other methods ignore it). ``round_to``:
    every ``padded_len`` is a multiple of it. ``recompute``: never, always or auto (``dynmb.recompute``).
    The cyclic garbage collector is paused during the call (packing
    allocates many small objects and creates no cycles); its previous state is restored.
    """
    if recompute != "never":
        from .recompute import pack_with_recompute
        return pack_with_recompute(pack, lengths, method, recompute=recompute, num_stages=num_stages,
                                   memory_limit_bytes=memory_limit_bytes, memory_model=memory_model,
                                   cost_model=cost_model, mbs=mbs, schedule_kind=schedule_kind, dp=dp,
                                   oversize=oversize, pack_len=pack_len, round_to=round_to, virtual=virtual)
    gc_was = gc.isenabled()
    gc.disable()
    try:
        return _pack(lengths, method, num_stages=num_stages, memory_limit_bytes=memory_limit_bytes,
                     memory_model=memory_model, cost_model=cost_model, mbs=mbs, schedule_kind=schedule_kind,
                     dp=dp, oversize=oversize, pack_len=pack_len, round_to=round_to, virtual=virtual)
    finally:
        if gc_was:
            gc.enable()


def _pack(lengths: Any, method: str, *, num_stages: int, memory_limit_bytes: int, memory_model: Any,
          cost_model: Any, mbs: int | None, schedule_kind: str, dp: int, oversize: str,
          pack_len: int | None, round_to: int, virtual: int) -> Plan:
    t0 = time.perf_counter()
    _check_args(method, schedule_kind, oversize, dp, mbs, round_to, memory_model, num_stages)
    round_to = int(round_to)
    orig = _check_lengths(lengths)
    cfg = memory_model.model_cfg
    ctx = _Ctx(memory_model, memory_limit_bytes, num_stages, schedule_kind, virtual=virtual)
    packed = method == "packed"
    if packed:
        len_cap, longest_row = _packed_row_len(ctx, cfg.max_seq_len, pack_len, round_to)
    else:
        len_cap = longest_row = ctx.length_cap(cfg.max_seq_len, round_to)

    def message(over: np.ndarray) -> str:
        return _oversize_message(over, orig, len_cap, ctx, packed=packed, max_seq_len=cfg.max_seq_len,
                                 round_to=round_to, longest_row=longest_row)

    lens, ids, meta = _apply_oversize(orig, len_cap, oversize, message)
    L = lens[ids]
    for tight in (True, False):
        # tight budget (k * act + tr) first; if the exact peak of a mix exceeds the limit, the safe one
        ctx = _Ctx(memory_model, memory_limit_bytes, num_stages, schedule_kind, tight=tight, virtual=virtual)
        flat, chosen = _method_flat(method, L, ctx, cost_model, mbs=mbs, round_to=round_to, len_cap=len_cap,
                                    attention=cfg.attention)
        if dp > 1:
            flat = _balance_replicas(flat, ctx, dp)
        microbatches, replica_ids, peak, est = _estimate(_microbatches(flat, ids, L), cost_model, memory_model,
                                                         cfg.attention, schedule_kind, virtual, dp)
        if not np.any(peak > memory_limit_bytes):
            meta.update(chosen, budget="tight" if tight else "safe")
            break
        if tight and not (mbs is not None and method in ("fixed", "sorted", "packed")):
            continue
        raise PackingError(_over_limit_message(method, peak, ctx, round_up(int(L.max()), round_to), len_cap))
    plan = Plan(microbatches=tuple(microbatches), method=method, num_stages=num_stages,
                memory_limit_bytes=int(memory_limit_bytes), num_sequences=len(orig), schedule_kind=schedule_kind,
                dp=dp, replica_ids=replica_ids,
                predictions={"pred_peak_bytes": [int(x) for x in np.ceil(peak)], "est_makespan_s": float(est),
                             "plan_s": time.perf_counter() - t0},
                meta={**meta, "longest_fitting_length": longest_row, "oversize": oversize, "round_to": round_to,
                      "pack_len": len_cap if packed else None})
    plan.validate(orig)
    return plan


def _over_limit_message(method: str, peak: np.ndarray, ctx: _Ctx, longest_padded: int, pack_len: int) -> str:
    i = int(np.argmax(peak - ctx.limit))
    hint = ""
    if method in ("fixed", "sorted"):
        hint = f"; the largest mbs whose worst case fits is {int(ctx.bmax([longest_padded])[0])}"
    elif method == "packed":
        hint = f"; the largest mbs (rows of pack_len {pack_len}) that fits is {int(ctx.bmax([pack_len])[0])}"
    return (f"{method}: predicted peak {int(peak[i])} B on stage {i} exceeds the limit {ctx.limit} B "
            f"under {ctx.kind}{hint}")
