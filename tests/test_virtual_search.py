"""``virtual="auto"`` (``dynmb.planning.virtual_search``): the model chunks per GPU chosen once per run by the
simulated step per real token of the workload's sample batches: V 2 or 4 for long documents, V 1 for short
chats, the same on every call, checked against plans made at that V independently; V 1 said once where
no plan can be made."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest

import dynmb
from dynmb.costmodel.gpu import GPUCostModel
from dynmb.planning import virtual_search
from dynmb.planning.split_search import SplitSearch
from dynmb.planning.stage_split import resolve_stage_split
from dynmb.planning.virtual_search import VirtualSearch, admissible

pytestmark = pytest.mark.filterwarnings("ignore::dynmb.planning.defaults.StandInModelWarning")
LLAMA2 = replace(dynmb.model_config("llama2-7b"), max_seq_len=21504)
P, GLOBAL = 8, 64


def _planner(trace: str, **kw) -> dynmb.Planner:
    args = dict(model=LLAMA2, num_stages=P, memory_limit="80GiB", cost_model=GPUCostModel(LLAMA2, P),
                workload=trace, oversize="truncate", schedule="auto", virtual="auto", global_batch=GLOBAL)
    return dynmb.Planner(**{**args, **kw})


@pytest.mark.slow
def test_long_documents_choose_several_chunks_per_gpu() -> None:
    """longtail at P 8, long documents sliced (``oversize="split"``: every V trains every token): V 2 and V 4
    train a third more tokens per simulated second than V 1 (within 0.3% of each other since the other
    methods' sliced plans are weighed: V 4 ahead); the Planner then plans at the fastest V, its cost model
    rebuilt for it, and the steps match plans made at each V. (With ``truncate`` V 2 would truncate more than
    V 1, and is not taken.)"""
    planner = _planner("longtail", oversize="split")
    choice = planner.virtual_choice
    v = choice.virtual
    assert choice.how == "simulated" and choice.candidates == (1, 2, 4) and v in (2, 4)
    assert planner.virtual == v and planner.num_stages == v * P and planner.cost_model.num_stages == v * P
    assert min(choice.scores_s) == choice.scores_s[choice.candidates.index(v)] < 0.8 * choice.scores_s[0]
    step = planner.plan(np.asarray(dynmb.data.sample_batch(dynmb.data.load_trace("longtail"), 16, 1, step=0)))
    assert step.plan.num_stages == v * P and step.schedule.kind == "interleaved"
    batches = SplitSearch(spec=planner.spec, global_batch=GLOBAL).sample_batches(dynmb.data.load_trace("longtail"))
    for each, expect in zip(choice.candidates, choice.steps_s):     # independently planned at each V
        fixed = dynmb.Planner(model=LLAMA2, num_stages=P * each, virtual=each, memory_limit="80GiB",
                              cost_model=GPUCostModel(LLAMA2, P * each), oversize="split", schedule="auto")
        got = np.mean([fixed.plan(b).plan.predictions["pred_step_s"] for b in batches])
        assert got == pytest.approx(expect)


def test_short_chats_take_zb_v_at_two_chunks_per_gpu() -> None:
    """sharegpt at P 8 (no slices may run): V 2 is weighed with ZB-V's V placement (``auto_kinds``), a few %
    ahead of V 1's kinds (with interleaved V 2 was behind V 1 here); V 4 (interleaved) is the slowest."""
    planner = _planner("sharegpt")
    choice = planner.virtual_choice
    assert choice.how == "simulated" and choice.virtual == 2 and len(choice.candidates) == 3
    assert choice.scores_s[1] == min(choice.scores_s) and choice.scores_s[2] == max(choice.scores_s)
    assert planner.virtual == 2 and planner.num_stages == 2 * P and planner.cost_model.num_stages == 2 * P
    step = planner.plan(np.asarray(dynmb.data.sample_batch(dynmb.data.load_trace("sharegpt"), 16, 1, step=0)))
    assert step.schedule.kind == "zb-v"


def test_the_choice_is_deterministic() -> None:
    a, b = _planner("longtail").virtual_choice, _planner("longtail").virtual_choice
    assert a.virtual == b.virtual and a.steps_s == b.steps_s and a.tokens == b.tokens


def test_a_tie_keeps_one_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """V 1 unless another V is strictly better per real token (a shorter step on fewer tokens loses), and never
    a V that trains fewer of the batches' tokens (more truncated), even at a better step per token."""
    for other, expect in (((1.0, 100.0), 1), ((0.98, 95.0), 1), ((0.98, 100.0), 2), ((0.5, 99.0), 1),
                          ((0.9, 100.5), 2)):
        monkeypatch.setattr(SplitSearch, "layout_step", lambda self, layout, n, cm, b, o=other:
                            (1.0, 100.0) if self.spec.virtual == 1 else o)
        search = VirtualSearch(SplitSearch(spec=_planner("longtail", virtual=1).spec, global_batch=GLOBAL))
        choice = search.choose(LLAMA2, lambda v, s: LLAMA2, candidates=(1, 2), workload="longtail",
                               cost_model=GPUCostModel(LLAMA2, P))
        assert choice.virtual == expect


def test_admissible_chunks_follow_the_layers_and_split() -> None:
    assert admissible(32, 8, "even") == (1, 2, 4)
    assert admissible(32, 16, "even") == (1, 2)                    # 64 chunks > 32 whole layers
    assert admissible(32, 16, "auto") == (1, 2, 4)                 # 64 half-blocks
    assert admissible(32, 16, "auto", half_blocks=False) == (1, 2)  # a model of one's own: whole layers
    assert admissible(32, 8, "8,8,8,8,0,0,0,0") == (1,)            # an explicit list fixes the chunks
    assert admissible(32, 8, "even", carried_split=True) == (1,)


def test_without_what_a_plan_needs_v1_is_said_once(caplog: pytest.LogCaptureFixture,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(virtual_search, "_SAID", set())
    with caplog.at_level(logging.INFO, logger="dynmb.planning.virtual_search"):
        for _ in range(2):
            planner = _planner("longtail", global_batch=None)
            assert planner.virtual == 1 and planner.num_stages == P and planner.virtual_choice.how == "default"
    said = [r.getMessage() for r in caplog.records if "1 chunk per GPU" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0] and "global batch" in said[0] and "global_batch=" in said[0]
    cases = {"layout-free": dict(cost_model=None), "no workload": dict(workload=None),
             "schedule 1f1b": dict(schedule="1f1b")}
    for words, kw in cases.items():
        planner = _planner("longtail", **kw)
        assert planner.virtual == 1 and planner.num_stages == P and words in planner.virtual_choice.reason


def test_each_v_plans_its_own_split_search() -> None:
    """``stage_split="auto"``: each V's layout is the split search's choice for ``P V`` chunks at that V's
    settings; the Planner keeps the chosen V's split, its cost model rebuilt for it."""
    p = 4
    planner = _planner("longtail", num_stages=p, cost_model=GPUCostModel(LLAMA2, p), stage_split="auto",
                       global_batch=16)
    choice = planner.virtual_choice
    assert choice.how == "simulated" and choice.candidates == (1, 2, 4)
    v = choice.virtual
    spec = _planner("longtail", num_stages=p, virtual=1, cost_model=GPUCostModel(LLAMA2, p)).spec
    search = VirtualSearch(SplitSearch(spec=spec, global_batch=16))
    own = resolve_stage_split(LLAMA2, p * v, "auto", workload="longtail", cost_model=GPUCostModel(LLAMA2, p),
                              search=search.for_virtual(v), virtual=v)
    assert planner.model_cfg.layer_split == own.layer_split is not None and planner.num_stages == p * v
    assert planner.cost_model.model_cfg.layer_split == own.layer_split and planner.cost_model.num_stages == p * v


def test_each_v_is_sized_with_the_embedding_where_it_runs() -> None:
    """``embedding="last"``: each V's sample plans hold the embedding's states on the last rank, as the Planner
    plans at that V (Llama-3.1-8B, P 8, 24 GiB, where its 128k-row table on stage 0 sets how much stage 0 admits).
    On the old code (memory sized with the table first) V 1 scored 0.1522 s against 0.1539 s planned, V 2 0.112 s
    against 0.059 s."""
    cfg, lim, spec_kw = dynmb.model_config("llama3.1-8b"), "24GiB", dict(oversize="truncate", schedule="interleaved",
                                                                         embedding="last")
    spec = dynmb.Planner(model=cfg, num_stages=P, memory_limit=lim, cost_model=GPUCostModel(cfg, P), **spec_kw).spec
    search = SplitSearch(spec=spec, global_batch=32)
    choice = VirtualSearch(search).choose(cfg, lambda v, s: cfg, candidates=(1, 2), workload="sharegpt",
                                          cost_model=GPUCostModel(cfg, P))
    batches = search.sample_batches(dynmb.data.load_trace("sharegpt"))
    for v, expect, tokens in zip(choice.candidates, choice.steps_s, choice.tokens):
        fixed = dynmb.Planner(model=cfg, num_stages=P * v, virtual=v, memory_limit=lim,
                              cost_model=GPUCostModel(cfg, P * v), **spec_kw)
        steps = [fixed.plan(b) for b in batches]
        assert np.mean([s.plan.predictions["pred_step_s"] for s in steps]) == pytest.approx(expect, rel=1e-12)
        assert np.mean([s.plan.real_tokens for s in steps]) == pytest.approx(tokens)
