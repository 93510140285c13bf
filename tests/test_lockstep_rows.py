"""``dynmb.integrations.static_rows`` against a reference collate written here, and the 2x2 gloo example
(``experiments/lockstep_pipelining.py``) against its one-process reference."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dynmb
from dynmb.api.collate import IGNORE_INDEX
from dynmb.integrations.static_rows import StaticRowsSettings, static_rows, static_steps, thd_fields
from tests.spawn_ranks import spawn_ranks

EXAMPLE = Path(__file__).resolve().parents[1] / "experiments" / "lockstep_pipelining.py"


def _reference_rows(rec, tokens, T: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[list[int]]]:
    """Rows built directly: documents of a row in entry order, positions 0..s-1, labels = the next id of
    the document (its end-of-text last); pads 0 / 0 / ignored; the segment lengths of every row."""
    ids, pos, lab = np.zeros((b, T), np.int64), np.zeros((b, T), np.int64), np.full((b, T), IGNORE_INDEX, np.int64)
    segs: list[list[int]] = [[] for _ in range(b)]
    fill = [0] * b
    for k in range(len(rec.indices)):
        r, s = int(rec.row_ids[k]), int(rec.lengths[k])
        a = fill[r]
        ids[r, a:a + s] = np.asarray(tokens[rec.indices[k]][:s])
        pos[r, a:a + s] = np.arange(s)
        lab[r, a:a + s] = np.asarray(tokens[rec.indices[k]][1:s + 1])
        fill[r] += s
        segs[r].append(s)
    for r in range(b):
        if fill[r] < T:
            segs[r].append(T - fill[r])
    return ids, pos, lab, segs


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([32, 64]), st.integers(1, 2), st.integers(1, 3), st.integers(0, 2**31))
def test_rows_equal_a_reference_collate(T, mbs, dp, seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(8 * dp * mbs, 60 * dp))
    lens = np.minimum(rng.pareto(1.0, n) * 5 + 1, T).astype(np.int64)
    tokens = [torch.as_tensor(rng.integers(1, 500, int(s) + 1)) for s in lens]      # length + 1 ids
    total_valid = int(lens.sum())
    seen = []
    for rank in range(dp):
        sampler = dynmb.DynamicBatchSampler(lens, n, model="llama-tiny", num_stages=2, memory_limit="2GiB",
                                            method="lockstep", num_replicas=dp, rank=rank, shuffle=False,
                                            pack_len=T, mbs=mbs)
        recs = list(sampler)
        rows = list(static_rows(recs, tokens, StaticRowsSettings(pack_len=T, rows_per_mb=mbs)))
        assert len(rows) == len(recs)
        for rec, row in zip(recs, rows):
            ids, pos, lab, segs = _reference_rows(rec, tokens, T, mbs)
            assert row.input_ids.shape == (mbs, T)
            assert np.array_equal(row.input_ids.numpy(), ids)
            assert np.array_equal(row.positions.numpy(), pos)
            assert np.array_equal(row.labels.numpy(), lab)
            assert row.step_valid_tokens == total_valid
            thd = row.thd()
            want = np.concatenate([[0], np.cumsum([s for r in segs for s in r])])
            assert np.array_equal(thd.cu_seqlens_q.numpy(), want) and thd.qkv_format == "thd"
            assert thd.max_seqlen_q == max(s for r in segs for s in r)
            seen += rec.indices.tolist()
    assert sorted(seen) == list(range(n))


def test_short_steps_are_completed_with_pad_microbatches_and_long_ones_refused():
    lens = np.full(12, 20)
    tokens = [torch.arange(21) + 1 for _ in lens]
    sampler = dynmb.DynamicBatchSampler(lens, 12, model="llama-tiny", num_stages=2, memory_limit="2GiB",
                                        method="lockstep", num_replicas=1, shuffle=False, pack_len=64)
    m = len(list(sampler))
    step = next(static_steps(sampler, tokens, StaticRowsSettings(pack_len=64, microbatches=m + 2)))
    assert step.input_ids.shape == (m + 2, 64) and bool((step.labels[m:] == IGNORE_INDEX).all())
    with pytest.raises(ValueError, match="more than the"):
        list(static_rows(sampler, tokens, StaticRowsSettings(pack_len=64, microbatches=m - 1)))
    with pytest.raises(ValueError, match="--method lockstep --pack-len 32"):
        list(static_rows(sampler, tokens, StaticRowsSettings(pack_len=32)))


def test_thd_fields_one_token_documents_and_pads():
    doc = torch.tensor([[0, 1, 1, 2, -1, -1], [0, 0, 0, 0, 0, 0]])
    f = thd_fields(doc)
    assert f.cu_seqlens_q.tolist() == [0, 1, 3, 4, 6, 12] and f.max_seqlen_kv == 6


def _load_example():
    spec = importlib.util.spec_from_file_location("lockstep_pipelining", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["lockstep_pipelining"] = mod
    spec.loader.exec_module(mod)
    return mod


def _worker(rank: int, world: int, store: str, out: str, argv: list[str]) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        ex = _load_example()
        res = ex.train(rank, world, ex.build_args().parse_args(argv))
        Path(out, f"rank{rank}.json").write_text(json.dumps(res))
        dist.destroy_process_group()
    except Exception:
        Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


@pytest.mark.slow
def test_the_2x2_example_equals_the_one_process_reference(tmp_path):
    argv = ["--pp", "2", "--steps", "2", "--out", str(tmp_path)]
    spawn_ranks(_worker, 4, lambda r: (r, 4, str(tmp_path / "store"), str(tmp_path), argv), 300)
    errors = sorted(tmp_path.glob("*.err"))
    assert not errors, errors[0].read_text()
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert {r["microbatches"] for r in results} == {results[0]["microbatches"]}
    ex = _load_example()
    args: argparse.Namespace = ex.build_args().parse_args(argv)
    assert ex.check(args, results) <= 1e-5
    assert torch.get_default_dtype() == torch.float32      # the reference's float64 stays inside it (it leaked once)
