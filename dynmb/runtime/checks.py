"""The checks of a step: ranks agree on the plan, peaks stay under the limit, gradients are right.

1. Plan agreement (before any action): every rank plans the step itself (deterministic);
   the plans' digests are all-gathered and a rank whose plan differs from rank 0's stops
   the run (``PlanDivergenceError`` naming it): a divergent plan would deadlock in P2P or
   corrupt gradients.
2. Memory limit (after the step): a stage's measured peak over the limit it is checked
   against is a failure unless the run allows it (``memory_problems``).
3. Gradients (``--verify``): before the step, the ranks of a replica all-gather their
   weights (``gather_weights``); after it, every rank recomputes the global batch's
   gradients in one process from those pre-step weights (``reference_gradients``) and
   compares its own parameters: max abs error <= rtol x max |reference| (+1e-9), rtol
   ``VERIFY_RTOL`` (1e-5) for fp32, ``VERIFY_RTOL_FP64`` (1e-10, no absolute floor) for a float64
   model (``ModelConfig.dtype``; ``gradient_problems``); the largest relative error goes to the
   ``steps`` table's ``grad_rel_err`` (``relative_error``).

Failures of 2 and 3 are messages naming rank, stage or parameter and step; the worker
raises them on every rank as ``StepCheckError`` once the step's rows are written, in one line
(``problem_line``: the first message and how many more, on which ranks), the same on every rank.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from dynmb.core.config import RunConfig
from dynmb.models import make_inputs, reference_stages, whole_documents
from dynmb.runtime.records import MemoryRow
from dynmb.core.types import Plan

__all__ = ["VERIFY_RTOL", "VERIFY_RTOL_FP64", "verify_tolerance", "relative_error", "PlanDivergenceError", "StepCheckError", "check_plan_digest", "gather_weights",
           "reference_gradients", "gradient_problems", "memory_problems", "problem_line"]

VERIFY_RTOL = 1e-5
"""Relative tolerance of ``--verify`` for fp32 (and 16-bit) models, plus an absolute 1e-9."""
VERIFY_RTOL_FP64 = 1e-10
"""Relative tolerance of ``--verify`` for float64 models (no absolute floor): the pipeline's sums
differ from the reference's only in their order."""
_MAX_GRADIENT_PROBLEMS = 5


class PlanDivergenceError(RuntimeError):
    """Ranks planned different steps; running them would deadlock or corrupt gradients."""


class StepCheckError(RuntimeError):
    """A step broke the memory limit or its gradients differ from the reference."""


def check_plan_digest(plan: Plan, step: int, device: torch.device) -> None:
    """All-gather the plan digest; raise ``PlanDivergenceError`` naming the ranks that differ from rank 0."""
    mine = torch.tensor(list(bytes.fromhex(plan.digest())), dtype=torch.uint8, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    differ = [r for r, digest in enumerate(gathered) if not torch.equal(digest, gathered[0])]
    if differ:
        theirs = bytes(gathered[differ[0]].cpu().tolist()).hex()[:12]
        reference = bytes(gathered[0].cpu().tolist()).hex()[:12]
        raise PlanDivergenceError(
            f"step {step}: the plan of rank(s) {differ} differs from rank 0's "
            f"(digest {theirs} vs {reference}); refusing to run a divergent plan")


def gather_weights(params: Mapping[str, torch.Tensor], group: dist.ProcessGroup | None,
                   pipeline_size: int) -> dict[str, torch.Tensor]:
    """Every stage's weights of this replica on every rank of it (CPU copies; collective)."""
    parts: list[dict[str, torch.Tensor] | None] = [None] * pipeline_size
    dist.all_gather_object(parts, {n: p.detach().cpu().clone() for n, p in params.items()}, group=group)
    return {name: tensor for part in parts if part is not None for name, tensor in part.items()}


def reference_gradients(run: RunConfig, plan: Plan, tokens: Sequence[torch.Tensor],
                        weights: Mapping[str, torch.Tensor], factory: Any = None) -> dict[str, torch.Tensor]:
    """Single-process gradients of the whole global batch (every replica's microbatches)
    from the pre-step ``weights``, with the pipeline's loss scale (1 / real tokens); a sliced
    sequence runs whole, in one pass (``dynmb.models.whole_documents``). The stages come from
    ``factory`` (a fresh one: ``RunSpec.factory()``; None: ``run.model``'s family)."""
    _, stages = reference_stages(factory if factory is not None else run.model, run.spec.num_stages, run.seed)
    with torch.no_grad():
        for stage in stages:
            for name, param in stage.named_parameters():
                param.copy_(weights[name])
    total = plan.real_tokens
    for microbatch in whole_documents(plan):
        inputs = make_inputs(microbatch, tokens, cfg=run.model)
        x: torch.Tensor | None = None
        for stage in stages:
            x = stage(x, inputs)
        assert x is not None
        (x / total).backward()
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p))
            for stage in stages for n, p in stage.named_parameters()}


