"""``--stage-split auto`` by simulated step: among the near-optimal layer splits, the fastest one.

``stage_split.balanced_split`` returns the min-max split of the stages' work (ties: smallest sum of
squares). The step of a pipeline is not its busiest stage's work alone: 1F1B's warm-up windows (stage
i holds P - i microbatches), fill and drain, and the zero-bubble kinds make *where* an uneven stage sits
matter, which min-max cannot see (docs/results.md "`--stage-split auto` balances the workload's own work":
the same stage sizes with the 2.5-layer stage elsewhere simulated up to 4.8% faster, or 2.5% slower).

Algorithm (``SplitSearch.choose``), run once per run, deterministic (every rank computes the same):

1. **Candidates** (``near_optimal_splits``): the min-max split ``S0`` first; then every arrangement of
   the stage sizes of ``S0``, of the whole-layer min-max split and of the half-block one
   (``stage_split.min_max_split``; sizes in 1/16 layer, boundaries on the grain of ``S0``: chunks where ``S0``
   is cut inside a half-block, else half-blocks, whole layers only for a model of the user's own)
   whose busiest stage's work is within ``tolerance`` of the min-max optimum (a depth-first walk over the
   multiset of sizes, a stage dropped as soon as its work passes the bound; at most ``ENUMERATE_LIMIT``
   arrangements). Arbitrary segmentations are not enumerated: where the busiest stage is the head's,
   millions of them keep the bound (most with very uneven stages), while arrangements of the optimum's own
   sizes are the near-ties that matter. Of the arrangements (sorted by their sizes, as tuples)
   ``max_candidates - 1`` evenly spaced ones are kept, so the uneven stages' positions spread over the
   pipeline; where they are fewer, the free places go (evenly spaced again) to the arrangements within the
   bound of the sizes one move away (one stage gives a chunk, a half-block or a layer, by that grain, to
   another: the even split's neighbours 4.5, 3.5, 4, ... among them).
2. **Choice**: ``batches`` sample batches drawn from the workload (``dynmb.data.sample_batch``, stream
   ``seed``, steps 0, 1, ...), each one replica's share of the global batch (``global_batch / dp``
   sequences) planned at ``dp = 1`` with the run's other settings (``PlanSpec``: memory limit, schedule
   kind ``auto`` included, round-to, oversize, recompute, virtual) and the ``dynamic`` method through
   ``planner.plan_step`` (pack, reorder, schedule, simulate), the cost model rebuilt for each candidate
   (``CostModel.for_layout``) and the analytic memory model of each split. Each candidate is scored per
   sample batch by throughput: its simulated step per real token (``score``: the step scaled to ``S0``'s
   real tokens on that batch), not its step, since with ``oversize="truncate"`` a split whose stages hold
   more activations truncates long sequences sooner and trains fewer tokens in a shorter step (Llama-3.1-8B
   longtail P16: -4.2% step, -2.5% tokens). A candidate that cannot plan a batch drops out.
3. **Keep ``S0`` unless the win is larger than the sample noise** (``pick_layout``): a candidate's gain on
   batch ``b`` is ``1 - score / S0's score`` (paired: the same batch); it may replace ``S0`` only if it gains
   on *every* sample batch and its mean gain exceeds ``max(MIN_GAIN, NOISE_SE x`` the standard error of its
   gains ``)``; of those, the largest mean gain wins (ties: the earlier candidate), else ``S0``. The sample
   is one replica's share planned at dp 1, the measured step the slowest of dp replicas of another batch:
   near-ties on the sample are noise on the run (docs/results.md, "The split search keeps the min-max layout
   unless the win exceeds the noise"). The rule that decided is in ``SplitChoice.rule`` (logged). Where
   ``S0`` itself cannot plan a sample batch, the smallest mean score of the candidates that plan them all.

With ``virtual`` > 1 (interleaved chunks, chunk ``s`` on GPU ``s % P``) the bound is the busiest GPU's
total work, not a chunk's, and the candidates are the split balanced per GPU (``S0``,
``dynmb.planning.gpu_split``) and the per-chunk min-max split when it differs (the arrangements of step 1
are not walked per GPU).

Only where a plan can be made: a layout-free cost model (``CostModel.layout_free``: ``analytic``,
``gpu``), the workload's lengths, and no fitted memory model (one split only); otherwise ``S0``, said once
(``logging``). Its cost: ``max_candidates x batches`` plannings of one replica's batch (CPU seconds logged);
one replica's share rather than the whole global batch bounds it (the packers' replica balancing and the
other replicas' reorder searches multiply the planning time by about ``dp``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from dynmb.core.config import ModelConfig
from dynmb.costmodel.loader import Models
from dynmb.memory.model import get_memory_model
from dynmb.core.model_sizes import UNITS_PER_LAYER
from dynmb.core.planspec import PlanSpec

from dynmb.planning.planner import plan_step
from dynmb.planning.split_units import CHUNK, HALF, LAYER, as_layers, fine_grid
from dynmb.planning.split_work import layout_cost_model, workload_lengths
from dynmb.planning.stage_split import StageCost, balanced_split, min_max_split, with_split

__all__ = ["SplitSearch", "SplitChoice", "Pick", "pick_layout", "batch_scores", "sample_runs", "near_optimal_splits",
           "ENUMERATE_LIMIT", "MIN_GAIN", "NOISE_SE"]

logger = logging.getLogger(__name__)

ENUMERATE_LIMIT = 20000
"""Arrangements of the stage sizes walked at most (the walk stops there; deterministic)."""

MIN_GAIN = 0.01
"""The smallest mean gain per real token (1%) on the sample batches for which a candidate replaces the
min-max split: one replica's share planned at dp 1 is not the slowest of dp replicas of the run's batch, and
a layout's gain moves by about 1% from one sample batch to the next (Llama-2-7B sharegpt P 4, 4M tokens: the
layout chosen on +0.65 / +0.94% gained +1.53 / -1.03% on the next two draws and ran 0.9% slower than the
min-max one on the cell's own batch; docs/results.md, "The split search keeps the min-max layout ...")."""

