"""What the CPU meter sees a stage hold, checked against the analytic memory model, for the memory tests."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from dynmb.runtime.meter import MemoryMeter
from dynmb.runtime.splitbackward import backward_input, backward_weight, record_linears

__all__ = ["check_w_held"]


def check_w_held(st: torch.nn.Module, stage: int, num_stages: int, width: int, inputs: Any, mm: Any, b: int,
                 s: int) -> None:
    """Stage ``stage``'s bytes held from its ``I`` to its ``W`` (each Linear call's input and output gradient, on
    a ``b x s`` microbatch whose received message has ``width`` channels) are at most ``mm.w_matrix`` and at
    least 97% of it; then runs ``W`` and closes the meter."""
    meter = MemoryMeter("cpu", [st])
    x = None if stage == 0 else torch.randn(b, s, width, requires_grad=True)
    with meter.saving(stage), record_linears(st) as tape:
        y = st(x, inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        backward_input(st, y, None if stage == num_stages - 1 else torch.ones_like(y), x, tape)
    del y, x
    meter.hold(tape.hold_tensors(), stage)
    held = meter.current_bytes - meter.state_bytes
    w = float(mm.w_matrix([b], [s])[stage, 0])
    assert 0.97 * w <= held <= w, (stage, held, w)
    backward_weight(tape)
    meter.close()
