"""Microbatch reordering for pipeline schedules (a pure ``Plan -> Plan`` pass).

The schedule's shape does not depend on the order (except for kinds whose builder reads the
microbatches' bytes, ``memory="required"`` in ``dynmb.schedule.kinds``: memory-aware, whose
windows follow the activation sizes), but with variable-size microbatches the
makespan does: under 1F1B the first microbatches fill the pipeline and the last
ones drain it, so what sits at the ends shows up as bubbles. Methods
(``REORDER_METHODS``), all keyed on a microbatch's predicted work
``sum_stages F + B`` from the one cost lookup ``cost_model.stage_costs``:

- ``none``: keep the packer's order.
- ``descending`` / ``ascending``: by work (stable).
- ``ends``: small microbatches at both ends, large in the middle (verl's
  ordering for dynamic batch sizes): sort ascending and deal alternately to the
  front and the back.
- ``dynapipe``: DynaPipe's search: cluster microbatches by work into
  ``k <= 4`` clusters (1-D k-means from quantile seeds), simulate every
  permutation of the clusters (original order inside a cluster), keep the best.
- ``search`` (this project): start from the best memory-feasible order among
  all the methods above, then first-improvement local search in the simulator,
  keeping only orders whose simulated per-GPU peak stays under the plan's
  limit. Neighbourhood, most promising first: swaps and moves of the
  microbatches around the longest stalls of the busiest rank (read off the
  simulated timeline: that is where the critical path waits), adjacent swaps,
  swaps of a fill/drain position with any other, moves of one microbatch.
  If no order found so far fits (a plan packed for another schedule), the
  descent first lowers the simulated peak until one fits. It is
  never worse than any of them by construction, and deterministic (a budget of
  simulator evaluations, ``max_evals``, not of wall time, so every rank plans
  the same order).

Choosing among orders is the candidate search of ``dynmb.timing.search``: each order judged by
``OrderEvaluator.verdict`` (makespan; fits; peak), ``best_order`` keeps the first best (``dynapipe``'s
permutations, ``search``'s start), and the descent's test of a neighbour is its ``better`` (by more
than ``NOISE``).

Each candidate is scored by the discrete-event simulator on a schedule
flattened once (``dynmb.timing.simulate``), so one evaluation is a single
O(actions) pass.
"""

from __future__ import annotations

import functools
import itertools
import threading
from typing import Any, Sequence, cast

import numpy as np

from dynmb.costmodel.loader import Models
from dynmb.memory.model import MemoryModelLike
from dynmb.schedule import build_schedule, execution_order
from dynmb.schedule.kinds import BuildInputs, ScheduleKind, get_kind
from dynmb.timing.search import Candidate, Verdict, better, evaluate, fastest
from dynmb.timing.simulate import action_times, cross_mask, comm_times, memory_inputs, peaks
from dynmb.core.types import Plan, Schedule
from dynmb.packing.orders import cluster_orders, ends_order
from dynmb.planning.batchsim import batch_makespans

__all__ = ["REORDER_METHODS", "reorder", "reorder_order", "OrderEvaluator", "ends_order", "default_max_evals"]

REORDER_METHODS = ("none", "descending", "ascending", "ends", "dynapipe", "search")


