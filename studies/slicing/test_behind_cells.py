"""The three long-document cells where ``dynamic`` was behind a plain method after the lean Llama blocks
(``README.md``, the tenth session; ``tests/test_behind.py`` holds each screen's own case): dynamic's step <= that
method's on the cell's planner (``longdoc.cell_planner``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import dynmb.planning.slicing as slicing
from studies.slicing import longdoc


@pytest.mark.skipif(not os.environ.get("DYNMB_SLOW"), reason="slow: minutes of planning per cell; DYNMB_SLOW=1")
@pytest.mark.parametrize("trace, model, stages, method", [
    ("longtail", "llama3.1-8b", 16, "balanced/2"),      # the final check's budgets (0.03% behind before)
    ("pycode", "llama3.1-8b", 8, "fixed"),              # the kind screen and the longer slices spread (7.3%)
    ("pycode", "llama2-7b", 16, "token-budget/2"),      # the kind screen (23.1%)
])
def test_dynamic_is_not_behind_on_the_long_document_cells(trace, model, stages, method):
    """The three ``longdoc`` cells where dynamic was behind a plain method (``studies/slicing/README.md``, ninth
    session): dynamic's step <= that method's. Each fails on a7d79fd."""
    planner, batch, _ = longdoc.cell_planner(trace, longdoc.load(trace, Path("results/traces")), model, stages)
    with slicing.reuse_searches():
        dyn = longdoc.plan_method(planner, batch, "dynamic")[0].sim.makespan_s
        other = longdoc.plan_method(planner, batch, method)[0].sim.makespan_s
    assert dyn <= other * (1 + 1e-9)
