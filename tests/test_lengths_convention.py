"""One length convention (docs/design.md "Lengths") and the end-of-text token of a corpus.

A length counts a document's trained tokens (its positions in a row); its ids are length + 1, its
tokens then the end-of-text id. A ``dynmb lengths`` trace fed to ``dynmb plan`` and to the sampler
gives the same token counts: the sampler's records carry the trace's lengths, the collate trains
exactly that many tokens per document (the corpus token file's documents), and the runtime's
``make_inputs`` trains the plan's real tokens. A tokenizer whose end-of-text token is ``<|eos|>``
(in no list dynmb knows) is refused with one line naming ``--eos-token``, found through
``--eos-token`` or its own ``tokenizer_config.json``, and trains through ``dynmb run --corpus``
on 2 gloo ranks (verified, the loss equal to the reference on the same documents).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import dynmb
from dynmb.api.collate import collate_packed, collate_padded
from dynmb.core.contract import IGNORE_INDEX
from dynmb.core.types import Plan
from dynmb.data import CorpusSource, CorpusTokens, get_tokenizer, load_trace, tokenize
from dynmb.data.corpus import TokenizerError
from dynmb.models import make_inputs
from tests.test_corpus_runs import TEXTS, TINY, WORDS, reference_loss

pytestmark = pytest.mark.filterwarnings("ignore::dynmb.planning.defaults.StandInModelWarning")
EOS = "<|eos|>"


def _custom_corpus(folder: Path, *, config: bool = False) -> tuple[Path, Path]:
    """``folder/c.jsonl`` and a word-level ``tokenizer.json`` whose end-of-text token is ``<|eos|>``
    (with ``config``: named as its ``eos_token`` in a ``tokenizer_config.json`` beside it)."""
    tokenizers = pytest.importorskip("tokenizers")
    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    names = ["[UNK]", *dict.fromkeys(WORDS), EOS]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(names)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = folder / "tokenizer.json"
    tok.save(str(path))
    if config:
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return corpus, path


def test_the_end_of_text_token_is_named_or_the_tokenizers_own(tmp_path):
    _, path = _custom_corpus(tmp_path / "bare")
    assert get_tokenizer(str(path)).eos_id is None                       # <|eos|> is in no list dynmb knows
    eos_id = len(dict.fromkeys(WORDS)) + 1
    assert get_tokenizer(str(path), EOS).eos_id == eos_id
    with pytest.raises(TokenizerError, match=r"has no token '<\|end\|>' \(--eos-token\)"):
        get_tokenizer(str(path), "<|end|>")
    corpus, _ = _custom_corpus(tmp_path / "bare")
    with pytest.raises(TokenizerError, match="name it with --eos-token TOKEN"):
        tokenize(CorpusSource.create(corpus, "text", str(path)))
    _, own = _custom_corpus(tmp_path / "own", config=True)
    assert get_tokenizer(str(own)).eos_id == eos_id                      # its tokenizer_config.json's eos_token


def test_a_lengths_trace_gives_the_sampler_and_plan_the_same_token_counts(tmp_path, capsys):
    from dynmb.cli.main import main

    corpus, tok = _custom_corpus(tmp_path / "data")
    trace = tmp_path / "trace.csv"
    assert main(["lengths", str(corpus), "--field", "text", "--tokenizer", str(tok), "-o", str(trace)]) == 0
    lengths = load_trace(str(trace))
    plan_file = tmp_path / "plan.json"
    assert main(["plan", "--lengths", str(trace), "--global-batch", "6", "--stages", "1", "--memory-limit", "64MiB",
                 "--method", "dynamic", "--model", "tiny", "--seed", "2", "-o", str(plan_file)]) == 0
    capsys.readouterr()
    plan = Plan.load(plan_file)
    docs = tokenize(CorpusSource.create(corpus, "text", str(tok), EOS))   # the documents a --corpus run reads
    assert np.array_equal(docs.lengths, lengths)
    assert all(docs.document(i)[-1] == docs.eos_id for i in range(docs.num_documents))
    rows = np.asarray(plan.dataset_ids)
    assert plan.real_tokens == int(lengths[rows].sum())
    tokens = [torch.from_numpy(docs.document(int(r))) for r in rows]  # the plan's sequences, in batch order
    trained = sum(int((make_inputs(mb, tokens, cfg=TINY).labels != IGNORE_INDEX).sum()) for mb in plan.microbatches)
    assert trained == plan.real_tokens                                     # the runtime trains every token of the trace

    sampler = dynmb.DynamicBatchSampler(lengths, len(lengths), model="tiny", num_stages=1, memory_limit="64MiB",
                                        shuffle=False)
    ids = [torch.from_numpy(docs.document(i)) for i in range(docs.num_documents)]
    records = list(sampler)
    assert sum(mb.tokens for mb in records) == records[0].batch_tokens == int(lengths.sum())
    for mb in records:
        assert np.array_equal(mb.lengths, lengths[mb.indices])            # the trace's own counts, none dropped
        for batch in (collate_padded(ids, mb), collate_packed(ids, mb)):
            assert batch.loss_tokens == mb.tokens
    assert sum(collate_padded(ids, mb).loss_tokens for mb in records) == int(lengths.sum())


@pytest.mark.dist
@pytest.mark.slow
def test_a_custom_end_of_text_tokenizer_trains_through_corpus(tmp_path, capsys):
    import pandas as pd

    from dynmb.cli.main import main
    from dynmb.data import sample_indices

    corpus, tok = _custom_corpus(tmp_path / "data")
    base = ["run", "--corpus", str(corpus), "--field", "text", "--tokenizer", str(tok), "--model", "tiny",
            "--global-batch", "5", "--seed", "1", "--steps", "1", "--warmup", "0", "--memory-limit", "256MiB",
            "--method", "packed", "--pack-len", "48", "--verify", "--device", "cpu"]
    assert main(base + ["--out", str(tmp_path / "refused")]) == 2          # no end-of-text of its own: one line
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--eos-token" in err[0]
    out = tmp_path / "res"
    assert main(base + ["--eos-token", EOS, "--out", str(out)]) == 0, capsys.readouterr().err
    steps = pd.read_csv(out / "steps.csv")
    tokens = CorpusTokens.load(next((out / "tokens").glob("*.npz")))
    assert tokens.eos_id == get_tokenizer(str(tok), EOS).eos_id and tokens.source.eos_token == EOS
    rows = sample_indices(len(TEXTS), 5, 1, 0)
    assert bool(steps["verified"].iloc[0]) and steps["real_tokens"].iloc[0] == int(tokens.lengths[rows].sum())
    assert steps["loss"].iloc[0] == pytest.approx(reference_loss(TINY, 1, [tokens.document(int(r)) for r in rows]),
                                                  rel=1e-5)
