"""How far a layer split can balance the stages, by the grain a stage boundary may fall on.

Run::

    python -m studies.stage_split.ceilings [--models llama2-7b llama3.1-8b] [--stages 4 8 16 32] [--tokens 1024]
                                        [--trace sharegpt]

The split ceiling is the mean stage's work over the busiest stage's (``stage_split.split_ceiling``): the
share of the machine the split alone lets a pipeline reach, whatever the schedule. The work model is
forward FLOPs of one ``--tokens``-token row (``stage_split.flops_cost``), or with ``--trace`` the trace's
own forward + backward priced by the GPU model (``split_work.workload_cost``, what ``auto`` balances in
the scaling study); each column is the min-max
contiguous partition (``planning.partition``) of a finer row of work units:

- ``half``: half-blocks (attention half, MLP half) with the head alone on the last stage allowed: what
  ``--stage-split auto`` planned before the head could be sharded;
- ``+head``: the LM head cut into 64 vocabulary chunks over the last stages (``planning.head_split``,
  ``ModelConfig.head_split``): what ``--stage-split auto`` plans now;
- ``+mlp/8`` and ``+attn/8``: a boundary inside a half-block: each MLP half (then also each attention
  half) cut into 8 equal chunks (column / K/V-head groups, whose partial sums travel with the residual
  stream, ``dynmb.core.model_sizes``). They show which grain holds each cell back;
- ``auto``: the layout ``--stage-split auto`` plans (``resolve_stage_split``, same work model): chunks of
  both halves and head shards, each taken where it lightens the busiest stage (chunks by ``CHUNK_GAIN``).
"""

from __future__ import annotations

import argparse

import numpy as np

from dynmb.core.config import ModelConfig
from dynmb.costmodel.gpu import GPUCostModel
from dynmb.planning.head_split import HEAD_CHUNKS
from dynmb.planning.partition import min_max_partition
from dynmb.planning.split_work import workload_cost
from dynmb.planning.stage_split import _stage_partition, flops_cost, resolve_stage_split, split_ceiling, unit_work


def ceilings(name: str, stages: int, tokens: int, trace: str | None = None) -> dict[str, float]:
    """The five columns (module docstring) of ``name`` over ``stages`` stages."""
    cfg = ModelConfig.preset(name)
    cost = flops_cost(tokens) if trace is None else workload_cost(trace, cfg, GPUCostModel(cfg, stages))
    units, first, last = unit_work(cfg, cost, True)
    mean = (units.sum() + first + last) / stages
    head = np.full(HEAD_CHUNKS, last / HEAD_CHUNKS)
    half = _stage_partition(units, stages, first, last)[1]

    def top(row: np.ndarray) -> float:
        return min(half, min_max_partition(np.concatenate([row, head]), stages, first, 0.0)[1])

    attn, mlp = units[0::2], units[1::2]
    cut_mlp = np.concatenate([[a] + [m / 8] * 8 for a, m in zip(attn, mlp)])
    cut_both = np.concatenate([[a / 8] * 8 + [m / 8] * 8 for a, m in zip(attn, mlp)])
    auto = resolve_stage_split(cfg, stages, "auto", tokens, stage_cost=cost)
    return {"half": mean / half, "+head": mean / top(units), "+mlp/8": mean / top(cut_mlp),
            "+attn/8": mean / top(cut_both),
            "auto": split_ceiling(auto, tuple(auto.stage_layer_counts(stages)), tokens, stage_cost=cost)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["llama2-7b", "llama3.1-8b"])
    ap.add_argument("--stages", nargs="+", type=int, default=[4, 8, 16, 32])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--trace", default=None, help="balance this trace's own F + B on the GPU model instead")
    args = ap.parse_args()
    print("| model | P | half | +head | +mlp/8 | +attn/8 | auto |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in args.models:
        for p in args.stages:
            c = ceilings(name, p, args.tokens, args.trace)
            print(f"| {name} | {p} | " + " | ".join(f"{c[k]:.3f}" for k in ("half", "+head", "+mlp/8", "+attn/8", "auto")) + " |")


if __name__ == "__main__":
    main()
