"""``--stage-split auto`` by simulated step (``dynmb.planning.split_search``): among the near-optimal splits
the min-max one unless another's simulated ``dynamic`` step per token on sample batches is faster on every
batch by more than the noise (``pick_layout``), the same on every call, and the min-max split where no plan
can be made."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest

import dynmb
from dynmb.cli.flags import model_from_args
from dynmb.cli.main import build_parser
from dynmb.costmodel.gpu import GPUCostModel
from dynmb.planning import stage_split
from dynmb.planning.split_search import MIN_GAIN, SplitSearch, near_optimal_splits, pick_layout
from dynmb.planning.split_work import workload_cost
from dynmb.planning.stage_split import balanced_split, resolve_stage_split, stage_work

LLAMA2 = replace(dynmb.model_config("llama2-7b"), max_seq_len=21504)
P, GLOBAL = 8, 64
# a long-tailed trace at P 8: the min-max split (4 x 6, 4.5, 3.5) puts the 2.5-layer-plus stage next to the head's
TRACE = "longtail"


def _planner(**kw) -> dynmb.Planner:
    return dynmb.Planner(model=LLAMA2, num_stages=P, memory_limit="80GiB", cost_model=GPUCostModel(LLAMA2, P),
                         stage_split="auto", workload=TRACE, oversize="truncate", **kw)


def _search() -> SplitSearch:
    return SplitSearch(spec=_planner().spec, global_batch=GLOBAL)


def _min_max() -> tuple[float, ...]:
    return balanced_split(LLAMA2, P, half_blocks=True, stage_cost=workload_cost(TRACE, LLAMA2, GPUCostModel(LLAMA2, P)))


def _mean_step(split: tuple[float, ...], batches: list[np.ndarray]) -> tuple[float, float]:
    """The split's (mean simulated step, mean real tokens) on ``batches``, planned by a Planner given the
    split explicitly."""
    planner = dynmb.Planner(model=LLAMA2, num_stages=P, memory_limit="80GiB", cost_model=GPUCostModel(LLAMA2, P),
                            stage_split=",".join(f"{n:g}" for n in split), oversize="truncate")
    plans = [planner.plan(b).plan for b in batches]
    return float(np.mean([p.predictions["pred_step_s"] for p in plans])), float(np.mean([p.real_tokens for p in plans]))


def test_candidates_are_near_optimal_arrangements_min_max_first() -> None:
    cost = workload_cost(TRACE, LLAMA2, GPUCostModel(LLAMA2, P))
    cands, near = near_optimal_splits(LLAMA2, P, cost, tolerance=0.02, max_candidates=6)
    assert cands[0] == _min_max() and len(cands) == len(set(cands)) <= 6 and near >= len(cands)
    best = max(stage_work(LLAMA2, cands[0], stage_cost=cost))
    for c in cands:
        assert sum(c) == LLAMA2.n_layers and len(c) == P
        assert max(stage_work(LLAMA2, c, stage_cost=cost)) <= best * 1.02 * (1 + 1e-9)
    assert near_optimal_splits(LLAMA2, P, cost, tolerance=0.02, max_candidates=1)[0] == [cands[0]]


@pytest.mark.slow
def test_auto_keeps_the_min_max_split_against_a_win_within_the_noise() -> None:
    """Here the rival of the smallest mean step per token on the two sample batches (what the strictly-smaller
    rule took) wins only within the noise: the Planner given a global batch size keeps the min-max split, by the
    rule the scores call for (faster on one batch and slower on the other: "not on every"; faster on both by less
    than the margin: "not over the margin", which this case gives since the lean Llama blocks changed the
    plans' memory); the scores are those of plans of each split made independently (an explicit --stage-split)."""
    planner = _planner(global_batch=GLOBAL)
    s0 = _min_max()
    assert tuple(planner.model_cfg.stage_layer_counts(P)) == s0
    assert planner.cost_model.model_cfg.layer_split == planner.model_cfg.layer_split    # the model follows
    search = _search()
    choice = search.choose(LLAMA2, P, workload_cost(TRACE, LLAMA2, GPUCostModel(LLAMA2, P)), workload=TRACE,
                           cost_model=GPUCostModel(LLAMA2, P))
    assert choice.how == "simulated" and choice.split == s0 == choice.candidates[0]
    best = int(np.argmin(choice.scores_s))
    assert best != 0 and choice.scores_s[best] < choice.scores_s[0] == pytest.approx(choice.steps_s[0])
    gains = [1 - a / b for a, b in zip(choice.batch_scores[best], choice.batch_scores[0])]
    if "not on every" in choice.rule:
        assert min(gains) < 0 < max(gains)
    else:
        assert "not over the margin" in choice.rule and 0 < float(np.mean(gains)) < MIN_GAIN
    batches = search.sample_batches(np.asarray(dynmb.data.load_trace(TRACE)))
    for i in (0, best):
        step, tokens = _mean_step(choice.candidates[i], batches)
        assert step == pytest.approx(choice.steps_s[i]) and tokens == pytest.approx(choice.tokens[i])


def test_the_choice_is_by_throughput_not_by_a_step_that_trains_fewer_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``oversize="truncate"`` a split can shorten its step by truncating more: the score is the step
    per real token, so a candidate whose step is shorter only because it trains fewer tokens loses."""
    s0, cost, cm = _min_max(), workload_cost(TRACE, LLAMA2, GPUCostModel(LLAMA2, P)), GPUCostModel(LLAMA2, P)
    for other, expect_s0 in (((0.98, 95.0), True), ((0.98, 100.0), False)):   # 2% shorter step, 5% fewer tokens
        monkeypatch.setattr(SplitSearch, "runs_of", lambda self, cfg, split, p, m, b, o=other:
                            ((1.0,) * len(b), (100.0,) * len(b)) if tuple(split) == s0
                            else ((o[0],) * len(b), (o[1],) * len(b)))
        choice = _search().choose(LLAMA2, P, cost, workload=TRACE, cost_model=cm)
        assert len(choice.candidates) > 1 and (choice.split == s0) == expect_s0


def test_the_choice_is_deterministic() -> None:
    a, b = _planner(global_batch=GLOBAL), _planner(global_batch=GLOBAL)
    assert a.model_cfg.layer_split == b.model_cfg.layer_split
    cost = workload_cost(TRACE, LLAMA2, GPUCostModel(LLAMA2, P))
    runs = [_search().choose(LLAMA2, P, cost, workload=TRACE, cost_model=GPUCostModel(LLAMA2, P)) for _ in range(2)]
    assert runs[0].split == runs[1].split and runs[0].steps_s == runs[1].steps_s


def test_without_what_a_plan_needs_auto_keeps_the_min_max_split(caplog: pytest.LogCaptureFixture,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stage_split, "_CHOICE_SAID", set())
    s0 = _min_max()
    assert tuple(_planner().model_cfg.stage_layer_counts(P)) == s0          # no global batch size
    with caplog.at_level(logging.INFO, logger="dynmb.planning.stage_split"):
        for _ in range(2):      # FLOPs work model (no layout-free cost model): today's split, said once
            out = resolve_stage_split(LLAMA2, P, "auto", workload=TRACE, search=_search())
            assert out.layer_split == resolve_stage_split(LLAMA2, P, "auto", workload=TRACE).layer_split
    said = [r.getMessage() for r in caplog.records if "min-max split, not chosen" in r.getMessage()]
    assert len(said) == 1 and "layout-free" in said[0]
    fitted = SplitSearch(spec=_planner().spec, global_batch=GLOBAL, memory_model="fitted.json")
    assert fitted.choose(LLAMA2, P, workload_cost(TRACE, LLAMA2, None), workload=TRACE,
                         cost_model=GPUCostModel(LLAMA2, P)).how == "min-max"


@pytest.mark.slow
def test_the_command_line_chooses_as_the_planner(tmp_path) -> None:
    path = tmp_path / "gpu.json"
    GPUCostModel(LLAMA2, P).save(path)
    args = build_parser().parse_args(["plan", "--model", "llama2-7b:max_seq_len=21504", "--stages", str(P),
                                      "--stage-split", "auto", "--dataset", TRACE, "--cost-model", str(path),
                                      "--global-batch", str(GLOBAL), "--memory-limit", "80GiB",
                                      "--oversize", "truncate", "--schedule-kind", "1f1b"])
    search = SplitSearch(spec=_planner().spec.with_(reorder="none"), global_batch=GLOBAL)   # dynmb plan's order
    choice = search.choose(LLAMA2, P, workload_cost(TRACE, LLAMA2, GPUCostModel(LLAMA2, P)), workload=TRACE,
                           cost_model=GPUCostModel(LLAMA2, P))
    assert choice.how == "simulated" and model_from_args(args).layer_split == choice.split


def test_a_chunked_optimum_offers_its_arrangements_and_neighbours() -> None:
    """Long documents: the min-max split is cut in chunks (nearly even); the candidates are arrangements of its
    sizes and, where those are fewer than the places, the sizes one chunk (1/16 layer) move away."""
    from dynmb.planning.split_search import _moves, _units

    cost = workload_cost("wikitext2", LLAMA2, GPUCostModel(LLAMA2, P))
    cands, _ = near_optimal_splits(LLAMA2, P, cost, tolerance=0.02, max_candidates=4)
    own = tuple(sorted(_units(cands[0])))
    assert replace(LLAMA2, layer_split=cands[0]).chunk_split and len(cands) == 4
    assert all(tuple(sorted(_units(c))) in _moves(own, 1) | {own} for c in cands[1:])


def test_compare_chooses_as_the_planner(tmp_path) -> None:
    from dynmb.jobs.compare import CompareSettings

    path = tmp_path / "gpu.json"
    GPUCostModel(LLAMA2, P).save(path)
    settings = CompareSettings(model="llama2-7b:max_seq_len=21504", stages=P, stage_split="auto", dataset=TRACE,
                               cost_model=str(path), global_batch=GLOBAL, memory_limit="80GiB", oversize="truncate")
    assert settings.model_config().layer_split == _planner(global_batch=GLOBAL).model_cfg.layer_split


def test_a_win_within_the_sample_noise_keeps_the_min_max_split() -> None:
    """``pick_layout`` (per candidate and sample batch, step per real token; candidate 0 the min-max split):
    a candidate faster on one batch and slower on another, or faster on every batch by less than the floor or
    than its batches' spread, leaves the min-max split; one faster on every batch, clearly, is taken."""
    s0 = [1.0, 1.0, 1.0, 1.0]
    one_batch = [0.90, 1.01, 0.99, 0.99]                          # -2.75% on average, but slower on batch 1
    assert pick_layout([s0, one_batch]).index == 0
    tiny = [1 - MIN_GAIN / 2] * 4                                  # every batch, under the floor
    assert pick_layout([s0, tiny]).index == 0
    spread = [0.999, 0.999, 0.999, 0.90]                          # every batch, mean 2.6%, 2 std errors 5%
    assert pick_layout([s0, spread]).index == 0
    clear, clearer = [0.97, 0.975, 0.98, 0.97], [0.96, 0.965, 0.96, 0.962]
    pick = pick_layout([s0, one_batch, clear, clearer])
    assert pick.index == 3 and pick.gain > pick.margin >= MIN_GAIN and "every sample batch" in pick.rule
    assert pick_layout([s0, [float("inf")] * 4, clear]).index == 2          # a candidate that cannot plan drops out
    assert pick_layout([[float("inf"), 1.0], [0.9, 0.9], [0.8, 0.8]]).index == 2   # S0 cannot plan: smallest mean
    assert pick_layout([s0]).index == 0
    assert pick_layout([[2.0, 1.0], [1.96, 0.98]]).index == 1      # the gain is relative to each batch's own S0


def test_the_choice_keeps_min_max_when_the_samples_disagree(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through ``choose``: a candidate 5% faster on average but slower on one sample batch is not taken (the
    strictly-smaller-mean rule took it); 3% faster on both, it is."""
    s0, cost, cm = _min_max(), workload_cost(TRACE, LLAMA2, GPUCostModel(LLAMA2, P)), GPUCostModel(LLAMA2, P)
    for other, expect_s0 in (((0.88, 1.02), True), ((0.97, 0.97), False)):
        monkeypatch.setattr(SplitSearch, "runs_of", lambda self, cfg, split, p, m, b, o=other:
                            ((1.0, 1.0) if tuple(split) == s0 else o, (100.0, 100.0)))
        choice = _search().choose(LLAMA2, P, cost, workload=TRACE, cost_model=cm)
        assert len(choice.candidates) > 1 and (choice.split == s0) == expect_s0
        assert len(choice.batch_scores) == len(choice.candidates) and choice.rule
