"""Smoke test of ``studies/shortdoc/stage_recompute.py``: the cells it runs and its main -> branch table."""

from __future__ import annotations

import pandas as pd

from studies.shortdoc import stage_recompute as sr


def _row(step: float, blocks: list[int] | None) -> dict:
    return {"model": "llama3.1-8b", "P": 8, "limit": "24GiB", "step_s": step, "gap_balanced": step / 3.8 - 1,
            "kind": "zb", "microbatches": 100, "split": [4.0, 4.0], "split_recompute": blocks,
            "gap_schedule": 0.01, "gap_overhead": 0.02, "gap_shape": 0.04}


def test_the_table_reads_main_and_branch_rows() -> None:
    out = sr.table(pd.DataFrame([_row(4.2, None)]), pd.DataFrame([_row(4.1, [2, 0])]))
    assert "4.2000 -> 4.1000" in out and "[2, 0]" in out and "1.0 / 2.0 / 4.0" in out
    assert len(sr.CELLS) == 6 and {c[2] for c in sr.CELLS} == {"24GiB", "80GiB"}
