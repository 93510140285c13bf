"""The memory a recomputed continued slice's backward keeps (``dynmb.memory.coef.slice_recompute_coef``): each
finished block's recomputed keys and values stay referenced by the prefix store until the slice's whole backward
ends. Fast checks of the per-layer bytes against the storages the attention modules make and of the simulator's
use of the term; the real-rank check is ``tests/test_slices_dp.py``'s gloo case (predicted >= measured)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dynmb.core.config import ModelConfig
from dynmb.core.types import Microbatch, Plan
from dynmb.costmodel import get_cost_model
from dynmb.costmodel.loader import Models
from dynmb.memory.coef import recompute_kv_kept_coef, slice_recompute_coef
from dynmb.memory.model import get_memory_model
from dynmb.models.gpt2 import Attention
from dynmb.models.llama import LlamaAttention
from dynmb.planning import make_schedule
from dynmb.timing.simulate import simulate, slice_grad_inputs


def _kept_storage_bytes(name: str, n: int = 37) -> float:
    """Bytes per token of the storages a slice's kept ``k`` and ``v`` reference, as the attention module makes
    them (``RoutedAttention._qkv``: projection, then rotary positions where the family has them)."""
    cfg = ModelConfig.preset(name)
    attn = (LlamaAttention if cfg.family == "llama" else Attention)(cfg)
    x = torch.randn(n, cfg.d_model)
    q, k, v = attn.project(x)
    if not cfg.learned_positions:
        hd = cfg.head_dim
        cs = (torch.ones(n, hd), torch.zeros(n, hd))
        q, k = attn.rotate(q, k, cs)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (k, v)}
    return sum(storages.values()) / n


@pytest.mark.parametrize("name", ["tiny", "llama-tiny", "small", "llama-small"])
def test_kept_keys_and_values_bytes_match_the_attention_modules_storages(name):
    assert recompute_kv_kept_coef(ModelConfig.preset(name)) == pytest.approx(_kept_storage_bytes(name))


def test_slice_recompute_coef_counts_every_layer_but_the_one_being_recomputed():
    cfg = ModelConfig.preset("tiny")                    # 4 layers; 2 stages of 2, the head on stage 1
    r = recompute_kv_kept_coef(cfg)
    two = slice_recompute_coef(cfg, 2)
    assert two[0] == pytest.approx(r)                   # (2 - 1) layers kept beside the stage's first block
    assert 0.0 <= two[1] <= r                           # the head stage: less the head phase's margin
    assert slice_recompute_coef(cfg, 4)[0] == 0.0       # one layer: nothing finished before it


def _chain(pieces: list[int], recompute: bool, stages: int) -> Plan:
    offsets = np.cumsum([0, *pieces[:-1]])
    mbs = [Microbatch([0], [n], n, 1, recompute=recompute, offsets=[int(o)], continued=[j < len(pieces) - 1])
           for j, (n, o) in enumerate(zip(pieces, offsets))]
    return Plan(tuple(mbs), "dynamic", stages, 1 << 30, 1)


def test_the_simulator_charges_it_during_recomputed_continued_slices_backwards_only():
    cfg = ModelConfig.preset("tiny")
    mm, cm = get_memory_model(None, cfg, 2), get_cost_model(None, cfg, 2)
    plan = _chain([700, 500, 300], True, 2)
    held = slice_grad_inputs(mm, plan).recomputed
    assert held is not None
    np.testing.assert_allclose(held, mm.slice_recompute_coef()[:, None] * np.array([[700, 500, 0]]))
    assert slice_grad_inputs(mm, _chain([700, 500, 300], False, 2)).recomputed is None
    sched = make_schedule(plan, "1f1b", models=Models(cm, mm))
    with_term = simulate(sched, plan, cm, mm).peak_bytes
    mm.slice_recompute_coef = lambda: np.zeros(2)       # the model without the term
    without = simulate(sched, plan, cm, mm).peak_bytes
    assert np.all(with_term > without)                  # the peak is in a continued slice's backward
    assert np.all(with_term - without <= slice_recompute_coef(cfg, 2) * 700 + 1)
