"""Smoke test of ``studies/shortdoc/embedding_auto_time.py``: one round on a small cell times both places' builds and
the four jobs, and its sample-batch choice is ``choose_on_samples``'s."""

from __future__ import annotations

import numpy as np
import pytest
from studies.scaling import scaling
from studies.shortdoc import embedding_auto_time as eat

from dynmb import data


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_one_round_times_every_job_on_a_small_cell():
    trace = data.load_trace("gsm8k")
    cfg = scaling.model_for("llama2-7b", [trace])
    batch = np.asarray(trace[:24], dtype=np.int64)
    row = eat.one_round(cfg, trace, 8, "24GiB", batch, 1)
    assert set(row) == {"build first", "build last", *eat.TIMED, "samples_place"}
    assert all(v >= 0 for v in row.values()) and row["samples_place"] in (0.0, 1.0)
