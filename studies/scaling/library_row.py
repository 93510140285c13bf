"""One cell of ``studies/scaling/scaling.py`` planned by the library's own step planner instead of the study's path.

The study's ``dynamic`` row packs with ``dynmb.packing.pack``, reorders and simulates the ``--sim-replicas`` slowest
replicas per kind (``_scaling_sched``), then runs its copy of the final check (``_scaling_final``) and the
fitting-slice check (``_scaling_slicefit``). ``dynmb.Planner.plan`` runs ``dynmb.planning.planner.plan_step``
instead: every replica planned and simulated, each kind's final check against ``FINAL_METHODS`` at the ranked
budgets and their neighbours and against every other registered method, the extra ``zb`` candidates
(``zb@zb-h1``, ramped fills) and slice fitting. This script plans the same global batch (``token_batch``, same
seed), on the layout a ``dynamic`` row recorded (``layer_split``, head shards included), with
``PlanSpec(method="dynamic", schedule_kind="auto", reorder="auto", dp, oversize="truncate", slice_fitting)`` and
the GPU cost model: what the library predicts for that cell, to set beside the study's row.

    PYTHONPATH=$PWD nice -n 15 python3 -m studies.scaling.library_row --trace sharegpt --model llama2-7b \\
        --stages 8 --layout "4.0625 4.125 4.0625 4.125 4.125 4.0625 4.0625 3.375"
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from studies.scaling.scaling import model_for, parse_tokens, token_batch

from dynmb import data
from dynmb.core.config import parse_bytes
from dynmb.core.planspec import PlanSpec
from dynmb.costmodel import gpu
from dynmb.costmodel.loader import Models
from dynmb.memory.model import get_memory_model
from dynmb.planning.planner import plan_step
from dynmb.planning.stage_split import with_split

__all__ = ["layout_of", "main"]


def layout_of(cfg, num_stages: int, label: str):
    """``cfg`` with the split of a ``layer_split`` label (``4 4 3.5 | head 6:1000 7:31000``, ``layout_label``)."""
    counts, _, head = label.partition("| head")
    out = with_split(cfg, num_stages, tuple(float(x) for x in counts.split()))
    if not head.strip():
        return out
    rows = [0] * num_stages
    for part in head.split():
        stage, n = part.split(":")
        rows[int(stage)] = int(n)
    return replace(out, head_split=tuple(rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--stages", type=int, required=True)
    ap.add_argument("--layout", required=True, help="a dynamic row's layer_split column")
    ap.add_argument("--tokens", default="4M")
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slice-fitting", default="auto", choices=("never", "auto"))
    ap.add_argument("--embedding", default="first", choices=("first", "last"))
    args = ap.parse_args(argv)
    trace = data.load_trace(args.trace)
    cfg = layout_of(model_for(args.model, [trace]), args.stages, args.layout)
    batch = token_batch(trace, parse_tokens(args.tokens), args.dp, args.seed)
    cm = gpu.GPUCostModel(cfg, args.stages, link="ib")
    models = Models(cm, get_memory_model(None, cfg, args.stages))
    spec = PlanSpec(method="dynamic", num_stages=args.stages, schedule_kind="auto", reorder="auto",
                    memory_limit_bytes=parse_bytes("80GiB"), dp=args.dp, oversize="truncate",
                    slice_fitting=args.slice_fitting, attention=cfg.attention, embedding=args.embedding)
    t0 = time.process_time()
    plan, _, _ = plan_step(batch, spec, model_cfg=cfg, models=models)
    meta = plan.meta
    print(f"{args.model} {args.trace} P {args.stages} ({args.embedding}): step {plan.predictions['pred_step_s']:.4f} s, "
          f"{plan.schedule_kind}, {plan.num_microbatches // plan.dp} mb a replica, grouping {meta.get('grouping')}, "
          f"slice threshold {meta.slice_threshold}, kinds {meta.get('schedule_auto')}; "
          f"{time.process_time() - t0:.0f} CPU s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
