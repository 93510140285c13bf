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
- With the embedding on the last rank (``ActionContext.num_stages`` one more than the plan's) the schedule's stage
  0 is the embedding alone (``dynmb.models.embedstage``): its ``F`` embeds without a graph (it keeps nothing) and
  sends the hidden state on; its ``B`` receives the gradient, redoes the lookup and back-propagates it into the
  table's gradient.
- ``sBm`` (backward): the last stage back-propagates its scaled loss; others
  receive ``("grad", s, m)`` and call ``torch.autograd.backward(output, grad)``.
  The input's gradient goes back to stage ``s - 1`` and both tensors are freed.
  Gradients accumulate in ``.grad`` across microbatches.
- ``sIm`` (backward input): like ``B`` it receives the gradient and sends the input's
  gradient back, but computes only it (and the cheap non-Linear parameter gradients),
  keeping each Linear call's input and output gradient for ``W``; the memory meter holds
  them (``MemoryMeter.hold``) until ``W`` frees them. A recomputed microbatch runs its
  whole backward here (its ``W`` is then empty). A stage's leading blocks that recompute in every
  microbatch (``ModelConfig.recompute_blocks``, ``DecoderStage.recomputed_blocks``) run their whole backward,
  weight gradients included, inside ``I`` too (``RecomputedBlock``'s nested backward): their forward runs
  without a graph, so the tape records only the other blocks' and the head's Linear calls, and ``W`` does those.
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

Activation offload (``ActionContext.offload``, the plan's ``offload_blocks``; ``dynmb.runtime.offload``): a
forward of an offloading stage runs its leading blocks under the session's saved-tensor hooks (the stage input
and a slice's carried keys and values stay on the device; the weight tape's Linear inputs go with their
storages); when the rank starts the action before a backward of such a stage (``prefetch_points``) the
session issues that microbatch's reload, and the backward waits for it (``before_backward``). After the last
action the session checks every copy done and every offloaded forward reloaded (``finish``).

Timing: three clock marks per action: before the receive, after it (compute
start), after the compute, on the device's clock (``dynmb.runtime.device``: ``perf_counter``
on CPU, CUDA events read after the step's final synchronisation on CUDA).
``wait_s`` is the receive wait, ``start_s``/``end_s`` bound the compute relative
to the step start. The memory meter (``runtime.meter.MemoryMeter``) accounts each
forward's and backward's saved tensors (``saving``) and is sampled after every action.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, cast

import torch

from dynmb.models.embedstage import is_embed_only
from dynmb.models.prefix import PrefixStore
from dynmb.runtime.comm import P2P
from dynmb.runtime.device import Clock
from dynmb.runtime.offload import OffloadSession, prefetch_points
from dynmb.runtime.splitbackward import WeightGradTape, backward_input, backward_weight, full_backward, record_linears
from dynmb.core.types import Action, Plan

__all__ = ["ActionContext", "ActionTiming", "run_actions"]


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


@dataclass(frozen=True)
class ActionContext:
    """What one rank's actions run against (``run_actions``).

    ``stages``: stage index -> module held by this rank; ``plan``: this DP replica's plan
    (``plan.microbatches[m]`` is microbatch m of the schedule); ``inputs(m)``: the
    ``MicrobatchInputs`` of microbatch m on this device; ``p2p``: the step's point-to-point
    channels; ``loss_scale``: the last stage's loss factor; ``clock``: the device's clock;
    ``meter``: optional memory meter (``saving(stage)`` context for forwards, ``sample(stage)``
    after each action); ``on_action(i, action)``: called before each action (fault injection in
    tests); ``prefix``: the step's store of slices' keys and values (the one ``inputs`` hands the
    model), None when the plan has no slices.
    """

    stages: Mapping[int, torch.nn.Module]
    plan: Plan
    inputs: Callable[[int], Any]
    p2p: P2P
    loss_scale: float
    clock: Clock
    meter: Any = None
    on_action: Callable[[int, Action], None] | None = None
    prefix: PrefixStore | None = None
    num_stages: int | None = None
    """The schedule's stages (None: the plan's); one more with the embedding on the last rank, whose stage 0 is
    the embedding alone (``dynmb.models.embedstage``)."""
    offload: OffloadSession | None = None
    """Activation offload to host memory of the plan's ``offload_blocks`` (``dynmb.runtime.offload``); None:
    none."""

    @property
    def last_stage(self) -> int:
        """The schedule's last stage, the one that returns the loss."""
        return (self.plan.num_stages if self.num_stages is None else self.num_stages) - 1


@dataclass
class _RankState:
    """The tensors one rank's actions hand each other within the step."""

    split: set[tuple[int, int]]          # (stage, mb) whose backward is split into I and W
    recompute: list[bool]                # per microbatch: recompute its blocks in the backward
    sliced: list[bool]                   # per microbatch: a slice of a long sequence
    saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = field(default_factory=dict)
    tapes: dict[tuple[int, int], WeightGradTape | None] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)


Marks = tuple[Any, Any, "float | None"]
"""(before the receive, compute start, thread CPU seconds at compute start) of one action."""


def _saving(ctx: ActionContext, stage: int) -> Any:
    """The meter's saved-tensor context for ``stage``, or a no-op one without a meter."""
    return ctx.meter.saving(stage) if ctx.meter is not None else nullcontext()


def _offloading(ctx: ActionContext, a: Action, x: torch.Tensor | None, tape: WeightGradTape | None) -> Any:
    """The offload context of forward ``a`` (``OffloadSession.forward``): the stage input and a slice's carried
    keys and values stay on the device; a no-op one without offload."""
    if ctx.offload is None or not ctx.offload.offloads(a.stage):
        return nullcontext()
    mod, prefix = ctx.stages[a.stage], ctx.prefix

    def keep() -> list[torch.Tensor]:
        carried = prefix.held_tensors(_layers(mod)) if prefix is not None else []
        return ([x] if x is not None else []) + list(carried)
    return ctx.offload.forward((a.stage, a.mb), mod, keep, tape)


def _forward(ctx: ActionContext, st: _RankState, a: Action) -> Marks:
    """``sFm``: receive (or embed), run the stage, keep (input, output), send the output on."""
    s, m = a.stage, a.mb
    mod, last = ctx.stages[s], ctx.last_stage
    # a forward's inputs (token ids, the attention mask) are built before the receive: the
    # work is neither wait nor the stage's compute, and it runs while the peer may still be busy
    inp = ctx.inputs(m)
    t_recv = ctx.clock.mark()
    x = None
    if s > 0:
        x, _ = ctx.p2p.recv("act", s, m)
        x.requires_grad_(True)
    t_start, cpu_start = ctx.clock.mark(), ctx.clock.cpu()
    saving = _saving(ctx, s)
    record = record_linears(mod) if (s, m) in st.split and not st.recompute[m] else nullcontext()
    embed_only = is_embed_only(mod)           # the embedding stage keeps nothing: its backward redoes the lookup
    with saving, record as tape, torch.no_grad() if embed_only else nullcontext(), _offloading(ctx, a, x, tape):
        out = mod(x, inp, recompute=True) if st.recompute[m] and not embed_only else mod(x, inp)
        if s == last:
            out = out * ctx.loss_scale
    st.saved[(s, m)] = (x, out if not embed_only else out.new_empty(0))
    if ctx.meter is not None and x is not None:
        ctx.meter.hold([x], s)           # held to its backward: not always saved (a piece's bucketed h)
    st.tapes[(s, m)] = tape
    if st.sliced[m] and ctx.prefix is not None and ctx.meter is not None:
        ctx.meter.hold(ctx.prefix.held_tensors(_layers(mod)), s)
    del inp
    if s == last:
        st.losses.append(out.detach())
    else:
        ctx.p2p.send("act", s + 1, m, out)
    return t_recv, t_start, cpu_start


def _input_gradient(ctx: ActionContext, a: Action, sliced: bool, saved: tuple[torch.Tensor | None, torch.Tensor],
                    grad: torch.Tensor | None, tape: WeightGradTape | None) -> torch.Tensor | None:
    """The backward (``B``) or backward-input (``I``) of ``a`` from its ``saved`` (input, output) and
    the output's ``grad``: the input's gradient; a slice (``sliced``) adds its prefix store's roots."""
    x, out = saved
    mod, prefix = ctx.stages[a.stage], ctx.prefix
    if not (sliced and prefix is not None):
        return backward_input(mod, out, grad, x, tape) if a.op == "I" and tape is not None else \
            full_backward(out, grad, x)
    roots = prefix.backward_roots(_layers(mod), a.mb)
    if a.op == "I" and tape is not None:
        dx = backward_input(mod, out, grad, x, tape, roots, prefix.read_leaves(_layers(mod), a.mb))
    else:
        dx = full_backward(out, grad, x, roots)
    del roots
    prefix.release(_layers(mod), a.mb)
    if ctx.meter is not None:
        ctx.meter.hold(prefix.held_tensors(_layers(mod)), a.stage)
    return dx


def _backward(ctx: ActionContext, st: _RankState, a: Action) -> Marks:
    """``sBm`` / ``sIm``: receive the output's gradient, back-propagate, send the input's gradient back."""
    s, m = a.stage, a.mb
    t_recv = ctx.clock.mark()
    x, out = st.saved.pop((s, m))
    tape = st.tapes.pop((s, m), None)
    grad = None
    if s < ctx.last_stage:
        grad, _ = ctx.p2p.recv("grad", s, m)
    t_start, cpu_start = ctx.clock.mark(), ctx.clock.cpu()
    if ctx.offload is not None:
        ctx.offload.before_backward((s, m))         # its reload was issued at the action before (prefetch)
    with _saving(ctx, s):
        if is_embed_only(ctx.stages[s]):
            out = ctx.stages[s](None, ctx.inputs(m))      # the lookup again (its forward kept nothing)
        dx = _input_gradient(ctx, a, st.sliced[m], (x, out), grad, tape)
    if s > 0:
        assert dx is not None
        ctx.p2p.send("grad", s - 1, m, dx)
    del x, out, grad, dx
    if a.op == "I":
        st.tapes[(s, m)] = tape
        if tape is not None and ctx.meter is not None:
            ctx.meter.hold(tape.hold_tensors(), s)
    return t_recv, t_start, cpu_start


def _weight(ctx: ActionContext, st: _RankState, a: Action) -> Marks:
    """``sWm``: the deferred Linear weight gradients of its ``sIm``; no communication."""
    t_recv = ctx.clock.mark()
    tape = st.tapes.pop((a.stage, a.mb), None)
    t_start, cpu_start = ctx.clock.mark(), ctx.clock.cpu()
    if tape is not None:
        backward_weight(tape)
    del tape
    return t_recv, t_start, cpu_start


_RUNNERS: dict[str, Callable[[ActionContext, _RankState, Action], Marks]] = {
    "F": _forward, "B": _backward, "I": _backward, "W": _weight}
"""The action kinds (``Action.op``) and what runs each."""


def run_actions(actions: Sequence[Action], ctx: ActionContext) -> tuple[list[ActionTiming], float]:
    """Run ``actions`` (this rank's list) against ``ctx`` and return their timings and the summed scaled loss."""
    st = _RankState(split={(a.stage, a.mb) for a in actions if a.op == "I"},
                    recompute=[bool(mb.recompute) for mb in ctx.plan.microbatches],
                    sliced=[mb.has_slices for mb in ctx.plan.microbatches])
    timings: list[ActionTiming] = []
    reloads = prefetch_points(actions, ctx.offload.offloads) if ctx.offload is not None else {}
    for i, a in enumerate(actions):
        if ctx.on_action is not None:
            ctx.on_action(i, a)
        if ctx.offload is not None:
            ctx.offload.poll()
            for key in reloads.get(i, ()):
                ctx.offload.reload(key)          # prefetch: the backward after this action reads them
        t_recv, t_start, cpu_start = _RUNNERS[a.op](ctx, st, a)
        t_end, cpu_end = ctx.clock.mark(), ctx.clock.cpu()
        if ctx.meter is not None:
            ctx.meter.sample(a.stage)
        timings.append(ActionTiming(a, t_recv, t_start, t_end,
                                    None if cpu_start is None or cpu_end is None else cpu_end - cpu_start))
    if st.saved:
        raise RuntimeError(f"actions left activations without a backward: {sorted(st.saved)[:6]}")
    if any(t is not None and t.calls for t in st.tapes.values()):
        raise RuntimeError(f"actions left weight gradients without a W: {sorted(st.tapes)[:6]}")
    if ctx.offload is not None:
        ctx.offload.finish()              # every copy done, every offloaded forward reloaded
    return timings, float(torch.stack(st.losses).sum()) if st.losses else 0.0
