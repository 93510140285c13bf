"""Smoke test of ``studies/shortdoc/recompute27.py``: its table of default and recomputing layouts."""

from __future__ import annotations

import json
from pathlib import Path

from studies.shortdoc import recompute27


def _row(layout: str, step: float, blocks: list[int] | None) -> dict:
    terms = {f"gap_{t}": v for t, v in (("schedule", 0.04), ("ends", 0.015), ("overhead", 0.019), ("shape", 0.033),
                                       ("passes", 0.0 if blocks is None else 0.02))}
    return {"trace": "sharegpt", "model": "llama2-7b", "P": 16, "limit": "24GiB", "layout": layout, "blocks": blocks,
            "step_s": step, "ideal_s": 1.7654 if blocks is None else 1.78, "kind": "zb", "microbatches": 137,
            "admission": [4350, 4498, 4684, 5042], **terms}


def test_the_table_reads_every_layout(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    rows = [_row("default", 1.9521, None), _row("first 1", 1.9544, [1, 0]),
            {"trace": "sharegpt", "model": "llama2-7b", "P": 16, "layout": "first 8", "status": "refused"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = recompute27.table([path])
    assert "| default | none | 1.9521 | 1.0000 | +10.6% | zb 137 | 4350, 4498, 4684, 5042 | +4.0 | +1.5 | +1.9 | +3.3 | +0.0 |" \
        in out
    assert "| first 1 | 1,0 | 1.9544 | 1.0012 | +10.7% |" in out and "+2.0 |" in out and "first 8" not in out
