"""Plan time under ``--schedule auto`` (issue 23): the packings of one batch for 1f1b, zb-h1 and zb share
their estimate-free work (``dynmb.packing.dynamic.space``), and the shortcuts of the ranking pick what
the full ranking picks where they are exact (baselines ranked in the order they run, baselines skipped
in ``choose`` by their ranked value, one level loop for pipelines of several sizes, equal microbatches
extended linearly) or close to it (``zb`` ranked with ``zb-h1``'s estimate). Plans never depend on what
was packed before (every rank of a run recomputes the same plan)."""

from __future__ import annotations

import numpy as np
import pytest

from dynmb.core.config import ModelConfig
from dynmb.costmodel import AnalyticCostModel
from dynmb.memory.model import MemoryModel
from dynmb.packing import methods, pack
from dynmb.packing.dynamic import rank as dynamic_rank
from dynmb.packing.dynamic import space as dynamic_space
from dynmb.core.planspec import PlanSpec
from dynmb.costmodel.loader import Models

TINY = ModelConfig.preset("tiny")
KINDS = ("1f1b", "zb-h1", "zb")


def _case(seed: int, P: int = 4, dp: int = 2, n: int = 160):
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(5.0, 1.0, n).astype(np.int64) + 1, 1500)
    mm, cm = MemoryModel.analytic(TINY, P), AnalyticCostModel(TINY, P)
    return lengths, mm, cm, int(mm.state_bytes.max() * 6)


def _pack(lengths, mm, cm, limit, kind, P=4, dp=2):
    return pack(lengths, PlanSpec(method="dynamic", num_stages=P, schedule_kind=kind, memory_limit_bytes=limit, dp=dp),
                models=Models(cm, mm))


def _shape(plan):
    return [(mb.seq_ids.tolist(), mb.row_ids.tolist(), mb.padded_len) for mb in plan.microbatches]


def test_auto_packings_share_the_other_methods_plans(monkeypatch):
    """auto packs a batch once per kind: the other methods' plans (balanced's Karmarkar-Karp partitions,
    the longest part of a packing) are made once for the three packings, not once per packing."""
    calls: list[int | None] = []
    real = methods.balanced_flat

    def counted(*a, **kw):
        calls.append(kw.get("divisor"))
        return real(*a, **kw)
    monkeypatch.setattr(methods, "balanced_flat", counted)
    dynamic_space.clear()
    lengths, mm, cm, limit = _case(0)
    for kind in KINDS:
        _pack(lengths, mm, cm, limit, kind)
    assert calls and len(calls) == len(set(calls)), calls          # each budget partitioned once


def test_zb_reuses_zb_h1s_rankings(monkeypatch):
    """zb ranks with zb-h1's estimate: packed after zb-h1 (as auto packs them), it ranks nothing itself (every
    ranking call is zb-h1's, remembered), and it estimates with its own only in ``choose``."""
    ranked: list[str] = []
    real = dynamic_rank.Ranker._rank

    def counted(self, cands, as_given):
        ranked.append(self.kind)
        return real(self, cands, as_given)
    monkeypatch.setattr(dynamic_rank.Ranker, "_rank", counted)
    dynamic_space.clear()
    lengths, mm, cm, limit = _case(7)
    _pack(lengths, mm, cm, limit, "zb-h1")
    assert ranked and set(ranked) == {"zb-h1"}
    ranked.clear()
    _pack(lengths, mm, cm, limit, "zb")
    assert ranked == []


def test_plans_do_not_depend_on_what_was_packed_before():
    """Each kind's plan is the one a fresh process makes, whatever was packed before it (in any order),
    and packing again gives it again."""
    for seed in (1, 2):
        lengths, mm, cm, limit = _case(seed)
        fresh = {}
        for kind in KINDS:
            dynamic_space.clear()
            fresh[kind] = _shape(_pack(lengths, mm, cm, limit, kind))
        for order in (KINDS, KINDS[::-1]):
            dynamic_space.clear()
            for kind in order:
                assert _shape(_pack(lengths, mm, cm, limit, kind)) == fresh[kind], (seed, order, kind)
        assert _shape(_pack(lengths, mm, cm, limit, "zb")) == fresh["zb"]


