"""``packing.dispatch._merge_cheapest`` builds its pair table in blocks of rows: the same pair as the whole table."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dynmb.packing import PackingError, dispatch
from dynmb.packing.rows import Group


class _Budget:
    """A context whose rows fit a token budget: ``bmax(s) = budget // s``."""

    def __init__(self, budget: int) -> None:
        self.budget = budget

    def bmax(self, s):
        return self.budget // np.asarray(s, dtype=np.int64)


def _whole_table_pair(groups: list[Group], ctx: _Budget) -> tuple[int, int] | None:
    """The cheapest admissible pair over the whole (i < j) table, first in row-major order on ties."""
    best, pair = np.inf, None
    for i in range(len(groups)):
        for j in range(i + 1, len(groups)):
            a, b = groups[i], groups[j]
            if a.batch + b.batch <= min(ctx.bmax([a.padded_len])[0], ctx.bmax([b.padded_len])[0]):
                cost = max(a.padded_len, b.padded_len) * (a.batch + b.batch)
                if cost < best:
                    best, pair = cost, (i, j)
    return pair


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([8, 16, 24, 64]), st.integers(1, 4)), min_size=2, max_size=40),
       st.integers(1, 7), st.sampled_from([48, 96, 256]), st.integers(2, 4))
def test_the_blocked_table_merges_the_whole_tables_pair(shapes, block, budget, dp):
    groups = [Group(np.array([q]), np.array([0]), s, b) for q, (s, b) in enumerate(shapes)]
    ctx = _Budget(budget)
    want = _whole_table_pair(groups, ctx)
    old_block = dispatch.MERGE_BLOCK
    dispatch.MERGE_BLOCK = block
    try:
        if want is None or len(groups) <= dp:
            with pytest.raises(PackingError, match="cannot give"):
                dispatch._merge_cheapest(groups, ctx, dp)
            return
        out = dispatch._merge_cheapest(groups, ctx, dp)
    finally:
        dispatch.MERGE_BLOCK = old_block
    merged = out[-1]
    assert sorted(merged.items.tolist()) == sorted([int(groups[want[0]].items[0]), int(groups[want[1]].items[0])])
    assert len(out) == len(groups) - 1