NOISE_SE = 2.0
"""The mean gain must also exceed this many standard errors of the per-batch gains (paired against ``S0``):
a gain that varies as much as it is large from batch to batch is the batches', not the layout's."""

Split = tuple[float, ...]


@dataclass(frozen=True)
class Pick:
    """``pick_layout``'s answer: the candidate's ``index`` (0: ``S0``), the ``rule`` that decided (words), its
    mean paired ``gain`` over ``S0`` and the ``margin`` it had to exceed (fractions)."""

    index: int
    rule: str
    gain: float = 0.0
    margin: float = 0.0


def pick_layout(scores: list[list[float]] | np.ndarray, *, min_gain: float = MIN_GAIN,
                noise_se: float = NOISE_SE) -> Pick:
    """Step 3 of the module docstring: ``scores[i][b]`` is candidate ``i``'s step per real token on sample
    batch ``b`` (candidate 0 the min-max split ``S0``; inf: cannot plan). ``S0`` unless a candidate gains on
    every batch and on average by more than ``max(min_gain, noise_se x`` the standard error of its gains``)``."""
    x = np.asarray(scores, dtype=float)
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError("pick_layout: scores must be candidates x sample batches")
    ok = np.isfinite(x).all(axis=1)
    if not ok[0]:                                   # S0 cannot plan a batch: no pairing, the smallest mean
        if not ok.any():
            return Pick(0, "no candidate plans every sample batch: the min-max split")
        means = np.where(ok, np.where(ok[:, None], x, 0.0).mean(axis=1), np.inf)
        i = int(np.argmin(means))
        return Pick(i, "the min-max split cannot plan a sample batch: the smallest mean step per token")
    best, best_gain, margin_of_best = 0, 0.0, 0.0
    closest = None                                  # the best candidate that fell short, for the log
    for i in range(1, x.shape[0]):
        if not ok[i]:
            continue
        gains = 1.0 - x[i] / x[0]
        gain = float(gains.mean())
        se = float(gains.std(ddof=1) / np.sqrt(gains.size)) if gains.size > 1 else 0.0
        margin = max(float(min_gain), float(noise_se) * se)
        if bool((gains > 0).all()) and gain > margin:
            if gain > best_gain:
                best, best_gain, margin_of_best = i, gain, margin
        elif closest is None or gain > closest[1]:
            closest = (i, gain, margin, bool((gains > 0).all()))
    if best:
        return Pick(best, f"candidate {best} gains {best_gain:+.2%} on every sample batch, over the margin "
                          f"{margin_of_best:.2%}", best_gain, margin_of_best)
    if closest is None:
        return Pick(0, "the min-max split: no other candidate plans every sample batch")
    i, gain, margin, every = closest
    why = f"gains {gain:+.2%}, not over the margin {margin:.2%}" if every else \
        f"gains {gain:+.2%} on average but not on every sample batch"
    return Pick(0, f"the min-max split kept: its best rival (candidate {i}) {why}", gain, margin)


