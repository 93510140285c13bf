"""Fault injection for the runtime tests: ``StepHooks`` that break one step of one rank.

A test names ``Fault`` in a run spec (``fault_hooks(rank, step, kind)``); every worker
builds it (``dynmb.runtime.hooks.load_hooks``). Kinds:

- ``exit``: ``os._exit(13)`` half-way through the rank's actions (a rank that dies);
- ``raise``: a ``RuntimeError`` at the same point;
- ``diverge``: the rank runs its plan with the first microbatch one column wider;
- ``corrupt``: one gradient scaled by 1.001 before ``--verify`` looks at it;
- ``overlimit``: the rank's peaks are checked against a limit 1 byte below them.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Mapping, Sequence

import torch

from dynmb.runtime.hooks import NoHooks
from dynmb.runtime.spec import HookRef
from dynmb.core.types import Action, Plan

__all__ = ["Fault", "fault_hooks", "KINDS", "REPO"]

KINDS = ("exit", "raise", "diverge", "corrupt", "overlimit")
REPO = Path(__file__).resolve().parent.parent
"""The folder ``tests`` is importable from: the workers need it on ``PYTHONPATH``."""


def fault_hooks(rank: int, step: int, kind: str) -> HookRef:
    """The spec's reference to ``Fault(rank, step, kind)``."""
    if kind not in KINDS:
        raise ValueError(f"unknown fault {kind!r}; expected one of {KINDS}")
    return HookRef(target=f"{__name__}:Fault", kwargs={"rank": rank, "step": step, "kind": kind})


@dataclasses.dataclass
class Fault(NoHooks):
    """Breaks step ``step`` of rank ``rank`` as ``kind`` says."""

    rank: int
    step: int
    kind: str

    def _hits(self, rank: int, step: int, kind: str) -> bool:
        return (rank, step, kind) == (self.rank, self.step, self.kind)

    def plan(self, rank: int, step: int, plan: Plan) -> Plan:
        if not self._hits(rank, step, "diverge"):
            return plan
        first = plan.microbatches[0]
        wider = dataclasses.replace(first, padded_len=first.padded_len + 1)
        return dataclasses.replace(plan, microbatches=(wider,) + plan.microbatches[1:])

    def before_action(self, rank: int, step: int, index: int, actions: Sequence[Action]) -> None:
        if index != len(actions) // 2:
            return
        if self._hits(rank, step, "exit"):
            os._exit(13)
        if self._hits(rank, step, "raise"):
            raise RuntimeError(f"injected fault before action {actions[index]} (step {step})")

    def gradients(self, rank: int, step: int, params: Mapping[str, torch.nn.Parameter]) -> None:
        if self._hits(rank, step, "corrupt"):
            grad = next(iter(params.values())).grad
            assert grad is not None
            grad.mul_(1.001)

    def memory_limit(self, rank: int, step: int, stage: int, limit_bytes: int, peak_bytes: int) -> int:
        return peak_bytes - 1 if self._hits(rank, step, "overlimit") else limit_bytes
