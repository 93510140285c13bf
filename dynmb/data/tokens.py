"""Real tokens for runs: a corpus tokenized once, in the launcher, into a token file every rank reads.

``CorpusSource(files, fields, tokenizer)`` names a corpus as ``dynmb lengths`` reads it
(``corpus.corpus_texts``: the same records, fields joined with a newline, txt split per line,
no normalization) and ``tokenize(source)`` encodes every record with the same encoder
(``corpus.get_tokenizer``), so document i's token count ``n_i`` is the length ``dynmb
lengths`` writes for record i. A 0-token record is an error naming its file and record.

Every document is stored as its ``n_i`` ids followed by the end-of-text id (``CorpusSource.eos_token``,
``--eos-token``, else the tokenizer's own: GPT-2's ``<|endoftext|>``): ``n_i + 1`` ids, so the model reads ids ``0 .. n_i - 1`` and
predicts ids ``1 .. n_i`` (the last label is the end of the text), ``n_i`` trained
positions, the length of the trace (``CorpusTokens.lengths``). A slice or a truncated
document takes a prefix of them (``dynmb.models.inputs.make_inputs``). A tokenizer without an
end-of-text id is refused.

Token file (``CorpusTokens.save`` / ``load``): ``<name>.npz`` holds ``offsets`` (int64,
``num_documents + 1``: document i is ``ids[offsets[i]:offsets[i + 1]]``) and ``meta`` (a JSON
string: the source, the tokenizer's ``vocab_size`` and ``eos_id``); the ids themselves (int32,
every document's back to back) lie beside it in ``<name>.ids.npy``, which ``load`` maps
read-only (``mmap_mode="r"``), so a rank reads only the documents its batches hold. The ids
are written first and the ``.npz`` last, each renamed into place: a complete ``.npz`` means a
complete token file. ``prepare_tokens(source, folder)`` writes it once
per source into ``folder/tokens/<key>.npz``, the key hashing the source and each file's size
and modification time, and returns a ``TokenFile``: what a run spec carries to the ranks.

``check_vocab`` refuses a tokenizer whose ids do not fit the model's embedding (ids are never
folded into a smaller vocabulary): one line naming the corpus and the ``--model`` to use.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Mapping, Sequence

import numpy as np

from dynmb.data.corpus import EOS_TOKENS, CorpusError, TokenizerError, corpus_texts, get_tokenizer

__all__ = ["CorpusSource", "CorpusTokens", "TokenFile", "tokenize", "prepare_tokens", "check_vocab"]

_BATCH = 512


@dataclass(frozen=True, kw_only=True)
class CorpusSource:
    """A corpus as ``dynmb lengths`` reads it: files, record fields, tokenizer."""

    files: tuple[str, ...]
    """Corpus files (.jsonl, .json, .txt, optionally .gz), read in order; absolute paths."""
    fields: tuple[str, ...] = ()
    """Record fields (dotted paths) joined with a newline; none for txt corpora."""
    tokenizer: str = "gpt2"
    """``gpt2`` (offline BPE), a Hugging Face tokenizer name or a tokenizer.json path."""
    eos_token: str | None = None
    """The end-of-text token appended to every document (``--eos-token``); None: the tokenizer's own
    (``dynmb.data.corpus.get_tokenizer``)."""

    @classmethod
    def create(cls, files: str | os.PathLike | Sequence[str | os.PathLike], fields: str | Sequence[str] | None = None,
               tokenizer: str = "gpt2", eos_token: str | None = None) -> CorpusSource:
        """A source with absolute file paths; ``fields``: one field or several."""
        paths = [files] if isinstance(files, (str, os.PathLike)) else list(files)
        names = [fields] if isinstance(fields, str) else list(fields or ())
        return cls(files=tuple(str(Path(p).resolve()) for p in paths), fields=tuple(names), tokenizer=tokenizer,
                   eos_token=eos_token)

    @property
    def name(self) -> str:
        """What the ``dataset`` column shows: the file(s), and the fields after a colon."""
        files = ",".join(self.files)
        return f"{files}:{','.join(self.fields)}" if self.fields else files

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"files": list(self.files), "fields": list(self.fields), "tokenizer": self.tokenizer}
        if self.eos_token is not None:
            out["eos_token"] = self.eos_token
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CorpusSource:
        eos = data.get("eos_token")
        return cls(files=tuple(str(f) for f in data["files"]), fields=tuple(str(f) for f in data.get("fields", ())),
                   tokenizer=str(data.get("tokenizer", "gpt2")), eos_token=None if eos is None else str(eos))


@dataclass(frozen=True, eq=False)
class CorpusTokens:
    """Every document's ids followed by the end-of-text id (see the module docstring)."""

    ids: np.ndarray
    offsets: np.ndarray
    source: CorpusSource
    vocab_size: int
    """The tokenizer's: every id it can emit."""
    eos_id: int
    starts: tuple[int, ...] = ()
    """The first document of each of ``source.files`` (empty in token files written before it was kept)."""

    def record_name(self, row: int) -> str:
        """Document ``row`` as its file and record number there (``c.jsonl record 3``, 0-based)."""
        if len(self.starts) != len(self.source.files) or not self.starts:
            return f"record {row}"
        k = int(np.searchsorted(self.starts, row, side="right") - 1)
        return f"{Path(self.source.files[k]).name} record {row - self.starts[k]}"

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        """The trace: each document's token count (its ids less the end-of-text id)."""
        return np.diff(self.offsets) - 1

    def document(self, row: int) -> np.ndarray:
        """Document ``row``'s ``n + 1`` ids (int64)."""
        if not 0 <= row < self.num_documents:
            raise IndexError(f"document {row} of a corpus of {self.num_documents} ({self.source.name})")
        return self.ids[self.offsets[row]:self.offsets[row + 1]].astype(np.int64)

    def save(self, path: str | Path) -> Path:
        """Write ``path`` (the ``.npz``) and its ``.ids.npy``, ids first, each atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = json.dumps({"source": self.source.to_dict(), "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                           "starts": list(self.starts)})
        _write_atomic(_ids_path(path), lambda f: np.save(f, np.ascontiguousarray(self.ids)))
        _write_atomic(path, lambda f: np.savez(f, offsets=self.offsets, meta=np.array(meta)))
        return path

    @classmethod
    def load(cls, path: str | Path) -> CorpusTokens:
        """The token file ``path`` (its ids mapped read-only)."""
        try:
            with np.load(path, allow_pickle=False) as z:
                offsets, meta = z["offsets"], json.loads(str(z["meta"]))
            ids = np.load(_ids_path(Path(path)), mmap_mode="r", allow_pickle=False)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"token file {str(e.filename or path)!r} not found") from None
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"token file {path} cannot be read: {e}") from None
        if ids.ndim != 1 or offsets[-1] != ids.size:
            raise ValueError(f"token file {path}: its offsets end at {int(offsets[-1])}, its ids hold {ids.size}")
        return cls(ids=ids, offsets=offsets, source=CorpusSource.from_dict(meta["source"]),
                   vocab_size=int(meta["vocab_size"]), eos_id=int(meta["eos_id"]),
                   starts=tuple(int(k) for k in meta.get("starts", ())))


def _ids_path(path: Path) -> Path:
    return path.with_name(path.name.removesuffix(".npz") + ".ids.npy")


def _write_atomic(path: Path, write: Callable[[BinaryIO], None]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass(frozen=True, kw_only=True)
class TokenFile:
    """A token file written for a run: its path and what the launcher checks before torchrun starts."""

    path: str
    """The ``.npz`` (absolute)."""
    source: CorpusSource
    vocab_size: int
    """The tokenizer's vocabulary size."""
    num_documents: int

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "source": self.source.to_dict(), "vocab_size": self.vocab_size,
                "num_documents": self.num_documents}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TokenFile:
        return cls(path=str(data["path"]), source=CorpusSource.from_dict(data["source"]),
                   vocab_size=int(data["vocab_size"]), num_documents=int(data["num_documents"]))

    def load(self) -> CorpusTokens:
        return CorpusTokens.load(self.path)