def _units(split: Split) -> tuple[int, ...]:
    """Layers per stage in units of 1/16 layer (``dynmb.core.model_sizes``)."""
    return tuple(int(round(UNITS_PER_LAYER * n)) for n in split)


def _arrangements(sizes: tuple[int, ...], work: np.ndarray, first: float, last: float, bound: float,
                  cuts: np.ndarray, limit: int) -> list[tuple[int, ...]]:
    """Every order of the multiset ``sizes`` (1/16-layer units per stage) whose stages' work (``work`` per
    unit, ``first`` / ``last`` added at the ends) stays within ``bound`` and whose boundaries are all allowed
    (``cuts``: per boundary on the 1/16 grid); depth-first, sizes in ascending order at each step, at most
    ``limit``."""
    prefix = np.concatenate([[0.0], np.cumsum(work)])
    p = len(sizes)
    values = sorted(set(sizes))
    left = {v: sizes.count(v) for v in values}
    out: list[tuple[int, ...]] = []
    path: list[int] = []

    def walk(start: int) -> None:
        if len(out) >= limit:
            return
        if len(path) == p:
            out.append(tuple(path))
            return
        for v in values:
            if not left[v] or (v == 0 and len(path) != p - 1):      # only the last stage may hold the head alone
                continue
            end = start + v
            if not cuts[end]:
                continue
            cost = prefix[end] - prefix[start] + (first if start == 0 else 0.0) + (last if len(path) == p - 1 else 0.0)
            if cost > bound:
                continue
            left[v] -= 1
            path.append(v)
            walk(end)
            path.pop()
            left[v] += 1

    walk(0)
    return out


def _moves(sizes: tuple[int, ...], step: int) -> set[tuple[int, ...]]:
    """The multisets (sorted) ``sizes`` becomes when one stage gives ``step`` units to another."""
    out = set()
    for i in range(len(sizes)):
        for j in range(len(sizes)):
            if i != j and sizes[j] > step:
                m = list(sizes)
                m[i], m[j] = m[i] + step, m[j] - step
                out.add(tuple(sorted(m)))
    return out


def near_optimal_splits(cfg: ModelConfig, num_stages: int, stage_cost: StageCost, *, half_blocks: bool = True,
                        tolerance: float = 0.02, max_candidates: int = 8, virtual: int = 1) -> tuple[list[Split], int]:
    """(candidate splits, the min-max split ``balanced_split`` first; how many arrangements walked kept the
    bound): step 1 of the module docstring; ``virtual`` > 1: the split balanced per GPU, then the per-chunk
    min-max one when it differs."""
    p = int(num_stages)
    if int(virtual) > 1:
        per_gpu = balanced_split(cfg, p, half_blocks=half_blocks, stage_cost=stage_cost, virtual=int(virtual))
        per_chunk = balanced_split(cfg, p, half_blocks=half_blocks, stage_cost=stage_cost)
        cands = [per_gpu] + ([per_chunk] if _units(per_chunk) != _units(per_gpu) else [])
        return cands[:max(1, int(max_candidates))], len(cands)
    s0 = balanced_split(cfg, p, half_blocks=half_blocks, stage_cost=stage_cost)
    chunked = any(int(u) % HALF for u in np.cumsum(_units(s0)))
    work, first, last, cuts = fine_grid(cfg, stage_cost, CHUNK if chunked else HALF if half_blocks else LAYER)
    pre = np.concatenate([[0.0], np.cumsum(work)])

    def busiest(units: tuple[int, ...]) -> float:
        ends = np.cumsum(units)
        w = pre[ends] - pre[np.concatenate([[0], ends[:-1]])]
        w[0] += first
        w[-1] += last
        return float(w.max())

    seeds = {_units(s0)}
    if p <= cfg.n_layers:
        seeds.add(_units(balanced_split(cfg, p, half_blocks=False, stage_cost=stage_cost)))
    if half_blocks and p <= 2 * cfg.n_layers:
        seeds.add(_units(min_max_split(cfg, p, stage_cost, half_blocks=True)))
    opt = min(busiest(s) for s in seeds)
    bound = opt * (1.0 + float(tolerance)) * (1 + 1e-12)
    step = CHUNK if chunked else HALF if half_blocks else LAYER
    near = {tuple(sorted(m)) for m in seeds}
    moved = {mv for m in near for mv in _moves(m, step)} - near
    k, total = max(0, int(max_candidates) - 1), 0
    kept: list[tuple[int, ...]] = []
    for tier in (near, moved):                          # the optimum's own sizes first, then one unit moved
        if tier is moved and len(kept) >= k:
            break
        found: set[tuple[int, ...]] = set()
        for sizes in sorted(tier):
            found.update(_arrangements(sizes, work, first, last, bound, cuts, ENUMERATE_LIMIT))
        total += len(found | ({_units(s0)} if tier is near else set()))
        others = sorted(found - {_units(s0)} - set(kept))
        room = k - len(kept)
        if len(others) > room:
            others = [others[int(i)] for i in np.unique(np.linspace(0, len(others) - 1, room).round().astype(int))] \
                if room > 0 else []
        kept += others
    return [s0, *(as_layers(u) for u in kept)], total


