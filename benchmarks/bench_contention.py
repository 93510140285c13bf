"""How much slower a stage's op runs while another rank computes on the same host than alone.

The profile (``dynmb profile``) times one stage's op at a time; a CPU pipeline's ranks share
the host's last-level cache and memory bandwidth. This script builds the ``small`` stages of a
2-stage split and times forward and backward (thread CPU time, one torch thread, median of
``--repeats`` after 2 warm-up runs) of a few microbatch shapes, twice: each stage alone in its
own process, then both stages in two processes at once, meeting at a barrier before every op,
as a pipeline's ranks overlap. It prints concurrent / alone per (stage, shape, op).

    python benchmarks/bench_contention.py --repeats 10

On the 2-core development box (AMD EPYC, 32 MiB L3), ``--repeats 10``: stage 0 1.11-1.37x for
4 x 220 ... 16 x 400 and 1 x 2048 tokens, 0.9-1.0x for 1 x 200; stage 1 0.93-1.15x. A second run
with ``--repeats 3`` read stage 0 1.00-1.33x (1 x 200 included) and stage 1 0.80-1.19x: the effect
is real but shape by shape as noisy as the box. The runtime calibration of a run
(``dynmb.costmodel.job_calibration``) absorbs the average of this into the run's predictions.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

SHAPES = [(1, 200), (4, 220), (2, 500), (8, 300), (16, 400), (1, 2048)]
"""(rows, padded_len) timed."""


def _worker(stage: int, barrier, queue, together: bool, repeats: int, model: str) -> None:
    import torch

    from dynmb.core.config import model_config
    from dynmb.models import build_stages, make_inputs, synthetic_tokens
    from dynmb.measure import synthetic_microbatch
    from dynmb.runtime.hostmem import retain_freed_memory

    torch.set_num_threads(1)
    retain_freed_memory()                   # as the runtime workers and the profile do
    cfg = model_config(model)
    mod = build_stages(cfg, 2, 0)[stage]
    out = {}
    for rows, length in SHAPES:
        mb = synthetic_microbatch(rows, length, 1, 0)
        inputs = make_inputs(mb, synthetic_tokens(mb.lengths, cfg.vocab_size, 0), cfg=cfg)
        x0 = None if mod.is_first else torch.randn(rows, length, cfg.d_model)
        grad = None if mod.is_last else torch.randn(rows, length, cfg.d_model) * 1e-3
        fwd, bwd = [], []
        for r in range(repeats + 2):
            x = None if x0 is None else x0.detach().requires_grad_(True)
            if together:
                barrier.wait()
            t0 = time.thread_time()
            y = mod(x, inputs)
            t1 = time.thread_time()
            if together:
                barrier.wait()
            t2 = time.thread_time()
            y.backward() if grad is None else y.backward(grad)
            t3 = time.thread_time()
            if r >= 2:
                fwd.append(t1 - t0)
                bwd.append(t3 - t2)
        out[(rows, length)] = (statistics.median(fwd), statistics.median(bwd))
    queue.put((stage, out))


def measure(together: bool, repeats: int, model: str) -> dict[int, dict]:
    """Per stage, per shape: median (forward, backward) thread seconds."""
    ctx = mp.get_context("spawn")
    queue, barrier = ctx.Queue(), ctx.Barrier(2)
    results = {}
    groups = [[0, 1]] if together else [[0], [1]]
    for group in groups:
        procs = [ctx.Process(target=_worker, args=(s, barrier, queue, together, repeats, model)) for s in group]
        for p in procs:
            p.start()
        for _ in group:
            stage, out = queue.get()
            results[stage] = out
        for p in procs:
            p.join()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--model", default="small")
    args = ap.parse_args()
    alone, together = measure(False, args.repeats, args.model), measure(True, args.repeats, args.model)
    for stage in (0, 1):
        for shape in SHAPES:
            a, c = alone[stage][shape], together[stage][shape]
            print(f"stage {stage} {shape[0]:2d} x {shape[1]:4d}: concurrent / alone  F {c[0] / a[0]:.2f}  "
                  f"B {c[1] / a[1]:.2f}   (alone F {a[0] * 1e3:.1f} ms, B {a[1] * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
