"""Activation offload on one device: exactness, the peak it saves, and the host-copy bandwidth it relies on.

The first stage of a two-stage ``--model`` runs ``--microbatches`` equal microbatches under GPipe's order (every
forward, then every backward: the most in flight) through the runtime's interpreter (``run_actions``), once plain
and once with ``offload_blocks`` = every block of the stage (``dynmb.runtime.offload``), and reports:

- ``exact``: every parameter gradient equal bit for bit between the two runs (``max_diff`` 0); ``plain_max_diff``:
  a second plain run's difference from the first (a GPU's attention backward may not repeat bitwise: then the
  offload run passes within 10x that);
- ``peak_plain`` / ``peak_offload``: the step's peak (CUDA: ``torch.cuda.max_memory_allocated``; CPU: the memory
  meter's accounting), ``offloaded_bytes`` (``OffloadStats``), and the bytes off the device where the plain run
  peaks, between ``(m - 2) / m`` of the offloaded (at the first backward microbatch 1 is being reloaded) and
  ``(m - 1) / m`` (at the last forward microbatch 0 is); stage 1 is a stand-in that returns a constant gradient;
- ``d2h_gbps`` / ``h2d_gbps``: the copy engine's own copies (pinned buffers, the copy stream) of ``--copy-mib`` MiB,
  median of 5 (the cost model's host-link bandwidth is an assumption this measures; CPU: a memory copy).

Writes one JSON to ``--out`` and prints it; exits 1 when the gradients differ (beyond a plain rerun's difference
where that is not 0), a reload came late or, on CUDA,
when the peak saved is outside ``[0.9 saving_low, 1.1 saving_high]``.

    python3 benchmarks/offload_check.py --device cuda --model gpt2 --out results/offload.json
    python3 benchmarks/offload_check.py --device cpu --model tiny --microbatches 3 --length 32 --copy-mib 8 --out o.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import cast

import numpy as np
import torch

from dynmb.core.config import ModelConfig, model_config
from dynmb.core.types import Microbatch, Plan
from dynmb.models import build_stages, make_inputs, synthetic_tokens
from dynmb.planning import make_schedule
from dynmb.runtime.comm import P2P
from dynmb.runtime.device import device_ops
from dynmb.runtime.interpreter import ActionContext, run_actions
from dynmb.runtime.meter import MemoryMeter
from dynmb.runtime.offload import OffloadSession


@dataclass
class Report:
    device: str
    model: str
    microbatches: int
    length: int
    blocks: int
    exact: bool
    max_diff: float
    plain_max_diff: float
    peak_plain: int
    peak_offload: int
    offloaded_bytes: int
    saving_low: int
    saving_high: int
    late_reloads: int
    d2h_gbps: float
    h2d_gbps: float


class _Loopback:
    """Stands in for stage 1: keeps the shape of each activation sent and returns a constant gradient of it."""

    def __init__(self) -> None:
        self.sent: dict[int, torch.Tensor] = {}

    def send(self, kind: str, stage: int, mb: int, t: torch.Tensor) -> None:
        self.sent[mb] = torch.empty_like(t, requires_grad=False)

    def recv(self, kind: str, stage: int, mb: int) -> tuple[torch.Tensor, None]:
        return self.sent.pop(mb).fill_(1e-3), None


def _step(cfg: ModelConfig, plan: Plan, device: torch.device, tokens: list) -> tuple[dict, int, int, int]:
    """(gradients, peak bytes, offloaded bytes, late reloads) of one step of ``plan``'s first stage."""
    gc.collect()                                  # the run before it freed (its modules and meter hold cycles)
    stage = build_stages(cfg, 2, seed=0, device=device)[0]
    meter = MemoryMeter(device, [stage])
    session = OffloadSession.for_plan(plan, {0: stage}, 0, device, meter)
    ops = device_ops(device)
    ops.synchronize()
    meter.reset_step()
    actions = list(make_schedule(replace(plan, num_stages=1), "gpipe").ranks[0])
    run_actions(actions, ActionContext(
        stages={0: stage}, plan=plan, inputs=lambda m: make_inputs(plan.microbatches[m], tokens, cfg=cfg, device=device),
        p2p=cast(P2P, _Loopback()), loss_scale=1.0, clock=ops, meter=meter, offload=session))
    stats = session.stats if session is not None else None        # run_actions finished it
    ops.synchronize()
    peak = meter.peak_bytes
    grads = {n: p.grad.detach().cpu() for n, p in stage.named_parameters() if p.grad is not None}   # off the device
    return grads, int(peak), sum(stats.bytes_by_stage.values()) if stats else 0, stats.late if stats else 0


