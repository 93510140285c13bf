"""Smoke test of ``studies/shortdoc/lean_blocks_time.py``: its unfused baseline is the same function as the lean
blocks (equal outputs and gradients) that saves more for backward, and is undone on leaving."""

from __future__ import annotations

import torch
from studies.shortdoc import lean_blocks_time as lbt

from dynmb.core.config import ModelConfig
from dynmb.models import full_microbatch, make_inputs, synthetic_tokens
from dynmb.models.llama import LlamaBlock, RMSNorm, position_tables


def _run(block: LlamaBlock, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, int]:
    mb = full_microbatch(2, 24)
    inputs = make_inputs(mb, synthetic_tokens(mb.lengths, cfg.vocab_size), cfg=cfg)
    x = torch.randn(2, 24, cfg.d_model, generator=torch.Generator().manual_seed(1), requires_grad=True)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = block(x, inputs, position_tables(inputs, cfg, torch.float32))
    y.sum().backward()
    assert x.grad is not None
    return y.detach(), x.grad, sum(saved.values())


def test_the_unfused_baseline_is_the_same_block_saving_more():
    cfg = ModelConfig.preset("llama-tiny")
    block = LlamaBlock(cfg, 0)
    lean_y, lean_g, lean_bytes = _run(block, cfg)
    with lbt.unfused():
        old_y, old_g, old_bytes = _run(block, cfg)
    assert RMSNorm.forward is not lbt._unfused_norm                      # undone on leaving
    torch.testing.assert_close(lean_y, old_y, rtol=0, atol=0)
    torch.testing.assert_close(lean_g, old_g, rtol=1e-4, atol=1e-6)                  # fp32: the norm's backward to rounding
    assert old_bytes > 1.2 * lean_bytes


def test_time_block_returns_positive_medians():
    t = lbt.time_block("llama-tiny", 16, 1)
    assert t.lean_s > 0 and t.unfused_s > 0 and t.ratio > 0
