"""``PlanMeta``: the typed plan-metadata record keeps the plan JSON's ``"meta"`` object as it was."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynmb.core.config import ModelConfig
from dynmb.core.planmeta import FIELD_NAMES, PlanMeta
from dynmb.core.planspec import PlanSpec
from dynmb.core.types import Plan
from dynmb.planning import plan_step

TINY = ModelConfig.preset("tiny")

_values = st.one_of(st.none(), st.integers(-5, 10**6), st.text(max_size=5), st.lists(st.integers(0, 50), max_size=4),
                    st.booleans())
_keys = st.one_of(st.sampled_from(FIELD_NAMES), st.text("abcxyz_", min_size=1, max_size=6))


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(_keys, _values, max_size=12))
def test_any_meta_object_round_trips_with_the_same_keys_and_values(d):
    """Known keys become fields, unknown ones stay in ``extra``; a key given as null stays listed."""
    meta = PlanMeta.from_dict(d)
    assert meta.to_dict() == d and dict(meta) == d and len(meta) == len(d)
    assert set(meta.extra) == set(d) - set(FIELD_NAMES)
    for k in set(d) & set(FIELD_NAMES):
        assert getattr(meta, k) == d[k] and meta[k] == d[k]
    assert PlanMeta.from_dict(json.loads(json.dumps(meta.to_dict()))).to_dict() == d


def test_with_sets_fields_and_keeps_unknown_keys():
    meta = PlanMeta.from_dict({"mbs": 4, "my_run": "a"})
    new = meta.with_(reorder="ends", pack_len=None, note=1)
    assert (new.mbs, new.reorder, new.pack_len) == (4, "ends", None)
    assert new.to_dict() == {"mbs": 4, "reorder": "ends", "pack_len": None, "my_run": "a", "note": 1}
    assert meta.to_dict() == {"mbs": 4, "my_run": "a"}                    # frozen: the old record is unchanged
    assert new.without("mbs", "note").to_dict() == {"reorder": "ends", "pack_len": None, "my_run": "a"}
    with pytest.raises(AttributeError):
        meta.mbs = 3                                                       # type: ignore[misc]
    assert PlanMeta(mbs=2).to_dict() == {"mbs": 2}                         # constructed: the fields not None


@pytest.mark.parametrize("method", ["dynamic", "fixed", "packed"])
def test_a_planned_plan_writes_and_reads_its_meta_unchanged(method):
    lengths = np.array([40, 300, 120, 90, 700, 33, 210, 64], dtype=np.int64)
    spec = PlanSpec(method=method, num_stages=2, memory_limit_bytes=64 * 2**20, reorder="auto")
    plan, _, _ = plan_step(lengths, spec, model_cfg=TINY, meta={"dataset": "x.csv", "my_tag": 7})
    assert isinstance(plan.meta, PlanMeta)
    assert plan.meta.dataset == "x.csv" and plan.meta.extra == {"my_tag": 7} and plan.meta.models is not None
    written = json.loads(plan.to_json())["meta"]
    assert {"longest_fitting_length", "oversize", "round_to", "pack_len", "truncated", "dropped", "reorder",
            "models", "dataset", "my_tag"} <= set(written)
    again = Plan.from_json(plan.to_json())
    assert again.meta.to_dict() == json.loads(json.dumps(plan.meta.to_dict()))
    assert json.loads(again.to_json())["meta"] == written
