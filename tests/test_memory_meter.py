"""The CPU memory meter (``dynmb.runtime.meter``) charges each backward the transient bytes of its own microbatch.

At the start of a stage's backward the meter adds the gradients made there that nothing holds: the input's
gradient and, on the LM-head stage, the logits' gradient. It used to pop them first in first out over the
forwards, so the reversed backwards of a chain of slices were charged the first (longest) slices' bytes; it now
hangs them on a gradient hook of each forward's own output. Also checked: the logits' gradient at the logits'
dtype and Adam's states before the first step at the parameters' dtype (float64 models: 8 bytes each, as the
analytic memory model counts them)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dynmb.core.config import ModelConfig
from dynmb.core.types import Microbatch
from dynmb.memory.model import MemoryModel
from dynmb.models import build_stage, make_inputs, synthetic_tokens
from dynmb.runtime.meter import MemoryMeter

TINY = ModelConfig.preset("tiny")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_backward_is_charged_its_own_forwards_gradients_in_reverse_order(dtype):
    """The LM-head stage of two runs F(200) F(40), then B(40) B(200), as a chain of slices does: each backward's
    start adds exactly its own input and logits gradients (and the 0-dim loss gradient)."""
    cfg = replace(TINY, dtype=dtype)
    e = cfg.dtype_bytes
    mod = build_stage(cfg, 1, 2)
    meter = MemoryMeter("cpu", [mod], optimizer=None)
    assert meter.state_bytes == MemoryModel.analytic(cfg, 2).state_bytes[1]      # Adam's states at the dtype
    runs = []
    for s in (200, 40):
        mb = Microbatch(seq_ids=[0], lengths=[s], padded_len=s, batch=1)
        inp = make_inputs(mb, synthetic_tokens([s], cfg.vocab_size), cfg=cfg)
        x = torch.randn(1, s, cfg.d_model, dtype=getattr(torch, dtype), requires_grad=True)
        with meter.saving(1):
            runs.append((s, mod(x, inp)))
        del x, inp
    for s, out in reversed(runs):
        before = meter.current_bytes
        meter.reset_peak()
        with meter.saving(1):
            out.backward()
        own = s * cfg.d_model * e + s * cfg.vocab_size * max(4, e) + e     # input, logits, loss gradients
        assert meter.peak_bytes - before == own, (s, meter.peak_bytes - before, own)
        meter.sample(1)
    del runs, out
    meter.close()
