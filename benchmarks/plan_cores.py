"""Plan time of one pipeline replica with ``schedule="auto"`` and the planner cores ``--plan-ahead`` needs.

For each P: ``dynmb.Planner`` (Llama-2-7B by default, ``GPUCostModel`` with H100 constants, 80 GiB,
``schedule="auto"``, method ``dynamic``) plans a warm-up batch, then ``--batches`` batches of about
``--tokens`` tokens sampled from ``--trace`` (documents capped at ``--max-len``); each plan's CPU time
(``time.process_time``: this process only, so a loaded box inflates it little) and the plan's simulated
step. With ``--plan-ahead N`` the job's W = P ranks (one replica) share the planning (rank k mod W plans
step k), so no step waits while ``plan_s <= N W step_s``: the planner cores a rank needs are
``plan_s / (P step_s)`` (``cores_per_rank``); planning in line, or without sharing, ``plan_s / step_s``.
``--full-check``: ``dynamic``'s final check schedules and simulates every candidate
(``dynmb.planning.planner.unpruned_final_check``), as before it pruned by ``step_floor``: run both for a
paired before / after on the same box. ``--unremembered``: the planner and ``lockstep`` remember nothing
(``dynmb.planning.planner.unremembered``: no fills, cost lookups, schedules or simulations reused), the plan time
before they did, the same plans.

    python benchmarks/plan_cores.py --stages 4,8,16              # ~2 min
    python benchmarks/plan_cores.py --stages 16 --full-check     # without the final check's pruning
    python benchmarks/plan_cores.py --stages 16 --unremembered   # without remembering (the same plans)
    python benchmarks/plan_cores.py --stages 16 --breakdown      # where a P 16 plan's CPU goes

``--breakdown``: the timed plans sampled every 5 ms of this process's CPU (``signal.ITIMER_PROF``); a sample counts
toward every part of ``PARTS`` on its stack (the parts overlap: the final check's floors run the zb estimate, the
packers run it and the simulator), printed as shares of the samples.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import signal
import time
from types import FrameType
from typing import Iterator

import numpy as np

import dynmb
from dynmb import data
from dynmb.costmodel.gpu import GPUCostModel
from dynmb.planning import planner as planning


PARTS = {
    "zb list scheduler": ("schedule/zerobubble.py", "_run_list"),
    "zb estimate": ("timing/makespan_zb.py", "zb_makespans"),
    "final check's floors": ("planning/search.py", "step_floor"),
    "packing (every method)": ("packing/dispatch.py", "pack"),
    "  dynamic's packer": ("packing/dynamic/pack.py", "dynamic_groups"),
    "  lockstep": ("packing/lockstep.py", "plan_lockstep"),
    "reorder search": ("planning/reorder.py", "reorder"),
    "simulation": ("timing/simulate.py", "simulate"),
    "cost lookups": ("costmodel/base.py", "plan_costs"),
}
"""Part of a plan -> (file, function) whose frames on the stack mark it (``--breakdown``)."""


class Breakdown:
    """CPU samples of this process (``signal.ITIMER_PROF``), counted per part of ``PARTS`` on the sampled stack."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s, self.samples, self.parts = interval_s, 0, collections.Counter[str]()
        self.marks = {(f, fn): part for part, (f, fn) in PARTS.items()}

    def _sample(self, signum: int, frame: FrameType | None) -> None:
        self.samples += 1
        seen = set()
        while frame is not None:
            code = frame.f_code
            part = self.marks.get(("/".join(code.co_filename.split("/")[-2:]), code.co_name)) or \
                self.marks.get(("/".join(code.co_filename.split("/")[-3:]), code.co_name))
            if part is not None and part not in seen:
                seen.add(part)
                self.parts[part] += 1
            frame = frame.f_back

    @contextlib.contextmanager
    def sampling(self) -> Iterator[None]:
        signal.signal(signal.SIGPROF, self._sample)
        signal.setitimer(signal.ITIMER_PROF, self.interval_s, self.interval_s)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0, 0)

    def report(self) -> str:
        return f"  {self.samples} samples: " + ", ".join(
            f"{part.strip()} {100 * self.parts[part] / max(1, self.samples):.0f}%" for part in PARTS)


def batch(lengths: np.ndarray, tokens: int, max_len: int, seed: int) -> np.ndarray:
    """Documents drawn with replacement until ``tokens``, each capped at ``max_len``."""
    rng, out, total = np.random.default_rng(seed), [], 0
    while total < tokens:
        x = min(int(lengths[rng.integers(len(lengths))]), max_len)
        out.append(x)
        total += x
    return np.array(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", default="4,8,16", help="comma-separated P (default 4,8,16)")
    ap.add_argument("--model", default="llama2-7b", help="model preset (default llama2-7b)")
    ap.add_argument("--trace", default="sharegpt", help="length trace (default sharegpt)")
    ap.add_argument("--tokens", type=int, default=500_000, help="tokens per replica's batch (default 500000)")
    ap.add_argument("--max-len", type=int, default=4096, help="document length cap (default 4096)")
    ap.add_argument("--batches", type=int, default=2, help="timed batches per P (default 2)")
    ap.add_argument("--full-check", action="store_true",
                    help="simulate every candidate of dynamic's final check (no pruning by step_floor)")
    ap.add_argument("--unremembered", action="store_true",
                    help="remember no fills, cost lookups, schedules or simulations (the same plans, as before)")
    ap.add_argument("--breakdown", action="store_true", help="where the timed plans' CPU goes (PARTS, sampled)")
    args = ap.parse_args()
    cfg, lengths = dynmb.model_config(args.model), data.load_trace(args.trace)
    with contextlib.ExitStack() as stack:
        if args.full_check:
            stack.enter_context(planning.unpruned_final_check())
        if args.unremembered:
            stack.enter_context(planning.unremembered())
        run(args, cfg, lengths)


def run(args: argparse.Namespace, cfg: dynmb.ModelConfig, lengths: np.ndarray) -> None:
    """The table: one row per P (module doc)."""
    print("P  plan_cpu_s (each batch)  kind  microbatches  step_s  cores_per_rank  cores_unshared")
    for P in (int(p) for p in args.stages.split(",")):
        planner = dynmb.Planner(model=cfg, num_stages=P, memory_limit="80GiB", cost_model=GPUCostModel(cfg, P),
                                schedule="auto")
        planner.plan(batch(lengths, args.tokens, args.max_len, 0), method="dynamic")       # warm caches
        times, step, sampled = [], None, Breakdown()
        for k in range(1, args.batches + 1):
            b = batch(lengths, args.tokens, args.max_len, k)
            with sampled.sampling() if args.breakdown else contextlib.nullcontext():
                t0 = time.process_time()
                step = planner.plan(b, method="dynamic")
                times.append(time.process_time() - t0)
        assert step is not None
        step_s = step.sim.makespan_s
        print(f"{P:<3d}{' '.join(f'{t:.2f}' for t in times):>24s}  {step.plan.schedule_kind:5s} "
              f"{step.plan.num_microbatches:12d}  {step_s:6.3f}  {max(times) / (P * step_s):14.3f}  "
              f"{max(times) / step_s:14.2f}")
        if args.breakdown:
            print(sampled.report())


if __name__ == "__main__":
    main()