def tokenize(source: CorpusSource, max_len: int | None = None) -> CorpusTokens:
    """Every record of ``source`` tokenized as ``dynmb lengths`` does, plus the end-of-text id.

    Records are encoded ``_BATCH`` at a time and each batch is kept as one int32/int64 array at once
    (never the whole corpus as Python lists); a record of more than ``max_len`` tokens (a run's
    ``max_seq_len`` under ``--oversize error``: no row can hold it) stops the reading there, naming
    its file and record."""
    tok = get_tokenizer(source.tokenizer, source.eos_token)
    if tok.eos_id is None:
        raise TokenizerError(f"tokenizer {source.tokenizer!r} has no end-of-text token of its own (looked for "
                             f"tokenizer_config.json's eos_token, {', '.join(EOS_TOKENS)}); a run appends it to every "
                             "document: name it with --eos-token TOKEN")
    texts, starts, paths = corpus_texts(list(source.files), list(source.fields) or None)
    dtype = np.int32 if tok.vocab_size < 2**31 else np.int64
    parts: list[np.ndarray] = []
    counts = np.empty(len(texts), dtype=np.int64)
    for s in range(0, len(texts), _BATCH):
        docs = tok.encode_batch(texts[s:s + _BATCH])
        counts[s:s + len(docs)] = [len(d) for d in docs]
        _refuse_records(counts[s:s + len(docs)], s, starts, paths, max_len)
        parts.append(_with_eos(docs, int(counts[s:s + len(docs)].sum()) + len(docs), tok.eos_id, dtype))
        del docs
    ids = np.concatenate(parts) if parts else np.empty(0, dtype=dtype)
    offsets = np.concatenate([[0], np.cumsum(counts + 1)]).astype(np.int64)
    return CorpusTokens(ids=ids, offsets=offsets, source=source, vocab_size=tok.vocab_size,
                        eos_id=int(tok.eos_id), starts=tuple(int(k) for k in starts))


