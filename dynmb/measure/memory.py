"""Measure the memory of one microbatch through one stage, and of a grid of them (``dynmb memory``).

``measure_stage_memory``: build the stage (through the model's ``StageFactory``: a ``ModelConfig`` of
dynmb's families or any factory of the stage contract, ``dynmb.models.resolve_model``; the one place
this module builds one; sizes and attention from ``planning_config(factory)``), a synthetic microbatch of full rows (``full_microbatch``: one document per row,
``docs_per_row`` documents splitting each row, or two with ``packed``) and, on a stage after the
first, a received hidden state; then forward and backward once. Three numbers come back:

- ``state_bytes``: parameters + gradients + Adam's two fp32 states;
- ``act_bytes``: what the forward left held for the backward (the received hidden state and the
  microbatch's inputs, a dense attention mask above all, count: the runtime holds them from the
  forward to the backward);
- ``peak_bytes``: the highest bytes through forward and backward.

On a device with allocator statistics (CUDA, ``DeviceOps.allocator_stats``) these are read from
the allocator: gradients and Adam states are allocated first, the peak reset, and the allocated
bytes read after the forward and at the end (synchronising first). On CPU the ``MemoryMeter``
accounts storages (see ``dynmb.runtime.meter``). ``measure_grid`` runs every stage at every
(rows, padded_len) of a grid and returns tidy rows, what ``dynmb memory`` fits the memory model on.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any, Sequence, cast

import torch

from dynmb.models import full_microbatch, make_inputs, synthetic_tokens, torch_dtype
from dynmb.models.contract import planning_config, resolve_model
from dynmb.runtime.device import device_ops
from dynmb.runtime.meter import MemoryMeter, tensor_bytes

__all__ = ["measure_stage_memory", "MemoryProbe", "measure_grid"]


@dataclass(frozen=True, kw_only=True)
class MemoryProbe:
    """``measure_stage_memory``'s settings (its keywords)."""

    packed: bool = False
    device: Any = "cpu"
    seed: int = 0
    docs_per_row: int | None = None


def measure_stage_memory(model_cfg: Any, num_stages: int, stage: int, rows: int, padded_len: int,
                         probe: MemoryProbe = MemoryProbe(), **keywords: Any) -> dict[str, int]:
    """One microbatch (rows x padded_len) through one stage, forward then backward, with
    Adam states; attention as ``model_cfg.attention`` says. Rows are full: one document
    each, ``docs_per_row`` documents splitting the row as evenly as possible
    (``full_microbatch``), or two with ``packed``. Returns ``state_bytes`` (params + grads
    + optimizer), ``act_bytes`` (held after the forward) and ``peak_bytes``. Settings: ``MemoryProbe``
    fields and/or keywords (``packed=False, device="cpu", seed=0, docs_per_row=None``; keywords win)."""
    probe = replace(probe, **keywords)
    packed, seed, docs_per_row = probe.packed, probe.seed, probe.docs_per_row
    dev = torch.device(probe.device)
    b, s = int(rows), int(padded_len)
    docs = docs_per_row if docs_per_row is not None else 2 if packed and s >= 2 else 1
    mb = full_microbatch(b, s, docs)
    lens = mb.lengths
    factory = resolve_model(model_cfg)
    model_cfg = planning_config(factory)
    mod = cast(torch.nn.Module, factory.build_stage(stage, num_stages, seed=seed, device=dev))   # a stage is a Module
    mod.zero_grad(set_to_none=True)      # a factory's stages may share modules: no gradient left from before
    inputs = make_inputs(mb, synthetic_tokens(lens, model_cfg.vocab_size, seed), cfg=model_cfg, device=dev)
    x = None
    if stage > 0:
        x = torch.randn(b, s, model_cfg.message_channels(stage - 1, num_stages), dtype=torch_dtype(model_cfg),
                        device=dev, requires_grad=True)
    ops = device_ops(dev)
    if ops.allocator_stats:
        for p in mod.parameters():
            p.grad = torch.zeros_like(p)
        opt_states = [torch.zeros(p.shape, dtype=torch.float32, device=dev) for p in mod.parameters() for _ in range(2)]
        ops.synchronize()
        base = int(ops.allocated_bytes() or 0)
        ops.reset_peak()
        # the received hidden state and the microbatch's inputs (a dense b x s x s attention
        # mask above all) are held by the runtime from the forward to the backward: activation bytes
        state = base - (tensor_bytes(x) if x is not None else 0) - sum(tensor_bytes(t) for t in inputs.tensors())
        out = mod(x, inputs)
        ops.synchronize()
        act = int(ops.allocated_bytes() or 0) - state
        out.backward(torch.ones_like(out) if out.dim() else None)
        ops.synchronize()
        peak = int(ops.peak_allocated_bytes() or 0)
        del opt_states
        return {"state_bytes": int(state), "act_bytes": int(act), "peak_bytes": int(peak)}
    meter = MemoryMeter(dev, [mod], optimizer=None, optimizer_kind="adam")
    try:
        meter.reset_peak()
        with meter.saving(stage):
            out = mod(x, inputs)
        if x is not None:
            meter.hold([x], stage)           # the received message, held to its backward (as the runtime does)
        act = meter.current_bytes - meter.state_bytes
        grad = torch.ones_like(out) if out.dim() else None
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            out.backward(grad)
        del out, grad
        meter.sample(stage)
        return {"state_bytes": int(meter.state_bytes), "act_bytes": int(act), "peak_bytes": int(meter.peak_bytes)}
    finally:
        meter.close()


def measure_grid(model_cfg: Any, num_stages: int, rows: Sequence[int], padded_lens: Sequence[int],
                 device: Any = "cpu", packed: bool = False) -> list[dict[str, Any]]:
    """``measure_stage_memory`` for every stage and (rows, padded_len) of the grid: tidy rows
    (stage, rows, padded_len, packed, device, state_bytes, act_bytes, peak_bytes)."""
    out = []
    for st in range(num_stages):
        for b in rows:
            for s in padded_lens:
                r = measure_stage_memory(model_cfg, num_stages, st, b, s, packed=packed, device=device)
                out.append({"stage": st, "rows": int(b), "padded_len": int(s), "packed": packed,
                            "device": str(device), **r})
    return out