class OrderEvaluator:
    """Predicted ``(makespan_s, peak per GPU, fits)`` of running a plan's microbatches in a given order.

    The peak is only computed when some order could exceed the limit (else it is reported as 0;
    ``peak(order)`` always computes it)."""

    def __init__(self, plan: Plan, models: Models[MemoryModelLike | None], schedule_kind: str | ScheduleKind = "1f1b",
                 virtual: int = 1) -> None:
        cost_model, memory_model = models.cost, models.memory
        self.rec = get_kind(schedule_kind)        # a record as given (the planner resolved the step's kind once)
        self.P, self.m, self.kind, self.virtual = plan.num_stages, plan.num_microbatches, self.rec.name, virtual
        costs = cost_model.plan_costs(plan, ops=("F", "B", "I", "W")) if self.rec.split_backward \
            else cost_model.plan_costs(plan)
        self.cube = np.zeros((4, self.P, self.m))          # F, B, I, W: the simulator's op codes
        for k, op in enumerate("FBIW"):
            if op in costs:
                self.cube[k] = np.asarray(costs[op], dtype=np.float64).reshape(self.P, self.m)
        self.work = self.cube[:2].sum(axis=(0, 1))           # F + B
        self.comm = np.broadcast_to(np.asarray(comm_times(cost_model, plan), dtype=np.float64), (self.m,))
        self.act, self.tr, self.state = memory_inputs(memory_model, plan)
        self.by_order = self.rec.memory == "required"        # the schedule follows the order's bytes
        if self.by_order and self.act is None:
            raise ValueError(f"reordering for the {self.kind} schedule needs a memory model")
        self.limit = float(plan.memory_limit_bytes)
        self.evals = 0
        self._cache: dict[tuple[int, ...], tuple[float, float, bool]] = {}
        self._by_key: dict[bytes, Any] = {}
        self._pre: dict[tuple[int, ...], float] = {}        # makespans simulated ahead (prefetch)
        self._flat = None if self.by_order else self._flatten(None)
        self._always_fits = self._order_free_fit()

    def _order_free_fit(self) -> bool:
        """True when every order fits (a window of the largest activations + the largest buffer fits,
        for kinds whose window is their exact peak; kinds that fit by construction whenever they
        can be built)."""
        if self.rec.fits_by_construction:
            return True
        if self.act is None or not self.rec.window_exact:
            return False
        win = [self.rec.inflight(s, self.P, self.m) for s in range(self.P)]
        top = -np.sort(-self.act, axis=1)
        held = np.array([top[s, :win[s]].sum() for s in range(self.P)])
        tr = 0.0 if self.tr is None else self.tr.max(axis=1)
        return bool(np.all(self.state + held + tr <= self.limit))

    def _flatten(self, perm: np.ndarray | None) -> Any:
        if not self.by_order:
            return self._prepare(build_schedule(self.kind, self.P, self.m, virtual=self.virtual))
        tr = None if self.tr is None else self.tr[:, perm]
        inp = BuildInputs(num_stages=self.P, num_microbatches=self.m, virtual=self.virtual,
                          act_bytes=self.act[:, perm], state_bytes=self.state, limit_bytes=self.limit,
                          transient_bytes=tr)
        if self.rec.cache_key is None:
            self.rec.check(inp)
            return self._prepare(self.rec.build(inp))
        key = self.rec.cache_key(inp)       # the schedule depends on the order only through this key
        flat = self._by_key.get(key)
        if flat is None:
            self.rec.check(inp)
            flat = self._prepare(self.rec.build(inp))
            self._by_key[key] = flat
        return flat

    @staticmethod
    def _prepare(sched: Schedule) -> Any:
        flat: Any = execution_order(sched)               # a FlatSchedule with two attributes more
        flat.num_ranks = sched.num_ranks
        flat.xi = cross_mask(flat)
        return flat

    def prefetch(self, orders: Sequence[Sequence[int]], limit: int) -> None:
        """Simulate the makespans of up to ``limit`` of ``orders`` not seen yet in one vectorised pass
        (``dynmb.planning.batchsim``), held until ``__call__`` asks for them (which counts each as one
        evaluation then, as unbatched, and adds its peak where needed: the peak reads the order, not the
        times). Only where the order does not change the schedule: else a no-op."""
        if self._flat is None or limit <= 0:
            return
        todo: dict[tuple[int, ...], None] = {}
        for o in orders:
            key = tuple(int(i) for i in o)
            if key not in self._cache and key not in self._pre:
                todo[key] = None
                if len(todo) >= limit:
                    break
        if len(todo) < 2:
            return
        keys = list(todo)
        for key, mk in zip(keys, batch_makespans(self._flat, self.cube, self.comm, np.array(keys, dtype=np.int64))):
            self._pre[key] = float(mk)

    def __call__(self, order: Sequence[int]) -> tuple[float, float, bool]:
        key = tuple(int(i) for i in order)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        self.evals += 1
        perm = np.asarray(key, dtype=np.int64)
        makespan = self._pre.pop(key, None)
        try:
            flat = self._flat if self._flat is not None else self._flatten(perm)
        except ValueError:  # a builder reading the bytes (memory-aware): some microbatch cannot fit even alone
            out = (float("inf"), float("inf"), False)
            self._cache[key] = out
            return out
        if makespan is None:
            j = perm[flat.mb]
            dur = self.cube[flat.op, flat.stage, j]
            cross = np.zeros(len(dur))
            cross[flat.xi] = self.comm[j[flat.xi]]
            _, end = action_times(flat, dur, cross, flat.num_ranks)
            makespan = float(max(end)) if end else 0.0
        peak, fits = 0.0, True
        if self.act is not None and not self._always_fits:
            tr = None if self.tr is None else self.tr[:, perm]
            _, peak_rank, _ = peaks(flat, self.P, flat.num_ranks, self.act[:, perm], tr, self.state)
            peak = float(peak_rank.max())
            fits = peak <= self.limit
        out = (makespan, peak, bool(fits))
        self._cache[key] = out
        return out

    def lower_bound(self) -> float:
        """A makespan no order can beat (one stage per rank): for each stage, its total work plus the
        cheapest fill (forwards of one microbatch through the stages before it) and the cheapest
        drain (backwards back through them), each with its P2P hops. NaN for interleaved."""
        if self.rec.virtual_stages and self.virtual > 1:
            return float("nan")
        f, b = self.cube[0], self.cube[1] + self.cube[2]
        busy = self.cube.sum(axis=2).sum(axis=0)
        lb = busy.copy()
        for s in range(1, self.P):
            hops = s * self.comm
            lb[s] += (f[:s].sum(axis=0) + hops).min() + (b[:s].sum(axis=0) + hops).min()
        return float(lb.max())

    def peak(self, order: Sequence[int]) -> np.ndarray:
        """Simulated peak bytes per GPU (rank) of this order (zeros without a memory model)."""
        perm = np.asarray(order, dtype=np.int64)
        flat = self._flat if self._flat is not None else self._flatten(perm)
        if self.act is None:
            return np.zeros(flat.num_ranks)
        tr = None if self.tr is None else self.tr[:, perm]
        return peaks(flat, self.P, flat.num_ranks, self.act[:, perm], tr, self.state)[1]

    def hot_positions(self, order: Sequence[int], k: int = 6) -> list[int]:
        """Positions whose microbatches wait longest on the busiest rank (where the critical path stalls)."""
        perm = np.asarray(order, dtype=np.int64)
        try:
            flat = self._flat if self._flat is not None else self._flatten(perm)
        except ValueError:  # an order the (memory-aware) builder cannot build
            return []
        j = perm[flat.mb]
        dur = self.cube[flat.op, flat.stage, j]
        cross = np.zeros(len(dur))
        cross[flat.xi] = self.comm[j[flat.xi]]
        start, end = (np.asarray(x) for x in action_times(flat, dur, cross, flat.num_ranks))
        busy = np.bincount(flat.rank, weights=dur, minlength=flat.num_ranks)
        r = int(busy.argmax())
        a, b = int(flat.start[r]), int(flat.start[r + 1])
        gaps = start[a:b] - np.r_[0.0, end[a:b - 1]]
        top = np.argsort(-gaps, kind="stable")[:k]
        return [int(flat.mb[a + i]) for i in top if gaps[i] > 0]

    def verdict(self, order: Sequence[int]) -> Verdict:
        """The candidate search's verdict of an order (``dynmb.timing.search``): its makespan, whether it fits
        and, if not, its peak (the closest to fitting is the best of those)."""
        mk, pk, ok = self(order)
        return Verdict(mk, ok, pk)

    def score(self, order: Sequence[int]) -> tuple[int, float, float]:
        """Sort key: memory-feasible first, by makespan; infeasible ones by peak (``verdict(order).key()``)."""
        return self.verdict(order).key()


