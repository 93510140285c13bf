"""``GPUCostModel``: an analytic cost model of a datacenter GPU, for the simulated scaling studies.

Nothing here is measured by dynmb; every constant is a published figure or an estimate derived from
one, named below, and ``studies/scaling/scaling.py`` prints them beside its tables. A forward op of a
stage on a microbatch of ``b`` rows x ``s`` padded tokens with attention work ``a`` (sum of segment
lengths squared) takes

    overhead + linear_flops / (peak x gemm_eff(b * s)) + attn_flops(a) / (peak x attn_eff(s_seg))

with ``linear_flops`` and ``attn_flops`` split out of ``ModelConfig.stage_flops`` (the same FLOP
count for both families as every other consumer: its ``rows * padded_len**2`` attention term is
rescaled to the microbatch's attention work ``a``, as ``AnalyticCostModel`` does) and
``s_seg = a / (b * s)``, the mean attention segment a token sees. Efficiency curves
(``x / (x + half)`` saturation, the shape of tile and wave quantization for small problems):

- ``gemm_eff(M) = gemm_eff_max * M / (M + gemm_m_half)`` over the GEMM's M = tokens of the
  microbatch (N and K are the model widths, >= 2048 for every published preset, so they fill tiles);
- ``attn_eff(s) = attn_eff_max * s / (s + attn_s_half)``: fused attention kernels are efficient
  only on long sequences.

Backward: 2x the linear FLOPs (input and weight gradients) at the same efficiency, and
``attn_bwd_ratio`` x the attention FLOPs (FlashAttention's backward recomputes the scores: 5 matmuls
against the forward's 2, 2.5x) at ``attn_bwd_eff`` of the forward's efficiency. P2P: the
``CommModel`` of the link (``LINKS``): ``alpha + bytes / bandwidth``.

Unfused attention (``score_bytes_fwd`` / ``score_bytes_bwd`` > 0: the scores are written to HBM, as
Megatron-LM without FlashAttention does): every attention score (``n_heads`` x the attention work
per layer) moves that many bytes through memory at ``hbm_bytes_per_s`` in the forward and in the
input-gradient backward (softmax, mask, dropout and their gradients). Fused kernels keep the scores
on chip: 0 (``H100_SXM``).

Split backward (``I``, ``W``; Qi et al., "Zero Bubble Pipeline Parallelism", arXiv:2401.10241, Table 1):
``W`` is the weight-gradient GEMMs, the same FLOPs as the forward's GEMMs (``sbh * 24h`` per layer),
at the same efficiency: ``W = linear_s``; ``I = (1 + split_overhead) B - W`` (the input-gradient GEMMs,
all of attention's backward, the launches). The split does no extra work on a GPU (``split_overhead`` 0: the deferred
GEMMs read the inputs and output gradients the full backward would, kept until ``W``), unlike
the CPU shares of ``dynmb.costmodel.split``. Checked against the paper's profiled times (its Table 9,
A100, Megatron-LM, GPT-3-like 1.5B-28.3B): with ``A100_SXM_MEGATRON`` a middle stage's F is within 0-3% of its ``T_F``, I within 2-9% of its ``T_B``
(the paper's B is dynmb's I) and W within 5-11% of its ``T_W`` for the four models (``studies/zerobubble``).

Sources of the constants (``H100_SXM``; H200 has the same Hopper compute, more HBM):
- HBM bandwidth 3.35 TB/s (H100 SXM5 datasheet); A100 SXM 80GB 2.039 TB/s and 312 TFLOP/s dense BF16
  (A100 datasheet);
- ``A100_SXM_MEGATRON`` (the zero-bubble paper's setting, Megatron-LM without FlashAttention):
  ``score_bytes_fwd = 36``, ``score_bytes_bwd = 27``: the paper's profiled ``T_F`` and ``T_B`` (its
  Table 9) less this model's GEMM and attention-matmul times, per score, at 2.039 TB/s; 34-40
  (forward) and 22-31 (backward) bytes over its four models, the middle taken;
- peak 989 TFLOP/s dense BF16: NVIDIA H100 Tensor Core GPU datasheet (SXM5), and H200 datasheet;
- GEMM efficiency: large BF16 GEMMs on H100 sustain about 75-80% of peak (cuBLAS; NVIDIA's
  "Matrix Multiplication Background" user guide explains the small-M loss by tile and wave
  quantization); ``gemm_eff_max = 0.78``, half efficiency at M = 128 tokens (one tile row);
- attention: FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608) reaches 600-740 TFLOP/s (60-75%)
  forward in BF16 at 8-16k tokens and about half that at 512; ``attn_eff_max = 0.75``,
  ``attn_s_half = 512``; its backward runs at about 0.75 of its forward's rate;
- per-op overhead: kernel launches of a few microseconds each (CUDA C++ Best Practices Guide), about
  ten per layer per op without CUDA graphs: ``overhead_per_layer_s = 40e-6`` plus 20 us per op;
- links: NVLink 4 is 900 GB/s per GPU in both directions together (450 GB/s one way; ``nvlink``
  uses 370 GB/s achieved and 10 us per message: NCCL's send/recv latency); InfiniBand NDR is
  400 Gb/s = 50 GB/s per GPU-NIC (ConnectX-7; ``ib`` uses 45 GB/s achieved and 20 us per message).
  Pipeline stages of a multi-node job cross nodes, so the scaling study defaults to ``ib``;
- host link (activation offload, ``dynmb.timing.offload``): an H100 SXM5 reaches its host through PCIe Gen5 x16
  (H100 datasheet: "PCIe Gen5 128 GB/s", both directions together): 32 GT/s x 16 lanes with 128b/130b encoding is
  63 GB/s each way. Pinned ``cudaMemcpyAsync`` reaches about 80% of that on Gen5 hosts (packet and DMA overhead;
  nvbandwidth-style host-to-device and device-to-host tests report 50-55 GB/s): **assumed, not measured here**,
  ``host_d2h_bytes_per_s = host_h2d_bytes_per_s = 50e9``, both at once (separate copy engines, a full-duplex
  link). A100: PCIe Gen4 x16, 32 GB/s each way, 25e9 assumed. Not modelled: the GPU's x16 link to its PCIe switch is
  shared with the NIC's GPUDirect traffic (the pipeline's P2P messages, ``2 d`` bytes per token against ``~46 d``
  per token of an offloaded Llama block: a few percent of the link), host memory capacity and NUMA placement, the
  CPU time of the copy hooks; the copies themselves take no SM time (copy engines).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from dynmb.core.config import ModelConfig

from dynmb.costmodel.base import CommModel, CostModel

__all__ = ["GPUCostModel", "GPUSpec", "H100_SXM", "A100_SXM_MEGATRON", "LINKS"]


@dataclass(frozen=True, kw_only=True)
class GPUSpec:
    """The constants of ``GPUCostModel`` (sources in the module docstring)."""

    peak_flops: float = 989e12
    """Dense BF16 tensor-core peak, FLOP/s."""
    gemm_eff_max: float = 0.78
    """Fraction of peak a large GEMM sustains."""
    gemm_m_half: float = 128.0
    """GEMM M (tokens) at which it reaches half of ``gemm_eff_max``."""
    attn_eff_max: float = 0.75
    """Fraction of peak fused attention sustains on long sequences (forward)."""
    attn_s_half: float = 512.0
    """Mean attention segment (tokens) at which attention reaches half of ``attn_eff_max``."""
    attn_bwd_ratio: float = 2.5
    """Attention backward FLOPs over forward FLOPs."""
    attn_bwd_eff: float = 0.75
    """Attention backward's efficiency relative to its forward's."""
    overhead_s: float = 20e-6
    """Fixed seconds per op (launch of the stage's first kernel, P2P posting)."""
    overhead_per_layer_s: float = 40e-6
    """Seconds per layer per op of kernel launches."""
    hbm_bytes_per_s: float = 3.35e12
    """Memory bandwidth, bytes/s (the memory-bound unfused attention below)."""
    score_bytes_fwd: float = 0.0
    """Bytes moved through HBM per attention score in the forward (0: fused attention keeps scores on chip)."""
    score_bytes_bwd: float = 0.0
    """Bytes moved per attention score in the input-gradient backward (0: fused attention)."""
    split_overhead: float = 0.0
    """(I + W) / B - 1 of a split backward: 0 on a GPU (the deferred weight GEMMs redo nothing)."""
    host_d2h_bytes_per_s: float = 50e9
    """Device-to-host copy rate of pinned memory, bytes/s (activation offload; 0: no host link)."""
    host_h2d_bytes_per_s: float = 50e9
    """Host-to-device copy rate of pinned memory, bytes/s (0: no host link)."""

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not np.isfinite(value) or value < 0 or (value == 0 and name in ("peak_flops", "gemm_eff_max",
                                                                                "attn_eff_max", "attn_bwd_eff",
                                                                                "hbm_bytes_per_s")):
                raise ValueError(f"GPUSpec.{name} must be finite and positive, got {value}")


H100_SXM = GPUSpec()
A100_SXM_MEGATRON = GPUSpec(peak_flops=312e12, hbm_bytes_per_s=2.039e12, score_bytes_fwd=36.0, score_bytes_bwd=27.0,
                             host_d2h_bytes_per_s=25e9, host_h2d_bytes_per_s=25e9)
"""A100 SXM 80GB running Megatron-LM's unfused attention: the zero-bubble paper's setting (module doc)."""
LINKS: dict[str, CommModel] = {
    "nvlink": CommModel(alpha_s=10e-6, bytes_per_s=370e9),
    "ib": CommModel(alpha_s=20e-6, bytes_per_s=45e9),
}
"""P2P between neighbouring stages, per link kind (sources in the module docstring)."""


class GPUCostModel(CostModel):
    """Analytic GPU stage times from FLOPs and shape-dependent efficiencies; see the module docstring."""

    kind = "gpu"
    layout_free = True

    def __init__(self, model_cfg: ModelConfig, num_stages: int, *, spec: GPUSpec = H100_SXM,
                 comm: CommModel | None = None, link: str = "ib", meta: dict[str, Any] | None = None) -> None:
        if comm is None and link not in LINKS:
            raise ValueError(f"unknown link {link!r}; expected one of {sorted(LINKS)}")
        super().__init__(model_cfg, num_stages, comm if comm is not None else LINKS[link], meta)
        self.spec = spec
        self._attn_unit = [self._attn_flops_per_unit(p) for p in range(num_stages)]
        self._layers = [len(pieces) / 2 for pieces in model_cfg.stage_pieces(num_stages)]
        """Layers' worth of kernel launches per stage: each half-block it holds counts 0.5, whole or chunks."""
        self._score_heads = [u / (4.0 * model_cfg.d_model / model_cfg.n_heads) for u in self._attn_unit]
        """Attention scores per unit of attention work on each stage (its heads x layers): the attention
        FLOPs are 4 x head_dim per score (QK^T and PV, a multiply and an add each)."""
        self._costs_seen: dict[bytes, dict[str, np.ndarray]] = {}
        """``stage_costs`` answers by a digest of their inputs and this model's calibration (``_costs_key``;
        read-only arrays, at most ``COSTS_REMEMBERED``): a plan's search asks for the same microbatches often."""

    def _attn_flops_per_unit(self, stage: int) -> float:
        """The s^2 coefficient of ``stage_flops`` at one row (its attention FLOPs per unit of work)."""
        f1, f2 = (float(self.model_cfg.stage_flops(stage, self.num_stages, 1, s)) for s in (1, 2))
        return (f2 - 2.0 * f1) / 2.0

    COSTS_REMEMBERED = 512
    """How many ``stage_costs`` answers a model remembers (the oldest is forgotten first); 0: none, every lookup
    computed afresh (the old path, for the tests' before / after)."""

    def stage_costs(self, rows: Any, padded_len: Any, attn: Any = None, ops: tuple[str, ...] = ("F", "B"),
                    recompute: Any = None) -> dict[str, np.ndarray]:
        """``CostModel.stage_costs``, remembered by its inputs' bytes (the arrays returned are read-only)."""
        if not self.COSTS_REMEMBERED:
            return super().stage_costs(rows, padded_len, attn, ops, recompute)
        key = self._costs_key(rows, padded_len, attn, ops, recompute)
        seen = self._costs_seen.get(key)
        if seen is None:
            seen = super().stage_costs(rows, padded_len, attn, ops, recompute)
            for v in seen.values():
                v.flags.writeable = False
            while len(self._costs_seen) >= self.COSTS_REMEMBERED:
                self._costs_seen.pop(next(iter(self._costs_seen)))
            self._costs_seen[key] = seen
        return dict(seen)

    def _costs_key(self, rows: Any, padded_len: Any, attn: Any, ops: tuple[str, ...], recompute: Any) -> bytes:
        """A digest of ``stage_costs``'s inputs (values, dtypes and shapes) and of what a copy of this model may
        change (``with_overhead``, ``with_scale``, ``with_recv_latency``, ``without_block_recompute``; the copies
        share the remembered answers)."""
        h = hashlib.blake2b(repr((tuple(ops), self.num_stages, self.model_cfg.recompute_blocks, self.spec,
                                  self.runtime_overhead_s,
                                  sorted(self.runtime_scale.items()), self.comm.recv_latency_s)).encode(),
                            digest_size=20)
        for x in (rows, padded_len, attn, recompute):
            if x is None:
                h.update(b"none;")
                continue
            arr = np.ascontiguousarray(x)
            h.update(f"{arr.dtype.str}{arr.shape};".encode())
            h.update(arr.tobytes())
        return h.digest()

    def own_split(self, stage: int, op: str) -> bool:
        """``I`` and ``W`` come from this model itself (module doc), not from the CPU shares."""
        return True

    def _predict(self, stage, op, b, s, a):
        g = self.spec
        tokens = b * s
        unit = self._attn_unit[stage]
        linear = np.asarray(self.model_cfg.stage_flops(stage, self.num_stages, b, s), dtype=np.float64) \
            - unit * b * s * s
        attn = unit * a
        seg = np.where(tokens > 0, a / np.maximum(tokens, 1.0), 0.0)
        gemm_eff = g.gemm_eff_max * tokens / (tokens + g.gemm_m_half)
        attn_eff = g.attn_eff_max * seg / (seg + g.attn_s_half)
        linear_s = np.where(tokens > 0, linear / (g.peak_flops * np.maximum(gemm_eff, 1e-12)), 0.0)
        attn_s = np.where(a > 0, attn / (g.peak_flops * np.maximum(attn_eff, 1e-12)), 0.0)
        scores_s = self._score_heads[stage] * a / g.hbm_bytes_per_s
        overhead = g.overhead_s + g.overhead_per_layer_s * self._layers[stage]
        if op == "F":
            return overhead + linear_s + attn_s + g.score_bytes_fwd * scores_s
        full = overhead + 2.0 * linear_s + g.attn_bwd_ratio * attn_s / g.attn_bwd_eff + g.score_bytes_bwd * scores_s
        if op == "W":
            return linear_s
        if op == "I":
            return (1.0 + g.split_overhead) * full - linear_s
        return full

    def ideal_stage_costs(self, lengths: Any) -> dict[str, np.ndarray]:
        """``{"F", "B"}: [P, n]`` seconds of each sequence's own work, no overhead: what ``dynmb.timing.bounds``
        prices the batch's ideal with. GEMMs at ``gemm_eff_max``: their efficiency grows with the
        microbatch's tokens, so a sequence's GEMMs alone would not be a lower bound (packing short
        sequences makes them cheaper than alone). Attention at the sequence's own length: with
        ``seg = a / tokens`` the op's attention time ``unit a / (peak attn_eff(seg))`` is
        ``unit (a + attn_s_half tokens) / (peak attn_eff_max)``, additive over the row's segments, so
        ``unit (L^2 + attn_s_half L) / (peak attn_eff_max)`` is each sequence's share in any microbatch
        (padding only adds), a lower bound that packing cannot undercut."""
        g = self.spec
        L = np.asarray(lengths, dtype=np.float64).reshape(-1)
        out = {"F": np.empty((self.num_stages, L.size)), "B": np.empty((self.num_stages, L.size))}
        for p in range(self.num_stages):
            unit = self._attn_unit[p]
            linear = np.asarray(self.model_cfg.stage_flops(p, self.num_stages, 1, L), dtype=np.float64) - unit * L * L
            linear_s = linear / (g.peak_flops * g.gemm_eff_max)
            attn_s = unit * (L * L + g.attn_s_half * L) / (g.peak_flops * g.attn_eff_max)
            scores_s = self._score_heads[p] * L * L / g.hbm_bytes_per_s
            out["F"][p] = linear_s + attn_s + g.score_bytes_fwd * scores_s
            out["B"][p] = 2.0 * linear_s + g.attn_bwd_ratio * attn_s / g.attn_bwd_eff + g.score_bytes_bwd * scores_s
        return out

    def _params(self):
        return asdict(self.spec)

    @classmethod
    def _from_parts(cls, cfg, p, comm, meta, params):
        return cls(cfg, p, spec=GPUSpec(**params), comm=comm, meta=meta)
