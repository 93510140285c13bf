"""Tidy results tables: schemas, atomic writers (CSV always, Parquet when pyarrow is there), loaders.

One row per observation, the columns of DESIGN.md ("Results tables"):

- ``steps``:   run_id, method, dataset, step, step_s, pred_step_s, real_tokens, computed_tokens, tokens_per_s, num_microbatches, ...
- ``actions``: run_id, step, rank, stage, op, mb, batch, padded_len, start_s, end_s, pred_s, ...
- ``memory``:  run_id, step, stage, peak_bytes, limit_bytes, ...
- ``runs``:    run_id, flattened config, git sha, torch version, backend, device, world size, date.

``TableWriter.append`` rewrites the whole CSV atomically (``dynmb.io.atomic``: a temporary
file and ``os.replace``) after every call, so a crash keeps every finished step and a
reader never sees half a file. Settings live in columns, never in folder names.

After a job, the launcher finishes its ``runs`` rows (``set_run_status``: ``status`` running ->
ok / failed / interrupted, ``error``) and, when it did not end well, drops the ``actions`` and
``memory`` rows of steps that have no ``steps`` row (``drop_incomplete_steps``), so the folder
holds only complete steps. ``select_runs`` keeps the rows of given run ids. ``tag_runs`` sets columns
(``case``: the name the summary gives the run's case; ``repeat``) in every table's rows of given run ids,
so a row joins ``summary.csv`` on ``case``. ``load_results`` also returns ``summary`` (a compare's
``summary.csv``; empty elsewhere).
"""

from __future__ import annotations

import datetime as _dt
import io
import os
import platform
import subprocess
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from dynmb.io.atomic import atomic_path

__all__ = ["TABLES", "REQUIRED_COLUMNS", "RUN_STATUSES", "TableWriter", "load_results", "run_info", "git_sha",
           "write_table", "select_runs", "set_run_status", "drop_incomplete_steps", "run_ids_in", "ResultsError",
           "read_table", "check_tables", "utf8_text", "check_utf8", "tag_runs", "SUMMARY"]


class ResultsError(ValueError):
    """A results file that is not a whole dynmb table; the message is one line naming the file."""

RUN_STATUSES = ("running", "ok", "failed", "interrupted")
"""The ``status`` column of ``runs``: written ``running``, finished by rank 0 or the launcher."""

TABLES = ("steps", "actions", "memory", "runs")

REQUIRED_COLUMNS: dict[str, tuple[str, ...]] = {
    "steps": ("run_id", "method", "dataset", "step", "step_s", "pred_step_s", "real_tokens",
              "computed_tokens", "tokens_per_s", "num_microbatches"),
    "actions": ("run_id", "step", "rank", "stage", "op", "mb", "batch", "padded_len", "start_s", "end_s", "pred_s"),
    "memory": ("run_id", "step", "stage", "peak_bytes", "limit_bytes"),
    "runs": ("run_id", "git_sha", "torch_version", "backend", "device", "world_size", "date"),
}


def _atomic_write_csv(df: pd.DataFrame, path: Path) -> None:
    with atomic_path(path) as tmp:
        df.to_csv(tmp, index=False)


def write_table(df: pd.DataFrame, path: str | Path, *, parquet: bool = True) -> None:
    """Write ``df`` atomically to ``path`` (CSV) and, with pyarrow, next to it as ``.parquet``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write_csv(df, path)
    if parquet:
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            return
        with atomic_path(path.with_suffix(".parquet")) as tmp:
            df.to_parquet(tmp, index=False)


def read_table(path: str | Path, table: str | None = None) -> pd.DataFrame:
    """Read one results CSV strictly: UTF-8, every row whole (a file cut mid-row is refused, not read
    with NaNs), the table's required columns present. Raises ``ResultsError`` naming the file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ResultsError(f"{path}: cannot read ({e.strerror or e})") from None
    if not raw:
        return pd.DataFrame()
    text = utf8_text(raw, path, "is this a dynmb results table?")
    if not text.endswith("\n") and text.count("\n") >= 1:
        raise ResultsError(f"{path}: the last row is cut (the file ends mid-row); the run that wrote it did not finish "
                           "its write: remove the last line or rerun")
    try:
        df = pd.read_csv(io.StringIO(text))
    except (pd.errors.ParserError, pd.errors.EmptyDataError, ValueError) as e:
        raise ResultsError(f"{path}: not a CSV table ({' '.join(str(e).split())})") from None
    missing = [c for c in REQUIRED_COLUMNS.get(table or "", ()) if c not in df.columns]
    if missing:
        raise ResultsError(f"{path}: not a dynmb {table} table (no column(s) {', '.join(missing)})")
    return df


