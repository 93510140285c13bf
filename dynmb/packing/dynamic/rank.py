"""Ranking and choosing candidate plans for the ``dynamic`` packer (``dynmb.packing.dynamic.pack``,
steps 5-7 of its docstring).

``Ranker`` costs, orders and estimates ``Candidate`` plans (built by ``dynmb.packing.dynamic.space``:
a split of a row set, its slowest microbatches halved until dp divides their number, or another
method's plan, balanced over dp as ``dynmb.packing`` balances it) for P stages and dp replicas:
``rank`` (each candidate's best estimate over its orders on its probe replicas: ``dynmb.timing.makespan``'s
bound regime (the pipeline bound and the round trips), or ``dynmb.timing.makespan.makespans`` for the
best by a proxy within ``RANK_OPS`` ops; the zero-bubble kinds' estimate, ``dynmb.timing.makespan_zb``, has
no bound regime: always the latter, with the kind's ``I`` / ``W`` shares of ``B``; nor has the
interleaved one, ``dynmb.timing.makespan_interleaved``, given the ``virtual`` chunks per GPU, whose proxy
sums each GPU's chunks) and
``choose`` (the finals re-costed in one lookup and estimated on every replica as
``dynmb.packing`` runs them, each in its best start order of the reorder search, ``orders``; a final whose
busiest stage's work alone already loses is not estimated: every estimate runs a stage's ops one after another).
``rank`` uses the estimate of ``makespan_zb.ranking_kind`` (``zb``: ``zb-h1``'s), ``choose`` the kind's own.
``RankMemo`` holds what the packings of one batch share.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from dynmb.costmodel.base import CostModelLike
from dynmb.core.features import CostFeatures
from dynmb.timing.makespan import exact_regime, has_bound_regime, makespans, round_trip_bound
from dynmb.timing.makespan_interleaved import fold_chunks
from dynmb.timing.makespan_zb import ESTIMATES as ZB_ESTIMATES
from dynmb.timing.makespan_zb import backward_shares, ranking_kind
from dynmb.schedule.kinds import ScheduleKind, get_kind
from dynmb.packing.dynamic.setup import SplitSetup
from dynmb.packing.context import PackContext
from dynmb.packing.embedprice import EmbedPricing
from dynmb.packing.orders import best_start_orders, blocked_order, start_orders
from dynmb.packing.rows import Flat, assign_replicas

__all__ = ["Candidate", "Ranker", "RankMemo", "RANK_EXACT", "RANK_OPS", "LOOKUP_CELLS", "ZB_KEEP", "CLUSTERED"]

Costs = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]
"""A candidate's looked-up ``(F, B, sends, embed)``: ``embed`` each microbatch's embed seconds with the embedding
last, else None."""

RANK_EXACT = 400
"""Candidates with at most this many (stage, microbatch) cells are always ranked by ``makespan``'s value."""
RANK_OPS = 300_000
"""Per ranking pass, exact estimates (2 * P * m ops each) of the best by proxy stop at this many ops
(scaled by P / 16 below 16 stages: with few stages an op of the level-by-level recurrence costs more)."""
LOOKUP_CELLS = 1 << 22
"""At most this many (stage, microbatch) cells are costed in one ``stage_costs`` lookup (memory)."""
ZB_KEEP = 4
"""A kind that ranks with another kind's estimate (``makespan_zb.ranking_kind``: ``zb`` ranks with ``zb-h1``'s)
carries at least this many own splits to ``choose``, which estimates them with its own."""
BOUND_MARGIN = 1e-9
"""``Ranker._bounded`` leaves a final out only when its work is past the best estimate by this relative margin (the
estimate and the work add the same seconds in other orders)."""
CLUSTERED = ("dynapipe",)
"""Baselines whose method runs its plan after DynaPipe's cluster search (``planning.defaults.AUTO_REORDER``):
``choose`` weighs them in those orders too (every candidate in the search's other start orders)."""


@dataclass
class RankMemo:
    """What the packings of one batch share (``space.Space.memo``), by candidate key: looked-up
    costs, replica assignments (both from ``stage_costs``, so the same for every kind) and whole ranking
    calls by (estimate, orders, candidate keys) (a value depends on the other candidates of its call:
    the ``RANK_OPS`` budget goes to the best by proxy)."""

    looked_up: dict = field(default_factory=dict)
    assigned: dict = field(default_factory=dict)
    ranked: dict = field(default_factory=dict)
    shares: dict = field(default_factory=dict)