@dataclass(frozen=True)
class SplitChoice:
    """What ``SplitSearch.choose`` did: the split, how (``"simulated"`` or ``"min-max"``: why in ``reason``),
    the candidates, their mean simulated steps and real tokens, their ``scores_s`` (mean over the sample
    batches of the step scaled to the min-max split's real tokens; inf: could not plan), the per-batch
    scores (``batch_scores``, candidates x batches), the ``rule`` that decided (``pick_layout``) and its CPU
    seconds."""

    split: Split
    how: str
    reason: str = ""
    candidates: tuple[Split, ...] = ()
    steps_s: tuple[float, ...] = ()
    tokens: tuple[float, ...] = ()
    scores_s: tuple[float, ...] = ()
    near_optimal: int = 0
    cpu_s: float = 0.0
    batch_scores: tuple[tuple[float, ...], ...] = ()
    rule: str = ""


@dataclass(frozen=True)
class SplitSearch:
    """The settings of the choice by simulated step (module docstring). ``spec``: the run's planning
    settings (its method, dp and mbs are replaced); ``global_batch``: sequences per global batch;
    ``memory_model``: None (the analytic model, rebuilt per split) or a fitted one (no search)."""

    spec: PlanSpec
    global_batch: int
    batches: int = 2
    seed: int = 0
    tolerance: float = 0.02
    max_candidates: int = 8
    memory_model: Any = None

    @classmethod
    def of(cls, spec_fields: dict[str, Any], global_batch: int, *, seed: int = 0,
           memory_model: Any = None) -> "SplitSearch | None":
        """The search of ``dynamic`` under the ``PlanSpec`` fields of a run (``auto`` reorder kept: ``plan_step``
        maps it to dynamic's own, or none for a plan with slices); None where they cannot make a plan (the run
        refuses them later)."""
        fields = {**spec_fields, "method": "dynamic", "reorder": spec_fields.get("reorder", "auto")}
        try:
            spec = PlanSpec(**fields)
        except ValueError:
            return None
        return cls(spec=spec, global_batch=int(global_batch), seed=int(seed), memory_model=memory_model)

    def sample_batches(self, lengths: np.ndarray) -> list[np.ndarray]:
        """The sample batches: ``batches`` draws of one replica's share of the global batch."""
        from dynmb.data import sample_batch

        size = max(1, -(-int(self.global_batch) // max(1, int(self.spec.dp))))
        return [sample_batch(lengths.astype(np.int64), size, int(self.seed), step=k) for k in range(int(self.batches))]

    def why_not(self, cost_model: Any, workload: Any) -> str:
        """Why no plan can be made (empty: it can)."""
        if workload is None:
            return "no workload given"
        if layout_cost_model(cost_model) is None:
            return "the cost model does not price other splits (give a layout-free one: analytic, gpu)"
        if self.memory_model is not None:
            return "a fitted memory model measured one split"
        if int(self.global_batch) < 1 or int(self.batches) < 1:
            return "no global batch size"
        return ""

    def runs_of(self, cfg: ModelConfig, split: Split, num_stages: int, cm: Any,
                batches: list[np.ndarray]) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(simulated steps, real tokens), one each per batch, of ``dynamic`` under ``split``; inf steps and 0
        tokens when a batch cannot be planned."""
        return self.layout_runs(with_split(cfg, num_stages, split), num_stages, cm, batches)

    def layout_step(self, layout: ModelConfig, num_stages: int, cm: Any,
                    batches: list[np.ndarray]) -> tuple[float, float]:
        """(mean simulated step, mean real tokens) of ``layout_runs``; (inf, 0) when a batch cannot be planned."""
        return _means(self.layout_runs(layout, num_stages, cm, batches))

    def layout_runs(self, layout: ModelConfig, num_stages: int, cm: Any,
                    batches: list[np.ndarray]) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """``runs_of`` for a whole layout (its ``layer_split`` and ``head_split``)."""
        priced = cm.for_layout(cm.model_cfg.with_layout_of(layout), num_stages)
        spec = self.spec.with_(method="dynamic", dp=1, mbs=None)
        models = Models(priced, get_memory_model(None, layout, num_stages))   # plan_step applies spec's views
        return sample_runs(batches, spec, layout, models)

    def scores(self, layouts: list[ModelConfig], num_stages: int, *, workload: Any, cost_model: Any) -> list[float] | None:
        """Mean simulated step per real token of each layout on the sample batches (scaled to the first's
        tokens, as ``choose`` scores); None where no plan can be made (``why_not``)."""
        if self.why_not(cost_model, workload):
            return None
        cm = layout_cost_model(cost_model)
        batches = self.sample_batches(workload_lengths(workload, layouts[0]))
        runs = [self.layout_step(layout, num_stages, cm, batches) for layout in layouts]
        return [step * runs[0][1] / tok if tok > 0 else float("inf") for step, tok in runs]

    def choose(self, cfg: ModelConfig, num_stages: int, stage_cost: StageCost, *, half_blocks: bool = True,
               workload: Any = None, cost_model: Any = None, virtual: int | None = None) -> SplitChoice:
        """The split (module docstring): the min-max split unless a candidate's step per real token is smaller
        on every sample batch by more than the noise (``pick_layout``; ``virtual`` chunks a GPU, None: the
        spec's; more than one: balanced per GPU)."""
        t0 = time.process_time()
        v = int(self.spec.virtual if virtual is None else virtual)
        reason = self.why_not(cost_model, workload)
        if reason:
            s0 = balanced_split(cfg, num_stages, half_blocks=half_blocks, stage_cost=stage_cost, virtual=v)
            return SplitChoice(split=s0, how="min-max", reason=reason, cpu_s=time.process_time() - t0)
        cm = layout_cost_model(cost_model)
        cands, near = near_optimal_splits(cfg, num_stages, stage_cost, half_blocks=half_blocks,
                                          tolerance=self.tolerance, max_candidates=self.max_candidates, virtual=v)
        batches = self.sample_batches(workload_lengths(workload, cfg))
        runs = [self.runs_of(cfg, c, num_stages, cm, batches) for c in cands]
        per_batch = batch_scores(runs)
        pick = pick_layout(per_batch)
        means = [_means(r) for r in runs]
        return SplitChoice(split=cands[pick.index], how="simulated", candidates=tuple(cands),
                           steps_s=tuple(m[0] for m in means), tokens=tuple(m[1] for m in means),
                           scores_s=tuple(float(np.mean(row)) for row in per_batch), near_optimal=near,
                           cpu_s=time.process_time() - t0, batch_scores=tuple(map(tuple, per_batch)), rule=pick.rule)


def sample_runs(batches: list[np.ndarray], spec: PlanSpec, layout: ModelConfig,
                models: Models) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(simulated steps, real tokens), one each per batch, planned under ``spec`` (``dp`` 1: one replica's share),
    ``layout`` and ``models``; inf steps and 0 tokens when a batch cannot be planned (the layout searches' runs)."""
    steps, tokens = [], []
    for batch in batches:
        try:
            plan, _, _ = plan_step(batch, spec, model_cfg=layout, models=models)
        except ValueError:                          # PackingError: this layout cannot take the batch
            return (float("inf"),) * len(batches), (0.0,) * len(batches)
        steps.append(float(plan.predictions["pred_step_s"]))
        tokens.append(float(plan.real_tokens))
    return tuple(steps), tuple(tokens)


def _means(run: tuple[tuple[float, ...], tuple[float, ...]]) -> tuple[float, float]:
    """(mean step, mean real tokens) of per-batch runs; (inf, 0) where a batch could not be planned."""
    steps, tokens = run
    if not steps or not np.isfinite(steps).all():
        return float("inf"), 0.0
    return float(np.mean(steps)), float(np.mean(tokens))


def batch_scores(runs: list[tuple[tuple[float, ...], tuple[float, ...]]]) -> list[list[float]]:
    """Per candidate and sample batch, the simulated step per real token scaled to the first candidate's (the
    min-max split's) real tokens on that batch (where it could not plan: to one token); inf: cannot plan."""
    ref = [t if np.isfinite(s) and t > 0 else 1.0 for s, t in zip(*runs[0])]
    return [[s * r / t if np.isfinite(s) and t > 0 else float("inf") for s, t, r in zip(steps, tokens, ref)]
            for steps, tokens in runs]
