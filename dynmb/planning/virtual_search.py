"""``virtual="auto"``: the model chunks per GPU (V, interleaved stages) chosen once per run by simulated step.

V is a model layout (GPU ``g`` holds chunks ``g, g + P, ...``), so it cannot change per step the way
``--schedule auto`` changes the kind; it is chosen once per run, as ``--stage-split auto`` chooses the layer
split (``dynmb.planning.split_search``), whose machinery this reuses. Which V is fastest depends on the
workload: at 4M tokens, DP 8, Llama-2-7B, P 16, longtail runs faster at V 2 and sharegpt at V 1
(docs/results.md "Interleaved stages at realistic load").

Algorithm (``VirtualSearch.choose``), deterministic (every rank computes the same):

1. **Candidates** (``admissible``): V in ``CANDIDATES`` (1, 2, 4) whose ``P V`` chunks the layers cover:
   ``P V <= n_layers`` whole layers, or ``<= 2 n_layers`` half-blocks where the split setting is ``auto``
   for one of dynmb's families (``half_blocks``); V 1 always. An explicit layer list (or a split the model
   config carries under ``even``) fixes the chunks: V 1 only. V > 1 needs a kind with virtual stages:
   schedule ``auto`` (each V weighs its own ``auto_kinds(virtual=V)``: 1f1b, zb-h1, zb at V 1,
   interleaved above) or ``interleaved``; any other kind keeps V 1.
2. **Layout per V** (``layout_of(v, search)``, given by the caller): the run's stage-split setting resolved
   for ``P V`` chunks (``resolve_stage_split(..., virtual=v)``; ``auto`` with the split search of that V's
   settings; the scaling study passes its own min-max split).
3. **Choice**: the sample batches of ``SplitSearch.sample_batches`` (one replica's share of the global
   batch, drawn from the workload), each planned with ``dynamic`` at ``dp = 1`` under the run's settings
   with ``num_stages = P V, virtual = V`` (``SplitSearch.layout_step``: pack, reorder, schedule, simulate; the
   layout-free cost model rebuilt for the layout, the analytic memory model with the embedding's states where
   the spec's ``embedding`` runs it, as the Planner plans). The V of the smallest mean
   simulated step per real token wins (``score``: mean step scaled to V 1's mean real tokens, as
   ``split_search`` scores: with ``oversize="truncate"`` a layout that truncates more trains fewer tokens in
   a shorter step), V 1 unless another is strictly better. A V that cannot plan a batch drops out, and so
   does a V that trains fewer of the sample batches' tokens than V 1 (``TOKENS_KEPT``): more chunks a GPU
   hold more microbatches in flight, so the longest row that fits shrinks and ``--oversize truncate`` cuts
   more; a layout is not chosen for throughput bought by training less of the batch.

Only where a plan can be made (``SplitSearch.why_not``: a layout-free cost model, a workload, a global batch
size, no fitted memory model): else V 1, said once in one line naming what to give (``say``). Its cost: per
V, the split search of that V (``auto``) and ``batches`` plannings of one replica's batch (CPU s logged).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from dynmb.core.config import ModelConfig
from dynmb.schedule.kinds import AUTO, get_kind

from dynmb.planning.split_search import SplitSearch
from dynmb.planning.split_work import layout_cost_model, workload_lengths
from dynmb.planning.stage_split import resolve_stage_split

__all__ = ["CANDIDATES", "AUTO_VIRTUAL", "VirtualChoice", "VirtualSearch", "admissible", "choose_virtual", "describe",
           "say"]

logger = logging.getLogger(__name__)

CANDIDATES = (1, 2, 4)
"""The chunks per GPU ``auto`` weighs (where the layers allow them)."""
AUTO_VIRTUAL = "auto"
TOKENS_KEPT = 1.0 - 1e-9
"""A V is eligible only if its sample batches keep at least this share of V 1's real tokens (module doc)."""
ENABLE = ("give a layout-free cost model (analytic, gpu), the workload and the global batch size "
          "(Planner(cost_model=..., workload=..., global_batch=...))")
"""What the one-line refusal asks for."""
_SAID: set[str] = set()


def admissible(n_layers: int, gpus: int, split: str, *, half_blocks: bool = True,
               carried_split: bool = False) -> tuple[int, ...]:
    """The V of ``CANDIDATES`` whose ``gpus x V`` chunks the layers cover under the split setting ``split``
    (module docstring, step 1); ``carried_split``: the model config carries a layer split of its own."""
    split = str(split).strip()
    if split not in ("even", "auto") or (split == "even" and carried_split):
        return (1,)
    units = 2 * int(n_layers) if split == "auto" and half_blocks else int(n_layers)
    return tuple(v for v in CANDIDATES if v == 1 or int(gpus) * v <= units)


@dataclass(frozen=True)
class VirtualChoice:
    """What ``VirtualSearch.choose`` did: V, how (``"simulated"``, or ``"default"``: V 1, why in ``reason``),
    the candidates, their layouts (None where not resolved), mean simulated steps, mean real tokens, scores
    (mean step scaled to V 1's real tokens; inf: could not plan) and the CPU seconds."""

    virtual: int
    how: str
    reason: str = ""
    candidates: tuple[int, ...] = (1,)
    layouts: tuple[Any, ...] = (None,)
    steps_s: tuple[float, ...] = ()
    tokens: tuple[float, ...] = ()
    scores_s: tuple[float, ...] = ()
    cpu_s: float = 0.0

    @property
    def layout(self) -> ModelConfig | None:
        """The chosen V's resolved layout (None: not resolved, the caller resolves V 1's)."""
        return self.layouts[self.candidates.index(self.virtual)]


