"""Stage boundaries inside a half-block (``dynmb.core.model_sizes``: units of 1/16 layer, ``stage_pieces``)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dynmb.core.config import ModelConfig
from dynmb.core.model_sizes import SUB_CHUNKS, UNITS_PER_LAYER, HalfPiece

LLAMA = ModelConfig.preset("llama-tiny")        # 4 layers, 2 K/V heads, d_ff 176


def test_pieces_cover_every_chunk_once_in_order() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        p = int(rng.integers(2, 7))
        cuts = np.sort(rng.choice(np.arange(1, UNITS_PER_LAYER * LLAMA.n_layers), p - 1, replace=False))
        cuts = [c for c in cuts if c % SUB_CHUNKS in (0, 4) or (c // SUB_CHUNKS) % 2]   # whole K/V heads (2)
        units = np.diff([0, *cuts, UNITS_PER_LAYER * LLAMA.n_layers])
        cfg = replace(LLAMA, layer_split=tuple(float(u) / UNITS_PER_LAYER for u in units))
        n = len(units)
        flat = [(pc.layer, pc.part, c) for pieces in cfg.stage_pieces(n) for pc in pieces for c in pc.chunks]
        assert flat == [(i, part, c) for i in range(LLAMA.n_layers) for part in ("attn", "mlp")
                        for c in range(SUB_CHUNKS)]
        assert sum(a + m for a, m in cfg.stage_parts(n)) == pytest.approx(2 * LLAMA.n_layers)
        ends = np.cumsum(units)[:-1]
        assert [cfg.message_channels(s, n) for s in range(n - 1)] == \
            [LLAMA.d_model * (2 if e % SUB_CHUNKS else 1) for e in ends]


def test_a_boundary_inside_the_mlp_half() -> None:
    cfg = replace(LLAMA, layer_split=(2.75, 1.25))
    assert cfg.chunk_split and cfg.half_split and cfg.unit_split == (44, 20)
    assert cfg.stage_pieces(2)[0][-1] == HalfPiece(2, "mlp", range(0, 4))
    assert cfg.stage_pieces(2)[1][0] == HalfPiece(2, "mlp", range(4, 8)) and not cfg.stage_pieces(2)[1][0].whole
    assert cfg.stage_parts(2) == [(3, 2.5), (1, 1.5)] and cfg.stage_layer_counts(2) == [2.75, 1.25]
    assert cfg.stage_blocks(2)[1][0] == (2, ("mlp",))
    assert [cfg.message_channels(s, 2) for s in range(2)] == [2 * cfg.d_model, cfg.d_model]
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="cuts blocks in half"):      # a model of one's own: whole layers
        cfg.stage_layers(2)
    f = [cfg.stage_flops(s, 2, 1, 100) for s in range(2)]
    assert sum(f) == pytest.approx(LLAMA.stage_flops(0, 1, 1, 100))


def test_attention_boundaries_fall_on_whole_kv_heads() -> None:
    assert replace(LLAMA, layer_split=(1.25, 2.75)).stage_pieces(2)[0][-1] == HalfPiece(1, "attn", range(0, 4))
    with pytest.raises(ValueError, match="n_kv_heads 2 is not divisible"):
        replace(LLAMA, layer_split=(1.125, 2.875))
    with pytest.raises(ValueError, match="d_ff 100 is not divisible"):
        replace(LLAMA, d_ff=100, layer_split=(1.5625, 2.4375))


def test_every_message_is_priced_at_the_widest_link() -> None:
    """The simulator prices one P2P time per microbatch on every link: at the widest message of the layout
    (``link_bytes``: ``[y | h]`` after a boundary inside a half-block, 2 d), the even split's at d."""
    from dynmb.costmodel.gpu import GPUCostModel
    from dynmb.timing.simulate import comm_times

    cfg = replace(LLAMA, layer_split=(1.75, 1.75, 0.5))         # stage 0 ends inside layer 1's MLP, 1 on a half
    assert cfg.link_bytes(2, 300, 3) == 2 * cfg.message_bytes(2, 300)
    assert LLAMA.link_bytes(2, 300, 2) == LLAMA.message_bytes(2, 300)
    assert replace(LLAMA, layer_split=(1.5, 2.5)).link_bytes(2, 300, 2) == LLAMA.message_bytes(2, 300)
    cm, even = GPUCostModel(cfg, 3), GPUCostModel(LLAMA, 3)
    assert float(cm.comm_s(2, 300)) == pytest.approx(float(cm.comm.time(2 * LLAMA.message_bytes(2, 300))))
    assert float(even.comm_s(2, 300)) == pytest.approx(float(even.comm.time(LLAMA.message_bytes(2, 300))))

    class Plan:                                                   # what comm_times reads of a plan
        num_stages = 3

        @staticmethod
        def shapes() -> np.ndarray:
            return np.array([[2, 300], [1, 50]])

    assert comm_times(cm, Plan()) == pytest.approx([float(cm.comm_s(2, 300)), float(cm.comm_s(1, 50))])
