"""One writer per results folder: an advisory lock on ``OUT/.dynmb.lock``.

``lock_out_dir(out)`` takes ``fcntl.flock(LOCK_EX | LOCK_NB)`` on the lock file and writes the
holder (pid, command, start time) into it; a second ``dynmb run``/``compare`` into the same folder
is refused at once with one line naming the holder, before anything starts or is written. The
kernel drops the lock when the holder exits, however it exits (a killed launcher leaves no stale
lock; the file itself stays, harmless). The folder's existing tables are checked first
(``dynmb.io.results.check_tables``): a file named like a dynmb table that is not one is refused
untouched.

One job per folder: ``check_fresh(out, append)`` refuses (one line naming ``--out`` and ``--append``) a
folder whose ``runs`` or ``steps`` table already holds rows, unless the user asked to add to them; the
command line checks it before anything is written (``dynmb run``, ``dynmb compare``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import os
import sys
from pathlib import Path
from typing import Iterator

from dynmb.io.results import ResultsError, check_tables, read_table

__all__ = ["lock_out_dir", "check_fresh", "LOCK_NAME"]

LOCK_NAME = ".dynmb.lock"


@contextlib.contextmanager
def lock_out_dir(out_dir: str | Path) -> Iterator[Path]:
    """Hold the results folder ``out_dir`` for this process (created if missing); see the module docstring."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ResultsError(f"{out}: cannot create the results folder ({e.strerror or e})") from None
    check_tables(out)
    path = out / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "another process"
            raise ResultsError(f"{out} is being written by another dynmb run ({holder}); wait for it to finish "
                               "or use another --out") from None
        stamp = _dt.datetime.now().isoformat(timespec="seconds")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}, started {stamp}: {' '.join(sys.argv)[:300]}\n".encode(), 0)
        yield out
    finally:
        os.close(fd)                  # closing the descriptor releases the lock


def check_fresh(out_dir: str | Path, append: bool) -> None:
    """Refuse (``ResultsError``, one line) a results folder holding another job's rows, unless ``append``."""
    if append:
        return
    out = Path(out_dir)
    for table in ("runs", "steps"):
        path = out / f"{table}.csv"
        if path.is_file() and path.stat().st_size > 0:
            rows = read_table(path, table)
            if len(rows):
                runs = rows["run_id"].astype(str).nunique()
                raise ResultsError(f"{out} already holds another job's tables ({runs} run(s) in {path.name}); "
                                   "give a new --out, or --append to add this job's rows to them")