@dataclass(frozen=True)
class VirtualSearch:
    """The choice of V (module docstring). ``search``: the run's split search at V 1 (its spec's
    ``num_stages`` is the GPUs of one pipeline; its global batch, sample batches, seed, memory model)."""

    search: SplitSearch
    enable: str = ENABLE
    """What the one-line refusal asks for (the command line names its flags)."""

    @property
    def gpus(self) -> int:
        return int(self.search.spec.num_stages) // int(self.search.spec.virtual)

    def for_virtual(self, v: int) -> SplitSearch:
        """The split search of ``v`` chunks per GPU: the same settings over ``P v`` chunks."""
        return replace(self.search, spec=self.search.spec.with_(num_stages=self.gpus * int(v), virtual=int(v)))

    def why_not(self, cost_model: Any, workload: Any) -> str:
        """Why V cannot be chosen by simulation (empty: it can)."""
        kind = self.search.spec.schedule_kind
        if kind != AUTO and not get_kind(kind).virtual_stages:
            return f"schedule {kind} runs one chunk per GPU (give schedule auto or interleaved)"
        reason = self.search.why_not(cost_model, workload)
        return f"{reason}; to choose V, {self.enable}" if reason else ""

    def choose(self, cfg: ModelConfig, layout_of: Callable[[int, SplitSearch], ModelConfig], *,
               candidates: tuple[int, ...], workload: Any, cost_model: Any) -> VirtualChoice:
        """V by simulated step per real token among ``candidates`` (V 1 first; module docstring);
        ``layout_of(v, search_v)``: the layout of ``P v`` chunks."""
        t0 = time.process_time()
        reason = self.why_not(cost_model, workload)
        if not reason and tuple(candidates) == (1,):
            reason = "the layers and split setting allow one chunk per GPU only"
        if reason:
            return VirtualChoice(virtual=1, how="default", reason=reason, cpu_s=time.process_time() - t0)
        cm = layout_cost_model(cost_model)
        batches = self.search.sample_batches(workload_lengths(workload, cfg))
        layouts, runs = [], []
        for v in candidates:
            search = self.for_virtual(v)
            layout = layout_of(int(v), search)
            n = self.gpus * int(v)
            layouts.append(layout)
            runs.append(search.layout_step(layout, n, cm, batches))        # the whole layout, head shards too
        ref = runs[0][1]
        base = ref if ref > 0 else max(r[1] for r in runs)          # V 1 could not plan: the others compete
        scores = [step * base / tok if tok > 0 and tok >= ref * TOKENS_KEPT else float("inf") for step, tok in runs]
        best = 0
        for i, score in enumerate(scores):
            if score < scores[best] * (1 - 1e-9):
                best = i
        return VirtualChoice(virtual=int(candidates[best]), how="simulated", candidates=tuple(int(v) for v in candidates),
                             layouts=tuple(layouts), steps_s=tuple(r[0] for r in runs),
                             tokens=tuple(r[1] for r in runs), scores_s=tuple(scores), cpu_s=time.process_time() - t0)


def describe(choice: VirtualChoice) -> str:
    """The choice in one line (what ``say`` logs; ``dynmb plan`` / ``dynmb run`` record it)."""
    if choice.how != "simulated":
        return f"1 chunk per GPU, not chosen by simulated step: {choice.reason}"
    rows = ", ".join(f"V {v}: {s:.4f} s ({t:.0f} real tokens)"
                     for v, s, t in zip(choice.candidates, choice.steps_s, choice.tokens))
    return (f"{choice.virtual} chunk(s) per GPU by simulated step per real token on sample batches ({rows}; "
            f"{choice.cpu_s:.1f} CPU s)")


def say(choice: VirtualChoice) -> None:
    """Log the choice (every time: once per run), or V 1 and its reason once per process, in one line."""
    if choice.how == "simulated":
        logger.info("virtual auto: %s", describe(choice))
    elif choice.reason not in _SAID:
        _SAID.add(choice.reason)
        logger.info("virtual auto: %s", describe(choice))


def choose_virtual(cfg: ModelConfig, gpus: int, stage_split: str, *, search: SplitSearch | None, workload: Any,
                   cost_model: Any, half_blocks: bool = True, enable: str = ENABLE) -> VirtualChoice:
    """The choice of ``Planner(virtual="auto")`` and of ``dynmb plan`` / ``run --virtual auto`` (said, ``say``):
    ``search`` the run's split search at V 1 over ``gpus`` stages (None: no global batch size); each V's layout
    ``stage_split`` resolved for ``gpus x V`` chunks priced by ``cost_model``; ``enable``: what the one-line
    refusal asks for."""
    if search is None:
        choice = VirtualChoice(virtual=1, how="default", reason=f"no global batch size; to choose V, {enable}")
    else:
        def layout_of(v: int, s: SplitSearch) -> ModelConfig:
            if stage_split == "even":
                return cfg
            return resolve_stage_split(cfg, gpus * v, stage_split, half_blocks=half_blocks, workload=workload,
                                       cost_model=cost_model, search=s, virtual=v)

        cands = admissible(cfg.n_layers, gpus, stage_split, half_blocks=half_blocks,
                           carried_split=cfg.layer_split is not None)
        choice = VirtualSearch(search, enable).choose(cfg, layout_of, candidates=cands, workload=workload,
                                              cost_model=cost_model)
    say(choice)
    return choice
