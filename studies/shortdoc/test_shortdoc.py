"""Smoke test of ``studies/shortdoc/shortdoc.py`` (``python -m pytest -q studies``): the short-trace list, the sweep's
stop rules and the tables from JSON lines."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from studies.shortdoc import shortdoc

from dynmb import data


def test_short_traces_are_the_shipped_ones_without_long_documents():
    names = shortdoc.short_traces()
    assert {"sharegpt", "alpaca_eval", "gsm8k", "humaneval"} <= set(names)
    assert all(int(data.load_trace(n).max()) <= shortdoc.SHORT_LONGEST for n in names)
    assert "wikitext2" not in names and "longtail" not in names


def test_sweep_stops_two_worse_in_a_row_and_keeps_the_best():
    steps = {1: 3.0, 2: 2.0, 4: 2.5, 8: 2.6, 16: 1.0}
    seen = []

    def plan(s):
        seen.append(s)
        return SimpleNamespace(sim=SimpleNamespace(makespan_s=steps[s]), plan=SimpleNamespace(num_microbatches=10 * s))

    assert shortdoc.sweep(plan, [1, 2, 4, 8, 16]) == (2.0, 2)
    assert seen == [1, 2, 4, 8]


def test_tables_from_json_lines(tmp_path, capsys):
    terms = {f"gap_{t}": 0.01 for t in shortdoc.TABLE_TERMS}
    row = {"trace": "t", "model": "m", "P": 16, "limit": "80GiB", "status": "ok", "step_s": 2.0, "ideal_s": 1.8,
           "gap": 2.0 / 1.8 - 1, "kind": "zb", "microbatches": 100, "grouping": "dynamic", "plan_cpu_s": 1.0,
           "best_other": "", "best_other_s": float("nan"), **terms}
    before, after = tmp_path / "before.jsonl", tmp_path / "after.jsonl"
    before.write_text(json.dumps({**row, "step_s": 2.2, "gap": 0.2, "step_balanced": 2.1}) + "\n")
    after.write_text(json.dumps(row) + "\n")
    assert shortdoc.main(["--table", str(after), "--before", str(before)]) == 0
    out = capsys.readouterr().out
    assert "2.2000 -> 2.0000" in out and "balanced (2.1000) | 0.952" in out
    assert shortdoc.main(["--table", str(before)]) == 0
    assert "| +20.0% |" in capsys.readouterr().out


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        shortdoc.main(["--help"])
    assert e.value.code == 0 and "--limits" in capsys.readouterr().out


def test_embedding_last_plans_with_the_option():
    """``--embedding last``: the cell's planner runs ``Planner(embedding="last")`` (its split's relief weighed for the
    embedding last; the embedding's states on the last stage's count, its plans with the embedding stage)."""
    import numpy as np

    cfg = dynmb_model("llama-tiny")
    trace = np.full(64, 100)
    planner = shortdoc.planner_for(cfg, trace, 2, "1GiB", shortdoc.Variant(embedding="last"))
    assert planner.spec.embedding == "last"
    emb = cfg.vocab_size * cfg.d_model * (2 * cfg.dtype_bytes + 8)
    assert np.isclose(planner.memory_model.embed_state_bytes, emb)
    assert planner.plan(trace[:16]).schedule.num_stages == 3


def dynmb_model(name):
    import dynmb
    return dynmb.model_config(name)


def test_stage_admission_grows_down_the_pipeline_and_caps_the_packer():
    from dynmb.memory.model import MemoryModel
    from dynmb.packing.context import PackContext

    cfg = dynmb_model("llama-tiny")
    mm = MemoryModel.analytic(cfg, 4)
    limit = int(mm.state_bytes.max() + 4 * mm.act_coef[:, 1].max() * 512)
    tokens = shortdoc.stage_admission(mm, limit)
    assert tokens[0] == min(tokens) and tokens[:-1] == sorted(tokens[:-1])     # the last stage also holds the head
    ctx = PackContext(mm, limit, 4, "1f1b")
    assert ctx.bmax([1])[0] == min(tokens)          # the packer's cap is the tightest stage's


def test_offload_variant_sets_the_spec_and_the_what_if_link():
    """``--offload auto`` reaches the cell's planner's spec; ``--host-gbps`` swaps only the host link."""
    from dynmb.core.config import ModelConfig
    from dynmb.costmodel.gpu import H100_SXM

    cfg = ModelConfig.preset("llama-tiny")
    trace = data.load_trace("gsm8k")
    variant = shortdoc.Variant(offload="auto", host_bytes_per_s=4e11)
    planner = shortdoc.planner_for(cfg, trace, 2, "1GiB", variant)
    assert planner.spec.offload == "auto"
    spec = variant.gpu(cfg, 2).spec
    assert spec.host_h2d_bytes_per_s == spec.host_d2h_bytes_per_s == 4e11
    assert spec.peak_flops == H100_SXM.peak_flops and shortdoc.Variant().gpu(cfg, 2).spec == H100_SXM


@pytest.mark.parametrize("embedding", ["first", "last"])
def test_state_shards_reach_the_cell_planner(embedding):
    """``--state-shards 8``: the cell's planner (either embedding place) plans with the sharded memory view."""
    import numpy as np

    cfg = dynmb_model("llama-tiny")
    trace = np.full(64, 100)
    whole = shortdoc.planner_for(cfg, trace, 2, "1GiB", shortdoc.Variant(embedding=embedding))
    planner = shortdoc.planner_for(cfg, trace, 2, "1GiB", shortdoc.Variant(embedding=embedding, state_shards=8))
    assert planner.spec.state_shards == 8 and planner.memory_model.state_shards == 8
    assert planner.memory_model.state_bytes.sum() < whole.memory_model.state_bytes.sum()


def test_baselines_keep_their_faster_embedding_place():
    """With dynamic's place chosen (the default ``auto``), every other method is planned under both places and its
    faster kept, the place recorded; ``--others-embedding same`` plans them on dynamic's planner only."""
    import numpy as np

    cfg = dynmb_model("llama-tiny")
    trace = np.random.default_rng(0).integers(40, 400, 64)
    variant = shortdoc.Variant(embedding="auto")
    planner = shortdoc.planner_for(cfg, trace, 4, "24MiB", variant)
    planner.plan(trace)
    planners = shortdoc.baseline_planners(cfg, trace, 4, "24MiB", variant, planner, True)
    assert [p.spec.embedding for p in planners] == ["first", "last"] and planner in planners
    both = shortdoc.others(planners, trace, ["packed", "dynapipe"])
    for name in ("packed", "dynapipe"):
        each = [shortdoc.plan_method(p, trace, name)[0].sim.makespan_s for p in planners]
        assert both[f"step_{name}"] == min(each)
        assert both[f"{name}_embedding"] == ("first", "last")[int(np.argmin(each))]
    assert shortdoc.baseline_planners(cfg, trace, 4, "24MiB", variant, planner, False) == [planner]
