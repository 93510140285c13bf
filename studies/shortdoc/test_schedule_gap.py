"""Smoke test of ``studies/shortdoc/schedule_gap.py``: the idle tenths of a rank and the markdown row."""

from __future__ import annotations

import pandas as pd
import pytest
from studies.shortdoc import schedule_gap


def test_idle_tenths_split_a_rank_s_waits_into_first_middle_and_last_tenth():
    # rank 0 busy from 0.2 to 9.5 of a 10 s step: idle 0.2 in the first tenth, 0.5 in the last, none between
    timeline = pd.DataFrame({"rank": [0, 0, 1], "start_s": [0.2, 5.0, 0.0], "end_s": [5.0, 9.5, 10.0]})
    first, middle, last = schedule_gap.idle_tenths(timeline, 0, 10.0)
    assert (first, middle, last) == pytest.approx((0.2, 0.0, 0.5))
    assert schedule_gap.idle_tenths(timeline, 1, 10.0) == pytest.approx((0.0, 0.0, 0.0))


def test_the_markdown_row_has_the_header_s_columns():
    row = schedule_gap.GapRow("gsm8k", "llama2-7b", 16, "24GiB", "last", "zb", 169, 1.9, 1.8, 1.7, 11.0, 4.0, 3.0,
                              40.0, 20.0, 20.0, 14, 1.9, 1.89)
    line = schedule_gap.markdown(row)
    assert line.count("|") == schedule_gap.HEADER.splitlines()[0].count("|")
    assert "+1.0" in line                                                 # schedule - P2P share
