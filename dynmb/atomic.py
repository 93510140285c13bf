"""Atomic file writes: a reader sees the old file or the new one, never half of one.

``atomic_path(path)`` is a context manager yielding a temporary path in the folder of
``path`` (a hidden name holding the process id and a random suffix, so concurrent writers
never share one); when the block ends without an exception the temporary file replaces
``path`` with ``os.replace`` (atomic within one file system, on POSIX and Windows), else it
is removed, so an error leaves no temporary file behind. Missing parent folders are
created. ``write_text_atomic(path, text)`` writes a string that way.

Every writer of dynmb's files (plans, schedules, traces, memory and cost models, results
tables, profile samples) goes through it. Imports nothing from dynmb, so any layer may use it.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path
from typing import Iterator

__all__ = ["atomic_path", "write_text_atomic"]


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path``, on error it is removed."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_text_atomic(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically (``atomic_path``); returns the path."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding=encoding)
    return Path(path)
