"""Robustness sweep: is ``dynamic`` <= every other method's predicted makespan across cost regimes?

For each shipped trace, global batch size and AnalyticCostModel per-op overhead, packs the
batch with every method at the binding limit of ``table_methods.py`` (fixed gets mbs 4 at the
batch's longest sequence) and compares ``est_makespan_s`` (equal to ``dynmb.timing.simulate``'s
makespan). Prints one line per case and a final count.

    python benchmarks/sweep_dynamic.py [--model small --stages 2] [--overheads 3e-4,5e-3,0.02,0.1] [--sizes 128,256,512]
"""

from __future__ import annotations

import argparse

import numpy as np

from dynmb.core.config import ModelConfig
from dynmb.costmodel import AnalyticCostModel
from dynmb.data import list_traces, load_trace, sample_batch
from dynmb.memory.model import MemoryModel
from dynmb.packing import METHODS, pack


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", help="model preset (default small)")
    ap.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    ap.add_argument("--overheads", default="3e-4,5e-3,0.02,0.1", help="AnalyticCostModel overhead_s values")
    ap.add_argument("--sizes", default="128,256,512", help="global batch sizes")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    args = ap.parse_args(argv)
    cfg, p = ModelConfig.preset(args.model), args.stages
    mm = MemoryModel.analytic(cfg, p)
    k = np.array([p - i for i in range(p)])
    wins = ties = losses = 0
    for o in [float(x) for x in args.overheads.split(",")]:
        cm = AnalyticCostModel(cfg, p, overhead_s=o)
        for g in [int(x) for x in args.sizes.split(",")]:
            for name in list_traces():
                lengths = np.minimum(sample_batch(load_trace(name), g, args.seed), cfg.max_seq_len)
                act, tr = mm.act_matrix([4], [int(lengths.max())])
                limit = int(np.max(mm.state_bytes + k * act[:, 0] + tr[:, 0])) + 1
                est = {m: pack(lengths, m, num_stages=p, memory_limit_bytes=limit, memory_model=mm,
                               cost_model=cm).predictions["est_makespan_s"] for m in METHODS}
                other = min(v for m, v in est.items() if m != "dynamic")
                r = est["dynamic"] / other
                wins, ties, losses = wins + (r < 1), ties + (r == 1), losses + (r > 1)
                print(f"overhead {o:<6g} G {g:<4} {name:<12} dynamic/dynapipe {est['dynamic'] / est['dynapipe']:.4f} "
                      f"dynamic/best-other {r:.4f}", flush=True)
    print(f"dynamic strictly best {wins}, tied {ties}, beaten {losses}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
