"""``--stage-split auto`` balances the workload's own work (``dynmb.planning.split_work``), not forward FLOPs
of one 1,024-token row: long documents keep the split the step is fastest with, short ones agree with the
old default, every rank computes the same split, and the stand-in is said once."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest

import dynmb
from dynmb import data
from dynmb.cli.flags import model_from_args
from dynmb.cli.main import build_parser
from dynmb.costmodel import get_cost_model
from dynmb.costmodel.gpu import GPUCostModel
from dynmb.planning import stage_split
from dynmb.planning.split_work import workload_cost
from dynmb.planning.stage_split import resolve_stage_split, stage_work

LLAMA2 = replace(dynmb.model_config("llama2-7b"), max_seq_len=21504)     # every wikitext2 document fits
P = 16


def _planner(cfg, **kw) -> dynmb.Planner:
    return dynmb.Planner(model=cfg, num_stages=P, memory_limit="80GiB", cost_model=GPUCostModel(cfg, P),
                         stage_split="auto", oversize="truncate", **kw)


def test_long_documents_get_the_split_the_workload_runs_fastest_with() -> None:
    """Llama-2-7B, P 16, wikitext2 (sum s^2 / sum s about 7,300 tokens): one 1,024-token row moves work off
    the head's stage; the documents' own F + B (attention's s^2 and its dearer backward) weigh the layers
    more and the head less, a nearly even split (in chunks); the step simulated on the GPU model is within
    0.5% of the 1,024-token split's (also in chunks; 0.2% slower on this batch, where in half-blocks, which
    could not balance either, it was not slower)."""
    batch = data.sample_batch(data.load_trace("wikitext2"), 128, 0, step=0)
    old, new = _planner(LLAMA2), _planner(LLAMA2, workload="wikitext2")
    assert old.model_cfg.layer_split != new.model_cfg.layer_split
    counts = new.model_cfg.stage_layer_counts(P)
    assert new.model_cfg.chunk_split and max(abs(c - 2) for c in counts[:-1]) <= 1 / 16 and 1.5 < counts[-1] < 2
    assert new.cost_model.model_cfg.layer_split == new.model_cfg.layer_split  # the GPU model follows the split
    # the batch itself as the workload gives the same split as its trace
    assert _planner(LLAMA2, workload=batch).model_cfg.layer_split == new.model_cfg.layer_split
    assert new.plan(batch).sim.makespan_s <= old.plan(batch).sim.makespan_s * 1.005     # both in chunks: 0.2% apart
    # the split balances the workload's work: its busiest stage is lighter under the new split
    cost = workload_cost(batch, LLAMA2, GPUCostModel(LLAMA2, P))
    assert max(stage_work(LLAMA2, new.model_cfg.stage_layer_counts(P), stage_cost=cost)) < \
        max(stage_work(LLAMA2, old.model_cfg.stage_layer_counts(P), stage_cost=cost))
    # without a cost model that prices any layout: forward + backward FLOPs at the real lengths, nearly the same
    flops = resolve_stage_split(LLAMA2, P, "auto", workload=batch)
    assert max(abs(a - b) for a, b in zip(flops.layer_split, new.model_cfg.layer_split)) <= 1 / 8


def test_short_sequences_agree_with_one_row_of_1024_tokens() -> None:
    """sharegpt (mostly short conversations) at P 8: the workload's split is the 1,024-token one (in FLOPs;
    priced by the GPU model, whose short-sequence attention is slower, an arrangement of the same stage
    sizes with the same busiest stage, a tie the sum of squares breaks the other way)."""
    cfg = LLAMA2
    old = resolve_stage_split(cfg, 8, "auto")
    flops = resolve_stage_split(cfg, 8, "auto", workload="sharegpt")
    assert max(abs(a - b) for a, b in zip(flops.layer_split, old.layer_split)) <= 1 / 16 and flops.chunk_split
    priced = resolve_stage_split(cfg, 8, "auto", workload="sharegpt", cost_model=GPUCostModel(cfg, 8))
    assert priced.chunk_split
    cost = workload_cost("sharegpt", cfg, GPUCostModel(cfg, 8))
    assert max(stage_work(cfg, priced.layer_split, stage_cost=cost)) == \
        pytest.approx(max(stage_work(cfg, old.layer_split, stage_cost=cost)), rel=0.01)


def test_the_split_is_deterministic() -> None:
    """A function of the lengths, the config and the model's constants: every call (every rank) agrees,
    whatever form the lengths come in."""
    trace = data.load_trace("longtail")
    cm = GPUCostModel(LLAMA2, P)
    splits = {resolve_stage_split(LLAMA2, P, "auto", workload=w, cost_model=cm).layer_split
              for w in ("longtail", trace, trace.tolist(), trace.astype(np.int32), trace.copy())}
    assert len(splits) == 1
    # the analytic CPU stand-in prices any layout too; a fitted file does not (FLOPs then)
    small = dynmb.model_config("small")
    analytic = get_cost_model(None, small, 2)
    assert analytic.layout_free and analytic.for_layout(replace(small, layer_split=(1.5, 2.5)), 2).num_stages == 2
    a = [resolve_stage_split(small, 2, "auto", workload="sharegpt", cost_model=analytic).layer_split for _ in range(2)]
    assert a[0] == a[1]


def test_without_a_workload_the_stand_in_is_said_once(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(stage_split, "_FALLBACK_SAID", False)
    cfg = dynmb.model_config("llama-small")
    with caplog.at_level(logging.INFO, logger="dynmb.planning.stage_split"):
        resolve_stage_split(cfg, 2, "auto", workload="sharegpt")
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        for _ in range(3):
            resolve_stage_split(cfg, 2, "auto")
            dynmb.Planner(model=cfg, num_stages=2, memory_limit="1GiB", stage_split="auto")
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and "1,024-token" in said[0] and "--dataset" in said[0] and "workload=" in said[0]


@pytest.mark.filterwarnings("ignore::UserWarning")                    # the sampler's stand-in memory model
def test_the_command_line_and_the_sampler_balance_their_trace() -> None:
    """``dynmb plan`` / ``run`` plan the trace they draw batches from (sharegpt when none is named)."""
    parser = build_parser()
    base = ["plan", "--model", "llama2-7b", "--stages", str(P), "--stage-split", "auto"]
    wiki = model_from_args(parser.parse_args(base + ["--dataset", "wikitext2"]))
    assert wiki.layer_split == resolve_stage_split(dynmb.model_config("llama2-7b"), P, "auto",
                                                   workload="wikitext2").layer_split
    assert model_from_args(parser.parse_args(base)).layer_split == \
        resolve_stage_split(dynmb.model_config("llama2-7b"), P, "auto", workload="sharegpt").layer_split
    # the sampler balances its dataset
    sampler = dynmb.DynamicBatchSampler(data.load_trace("wikitext2"), 8, model=LLAMA2, num_stages=P,
                                        memory_limit="80GiB", cost_model=GPUCostModel(LLAMA2, P), stage_split="auto")
    # (with its global batch size: the near-optimal split its batches simulate fastest with, split_search)
    planner = dynmb.Planner(model=LLAMA2, num_stages=P, memory_limit="80GiB", cost_model=GPUCostModel(LLAMA2, P),
                            stage_split="auto", workload=data.load_trace("wikitext2"), global_batch=8)
    assert sampler.planner.model_cfg.layer_split == planner.model_cfg.layer_split


def test_a_fitted_cost_model_plans_the_split_it_was_measured_on(tmp_path) -> None:
    """A fitted model prices one split only: ``auto`` with one made for this model and stage count is its
    split (so profile + fit with ``--stage-split auto``, which see no workload, still plan ``run --stage-split
    auto --dataset ...``); one made for another model or stage count is not taken."""
    cfg = dynmb.model_config("llama-small")
    half = replace(cfg, layer_split=(2.5, 1.5))
    fitted = get_cost_model(None, half, 2)
    fitted.layout_free = False                       # stands for a poly / grid fit on the (2.5, 1.5) split
    assert resolve_stage_split(cfg, 2, "auto", workload="wikitext2", cost_model=fitted).layer_split == (2.5, 1.5)
    for other, stages in ((cfg, 4), (replace(cfg, d_model=512), 2)):      # another stage count, another model
        assert resolve_stage_split(other, stages, "auto", workload="wikitext2", cost_model=fitted).layer_split == \
            resolve_stage_split(other, stages, "auto", workload="wikitext2").layer_split
    shipped = dynmb.Planner(model="llama-small", num_stages=2, memory_limit="1GiB", stage_split="auto",
                            workload="wikitext2")
    assert shipped.cost_model.kind != "analytic" and shipped.model_cfg.layer_split == shipped.cost_model.model_cfg.layer_split


def test_zero_length_documents_are_skipped_with_a_note(caplog: pytest.LogCaptureFixture) -> None:
    """Real traces hold empty files: ``Planner(stage_split="auto", workload=...)`` skips their zero lengths
    with a warning and balances the rest as without them; a negative length is still refused."""
    cfg = dynmb.model_config("small")
    lengths = data.sample_batch(data.load_trace("sharegpt"), 64, 0, step=0)
    with_empty = np.concatenate([lengths, np.zeros(5, dtype=np.int64)])
    with caplog.at_level(logging.WARNING, logger="dynmb.planning.split_work"):
        split = resolve_stage_split(cfg, 2, "auto", workload=with_empty).layer_split
    assert split == resolve_stage_split(cfg, 2, "auto", workload=lengths).layer_split
    assert any("skipped 5 zero-length" in r.getMessage() for r in caplog.records)
    gpu = GPUCostModel(cfg, 2)
    planner = dynmb.Planner(model=cfg, num_stages=2, memory_limit="2GiB", stage_split="auto", workload=with_empty,
                            cost_model=gpu)
    assert planner.model_cfg.layer_split == resolve_stage_split(cfg, 2, "auto", workload=lengths,
                                                                cost_model=gpu).layer_split
    with pytest.raises(ValueError, match="non-negative"):
        resolve_stage_split(cfg, 2, "auto", workload=np.array([5, -1, 7]))
