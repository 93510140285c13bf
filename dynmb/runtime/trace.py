"""Chrome / Perfetto trace export of measured pipeline steps.

``export_trace(actions, path, step=None, run_id=None)`` turns rows of the
``actions`` table (``rank, stage, op, mb, start_s, end_s, wait_s, ...``) into the
Chrome trace-event JSON format: one process per run, one track (thread) per rank,
one complete event (``ph: "X"``) per action named like the schedule IR
(``1F3``), and a separate ``wait`` event for the receive wait before it. Times
are microseconds from the step start. Open the file in https://ui.perfetto.dev
or chrome://tracing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

__all__ = ["export_trace", "trace_events"]


def trace_events(actions: pd.DataFrame) -> list[dict[str, Any]]:
    """Trace events (list of dicts) of the given action rows (one step)."""
    ev: list[dict[str, Any]] = []
    for r in sorted(actions["rank"].unique()):
        ev.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": int(r), "args": {"name": f"rank {int(r)}"}})
    for row in actions.itertuples(index=False):
        name = f"{int(row.stage)}{row.op}{int(row.mb)}"
        args = {k: (v.item() if hasattr(v, "item") else v) for k, v in row._asdict().items()
                if k in ("batch", "padded_len", "pred_s", "wait_s", "step")}
        start = float(row.start_s) * 1e6
        ev.append({"ph": "X", "name": name, "cat": row.op, "pid": 0, "tid": int(row.rank),
                   "ts": start, "dur": max(0.0, (float(row.end_s) - float(row.start_s)) * 1e6), "args": args})
        wait = float(getattr(row, "wait_s", 0.0) or 0.0)
        if wait > 0:
            ev.append({"ph": "X", "name": "wait", "cat": "wait", "pid": 0, "tid": int(row.rank),
                       "ts": start - wait * 1e6, "dur": wait * 1e6, "args": {"for": name}})
    return ev


def export_trace(actions: pd.DataFrame, path: str | Path, step: int | None = None, run_id: str | None = None) -> Path:
    """Write the trace of one step (default: the last non-warm-up step of the first run) to ``path``."""
    df = actions
    if run_id is None and "run_id" in df:
        run_id = df["run_id"].iloc[0]
    if run_id is not None and "run_id" in df:
        df = df[df["run_id"] == run_id]
    if step is None:
        step = int(df["step"].max())
    df = df[df["step"] == step]
    if df.empty:
        raise ValueError(f"no actions for run {run_id!r} step {step}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"traceEvents": trace_events(df), "displayTimeUnit": "ms",
           "otherData": {"run_id": str(run_id), "step": step}}
    path.write_text(json.dumps(doc))
    return path
