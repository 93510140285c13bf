"""Atomic file writes: a reader sees the old file or the new one, never half of one.

``atomic_path(path)`` is a context manager yielding a temporary path in the folder of
``path`` (a hidden name holding the process id and a random suffix, so concurrent writers
never share one); when the block ends without an exception the temporary file replaces
``path`` with ``os.replace`` (atomic within one file system, on POSIX and Windows), else it
is removed, so an error leaves no temporary file behind. Missing parent folders are
created. An ``OSError`` of the write (``ENOSPC``: the disk is full) names ``path``, never the
hidden temporary file: the same errno, ``filename`` the destination. ``write_text_atomic(path, text)`` writes a string that way.

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
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _naming(e, target, target.parent) from None
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        os.replace(tmp, target)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise _naming(e, target, tmp) from None
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _naming(err: OSError, target: Path, hidden: Path) -> OSError:
    """``err`` naming ``target`` instead of the hidden path ``hidden`` (or no file at all): the same
    errno and subclass (``OSError(errno, ...)`` picks it), so ``ENOSPC`` reads
    ``<target>: No space left on device``. An error about another file (one the block read) is kept."""
    ours = {None, str(hidden), str(target)}
    if {None if n is None else str(n) for n in (err.filename, err.filename2)} - ours:
        return err
    if err.errno is None:
        return OSError(f"{target}: {err}")
    return OSError(err.errno, err.strerror or os.strerror(err.errno), str(target))


def write_text_atomic(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically (``atomic_path``); returns the path."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding=encoding)
    return Path(path)
