"""The samples table of ``dynmb profile``: its rows, reading it back, resuming it, checking its model.

One row per timed repeat: stage, op (``F``, ``B``, and ``I``/``W`` after them when the split
backward was timed), rows, padded_len, tokens, packed, docs_per_row, attn_work (the microbatch's
``Microbatch.attention_work``), time_s, wall_s, repeat, and the settings columns (device,
threads, clock, torch_version, model, attention, num_stages, concurrent and every ``ModelConfig``
field), plus ``mem_*`` columns on a point's first repeat. A run's ``B`` row is written last, so a
run counts as done once it is there (``done_runs``): resuming skips (repeat, stage, point) runs
already in the CSV. ``read_resumable`` refuses a CSV of other settings, or one without
``attn_work`` (profiled before it was recorded). ``check_samples_model`` refuses to fit a cost
model on samples of another architecture. ``load_samples`` reads samples CSVs, or a run's
actions CSVs converted (``costmodel.samples_from_actions``).
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Iterable

import pandas as pd

from dynmb.core.config import ModelConfig
from dynmb.costmodel import samples_from_actions
from dynmb.core.types import Microbatch

__all__ = ["ARCH_FIELDS", "load_samples", "check_samples_model", "read_resumable", "done_runs", "sample_rows"]

ARCH_FIELDS = tuple(f.name for f in fields(ModelConfig) if f.name != "name")
"""ModelConfig fields recorded as sample columns of the same name (the name is the ``model`` column)."""


def check_samples_model(samples: pd.DataFrame, cfg: ModelConfig, num_stages: int, source: str = "samples") -> None:
    """Raise ``ValueError`` naming both unless every recorded ModelConfig field (and the stage
    count) of ``samples`` equals ``cfg``'s: a cost model is fitted only for the architecture measured."""
    want = {"model": cfg.name, "num_stages": int(num_stages), **{k: getattr(cfg, k) for k in ARCH_FIELDS}}
    for column, value in want.items():
        if column not in samples:
            continue
        got = set(samples[column].dropna().unique().tolist())
        if got - {value}:
            raise ValueError(f"{source} were measured for {column}={sorted(got, key=str)}, not {value} "
                             f"(--model {cfg.name!r}, --stages {num_stages}); pass a matching --model/--stages")


def read_resumable(output: str | Path | None, base: dict) -> pd.DataFrame:
    """The samples already in ``output`` (empty when none); refuses a file of other settings."""
    if output is None or not Path(output).exists():
        return pd.DataFrame()
    old = pd.read_csv(output)
    if "concurrent" not in old:
        old["concurrent"] = 1
    timed = old[old["op"] != "comm"]
    if len(timed) and "attn_work" not in old:
        raise ValueError(f"{output} holds samples without attn_work (profiled before the attention work was "
                         f"recorded, under another attention implementation); use another -o")
    for k in ("model", "num_stages", "clock", "concurrent", *(k for k in base if k in ARCH_FIELDS)):
        if k in old and len(timed) and set(timed[k].dropna().unique()) - {base[k]}:
            raise ValueError(f"{output} holds samples for {k}={sorted(old[k].dropna().unique().tolist(), key=str)}, not {base[k]}; "
                             f"use another -o")
    return old


def done_runs(old: pd.DataFrame) -> set[tuple[int, int, int, int, int]]:
    """(repeat, stage, rows, padded_len, docs_per_row) already measured (their B row written)."""
    ff = old[old["op"] == "B"] if len(old) else old
    if not len(ff):             # nothing yet, or only the comm rows
        return set()
    return {(int(r), int(p), int(b), int(s), int(d)) for r, p, b, s, d in
            ff[["repeat", "stage", "rows", "padded_len", "docs_per_row"]].itertuples(index=False)}


