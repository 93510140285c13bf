"""Typed values across modules: ``CostFeatures`` (the one cost lookup's inputs, built in one
place), the named ``Flat``/``Group`` records of the packers, and the dynamic packer's check of
the affine property it relies on."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynmb.core.config import ModelConfig
from dynmb.costmodel import AnalyticCostModel, get_cost_model
from dynmb.core.features import CostFeatures
from dynmb.memory.model import MemoryModel
from dynmb.packing import pack
from dynmb.packing.dynamic.setup import AFFINE_TOL, AffineCostError, affine_costs
from dynmb.packing.rows import Flat, Group, flat_to_groups, groups_to_flat, merge_groups, split_group
from dynmb.core.planspec import PlanSpec
from dynmb.core.types import Microbatch
from dynmb.costmodel.loader import Models

TINY = ModelConfig.preset("tiny")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(1, 64), min_size=1, max_size=4), min_size=1, max_size=6),
       st.sampled_from(["auto", "dense"]), st.booleans())
def test_features_of_microbatches_are_their_attention_work(rows_of_docs, attention, recompute):
    """One microbatch per list: each inner list is one row's documents (packed when > 1)."""
    mbs, sid = [], 0
    for docs in rows_of_docs:
        n = len(docs)
        mbs.append(Microbatch(list(range(sid, sid + n)), docs, max(sum(docs), 1), 1, [0] * n, recompute=recompute))
        sid += n
    f = CostFeatures.of(mbs, attention)
    assert f.attn.tolist() == [float(mb.attention_work(attention)) for mb in mbs]
    assert f.rows.tolist() == [1.0] * len(mbs) and f.padded_len.tolist() == [float(mb.padded_len) for mb in mbs]
    assert f.recompute.tolist() == [recompute] * len(mbs) and not f.prefix.any()


def test_features_of_slices_carry_their_prefix_work_and_refuse_the_plain_lookup():
    mbs = [Microbatch([0], [100], 100, 1, offsets=[0], continued=[True]),
           Microbatch([0], [60], 64, 1, offsets=[100], continued=[False])]
    f = CostFeatures.of(mbs)
    assert f.prefix.tolist() == [0.0, 2.0 * 60 * 100]
    assert f.attn.tolist() == [float(mb.attention_work()) for mb in mbs]
    with pytest.raises(ValueError, match="plan_costs"):
        f.costs(AnalyticCostModel(TINY, 2))
    assert f.take([0]).costs(AnalyticCostModel(TINY, 2))["F"].shape == (2, 1)


def test_features_lookup_is_the_cost_models():
    cm = AnalyticCostModel(TINY, 2)
    rows, plen = np.array([1, 3, 2]), np.array([64, 128, 300])
    attn = rows * plen ** 2 / 2.0
    got = CostFeatures.of_shapes(rows, plen, attn, recompute=[False, True, False]).costs(cm, ops=("F", "B"))
    want = cm.stage_costs(rows, plen, attn, recompute=np.array([False, True, False]))
    for op in ("F", "B"):
        np.testing.assert_array_equal(got[op], want[op])
    both = CostFeatures.concat([CostFeatures.of_shapes(rows[:1], plen[:1]), CostFeatures.of_shapes(rows[1:], plen[1:])])
    np.testing.assert_array_equal(both.attn, rows * plen.astype(np.float64) ** 2)


def test_groups_and_flat_are_named_records():
    g = Group(np.array([4, 5, 6]), np.array([0, 1, 1]), 32, 2)
    assert g.padded_len == 32 and g.batch == 2 and g[2] == 32            # still a tuple
    halves = split_group(g)
    assert all(isinstance(h, Group) for h in halves) and sum(h.batch for h in halves) == 2
    merged = merge_groups(*halves)
    assert merged.batch == 2 and sorted(merged.items.tolist()) == [4, 5, 6]
    flat = groups_to_flat(halves + [Group(np.array([1]), np.array([0]), 8, 1)])
    assert isinstance(flat, Flat) and flat.nseq.tolist() == [1, 2, 1] and flat.batch.tolist() == [1, 1, 1]
    back = flat_to_groups(flat)
    assert all(isinstance(x, Group) for x in back) and [x.padded_len for x in back] == [32, 32, 8]


class _Bent(AnalyticCostModel):
    """The analytic model plus ``extra * rows^2`` seconds: not affine in rows."""

    def __init__(self, cfg: ModelConfig, p: int, extra: float) -> None:
        super().__init__(cfg, p)
        self.extra = extra

    def stage_costs(self, rows, padded_len, attn=None, ops=("F", "B"), recompute=None):
        out = super().stage_costs(rows, padded_len, attn, ops, recompute)
        b = np.asarray(rows, dtype=np.float64)
        return {op: v + self.extra * b ** 2 for op, v in out.items()}


def test_affine_property_holds_for_the_analytic_model():
    cm = AnalyticCostModel(TINY, 2)
    a = affine_costs(cm, np.array([32, 100, 999]), strict=True)
    alpha, beta, gamma, delta = a["F"]
    np.testing.assert_allclose(delta, 0.0, atol=1e-15)          # no packed path in the FLOP count
    s = 100.0
    for b in (1, 4, 9):
        want = cm.stage_costs([b], [s], [b * s * s])["F"][:, 0]
        np.testing.assert_allclose(alpha[:, 1] + beta[:, 1] * b, want, rtol=1e-9)


def test_a_cost_model_that_is_not_affine_is_named(caplog):
    bent = _Bent(TINY, 2, extra=1e-3)
    with pytest.raises(AffineCostError, match=r"_Bent is not affine .* 3 rows"):
        affine_costs(bent, np.array([64, 128]), strict=True)
    with caplog.at_level(logging.WARNING, logger="dynmb.packing.dynamic.setup"):
        affine_costs(bent, np.array([64, 128]))
    assert any("not affine" in r.getMessage() for r in caplog.records)
    assert AFFINE_TOL < 1e-3
    # the packer keeps working on such a model: its chosen plan is re-costed with the model itself
    mm = MemoryModel.analytic(TINY, 2)
    lengths = np.random.default_rng(1).integers(16, 200, size=20)
    plan = pack(lengths, PlanSpec(method="dynamic", memory_limit_bytes=64 * 2**20), models=Models(bent, mm))
    plan.validate(lengths)


def test_shipped_fitted_model_is_affine_on_each_side_of_the_packed_flag(caplog):
    """The shipped polynomial model's per-token term of packed microbatches (attention work below
    rows x padded_len^2) is a step; the packer's form carries it (``delta``), so the check passes, no
    warning on the default path, and the form reproduces the model at packed and one-document shapes."""
    cfg = ModelConfig.preset("small")
    from dynmb.planning import default_cost_model_path
    fitted = get_cost_model(default_cost_model_path("small", 2, "cpu"), cfg, 2)
    s = np.array([64, 512])
    with caplog.at_level(logging.WARNING, logger="dynmb.packing.dynamic.setup"):
        a = affine_costs(fitted, s, strict=True)
    assert not any("not affine" in r.getMessage() for r in caplog.records)
    for op in ("F", "B"):
        alpha, beta, gamma, delta = a[op]
        assert np.all(delta > 0)
        for b, work_share in ((4, 1.0), (4, 0.3), (7, 0.05)):
            work = b * s * s * work_share
            want = fitted.stage_costs(np.full(2, b), s, work)[op]
            packed = work_share < 1.0
            got = alpha + beta * b - gamma * (b * s * s - work) + delta * b * packed
            np.testing.assert_allclose(got, want, rtol=1e-9)
