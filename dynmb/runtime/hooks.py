"""Hooks into one training step, for tests: the step runner calls them at fixed points.

A run has no hooks (``NoHooks``). A test that needs a fault (a rank that dies or raises
mid-step, a divergent plan, a wrong gradient, a peak over the limit) passes an object with
these methods: in process to ``worker.run_cases(..., hooks=...)``, or through the spec
(``RunSpec.hooks = HookRef("package.module:Name", kwargs)``), which every rank builds with
``load_hooks``. The points, in step order:

1. ``plan(rank, step, plan) -> plan``: the plan this rank runs, before the ranks compare
   plan digests;
2. ``before_action(rank, step, index, actions)``: before action ``index`` of this rank's
   ``actions``;
3. ``gradients(rank, step, params)``: after the gradients are complete (data-parallel sum
   included), before the ``--verify`` copy and the optimizer step;
4. ``memory_limit(rank, step, stage, limit_bytes, peak_bytes) -> int``: the limit the
   stage's measured peak is checked against (and recorded with).
"""

from __future__ import annotations

import importlib
from typing import Mapping, Protocol, Sequence

import torch

from dynmb.runtime.spec import HookRef
from dynmb.core.types import Action, Plan

__all__ = ["StepHooks", "NoHooks", "load_hooks"]


class StepHooks(Protocol):
    """The points of a step a test can act on (see the module docstring)."""

    def plan(self, rank: int, step: int, plan: Plan) -> Plan: ...

    def before_action(self, rank: int, step: int, index: int, actions: Sequence[Action]) -> None: ...

    def gradients(self, rank: int, step: int, params: Mapping[str, torch.nn.Parameter]) -> None: ...

    def memory_limit(self, rank: int, step: int, stage: int, limit_bytes: int, peak_bytes: int) -> int: ...


class NoHooks:
    """Hooks that change nothing: what a run uses. Subclass it to override a few points."""

    def plan(self, rank: int, step: int, plan: Plan) -> Plan:
        return plan

    def before_action(self, rank: int, step: int, index: int, actions: Sequence[Action]) -> None:
        return None

    def gradients(self, rank: int, step: int, params: Mapping[str, torch.nn.Parameter]) -> None:
        return None

    def memory_limit(self, rank: int, step: int, stage: int, limit_bytes: int, peak_bytes: int) -> int:
        return limit_bytes


def load_hooks(ref: HookRef | None) -> StepHooks:
    """Build the hooks ``ref`` names (``NoHooks`` for None)."""
    if ref is None:
        return NoHooks()
    module_name, _, attr = ref.target.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load step hooks {ref.target!r}: {e}") from None
    return factory(**ref.kwargs)