def sample_rows(stage: int, mb: Microbatch, cfg: ModelConfig, docs: int, times: tuple[float, ...],
                 repeat: int, base: dict, extra: dict) -> list[dict]:
    """The F and B rows of one timed run (and I and W after them when it timed a split backward)."""
    tf, tb, wf, wb = times[:4]
    ops = [("F", tf, wf), ("I", times[4], times[6]), ("W", times[5], times[7])] if len(times) == 8 else [("F", tf, wf)]
    ops.append(("B", tb, wb))       # last: a run counts as done once its B row is written (resume)
    point = {"stage": stage, "rows": mb.batch, "padded_len": mb.padded_len, "tokens": mb.computed_tokens,
             "packed": docs > 1, "docs_per_row": docs, "attn_work": mb.attention_work(cfg.attention)}
    return [{**point, "op": op, "time_s": t, "wall_s": w, "repeat": repeat, **base, **extra}
            for op, t, w in ops]




def _lines(mask: pd.Series, k: int = 5) -> str:
    """The CSV line numbers (header = line 1) of the rows where ``mask`` holds, the first ``k`` and a count."""
    lines = (mask[mask].index.to_numpy() + 2).tolist()
    return ", ".join(map(str, lines[:k])) + (f", ... ({len(lines)} rows in all)" if len(lines) > k else "")


def _check_values(df: pd.DataFrame, path: str | Path) -> None:
    """Refuse, naming the file, the column and its CSV lines: a non-numeric, missing (NaN) or negative
    value in a column a fit reads (a time, stage, rows, padded_len); nothing is dropped silently."""
    times = ["start_s", "end_s"] if {"start_s", "end_s"} <= set(df.columns) else ["time_s"]
    shape = [c for c in ("stage", "rows", "batch", "padded_len") if c in df.columns]
    timed = df["op"].isin(["F", "B", "I", "W"]) if "op" in df.columns else pd.Series(True, index=df.index)
    for column in times + shape:
        values = pd.to_numeric(df[column], errors="coerce")
        text = df[column].where(values.isna() & df[column].notna())
        if text.notna().any():
            first = text.dropna().iloc[0]
            raise ValueError(f"{path}: column {column} holds non-numeric values ({first!r}) at line(s) "
                             f"{_lines(text.notna())}; a samples table holds numbers there")
        missing = values.isna() & timed
        if missing.any():
            raise ValueError(f"{path}: column {column} is empty (NaN) at line(s) {_lines(missing)}; "
                             "remove those rows or re-profile (a sample without a value is never dropped silently)")
        negative = (values < 0) & timed
        if negative.any():
            raise ValueError(f"{path}: column {column} is negative at line(s) {_lines(negative)} "
                             f"(e.g. {values[negative].iloc[0]}); a time or size cannot be below 0")


def load_samples(paths: Iterable[str | Path]) -> pd.DataFrame:
    """Read and concatenate samples CSVs (or a run's actions CSVs, converted). A file that is not
    one, or whose times or sizes are non-numeric, missing or negative, is refused naming the file
    and its lines (``ValueError``)."""
    dfs = []
    for p in paths:
        try:
            df = pd.read_csv(p)
        except UnicodeDecodeError as e:
            raise ValueError(f"{p}: not UTF-8 text (byte {e.start}); is this a samples CSV?") from None
        except (ValueError, KeyError) as e:   # pandas' parse errors are ValueErrors
            raise ValueError(f"{p}: not a samples or actions CSV: {' '.join(str(e).split())}") from None
        actions = {"start_s", "end_s"} <= set(df.columns)
        need = {"stage", "op", "batch", "padded_len"} if actions else {"stage", "op", "rows", "padded_len", "time_s"}
        missing = need - set(df.columns)
        if missing:
            raise ValueError(f"{p}: not a samples or actions CSV (no column {', '.join(sorted(missing))})")
        _check_values(df, p)
        dfs.append(samples_from_actions(df) if actions else df)
    if not dfs:
        raise ValueError("no samples files given")
    return pd.concat(dfs, ignore_index=True)