def _bandwidth(device: torch.device, mib: int) -> tuple[float, float]:
    """Median GB/s of the copy engine's D2H and H2D copies of ``mib`` MiB."""
    copies = device_ops(device).copies()
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device).fill_(1)
    host = copies.host_buffer(src.numel())
    d2h, h2d = [], []
    ops = device_ops(device)
    for _ in range(6):
        ops.synchronize()
        t0 = time.perf_counter()
        copies.to_host(src, host)
        copies.synchronize()
        t1 = time.perf_counter()
        copies.to_device(host)
        copies.synchronize()
        t2 = time.perf_counter()
        d2h.append(src.numel() / (t1 - t0) / 1e9)
        h2d.append(src.numel() / (t2 - t1) / 1e9)
    return statistics.median(d2h[1:]), statistics.median(h2d[1:])


def _max_diff(a: dict, b: dict) -> float:
    """The largest absolute difference of two runs' gradients (inf when they hold other parameters)."""
    if a.keys() != b.keys():
        return float("inf")
    return max((float((a[k].double() - b[k].double()).abs().max()) for k in a), default=0.0)


def check(args: argparse.Namespace) -> Report:
    device = torch.device(args.device)
    cfg = model_config(args.model)
    n = args.microbatches
    lengths = np.full(n, args.length, dtype=np.int64)
    tokens = synthetic_tokens(lengths, cfg.vocab_size, seed=0)
    mbs = tuple(Microbatch([i], lengths[[i]], args.length, args.batch) for i in range(n))
    plan = Plan(microbatches=mbs, method="check", num_stages=2, memory_limit_bytes=1 << 40, num_sequences=n)
    blocks = len(cfg.stage_blocks(2)[0])
    plain, again = _step(cfg, plan, device, tokens), _step(cfg, plan, device, tokens)
    off = _step(cfg, replace(plan, meta=plan.meta.with_(offload_blocks=[blocks, 0])), device, tokens)
    d2h, h2d = _bandwidth(device, args.copy_mib)
    return Report(device=str(device), model=args.model, microbatches=n, length=args.length, blocks=blocks,
                  exact=_max_diff(plain[0], off[0]) == 0.0, max_diff=_max_diff(plain[0], off[0]),
                  plain_max_diff=_max_diff(plain[0], again[0]),
                  peak_plain=plain[1], peak_offload=off[1], offloaded_bytes=off[2],
                  saving_low=off[2] * (n - 2) // n, saving_high=off[2] * (n - 1) // n, late_reloads=off[3],
                  d2h_gbps=d2h, h2d_gbps=h2d)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda or cpu")
    p.add_argument("--model", default="gpt2", help="a model preset (ModelConfig spec)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches in flight (GPipe order)")
    p.add_argument("--length", type=int, default=1024, help="tokens per row")
    p.add_argument("--batch", type=int, default=2, help="rows per microbatch")
    p.add_argument("--copy-mib", type=int, default=256, help="MiB per bandwidth copy")
    p.add_argument("--out", type=Path, required=True, help="the JSON report")
    args = p.parse_args(argv)
    report = check(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(asdict(report), indent=1) + "\n")
    print(json.dumps(asdict(report)))
    saved = report.peak_plain - report.peak_offload
    # bitwise where the device's kernels repeat a run bitwise, else within the run-to-run difference
    exact = report.exact or (report.plain_max_diff > 0 and report.max_diff <= 10 * report.plain_max_diff)
    ok = exact and report.late_reloads == 0
    if report.device.startswith("cuda"):
        ok = ok and 0.9 * report.saving_low <= saved <= 1.1 * report.saving_high
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
