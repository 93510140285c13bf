"""``GPUCostModel``: shape-dependent efficiencies behave as documented; JSON round trip."""

from __future__ import annotations

import numpy as np
import pytest

from dynmb.core.config import ModelConfig
from dynmb.costmodel import CostModel, GPUCostModel, GPUSpec, LINKS


def _model(p: int = 4) -> GPUCostModel:
    return GPUCostModel(ModelConfig.preset("small", d_model=4096, n_heads=32, d_ff=11008, n_layers=32,
                                           vocab_size=32000), p)


def test_large_microbatches_reach_the_gemm_efficiency() -> None:
    cm, spec = _model(), GPUSpec()
    b, s = 4, 4096
    t = float(cm.predict(1, "F", b, s, attn=0.0))              # no attention work: linear FLOPs only
    flops = float(cm.model_cfg.stage_flops(1, 4, b, s)) - cm._attn_flops_per_unit(1) * b * s * s
    overhead = spec.overhead_s + spec.overhead_per_layer_s * 8
    achieved = flops / (t - overhead) / spec.peak_flops
    assert achieved == pytest.approx(spec.gemm_eff_max * b * s / (b * s + spec.gemm_m_half), rel=1e-9)


def test_small_problems_run_less_efficiently_and_backward_costs_more() -> None:
    cm = _model()
    rows = np.array([1, 1, 1, 8])
    lens = np.array([16, 256, 4096, 4096])
    f, b = cm.predict(1, "F", rows, lens), cm.predict(1, "B", rows, lens)
    per_token = f / (rows * lens)
    assert per_token[0] > per_token[1] > per_token[3]          # tiny GEMMs are inefficient
    assert np.all(b > 1.9 * f - 1e-3) and np.all(np.diff(f[:3]) > 0)
    # packing short documents into one row: same tokens, far less attention work, less time
    assert float(cm.predict(1, "F", 1, 4096, attn=16 * 256 ** 2)) < float(cm.predict(1, "F", 1, 4096))


def test_round_trip_and_links() -> None:
    cm = GPUCostModel(ModelConfig.preset("small"), 2, spec=GPUSpec(gemm_eff_max=0.5), link="nvlink")
    back = CostModel.from_dict(cm.to_dict())
    assert isinstance(back, GPUCostModel) and back.spec == cm.spec
    assert back.comm.bytes_per_s == LINKS["nvlink"].bytes_per_s
    np.testing.assert_allclose(back.predict(0, "B", [1, 3], [100, 300]), cm.predict(0, "B", [1, 3], [100, 300]))
    with pytest.raises(ValueError, match="unknown link"):
        GPUCostModel(ModelConfig.preset("small"), 2, link="ethernet")
    with pytest.raises(ValueError, match="peak_flops"):
        GPUSpec(peak_flops=0)


def test_the_ideal_stays_below_every_plan_of_a_gpu_model() -> None:
    # efficiency rises with microbatch size, so a sequence alone costs more than its share of a row:
    # the ideal prices every FLOP at the best efficiency and stays a lower bound
    import dynmb
    from dynmb.data import load_trace, sample_batch

    cfg = ModelConfig.preset("small", d_model=1024, n_heads=16, d_ff=4096, n_layers=8, vocab_size=32000,
                             max_seq_len=32768)
    planner = dynmb.Planner(model=cfg, num_stages=4, memory_limit="80GiB", cost_model=GPUCostModel(cfg, 4),
                            oversize="truncate")
    batch = sample_batch(load_trace("sharegpt"), 256, seed=1)
    for method in ("fixed", "packed", "balanced", "dynamic"):
        sim = planner.plan(batch, method=method).sim
        assert sim.ideal_s <= sim.bound_s * (1 + 1e-9) and sim.bound_s <= sim.makespan_s * (1 + 1e-9), method


def test_the_split_backward_is_the_devices_own() -> None:
    """On a GPU the weight gradients are the forward's GEMM FLOPs and the split costs nothing (Qi et al.,
    arXiv:2401.10241, Table 1): W + I == B exactly, W is the forward less its attention, and the CPU's
    measured shares (``dynmb.costmodel.split``) are not used."""
    cm = _model()
    b, s = np.array([1.0, 4.0, 16.0]), np.array([4096.0, 1024.0, 256.0])
    for stage in range(cm.num_stages):
        full, i, w = (cm.predict(stage, op, b, s) for op in ("B", "I", "W"))
        np.testing.assert_allclose(i + w, full, rtol=1e-12)
        no_attn_f = cm.predict(stage, "F", b, s, np.zeros_like(b)) - cm.spec.overhead_s \
            - cm.spec.overhead_per_layer_s * cm._layers[stage]
        np.testing.assert_allclose(w, no_attn_f, rtol=1e-9)


def test_the_a100_megatron_spec_matches_the_zero_bubble_papers_profiled_times() -> None:
    """``A100_SXM_MEGATRON`` against the paper's Table 9 (1.5B, P 8, microbatch 6 x 1024; its middle stage,
    3 of 22 layers): F, I (the paper's B) and W each within 12%."""
    from dynmb.costmodel.gpu import A100_SXM_MEGATRON
    cfg = ModelConfig(name="gpt3-1.5b", family="gpt2", vocab_size=50257, d_model=2304, n_layers=22, n_heads=24,
                      d_ff=4 * 2304, max_seq_len=1024, dtype="bfloat16", layer_split=(2, 3, 3, 3, 3, 3, 3, 2))
    cm = GPUCostModel(cfg, 8, spec=A100_SXM_MEGATRON)
    published = {"F": 18.522e-3, "I": 18.086e-3, "W": 9.337e-3}
    for op, t in published.items():
        assert abs(float(cm.predict(4, op, 6, 1024)) / t - 1) < 0.12, op
