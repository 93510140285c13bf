"""Smoke test of ``studies/shortdoc/v_split.py``: the split balanced per V GPU covers the layers, every chunk holds a
unit, and it balances the V GPUs far better than the split ``--virtual 2`` resolves for the loop placement."""

from __future__ import annotations

import numpy as np
from studies.scaling import scaling
from studies.shortdoc import v_split

from dynmb import data
from dynmb.planning.split_units import CHUNK, HALF, flops_cost, unit_row


def test_the_v_split_balances_the_v_gpus() -> None:
    cfg = scaling.model_for("llama2-7b", [data.load_trace("gsm8k")])
    cost = flops_cost(300)
    for P, grain, floor in ((16, CHUNK, 0.97), (8, CHUNK, 0.98), (16, HALF, 0.86)):
        split, ceiling = v_split.v_split(cfg, 2 * P, cost, grain)
        assert len(split) == 2 * P and min(split) > 0 and abs(sum(split) - cfg.n_layers) < 1e-9
        assert ceiling >= floor, (P, grain, ceiling)
    row = unit_row(cfg, cost, CHUNK)
    even = [row.work.size // 32] * 32                  # one layer a chunk: GPU 0 carries the head besides two layers
    g = v_split.gpu_loads(row, even)
    assert g.mean() / g.max() < 0.95 and int(np.argmax(g)) == 0
