"""Length traces: the shipped ones, loading and saving, statistics, sampling, synthetic ones.

Format: a CSV with a header row and a column ``length`` (one positive integer
per record, its token count); other columns are ignored. Shipped traces live once in the
repository's top-level ``data/traces/<name>.csv``; a wheel carries them as package data
``dynmb/data/traces/`` (``setup.py`` maps the folder), read with ``importlib.resources`` so an
installed wheel finds them from any folder. ``shipped_dir`` takes the package data when it is
there, else the checkout's ``data/`` (editable install, ``PYTHONPATH``); ``DYNMB_DATA_DIR``
overrides the traces folder. Loading them needs numpy only, never a tokenizer.

Building a trace from a corpus, and the tokenizers: ``dynmb.data.corpus``.

Sampling (``sample_indices``: the rows of the trace; ``sample_batch``: their lengths): batch
``step`` of stream ``seed`` is drawn with ``np.random.default_rng([seed, step])``, without
replacement when the trace has ``global_batch`` records, else with replacement (logged once per
trace size and batch size); same (seed, step), same batch.

Synthetic traces for sweeps: ``lognormal``/``lognormal_mixture`` draw
``round(exp(N(mu, sigma)))`` clipped to ``[1, max_len]``; ``fit_lognormal`` is
the maximum-likelihood fit on log lengths, ``fit_mixture`` a k-component
Gaussian mixture on log lengths fitted by EM; ``synthetic_like`` fits and draws.
"""

from __future__ import annotations

import csv
import logging
import os
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

from dynmb.io.atomic import write_text_atomic

log = logging.getLogger(__name__)
_NOTED_REPLACEMENT: set[tuple[int, int]] = set()

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

    import pandas

__all__ = [
    "shipped_dir", "data_dir", "list_traces", "load_trace", "save_trace", "check_lengths", "trace_stats", "datasets_table",
    "sample_batch", "sample_indices", "lognormal", "lognormal_mixture", "fit_lognormal", "fit_mixture", "synthetic_like",
]


# --------------------------------------------------------------------------
# shipped traces
# --------------------------------------------------------------------------
def shipped_dir(kind: str) -> Path | Traversable:
    """Folder of the shipped ``kind`` files (``"traces"``, ``"costmodels"``): the package data
    ``dynmb/data/<kind>`` of an installed wheel, else the checkout's top-level ``data/<kind>``."""
    packaged = resources.files(__package__).joinpath(kind)
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "data" / kind


def data_dir() -> Path | Traversable:
    """Folder of shipped traces: ``$DYNMB_DATA_DIR`` or ``shipped_dir("traces")``."""
    env = os.environ.get("DYNMB_DATA_DIR")
    return Path(env) if env else shipped_dir("traces")


def list_traces() -> list[str]:
    """Names of the shipped traces (``<name>.csv`` in ``data_dir()``), sorted."""
    d = data_dir()
    if not d.is_dir():
        return []
    return sorted(f.name[:-len(".csv")] for f in d.iterdir() if f.name.endswith(".csv") and f.is_file())


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
        shipped = data_dir().joinpath(f"{s}.csv")
        if shipped.is_file():
            return _read_trace_csv(shipped)
        if not p.is_file():
            known = ", ".join(list_traces()) or f"none in {data_dir()}"
            raise ValueError(f"unknown dataset {s!r}; known: {known}")
    if not p.is_file():
        raise FileNotFoundError(f"length trace {s!r} not found")
    return _read_trace_csv(p)


def _read_trace_csv(p: Path | Traversable) -> np.ndarray:
    with p.open("r", newline="", encoding="utf-8") as f:
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
    return write_text_atomic(path, "length\n" + "".join(f"{int(x)}\n" for x in a))


def trace_stats(lengths: Iterable[int]) -> dict[str, float]:
    """count, mean, median, p90, p99 (numpy linear percentiles), max."""
    a = check_lengths(lengths)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"count": int(a.size), "mean": float(a.mean()), "median": float(p50),
            "p90": float(p90), "p99": float(p99), "max": int(a.max())}


def datasets_table() -> pandas.DataFrame:
    """One row per shipped trace: name, count, mean, median, p90, p99, max."""
    import pandas as pd
    rows = [{"name": n, **trace_stats(load_trace(n))} for n in list_traces()]
    return pd.DataFrame(rows, columns=["name", "count", "mean", "median", "p90", "p99", "max"])


def sample_batch(lengths: Iterable[int], global_batch: int, seed: int, step: int = 0) -> np.ndarray:
    """Global batch ``step`` of stream ``seed``: the lengths of the rows ``sample_indices`` draws."""
    a = check_lengths(lengths)
    return a[sample_indices(a.size, global_batch, seed, step)]


def sample_indices(num_records: int, global_batch: int, seed: int, step: int = 0, *, note: bool = True) -> np.ndarray:
    """Rows (int64) of a trace of ``num_records`` in global batch ``step`` of stream ``seed``:
    ``global_batch`` drawn with ``default_rng([seed, step])``, without replacement if the trace
    is big enough (else with, said once per process unless ``note`` is False: a run's ranks draw
    quietly, its launcher said it before they started)."""
    if num_records < 1:
        raise ValueError(f"cannot sample from an empty trace ({num_records} records)")
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    if seed < 0 or step < 0:
        raise ValueError(f"seed and step must be >= 0, got seed={seed} step={step}")
    if note and global_batch > num_records and (num_records, int(global_batch)) not in _NOTED_REPLACEMENT:
        _NOTED_REPLACEMENT.add((num_records, int(global_batch)))
        log.warning("the trace has %d records < global batch %d: batches are drawn with replacement "
                    "(records repeat within a batch)", num_records, global_batch)
    rng = np.random.default_rng([int(seed), int(step)])
    return rng.choice(int(num_records), size=int(global_batch), replace=global_batch > num_records).astype(np.int64)


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
