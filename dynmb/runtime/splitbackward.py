"""Split backward: ``I`` (the stage input's gradient) now, ``W`` (the Linear weight gradients) later.

Zero-bubble schedules split a stage's backward of one microbatch in two actions (torch's
``BACKWARD_INPUT`` / ``BACKWARD_WEIGHT``, printed ``I`` / ``W``). This module runs them
exactly on any ``dynmb.models.StageModule`` (both families: any module whose weight-bearing layers are
``nn.Linear``).

Algorithm
---------
Forward (``record_linears(stage)`` around the stage's forward, only for microbatches the
schedule splits): a forward hook on every ``nn.Linear`` appends one ``LinearCall`` per call
(a layer called several times, as the bucketed attention does, gets one per call) holding
the layer's input and a tensor hook on its output that will store the output's gradient.
The input is a tensor autograd saves for that layer anyway, so recording costs no memory
until ``I``. A block under ``dynmb.models.RecomputedBlock`` (a microbatch's full recomputation, or a stage's
leading ``ModelConfig.recompute_blocks``) runs its forward without a graph, so its Linear outputs need no
gradient and are not recorded; ``I`` recomputes it after the hooks are gone and its nested backward
accumulates its weight gradients at once: ``W`` never sees them (no gradient counted twice or missed). On the first stage a forward pre-hook on the first block keeps that block's
input (token + position embedding): the ``boundary`` whose gradient ``I`` computes there.

``I`` (``backward_input``): one ``torch.autograd.grad(out, [boundary] + eager, grad)`` with
``retain_graph=False``, where ``eager`` are the stage's parameters that are *not* Linear
weights (LayerNorm gains and biases, embeddings, Linear biases: reductions, cheap). The
autograd engine then executes only what leads to those inputs: every node on the
activation-gradient chain runs, but a Linear's ``addmm`` node skips its weight output (the
engine's ``should_compute_output``), which is the weight-gradient GEMM W defers. The tensor
hooks store each Linear's output gradient on its ``LinearCall``; the graph and every saved
activation are freed as the pass goes. The eager gradients are accumulated into ``.grad``
(as ``AccumulateGrad`` would) and ``d boundary`` is returned (sent upstream on stages > 0).
Held from ``I`` to ``W``: each Linear call's input and output gradient (``hold_tensors``),
about a microbatch's activation bytes (``dynmb.memory.model.MemoryModel.w_bytes`` counts them), and
nothing else: the tape records each input detached (the same storage), so it keeps no node of the
forward's graph alive. An attached input would keep the graph, and through its ``AccumulateGrad``
nodes every leaf the forward read, until ``W``: the stage input ``x`` (stages > 0) and, for a slice,
the earlier slices' key/value leaves with their gradients and so their whole fused q/k/v storages,
which their own backwards had freed (measured: 3,571,200 B over the model at the peak of a 6-slice
``zb`` chain on ``tiny`` fp64, stage 1, issue 39).

Slices of a long sequence (``dynmb.models.prefix``): a slice reads the keys and values of its
sequence's earlier slices through detached leaves, and a continued slice's own keys and values
get, before its backward, the gradients every later slice left on those leaves. A full ``B``
(``torch.autograd.backward``) accumulates into the leaves by itself; ``I`` is an
``autograd.grad`` that computes only what it is asked for, so the runtime passes the leaves
the microbatch read as ``leaves`` (their gradients are accumulated into ``.grad``, exactly as
``B`` would) and its continued slices' ``(keys, gradient)`` pairs as extra ``roots`` of the same
call: the Linear output gradients the hooks store for ``W`` then include what later slices gave
the keys and values, and ``W`` stays a plain GEMM. Since the schedule runs a sequence's
backwards (``B`` or ``I``) in reverse slice order on every stage, every later slice's ``I`` has
filled the leaves before the earlier slice's ``I`` reads them; its ``W`` may run any time after.

``W`` (``backward_weight``): per recorded call, ``dW = (x^T g)^T`` on the flattened
``(tokens, features)`` views -- the very GEMM ``AddmmBackward0`` runs for ``mat2`` followed
by its ``TBackward0`` -- accumulated into ``weight.grad`` (set when None, else added in
place), then the call's tensors are dropped.

Exactness: I runs the same autograd nodes as a full backward on the same tensors, W the same
GEMM, so gradients equal the full backward's up to the order in which microbatches' weight
gradients are summed (``tests/test_zerobubble.py``: fp32, within 1e-5 relative, 2 and 4
gloo ranks). No boundary (a first stage without blocks): ``I`` runs the full backward and
``W`` has nothing left to do.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence, cast

import torch
from torch import nn

__all__ = ["LinearCall", "WeightGradTape", "record_linears", "backward_input", "backward_weight", "full_backward"]


@dataclass(eq=False)
class LinearCall:
    """One call of an ``nn.Linear``: its input, and its output's gradient once ``I`` ran."""

    module: nn.Linear
    input: torch.Tensor
    grad_output: torch.Tensor | None = None

    def capture(self, grad: torch.Tensor) -> None:
        self.grad_output = grad


