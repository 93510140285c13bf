"""``benchmarks/plan_cores.py --breakdown``: the sampler counts a part only while a function that marks it is on
the stack (a wrong mark, or a path it cannot match, counts nothing or the wrong part)."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import dynmb

ROOT = Path(__file__).resolve().parents[1]


def _plan_cores():
    spec = importlib.util.spec_from_file_location("plan_cores_under_test", ROOT / "benchmarks" / "plan_cores.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.filterwarnings("ignore:Planner. planning model")
def test_breakdown_counts_the_parts_on_the_stack_only():
    pc = _plan_cores()
    cfg = dynmb.model_config("tiny")
    planner = dynmb.Planner(model=cfg, num_stages=2, memory_limit="1GiB", schedule="1f1b")
    lengths = np.random.default_rng(0).integers(16, 200, 64)
    sampled = pc.Breakdown(interval_s=0.001)
    with sampled.sampling():
        t0 = time.process_time()
        while time.process_time() - t0 < 0.5:
            planner.plan(lengths, method="fixed")
    assert sampled.samples > 50
    assert sampled.parts["packing (every method)"] > 0 and sampled.parts["simulation"] > 0
    assert sampled.parts["zb list scheduler"] == 0                  # a 1f1b plan builds no zero-bubble schedule
    assert all(n <= sampled.samples for n in sampled.parts.values())
    assert "samples" in sampled.report()