def utf8_text(raw: bytes, path: str | Path, hint: str = "dynmb reads UTF-8 text") -> str:
    """``raw`` (the bytes of ``path``) decoded as UTF-8; ``ResultsError`` naming the file otherwise: a
    UTF-16 byte-order mark gets its own line (a file saved as "Unicode" by an editor), any other
    undecodable byte its offset."""
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ResultsError(f"{path}: UTF-16 text (it starts with a UTF-16 byte-order mark); save it as UTF-8")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ResultsError(f"{path}: not UTF-8 text (byte {e.start}); {hint}") from None


def check_utf8(path: str | Path) -> None:
    """Refuse (``ResultsError``, one line naming the file) a file that is not UTF-8 text; a file that
    cannot be read is left to its reader."""
    try:
        raw = Path(path).read_bytes()
    except OSError:
        return
    utf8_text(raw, path)


def check_tables(out_dir: str | Path) -> None:
    """Refuse a results folder holding a file named like a dynmb table that is not one (a user's own
    ``steps.csv``), before anything runs: nothing in the folder is touched."""
    for table in TABLES:
        path = Path(out_dir) / f"{table}.csv"
        if path.exists():
            read_table(path, table)


class TableWriter:
    """Accumulates rows per table and rewrites ``out_dir/<table>.csv`` atomically on each append.

    Appends to tables already in ``out_dir`` (a resumed run keeps earlier rows).
    ``close()`` also writes Parquet copies when pyarrow is installed.
    """

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        check_tables(self.out_dir)
        self._frames: dict[str, pd.DataFrame] = {}

    def _current(self, table: str) -> pd.DataFrame:
        if table not in self._frames:
            p = self.out_dir / f"{table}.csv"
            self._frames[table] = read_table(p, table) if p.exists() else pd.DataFrame()
        return self._frames[table]

    def append(self, table: str, rows: Iterable[dict[str, Any]] | pd.DataFrame) -> None:
        new = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
        if new.empty:
            return
        missing = [c for c in REQUIRED_COLUMNS.get(table, ()) if c not in new.columns]
        if missing:
            raise ValueError(f"rows for table {table!r} lack the columns {missing}")
        cur = self._current(table)
        df = new if cur.empty else pd.concat([cur, new], ignore_index=True)
        self._frames[table] = df
        _atomic_write_csv(df, self.out_dir / f"{table}.csv")

    def update(self, table: str, run_id: str, values: dict[str, Any]) -> None:
        """Set ``values`` in the rows of ``table`` whose ``run_id`` is ``run_id`` (rewritten atomically)."""
        df = self._current(table)
        if df.empty or "run_id" not in df.columns:
            return
        df = _with_values(df, df["run_id"].astype(str) == str(run_id), values)
        self._frames[table] = df
        _atomic_write_csv(df, self.out_dir / f"{table}.csv")

    def close(self) -> None:
        for table, df in self._frames.items():
            if not df.empty:
                write_table(df, self.out_dir / f"{table}.csv")

    def __enter__(self) -> "TableWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


SUMMARY = "summary"
"""The compare job's table of cases (``summary.csv``), loaded by ``load_results`` next to ``TABLES``."""


def _read_newest(csv: Path, table: str) -> pd.DataFrame:
    """``csv``'s table from its Parquet copy when that is there and not older (types kept), else the CSV."""
    pq = csv.with_suffix(".parquet")
    if pq.exists() and csv.exists() and pq.stat().st_mtime >= csv.stat().st_mtime:
        try:
            return pd.read_parquet(pq)
        except ImportError:
            pass
        except (OSError, ValueError) as e:              # a cut or foreign file: one line naming it
            raise ResultsError(f"{pq}: not a whole Parquet table ({' '.join(str(e).split())[:200]}); remove it "
                               f"to read {csv.name}") from None
    return read_table(csv, table) if csv.exists() and csv.stat().st_size > 0 else pd.DataFrame()


def load_results(out_dir: str | Path, tables: Iterable[str] = (*TABLES, SUMMARY)) -> dict[str, pd.DataFrame]:
    """Load the tables of one results folder (or of every run folder below it, concatenated): ``steps``,
    ``actions``, ``memory``, ``runs`` and ``summary`` (empty where no compare wrote one).

    Parquet is preferred when present and not older than the CSV.
    """
    out_dir = Path(out_dir)
    if not out_dir.exists():
        raise FileNotFoundError(f"no results folder {out_dir}")
    out: dict[str, pd.DataFrame] = {}
    for t in tables:
        frames = []
        for csv in sorted(out_dir.rglob(f"{t}.csv")):
            frame = _read_newest(csv, t)
            if not frame.empty or len(frame.columns):
                frames.append(frame)
        out[t] = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    return out