@dataclass(eq=False)
class WeightGradTape:
    """What ``W`` of one (stage, microbatch) needs: the Linear calls, in forward order."""

    calls: list[LinearCall] = field(default_factory=list)
    boundary: torch.Tensor | None = None
    """The first block's input on the first stage (the tensor ``I`` differentiates to)."""

    def hold_tensors(self) -> list[torch.Tensor]:
        """The tensors held from ``I`` to ``W`` (inputs and output gradients)."""
        out = []
        for c in self.calls:
            out.append(c.input)
            if c.grad_output is not None:
                out.append(c.grad_output)
        return out

    def clear(self) -> None:
        self.calls.clear()
        self.boundary = None


@contextmanager
def record_linears(stage: nn.Module) -> Iterator[WeightGradTape]:
    """Context around one forward of ``stage``: yields the tape its Linear calls are recorded on."""
    tape = WeightGradTape()

    def on_linear(mod: nn.Module, args: tuple, out: torch.Tensor) -> None:
        if not (isinstance(out, torch.Tensor) and out.requires_grad):
            return
        # detached (same storage): the tape must not keep the forward's graph alive from I to W (module doc)
        call = LinearCall(cast(nn.Linear, mod), args[0].detach())     # hooked on nn.Linear modules only
        out.register_hook(call.capture)
        tape.calls.append(call)

    def on_first_block(mod: nn.Module, args: tuple) -> None:
        if tape.boundary is None and args and isinstance(args[0], torch.Tensor):
            tape.boundary = args[0]

    handles = [m.register_forward_hook(on_linear) for m in stage.modules() if isinstance(m, nn.Linear)]
    blocks = getattr(stage, "blocks", None)
    if stage.is_first and blocks is not None and len(blocks):
        handles.append(next(iter(blocks.values())).register_forward_pre_hook(on_first_block))
    try:
        yield tape
    finally:
        for h in handles:
            h.remove()


def _eager_params(stage: nn.Module) -> list[nn.Parameter]:
    """Parameters whose gradient ``I`` computes: every one but the Linear weights."""
    deferred = {id(m.weight) for m in stage.modules() if isinstance(m, nn.Linear)}
    return [p for p in stage.parameters() if p.requires_grad and id(p) not in deferred]


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    if p.grad is None:
        p.grad = g.detach().contiguous()
    else:
        p.grad.add_(g)


def full_backward(out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor | None,
                  extra: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> torch.Tensor | None:
    """The full backward ``B``: every gradient at once; returns the input's gradient (None on stage 0).
    ``extra``: more ``(tensor, gradient)`` roots of the same backward (a continued slice's keys and
    values with the gradients later slices gave them, ``dynmb.models.prefix.PrefixStore.backward_roots``)."""
    if extra:
        torch.autograd.backward([out, *(t for t, _ in extra)],
                                [torch.ones_like(out) if grad is None else grad, *(g for _, g in extra)])
    else:
        torch.autograd.backward(out, grad_tensors=grad)
    return None if x is None else x.grad


def backward_input(stage: nn.Module, out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor | None,
                   tape: WeightGradTape, roots: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
                   leaves: Sequence[torch.Tensor] = ()) -> torch.Tensor | None:
    """``I``: the gradient of the stage input ``x`` (None on the first stage) and the eager
    parameter gradients; the Linear output gradients are stored on ``tape`` for ``W``.
    ``roots``: more ``(tensor, gradient)`` roots (a continued slice's keys and values,
    ``PrefixStore.backward_roots``); ``leaves``: tensors whose gradients are accumulated into
    their ``.grad`` as a full backward would (the earlier slices' key/value leaves this
    microbatch read, ``PrefixStore.read_leaves``) -- module doc."""
    boundary = x if x is not None else tape.boundary
    if boundary is None or not boundary.requires_grad:
        tape.clear()                      # nothing to split at: run everything now, W is empty
        return full_backward(out, grad, x, roots)
    eager = _eager_params(stage)
    leaves = [t for t in leaves if t.requires_grad]
    outs, gouts = [out, *(t for t, _ in roots)], [grad, *(g for _, g in roots)]
    grads = torch.autograd.grad(outs, [boundary, *eager, *leaves], grad_outputs=gouts, allow_unused=True)
    for p, g in zip([*eager, *leaves], grads[1:]):
        if g is not None:
            _accumulate(p, g)
    tape.boundary = None
    missing = [c for c in tape.calls if c.grad_output is None]
    if missing:
        raise RuntimeError(f"I left {len(missing)} Linear call(s) without an output gradient "
                           f"(first: {type(missing[0].module).__name__}); their weights would get no gradient")
    return grads[0] if x is not None else None


@torch.no_grad()
def backward_weight(tape: WeightGradTape) -> None:
    """``W``: accumulate every recorded Linear call's weight gradient, then drop its tensors."""
    for c in tape.calls:
        w = c.module.weight
        x2 = c.input.reshape(-1, c.input.shape[-1])
        go = c.grad_output
        assert go is not None, "W before the call's I"
        g2 = go.reshape(-1, go.shape[-1]).to(x2.dtype)
        _accumulate(w, torch.mm(x2.t(), g2).t())
    tape.clear()