def test_another_cost_model_gets_a_space_of_its_own():
    """A remembered space is never served to another cost model (its costs, hence its candidates, differ)."""
    lengths, mm, cm, limit = _case(3)
    slow = AnalyticCostModel(TINY, 4)
    slow.stage_costs = lambda *a, **kw: {op: 3.0 * v + 1e-3 for op, v in AnalyticCostModel.stage_costs(
        cm, *a, **kw).items()}
    dynamic_space.clear()
    alone = _shape(_pack(lengths, mm, slow, limit, "1f1b"))
    dynamic_space.clear()
    _pack(lengths, mm, cm, limit, "1f1b")
    assert _shape(_pack(lengths, mm, slow, limit, "1f1b")) == alone


def _no_prune_choose(monkeypatch):
    """``Ranker.choose`` without its skip of baselines by ranked value (their values set to -inf)."""
    real = dynamic_rank.Ranker.choose

    def choose(self, finals, tol):
        for c in finals:
            if c.baseline:
                c.value = -np.inf
        return real(self, finals, tol)
    monkeypatch.setattr(dynamic_rank.Ranker, "choose", choose)


def _all_orders_rank(monkeypatch):
    """``Ranker.rank`` ranking baselines in every order (as before: ``as_given`` ignored)."""
    real = dynamic_rank.Ranker._rank
    monkeypatch.setattr(dynamic_rank.Ranker, "_rank", lambda self, cands, as_given: real(self, cands, False))


@pytest.mark.parametrize("seed", [4, 5, 6])
@pytest.mark.parametrize("kind", ["1f1b", "zb-h1"])
def test_exact_shortcuts_choose_what_the_full_ranking_chooses(seed, kind, monkeypatch):
    """Ranking the baselines only in the order ``choose`` runs them, and skipping in ``choose`` a baseline
    whose ranked value (a lower bound of its estimate there) is already past the best, pick the same plan
    as ranking them in every order and estimating each in full (4 stages, 4 replicas, hand batches)."""
    lengths, mm, cm, limit = _case(seed, dp=4)
    dynamic_space.clear()
    short = _pack(lengths, mm, cm, limit, kind, dp=4)
    with monkeypatch.context() as mp:
        _no_prune_choose(mp)
        _all_orders_rank(mp)
        dynamic_space.clear()
        full = _pack(lengths, mm, cm, limit, kind, dp=4)
    assert _shape(short) == _shape(full)
    assert short.predictions["est_makespan_s"] == full.predictions["est_makespan_s"]


def test_zb_ranked_with_zb_h1s_estimate_stays_near_its_own_ranking(monkeypatch):
    """``zb`` ranks with ``zb-h1``'s estimate (RANK_AS) and estimates only its finals with its own: on hand
    batches its plan is mostly the one ranking every candidate by ``zb``'s own estimate gives, and never
    more than 3% slower by that estimate (the shipped-trace cells: the same plans, docs/results.md)."""
    from dynmb.timing import makespan_zb

    same, n = 0, 0
    for seed in range(8):
        lengths, mm, cm, limit = _case(10 + seed, n=120)
        dynamic_space.clear()
        short = _pack(lengths, mm, cm, limit, "zb")
        with monkeypatch.context() as mp:
            mp.setattr(makespan_zb, "RANK_AS", {})
            dynamic_space.clear()
            full = _pack(lengths, mm, cm, limit, "zb")
        n += 1
        same += _shape(short) == _shape(full)
        assert short.predictions["est_makespan_s"] <= full.predictions["est_makespan_s"] * 1.03, seed
    assert same >= n // 2, (same, n)
    dynamic_space.clear()