def git_sha(cwd: str | Path | None = None) -> str:
    """The checkout's commit (with ``-dirty`` when modified), or ``unknown`` outside git."""
    cwd = cwd or Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=cwd, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha + ("-dirty" if dirty else "")) if sha else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_info(run_id: str, config_flat: dict[str, Any], *, backend: str, device: str, world_size: int,
             host_malloc: str) -> dict[str, Any]:
    """One ``runs`` row: the flattened config plus provenance. ``host_malloc``: the workers' host
    allocator policy (``dynmb.runtime.hostmem.host_malloc_mode()``, which the runtime passes in)."""
    try:
        import torch

        tv = str(torch.__version__)
    except ImportError:  # pragma: no cover - torch is a dependency
        tv = "none"
    return {
        "run_id": run_id,
        **{f"cfg.{k}" if k in ("backend", "device") else k: v for k, v in config_flat.items()},
        "git_sha": git_sha(),
        "torch_version": tv,
        "backend": backend,
        "device": device,
        "world_size": int(world_size),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "host_malloc": host_malloc,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def _with_values(df: pd.DataFrame, rows: pd.Series, values: dict[str, Any]) -> pd.DataFrame:
    df = df.copy()
    for column, value in values.items():
        if column not in df.columns:
            df[column] = ""
        df[column] = df[column].astype(object)
        df.loc[rows, column] = value
    return df


def _read_csv(path: Path) -> pd.DataFrame:
    return read_table(path) if path.exists() else pd.DataFrame()


def run_ids_in(out_dir: str | Path) -> set[str]:
    """The run ids of ``out_dir/runs.csv`` (empty when there is none)."""
    runs = _read_csv(Path(out_dir) / "runs.csv")
    return set(runs["run_id"].astype(str)) if "run_id" in runs.columns else set()


def select_runs(tables: dict[str, pd.DataFrame], run_ids: Iterable[str]) -> dict[str, pd.DataFrame]:
    """The rows of ``run_ids`` in every table (tables without a ``run_id`` column are kept whole)."""
    ids = {str(r) for r in run_ids}
    return {name: (df[df["run_id"].astype(str).isin(ids)].reset_index(drop=True) if "run_id" in df.columns else df)
            for name, df in tables.items()}


def set_run_status(out_dir: str | Path, run_ids: Iterable[str], status: str, error: str = "", *,
                   keep: Iterable[str] = ("ok", "failed", "interrupted")) -> list[str]:
    """Set ``status`` (one of ``RUN_STATUSES``) and ``error`` (one line) in the ``runs`` rows of
    ``run_ids`` in ``out_dir``, except rows whose status is in ``keep`` (by default: only rows
    still ``running``, or without a status); rewrites ``runs.csv`` (and its Parquet copy)
    atomically. Returns the run ids changed."""
    if status not in RUN_STATUSES:
        raise ValueError(f"unknown run status {status!r}; expected one of {RUN_STATUSES}")
    path = Path(out_dir) / "runs.csv"
    runs = _read_csv(path)
    if runs.empty or "run_id" not in runs.columns:
        return []
    rows = runs["run_id"].astype(str).isin({str(r) for r in run_ids})
    if "status" in runs.columns:
        rows &= ~runs["status"].astype(str).isin(set(keep))
    if not rows.any():
        return []
    write_table(_with_values(runs, rows, {"status": status, "error": " ".join(str(error).split())}), path)
    return list(runs.loc[rows, "run_id"].astype(str))


def drop_incomplete_steps(out_dir: str | Path, run_ids: Iterable[str]) -> dict[str, list[int]]:
    """Drop the ``actions`` and ``memory`` rows of ``run_ids`` whose step has no ``steps`` row
    (a step stopped between its measurements and its ``steps`` row). Returns, per run id, the
    steps that are complete."""
    out_dir = Path(out_dir)
    ids = {str(r) for r in run_ids}
    steps = _read_csv(out_dir / "steps.csv")
    complete: dict[str, set[int]] = {r: set() for r in ids}
    if not steps.empty and {"run_id", "step"} <= set(steps.columns):
        for rid, step in zip(steps["run_id"].astype(str), steps["step"].astype(int)):
            if rid in complete:
                complete[rid].add(step)
    for table in ("actions", "memory"):
        path = out_dir / f"{table}.csv"
        df = _read_csv(path)
        if df.empty or not {"run_id", "step"} <= set(df.columns):
            continue
        rid = df["run_id"].astype(str)
        mine = rid.isin(ids)
        done = pd.Series([s in complete.get(r, set()) for r, s in zip(rid, df["step"].astype(int))], index=df.index)
        keep = ~mine | done
        if not keep.all():
            write_table(df[keep].reset_index(drop=True), path)
    return {r: sorted(s) for r, s in complete.items()}


def tag_runs(out_dir: str | Path, values: dict[str, dict[str, Any]], tables: Iterable[str] = TABLES) -> None:
    """Set, in every table of ``out_dir``, the columns ``values[run_id]`` in the rows of that run id
    (tables rewritten atomically; rows of other runs keep what they had, empty where new)."""
    if not values:
        return
    for table in tables:
        path = Path(out_dir) / f"{table}.csv"
        df = _read_newest(path, table)
        if df.empty or "run_id" not in df.columns:
            continue
        rid = df["run_id"].astype(str)
        for run_id, cols in values.items():
            df = _with_values(df, rid == str(run_id), cols)
        write_table(df, path)
