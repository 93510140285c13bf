"""The registry of packing methods: each method's packer and its traits, looked up by name.

``pack`` (``dispatch``) asks the registry for the method's microbatches in flat form
(``method_flat``) and for its traits; nothing in the packing layer branches on a method's name.
A record (``MethodRecord``) holds:

- ``flat(job)``: the microbatches of one global batch (``MethodJob``: lengths after the oversize
  policy, the ``PackContext``, the cost model, ``mbs``, ``round_to``, the row-length cap, the
  attention and ``dp``) in flat form, and the settings it chose (for ``plan.meta``);
- ``mbs``: what ``--mbs`` means to it: ``"rows"`` (rows per microbatch: ``fixed``, ``sorted``,
  ``packed``), ``"budget divisor"`` (its token budget is the memory maximum divided by it:
  ``token-budget``, ``balanced``) or None (it sizes its own microbatches: ``dynapipe``,
  ``dynamic``; an ``mbs`` is refused);
- ``pack_len_rows``: its rows are ``pack_len`` long (``packed``), so the row-length cap is the
  pack length instead of the longest admissible one-row length;
- ``takes_dp``: it balances its own microbatches over the data-parallel replicas (``balanced``,
  ``dynamic``); the others get ``dp = 1`` and ``pack`` balances their plan afterwards;
- ``lockstep``: its microbatches come replica-major, every replica the same number, microbatch i of
  every replica run together (``lockstep``, ``in-order``): ``pack`` keeps that order and assignment, and the planner
  runs it in that order (no reorder pass, no slices);
- ``estimate_free``: its plan reads of the schedule kind only the memory budget the kind's window sets
  (``PackContext``), no makespan estimate (every method but ``dynamic`` and ``lockstep``; False, the default, for
  a method that may).

Within ``shared_plans`` (one planning step) ``method_flat`` makes the plan of an ``estimate_free`` method once
per input: ``--schedule auto``'s kinds (1f1b, zb-h1, zb: one window) and ``dynamic``'s baselines and final check
ask for the same plans. The key holds every input the packer reads (the lengths, the budget's caps, in-flight
counts, tightness and row cap, the models by identity, mbs, round_to, the row cap, attention, dp); the plan's arrays
are handed out read-only.

A new method is one ``register_method`` call (``docs/design.md``, "A packing method").
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import numpy as np

from dynmb.costmodel.base import CostModelLike

from dynmb.packing.balanced import balanced_flat
from dynmb.packing.context import PackContext
from dynmb.packing.dynamic.pack import dynamic_groups
from dynmb.packing.dynapipe import dynapipe_groups
from dynmb.packing.fixed import fixed_flat
from dynmb.packing.in_order import in_order_flat
from dynmb.packing.lockstep import LockstepShape, lockstep_flat
from dynmb.packing.packed import packed_rows_flat
from dynmb.packing.rows import Flat, groups_to_flat
from dynmb.packing.token_budget import token_budget_flat

__all__ = ["MethodJob", "MethodRecord", "register_method", "get_method", "method_names", "method_flat",
           "shared_plans"]


@dataclass(frozen=True)
class MethodJob:
    """What a method packs: one global batch (lengths after the oversize policy) and its settings."""

    lens: np.ndarray
    ctx: PackContext
    cost_model: CostModelLike
    mbs: int | None
    round_to: int
    len_cap: int
    """The longest row: the longest admissible one-row length, or ``packed``'s pack length."""
    attention: str
    dp: int = 1


@dataclass(frozen=True)
class MethodRecord:
    """One packing method: its packer and traits (module docstring)."""

    name: str
    flat: Callable[[MethodJob], tuple[Flat, dict[str, Any]]]
    mbs: str | None = None
    pack_len_rows: bool = False
    takes_dp: bool = False
    lockstep: bool = False
    estimate_free: bool = False


_REGISTRY: dict[str, MethodRecord] = {}


def register_method(record: MethodRecord) -> MethodRecord:
    """Add (or replace) a method; returns it."""
    if record.mbs not in (None, "rows", "budget divisor"):
        raise ValueError(f"method {record.name!r}: mbs must be None, 'rows' or 'budget divisor', got {record.mbs!r}")
    _REGISTRY[record.name] = record
    return record


def get_method(name: str) -> MethodRecord:
    """The record of ``name``; ``ValueError`` naming the registered methods otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown packing method {name!r}; expected one of {method_names()}") from None


def method_names() -> tuple[str, ...]:
    """The registered methods, in registration order."""
    return tuple(_REGISTRY)


def method_flat(name: str, job: MethodJob) -> tuple[Flat, dict[str, Any]]:
    """``name``'s microbatches of ``job`` in flat form and the settings it chose; a method that
    does not balance replicas itself is packed with ``dp = 1``. Within ``shared_plans``, made once per input
    for an ``estimate_free`` method (module doc)."""
    record = get_method(name)
    job = job if record.takes_dp else replace(job, dp=1)
    memo = _SHARED.get()
    if memo is None or not record.estimate_free:
        return record.flat(job)
    key = _job_key(name, job)
    made = memo.get(key)
    if made is None:
        flat, chosen = record.flat(job)
        for a in flat:
            a.setflags(write=False)
        made = memo[key] = (flat, chosen, (job.ctx.mm, job.cost_model))   # the models held: their ids are keys
    return made[0], dict(made[1])


_SHARED: contextvars.ContextVar[dict[tuple, tuple] | None] = contextvars.ContextVar("dynmb_shared_plans",
                                                                                    default=None)


SHARE_PLANS = 1
"""``shared_plans`` shares the plans of a step; 0: not (every plan made afresh, as before; ``unremembered``)."""


@contextlib.contextmanager
def shared_plans() -> Iterator[None]:
    """Within it ``method_flat`` makes each plan of an ``estimate_free`` method once per input (module doc);
    nested: the outer one's plans. Forgotten on leaving."""
    if _SHARED.get() is not None or not SHARE_PLANS:
        yield
        return
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