def verify_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(relative, absolute)`` tolerance of ``--verify`` for gradients of ``dtype``."""
    return (VERIFY_RTOL_FP64, 0.0) if dtype == torch.float64 else (VERIFY_RTOL, 1e-9)


def _errors(grads: Mapping[str, torch.Tensor],
            reference: Mapping[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """``{name: (max abs error, max |reference|)}`` of every parameter of ``grads``."""
    out = {}
    for name, mine in grads.items():
        ref = reference[name].to(mine.device, mine.dtype)
        out[name] = float((mine - ref).abs().max()), float(ref.abs().max())
    return out


def relative_error(grads: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> float:
    """The largest max abs error / max |reference| over the parameters of ``grads`` (0 for none;
    a parameter whose reference is all zeros counts its absolute error)."""
    return max((err / scale if scale > 0 else err for err, scale in _errors(grads, reference).values()), default=0.0)


def gradient_problems(rank: int, step: int, grads: Mapping[str, torch.Tensor],
                      reference: Mapping[str, torch.Tensor]) -> list[str]:
    """One message per parameter of ``grads`` off the reference (the first five)."""
    problems = []
    for name, (err, scale) in _errors(grads, reference).items():
        rtol, atol = verify_tolerance(grads[name].dtype)
        if err > rtol * scale + atol:
            problems.append(f"rank {rank} step {step} param {name}: max abs error {err:.3g} > "
                            f"{rtol:g} x max|ref| {scale:.3g}")
    return problems[:_MAX_GRADIENT_PROBLEMS]


def memory_problems(rows: Sequence[MemoryRow], *, allow_over_limit: bool) -> list[str]:
    """One message per stage whose measured peak exceeds the limit it was checked against."""
    if allow_over_limit:
        return []
    return [f"rank {r.rank} stage {r.stage}: measured peak {r.peak_bytes} bytes exceeds the memory limit "
            f"{r.limit_bytes} bytes at step {r.step}" for r in rows if r.peak_bytes > r.limit_bytes]


def problem_line(step: int, problems: Sequence[str], shown: int = 3) -> str:
    """One line for a step's failed checks: what failed (gradients, memory), the first ``shown`` messages and
    how many more, on which ranks."""
    grads = [p for p in problems if " param " in p]
    if grads and len(grads) < len(problems):
        what = "gradients differ from the single-process reference (--verify) and a peak is over the limit"
    elif grads:
        what = "gradients differ from the single-process reference (--verify)"
    else:
        what = "a measured peak is over the memory limit"
    ranks = sorted({p.split()[1] for p in problems if p.startswith("rank ")}, key=lambda r: int(r) if r.isdigit() else 0)
    more = f"; {len(problems) - shown} more on rank(s) {', '.join(ranks)}" if len(problems) > shown else ""
    return f"step {step}: {what}: {'; '.join(problems[:shown])}{more}"
