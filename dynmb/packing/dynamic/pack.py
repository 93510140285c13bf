"""The ``dynamic`` packer: memory- and cost-aware microbatches planned for the schedule.

Algorithm:

1. Rows. For a row capacity R, a sequence longer than R/2 gets its own row; the shorter
   ones, in ascending length order, are packed next-fit into rows of at most R tokens (one
   ``bisect`` per row), so neighbouring rows have similar lengths and a row wastes less
   than one of its short documents. R runs over "no packing", up to three powers of two
   from 2x the median length up to the longest (rounded down to a multiple of
   ``round_to``) and ``max_len``, the longest admissible row. Batches of <= ``BFD_MAX``
   sequences also get rows of ``max_len`` filled best-fit-decreasing (``packed``'s rows).
2. Shapes and costs. A microbatch is a contiguous run of rows (sorted longest first); its
   ``padded_len`` is its first row's length rounded up to a multiple of ``round_to``, and
   memory and costs are evaluated at that rounded length. Its attention work is
   ``Microbatch.attention_work``: sum of s_i^2 over its documents when some row is packed
   (``attention="auto"``), else rows x padded_len^2. Its time per stage is taken from ONE
   cost lookup (``stage_costs`` at (1, s), (2, s) and (1, s, attention work 0) for every
   distinct padded length s): ``alpha_s + beta_s * rows - gamma_s * (rows * s^2 - work)``,
   affine in rows and attention work (exact for the analytic cost model; the polynomial model's
   per-token term of packed microbatches is not affine in attention work, which
   ``setup.affine_costs`` checks at two more points and reports; the final choice is
   re-costed with the model itself, step 7).
3. Own splits. The size is capped by memory (``bmax``, the per-microbatch budget of
   ``dynmb.packing``) and by a time target tau on the bottleneck stage's F + B. Greedy: each
   microbatch takes the most rows both caps allow, found for all rows at once by pointer
   doubling; tau sweeps a geometric grid per R. Also one best-fit row per microbatch.
4. Baselines. ``baselines(method)`` gives the plan each other method makes of the same batch
   (``BASELINES``; ``packed`` up to ``BFD_MAX`` sequences): candidates as they stand. The splits
   of ``sorted`` and (batches of <= ``SEED_DP_MAX`` sequences) ``dynapipe`` (runs of the sorted
   rows) are own splits too; called without baselines, batches of <= ``SEED_DP_MAX`` sequences
   seed with the same two (the fixed-size and DP (``dynmb.packing.dynapipe``) splits).
5. Data parallelism (dp = D): an own split's slowest microbatches are halved until their number
   is a positive multiple of D (else it drops out); a baseline is balanced as ``dynmb.packing``
   balances it (halving, then merging).
6. Rank. Each candidate in several orders (as formed; reversed; slowest / fastest first; the
   two cheapest at the two ends, the rest as formed or reversed; best-fit rows also as opened; a
   baseline only as it stands, the order step 7 runs it in), per replica when D > 1
   (replicas dealt boustrophedon by time, ``assign_replicas`` for baselines; estimated on the
   replica with the most work and the one with the longest round trip). A proxy orders them:
   the larger of the pipeline bound (``dynmb.timing.makespan``) and the longest chain of round trips that 1F1B forces
   (microbatch j + P starts on stage 0 only after j's backward is back there; with m <= P
   every microbatch is its own chain). The value ``makespan`` reports (exact with few
   microbatches per stage, else the bound) is computed for the best by proxy within
   ``RANK_OPS`` ops per pass (``makespans``: all at once). Then tau is refined around the
   best, the best three are also filled from the short end and the best two get a
   boundary-shift DP (each cut moves by up to 4 rows to minimise the summed bottleneck
   time), and those are ranked too. The estimate is the kind's, except that ``zb`` ranks with
   ``zb-h1``'s (``dynmb.timing.makespan_zb.RANK_AS``: its level tables have a closed form) and carries
   ``ZB_KEEP`` own splits to step 7, which estimates them with its own.
7. Choose. The ``keep`` best (and the fewest-microbatch ones within ``tol``) and every baseline
   are re-costed in one ``stage_costs`` lookup and estimated as ``dynmb.packing`` will run them and
   as the reorder search (``dynmb.planning.reorder``) will start them: in the search's start orders
   (``dynmb.packing.orders``: as packed, by work, ends, and for ``dynapipe``'s plan its cluster
   permutations, the reorder that method runs). D = 1: a baseline as it stands and in those orders,
   an own split in each order of step 6 and those; the best order is returned (a final whose busiest stage's work
   alone is past the best-ranked final's best estimate is not estimated: no estimate is below that work). D > 1: an own split in
   its best order run globally (so that every replica keeps it, whichever of identical microbatches
   ``assign_replicas`` deals it), a baseline as it stands, replicas assigned by ``assign_replicas``
   on that order; then each replica, the likeliest slowest first, in its best start order
   (``orders.best_start_orders``), with ``makespans``: the value is the slowest replica's, the step
   the search starts from (a candidate drops out as soon as a replica's best is past the best, or
   its busiest GPU's work alone is). The order returned is one ``assign_replicas`` deals in those
   replica orders where ``orders.blocked_order`` finds one (ties of equal work are dealt by position),
   else the order as run, which the search then reorders per replica. The fastest is returned (among
   those within ``tol``, the fewest microbatches): dynamic is never slower than the plan of any
   method it was given, by the estimate ``dynmb.packing`` reports (D = 1) or the estimate the reorder
   search starts from (D > 1; ``dynapipe``'s plan after its own cluster search). With D > 1 the plan
   as packed may be estimated slower than another method's (``--reorder none`` runs it so).
Modules: the row sets, their affine costs and split scoring (steps 1-3) are in
``setup``, the ranking and choice (steps 5-7) in ``rank``; this module runs them.
Steps 1-5 read no makespan estimate: ``space`` remembers them (and the rankings, looked-up
costs and replica assignments, ``rank.RankMemo``) across the packings of one batch, so
``--schedule auto``, which packs a batch once per kind (1f1b, zb-h1, zb), does them once.

Cost: O(n log n) for sorting plus O(n) vectorised work per (R, tau), O(rows) Python steps for
the next-fit rows, a per-sequence Python loop for the best-fit rows, the baselines' own costs
(``dynapipe``'s DP: a Python step per sequence, at any batch size), and the exact estimates
(O(m + P) numpy steps per batch of them; step 7: up to 4 start orders per replica, 28 for
``dynapipe``'s plan).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dynmb.costmodel.base import CostModelLike
from dynmb.packing.balanced import budget_divisors
from dynmb.packing.context import PackContext
from dynmb.packing.dynamic.ramp import ramped
from dynmb.packing.dynamic.rank import RANK_EXACT, ZB_KEEP, Candidate, Ranker
from dynmb.packing.dynamic.setup import SplitSetup
from dynmb.packing.dynamic.space import BFD_MAX, SEED_DP_MAX, PackCall, Space, space_for
from dynmb.packing.rows import Flat, polish_cuts, round_up
BALANCED_BUDGETS = 3
"""``balanced`` (verl's dynamic batching) is weighed at this many token budgets memory maximum / 2^j,
those the fast estimate ranks best (``balanced.budget_divisors``; ``dynmb compare`` tunes it over the
same budgets in hindsight): baselines ``"balanced/d"``. ``token-budget`` is weighed at the same
budgets (``"token-budget/d"``), as ``dynmb compare``'s ``token-budget-best`` tunes it."""
BASELINES = ("fixed", "sorted", "token-budget", "packed", "dynapipe", "balanced")
"""Methods whose plans (``baselines``) are candidates too, always weighed in the final choice
(``balanced`` at the budgets ``BALANCED_BUDGETS`` says, as ``balanced/d``: budget divisor ``mbs = d``)."""

__all__ = ["dynamic_groups", "DynamicSearch", "PackCall", "BASELINES", "BALANCED_BUDGETS", "RANK_EXACT", "BFD_MAX",
           "SEED_DP_MAX"]


@dataclass(frozen=True, kw_only=True)
class DynamicSearch:
    """How widely ``dynamic_groups`` searches."""

    num_tau: int = 4
    """Time targets per row set (3 more for batches of <= 1024 sequences)."""
    keep: int = 3
    """Own splits carried to the final choice (and as many of the fewest microbatches within ``tol``)."""
    tol: float = 0.0
    """Among plans within this relative margin of the best estimate, the fewest microbatches win."""


def dynamic_groups(lengths: np.ndarray, ctx: PackContext, cost_model: CostModelLike, call: PackCall = PackCall(),
                   search: DynamicSearch = DynamicSearch(), **settings: Any) -> tuple[Flat, float]:
    """Microbatches (in execution order) of the global batch ``lengths`` and their estimated makespan
    (the slowest of ``dp`` replicas, as ``dynmb.packing`` assigns them). The settings below come as
    keywords (``round_to=1, max_len=None, attention="auto", dp=1, baselines=None``), as a ``PackCall``
    record, or as both (the keywords replace the record's fields).

    ``ctx``: the packing call's memory budget (``ctx.bmax(padded_lens)``: the most rows admissible
    per padded length), stage count and schedule kind; the P2P time of a microbatch is
    ``cost_model.comm_s(rows, padded_len)`` when the model has one. Every padded_len is
    a multiple of ``round_to``; packed rows hold at most ``max_len`` tokens (a multiple of
    ``round_to``; default: no cap beyond the longest length). ``attention``: the model's
    attention setting (``auto``: packed microbatches cost sum(s_i^2)). ``baselines(method)``:
    the plan (flat form, in its order) ``method`` makes of the same batch, for the methods of
    ``BASELINES``. Among plans whose estimate is within ``search.tol`` (relative) of the best, the one
    with the fewest microbatches is kept (less per-microbatch runtime overhead the cost model may miss).
    """
    call = replace(call, **settings)
    round_to, max_len, dp, baselines = call.round_to, call.max_len, call.dp, call.baselines
    num_tau, keep, tol = search.num_tau, search.keep, search.tol
    n = len(lengths)
    top = round_up(int(lengths.max()), round_to) if max_len is None else int(max_len)
    space = space_for(lengths, ctx, cost_model, call, top=top, num_tau=num_tau if n > 1024 else num_tau + 3)
    setups = space.setups
    rk = Ranker(cost_model, ctx, dp, setups, lengths, space.memo)
    if rk.rank_kind != ctx.kind:                      # ranked by another kind's estimate: more finals to choose from
        keep = max(keep, ZB_KEEP)
    first = list(space.first)
    base: list[Candidate] = []
    if baselines is not None:
        names = [m for m in BASELINES if m != "balanced" and not (m == "packed" and n > BFD_MAX)]
        divisors = space.divisors(rk.rank_kind, lambda: budget_divisors(lengths, ctx, cost_model, round_to=round_to,
                                                                        dp=dp, keep=BALANCED_BUDGETS))
        names += [f"balanced/{d}" for d in divisors] + [f"token-budget/{d}" for d in divisors if d > 1]
        base = [c for c in (space.baseline(m, baselines, ctx.bmax) for m in names) if c is not None]
        for m in ("sorted", "dynapipe"):            # the seeds of a call without baselines, as those methods made them
            if m in names and (m == "sorted" or n <= SEED_DP_MAX):
                cuts = _sorted_cuts(space.given(m, baselines), setups["none"].rows.padded, m == "dynapipe")
                if cuts is not None:
                    first.append(("none", cuts, np.nan))
    own = rk.rank([space.own(*x) for x in {(x[0], x[1].tobytes()): x for x in first}.values()])
    base = rk.rank(base, as_given=True)
    own += rk.rank(_refined(own, setups, space.grids, num_tau, space))
    ramps = rk.rank(_ramps(own, space, lengths, ctx, min(top, ctx.max_len(top)), round_to)) \
        if dp == 1 and ctx.virtual == 1 and space.doc_causal else []       # ramped fills (``ramp``): one replica
    best = sorted((c for c in own if np.isfinite(c.value)), key=lambda c: c.value)
    finals = best[:keep] + sorted((c for c in best if c.value <= best[0].value * (1 + tol)),
                                  key=lambda c: len(c.rows))[:keep] if best else []
    finals += sorted((c for c in ramps if np.isfinite(c.value)), key=lambda c: c.value)[:RAMP_KEEP]
    if not finals and not base:                      # nothing balances over dp: leave it to dynmb.packing
        c = space.own(*first[0], balance=False)
        return c.emit(np.arange(len(c.rows))), np.inf
    return rk.choose(list({id(c): c for c in finals + base}.values()), tol)


RAMP_KEEP = 2
"""The best ramped candidates by the ranking estimate go to the final choice whatever their rank (``zb`` ranks with
``zb-h1``'s estimate, which does not see the fill a ramp saves under ``zb``'s)."""
RAMP_BODIES = (1.0, 1.5, 2.0, 3.0)
"""The best own split's time target times these: the bodies ``_ramps`` ramps (a ramp lets the body grow)."""


def _ramps(own: list[Candidate], space: Space, lengths: np.ndarray, ctx: PackContext, row_cap: int,
           round_to: int) -> list[Candidate]:
    """Ramped fills (``dynmb.packing.dynamic.ramp``) of the best ranked own split, of its row set's greedy splits
    at ``RAMP_BODIES`` times its time target, and of the second best."""
    ranked = sorted((c for c in own if np.isfinite(c.value) and c.source is not None), key=lambda c: c.value)
    if not ranked:
        return []
    key, _, tau = ranked[0].source  # type: ignore[misc]
    bodies = ranked[1:2] + [space.own(key, space.setups[key].greedy_cuts(tau * f), tau * f) for f in RAMP_BODIES]
    out = [ramped(b, lengths, ctx.p, row_cap, round_to, ctx.bmax) for b in bodies if len(b.rows)]
    return list({c.key: c for c in out if c is not None}.values())


def _sorted_cuts(flat: Flat, padded: np.ndarray, reverse: bool) -> np.ndarray | None:
    """Cut points over the unpacked rows (longest first, padded to ``padded``) of a plan of
    one sequence per row, its microbatches (reversed if ``reverse``) taking the rows in turn, if
    that gives each microbatch its own shape (runs of the sorted sequences, longest first);
    else None."""
    _, _, nseq, plen, batch = flat
    order = np.arange(len(nseq))[::-1] if reverse else np.arange(len(nseq))
    cuts = np.concatenate([[0], np.cumsum(batch[order])])
    return cuts if np.all(nseq == batch) and np.array_equal(padded[cuts[:-1]], plen[order]) else None


def _refined(own: list[Candidate], setups: dict[str, SplitSetup], grids: dict[str, np.ndarray], num_tau: int,
             space: Space) -> list[Candidate]:
    """Second-pass splits around the best ranked: tau refined between the grid neighbours of the
    best's, the best three's targets filled from the short end, the best two polished."""
    ranked = sorted((c for c in own if np.isfinite(c.value) and c.source is not None), key=lambda c: c.value)
    out: list[tuple] = []
    best = ranked[0].source if ranked else None      # every ranked candidate has a source
    if best is not None and np.isfinite(best[2]):
        key, _, tau = best
        grid = grids[key]
        k = int(np.searchsorted(grid, tau))
        lo_t, hi_t = grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 2)]
        if hi_t > lo_t:
            for t in np.geomspace(lo_t, hi_t, num_tau + 2)[1:-1]:
                out.append((key, setups[key].greedy_cuts(t), t))
    for c in ranked[:3]:
        assert c.source is not None
        key, _, tau = c.source
        if not np.isnan(tau):
            out.append((key, setups[key].greedy_cuts(tau, from_short_end=True), tau))
    for c in ranked[:2]:
        assert c.source is not None
        key, cuts, tau = c.source
        if len(cuts) - 1 <= 256:
            st = setups[key]
            out.append((key, polish_cuts(cuts, st.bottleneck, st.bmax), tau))
    seen = {(c.source[0], c.source[1].tobytes()) for c in own if c.source is not None}
    fresh = {(x[0], x[1].tobytes()): x for x in out if (x[0], x[1].tobytes()) not in seen}
    return [space.own(*x) for x in fresh.values()]
