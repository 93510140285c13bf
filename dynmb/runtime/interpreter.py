"""Execute one rank's actions of a validated Schedule: forward, backward, P2P, timing.

Algorithm (one step, one rank; stage ``s`` lives on pipeline rank ``s % R``)
----------------------------------------------------------------------------
For each action in the rank's list, in order:

- ``sFm`` (forward): stage 0 embeds microbatch m's tokens; any other stage
  receives the activation ``("act", s, m)`` (shape known from the plan), marks it
  as requiring grad and runs the stage (with full recomputation per block when the
  microbatch has ``recompute``; ``dynmb.models.RecomputedBlock``). It keeps ``(input,
  output)`` for the backward and sends the output on to stage ``s + 1`` (a local handoff
  when that stage is on this rank). When the rank's actions split that microbatch's
  backward (an ``sIm``), the forward records its Linear calls for ``W``
  (``dynmb.runtime.splitbackward.record_linears``). The last stage's output is the summed cross-entropy of
  the microbatch, scaled by ``loss_scale`` = 1 / real tokens of the whole global
  batch over all DP replicas, so gradients equal the single-process mean loss.
- ``sBm`` (backward): the last stage back-propagates its scaled loss; others
  receive ``("grad", s, m)`` and call ``torch.autograd.backward(output, grad)``.
  The input's gradient goes back to stage ``s - 1`` and both tensors are freed.
  Gradients accumulate in ``.grad`` across microbatches.
- ``sIm`` (backward input): like ``B`` it receives the gradient and sends the input's
  gradient back, but computes only it (and the cheap non-Linear parameter gradients),
  keeping each Linear call's input and output gradient for ``W``; the memory meter holds
  them (``MemoryMeter.hold``) until ``W`` frees them. A recomputed microbatch runs its
  whole backward here (its ``W`` is then empty).
- ``sWm`` (backward weight): the deferred Linear weight gradients of ``sIm``
  (``splitbackward.backward_weight``); no communication.
- Slices of long sequences (``dynmb.models.prefix``): a microbatch's backward (``B``, or ``I``) adds its
  continued slices' keys and values, with the gradients later slices left on their leaves, as
  extra roots (``PrefixStore.backward_roots``), then releases them (``PrefixStore.release``
  refuses a backward that runs before a later slice's). An ``I`` also accumulates the gradients
  of the earlier slices' leaves it read (``PrefixStore.read_leaves``), which a full ``B`` does
  by itself, so the earlier slice's ``I`` (after it on the stage, the schedule's reverse slice
  order) finds them complete; ``W`` is unchanged (``dynmb.runtime.splitbackward``).

Backwards (``B``, ``I``) run inside the meter's saved-tensor context, so the activations a
recomputing backward re-creates are accounted as they are.

Timing: three clock marks per action: before the receive, after it (compute
start), after the compute, on the device's clock (``dynmb.runtime.device``: ``perf_counter``
on CPU, CUDA events read after the step's final synchronisation on CUDA).
``wait_s`` is the receive wait, ``start_s``/``end_s`` bound the compute relative
to the step start. The memory meter (``runtime.meter.MemoryMeter``) accounts each
forward's and backward's saved tensors (``saving``) and is sampled after every action.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, cast

import torch

from dynmb.models.prefix import PrefixStore
from dynmb.runtime.comm import P2P
from dynmb.runtime.device import Clock
from dynmb.runtime.splitbackward import WeightGradTape, backward_input, backward_weight, full_backward, record_linears
from dynmb.core.types import Action, Plan

__all__ = ["ActionTiming", "run_actions"]


@dataclass
class ActionTiming:
    action: Action
    t_recv: Any      # before waiting for the input
    t_start: Any     # compute start
    t_end: Any       # compute end
    cpu_s: float | None = None   # thread CPU seconds from compute start to end (CPU only)


def _layers(mod: torch.nn.Module) -> list[float]:
    """A stage's attention layers (``DecoderStage.layers``): the keys of its prefix store."""
    return cast("list[float]", mod.layers)


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
    prefix: PrefixStore | None = None,
) -> tuple[list[ActionTiming], float]:
    """Run ``actions`` (this rank's list) and return their timings and the summed scaled loss.

    ``stages``: stage index -> module held by this rank; ``plan``: this DP
    replica's plan (``plan.microbatches[m]`` is microbatch m of the schedule);
    ``inputs(m)``: the ``MicrobatchInputs`` of microbatch m on this device;
    ``meter``: optional memory meter (``saving(stage)`` context for forwards,
    ``sample(stage)`` after each action); ``on_action(i, action)``: called
    before each action (fault injection in tests); ``prefix``: the step's store of slices'
    keys and values (the one ``inputs`` hands the model), None when the plan has no slices.
    """
    last = plan.num_stages - 1
    saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
    split = {(a.stage, a.mb) for a in actions if a.op == "I"}
    tapes: dict[tuple[int, int], WeightGradTape | None] = {}
    recompute = [bool(mb.recompute) for mb in plan.microbatches]
    sliced = [mb.has_slices for mb in plan.microbatches]
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
            t_start, cpu_start = clock.mark(), clock.cpu()
            ctx = meter.saving(s) if meter is not None else nullcontext()
            record = record_linears(mod) if (s, m) in split and not recompute[m] else nullcontext()
            with ctx, record as tape:
                out = mod(x, inp, recompute=True) if recompute[m] else mod(x, inp)
                if s == last:
                    out = out * loss_scale
            saved[(s, m)] = (x, out)
            if meter is not None and x is not None:
                meter.hold([x], s)           # held to its backward: not always saved (a piece's bucketed h)
            tapes[(s, m)] = tape
            if sliced[m] and prefix is not None and meter is not None:
                meter.hold(prefix.held_tensors(_layers(mod)), s)
            del inp
            if s == last:
                losses.append(out.detach())
            else:
                p2p.send("act", s + 1, m, out)
        elif a.op in ("B", "I"):
            x, out = saved.pop((s, m))
            tape = tapes.pop((s, m), None)
            grad = None
            if s < last:
                grad, _ = p2p.recv("grad", s, m)
            t_start, cpu_start = clock.mark(), clock.cpu()
            ctx = meter.saving(s) if meter is not None else nullcontext()
            with ctx:
                if sliced[m] and prefix is not None:
                    roots = prefix.backward_roots(_layers(mod), m)
                    if a.op == "I" and tape is not None:
                        dx = backward_input(mod, out, grad, x, tape, roots, prefix.read_leaves(_layers(mod), m))
                    else:
                        dx = full_backward(out, grad, x, roots)
                    del roots
                    prefix.release(_layers(mod), m)
                    if meter is not None:
                        meter.hold(prefix.held_tensors(_layers(mod)), s)
                elif a.op == "I" and tape is not None:
                    dx = backward_input(mod, out, grad, x, tape)
                else:
                    dx = full_backward(out, grad, x)
            if s > 0:
                assert dx is not None
                p2p.send("grad", s - 1, m, dx)
            del x, out, grad, dx
            if a.op == "I":
                tapes[(s, m)] = tape
                if tape is not None and meter is not None:
                    meter.hold(tape.hold_tensors(), s)
        else:  # "W": the deferred Linear weight gradients
            tape = tapes.pop((s, m), None)
            t_start, cpu_start = clock.mark(), clock.cpu()
            if tape is not None:
                backward_weight(tape)
            del tape
        t_end, cpu_end = clock.mark(), clock.cpu()
        if meter is not None:
            meter.sample(s)
        timings.append(ActionTiming(a, t_recv, t_start, t_end,
                                    None if cpu_start is None or cpu_end is None else cpu_end - cpu_start))
    if saved:
        raise RuntimeError(f"actions left activations without a backward: {sorted(saved)[:6]}")
    if any(t is not None and t.calls for t in tapes.values()):
        raise RuntimeError(f"actions left weight gradients without a W: {sorted(tapes)[:6]}")
    if losses:
        loss = float(torch.stack(losses).sum())
    return timings, loss
