"""Schedule text I/O in torch.distributed.pipelining's compute-only CSV format.

One line per rank, actions comma-separated and printed like torch's ``_Action``
(``0F0,0F1,0B0,...``); empty cells (torch writes them for idle steps) are
skipped on reading. ``num_stages`` is read off the actions (max stage + 1) and
``num_microbatches`` from them too unless given. ``to_str``/``from_str`` are the
same format in memory; ``from_str`` also accepts the ``rank r: 0F0 0B0`` lines
that ``str(Schedule)`` prints.
"""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path

from dynmb.io.atomic import write_text_atomic
from dynmb.core.types import Action, Schedule

__all__ = ["to_str", "from_str", "to_csv", "from_csv", "sidecar_path"]

def sidecar_path(schedule_path: str | Path) -> Path:
    """``<stem>.meta.json`` beside a schedule CSV: what ``dynmb schedule`` built it for (the plan's
    digest, kind, virtual stages, reorder). A CSV without one was written by hand or by torch."""
    p = Path(schedule_path)
    return p.with_name(p.stem + ".meta.json")


_RANK_PREFIX = re.compile(r"^\s*rank\s+\d+\s*:\s*")


def to_str(schedule: Schedule) -> str:
    """The compute-only CSV text: one line per rank, ``0F0,0F1,0B0,...``."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    for acts in schedule.ranks:
        w.writerow([str(a) for a in acts])
    return buf.getvalue()


def from_str(text: str, num_microbatches: int | None = None, kind: str = "") -> Schedule:
    """Parse ``to_str`` output (or ``str(Schedule)``); raises ``ValueError`` naming a bad cell."""
    ranks: list[list[Action]] = []
    for ln, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        line = _RANK_PREFIX.sub("", line)
        cells = next(csv.reader([line])) if "," in line else line.split()
        acts = []
        for c in cells:
            if not c.strip():
                continue
            try:
                acts.append(Action.parse(c))
            except ValueError as e:
                raise ValueError(f"line {ln + 1}: {e}") from None
        ranks.append(acts)
    if not ranks or not any(ranks):
        raise ValueError("schedule text holds no action")
    S = max(a.stage for r in ranks for a in r) + 1
    m = num_microbatches if num_microbatches is not None else max(a.mb for r in ranks for a in r) + 1
    return Schedule(ranks, S, m, kind=kind)


def to_csv(schedule: Schedule, path: str | Path) -> None:
    """Write the compute-only CSV (atomically: ``dynmb.io.atomic``)."""
    write_text_atomic(path, to_str(schedule))


def from_csv(path: str | Path, num_microbatches: int | None = None, kind: str = "") -> Schedule:
    """Read a compute-only CSV written by ``to_csv`` or by torch's ``_dump_csv(format="compute_only")``."""
    text = Path(path).read_text()
    try:
        return from_str(text, num_microbatches=num_microbatches, kind=kind)
    except ValueError as e:
        raise ValueError(f"{path}: not a compute-only schedule CSV: {e}") from None
