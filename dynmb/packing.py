"""Packers: group a global batch of variable-length sequences into microbatches under a
per-GPU memory limit. Pure numpy; every method returns a validated ``Plan``.

Memory rule (shared by all methods): stage i may spend ``cap_i = limit - state_bytes_i``
on activations, with ``k_i`` the microbatches it holds in flight (``P - i`` under 1F1B /
memory-aware / interleaved, ``1`` under GPipe, where the whole batch is then checked). A
microbatch (b rows x s) is admissible under the tight budget ``k_i * act_i(b, s) +
transient_i(b, s) <= cap_i`` (exact for equal microbatches). The plan's
``pred_peak_bytes`` is the exact ``MemoryModel.peak_bytes`` of the result; if a mix of
sizes exceeds the limit, the method is re-run under the safe budget ``k_i * (act_i +
transient_i) <= cap_i`` (a window of k such microbatches plus one op's buffers never
exceeds the cap, in any order); ``meta["budget"]`` says which was used.

Methods (``METHODS``):

- ``fixed``: ``mbs`` sequences per microbatch in batch order, padded to the longest.
  Without ``mbs``: the largest whose worst case (every row at the batch's longest length)
  is admissible.
- ``sorted``: as ``fixed`` over sequences sorted by length (longest first).
- ``packed``: Megatron-style rows of ``row_len`` tokens (default: next power of two >= the
  longest sequence, or the longest if that does not fit) filled first-fit-decreasing with
  whole documents (document-causal mask); ``mbs`` rows per microbatch.
- ``token-budget``: fairseq ``batch_by_size``: length-ascending, a microbatch grows while
  rows x longest <= T; T is the largest token count admissible at the longest length.
- ``dynapipe``: DynaPipe's DP (see ``dynmb._dynapipe``).
- ``dynamic``: this project's method (see ``dynmb._dynamic``).

Data parallelism ``dp = D``: microbatches are split (largest first) until their number
divides by D, then dealt largest-first to the least-loaded replica among those with room,
so every replica runs m / D microbatches with balanced predicted time.

Oversize sequences (longer than the longest admissible alone, or than ``max_seq_len``):
``oversize="error"`` raises ``PackingError`` naming them and the longest length that
fits; ``"truncate"`` / ``"drop"`` list them in ``plan.meta["truncated"|"dropped"]``.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import numpy as np

from ._dynamic import dynamic_groups
from ._dynapipe import dynapipe_split
from ._packutil import ffd_rows, makespan
from .memory import inflight_limit, interleaved_inflight
from .types import Microbatch, Plan

__all__ = ["METHODS", "PackingError", "pack", "max_fitting_length", "auto_mbs"]

METHODS = ("fixed", "sorted", "packed", "token-budget", "dynapipe", "dynamic")
_KINDS = ("gpipe", "1f1b", "interleaved", "memory-aware")


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

    def token_budget(self, s: int) -> int:
        """Largest T with b = T / s (fractional) admissible at length s."""
        w = self.k[:, None] * self.mm.act_coef + (1 if self.tight else self.k[:, None]) * self.mm.transient_coef
        per_tok = w[:, 1] + w[:, 2] * s
        return int(max(0.0, np.min((self.caps - w[:, 0]) / np.maximum(per_tok, 1e-300))))


def max_fitting_length(memory_model: Any, memory_limit_bytes: int, num_stages: int,
                       schedule_kind: str = "1f1b", upto: int = 1 << 16) -> int:
    """The longest sequence that is admissible alone (one row) under the limit."""
    return _Ctx(memory_model, memory_limit_bytes, num_stages, schedule_kind).max_len(upto)


def auto_mbs(memory_model: Any, memory_limit_bytes: int, num_stages: int, max_len: int,
             schedule_kind: str = "1f1b") -> int:
    """The largest mbs whose worst case (every row ``max_len`` long) is admissible (0 if none)."""
    return int(_Ctx(memory_model, memory_limit_bytes, num_stages, schedule_kind).bmax([max_len])[0])


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


def _fixed_groups(idx: np.ndarray, lens: np.ndarray, mbs: int) -> list[tuple]:
    out = []
    for a in range(0, len(idx), mbs):
        sel = idx[a:a + mbs]
        out.append((sel, np.arange(len(sel)), int(lens[sel].max()), len(sel)))
    return out


def _split_group(g: tuple) -> list[tuple]:
    items, rows, plen, b = g
    if b >= 2:
        h = b // 2
        lo = rows < h
        return [(items[lo], rows[lo], plen, h), (items[~lo], rows[~lo] - h, plen, b - h)]
    if len(items) >= 2:                      # a packed row: split its documents
        h = len(items) // 2
        return [(items[:h], np.zeros(h, np.int64), plen, 1), (items[h:], np.zeros(len(items) - h, np.int64), plen, 1)]
    return [g]


def _flat(groups: list[tuple]) -> tuple:
    """List of (items, rows, padded_len, batch) -> the flat form of ``dynmb._dynamic``."""
    return (np.concatenate([g[0] for g in groups]).astype(np.int64),
            np.concatenate([g[1] for g in groups]).astype(np.int64),
            np.array([len(g[0]) for g in groups], dtype=np.int64),
            np.array([g[2] for g in groups], dtype=np.int64), np.array([g[3] for g in groups], dtype=np.int64))


def _unflat(flat: tuple) -> list[tuple]:
    items, rows, nseq, plen, batch = flat
    cut = np.cumsum(nseq)[:-1]
    return list(zip(np.split(items, cut), np.split(rows, cut), plen.tolist(), batch.tolist()))


def _microbatches(flat: tuple, ids: np.ndarray, L: np.ndarray) -> list[Microbatch]:
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


def _merge_cheapest(groups: list[tuple], ctx: "_Ctx", dp: int) -> list[tuple]:
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


def _assign_replicas(groups: list[tuple], t: np.ndarray, dp: int) -> tuple[list[tuple], list[int]]:
    m = len(groups)
    per = m // dp
    load = np.zeros(dp)
    count = np.zeros(dp, dtype=np.int64)
    rep = np.zeros(m, dtype=np.int64)
    for j in np.argsort(-t, kind="stable").tolist():
        open_ = np.flatnonzero(count < per)
        r = int(open_[np.argmin(load[open_])])
        rep[j], load[r], count[r] = r, load[r] + t[j], count[r] + 1
    order = np.argsort(rep, kind="stable")          # replica by replica, keeping each one's order
    return [groups[j] for j in order.tolist()], rep[order].tolist()


def pack(lengths: Any, method: str, *, num_stages: int, memory_limit_bytes: int, memory_model: Any,
         cost_model: Any, mbs: int | None = None, schedule_kind: str = "1f1b", dp: int = 1,
         oversize: str = "error", row_len: int | None = None, virtual: int = 1) -> Plan:
    """Pack the global batch ``lengths`` with ``method``; see the module docstring.

    The cyclic garbage collector is paused during the call (packing allocates many small
    objects and creates no cycles); its previous state is restored on return.
    """
    gc_was = gc.isenabled()
    gc.disable()
    try:
        return _pack(lengths, method, num_stages=num_stages, memory_limit_bytes=memory_limit_bytes,
                     memory_model=memory_model, cost_model=cost_model, mbs=mbs, schedule_kind=schedule_kind,
                     dp=dp, oversize=oversize, row_len=row_len, virtual=virtual)
    finally:
        if gc_was:
            gc.enable()


def _pack(lengths: Any, method: str, *, num_stages: int, memory_limit_bytes: int, memory_model: Any,
          cost_model: Any, mbs: int | None, schedule_kind: str, dp: int, oversize: str,
          row_len: int | None, virtual: int = 1) -> Plan:
    t0 = time.perf_counter()
    if method not in METHODS:
        raise ValueError(f"unknown packing method {method!r}; expected one of {METHODS}")
    if schedule_kind not in _KINDS:
        raise ValueError(f"unknown schedule kind {schedule_kind!r}; expected one of {_KINDS}")
    if oversize not in ("error", "truncate", "drop"):
        raise ValueError(f"oversize must be error, truncate or drop, got {oversize!r}")
    if dp < 1 or (mbs is not None and mbs < 1):
        raise ValueError(f"dp and mbs must be >= 1, got dp={dp}, mbs={mbs}")
    if memory_model.num_stages != num_stages:
        raise ValueError(f"memory model is for {memory_model.num_stages} stages, not {num_stages}")
    orig = _check_lengths(lengths)
    ctx = _Ctx(memory_model, memory_limit_bytes, num_stages, schedule_kind, virtual=virtual)
    cfg = memory_model.model_cfg
    limit_len = min(cfg.max_seq_len, row_len or cfg.max_seq_len)
    lfit = ctx.max_len(min(int(orig.max()), limit_len))
    meta: dict[str, Any] = {"truncated": [], "dropped": []}
    lens = orig.copy()
    over = np.flatnonzero(orig > lfit)
    if len(over):
        if oversize == "error" or lfit == 0:
            raise PackingError(
                f"{len(over)} sequence(s) cannot fit even alone under {int(memory_limit_bytes)} B at "
                f"{num_stages} stages ({schedule_kind}): ids {over[:10].tolist()} with lengths "
                f"{orig[over[:10]].tolist()}; the longest length that fits is {lfit}"
                f"{' (model max_seq_len / row_len ' + str(limit_len) + ')' if lfit == limit_len else ''}")
        if oversize == "truncate":
            lens[over] = lfit
            meta["truncated"] = over.tolist()
        else:
            meta["dropped"] = over.tolist()
            if len(over) == len(orig):
                raise PackingError(f"every sequence is longer than the longest that fits ({lfit}); nothing left")
    ids = np.setdiff1d(np.arange(len(orig)), np.asarray(meta["dropped"], dtype=np.int64))
    L = lens[ids]
    lmax = int(L.max())
    for tight in (True, False):
        # tight budget (k * act + tr) first; if the exact peak of a mix exceeds the limit, the safe one
        ctx = _Ctx(memory_model, memory_limit_bytes, num_stages, schedule_kind, tight=tight, virtual=virtual)
        if method in ("fixed", "sorted"):
            b = mbs or int(ctx.bmax([lmax])[0])
            meta["mbs"] = b
            pos = np.arange(len(ids)) if method == "fixed" else np.argsort(-L, kind="stable")
            groups = _fixed_groups(pos, L, b)
        elif method == "packed":
            r = row_len or min(1 << (lmax - 1).bit_length(), cfg.max_seq_len)
            if ctx.bmax([r])[0] < 1:
                r = lmax
            row = ffd_rows(L, r)
            nrows = int(row.max()) + 1
            b = mbs or int(ctx.bmax([r])[0])
            meta.update(mbs=b, row_len=r)
            groups = []
            for a in range(0, nrows, b):
                sel = np.flatnonzero((row >= a) & (row < a + b))
                groups.append((sel, row[sel] - a, r, min(b, nrows - a)))
        elif method == "token-budget":
            tb = ctx.token_budget(lmax)
            meta["max_tokens"] = tb
            pos = np.argsort(L, kind="stable")
            ls = L[pos].tolist()
            groups, a = [], 0
            for e in range(1, len(ls) + 1):
                if e == len(ls) or (e + 1 - a) * ls[e] > tb:
                    sel = pos[a:e]
                    groups.append((sel, np.arange(len(sel)), ls[e - 1], e - a))
                    a = e
        elif method == "dynapipe":
            pos = np.argsort(L, kind="stable")
            cuts = dynapipe_split(L[pos], np.maximum(ctx.bmax(L[pos]), 1), cost_model, num_stages)
            groups = [(pos[a:e], np.arange(e - a), int(L[pos[e - 1]]), e - a) for a, e in zip(cuts[:-1], cuts[1:])]
        else:
            comm = getattr(cost_model, "comm_s", None)
            flat, _ = dynamic_groups(L, lambda s: ctx.bmax(s), cost_model, num_stages, schedule_kind, comm)
        if method != "dynamic":
            flat = _flat(groups)
        if dp > 1:
            groups = _unflat(flat)
            while len(groups) % dp or len(groups) < dp:      # split the largest splittable ...
                cand = [j for j, g in enumerate(groups) if g[3] >= 2 or len(g[0]) >= 2]
                if not cand:
                    break
                big = max(cand, key=lambda j: (groups[j][3], len(groups[j][0])))
                groups[big:big + 1] = _split_group(groups[big])
            while len(groups) % dp:                          # ... else merge the cheapest pairs
                groups = _merge_cheapest(groups, ctx, dp)
            flat = _flat(groups)
        mbs_list = _microbatches(flat, ids, L)
        shapes = np.stack([flat[4], flat[3]], axis=1).astype(np.float64)
        cost = cost_model.stage_costs(shapes[:, 0], shapes[:, 1])
        comm_s = cost_model.comm_s(shapes[:, 0], shapes[:, 1]) if hasattr(cost_model, "comm_s") else 0.0
        replica_ids = None
        reps = [np.arange(len(mbs_list))]
        if dp > 1:
            t = (cost["F"] + cost["B"]).max(axis=0)
            grouped, replica_ids = _assign_replicas(list(range(len(mbs_list))), t, dp)
            perm = list(grouped)
            mbs_list = [mbs_list[j] for j in perm]
            shapes, comm_s = shapes[perm], (np.asarray(comm_s)[perm] if np.ndim(comm_s) else comm_s)
            cost = {k: v[:, perm] for k, v in cost.items()}
            ra = np.asarray(replica_ids)
            reps = [np.flatnonzero(ra == r) for r in range(dp)]
        peak = np.zeros(num_stages)
        ests = []
        for sel in reps:
            peak = np.maximum(peak, memory_model.peak_bytes(shapes[sel, 0], shapes[sel, 1], schedule_kind,
                                                            virtual=virtual))
            c = np.asarray(comm_s)[sel] if np.ndim(comm_s) else comm_s
            ests.append(makespan(cost["F"][:, sel], cost["B"][:, sel], c, schedule_kind))
        if not np.any(peak > memory_limit_bytes):
            meta["budget"] = "tight" if tight else "safe"
            break
        if tight and not (mbs is not None and method in ("fixed", "sorted", "packed")):
            continue
        i = int(np.argmax(peak - memory_limit_bytes))
        hint = (f"; the largest mbs whose worst case fits is {int(ctx.bmax([lmax])[0])}"
                if method in ("fixed", "sorted", "packed") else "")
        raise PackingError(f"{method}: predicted peak {int(peak[i])} B on stage {i} exceeds the limit "
                           f"{int(memory_limit_bytes)} B under {schedule_kind}{hint}")
    plan_s = time.perf_counter() - t0
    plan = Plan(microbatches=tuple(mbs_list), method=method, num_stages=num_stages,
                memory_limit_bytes=int(memory_limit_bytes), num_sequences=len(orig), schedule_kind=schedule_kind,
                dp=dp, replica_ids=replica_ids,
                predictions={"pred_peak_bytes": [int(x) for x in np.ceil(peak)], "est_makespan_s": float(max(ests)),
                             "plan_s": plan_s},
                meta={**meta, "longest_fitting_length": lfit, "oversize": oversize})
    plan.validate(orig)
    return plan
