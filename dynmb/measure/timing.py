"""Time one stage's forward and backward (and, with ``split``, its split backward) on one microbatch.

Each run builds a fresh graph and is timed op by op on the device's timer
(``dynmb.runtime.device.DeviceOps.timer``: CUDA events on a GPU; on CPU the calling thread's CPU
time with ``clock="thread"``, else wall time)::

    x  = fresh leaf hidden state (requires_grad, as a pipeline receiver holds it)
    F  = time(y = stage(x, inputs))
    B  = time(y.backward(g))      # g: a fixed random grad of y (non-last), or loss.backward()

so backward is timed alone on its own graph; parameter gradients accumulate as over the
microbatches of a step. With ``split`` a second fresh graph times what a zero-bubble schedule
runs (``dynmb.runtime.splitbackward``)::

    y  = stage(x, inputs)         # recording the Linear calls, untimed
    I  = time(backward_input(y))  # the input's gradient (+ LayerNorm, embedding, bias grads)
    W  = time(backward_weight())  # the deferred Linear weight gradients

The hidden state and its gradient come from a CPU generator seeded by the microbatch's shape.
"""

from __future__ import annotations

from typing import Any

import torch

from dynmb.runtime.device import device_ops
from dynmb.runtime.splitbackward import backward_input, backward_weight, record_linears

__all__ = ["time_stage"]


def _widths(stage_mod: Any, d: int) -> tuple[int, int]:
    """Channels a stage receives and sends: ``d``, or a dynmb stage's ``cfg.message_channels`` (head shards)."""
    cfg = getattr(stage_mod, "cfg", None)
    if cfg is None or not hasattr(cfg, "message_channels"):
        return d, d
    s, n = int(stage_mod.stage), int(stage_mod.num_stages)
    return (cfg.message_channels(s - 1, n) if s > 0 else d), cfg.message_channels(s, n)


def time_stage(stage_mod: torch.nn.Module, inputs: Any, *, hidden_size: int, repeats: int = 5, warmup: int = 2,
               device: str | torch.device = "cpu", clock: str = "thread", split: bool = False) -> list[tuple[float, ...]]:
    """``repeats`` (forward_s, backward_s, forward_wall_s, backward_wall_s) of ``stage_mod`` (a stage of the
    stage contract: ``is_first``, ``is_last``) on ``inputs``; ``hidden_size``: the width of the hidden state
    it receives and sends (the model's ``d_model``; a dynmb stage next to a head shard receives or sends
    its ``cfg.message_channels``). With ``split`` each tuple goes on with (input_grad_s,
    weight_grad_s, input_grad_wall_s, weight_grad_wall_s)."""
    device = torch.device(device)
    timed = device_ops(device).timer(clock)
    b, s = inputs.shape
    d_in, d_out = _widths(stage_mod, int(hidden_size))
    dtype = next(stage_mod.parameters()).dtype
    gen = torch.Generator(device="cpu").manual_seed(b * 7919 + s)
    x0 = None if stage_mod.is_first else torch.randn(b, s, d_in, generator=gen).to(device=device, dtype=dtype)
    g = None if stage_mod.is_last else (torch.randn(b, s, d_out, generator=gen) * 1e-3).to(device=device, dtype=dtype)
    stage_mod.train()
    out = []
    for i in range(warmup + repeats):
        x = None if x0 is None else x0.detach().requires_grad_(True)
        # bound now: x and y are deleted below (mypy cannot type a lambda with default arguments)
        y, tf, wf = timed(lambda x=x: stage_mod(x, inputs))  # type: ignore[misc]
        _, tb, wb = timed(lambda y=y: y.backward() if g is None else y.backward(g))  # type: ignore[misc]
        del y, x
        times: tuple[float, ...] = (tf, tb, wf, wb)
        if split:
            x = None if x0 is None else x0.detach().requires_grad_(True)
            with record_linears(stage_mod) as tape:
                y = stage_mod(x, inputs)
            _, ti, wi = timed(lambda: backward_input(stage_mod, y, g, x, tape))
            _, tw, ww = timed(lambda: backward_weight(tape))
            del y, x
            times += (ti, tw, wi, ww)
        if i >= warmup:
            out.append(times)
    return out

