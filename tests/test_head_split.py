"""The LM head split by vocabulary over the last stages (``ModelConfig.head_split``): sizes and checks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dynmb.core.config import ModelConfig
from dynmb.core.model_sizes import HEAD_STATS


def _llama8b(**kw):
    return ModelConfig.preset("llama3.1-8b", **kw)


def test_default_keeps_the_whole_head_on_the_last_stage():
    cfg = _llama8b()
    assert [len(r) for r in cfg.stage_vocab(4)] == [0, 0, 0, cfg.vocab_size]
    assert cfg.head_stage(4) == 3 and [cfg.message_channels(i, 4) for i in range(4)] == [cfg.d_model] * 4


def test_shards_split_rows_params_and_flops_and_conserve_the_totals():
    base, cfg = _llama8b(), _llama8b(layer_split=(16, 16, 0, 0), head_split=(0, 0, 28256, 100000))
    assert [(r.start, r.stop) for r in cfg.stage_vocab(4)] == [(0, 0), (0, 0), (0, 28256), (28256, 128256)]
    assert cfg.head_stage(4) == 2
    d = cfg.d_model
    assert cfg.stage_params(2, 4) == d + 28256 * d           # the final norm and its rows
    assert cfg.stage_params(3, 4) == 100000 * d              # rows only
    assert sum(cfg.stage_params(i, 4) for i in range(4)) == sum(
        _llama8b(layer_split=(16, 16, 0)).stage_params(i, 3) for i in range(3))
    assert cfg.param_count() == base.param_count()
    head = [float(cfg.stage_flops(i, 4, 2, 100)) for i in (2, 3)]
    assert head == [2 * 100 * 2 * d * 28256, 2 * 100 * 2 * d * 100000]
    # a 16-bit model sends each fp32 statistic as two 16-bit parts; fp32 sends them as they are
    assert cfg.message_channels(2, 4) == d + 2 * HEAD_STATS and cfg.message_channels(3, 4) == d
    f32 = _llama8b(dtype="float32", layer_split=(16, 16, 0, 0), head_split=(0, 0, 28256, 100000))
    assert f32.message_channels(2, 4) == d + HEAD_STATS and f32.message_channels(1, 4) == d


def test_the_first_shard_may_share_its_stage_with_layers():
    cfg = _llama8b(layer_split=(16, 16, 0), head_split=(0, 100, 128156))
    assert cfg.head_stage(3) == 1 and cfg.stage_layer_counts(3) == [16, 16, 0]
    assert _llama8b(layer_split=(16, 16, 0), head_split=(0, 0, 128256)).head_split is None   # all on the last


@pytest.mark.parametrize("kw, words", [
    (dict(layer_split=(16, 16, 0, 0)), "hold no layers"),
    (dict(layer_split=(16, 8, 8, 0), head_split=(0, 28256, 50000, 50000)), "no layers after stage 1"),
    (dict(head_split=(0, 0, 28256, 100000)), "layer_split must give"),
    (dict(layer_split=(16, 16, 0, 0), head_split=(0, 0, 28256, 99999)), "sum to vocab_size"),
    (dict(layer_split=(16, 16, 0, 0), head_split=(0, 5, 0, 128251)), "suffix"),
    (dict(layer_split=(16, 16, 0, 0), head_split=(0, 0, 0.5, 128255.5)), "whole number"),
    (dict(layer_split=(16, 0, 16)), "every stage >= 1 layer"),
])
def test_bad_splits_are_refused_naming_the_split(kw, words):
    with pytest.raises(ValueError, match=words):
        _llama8b(**kw)


def test_tied_heads_cannot_be_sharded():
    with pytest.raises(ValueError, match="untied"):
        ModelConfig.preset("llama3.2-1b", layer_split=(8, 8, 0, 0), head_split=(0, 0, 64128, 64128))


# --- planned: --stage-split auto shards the head where it outweighs a stage ------------------------------
def test_auto_shards_a_head_heavier_than_a_stage_and_only_then():
    from dynmb.planning.head_split import HEAD_CHUNKS, shard_head
    from dynmb.planning.split_units import CHUNK, unit_row
    from dynmb.planning.stage_split import (balanced_split, flops_cost, resolve_stage_split, stage_work, unit_work,
                                            with_split)

    cost = flops_cost(1024)
    cfg = _llama8b()
    out = resolve_stage_split(cfg, 32, "auto")
    assert out.head_split is not None and out.head_stage(32) == 29     # the head over the last three stages,
    assert out.stage_layer_counts(32)[-2:] == [0, 0] and out.chunk_split   # the layers cut in chunks
    assert sum(out.head_split) == cfg.vocab_size
    unsharded = with_split(cfg, 32, balanced_split(cfg, 32, half_blocks=True, stage_cost=cost))   # head unsharded
    assert max(stage_work(out, tuple(out.stage_layer_counts(32)), stage_cost=cost)) < \
        max(stage_work(unsharded, tuple(unsharded.stage_layer_counts(32)), stage_cost=cost)) * 0.9
    # the two head stages balanced to within one chunk of the head's work (the tie-break spreads them)
    work = stage_work(out, tuple(out.stage_layer_counts(32)), stage_cost=cost)
    head = unit_work(cfg, cost, True)[2]
    assert abs(work[-1] - work[-2]) <= head / HEAD_CHUNKS * (1 + 1e-9) and max(work[-2:]) < max(work)
    # Llama-2-7B's 32k head never outweighs a stage at P <= 16: the split is left as it is; Llama-3.1-8B's
    # 128k head does at P 16 once the layers are cut in chunks (the stages about 2.1 layers, the head 2.3)
    for p in (4, 8, 16):
        assert resolve_stage_split(ModelConfig.preset("llama2-7b"), p, "auto").head_split is None
        layout = resolve_stage_split(cfg, p, "auto")
        now = max(stage_work(layout, tuple(layout.stage_layer_counts(p)), stage_cost=cost))
        if p < 16:
            assert layout.head_split is None and shard_head(layout, p, unit_row(layout, cost, CHUNK), now) == []
        else:
            assert layout.head_split is not None and layout.stage_layer_counts(p)[-1] == 0


def test_memory_and_costs_follow_the_rows():
    from dynmb.costmodel.gpu import GPUCostModel
    from dynmb.memory.model import MemoryModel

    whole = _llama8b(layer_split=(16, 16, 0))
    cfg = _llama8b(layer_split=(16, 16, 0, 0), head_split=(0, 0, 28256, 100000))
    mw, ms = MemoryModel.analytic(whole, 3), MemoryModel.analytic(cfg, 4)
    # the fp32 logits gradient (transient) and the saved log-softmax / logits split by rows
    assert ms.transient_coef[2, 1] >= 4 * 28256 and ms.transient_coef[3, 1] >= 4 * 100000
    assert ms.transient_coef[3, 1] < mw.transient_coef[2, 1]
    assert ms.act_coef[2, 1] + ms.act_coef[3, 1] > mw.act_coef[2, 1] > max(ms.act_coef[2, 1], ms.act_coef[3, 1])
    assert ms.state_bytes[2] + ms.state_bytes[3] == pytest.approx(mw.state_bytes[2], rel=1e-6)
    # the GPU model prices a shard's head time by its rows
    gw, gs = GPUCostModel(whole, 3), GPUCostModel(cfg, 4)
    t = {name: float(m.predict(stage, "F", 1, 4096)) - m.spec.overhead_s
         for name, m, stage in (("whole", gw, 2), ("a", gs, 2), ("b", gs, 3))}
    assert t["a"] + t["b"] == pytest.approx(t["whole"], rel=1e-6)
    assert t["b"] / t["a"] == pytest.approx(100000 / 28256, rel=1e-3)


def test_the_runs_table_keeps_both_splits(tmp_path):
    """The ``runs`` row of a run with both splits writes to CSV and parquet alike (a column of tuples did not)."""
    from dynmb.core.config import PipelineConfig, RunConfig
    from dynmb.io.results import read_table, write_table
    import pandas as pd

    model = ModelConfig.preset("llama-tiny", layer_split=(4, 0), head_split=(170, 342))
    flat = RunConfig(model=model, pipeline=PipelineConfig(num_stages=2)).flat()
    assert flat["model.layer_split"] == "(4, 0)" and flat["model.head_split"] == "(170, 342)"
    write_table(pd.DataFrame([flat, {**flat, "model.head_split": None}]), tmp_path / "runs.csv")
    assert list(read_table(tmp_path / "runs.csv")["model.layer_split"]) == ["(4, 0)", "(4, 0)"]


def test_a_split_search_keeps_the_layout_that_simulates_fastest():
    """With a search that can simulate, the head stays whole unless a sharded layout (the min-max one, or the
    split's own prefix kept) simulates strictly faster per token; without one, the min-max sharded layout."""
    from dynmb.planning.stage_split import balanced_split, flops_cost, planned_layout

    cfg, cost = _llama8b(), flops_cost(1024)
    split = balanced_split(cfg, 32, half_blocks=True, stage_cost=cost)
    seen = []

    class Search:                              # SplitSearch.scores: mean step per token of each layout
        def __init__(self, scores):
            self.given = scores

        def scores(self, layouts, num_stages, *, workload, cost_model):
            seen.append(layouts)
            return self.given[:len(layouts)]

    plain = planned_layout(cfg, 32, split, cost)
    assert plain.head_split is not None
    whole = planned_layout(cfg, 32, split, cost, search=Search([1.0, 1.0, 1.0]))
    assert whole.head_split is None and whole.layer_split == tuple(split)        # no strict gain: kept whole
    layouts = seen[-1]
    assert layouts[1] == plain and all(x.head_split is not None for x in layouts[1:])
    assert planned_layout(cfg, 32, split, cost, search=Search([1.0, 0.9, 0.95])) == plain
    assert planned_layout(cfg, 32, split, cost, search=Search([1.0, 0.95, 0.9])) == layouts[-1]


def test_the_search_s_other_arrangements_are_sharded_and_weighed_too():
    from dynmb.planning.head_split import shard_head
    from dynmb.planning.split_search import near_optimal_splits
    from dynmb.planning.split_units import HALF, unit_row
    from dynmb.planning.stage_split import balanced_split, flops_cost, planned_layout, stage_work

    cfg, cost = _llama8b(), flops_cost(1024)
    split = balanced_split(cfg, 32, half_blocks=True, stage_cost=cost)
    others = near_optimal_splits(cfg, 32, cost, half_blocks=True, max_candidates=4)[0]
    seen = []

    class Search:
        def scores(self, layouts, num_stages, *, workload, cost_model):
            seen.append(layouts)
            return [1.0] + [0.9 + 0.001 * i for i in range(len(layouts) - 1)][::-1]   # the last one fastest

    chosen = planned_layout(cfg, 32, split, cost, search=Search(), arrangements=others)
    layouts = seen[-1]
    assert len(layouts) >= 3 and chosen == layouts[-1] and chosen.head_split is not None
    # each arrangement re-partitioned in half-blocks keeps its own prefix: its stages before the suffix
    # (in chunks the whole pipeline's re-partition is the lightest, CHUNK_GAIN lighter: the same for all)
    kept = []
    for other in others:
        layout = replace(cfg, layer_split=tuple(other))
        now = max(stage_work(layout, tuple(other), stage_cost=cost))
        kept += shard_head(layout, 32, unit_row(layout, cost, HALF), now, whole=False)
    assert len({x.layer_split[:20] for x in kept}) > 1 and all(x.head_split is not None for x in kept)
