"""How much a recomputed microbatch's forward really holds at its peak, against the memory model.

The memory model charges a recomputed microbatch (``--recompute``) its recompute transient (one
block's activations, ``memory_coef.recompute_transient_coef``) while its forward AND its backward
run. The backward re-creates one block's activations for sure; the forward runs each block without
saving, so what it holds at once is the open question (studies/slicing/notes.md). The CPU
meter samples only at forward ends and cannot answer it; a CUDA allocator's peak can.

For each stage of ``--model`` over 2 stages and each length: the device peak during one recomputed
forward (CUDA: ``torch.cuda.max_memory_allocated`` above what was allocated before it; CPU: the
meter, which misses the forward's intermediates), beside the model's recomputed activation bytes
plus the plain transient and plus the recompute transient. One line per (stage, length).

    python -m studies.zerobubble.recompute_peak --device cuda --model gpt2 --lengths 1024,4096
"""

from __future__ import annotations

import argparse

import torch

from dynmb.core.config import model_config
from dynmb.memory.model import get_memory_model
from dynmb.core.microbatch import Microbatch
from dynmb.models import build_stage, make_inputs, synthetic_tokens
from dynmb.runtime.meter import MemoryMeter


def forward_peak(stage_module, x, inputs, device: torch.device, stage: int) -> int:
    """Bytes above the start while one recomputed forward runs (CUDA allocator; CPU meter)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        stage_module(x, inputs, recompute=True)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    meter = MemoryMeter("cpu", [stage_module])
    meter.reset_peak()
    with meter.saving(stage):
        stage_module(x, inputs, recompute=True)
    peak = meter.peak_bytes - meter.state_bytes
    meter.close()
    return peak


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lengths", default="1024,4096")
    args = ap.parse_args(argv)
    device, cfg, P = torch.device(args.device), model_config(args.model), 2
    mm = get_memory_model(None, cfg, P)
    for stage in range(P):
        module = build_stage(cfg, stage, P, device=device)
        for s in (int(x) for x in args.lengths.split(",")):
            mb = Microbatch(seq_ids=[0], lengths=[s], padded_len=s, batch=1)
            inputs = make_inputs(mb, synthetic_tokens(mb.lengths, cfg.vocab_size), cfg=cfg, device=device)
            x = None if stage == 0 else torch.randn(1, s, cfg.d_model, device=device, requires_grad=True)
            peak = forward_peak(module, x, inputs, device, stage)
            act = float(mm.activation_bytes(stage, 1, s, recompute=True)[0])
            plain = float(mm.transient_bytes(stage, 1, s, recompute=False)[0])
            rc = float(mm.transient_bytes(stage, 1, s, recompute=True)[0])
            print(f"{args.model} {device.type} stage {stage} len {s}: recomputed forward peak {peak / 2**20:.1f} MiB; "
                  f"model act + plain transient {(act + plain) / 2**20:.1f}, act + recompute transient "
                  f"{(act + rc) / 2**20:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
