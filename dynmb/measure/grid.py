"""The profiling grid: points (rows, padded_len, documents per row) and their synthetic microbatches.

``default_grid`` lists the points ``dynmb profile`` measures: one document per row at rows
``GRID_ROWS`` x padded_len ``GRID_LENS``, plus packed rows (``PACKED_ROWS`` x ``PACKED_LENS`` x
``GRID_DOCS`` documents per row), every point under a rows x padded_len token cap.
``synthetic_microbatch`` builds the microbatch of a point: k = 1 holds one sequence per row (the
first row full, the others of random length >= padded_len / 2, so there is padding); k > 1 fills
every row exactly with k documents of random lengths (uniform random split points, each document
at least ``MIN_DOC_TOKENS`` long). The generator is seeded by (seed, rows, padded_len, k), so a
point's microbatch is the same in every process and every run.

``estimate_run_seconds`` prices one forward+backward run of a stage at a point before anything
is measured: the analytic cost model (FLOPs of the development CPU's core, the point's attention
work included) plus ``RUN_OVERHEAD_S`` per run. The progress bar and its ETA count these.
"""

from __future__ import annotations

import numpy as np

from dynmb.core.config import ModelConfig
from dynmb.costmodel import AnalyticCostModel
from dynmb.core.types import Microbatch

__all__ = ["Point", "GRID_ROWS", "GRID_LENS", "GRID_DOCS", "PACKED_ROWS", "PACKED_LENS", "MIN_DOC_TOKENS",
           "RUN_OVERHEAD_S", "default_grid", "as_point", "synthetic_microbatch", "estimate_run_seconds"]

Point = tuple[int, int, int]
"""A grid point: (rows, padded_len, docs_per_row)."""

GRID_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
GRID_LENS = (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 4096, 8192)
GRID_DOCS = (1, 4, 16, 64)
"""Documents per row; k > 1 only where padded_len >= k * MIN_DOC_TOKENS."""
PACKED_ROWS = (1, 2, 4)
PACKED_LENS = (128, 512, 1024, 2048, 4096)
MIN_DOC_TOKENS = 8
"""Shortest synthetic document (and the least padded_len per document of a packed grid point)."""
RUN_OVERHEAD_S = 0.03
"""Estimated wall seconds per (stage, point) run beyond the op itself (inputs, graph, barrier)."""


def default_grid(*, quick: bool = False, max_len: int | None = None, token_cap: int | None = None,
                 packed_points: bool = True) -> list[Point]:
    """Grid points ``(rows, padded_len, docs_per_row)`` with rows * padded_len <= token_cap.

    Full: one document per row at rows 1..64 x padded_len 32..8192 (powers of two and 1.5x
    up to 2048), token_cap 8192 (one CPU core runs an F+B of 8k tokens on the small preset in
    a few seconds), plus packed rows: rows ``PACKED_ROWS`` x padded_len ``PACKED_LENS`` x
    documents per row ``GRID_DOCS`` (> 1, at least ``MIN_DOC_TOKENS`` tokens per document).
    The long rows matter: causal attention skips its masked blocks only on long rows, so the
    cost per unit of attention work of one long document is below that of short ones.
    Quick: rows {1, 2, 4, 8} x {32, 128, 512}, cap 2048, plus rows {1, 2} x 512 x {4, 16, 64}.
    ``max_len`` (quick or full): the lengths up to it, and ``max_len`` itself, and beyond the
    grid's own lengths every 4x (quick) or 2x (full) step below it, so the fit never extrapolates
    past the longest row asked for; the cap grows to hold one row of ``max_len``.
    """
    rows: tuple[int, ...] = (1, 2, 4, 8) if quick else GRID_ROWS
    lens: tuple[int, ...] = (32, 128, 512) if quick else GRID_LENS
    packed_rows: tuple[int, ...] = (1, 2) if quick else PACKED_ROWS
    packed_lens: tuple[int, ...] = (512,) if quick else PACKED_LENS
    cap = token_cap or (2048 if quick else 8192)
    if max_len is not None:
        lens = _lengths_to(lens, int(max_len), 4 if quick else 2)
        packed_lens = tuple(s for s in packed_lens if s <= max_len)
        cap = max(cap, int(max_len))
    pts = [(b, s, 1) for s in lens for b in rows if b * s <= cap]
    if packed_points:
        pts += [(b, s, k) for s in packed_lens for k in GRID_DOCS[1:] for b in packed_rows
                if b * s <= cap and s >= k * MIN_DOC_TOKENS]
    return pts


def _lengths_to(lens: tuple[int, ...], max_len: int, step: int) -> tuple[int, ...]:
    """``lens`` up to ``max_len``, then every ``step``-fold length beyond the last below it, and ``max_len``."""
    kept = [s for s in lens if s < max_len]
    nxt = (kept[-1] if kept else max_len) * step
    while nxt < max_len:
        kept.append(nxt)
        nxt *= step
    return tuple(kept) + (max_len,)


def as_point(point: tuple[int, int, int | bool]) -> Point:
    """``(rows, padded_len, docs_per_row)``; a bool third element is the older ``packed`` flag
    (True: 4 documents per row, fewer where the row is short)."""
    b, s, d = point
    if isinstance(d, (bool, np.bool_)):
        d = max(2, min(4, int(s) // MIN_DOC_TOKENS)) if d else 1
    return int(b), int(s), int(d)


def synthetic_microbatch(rows: int, padded_len: int, docs_per_row: int | bool = 1, seed: int = 0) -> Microbatch:
    """A (rows x padded_len) microbatch. One document per row: row 0 full, the others of random
    length >= padded_len/2 (padding). ``docs_per_row`` k > 1: every row filled exactly with k
    documents of random lengths, each >= min(MIN_DOC_TOKENS, padded_len // k) (uniform random
    split points). A bool is the older ``packed`` flag (see ``as_point``)."""
    rows, padded_len, docs = as_point((rows, padded_len, docs_per_row))
    if not 1 <= docs <= padded_len:
        raise ValueError(f"docs_per_row must lie in [1, padded_len={padded_len}], got {docs}")
    rng = np.random.default_rng([seed, rows, padded_len, docs])
    if docs == 1:
        lens = np.concatenate([[padded_len], rng.integers(max(1, padded_len // 2), padded_len + 1, size=rows - 1)])
        return Microbatch(np.arange(rows), lens, padded_len, rows)
    shortest = min(MIN_DOC_TOKENS, padded_len // docs)
    spare = padded_len - docs * shortest
    cuts = np.sort(rng.integers(0, spare + 1, size=(rows, docs - 1)), axis=1)
    edges = np.concatenate([np.zeros((rows, 1), np.int64), cuts, np.full((rows, 1), spare)], axis=1)
    lens = (np.diff(edges, axis=1) + shortest).reshape(-1)
    return Microbatch(np.arange(rows * docs), lens, padded_len, rows, row_ids=np.repeat(np.arange(rows), docs))


def estimate_run_seconds(cfg: ModelConfig, num_stages: int, stage: int, point: Point, runs: int = 1,
                         seed: int = 0) -> float:
    """Estimated wall seconds of ``runs`` forward+backward runs of ``stage`` at ``point`` (analytic
    cost model of the development CPU's core, with the point's attention work) + overheads."""
    b, s, d = point
    work = synthetic_microbatch(b, s, d, seed).attention_work(cfg.attention)
    cm = AnalyticCostModel(cfg, num_stages)
    op_s = sum(float(cm.predict(stage, op, b, s, work)) for op in ("F", "B"))
    return runs * (op_s + RUN_OVERHEAD_S)