def best_order(ev: OrderEvaluator, orders: Sequence[list[int]], names: Sequence[str] | None = None) -> list[int]:
    """The best of ``orders`` by the candidate search (``dynmb.timing.search``: each judged by
    ``OrderEvaluator.verdict``, rule ``fastest``: the first of equals), simulated in one batch first."""
    ev.prefetch(orders, len(orders))
    names = names or [str(i) for i in range(len(orders))]
    cands: list[Candidate[list[int]]] = [Candidate(n, functools.partial(list, o)) for n, o in zip(names, orders)]
    return cast(list, fastest(evaluate(cands, ev.verdict)).made)


def _dynapipe(ev: OrderEvaluator, k: int = 4) -> list[int]:
    """DynaPipe's search: the best (``best_order``) of its cluster permutations
    (``dynmb.packing.orders.cluster_orders``)."""
    perms = cluster_orders(ev.work, k)
    return perms[0] if len(perms) == 1 else best_order(ev, perms)


def _neighbours(cur: list[int], P: int, hot: Sequence[int] = ()):
    """Candidate orders around ``cur``, most promising first: moves around the positions where
    the busiest rank stalls (``hot``), adjacent swaps (steady-state pairing), swaps of a
    fill/drain position with any other, then single moves of one microbatch."""
    m = len(cur)

    def swap(i: int, j: int) -> list[int]:
        cand = list(cur)
        cand[i], cand[j] = cand[j], cand[i]
        return cand

    def move(i: int, t: int) -> list[int]:
        rest = cur[:i] + cur[i + 1:]
        return rest[:t] + [cur[i]] + rest[t:]

    # a stall of the busiest rank at position p is caused upstream by microbatches up to ~P earlier
    near = sorted({q for p in hot for q in range(p - P - 2, p + 2) if 0 <= q < m - 1})
    for i in near:
        yield swap(i, i + 1)
    for i in range(m - 1):
        yield swap(i, i + 1)
    for i in near:
        for j in range(m):
            if abs(j - i) > 1:
                yield swap(i, j)
                yield move(i, j)
    half = min(m, 2 * P) // 2
    for i in list(range(half)) + list(range(m - half, m)):
        for j in range(m):
            if abs(j - i) > 1:
                yield swap(i, j)
    for i in range(m):
        targets = range(m) if m <= 32 else sorted({0, m - 1, i - 2, i + 2, *range(i % 8, m, max(1, m // 16))}
                                                 & set(range(m)))
        for t in targets:
            if abs(t - i) > 1:
                yield move(i, t)


NOISE = 1e-12
"""A neighbour replaces the current order only when better by more than this relative margin (float noise)."""


def _local_search(ev: OrderEvaluator, start: list[int], max_evals: int) -> list[int]:
    """First-improvement descent over ``_neighbours`` within ``max_evals`` evaluations: on makespan
    among memory-feasible orders (from an infeasible start, first on peak until it fits)."""
    cur = list(start)
    best = ev.verdict(cur)
    budget_end = ev.evals + max_evals
    improved = True
    while improved and ev.evals < budget_end:
        improved = False
        hood, chunk = _neighbours(cur, ev.P, ev.hot_positions(cur)), 4
        # neighbours are simulated in growing chunks at once (OrderEvaluator.prefetch) but taken in turn,
        # each counted as it is reached: the same descent, evaluations and result as one at a time
        while not improved and ev.evals < budget_end:
            cands = list(itertools.islice(hood, chunk))
            if not cands:
                break
            ev.prefetch(cands, budget_end - ev.evals)
            for cand in cands:
                if ev.evals >= budget_end:
                    break
                sc = ev.verdict(cand)
                if better(sc, best, NOISE):      # the candidate search's rule (dynmb.timing.search)
                    cur, best, improved = cand, sc, True
                    break
            chunk = min(2 * chunk, 64)
    return cur


def default_max_evals(num_actions: int) -> int:
    """Simulator evaluations the search may spend: about half a second of CPU on one core."""
    return int(np.clip(600_000 // max(1, num_actions), 64, 4000))


def reorder_order(plan: Plan, method: str, *, models: Models[MemoryModelLike | None],
                  schedule_kind: str | ScheduleKind = "1f1b", virtual: int = 1, max_evals: int | None = None,
                  evaluator: OrderEvaluator | None = None) -> list[int]:
    """The order (``order[i]`` = old index run at position ``i``) that ``method`` chooses."""
    if method not in REORDER_METHODS:
        raise ValueError(f"unknown reorder method {method!r}; known: {', '.join(REORDER_METHODS)}")
    m = plan.num_microbatches
    if method == "none" or m <= 1:
        return list(range(m))
    ev = evaluator or OrderEvaluator(plan, models, schedule_kind, virtual)
    if method == "descending":
        return np.argsort(-ev.work, kind="stable").tolist()
    if method == "ascending":
        return np.argsort(ev.work, kind="stable").tolist()
    if method == "ends":
        return ends_order(ev.work)
    if method == "dynapipe":
        return _dynapipe(ev)
    names = [k for k in REORDER_METHODS if k != "search"]
    start = best_order(ev, [reorder_order(plan, k, models=models, schedule_kind=schedule_kind,
                                          virtual=virtual, evaluator=ev) for k in names], names)
    if max_evals is None:
        max_evals = default_max_evals(2 * ev.P * m)
    return _local_search(ev, start, max_evals)


def reorder(plan: Plan, method: str, *, models: Models[MemoryModelLike | None],
            schedule_kind: str | ScheduleKind = "1f1b", virtual: int = 1, max_evals: int | None = None) -> Plan:
    """``plan`` with its microbatches in the order ``method`` picks (``plan.meta['reorder'] = method``).

    ``max_evals`` bounds the simulator evaluations of ``search`` (default ``default_max_evals``:
    about half a second on one core whatever the size). A plan with slices of long sequences
    keeps its order (any method but ``none`` is refused).
    """
    if plan.has_slices and method != "none":
        raise ValueError(f"reorder {method!r}: this plan holds slices of long sequences, which run in their "
                         f"planned order (reorder 'none')")
    kind = get_kind(schedule_kind).name
    key = (plan.digest(), plan.num_stages, plan.memory_limit_bytes, method, kind, virtual, max_evals,
           id(models.cost), id(models.memory)) if REMEMBERED > 0 and method != "none" else None
    with _ORDERS_LOCK:
        known = _ORDERS.get(key) if key is not None else None
    if known is None:
        order = reorder_order(plan, method, models=models, schedule_kind=schedule_kind, virtual=virtual,
                              max_evals=max_evals)
        if key is not None:
            with _ORDERS_LOCK:
                while len(_ORDERS) >= REMEMBERED:
                    _ORDERS.pop(next(iter(_ORDERS)))
                _ORDERS[key] = (order, (models.cost, models.memory))   # the models held: their ids are keys
    else:
        order = known[0]
    return plan.with_order(order, reorder=method)


REMEMBERED = 8
"""Orders ``reorder`` remembers (the last ones), by every input the search reads: the plan's microbatches in their
order (``Plan.digest``), its stages and limit, the method, kind, ``virtual``, ``max_evals`` and the models (held,
by identity). ``--schedule auto`` reorders one packing twice where a kind runs on another kind's packing and the
two packings are equal (``zb@zb-h1``). 0: none (every order searched afresh)."""

_ORDERS: dict[tuple, tuple[list[int], tuple]] = {}
_ORDERS_LOCK = threading.Lock()
