"""Execute one rank's actions of a validated Schedule: forward, backward, P2P, timing.

Algorithm (one step, one rank; stage ``s`` lives on pipeline rank ``s % R``)
----------------------------------------------------------------------------
For each action in the rank's list, in order:

- ``sFm`` (forward): stage 0 embeds microbatch m's tokens; any other stage
  receives the activation ``("act", s, m)`` (shape known from the plan), marks it
  as requiring grad and runs the stage. It keeps ``(input, output)`` for the
  backward and sends the output on to stage ``s + 1`` (a local handoff when that
  stage is on this rank). The last stage's output is the summed cross-entropy of
  the microbatch, scaled by ``loss_scale`` = 1 / real tokens of the whole global
  batch over all DP replicas, so gradients equal the single-process mean loss.
- ``sBm`` (backward): the last stage back-propagates its scaled loss; others
  receive ``("grad", s, m)`` and call ``torch.autograd.backward(output, grad)``.
  The input's gradient goes back to stage ``s - 1`` and both tensors are freed.
  Gradients accumulate in ``.grad`` across microbatches.
- ``sWm``: the builders here emit full backwards; a split weight-gradient
  action runs nothing (its B already computed the weight gradients) and is
  recorded with zero length.

Timing: three clock marks per action: before the receive, after it (compute
start), after the compute. On CPU the clock is ``perf_counter``; on CUDA it is
CUDA events, read after the step's final synchronisation (``Clock.resolve``).
``wait_s`` is the receive wait, ``start_s``/``end_s`` bound the compute relative
to the step start. The memory meter (``runtime.meter.MemoryMeter``) is told
where each forward begins and each backward ends.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from dynmb.runtime.comm import P2P
from dynmb.types import Action, Plan

__all__ = ["Clock", "ActionTiming", "run_actions"]


class Clock:
    """``perf_counter`` marks on CPU, CUDA events on a CUDA device (resolved after a sync)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a: Any, b: Any) -> float:
        """Seconds from mark ``a`` to mark ``b`` (after synchronisation on CUDA)."""
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


@dataclass
class ActionTiming:
    action: Action
    t_recv: Any      # before waiting for the input
    t_start: Any     # compute start
    t_end: Any       # compute end


def run_actions(
    actions: Sequence[Action],
    *,
    stages: Mapping[int, torch.nn.Module],
    plan: Plan,
    inputs: Callable[[int], Any],
    p2p: P2P,
    loss_scale: float,
    clock: Clock,
    meter: Any = None,
    on_action: Callable[[int, Action], None] | None = None,
) -> tuple[list[ActionTiming], float]:
    """Run ``actions`` (this rank's list) and return their timings and the summed scaled loss.

    ``stages``: stage index -> module held by this rank; ``plan``: this DP
    replica's plan (``plan.microbatches[m]`` is microbatch m of the schedule);
    ``inputs(m)``: the ``MicrobatchInputs`` of microbatch m on this device;
    ``meter``: optional memory meter (``saving(stage)`` context for forwards,
    ``sample(stage)`` after each action); ``on_action(i, action)``: called
    before each action (fault injection in tests).
    """
    last = plan.num_stages - 1
    saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
    timings: list[ActionTiming] = []
    loss = 0.0
    losses: list[torch.Tensor] = []
    for i, a in enumerate(actions):
        if on_action is not None:
            on_action(i, a)
        s, m = a.stage, a.mb
        mod = stages[s]
        # a forward's inputs (token ids, the attention mask) are built before the receive: the
        # work is neither wait nor the stage's compute, and it runs while the peer may still be busy
        inp = inputs(m) if a.op == "F" else None
        t_recv = clock.mark()
        if a.op == "F":
            x = None
            if s > 0:
                x, _ = p2p.recv("act", s, m)
                x.requires_grad_(True)
            t_start = clock.mark()
            ctx = meter.saving(s) if meter is not None else nullcontext()
            with ctx:
                out = mod(x, inp)
                if s == last:
                    out = out * loss_scale
            saved[(s, m)] = (x, out)
            del inp
            if s == last:
                losses.append(out.detach())
            else:
                p2p.send("act", s + 1, m, out)
        elif a.op == "B":
            x, out = saved.pop((s, m))
            grad = None
            if s < last:
                grad, _ = p2p.recv("grad", s, m)
            t_start = clock.mark()
            torch.autograd.backward(out, grad_tensors=grad)
            if s > 0:
                assert x is not None and x.grad is not None
                p2p.send("grad", s - 1, m, x.grad)
            del x, out, grad
        else:  # "W": weight grads were computed by the full backward
            t_start = clock.mark()
        t_end = clock.mark()
        if meter is not None:
            meter.sample(s)
        timings.append(ActionTiming(a, t_recv, t_start, t_end))
    if saved:
        raise RuntimeError(f"actions left activations without a backward: {sorted(saved)[:6]}")
    if losses:
        loss = float(torch.stack(losses).sum())
    return timings, loss
