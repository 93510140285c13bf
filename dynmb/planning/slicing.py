"""``oversize="split"``: plan sequences longer than any row that fits as chains of slices.

Algorithm (one global batch, one pipeline replica):

1. The longest row the method runs (``row_cap``): the longest admissible one-row
   microbatch (``PackContext.length_cap``), or ``packed``'s row length. Sequences up to it
   are packed by the method as usual (``dynmb.packing.pack``, any ``recompute`` policy).
2. Every longer sequence is cut into ``k = ceil(L / S)`` consecutive slices of near-equal
   length (``packed``: rows of its pack length, the last one shorter, as a packed trainer
   cuts a document at row boundaries), each slice one single-row microbatch
   (``Microbatch.offsets`` / ``continued``). The slice length ``S`` is chosen jointly with
   the rest of the plan: for ``S`` in ``row_cap / {1, 2, 4, 8}`` (multiples of ``round_to``,
   at least 128 tokens), the chains placed before or after the short sequences'
   microbatches, and the slices recomputed or not (``recompute``: ``never`` - not;
   ``always`` - always; ``auto`` - only when the plan does not fit otherwise), the whole
   plan is scheduled (``make_schedule`` with the plan's kind, any kind with ``slices`` in the
   registry: GPipe, 1F1B, interleaved with its virtual stages, ZB-H1 and ``zb``, every one
   running a chain's backwards -- ``B``, or ``I`` of a split backward -- in reverse slice
   order, a chain in flight until its last slice went forward) and simulated with the
   memory model's slice bytes; the fastest candidate whose every GPU's predicted peak
   (every stage's, with one stage per rank) is within the limit wins.
   Each slice length is also tried with the slices' rows filled (``slice_fill``): a slice
   shorter than the longest row leaves room in its row, which short sequences take, packed
   after the slice in the same row (first fit, longest first; the row stays within the longest
   row), and the short sequences left over are packed by the method as usual. Fewer
   microbatches (less per-op overhead, shorter fill and drain) against longer slice rows: the
   simulator decides, as for the other choices; without room for any short sequence the
   candidate is not tried. None fitting raises ``PackingError`` naming the longest
   sequence and the smallest predicted peak.
3. ``meta``: ``oversize="split"``, ``sliced`` (``{seq_id: slices}``), ``slice_len``,
   ``slice_placement``, ``slice_recompute``, ``slice_fill``, ``longest_fitting_length``; every token of
   the batch is planned.

Not supported (refused with one line): data parallelism (``dp > 1``) and kinds without
``slices`` (``memory-aware``).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import replace
from typing import Callable

import numpy as np

from dynmb.costmodel.base import CostModelLike
from dynmb.memory import MemoryModelLike
from dynmb.config import ModelConfig
from dynmb.packing import PackingError, pack
from dynmb.packing.context import PackContext
from dynmb.packing.packed import packed_row_len
from dynmb.packing.rows import round_down, round_up
from dynmb.planspec import PlanSpec
from dynmb.predictions import Predictions
from dynmb.schedule.kinds import AUTO, auto_kinds, get_kind, slice_kinds
from dynmb.simulate import SimResult, simulate
from dynmb.types import Microbatch, Plan, Schedule

__all__ = ["plan_split", "longest_row", "slice_lengths", "MIN_SLICE"]

MIN_SLICE = 128
"""Shortest slice length the planner tries (tokens)."""


def longest_row(spec: PlanSpec, model_cfg: ModelConfig, memory_model: MemoryModelLike) -> int:
    """The longest row ``spec.method`` runs: ``packed``'s row length, else the longest admissible
    one-row microbatch (beyond it, ``oversize='split'`` slices a sequence). ``--schedule auto``:
    the shortest over the kinds auto weighs (a longer sequence is sliced under one of them at least)."""
    if spec.schedule_kind == AUTO:
        return min(longest_row(spec.with_(schedule_kind=k), model_cfg, memory_model) for k in auto_kinds(spec.virtual))
    ctx = PackContext.from_spec(spec, memory_model)
    if spec.method == "packed":
        return packed_row_len(ctx, model_cfg.max_seq_len, spec.pack_len, spec.round_to)[0]
    return ctx.length_cap(model_cfg.max_seq_len, spec.round_to)


def slice_lengths(length: int, slice_len: int) -> list[int]:
    """``length`` cut into ``ceil(length / slice_len)`` near-equal slices (longest first)."""
    k = max(1, math.ceil(length / slice_len))
    base, extra = divmod(length, k)
    return [base + 1] * extra + [base] * (k - extra)


def _chain(seq_id: int, pieces: list[int], round_to: int, recompute: bool) -> list[Microbatch]:
    out, offset = [], 0
    for j, n in enumerate(pieces):
        out.append(Microbatch([seq_id], [n], round_up(n, round_to), 1, recompute=recompute, offsets=[offset],
                              continued=[j < len(pieces) - 1]))
        offset += n
    return out


def _fill(chains: list[Microbatch], short_ids: np.ndarray, lengths: np.ndarray, row_cap: int,
          round_to: int) -> tuple[list[Microbatch], np.ndarray]:
    """The slices' rows filled with short sequences (first fit, longest first, each row within
    ``row_cap`` rounded up to ``round_to``) and the short sequences left over (module doc)."""
    cap = round_down(row_cap, round_to) or row_cap
    free = [cap - int(mb.lengths.sum()) for mb in chains]
    added: list[list[int]] = [[] for _ in chains]
    left = []
    for sid in sorted(short_ids.tolist(), key=lambda i: -int(lengths[i])):
        n = int(lengths[sid])
        k = next((k for k, f in enumerate(free) if f >= n), None)
        if k is None:
            left.append(sid)
            continue
        free[k] -= n
        added[k].append(sid)
    out = []
    for mb, more in zip(chains, added):
        if more:
            ids = [*mb.seq_ids.tolist(), *more]
            lens = [*mb.lengths.tolist(), *lengths[more].tolist()]
            extra = [0] * len(more)
            mb = Microbatch(ids, lens, min(cap, round_up(sum(lens), round_to)), 1, recompute=mb.recompute,
                            row_ids=[0] * len(ids), offsets=[*mb.offsets.tolist(), *extra],
                            continued=[*mb.continued.tolist(), *(False for _ in more)])
        out.append(mb)
    return out, np.asarray(sorted(left), dtype=np.int64)


def plan_split(lengths: np.ndarray, spec: PlanSpec, *, model_cfg: ModelConfig, memory_model: MemoryModelLike,
               cost_model: CostModelLike, make_schedule: Callable[..., Schedule]) -> tuple[Plan, Schedule, SimResult]:
    """Plan ``lengths`` with every sequence longer than the longest row cut into slices (module doc)."""
    t0 = time.perf_counter()
    method, num_stages, memory_limit_bytes = spec.method, spec.num_stages, spec.memory_limit_bytes
    schedule_kind, round_to, virtual, recompute = spec.schedule_kind, spec.round_to, spec.virtual, spec.recompute
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if spec.dp != 1:
        raise ValueError("oversize='split' plans one pipeline replica (dp = 1)")
    rec = get_kind(schedule_kind)
    if not rec.slices or (virtual != 1 and not rec.virtual_stages):
        raise ValueError(f"oversize='split' runs on the {' or '.join(slice_kinds())} schedule, not {schedule_kind!r}"
                         f"{f' with virtual={virtual}' if virtual != 1 else ''}")
    if model_cfg.learned_positions and lengths.size and int(lengths.max()) > model_cfg.max_seq_len:
        raise PackingError(f"a sequence of {int(lengths.max())} tokens is longer than the model's max_seq_len "
                           f"{model_cfg.max_seq_len} (learned positions): size them from the trace, e.g. "
                           f"--model {model_cfg.name}:max_seq_len={int(lengths.max())}")
    row_cap = longest_row(spec, model_cfg, memory_model)
    if row_cap < 1:
        raise PackingError(f"no row fits under {memory_limit_bytes} B at {num_stages} stages ({schedule_kind})")
    long_ids = np.flatnonzero(lengths > row_cap)
    short_ids = np.flatnonzero(lengths <= row_cap)
    packed: dict[tuple[int, ...], list[Microbatch]] = {}

    def pack_short(ids: np.ndarray) -> list[Microbatch]:
        """The method's packing of short sequences ``ids`` (cached: the fill candidates share leftovers)."""
        key = tuple(ids.tolist())
        if key not in packed:
            sub = pack(lengths[ids], spec.with_(oversize="error"), memory_model=memory_model,
                       cost_model=cost_model) if ids.size else None
            packed[key] = [] if sub is None else [replace(mb, seq_ids=ids[mb.seq_ids]) for mb in sub.microbatches]
        return packed[key]

    short_mbs = pack_short(short_ids)
    if not long_ids.size:
        raise ValueError("internal: plan_split called without a sequence longer than the longest row")
    if method == "packed":
        candidates = [row_cap]
    else:
        candidates = sorted({max(MIN_SLICE, round_down(row_cap // f, round_to) or round_to) for f in (1, 2, 4, 8)},
                            reverse=True)
    rc_options = {"never": [False], "always": [True], "auto": [False, True]}[recompute]
    best: tuple[float, Plan, Schedule, SimResult] | None = None
    lowest: tuple[float, int] | None = None
    for use_rc in rc_options:
        for slice_len in candidates:
            chains: list[Microbatch] = []
            for sid in long_ids:
                n = int(lengths[sid])
                pieces = ([slice_len] * (n // slice_len) + ([n % slice_len] if n % slice_len else [])
                          if method == "packed" else slice_lengths(n, slice_len))
                chains += _chain(int(sid), pieces, round_to, use_rc)
            variants = [(False, chains, short_mbs)]
            filled, left = _fill(chains, short_ids, lengths, row_cap, round_to)
            if left.size < short_ids.size:
                variants.append((True, filled, pack_short(left)))
            for (fill, rows, shorts), placement in itertools.product(variants, ("first", "last")):
                if fill and not shorts and placement == "last":
                    continue                         # nothing left to place around the chains
                order = rows + shorts if placement == "first" else shorts + rows
                plan = Plan(tuple(order), method, num_stages, int(memory_limit_bytes), len(lengths),
                            schedule_kind=schedule_kind, spec=spec,
                            meta={"oversize": "split", "round_to": round_to, "longest_fitting_length": row_cap,
                                  "sliced": {int(s): int(math.ceil(lengths[s] / slice_len)) for s in long_ids},
                                  "slice_len": int(slice_len), "slice_placement": placement,
                                  "slice_recompute": use_rc, "slice_fill": fill, "truncated": [], "dropped": [],
                                  "pack_len": int(row_cap) if method == "packed" else None,
                                  "virtual": int(virtual)})
                sched = make_schedule(plan, schedule_kind, virtual=virtual, memory_model=memory_model,
                                      cost_model=cost_model)
                sim = simulate(sched, plan, cost_model, memory_model)
                gpu = sim.peak_bytes_rank if sim.peak_bytes_rank is not None else sim.peak_bytes
                peak = float(np.max(gpu)) if gpu is not None else 0.0
                if lowest is None or peak < lowest[0]:
                    lowest = (peak, int(slice_len))
                if peak <= memory_limit_bytes and (best is None or sim.makespan_s < best[0]):
                    best = (sim.makespan_s, plan, sched, sim)
        if best is not None:
            break
    if best is None:
        assert lowest is not None
        raise PackingError(
            f"oversize='split': sequence {int(long_ids[np.argmax(lengths[long_ids])])} of "
            f"{int(lengths[long_ids].max())} tokens does not fit sliced: the lowest predicted peak "
            f"{int(lowest[0])} B (slices of {lowest[1]}) exceeds the limit {int(memory_limit_bytes)} B"
            f"{'; --recompute auto keeps only block inputs and keys/values' if recompute == 'never' else ''}")
    _, plan, sched, sim = best
    plan = replace(plan, predictions=Predictions(pred_peak_bytes=tuple(int(x) for x in np.ceil(np.asarray(sim.peak_bytes))), est_makespan_s=sim.makespan_s,
                                                 plan_s=time.perf_counter() - t0))
    plan.validate(lengths)
    return plan, sched, sim
