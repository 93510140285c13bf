"""Sharded data parallelism of pipeline stages with FSDP2 (``dynmb run --dp N --shard``).

The loss contract (docs/design.md "Data parallelism and the loss"): the last stage returns the
SUM of token cross-entropy, the runtime (or ``run_with_torch_pipelining``) divides it by the
real tokens of the whole global batch, every replica included, so the replicas' gradients must be
**summed**, never averaged. FSDP2 averages by default (``ReduceOp.AVG``, a divide by the group
size); dynmb turns that off here, on every backend.

Algorithm
---------
``shard_stage(stage, group)`` (once, before the optimizer is built):

1. the blocks of the stage (the members of each ``nn.ModuleDict`` / ``nn.ModuleList`` child:
   dynmb's ``blocks``, the transformers adapter's decoder layers) are each ``fully_shard``-ed,
   then the stage itself (its embedding, final norm and head), as torchtitan does, over a 1-D
   ``DeviceMesh`` of the data-parallel group (``DeviceMesh.from_group``);
2. ``reshard_after_forward=False``: a pipeline step runs many microbatches through a stage, and
   gathering its weights per microbatch would cost one all-gather per action (torchtitan's policy
   under pipelining; torch's own schedule runtime unshards once per step too);
3. every FSDP unit reduces by a plain sum: ``set_force_sum_reduction_for_comms(True)`` with
   ``set_gradient_divide_factor(1.0)`` (no ``PREMUL_SUM``, no ``AVG``: both missing on gloo), so
   the reduce-scatter adds the replicas' gradients and nothing divides them.

A step of dynmb's runtime (``begin_step`` / ``finish_step`` around the rank's actions):

4. ``begin_step``: every unit is unsharded (all-gathered) once, in module order, and gradient
   sync is turned off: the microbatches' backwards accumulate unsharded gradients and issue no
   collective, so no collective depends on the order of the schedule's actions (replicas whose
   schedules differ, as under ``memory-aware`` or with slices, cannot deadlock); the runtime's CPU meter then
   recounts the states (the gathered weights and their whole gradients beside the shards: what
   ``MemoryModel.sharded`` predicts for ``PlanSpec.state_shards``);
5. ``finish_step``: gradient sync on, every parameter group's ``post_backward`` (the
   reduce-scatter of its accumulated gradient, summed), then the root's final callback
   (waits, reshards): what torch's ``PipelineStage.perform_reduce_grad`` does. The optimizer then
   steps on the shards.

``full_tensors`` turns sharded parameters or gradients into whole tensors (an all-gather over the
data-parallel group; every replica must call it with the same names in the same order), for
``--verify``.
"""

from __future__ import annotations

import logging
from typing import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ShardingError", "shard_stage", "fsdp_units", "begin_step", "finish_step", "full_tensors",
           "is_sharded"]

logger = logging.getLogger(__name__)


class ShardingError(ValueError):
    """A stage cannot be sharded with FSDP2 as dynmb needs it (one line naming why)."""


def _fsdp():
    """torch's FSDP2 names; ``ShardingError`` naming what the installed torch lacks."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import FSDPModule, fully_shard
    except ImportError as e:                     # pragma: no cover - torch < 2.6
        raise ShardingError(f"torch {torch.__version__} has no FSDP2 (torch.distributed.fsdp.fully_shard): {e}") \
            from None
    if not hasattr(FSDPModule, "set_force_sum_reduction_for_comms"):   # pragma: no cover - older torch
        raise ShardingError(f"torch {torch.__version__}: FSDPModule.set_force_sum_reduction_for_comms is missing; "
                            "dynmb needs it to sum gradients over replicas (torch >= 2.8)")
    return DeviceMesh, FSDPModule, fully_shard


def fsdp_units(stage: nn.Module) -> list[nn.Module]:
    """The blocks of ``stage`` sharded one by one: every member of its ``ModuleDict`` / ``ModuleList`` children."""
    units: list[nn.Module] = []
    for child in stage.children():
        if isinstance(child, (nn.ModuleDict, nn.ModuleList)):
            units.extend(m for m in child.children() if any(True for _ in m.parameters()))
    return units


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 module (``fully_shard`` ran on it)."""
    _, fsdp_module, _ = _fsdp()
    return isinstance(module, fsdp_module)


def _sum_reduction(module: nn.Module) -> None:
    module.set_force_sum_reduction_for_comms(True)       # type: ignore[operator]
    module.set_gradient_divide_factor(1.0)               # type: ignore[operator]


def shard_stage(stage: nn.Module, group: dist.ProcessGroup | None) -> nn.Module:
    """``fully_shard`` the blocks of ``stage``, then the stage, over the data-parallel ``group``
    (None: the world), weights kept gathered between forwards and gradients summed (module
    docstring, 1-3). Returns ``stage`` (now an ``FSDPModule``); build the optimizer after."""
    device_mesh, _, fully_shard = _fsdp()
    params = list(stage.parameters())
    if not params:
        raise ShardingError(f"stage {getattr(stage, 'stage', '?')} has no parameters to shard")
    device = params[0].device
    if any(p.device != device for p in params):
        raise ShardingError(f"stage {getattr(stage, 'stage', '?')} has parameters on several devices")
    mesh = device_mesh.from_group(group if group is not None else dist.group.WORLD, device.type)
    units = fsdp_units(stage)
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=False)
        _sum_reduction(unit)
    fully_shard(stage, mesh=mesh, reshard_after_forward=False)
    _sum_reduction(stage)
    fully_shard.state(stage)._lazy_init()    # the stage is the root, before any unit is unsharded on its own
    logger.debug("stage %s: FSDP2 over %d replicas, %d blocks + the stage", getattr(stage, "stage", "?"),
                 mesh.size(), len(units))
    return stage


def _fsdp_modules(stages: Iterable[nn.Module]) -> list[nn.Module]:
    """Every FSDP module of ``stages``, in module order (the same on every replica)."""
    _, fsdp_module, _ = _fsdp()
    return [m for stage in stages for m in stage.modules() if isinstance(m, fsdp_module)]


def begin_step(stages: Iterable[nn.Module]) -> None:
    """Unshard every unit once and turn gradient sync off (module docstring, 4)."""
    modules = _fsdp_modules(stages)
    for m in modules:
        m.unshard()                                               # type: ignore[operator]
    for m in modules:
        m.set_requires_gradient_sync(False, recurse=False)        # type: ignore[operator]
        m.set_is_last_backward(False)                             # type: ignore[operator]
        m.set_reshard_after_backward(False, recurse=False)        # type: ignore[operator]


def finish_step(stages: Iterable[nn.Module]) -> None:
    """Reduce-scatter (sum) every unit's accumulated gradient and reshard (module docstring, 5)."""
    _, _, fully_shard = _fsdp()
    for root in stages:
        for m in _fsdp_modules([root]):
            m.set_requires_gradient_sync(True, recurse=False)     # type: ignore[operator]
            m.set_reshard_after_backward(True, recurse=False)     # type: ignore[operator]
        root.set_is_last_backward(True)                           # type: ignore[operator]
        state = fully_shard.state(root)
        for unit_state in state._state_ctx.all_states:
            for group in unit_state._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()


def full_tensors(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors of ``named`` (sharded ones all-gathered over their replicas; collective:
    every replica calls it with the same names in the same order); others as they are."""
    from torch.distributed.tensor import DTensor

    return {n: (t.full_tensor() if isinstance(t, DTensor) else t) for n, t in named.items()}
