"""CPU time of packing one global batch per ``--schedule auto`` kind: the study's batch and models.

For each (trace, P) cell of ``studies/scaling/scaling.py`` (Llama-2-7B, H100 ``GPUCostModel``, 80 GiB,
``--tokens`` global batch, DP ``--dp``, oversize truncate, even layer split), one repeat is: every
packing memo cleared (``karmarkar_karp``'s and, where the checkout has one, the dynamic packer's),
then ``pack(batch, method, schedule_kind=k)`` for ``1f1b`` alone (the 1F1B-only plan time), the memos
cleared again, then ``1f1b``, ``zb-h1``, ``zb`` in turn (what ``--schedule auto`` packs; kinds of one
``packing_key`` packed once). ``time.process_time`` per call; the median over ``--repeats``. Each
plan's ``est_makespan_s`` and microbatch count are printed, so two checkouts can be compared plan by
plan. Run it once per checkout, back to back, and compare ratios (the box is shared):

    PYTHONPATH=path/to/main-checkout nice -n 19 python3 -m studies.scaling.pack_time --out /tmp/main.json
    PYTHONPATH=$PWD nice -n 19 python3 -m studies.scaling.pack_time --out /tmp/branch.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from studies.scaling import scaling

from dynmb import data
from dynmb.costmodel import gpu
from dynmb.memory.model import get_memory_model
from dynmb.packing import balanced, pack
from dynmb.schedule.kinds import auto_kinds, get_kind
from dynmb.core.planspec import PlanSpec
from dynmb.costmodel.loader import Models

KINDS = ("1f1b", "zb-h1", "zb")


def clear_memos() -> None:
    """Forget every packing memo of this checkout (a fresh process would have none)."""
    getattr(balanced, "_KK_MEMO", {}).clear()
    try:
        from dynmb.packing.dynamic import space as dynamic_space
        dynamic_space.clear()
    except ImportError:                     # a checkout without the dynamic packer's memo
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default="sharegpt,longtail")
    ap.add_argument("--stages", default="16,32")
    ap.add_argument("--tokens", default="4M")
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--method", default="dynamic")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON file of every timing")
    args = ap.parse_args(argv)
    tokens = scaling.parse_tokens(args.tokens)
    traces = {t: data.load_trace(t) for t in args.traces.split(",")}
    cfg = scaling.model_for("llama2-7b", list(traces.values()))
    limit = 80 * 2**30
    groups: dict[tuple, str] = {}
    for k in auto_kinds():
        groups.setdefault(get_kind(k).packing_key, k)
    auto = tuple(groups.values())
    print(f"# pack() CPU s, {args.method}, {args.tokens} tokens, DP {args.dp}; auto packs {auto}; "
          f"median of {args.repeats}", flush=True)
    rows = []
    for name, trace in traces.items():
        lens = scaling.token_batch(trace, tokens, args.dp, 0)
        for P in (int(x) for x in args.stages.split(",")):
            cm, mm = gpu.GPUCostModel(cfg, P, link="ib"), get_memory_model(None, cfg, P)

            def one(kind: str) -> tuple[float, object]:
                t0 = time.process_time()
                plan = pack(lens, PlanSpec(method=args.method, num_stages=P, memory_limit_bytes=limit, dp=args.dp,
                                           oversize="truncate", schedule_kind=kind), models=Models(cm, mm))
                return time.process_time() - t0, plan
            alone, per, plans = [], {k: [] for k in auto}, {}
            for _ in range(args.repeats):
                clear_memos()
                alone.append(one("1f1b")[0])
                clear_memos()
                for k in auto:
                    t, plans[k] = one(k)
                    per[k].append(t)
            clear_memos()
            row = {"trace": name, "P": P, "alone_1f1b": statistics.median(alone),
                   **{k: statistics.median(v) for k, v in per.items()},
                   "auto_sum": statistics.median([sum(x) for x in zip(*per.values())]),
                   "plans": {k: [p.num_microbatches // p.dp, float(p.predictions["est_makespan_s"])]
                             for k, p in plans.items()}}
            rows.append(row)
            print(f"{name:>9} P{P:<3} 1f1b alone {row['alone_1f1b']:.3f} s | auto "
                  + " + ".join(f"{k} {row[k]:.3f}" for k in auto)
                  + f" = {row['auto_sum']:.3f} s ({row['auto_sum'] / row['alone_1f1b']:.2f}x) | "
                  + " ".join(f"{k}: m {v[0]} est {v[1]:.4f}" for k, v in row["plans"].items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