@dataclass(eq=False)
class Candidate:
    """One candidate plan: per-microbatch shapes in its own order, how to emit it, its ranking."""

    rows: np.ndarray
    padded: np.ndarray
    attn: np.ndarray
    emit: Callable[[np.ndarray], Flat]      # the flat form run in the given order
    source: tuple | None = None             # own splits: (row set, cuts before balancing, tau)
    baseline: str = ""                      # the method whose plan this is, as that method makes it
    opened: np.ndarray | None = None        # one best-fit row per microbatch: the order they were opened in
    split: tuple | None = None              # own splits: (row set, cuts after balancing)
    F: np.ndarray | None = None             # costs, while it is being estimated
    B: np.ndarray | None = None
    comm: np.ndarray | None = None
    embed: np.ndarray | None = None         # with the embedding last: each microbatch's embed seconds (F + B)
    value: float = np.inf                   # best estimate found (ranking: on the probe replicas)
    order: str = ""                         # the order that gave it
    key: tuple | None = None                # its key in ``space`` (equal keys: the same plan)


class Ranker:
    """Costs, orders and estimates candidates for ``num_stages`` stages and ``dp`` replicas."""

    def __init__(self, cost_model: CostModelLike, ctx: PackContext, dp: int, setups: dict[str, SplitSetup],
                 lengths: np.ndarray, memo: RankMemo | None = None) -> None:
        """``ctx``: the packing call's settings (its stage count, schedule kind, chunks per GPU and the embedding's
        place); ``setups``: the row sets' affine costs; ``lengths``: the batch (the zero-bubble shares);
        ``memo``: what the packings of one batch share."""
        kind = ctx.rec
        self.cm, self.P, self.kind, self.dp = cost_model, ctx.p, kind.name, dp
        self.comm_fn = getattr(cost_model, "comm_s", None)   # P2P seconds of a microbatch, where the model has them
        self.virtual = ctx.virtual                           # chunks per GPU (the interleaved estimate reads it)
        self.embeds = EmbedPricing.of(ctx.embedding, cost_model)
        """With the embedding last (``dynmb.packing.embedprice``): what every estimate adds; None: nothing."""
        self.setups = setups
        self.memo = RankMemo() if memo is None else memo
        self.looked_up = self.memo.looked_up                 # stage_costs (F, B, sends) by candidate key
        self.rank_rec = get_kind(ranking_kind(kind.name))    # resolved once: _round_trips reads its estimate
        self.rank_kind = self.rank_rec.name                  # the estimate rank() uses; choose() uses the kind's
        self.one_regime = not has_bound_regime(self.rank_kind)    # zero-bubble, interleaved: no bound regime
        if kind.estimate_as in ZB_ESTIMATES and "shares" not in self.memo.shares:
            self.memo.shares["shares"] = backward_shares(cost_model, lengths, ctx.p)
        self.shares = self.memo.shares.get("shares")

    def _send(self, rows: np.ndarray, padded: np.ndarray) -> np.ndarray:
        sends = self.comm_fn(rows, padded) if self.comm_fn is not None else 0.0
        return np.broadcast_to(np.asarray(sends, dtype=np.float64), rows.shape).copy()

    def costed(self, cands: list[Candidate], affine: bool) -> Iterator[Candidate]:
        """``cands`` in turn with their costs set while they are used: an own split's affine costs
        when ``affine``, else ``stage_costs`` with each microbatch's attention work, one lookup
        for as many candidates in a row as fit ``LOOKUP_CELLS`` (stage, microbatch) cells; looked-up
        costs are kept by candidate key (``looked_up``: shared by the packings of one batch)."""
        todo, i = [c for c in cands if len(c.rows)], 0
        while i < len(todo):
            chunk, cells = [todo[i]], len(todo[i].rows) * self.P
            if todo[i].key in self.looked_up and not (affine and todo[i].split is not None):
                c = todo[i]
                c.F, c.B, c.comm = self.looked_up[c.key]
            elif affine and todo[i].split is not None:
                c = todo[i]
                assert c.split is not None
                (c.F, c.B), c.comm = self.setups[c.split[0]].costs(c.split[1]), self._send(c.rows, c.padded)
            else:
                while (i + len(chunk) < len(todo) and not (affine and todo[i + len(chunk)].split is not None)
                       and todo[i + len(chunk)].key not in self.looked_up
                       and cells + len(todo[i + len(chunk)].rows) * self.P <= LOOKUP_CELLS):
                    chunk.append(todo[i + len(chunk)])
                    cells += len(chunk[-1].rows) * self.P
                rows, padded, attn = (np.concatenate(a) for a in zip(*((x.rows, x.padded, x.attn) for x in chunk)))
                cc, sends = CostFeatures.of_shapes(rows, padded, attn).costs(self.cm), self._send(rows, padded)
                bounds = np.cumsum([0] + [len(x.rows) for x in chunk])
                for x, a, e in zip(chunk, bounds[:-1], bounds[1:]):
                    x.F, x.B, x.comm = cc["F"][:, a:e], cc["B"][:, a:e], sends[a:e]
                    if x.key is not None:
                        self.looked_up[x.key] = (x.F, x.B, x.comm)
            for x in chunk:
                x.embed = None if self.embeds is None else self.embeds.seconds(x.rows, x.padded)
                yield x
                x.F = x.B = x.comm = x.embed = None
            i += len(chunk)

    def _members(self, c: Candidate, exact_assignment: bool) -> tuple[np.ndarray, np.ndarray]:
        """(replicas x microbatches in split order, busy time of each microbatch)."""
        assert c.F is not None and c.B is not None          # costed
        busy = (c.F + c.B).max(axis=0)
        if self.dp == 1:
            return np.arange(len(busy))[None, :], busy
        if exact_assignment:
            return self._assigned(c, busy, None).reshape(self.dp, -1), busy
        return np.argsort(_deal(busy, self.dp), kind="stable").reshape(self.dp, -1), busy

    def _assigned(self, c: Candidate, busy: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        """``assign_replicas`` of the microbatches ``out`` (None: all, as formed) on their looked-up ``busy``
        times, as positions: kept by candidate key for ``out`` None (the same for every kind)."""
        key = c.key if out is None else None
        if key is None or key not in self.memo.assigned:
            order, _ = assign_replicas(busy if out is None else busy[out], self.dp)
            got = np.asarray(order, dtype=np.int64)
            if key is None:
                return got
            self.memo.assigned[key] = got
        return self.memo.assigned[key]

    def _probes(self, c: Candidate, members: np.ndarray) -> np.ndarray:
        """The replica with the most work on its busiest stage and the one with the longest round trip."""
        if len(members) == 1:
            return members
        assert c.F is not None and c.B is not None and c.comm is not None    # costed
        T = c.F + c.B
        work = T[:, members].sum(axis=2).max(axis=0)
        trip = (T.sum(axis=0) + 2 * (self.P - 1) * c.comm)[members].max(axis=1)
        return members[np.unique([int(np.argmax(work)), int(np.argmax(trip))])]

    def rank(self, cands: list[Candidate], as_given: bool = False) -> list[Candidate]:
        """Each candidate's best estimate over its orders on its probe replicas: exact (``makespans``)
        for the best by proxy within ``RANK_OPS`` ops (baselines and small ones always). Only the
        probe replicas' costs are kept. ``as_given``: in its order as formed only (the baselines:
        ``choose`` runs them as they stand, so their other orders would only sort the finals)."""
        cands = [c for c in cands if len(c.rows)]
        call = (self.rank_kind, as_given, tuple(c.key for c in cands))
        if None not in call[2] and call in self.memo.ranked:
            for c, (value, order) in zip(cands, self.memo.ranked[call]):
                c.value, c.order = value, order
            return cands
        self._rank(cands, as_given)
        if None not in call[2]:
            self.memo.ranked[call] = [(c.value, c.order) for c in cands]
        return cands

    def _rank(self, cands: list[Candidate], as_given: bool) -> None:
        jobs = []                        # (candidate, order, (F, B, sends) of its probe replicas, columns)
        trips = []                       # bound regime: (candidate, order, pipeline bound, stage-0 F, B, trip above)
        for c in self.costed(cands, affine=True):
            members, busy = self._members(c, exact_assignment=bool(c.baseline))
            assert c.F is not None and c.B is not None and c.comm is not None    # costed
            used, local = (np.unique(self._probes(c, members), return_inverse=True) if self.dp > 1
                           else (np.arange(members.shape[1]), members))
            sub, local = (c.F[:, used], c.B[:, used], c.comm[used], _taken(c.embed, used)), local.reshape(-1, members.shape[1])
            opened = c.opened[used] if c.opened is not None else None
            orders = {"as formed": local} if as_given else _orders(local, busy[used], opened)
            if self.one_regime or exact_regime(self.P, members.shape[1]):
                jobs += [(c, name, sub, cols) for name, cols in orders.items()]
                continue
            # the bound (dynmb.timing.makespan): the pipeline bound (the same work in every order, only the
            # first and last microbatches differ) and the round trips, the latter for all at once below
            work = (sub[0] + sub[1])[:, local].sum(axis=2)
            up = (sub[0][1:] + sub[1][1:]).sum(axis=0) + 2 * (self.P - 1) * sub[2]
            for name, cols in orders.items():
                a, e = cols[:, 0], cols[:, -1]
                embed = self._embed_terms(sub, cols)        # the round trips' pipeline: the least at least
                v = float((_bound(work, sub[0][:, a], sub[1][:, e], sub[2][a], sub[2][e]) + embed).max())
                trips.append((c, name, v, sub[0][0][cols], sub[1][0][cols], up[cols], float(embed.min())))
        for (c, name, v, *_, least), t in zip(trips, _round_trips(trips, self.P, self.rank_rec)):
            v = max(v, t + least)
            if v < c.value:
                c.value, c.order = v, name
        proxy = np.array([(self._proxy(*sub[:3], cols) + self._embed_terms(sub, cols)).max() for _, _, sub, cols in jobs])
        chosen, spent, budget = [], 0, RANK_OPS * min(1.0, self.P / 16)
        for j in np.argsort(proxy, kind="stable").tolist():
            c, _, _, cols = jobs[j]
            cells = self.P * cols.shape[1]
            ops = 2 * cells * len(cols)
            if c.baseline or cells <= RANK_EXACT or spent + ops <= budget:
                chosen.append(j)
                spent += ops
        for j, v in zip(chosen, self._estimate([jobs[j][2:] for j in chosen], self.rank_kind)):
            c, name = jobs[j][:2]
            if v < c.value:
                c.value, c.order = v, name

    def _embed_terms(self, costs: Costs, cols: np.ndarray) -> np.ndarray:
        """What the embedding last adds to each pipeline of ``cols`` ([n, k] columns of ``costs``); 0 without it."""
        idx = cols.ravel()
        return self._with_embeds(np.zeros(len(cols)), _taken(costs[3], idx), costs[2][idx],
                                 np.full(len(cols), cols.shape[1]))

    def _with_embeds(self, per: np.ndarray, embed: np.ndarray | None, sends: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """``per`` (pipelines of ``sizes`` microbatches) with the embeds' terms added; as it is with the embedding
        first."""
        if self.embeds is None:
            return per
        assert embed is not None                       # costed with the embedding last
        return self.embeds.added(per, embed, sends, sizes)

    def _proxy(self, F: np.ndarray, B: np.ndarray, comm: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """``_proxy``; with ``virtual`` chunks per GPU on the GPUs' costs (each GPU's chunks summed)."""
        return _proxy(fold_chunks(F, self.virtual), fold_chunks(B, self.virtual), comm, cols)

    def _estimate(self, jobs: list[tuple], kind: str | None = None) -> list[float]:
        """Per job ``((F, B, sends), [pipelines, k] columns)``: the slowest of its pipelines by
        ``makespans`` (under ``kind``, default the Ranker's), all in one call."""
        if not jobs:
            return []
        F = np.concatenate([s[0][:, cols.ravel()] for s, cols in jobs], axis=1)
        B = np.concatenate([s[1][:, cols.ravel()] for s, cols in jobs], axis=1)
        sends = np.concatenate([s[2][cols.ravel()] for s, cols in jobs])
        sizes = np.concatenate([np.full(len(cols), cols.shape[1]) for _, cols in jobs])
        per = makespans(F, B, sends, sizes, kind or self.kind, shares=self.shares, virtual=self.virtual)
        if self.embeds is not None:
            per = self._with_embeds(per, np.concatenate([s[3][cols.ravel()] for s, cols in jobs]), sends, sizes)
        bounds = np.cumsum([0] + [len(cols) for _, cols in jobs])
        return [float(per[a:e].max()) for a, e in itertools.pairwise(bounds)]

    def _bounded(self, jobs: list[tuple], tol: float) -> list[float | None]:
        """``_estimate`` of each ``(candidate, costs, [1, m] columns)`` job of one pipeline (``choose``, dp 1), or None
        for those whose candidate's busiest stage's work alone (``_work``) is past the best-ranked candidate's best
        estimate times ``1 + tol`` (``BOUND_MARGIN`` above it): their estimate is no lower (every estimate runs each
        stage's ops one after another), so they can be neither the fastest nor within ``tol`` of it. With
        ``virtual`` > 1 every job is estimated (a GPU's chunks follow the kind's placement)."""
        if self.virtual > 1 or not jobs:
            return list(self._estimate([job[1:] for job in jobs]))
        out: list[float | None] = [None] * len(jobs)

        def estimate(rows: list[int]) -> None:
            for i, v in zip(rows, self._estimate([jobs[i][1:] for i in rows])):
                out[i] = v
        first = min((job[0] for job in jobs), key=lambda c: c.value)          # the best ranked, estimated first
        estimate([i for i, job in enumerate(jobs) if job[0] is first])
        best = min(v for v in out if v is not None) * (1.0 + tol) * (1.0 + BOUND_MARGIN)
        work = {id(c): self._work(costs) for c, costs, _ in jobs}
        estimate([i for i, job in enumerate(jobs) if out[i] is None and work[id(job[0])] <= best])
        return out

    def _work(self, costs: Costs) -> float:
        """The busiest stage's work of a pipeline of all the columns of ``costs``: ``F + B`` (a zero-bubble
        estimate's ``I + W`` from its shares of ``B``, where they add up to less than ``B``)."""
        F, B = costs[0], costs[1]
        grad = B if self.shares is None else B * np.minimum(1.0, self.shares.sum(axis=0))[:, None]
        return float((F + grad).sum(axis=1).max())

    def _slowest(self, costs: Costs, cols: np.ndarray, limit: float,
                 inclusive: bool) -> float:
        """The slowest replica's estimate (replicas: rows of ``cols``), the likeliest by proxy
        first: past ``limit`` (or at it, unless ``inclusive``) already, the others are left out
        (the value is then a lower bound)."""
        likely = np.argsort(-self._proxy(*costs[:3], cols), kind="stable")
        head = self._estimate([(costs, cols[likely[:max(2, len(cols) // 8)]])])[0]
        if head > limit or (head == limit and not inclusive) or len(likely) <= 2:
            return head
        return max(head, self._estimate([(costs, cols[likely[max(2, len(cols) // 8):]])])[0])

    def _started(self, c: Candidate, busy: np.ndarray, cols: np.ndarray, out: np.ndarray,
                 limit: float) -> tuple[float, np.ndarray]:
        """(value, order) of ``c`` run as ``out`` (replicas ``cols``, as ``assign_replicas`` deals it), each replica
        in its best start order of the reorder search (``orders.best_start_orders``; DynaPipe's cluster orders
        too for the ``CLUSTERED`` baselines): what the search runs is no slower. The order returned is one
        that ``assign_replicas`` deals in those orders where ``orders.blocked_order`` finds one (then the value
        is its estimate), else ``out``; inf where the value is not below ``limit``."""
        assert c.F is not None and c.B is not None and c.comm is not None      # costed candidates
        costs = (c.F, c.B, c.comm, c.embed)
        starts, u, ran = best_start_orders(cols, (c.F + c.B).sum(axis=0), lambda p: self._each(costs, p), limit,
                                           c.baseline in CLUSTERED, int(np.argmax(self._proxy(*costs[:3], cols))))
        g = blocked_order(starts, cols, out, busy) if u < ran else None
        if g is not None and self._slowest(costs, g[self._assigned(c, busy, g)].reshape(self.dp, -1), u, True) <= u:
            return u, g
        return u, out

    def _each(self, costs: Costs, cols: np.ndarray) -> np.ndarray:
        """``makespans`` (the kind's own) of each pipeline of ``cols`` ([n, k] columns in order)."""
        idx, sizes = cols.ravel(), np.full(len(cols), cols.shape[1])
        per = makespans(costs[0][:, idx], costs[1][:, idx], costs[2][idx], sizes, self.kind, shares=self.shares,
                        virtual=self.virtual)
        return self._with_embeds(per, _taken(costs[3], idx), costs[2][idx], sizes)

    def choose(self, finals: list[Candidate], tol: float) -> tuple[Flat, float]:
        """The plan and estimate of the fastest of ``finals``, re-costed in one lookup and estimated on
        every replica as ``dynmb.packing`` will run them, in the reorder search's start orders (dp > 1:
        ``_started``, the estimate the search starts from)."""
        results = []                                   # (value, microbatches, candidate, order returned)
        if self.dp == 1:                               # every order weighed, the search's starts too
            jobs = [(c, (c.F, c.B, c.comm, c.embed), cols) for c in self.costed(finals, affine=False)
                    for cols in ([] if c.baseline else list(_orders(*self._members(c, True), c.opened).values()))
                    + [np.array([o]) for o in start_orders((c.F + c.B).sum(axis=0),  # type: ignore[operator]
                                                           c.baseline in CLUSTERED)]]
            for (c, _, cols), v in zip(jobs, self._bounded(jobs, tol)):
                if v is not None:
                    results.append((v, len(c.rows), c, cols[0]))
        else:
            best, best_m, seen = np.inf, np.inf, set()
            for c in self.costed(sorted(finals, key=lambda c: c.value), affine=False):
                sig = (c.baseline, c.order, c.rows.tobytes(), c.padded.tobytes(), c.attn.tobytes())
                if sig in seen:
                    continue                            # the same plan run the same way
                seen.add(sig)
                assert c.F is not None and c.B is not None and c.comm is not None    # costed
                busy, m = (c.F + c.B).max(axis=0), len(c.rows)
                fewer = m < best_m                      # it may also win by tying (or within tol)
                limit = best * (1 + tol) if fewer else best
                # what dynmb.packing will run (a baseline as given, else its order, which each replica keeps), or
                # each replica in its best start of the reorder search: a baseline's ranked value no bound of it
                out = np.arange(m) if c.baseline else _global_order(c.order, busy, self._members(c, True)[0], c.opened)
                order = self._assigned(c, busy, None if c.baseline else out)
                cols = out[order].reshape(self.dp, -1)
                busiest = fold_chunks(c.F + c.B, self.virtual)[:, cols].sum(axis=2).max()   # no order runs faster
                if busiest > limit or (busiest == limit and not fewer):
                    continue
                v, out = self._started(c, busy, cols, out, np.nextafter(limit, np.inf) if fewer else limit)
                if v < limit or (v == limit and fewer):
                    results.append((v, m, c, out))
                    best, best_m = (v, m) if v < best else (best, min(best_m, m))
        best_t = min(r[0] for r in results)
        v, _, c, out = min((r for r in results if r[0] <= best_t * (1 + tol)), key=lambda r: (r[1], r[0]))
        return c.emit(out), float(v)


def _taken(embed: np.ndarray | None, cols: np.ndarray) -> np.ndarray | None:
    """``embed[cols]`` (None without the embedding last)."""
    return None if embed is None else embed[cols]


def _deal(busy: np.ndarray, dp: int) -> np.ndarray:
    """Replica of each microbatch while ranking: slowest first, dealt boustrophedon (m / dp each)."""
    pos = np.empty(len(busy), dtype=np.int64)
    pos[np.argsort(-busy, kind="stable")] = np.arange(len(busy))
    r = pos % (2 * dp)
    return np.where(r < dp, r, 2 * dp - 1 - r)


def _orders(members: np.ndarray, t: np.ndarray, opened: np.ndarray | None) -> dict[str, np.ndarray]:
    """Execution orders of each row of ``members`` (a replica's microbatches, as formed): as
    formed, reversed, slowest / fastest first (by ``t``), the two cheapest at the two ends (the
    rest as formed or reversed); best-fit rows also as opened. Repeats dropped."""
    k = members.shape[1]
    by_t = np.take_along_axis(members, np.argsort(-t[members], axis=1, kind="stable"), axis=1)
    out = {"as formed": members, "reversed": members[:, ::-1], "slowest first": by_t, "fastest first": by_t[:, ::-1]}
    if k >= 3:
        cheap = np.argpartition(t[members], 1, axis=1)[:, :2]
        mid = np.ones(members.shape, dtype=bool)
        np.put_along_axis(mid, cheap, False, axis=1)
        ends, rest = np.take_along_axis(members, cheap, axis=1), members[mid].reshape(-1, k - 2)
        out["ends"] = np.concatenate([ends[:, :1], rest, ends[:, 1:]], axis=1)
        out["ends, reversed"] = np.concatenate([ends[:, :1], rest[:, ::-1], ends[:, 1:]], axis=1)
    if opened is not None:
        out["as opened"] = np.take_along_axis(members, np.argsort(opened[members], axis=1, kind="stable"), axis=1)
    unique: dict[bytes, tuple[str, np.ndarray]] = {}
    for name, cols in out.items():
        unique.setdefault(cols.tobytes(), (name, cols))
    return dict(unique.values())


def _round_trips(trips: list[tuple], P: int, kind: ScheduleKind) -> list[float]:
    """``round_trip_bound`` of each entry's probe replicas (the slowest of them), all entries at once
    (padded with zero-cost microbatches to the longest)."""
    if not trips:
        return []
    k = max(t[3].shape[1] for t in trips)
    F0, B0, up = [np.concatenate([np.pad(t[i], ((0, 0), (0, k - t[i].shape[1]))) for t in trips]) for i in (3, 4, 5)]
    per = round_trip_bound(F0, B0, up, k if kind.estimate_as == "gpipe" else P - 1)
    bounds = np.cumsum([0] + [len(t[3]) for t in trips])
    return [float(per[a:e].max()) for a, e in itertools.pairwise(bounds)]


def _global_order(name: str, busy: np.ndarray, members: np.ndarray, opened: np.ndarray | None) -> np.ndarray:
    """The order ``name`` of ``_orders`` for all microbatches at once, so that every replica keeps
    it whichever identical microbatches ``assign_replicas`` deals it (it breaks ties by position):
    as formed, reversed, by time, as opened; the two cheapest of each replica of ``members`` first
    and last, the rest as formed or reversed ("ends")."""
    m = len(busy)
    by_t = np.argsort(-busy, kind="stable")
    if name.startswith("ends") and members.shape[1] >= 3:
        ends = np.take_along_axis(members, np.argpartition(busy[members], 1, axis=1)[:, :2], axis=1)
        mid = np.ones(m, dtype=bool)
        mid[ends.ravel()] = False
        rest = np.flatnonzero(mid)
        return np.concatenate([ends[:, 0], rest[::-1] if name == "ends, reversed" else rest, ends[:, 1]])
    if name == "as opened" and opened is not None:
        return np.argsort(opened, kind="stable")
    return {"reversed": np.arange(m)[::-1], "slowest first": by_t, "fastest first": by_t[::-1]}.get(name, np.arange(m))


def _bound(work: np.ndarray, first_F: np.ndarray, last_B: np.ndarray, first_send: np.ndarray,
           last_send: np.ndarray) -> np.ndarray:
    """The pipeline bound (``dynmb.timing.makespan``) of pipelines side by side: ``work``, ``first_F``, ``last_B`` [P, n],
    the first and last microbatch's send time [n] each."""
    zero = np.zeros((1, work.shape[1]))
    fill = np.concatenate([zero, np.cumsum(first_F[:-1] + first_send, axis=0)])
    drain = np.concatenate([zero, np.cumsum(last_B[:-1] + last_send, axis=0)])
    return (work + fill + drain).max(axis=0)


def _proxy(F: np.ndarray, B: np.ndarray, comm: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Ranking proxy of each pipeline of ``cols`` ([pipelines, k] columns in order): the larger
    of the pipeline bound and the longest chain of round trips of microbatches P apart."""
    P, k = F.shape[0], cols.shape[1]
    Fo, Bo, c = F[:, cols], B[:, cols], comm[cols]                   # [P, n, k], [n, k]
    bound = _bound((Fo + Bo).sum(axis=2), Fo[:, :, 0], Bo[:, :, -1], c[:, 0], c[:, -1])
    trip = (Fo + Bo).sum(axis=0) + 2 * (P - 1) * c                    # [n, k]
    pad = -k % P
    chains = np.concatenate([trip, np.zeros((len(cols), pad))], axis=1).reshape(len(cols), -1, P).sum(axis=1)
    return np.maximum(bound, chains.max(axis=1))
