"""The single-process reference a pipeline step must match, for any family.

``reference_grads(model, P, plan, tokens)`` builds the ``P`` stages of ``model`` -- a ``ModelConfig``
(its dynmb family) or any ``StageFactory`` (``reference_stages``: ``factory.build_stage`` for every
stage, the same global names and weights as every rank's stage; a factory's inputs follow
``planning_config(factory)``) -- runs every microbatch of the plan (all replicas) through them in order, each
sliced sequence whole in one pass (``whole_documents``), divides each microbatch's summed loss
by the global batch's real tokens, and returns the token-weighted loss and
``{global name: gradient}``. Since the loss is a sum over tokens divided by a constant, the
result does not depend on how the plan grouped the documents into microbatches or rows.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import nn

from typing import Any, cast

from dynmb.core.config import ModelConfig
from dynmb.models.inputs import make_inputs
from dynmb.core.types import Microbatch, Plan

from dynmb.models.contract import planning_config, resolve_model

__all__ = ["reference_grads", "reference_stages", "whole_documents", "global_named_parameters", "count_params"]


def global_named_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """``{global name: parameter}``; names are already global, e.g. ``blocks.3.attn.qkv.weight``."""
    return dict(module.named_parameters())


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def whole_documents(plan: Plan) -> list[Microbatch]:
    """The plan's microbatches with every sliced sequence taken out of them and run whole,
    one single-row microbatch per sliced sequence (the reference a sliced plan must match)."""
    groups = plan.slice_groups()
    if not groups:
        return list(plan.microbatches)
    out = []
    for mb in plan.microbatches:
        keep = ~mb.slice_mask
        if keep.any():
            rows = np.unique(mb.row_ids[keep], return_inverse=True)[1]
            out.append(Microbatch(mb.seq_ids[keep], mb.lengths[keep], mb.padded_len, int(rows.max()) + 1, rows))
    for sid, where in groups.items():
        n = sum(int(plan.microbatches[i].lengths[plan.microbatches[i].seq_ids == sid][0]) for i in where)
        out.append(Microbatch([sid], [n], n, 1))
    return out


def reference_stages(model: Any, num_stages: int, seed: int = 0, *, dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None) -> tuple[ModelConfig, list[nn.Module]]:
    """``(planning config, all num_stages stages)`` of ``model`` (a ``ModelConfig`` or a ``StageFactory``)."""
    factory = resolve_model(model)
    return planning_config(factory), [cast(nn.Module, factory.build_stage(s, num_stages, seed=seed, dtype=dtype,
                                                                         device=device))
                                      for s in range(num_stages)]


def reference_grads(model: Any, num_stages: int, plan: Plan, tokens: Sequence[torch.Tensor], seed: int = 0, *,
                    dtype: torch.dtype | None = None, device: torch.device | str | None = None
                    ) -> tuple[float, dict[str, torch.Tensor]]:
    """Single-process reference for one step (module docstring): ``(loss, {global name: grad})``."""
    cfg, stages = reference_stages(model, num_stages, seed, dtype=dtype, device=device)
    total = plan.real_tokens
    loss_sum = 0.0
    for mb in whole_documents(plan):
        inputs = make_inputs(mb, tokens, cfg=cfg, device=device)
        x: Any = None                           # into the first stage; then each stage's output
        for st in stages:
            x = st(x, inputs)
        (x / total).backward()
        loss_sum += float(x.detach())
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
             for st in stages for n, p in st.named_parameters()}
    return loss_sum / total, grads