def _with_eos(docs: list[list[int]], size: int, eos_id: int, dtype: Any) -> np.ndarray:
    """One array of every document's ids, each followed by ``eos_id``."""
    out = np.empty(size, dtype=dtype)
    at = 0
    for d in docs:
        out[at:at + len(d)] = d
        out[at + len(d)] = eos_id
        at += len(d) + 1
    return out


def _record(index: int, starts: Sequence[int], paths: Sequence[Path]) -> str:
    k = int(np.searchsorted(starts, index, side="right") - 1)
    return f"{paths[k]}: record {index - starts[k]} (0-based)"


def _refuse_records(counts: np.ndarray, first: int, starts: Sequence[int], paths: Sequence[Path],
                    max_len: int | None) -> None:
    """Refuse the first record of a batch (records ``first ..``) with 0 tokens or more than ``max_len``."""
    empty = np.flatnonzero(counts == 0)
    if empty.size:
        raise CorpusError(f"{_record(first + int(empty[0]), starts, paths)} has 0 tokens; a run needs text in every "
                          "record (`dynmb lengths --skip-empty` shows them)")
    long = np.flatnonzero(counts > max_len) if max_len is not None else np.empty(0, dtype=np.int64)
    if long.size:
        i = int(long[0])
        raise CorpusError(f"{_record(first + i, starts, paths)} has {int(counts[i])} tokens, longer than any row "
                          f"(the model's max_seq_len {max_len}); --oversize truncate, drop or split takes it, or a "
                          "model with a longer max_seq_len")


def _key(source: CorpusSource) -> str:
    h = hashlib.sha256(json.dumps(source.to_dict(), sort_keys=True).encode())
    for f in source.files:
        try:
            st = os.stat(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"corpus {f!r} not found") from None
        h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def prepare_tokens(source: CorpusSource, folder: str | Path, *, vocab_size: int | None = None,
                   model_name: str = "model", max_len: int | None = None) -> TokenFile:
    """The token file of ``source`` in ``folder/tokens/`` (written unless a file of the same
    source, file sizes and modification times is there). With ``vocab_size`` (the model's) the
    tokenizer is checked first (``check_vocab``), before any record is read; with ``max_len`` a
    record longer is refused as soon as it is read (``tokenize``), and a token file already there is
    checked against it too."""
    if vocab_size is not None:
        tok = get_tokenizer(source.tokenizer, source.eos_token)       # also refuses an --eos-token it lacks
        _refuse(source, tok.vocab_size, vocab_size, model_name)
    path = (Path(folder) / "tokens" / f"{_key(source)}.npz").resolve()
    try:
        tokens = CorpusTokens.load(path) if path.is_file() else None
    except (ValueError, FileNotFoundError):       # a partial or foreign file: write it again
        tokens = None
    if tokens is None or tokens.source != source:
        tokens = tokenize(source, max_len)
        tokens.save(path)
    elif max_len is not None and tokens.num_documents and int(tokens.lengths.max()) > max_len:
        tokenize(source, max_len)            # raises naming the file and record of the first one too long
    return TokenFile(path=str(path), source=source, vocab_size=tokens.vocab_size,
                     num_documents=tokens.num_documents)


def check_vocab(tokens: TokenFile | CorpusTokens, vocab_size: int, model_name: str) -> None:
    """Refuse token ids the model cannot embed (``ValueError``, one line)."""
    _refuse(tokens.source, tokens.vocab_size, vocab_size, model_name)


def _refuse(source: CorpusSource, tokenizer_vocab: int, vocab_size: int, model_name: str) -> None:
    if tokenizer_vocab > vocab_size:
        flag = f"{model_name}{',' if ':' in model_name else ':'}vocab_size={tokenizer_vocab}"
        raise ValueError(f"corpus {source.name}: tokenizer {source.tokenizer!r} has {tokenizer_vocab} token ids but "
                         f"model {model_name} has vocab_size {vocab_size}; ids are never folded into a smaller "
                         f"vocabulary: use --model {flag}")
