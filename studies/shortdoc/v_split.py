"""What-if (issue 39, 24 GiB P 16): ``zb-v`` on a layer split balanced per GPU under the V placement.

``--virtual 2`` resolves the split for ``2P`` chunks balanced per GPU as the interleaved placement pairs them (chunk
``s`` on GPU ``s % P``, ``dynmb.planning.gpu_split``), but ``zb-v`` places chunk ``s`` on GPU ``v_rank(s)`` (``r`` and
``2P - 1 - r``), so its GPUs are not balanced (Llama-2-7B P 16: the plan's ideal 1.936 s against 1.708 s). This script
plans one shortdoc cell (``studies.shortdoc.shortdoc.cell``: dynamic alone, ``schedule="auto"``, ``virtual=2``) on a
split balanced per V GPU instead:

- ``v_split``: bisection on the busiest GPU's work ``B``; for a given ``B`` GPU ``r = 0 .. R - 2`` takes its front
  chunk (the next units from the front, at most ``min(B / 2, B - its end's extra - one unit)`` of work, GPU 0's
  embedding extra included) and its back chunk (the units before the back pointer, up to ``B`` in all, GPU 0's head
  extra included); GPU ``R - 1`` takes what is left, cut in the middle into its two chunks. ``B`` is feasible when
  that last GPU's work is at most ``B``. The grain is ``split_units``' (``chunk``: 1/16 layer where the model allows
  a cut, ``half``: half-blocks), the work the workload's (``split_work.workload_cost``) under the cell's cost model.
- the ZB-V list scheduler runs with its exact admission (``dynmb.schedule.vshape``'s rule 2). The README's rows of
  the admission of before (``--exact 0``: chunk-1 forwards past the cap, the packers counting ``3R``) need a
  checkout of c7a7e84 or earlier, which had that switch.

    PYTHONPATH=$PWD nice -n 10 python3 -m studies.shortdoc.v_split --models llama2-7b --stages 16 \
        --out results/v_split.jsonl
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import dynmb
from dynmb import data
from dynmb.core.config import ModelConfig
from dynmb.planning.memory_split import layout_of
from dynmb.planning.split_units import CHUNK, HALF, StageCost, UnitRow, unit_row
from dynmb.planning.split_work import workload_cost
from studies.common import append_row
from studies.scaling import scaling
from studies.shortdoc import shortdoc

GRAINS = {"chunk": CHUNK, "half": HALF}


def _greedy(row: UnitRow, num_chunks: int, bound: float) -> list[int]:
    """Units per chunk for the busiest-GPU bound ``bound`` (module doc); the last GPU may exceed it."""
    w = row.work
    pre = np.concatenate([[0.0], np.cumsum(w)])
    R = num_chunks // 2
    x, y, front, back = 0, w.size, [], []
    for r in range(R - 1):
        ef, eb = (row.first, row.last) if r == 0 else (0.0, 0.0)
        reach = int(np.searchsorted(pre, pre[x] + min(bound / 2, bound - eb - w[y - 1]) - ef, side="right")) - 1
        xn = max(x + 1, min(reach, y - 2 * (R - r) + 1))            # leave every later chunk a unit
        rest = bound - (pre[xn] - pre[x]) - ef - eb
        yn = min(y - 1, max(int(np.searchsorted(pre, pre[y] - rest, side="left")), xn + 2 * (R - r - 1)))
        front.append(xn - x)
        back.append(y - yn)
        x, y = xn, yn
    mid = min(max(int(np.searchsorted(pre, (pre[x] + pre[y]) / 2)), x + 1), y - 1)
    return front + [mid - x, y - mid] + back[::-1]


def gpu_loads(row: UnitRow, counts: list[int]) -> np.ndarray:
    """Work of every GPU (chunks ``r`` and ``S - 1 - r``) under ``counts`` units per chunk, the ends' extras in."""
    pre = np.concatenate([[0.0], np.cumsum(row.work)])
    b = np.cumsum([0, *counts])
    c = pre[b[1:]] - pre[b[:-1]]
    c[0] += row.first
    c[-1] += row.last
    R = len(counts) // 2
    return c[:R] + c[R:][::-1]


def v_split(cfg: ModelConfig, num_chunks: int, cost: StageCost, grain: int = CHUNK) -> tuple[tuple[float, ...], float]:
    """(layers per chunk, mean over busiest GPU work) of the split balanced per V GPU (module doc)."""
    row = unit_row(cfg, cost, grain)
    total = float(row.work.sum() + row.first + row.last)
    lo, hi, best = total / (num_chunks // 2), total, None
    for _ in range(50):
        mid = (lo + hi) / 2
        counts = _greedy(row, num_chunks, mid)
        if gpu_loads(row, counts).max() <= mid * (1 + 1e-9):
            hi, best = mid, counts
        else:
            lo = mid
    if best is None:
        raise ValueError(f"no V split of {cfg.n_layers} layers over {num_chunks} chunks")
    g = gpu_loads(row, best)
    return row.layers(best), float(g.mean() / g.max())


def run_cell(model: str, P: int, grain: str, out: Path | None) -> dict:
    """One gsm8k 24 GiB cell of dynamic at ``virtual=2`` on the V split (module doc)."""
    trace = data.load_trace("gsm8k")
    cfg = scaling.model_for(model, [trace])
    variant = shortdoc.Variant(virtual=2)
    split, ceiling = v_split(cfg, 2 * P, workload_cost(trace, cfg, variant.gpu(cfg, 2 * P)), GRAINS[grain])

    def planner_for(cfg_: ModelConfig, trace_: np.ndarray, S: int, limit: str, v: shortdoc.Variant) -> dynmb.Planner:
        lay = layout_of(cfg_, S, split)
        return dynmb.Planner(model=lay, num_stages=S, memory_limit=limit, cost_model=v.gpu(lay, S), schedule="auto",
                             stage_split="even", workload=trace_, virtual=2)

    shortdoc.planner_for = planner_for
    row = shortdoc.cell("gsm8k", trace, model, P, "24GiB", [], variant)
    row.update(v_split=list(split), v_ceiling=ceiling, grain=grain)
    append_row(row, out)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama2-7b")
    ap.add_argument("--stages", default="16")
    ap.add_argument("--grain", choices=tuple(GRAINS), default="chunk")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    for model in args.models.split(","):
        for P in map(int, args.stages.split(",")):
            row = run_cell(model, P, args.grain, args.out)
            print({k: row.get(k) for k in ("model", "P", "status", "step_s", "ideal_s", "gap", "microbatches",
                                            "gap_schedule", "gap_ends", "gap_overhead", "gap_shape", "v_ceiling")},
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
