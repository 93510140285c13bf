"""Memory in the stage split (``dynmb.planning.memory_split``): the candidates are partitions that keep the tail, the
choice never loses by its own proxy, a generous limit keeps the work-balanced split, and the Planner plans on the
relieved layout within the limit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dynmb
from dynmb.costmodel.gpu import GPUCostModel
from dynmb.memory.model import MemoryModel
from dynmb.planning import memory_split as ms
from dynmb.planning.stage_split import resolve_stage_split

WORKLOAD = np.array([40, 90, 150, 200, 260, 320, 700, 1200], dtype=np.int64)


def _balanced(name: str, stages: int) -> dynmb.ModelConfig:
    cfg = dynmb.model_config(name)
    return resolve_stage_split(cfg, stages, "auto", workload=WORKLOAD, cost_model=GPUCostModel(cfg, stages))


def _inputs(cfg: dynmb.ModelConfig, stages: int, limit: int) -> ms.ReliefInputs:
    return ms.ReliefInputs(memory_limit_bytes=limit, schedule_kind="auto", workload=WORKLOAD,
                           cost_model=GPUCostModel(cfg, stages))


@settings(max_examples=12, deadline=None)
@given(stages=st.sampled_from([2, 3, 4]), limit_mib=st.integers(64, 8192))
def test_candidates_partition_the_layers_and_keep_the_tail(stages: int, limit_mib: int) -> None:
    cfg = _balanced("llama-small", stages)
    cands = ms.relief_candidates(cfg, stages, _inputs(cfg, stages, limit_mib << 20))
    base = cands[0]
    assert base == tuple(cfg.stage_layer_counts(stages))
    tail = ms._tail(cfg, stages)
    for c in cands:
        assert len(c) == stages and abs(sum(c) - cfg.n_layers) < 1e-9
        assert all(x > 0 for x in c[:tail]) and c[tail:] == base[tail:]
    firsts = [c[0] for c in cands]
    assert firsts == sorted(firsts, reverse=True) and len(set(firsts)) == len(firsts)
    assert len(set(cands)) == len(cands)


@settings(max_examples=12, deadline=None)
@given(stages=st.sampled_from([2, 4]), limit_mib=st.integers(64, 8192))
def test_the_choice_never_loses_by_its_proxy(stages: int, limit_mib: int) -> None:
    cfg = _balanced("llama-small", stages)
    out, relief = ms.relieve(cfg, stages, _inputs(cfg, stages, limit_mib << 20))
    assert relief.proxy_s <= relief.balanced_proxy_s
    if relief.relieved:
        assert relief.proxy_s < relief.balanced_proxy_s * (1 - ms.RELIEF_GAIN)
        assert tuple(out.stage_layer_counts(stages)) == relief.split and out.recompute_blocks == relief.recompute_blocks
        assert relief.split[0] < relief.balanced[0] or relief.recompute_blocks is not None   # a relief of stage 0
    else:
        assert out == cfg and relief.split == relief.balanced


@settings(max_examples=10, deadline=None)
@given(limit_mib=st.integers(256, 4096), more=st.integers(1, 4096))
def test_admitted_tokens_grow_with_the_limit(limit_mib: int, more: int) -> None:
    cfg = _balanced("llama-small", 4)
    lo = ms.step_proxy(cfg, 4, _inputs(cfg, 4, limit_mib << 20), 200)[1]
    hi = ms.step_proxy(cfg, 4, _inputs(cfg, 4, (limit_mib + more) << 20), 200)[1]
    assert hi >= lo


def test_a_generous_limit_keeps_the_balanced_split() -> None:
    cfg = _balanced("llama2-7b", 8)
    out, relief = ms.relieve(cfg, 8, _inputs(cfg, 8, 80 << 30))
    assert not relief.relieved and out == cfg


def test_llama3_first_stage_is_relieved_at_20gib() -> None:
    """Llama-3.1-8B at P 8, 20 GiB: the embedding's states and 8 microbatches in flight bind the first stage; the
    relieved split takes layers off it and admits more tokens a microbatch (at 24 GiB the lean blocks,
    ``dynmb.models.llama``, leave the balanced split admitting as many)."""
    cfg = _balanced("llama3.1-8b", 8)
    out, relief = ms.relieve(cfg, 8, _inputs(cfg, 8, 20 << 30))
    assert relief.relieved and relief.split[0] < relief.balanced[0] and relief.tokens > relief.balanced_tokens


def test_planner_plans_on_the_relieved_layout_within_the_limit() -> None:
    cfg = dynmb.model_config("llama-small")
    kw = dict(model=cfg, num_stages=4, memory_limit="2GiB", cost_model=GPUCostModel(cfg, 4), schedule="1f1b",
              stage_split="auto", workload=WORKLOAD)
    planner = dynmb.Planner(**kw)
    relief = planner.split_relief
    assert relief is not None
    assert tuple(planner.model_cfg.stage_layer_counts(4)) == relief.split
    step = planner.plan(np.random.default_rng(0).choice(WORKLOAD, 64))
    assert np.all(np.asarray(step.plan.predictions["pred_peak_bytes"]) <= planner.memory_limit_bytes)
    balanced = ms.layout_of(planner.model_cfg, 4, relief.balanced)
    given_memory = dynmb.Planner(**kw, memory_model=MemoryModel.analytic(balanced, 4))
    assert given_memory.split_relief is None


@pytest.mark.parametrize("virtual", [2])
def test_no_relief_with_chunks(virtual: int) -> None:
    cfg = _balanced("llama-small", 4)
    assert ms.relieved_layout(cfg, 4, _inputs(cfg, 4, 2 << 30), virtual=virtual) == (cfg, None)


def test_the_command_line_resolves_the_planners_layout(tmp_path) -> None:
    """``model_from_args`` (``dynmb plan`` / ``run``) weighs the same relief as ``Planner``: one layout."""
    import argparse

    from dynmb.cli.flags import model_from_args

    cfg = dynmb.model_config("llama-small")
    cost = tmp_path / "gpu.json"
    GPUCostModel(cfg, 4).save(cost)
    args = argparse.Namespace(model="llama-small", stage_split="auto", stages=4, memory_limit="2GiB", schedule="1f1b",
                              cost_model=str(cost), dataset="gsm8k", lengths=None, corpus=None, virtual=None,
                              attention=None, memory_model=None)
    planner = dynmb.Planner(model=cfg, num_stages=4, memory_limit="2GiB", cost_model=str(cost), schedule="1f1b",
                            stage_split="auto", workload="gsm8k")
    assert planner.split_relief is not None and planner.split_relief.relieved
    assert model_from_args(args).layer_split == planner.model_cfg.layer_split


def test_the_embedding_on_the_last_rank_is_sized_where_it_runs() -> None:
    """Llama-3.1-8B, P 8, 20 GiB: with the embedding first its 128k-row table on stage 0 sets the microbatch and the
    relief takes layers off stage 0; with it last (``embedding="last"``) stage 0 holds no table, so the
    balanced split admits more tokens, as the memory model that plans the run says, and is kept (the old code
    weighed the table on stage 0 either way and relieved both). (24 GiB before the lean blocks.)"""
    cfg, stages, limit = dynmb.model_config("llama3.1-8b"), 8, 20 << 30
    kw = dict(model=cfg, num_stages=stages, memory_limit=limit, cost_model=GPUCostModel(cfg, stages), workload="gsm8k",
              stage_split="auto", schedule="1f1b")
    first, last = (dynmb.Planner(**kw, embedding=e) for e in ("first", "last"))
    assert first.split_relief is not None and last.split_relief is not None
    assert first.split_relief.relieved and not last.split_relief.relieved
    assert last.split_relief.balanced_tokens > first.split_relief.balanced_tokens
    mm = MemoryModel.analytic(last.model_cfg, stages).embedding_last()      # the balanced layout, as it plans
    admitted = mm.max_rows(limit - np.asarray(mm.state_bytes, dtype=np.float64), 1,
                           ms._windows("1f1b", stages), tight=True)[0]
    assert last.split_relief.balanced_tokens == int(admitted)
