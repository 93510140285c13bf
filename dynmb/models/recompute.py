"""Full activation recomputation of a block and of the LM head or a head shard (Megatron's ``full``).

``RecomputedBlock.apply(x, block, inputs, *extra)``: the block runs without building a graph;
only its input is saved for backward (``save_for_backward``, so saved-tensor hooks such as the
CPU memory meter see it). Backward recomputes the block's forward from that input with
autograd on and back-propagates at once (a nested ``torch.autograd.backward``: the block's
parameter gradients accumulate in ``.grad``, the input's gradient is returned), so one block's
activations are live at a time. ``extra`` are further block arguments that need no gradient
(the Llama family's rotary tables; tensors they hold, ``extra.tensors()``, are saved beside the
input, so saved-tensor hooks see them, once per stage since the blocks share them). The recomputation runs under whatever saved-tensor hooks
the caller's backward has, which is why this is not
``torch.utils.checkpoint(use_reentrant=False)``: that one saves the recomputed activations
under its own hooks, where the CPU meter cannot account them. A block holding slices of a
long sequence re-keeps its keys and values in the prefix store during the recomputation;
their accumulated gradients join the nested backward as extra roots
(``dynmb.models.prefix.PrefixStore.pop_pending``). Deterministic kernels recompute bit-identical
activations, so gradients are exact.

``RecomputedHead.apply(x, stage, inputs, reduction)``: the stage's ``head`` (final norm, LM head
and cross-entropy; or a head shard's message or loss, ``dynmb.models.head``) under the same
scheme: only ``x`` is saved, and the fp32 logits (a shard's rows only) and log-softmax of a
recomputed microbatch live only during its backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["RecomputedBlock", "RecomputedHead"]


class RecomputedBlock(torch.autograd.Function):
    """A block under full recomputation (module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, block: nn.Module, inputs: Any, *extra: Any) -> torch.Tensor:
        ctx.block, ctx.inputs, ctx.extra = block, inputs, extra
        held = [t for e in extra if hasattr(e, "tensors") for t in e.tensors()]
        ctx.save_for_backward(x, *held)          # the tables live until the backward: let the meter see them
        return block(x, inputs, *extra)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x = ctx.saved_tensors[0]
        leaf = x.detach().requires_grad_(x.requires_grad)
        with torch.enable_grad():
            y = ctx.block(leaf, ctx.inputs, *ctx.extra)
        roots = ctx.inputs.prefix.pop_pending() if ctx.inputs.prefix is not None else []
        torch.autograd.backward([y, *(t for t, _ in roots)], [grad, *(g for _, g in roots)])
        return (leaf.grad, None, None, *(None for _ in ctx.extra))


class RecomputedHead(torch.autograd.Function):
    """A stage's head or head shard under full recomputation (module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, stage: Any, inputs: Any,           # stage: a DecoderStage
                reduction: str = "sum") -> torch.Tensor:
        ctx.stage, ctx.inputs, ctx.reduction = stage, inputs, reduction
        ctx.save_for_backward(x)
        return stage.head(x, inputs, reduction)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        (x,) = ctx.saved_tensors
        leaf = x.detach().requires_grad_(x.requires_grad)
        with torch.enable_grad():
            y = ctx.stage.head(leaf, ctx.inputs, ctx.reduction)
        torch.autograd.backward(y, grad)
        return leaf.grad, None, None, None
