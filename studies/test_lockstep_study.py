"""Smoke test of ``studies/lockstep/lockstep_study.py``: one small cell, its columns, (e) never slower than (a)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd

STUDY = Path(__file__).resolve().parent / "lockstep" / "lockstep_study.py"


def test_one_cell(tmp_path):
    spec = importlib.util.spec_from_file_location("lockstep_study", STUDY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--traces", "wikitext2", "--models", "llama2-7b", "--P", "2", "--D", "2", "--T", "4096",
                     "--dynamic-max-tokens", "1e5", "--out", str(tmp_path)]) == 0
    df = pd.read_csv(tmp_path / "lockstep.csv")
    assert len(df) == 1
    row = df.iloc[0]
    assert row.e_lockstep_s <= row.a_packed_s * (1 + 1e-12) and row.e_lockstep_s <= row.a0_stream_s * (1 + 1e-12)
    assert row.ideal_s < min(row.e_lockstep_s, row.f_dynamic_s)
    for col in ("gap_a_packed", "gap_b_D", "gap_c_M", "gap_d_G", "gap_e_lockstep", "gap_f_dynamic", "share_M", "floor_vs_a", "e_vs_per_group"):
        assert col in df
