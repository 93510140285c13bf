"""Measure the stage time of sequence slices and fit the cost model's ``prefix_scale``.

A slice of n tokens at offset p runs its attention against p prefix keys with
``dynmb.models.prefix.PrefixAttention`` (``Microbatch.prefix_work = n * (2p + n)``), a different
kernel from whole documents' causal SDPA. This script times forward and backward of one
such slice (the last of its sequence: prefix keys and values from a pre-filled
``PrefixStore``) on every stage, ``--repeats`` interleaved passes after a warm-up pass (``measure``),
thread CPU time (as the profile), one thread, and fits the cost model's ``prefix_scale``, one factor per op (F, B).

First it calibrates the stored model to this sitting, as the runtime calibration does on a run's
steps (``costmodel.runtime_calibration``): whole documents of the slice lengths are timed in the same
passes, and the model's predictions are scaled per stage and op by measured / predicted of those
(the profile was measured on another day, and the shared box drifts by 10-20%). Then:

    t(op) = pred(op, attn = n**2) + prefix_scale * (pred(op, attn = prefix_work) - pred(op, attn = n**2))

(the slice's own tokens cost what a causal document of n tokens does; its queries against the
p prefix keys, ``2 n p`` units, cost the model's per-unit attention cost scaled), by least squares
of the relative error over every other (n, prefix, stage) point; it reports the relative error of the predictions on
the held-out points (the rest) and, with ``--write``, stores the factor in the cost model file.

    python benchmarks/bench_slices.py --cost-model data/costmodels/small-p2-cpu.json \\
        --model small:max_seq_len=20480 --repeats 5 [--write]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import numpy as np
import torch

from dynmb.core.config import model_config
from dynmb.costmodel import CostModel
from dynmb.models import build_stage, make_inputs, synthetic_tokens, torch_dtype
from dynmb.models.prefix import PrefixStore
from dynmb.core.types import Microbatch

POINTS = [(256, 256), (256, 2048), (384, 4608), (512, 512), (512, 4096), (768, 4608), (1024, 1024), (1024, 8192),
          (2048, 2048), (2048, 12288)]
"""(slice tokens n, prefix tokens p) measured."""


def _time_once(mod, cfg, n: int, prefix: int, g: torch.Generator) -> tuple[float, float]:
    """Thread seconds of (forward, backward) of one last slice of n tokens at offset ``prefix``
    on stage module ``mod``; ``prefix=0``: a whole document of n tokens (causal SDPA, no store)."""
    mb = Microbatch([0], [n], n, 1, offsets=[prefix], continued=[False]) if prefix else Microbatch([0], [n], n, 1)
    inputs = make_inputs(mb, synthetic_tokens([prefix + n], cfg.vocab_size, 0), cfg=cfg)
    if prefix:
        store = PrefixStore()
        for layer in mod.layers:
            k, v = (torch.randn(cfg.n_heads, prefix, cfg.head_dim, generator=g) * 0.1 for _ in range(2))
            store.keep(layer, 0, 0, k, v, mb=-1)
        inputs = replace(inputs, prefix=store, microbatch=0)
    x = None if mod.is_first else torch.randn(1, n, cfg.d_model, dtype=torch_dtype(cfg), requires_grad=True)
    t0 = time.thread_time()
    out = mod(x, inputs)
    t1 = time.thread_time()
    out.backward(torch.ones_like(out))
    t2 = time.thread_time()
    return t1 - t0, t2 - t1


def measure(cfg, num_stages: int, points: list[tuple[int, int]], repeats: int) -> dict[tuple[int, int, int], tuple[float, float]]:
    """Median (forward, backward) thread seconds per (n, prefix, stage). Repeats are interleaved:
    pass r times every point once (pass 0 warms up), so a burst of load on the shared box hits one
    repeat of many points, not every repeat of one point, and the median rejects it."""
    mods = [build_stage(cfg, stage, num_stages) for stage in range(num_stages)]
    g = torch.Generator().manual_seed(0)
    times: dict[tuple[int, int, int], list[tuple[float, float]]] = {}
    for r in range(repeats + 1):
        for n, prefix in points:
            for stage, mod in enumerate(mods):
                t = _time_once(mod, cfg, n, prefix, g)
                if r:
                    times.setdefault((n, prefix, stage), []).append(t)
    return {k: (statistics.median(f for f, _ in v), statistics.median(b for _, b in v)) for k, v in times.items()}


def sitting_scale(cm: CostModel, measured: dict[tuple[int, int, int], tuple[float, float]]) -> dict[str, list[float]]:
    """This sitting's measured / predicted time of the whole documents (prefix 0) in ``measured``,
    per op and stage (ratio of sums, as ``costmodel.runtime_calibration`` calibrates a run on its warm-up)."""
    scale: dict[str, list[float]] = {"F": [], "B": []}
    for stage in range(cm.num_stages):
        docs = [(n, t) for (n, prefix, st), t in measured.items() if prefix == 0 and st == stage]
        for k, op in enumerate(("F", "B")):
            predicted = sum(float(np.ravel(cm.predict(stage, op, 1, n, float(n * n)))[0]) for n, _ in docs)
            scale[op].append(sum(t[k] for _, t in docs) / predicted)
    return scale


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cost-model", required=True)
    ap.add_argument("--model", default="small:max_seq_len=20480")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--write", action="store_true", help="store the fitted prefix_scale in the cost model file")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = model_config(args.model)
    stored = CostModel.load(args.cost_model)
    stored.check(cfg, stored.num_stages)
    docs = [(n, 0) for n in sorted({n for n, _ in POINTS})]
    measured = measure(cfg, stored.num_stages, POINTS + docs, args.repeats)
    sitting = sitting_scale(stored, measured)
    print("this sitting, whole documents of the slice lengths, measured / predicted per stage: "
          + ", ".join(f"{op} {'/'.join(f'{v:.3f}' for v in per)}" for op, per in sitting.items()))
    cm = stored.with_scale(sitting)
    for (n, p, stage), (f, b) in sorted(measured.items()):
        if p == 0:
            print(f"whole document n={n:5d} stage {stage}: F {f:.4f} s (model {float(np.ravel(cm.predict(stage, 'F', 1, n))[0]):.4f}), "
                  f"B {b:.4f} s (model {float(np.ravel(cm.predict(stage, 'B', 1, n))[0]):.4f})")
    rows = []
    for n, p in POINTS:
        for stage in range(cm.num_stages):
            f, b = measured[(n, p, stage)]
            mb = Microbatch([0], [n], n, 1, offsets=[p], continued=[False])
            work = float(mb.prefix_work())
            for op, t in (("F", f), ("B", b)):
                base = float(np.ravel(cm.predict(stage, op, 1, n, float(n * n)))[0])    # own tokens, causal
                full = float(np.ravel(cm.predict(stage, op, 1, n, work))[0])           # + the 2 n p cross term
                rows.append((n, p, stage, op, t, base, full))
                print(f"n={n:5d} prefix={p:6d} stage {stage} {op}: measured {t:.4f} s, model at scale 1 {full:.4f} s")
    # held out: every other (n, prefix, stage) point, both ops; fitted per op on the rest
    train = [r for k, r in enumerate(rows) if (k // 2) % 2 == 0]
    test = [r for k, r in enumerate(rows) if (k // 2) % 2 == 1]
    scale = {}
    for op in ("F", "B"):
        pts = [(t, base, full - base) for (_, _, _, o, t, base, full) in train if o == op and full > base]
        # min sum(((base + s * delta - t) / t)^2): s = sum(d/t * (t - base)/t) / sum((d/t)^2)
        scale[op] = max(sum(d / t * (t - b) / t for t, b, d in pts) / sum((d / t) ** 2 for t, _, d in pts), 1e-3)
    errs = [abs(base + scale[o] * (full - base) - t) / t for (_, _, _, o, t, base, full) in test]
    errs1 = [abs(full - t) / t for (_, _, _, o, t, base, full) in test]
    print(f"fitted prefix_scale F {scale['F']:.3f}, B {scale['B']:.3f} on {len(train)} measurements; held-out "
          f"({len(test)}) relative error: mean {np.mean(errs):.1%}, median {np.median(errs):.1%}, "
          f"p90 {np.percentile(errs, 90):.1%}, max {np.max(errs):.1%} (at scale 1: median {np.median(errs1):.1%}, "
          f"max {np.max(errs1):.1%})")
    if args.write:                      # the factor only: the sitting's calibration is not stored
        stored.prefix_scale = {op: float(v) for op, v in scale.items()}
        stored.meta = {**stored.meta, "prefix_scale_fit": {
            "points": len(train), "heldout_points": len(test), "sitting_scale": sitting,
            "heldout_mean_rel_err": float(np.mean(errs)), "heldout_median_rel_err": float(np.median(errs)),
            "heldout_p90_rel_err": float(np.percentile(errs, 90)), "heldout_max_rel_err": float(np.max(errs)),
            "command": "benchmarks/bench_slices.py"}}
        stored.save(args.cost_model)
        print(f"wrote prefix_scale {stored.prefix_scale} to {args.cost_model}")


if __name__ == "__main__":
    main()
