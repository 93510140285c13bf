"""What a finished or interrupted job prints: ``run_summary`` (one line on the measured steps of a run:
median step, predicted, tokens/s, bubble, and whether gradients were checked) and ``stop_line`` (the one
line of a job stopped by a signal: what was stopped and which whole steps the tables hold)."""

from __future__ import annotations

import signal
from pathlib import Path

from dynmb.runtime.launch import LaunchResult

__all__ = ["run_summary", "stop_line"]


def _steps_text(steps: tuple[int, ...]) -> str:
    if not steps:
        return "no complete step"
    if list(steps) == list(range(steps[0], steps[-1] + 1)):
        return f"steps {steps[0]}-{steps[-1]} complete" if len(steps) > 1 else f"step {steps[0]} complete"
    return f"steps {', '.join(map(str, steps))} complete"


def stop_line(verb: str, launched: LaunchResult) -> str:
    """The one line of an interrupted job: what was stopped and which steps the tables hold."""
    done = launched.complete_steps
    held = "; ".join(f"{rid}: {_steps_text(steps)}" for rid, steps in done.items()) if len(done) > 1 \
        else _steps_text(next(iter(done.values()), ()))
    name = signal.Signals(launched.signal).name if launched.signal is not None else "a signal"
    return (f"dynmb {verb}: interrupted ({name}), stopped torchrun and {launched.stopped_workers} workers; "
            f"tables hold {held}")


def run_summary(out: Path, run_id: str | None = None) -> str:
    """One line on the measured steps of ``run_id`` (default: every run) in ``out``: median
    step, predicted, tokens/s, bubble."""
    import pandas as pd

    steps = pd.read_csv(out / "steps.csv")
    if run_id is not None:
        steps = steps[steps["run_id"].astype(str) == run_id]
    steps = steps[~steps["warmup"].astype(bool)] if "warmup" in steps else steps
    tag = f"run {run_id}, " if run_id is not None else ""
    checked = ""
    if "verified" in steps.columns and steps["verified"].astype(bool).any():
        checked = (f"; gradients checked against a single-process reference: {int(steps['verified'].astype(bool).sum())}"
                   f" of {len(steps)} measured steps equal")
    return (f"dynmb run: ok, {tag}{len(steps)} measured steps, median step {steps['step_s'].median():.3f} s "
            f"(predicted {steps['pred_step_s'].median():.3f} s), {steps['tokens_per_s'].median():.0f} tokens/s, "
            f"mean bubble {steps['mean_bubble'].median():.2f}{checked}; tables in {out}")
