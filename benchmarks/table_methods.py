"""Methods x shipped traces at a binding memory limit, judged by the real simulator.

For each trace: a global batch (default 256 sequences, seed 0; lengths clipped to the
model's max_seq_len), the small model at P = 2 under 1F1B, and a limit at which
``fixed`` gets mbs 4 at the batch's longest sequence (so it binds). Each method is
packed and scheduled by ``dynmb.planning.plan_step`` (no reordering) and simulated by
``dynmb.timing.simulate``; the table shows microbatches, padding fraction, predicted peak /
limit (max over stages), simulated step time and plan_s (pack wall time).

    python benchmarks/table_methods.py [--global-batch 256] [--mbs-at-limit 4] [--cost-model cost.json]
"""

from __future__ import annotations

import argparse

import numpy as np

from dynmb.core.config import ModelConfig, format_bytes
from dynmb.costmodel import get_cost_model
from dynmb.data import list_traces, load_trace, sample_batch
from dynmb.memory.model import get_memory_model
from dynmb.packing import METHODS
from dynmb.planning import plan_step


def binding_limit(mm, lengths, mbs: int, p: int) -> int:
    """The smallest limit at which ``mbs`` rows of the batch's longest length are admissible."""
    act, tr = mm.act_matrix([mbs], [int(lengths.max())])
    k = np.array([p - i for i in range(p)])
    return int(np.max(mm.state_bytes + k * act[:, 0] + tr[:, 0])) + 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", help="model preset (default small)")
    ap.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    ap.add_argument("--global-batch", type=int, default=256, help="sequences per global batch (default 256)")
    ap.add_argument("--mbs-at-limit", type=int, default=4, help="fixed's mbs at the limit (default 4)")
    ap.add_argument("--cost-model", default=None, help="fitted cost-model JSON (default analytic)")
    ap.add_argument("--memory-model", default=None, help="fitted memory-model JSON (default analytic)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    args = ap.parse_args(argv)
    cfg, p = ModelConfig.preset(args.model), args.stages
    mm = get_memory_model(args.memory_model, cfg, p)
    cm = get_cost_model(args.cost_model, cfg, p)
    print("| trace | limit | method | microbatches | padding | peak/limit | step_s (sim) | vs dynamic | plan_s ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in list_traces():
        lengths = np.minimum(sample_batch(load_trace(name), args.global_batch, args.seed), cfg.max_seq_len)
        limit = binding_limit(mm, lengths, args.mbs_at_limit, p)
        rows = {}
        for method in METHODS:
            plan, _, sim = plan_step(lengths, method=method, model_cfg=cfg, num_stages=p, memory_limit_bytes=limit,
                                     cost_model=cm, memory_model=mm)
            rows[method] = (plan, sim)
        dyn = rows["dynamic"][1].makespan_s
        for method, (plan, sim) in rows.items():
            peak = max(plan.predictions["pred_peak_bytes"]) / limit
            print(f"| {name} | {format_bytes(limit)} | {method}{' (mbs %d)' % plan.meta['mbs'] if 'mbs' in plan.meta else ''} "
                  f"| {plan.num_microbatches} | {plan.padding_fraction:.3f} | {peak:.3f} | {sim.makespan_s:.3f} "
                  f"| {sim.makespan_s / dyn:.3f} | {plan.predictions['plan_s'] * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