def _job_key(name: str, job: MethodJob) -> tuple:
    """Everything of ``job`` a packer reads (module doc): the arrays by digest, the models by identity."""
    ctx = job.ctx
    h = hashlib.blake2b(digest_size=20)
    for a in (job.lens, ctx.k, ctx.caps):
        arr = np.ascontiguousarray(a)
        h.update(f"{arr.dtype.str}{arr.shape};".encode())
        h.update(arr.tobytes())
    return (name, h.digest(), id(ctx.mm), ctx.limit, ctx.p, ctx.tight, ctx.virtual, ctx.row_cap, id(job.cost_model),
            job.mbs, job.round_to, job.len_cap, job.attention, job.dp)


def _fixed(method: str) -> Callable[[MethodJob], tuple[Flat, dict[str, Any]]]:
    def flat(job: MethodJob) -> tuple[Flat, dict[str, Any]]:
        out, rows_per_mb = fixed_flat(method, job.lens, job.ctx, job.mbs, job.round_to)
        return out, {"mbs": rows_per_mb}
    return flat


def _packed(job: MethodJob) -> tuple[Flat, dict[str, Any]]:
    out, rows_per_mb = packed_rows_flat(job.lens, job.len_cap, job.mbs)
    return out, {"mbs": rows_per_mb}


def _token_budget(job: MethodJob) -> tuple[Flat, dict[str, Any]]:
    out, budget = token_budget_flat(job.lens, job.ctx, job.round_to, divisor=job.mbs)
    return out, {"max_tokens": budget, "budget_divisor": job.mbs or 1}


def _balanced(job: MethodJob) -> tuple[Flat, dict[str, Any]]:
    out, budget = balanced_flat(job.lens, job.ctx.with_row_cap(job.len_cap), job.cost_model, round_to=job.round_to,
                                divisor=job.mbs, dp=job.dp)
    return out, {"max_tokens": budget, "budget_divisor": job.mbs or 1}


def _dynapipe(job: MethodJob) -> tuple[Flat, dict[str, Any]]:
    return groups_to_flat(dynapipe_groups(job.lens, job.ctx.bmax, job.cost_model, job.ctx.p, job.round_to)), {}


def _dynamic(job: MethodJob) -> tuple[Flat, dict[str, Any]]:
    def baseline(m: str) -> Flat:     # the plan method m makes of this batch: one of dynamic's candidates
        name, _, divisor = m.partition("/")           # "balanced/4": balanced at the memory-maximum budget / 4
        return method_flat(name, replace(job, mbs=int(divisor) if divisor else None))[0]
    # its plans are functions of what the dynamic packer keys its remembered search space by (the lengths,
    # the memory budget, the models, round_to, the row cap, attention, dp): calls may share them
    baseline.memo_key = "dynmb.packing.methods"   # type: ignore[attr-defined]
    out, _ = dynamic_groups(job.lens, job.ctx, job.cost_model, round_to=job.round_to, max_len=job.len_cap,
                            attention=job.attention, dp=job.dp, baselines=baseline)
    return out, {}


def _in_order(job: MethodJob) -> tuple[Flat, dict[str, Any]]:
    return in_order_flat(job.lens, job.len_cap, job.dp, job.mbs or 1)


def _lockstep(job: MethodJob) -> tuple[Flat, dict[str, Any]]:
    shape = LockstepShape(pack_len=job.len_cap, dp=job.dp, rows_per_mb=job.mbs or 1, kind=job.ctx.kind,
                          virtual=job.ctx.virtual, embedding=job.ctx.embedding)
    return lockstep_flat(job.lens, shape, job.cost_model)


for _record in (MethodRecord("fixed", _fixed("fixed"), mbs="rows", estimate_free=True),
                MethodRecord("sorted", _fixed("sorted"), mbs="rows", estimate_free=True),
                MethodRecord("packed", _packed, mbs="rows", pack_len_rows=True, estimate_free=True),
                MethodRecord("token-budget", _token_budget, mbs="budget divisor", estimate_free=True),
                MethodRecord("dynapipe", _dynapipe, estimate_free=True),
                MethodRecord("dynamic", _dynamic, takes_dp=True),
                MethodRecord("balanced", _balanced, mbs="budget divisor", takes_dp=True, estimate_free=True),
                MethodRecord("lockstep", _lockstep, mbs="rows", pack_len_rows=True, takes_dp=True, lockstep=True),
                MethodRecord("in-order", _in_order, mbs="rows", pack_len_rows=True, takes_dp=True, lockstep=True,
                             estimate_free=True)):
    register_method(_record)
