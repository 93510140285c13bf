"""``AnalyticCostModel``: the stand-in before profiling, from FLOP counts.

Forward time of a stage = ``overhead_s`` + FLOPs / ``flops_per_s``, with the FLOPs of
``ModelConfig.stage_flops`` (its attention term, ``rows * padded_len^2`` per layer, rescaled to
the microbatch's attention work); backward = ``bwd_ratio`` x forward. The FLOPs follow the model
family (``stage_flops``: the Llama family's SwiGLU has three ``d x d_ff`` matrices, its grouped K/V
projections are ``d x n_kv_heads * head_dim``), so no feature here depends on the block shape. Calibrated roughly to one
core of the development CPU; ``get_cost_model(None, ...)`` returns it.
"""

from __future__ import annotations

from typing import Any

from dynmb.core.config import ModelConfig

from dynmb.costmodel.base import CommModel, CostModel

__all__ = ["AnalyticCostModel"]


class AnalyticCostModel(CostModel):
    """FLOPs / flops_per_s + overhead_s; backward = bwd_ratio x forward.

    Defaults fitted (relative least squares) to the small preset's forward times at 2 stages
    on one core of the development CPU (AMD EPYC, torch 2.13, fp32): 58 GFLOP/s, 1.3 ms per op;
    measured backward/forward ~ 2.0. Held-out-free error there: ~5% (F), ~6% (B)."""

    kind = "analytic"
    layout_free = True

    def __init__(self, model_cfg: ModelConfig, num_stages: int, *, flops_per_s: float = 5.8e10,
                 overhead_s: float = 1.3e-3, bwd_ratio: float = 2.0, comm: CommModel | None = None,
                 meta: dict[str, Any] | None = None) -> None:
        super().__init__(model_cfg, num_stages, comm, meta)
        if flops_per_s <= 0 or overhead_s < 0 or bwd_ratio <= 0:
            raise ValueError(f"bad analytic constants flops_per_s={flops_per_s} overhead_s={overhead_s} bwd_ratio={bwd_ratio}")
        self.flops_per_s, self.overhead_s, self.bwd_ratio = float(flops_per_s), float(overhead_s), float(bwd_ratio)

    def _predict(self, stage, op, b, s, a):
        flops = self.model_cfg.stage_flops(stage, self.num_stages, b, s) \
            + self._attn_flops_per_unit(stage) * (a - b * s * s)
        f = self.overhead_s + flops / self.flops_per_s
        return f if op == "F" else self.bwd_ratio * f

    def _attn_flops_per_unit(self, stage: int) -> float:
        """FLOPs per unit of attention work in ``stage_flops`` (its s^2 coefficient at one row):
        stage_flops(1, s) = A*s + C*s^2, so C = (stage_flops(1, 2) - 2*stage_flops(1, 1)) / 2."""
        f1, f2 = (float(self.model_cfg.stage_flops(stage, self.num_stages, 1, s)) for s in (1, 2))
        return (f2 - 2.0 * f1) / 2.0

    def _params(self):
        return {"flops_per_s": self.flops_per_s, "overhead_s": self.overhead_s, "bwd_ratio": self.bwd_ratio}

    @classmethod
    def _from_parts(cls, cfg, p, comm, meta, params):
        return cls(cfg, p, comm=comm, meta=meta, **params)
