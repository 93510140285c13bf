"""Checks a cost- or memory-model file must pass when it is loaded (``docs/design.md``, file formats).

A model file is refused unless its numbers are finite and non-negative and what it predicts
grows with the tokens: for a fixed number of rows, the predicted time of every (stage, op) and
the predicted bytes of every stage must not decrease as ``padded_len`` grows, over a grid of
shapes (``shape_grid``: rows 1..64, padded_len 1..``max_seq_len``, geometric), up to the
measurement noise ``NOISE_TOL``. A fit that
went wrong (a negative slope, an interpolation table whose longer rows are cheaper, NaN from a
failed measurement) would otherwise make the packers prefer longer microbatches without a word.

``check_cost_model(cm)`` and ``check_memory_model(mm)`` raise ``ValueError`` with one line
saying what is wrong (the loaders prefix the file: ``PATH: invalid cost-model file: ...``) and
return the model, so a loader ends ``return check_memory_model(cls.from_dict(d))``.
``check_numbers(x, where)`` is the finite/non-negative check of the raw JSON values.

Duck-typed (``predict`` / ``activation_bytes`` / ``transient_bytes``); imports numpy only, so
``costmodel.base`` and ``dynmb.memory.model`` can both use it without a cycle.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, TypeVar

import numpy as np

__all__ = ["GRID_ROWS", "NOISE_TOL", "shape_grid", "check_numbers", "check_cost_model", "check_memory_model",
           "read_model_file"]

GRID_ROWS = (1, 2, 4, 8, 16, 64)
"""Rows of the shapes the monotonicity check evaluates."""

NOISE_TOL = 0.05
"""A prediction may fall by at most this fraction of its value between neighbouring lengths of
the grid: a measured table (``grid``) carries the repeat noise of its cells (a few percent where
the fixed per-op cost dominates), and a fit of noisy samples must still load. A fall beyond it
(a decreasing table, a negative slope) is refused."""

M = TypeVar("M")


def shape_grid(max_seq_len: int, points: int = 48) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, padded_len)`` axes of the check: ``GRID_ROWS`` and ``points`` lengths from 1 to
    ``max_seq_len`` (geometric, rounded, each grid length and ``max_seq_len`` included)."""
    top = max(2, int(max_seq_len))
    lens = np.unique(np.concatenate([np.round(np.geomspace(1, top, points)), [top]]))
    return np.asarray(GRID_ROWS, dtype=np.float64), lens.astype(np.float64)


def check_numbers(x: Any, where: str, *, negative_ok: bool = False) -> None:
    """Raise ``ValueError`` naming ``where`` at the first number in ``x`` (nested dicts and
    lists) that is not finite, or negative unless ``negative_ok``."""
    if isinstance(x, dict):
        for k, v in x.items():
            check_numbers(v, f"{where}.{k}", negative_ok=negative_ok)
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            check_numbers(v, f"{where}[{i}]", negative_ok=negative_ok)
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        if not math.isfinite(x) or (x < 0 and not negative_ok):
            raise ValueError(f"{where} is {x}: must be finite{'' if negative_ok else ' and non-negative'}")


def read_model_file(path: str | Path, what: str, build: Callable[[dict[str, Any]], M]) -> M:
    """``build(the JSON of path)``, any parse or validation error turned into one ``ValueError``
    naming the file (``what``: "cost-model", "memory-model")."""
    text = Path(path).read_text()
    try:
        return build(json.loads(text))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a JSON file ({e})") from None
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: invalid {what} file: {e}") from None


def _first_bad(values: np.ndarray, lens: np.ndarray, rows: float, what: str, unit: str) -> None:
    """Raise at the first non-finite, negative or decreasing value of ``values`` along ``lens``."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    bad = np.flatnonzero(~np.isfinite(v) | (v < 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{what} predicts {float(v[i])} {unit} at rows={int(rows)} padded_len={int(lens[i])}: "
                         "must be finite and non-negative")
    drop = np.flatnonzero(v[1:] < v[:-1] * (1 - NOISE_TOL))
    if drop.size:
        i = int(drop[0])
        raise ValueError(f"{what} decreases with tokens: {_fmt(v[i])} {unit} at rows={int(rows)} "
                         f"padded_len={int(lens[i])} but {_fmt(v[i + 1])} {unit} at padded_len={int(lens[i + 1])} "
                         f"(predictions must not decrease as padded_len grows; tolerance {NOISE_TOL:.0%})")


def _fmt(x: float) -> str:
    return f"{x:.6f}" if abs(x) < 1e6 else f"{x:.0f}"


def _max_len(model: Any, max_seq_len: int | None) -> int:
    if max_seq_len is not None:
        return int(max_seq_len)
    return int(getattr(getattr(model, "model_cfg", None), "max_seq_len", 8192) or 8192)


def check_cost_model(cm: M, *, max_seq_len: int | None = None) -> M:
    """``cm`` if every stage's F and B time (and I, W where the model has its own fits) is finite,
    non-negative and non-decreasing in padded_len at every row count of the grid; else
    ``ValueError`` naming the (stage, op) and the shapes."""
    rows, lens = shape_grid(_max_len(cm, max_seq_len))
    own = set(getattr(cm, "params", None) or getattr(cm, "grids", None) or {})
    ops = ["F", "B"] + [op for op in ("I", "W") if any(k[1] == op for k in own)]
    for stage in range(int(cm.num_stages)):   # type: ignore[attr-defined]
        for op in ops:
            for b in rows:
                with np.errstate(all="ignore"):
                    t = cm.predict(stage, op, b, lens)   # type: ignore[attr-defined]
                _first_bad(t, lens, b, f"stage {stage} op {op}", "s")
    return cm


def check_memory_model(mm: M, *, max_seq_len: int | None = None) -> M:
    """``mm`` if its state bytes are finite and non-negative and every stage's activation and
    transient bytes are finite, non-negative and non-decreasing in padded_len at every row
    count of the grid; else ``ValueError`` naming the stage and the shapes."""
    check_numbers(np.asarray(mm.state_bytes, dtype=np.float64).tolist(), "state_bytes")   # type: ignore[attr-defined]
    rows, lens = shape_grid(_max_len(mm, max_seq_len))
    for stage in range(int(mm.num_stages)):   # type: ignore[attr-defined]
        for name in ("activation_bytes", "transient_bytes"):
            fn = getattr(mm, name)
            for b in rows:
                with np.errstate(all="ignore"):
                    v = fn(stage, b, lens)
                _first_bad(v, lens, b, f"stage {stage} {name.replace('_', ' ')}", "bytes")
    return mm
