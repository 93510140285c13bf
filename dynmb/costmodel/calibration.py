"""Runtime calibration: how fast a running pipeline executes each stage's ops, against the cost model.

The shipped cost model is a profile: each stage's op timed on its own graph, one shape at a time.
A real pipeline on a shared host runs at another speed, and that speed moves: the ranks share the
last-level cache and memory bandwidth with each other's compute and communication threads (on
the 2-core development box a stage's forward ran up to 1.37x slower while the other rank computed
than alone, ``benchmarks/bench_contention.py``), the host's neighbours come and go (the same
action ran 1.0x its prediction in one step and 1.3x half a minute later), and every action pays a
few ms the profiled op does not (posting sends and receives, the memory meter's hooks, the
interpreter).

``runtime_calibration(actions)`` fits ``measured = scale[op][stage] x predicted + overhead[op]``
to an ``actions`` table whose ``pred_s`` are the *uncalibrated* predictions, in two steps:

1. ``scale``: per (stage, op), ``sum(measured) / sum(predicted)`` over the actions predicted at
   ``OVERHEAD_SMALL_S`` or more (where a fixed cost per action does not show): a ratio of sums,
   so the big actions that make up a step weigh most. A (stage, op) with under
   ``SCALE_MIN_PRED_S`` of such predicted work has no scale (1.0).
2. ``overhead_s``: per op, the median of ``measured - scale x predicted`` over the actions
   predicted under ``OVERHEAD_SMALL_S`` (``OVERHEAD_MIN_ACTIONS`` of them needed), never negative.

``job_calibration(history, run_id)`` is what a run plans its next step with: the history is
every step measured so far by the runs of one job that share a machine, a model, a stage count
and a cost model (``dynmb compare`` runs its cases round by round in one job), in the order they
ran. Per (stage, op) it multiplies

    own bias x speed now = (own ratio / everyone's ratio) x recent ratio

where *own* is this run's steps so far, *everyone's* every step of the job so far and *recent*
the job's last ``RECENT_STEPS`` steps (each a ratio of sums as in step 1; a missing ratio falls
back to everyone's, so with no steps of its own a run takes the job's recent speed, and a run
alone in its job takes its own ratio). The per-action overhead is the run's own (each fit with
its own scale) once it has ``OVERHEAD_MIN_ACTIONS`` small actions of an op, else the recent
window's, else everyone's: what an action pays beyond its op depends on the method's actions. Why both terms: the profile is off by a factor that depends on the shapes a method
runs (on the development box the padded rows of ``fixed`` ran 1.15-1.3x their prediction while
``packed`` rows ran 1.0x), which only the run's own actions show; and the machine's speed drifts
by up to 30% within a minute, which only the latest actions show, whoever ran them. Replayed on
seven recorded default compares (``experiments/calibration_study.py``; 63 case-runs), the median
step-time error per case is 11.1% calibrating once on the warm-up step, 9.4% on the run's own
steps, 7.3% with this rule, the worst 26%, 19% and 16%.

Every rank appends the same gathered actions in the same order, so every rank computes the same
calibration and plans the same step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pandas as pd

__all__ = ["SCALE_MIN_PRED_S", "OVERHEAD_SMALL_S", "OVERHEAD_MIN_ACTIONS", "RECENT_STEPS", "RuntimeCalibration",
           "CalibrationStep", "runtime_calibration", "job_calibration"]

SCALE_MIN_PRED_S = 0.25
"""A (stage, op) is scaled once its big actions add up to 0.25 s of predicted work."""

OVERHEAD_SMALL_S, OVERHEAD_MIN_ACTIONS = 0.05, 8
"""Actions predicted under 50 ms give the per-action overhead (8 of an op needed), the others the scale."""

RECENT_STEPS = 2
"""``job_calibration``'s window on the machine's current speed: the job's last two steps."""

_OPS = ("F", "B", "I", "W")


@dataclass(frozen=True)
class RuntimeCalibration:
    """What running steps measured against the cost model: ``scale[op][stage]`` multiplies the
    uncalibrated prediction (``CostModel.with_scale``), and ``overhead_s[op]`` seconds are added
    per action (``CostModel.with_overhead``)."""

    scale: dict[str, list[float]] = field(default_factory=dict)
    overhead_s: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class CalibrationStep:
    """One measured step of a job's history: the run it belongs to and every rank's actions
    (``stage``, ``op``, ``start_s``, ``end_s`` and the uncalibrated prediction ``pred_s``)."""

    run_id: str
    actions: pd.DataFrame


def _measured(actions: pd.DataFrame) -> pd.Series:
    return (actions["end_s"] - actions["start_s"]).astype(float)


def _ratios(actions: pd.DataFrame) -> dict[tuple[str, int], float]:
    """``sum(measured) / sum(predicted)`` per (op, stage) over the big actions, where there are
    ``SCALE_MIN_PRED_S`` of predicted work."""
    big = actions[actions["op"].isin(_OPS) & (actions["pred_s"] >= OVERHEAD_SMALL_S)]
    out = {}
    for (op, stage), g in big.groupby(["op", "stage"]):
        total = float(g["pred_s"].sum())
        if total >= SCALE_MIN_PRED_S:
            out[(str(op), int(stage))] = float(_measured(g).sum()) / total
    return out


def _overheads(actions: pd.DataFrame, scale: dict[str, list[float]], num_stages: int) -> dict[str, float]:
    """Per op: the median of ``measured - scale x predicted`` over the small actions."""
    out = {}
    for op in _OPS:
        few = actions[(actions["op"] == op) & (actions["pred_s"] < OVERHEAD_SMALL_S)]
        if len(few) < OVERHEAD_MIN_ACTIONS:
            continue
        factor = np.array([scale.get(op, [1.0] * num_stages)[int(st)] for st in few["stage"]])
        out[op] = max(0.0, float(np.median(_measured(few) - factor * few["pred_s"])))
    return out


def _as_scale(ratios: dict[tuple[str, int], float], num_stages: int) -> dict[str, list[float]]:
    scale: dict[str, list[float]] = {}
    for (op, stage), r in sorted(ratios.items()):
        scale.setdefault(op, [1.0] * num_stages)[stage] = r
    return scale


def runtime_calibration(actions: pd.DataFrame, num_stages: int) -> RuntimeCalibration:
    """Fit ``measured = scale[op][stage] x predicted + overhead_s[op]`` to ``actions`` (module doc)."""
    actions = actions[actions["op"].isin(_OPS)]
    scale = _as_scale(_ratios(actions), num_stages)
    return RuntimeCalibration(scale, _overheads(actions, scale, num_stages))


def job_calibration(history: Sequence[CalibrationStep], run_id: str, num_stages: int, *,
                    recent_steps: int = RECENT_STEPS) -> RuntimeCalibration:
    """The calibration run ``run_id`` plans its next step with: its own bias against the job times
    the job's speed over its last ``recent_steps`` steps (module doc). Empty history: none."""
    if not history:
        return RuntimeCalibration()
    frames = [h.actions for h in history]
    everyone_actions = pd.concat(frames, ignore_index=True)
    own_frames = [h.actions for h in history if h.run_id == run_id]
    if len(own_frames) == len(history):
        return runtime_calibration(everyone_actions, num_stages)
    everyone = _ratios(everyone_actions)
    own = _ratios(pd.concat(own_frames, ignore_index=True)) if own_frames else {}
    recent_actions = pd.concat(frames[-recent_steps:], ignore_index=True)
    recent = _ratios(recent_actions)
    ratios = {}
    for key, all_r in everyone.items():
        ratios[key] = own.get(key, all_r) / all_r * recent.get(key, all_r)
    overhead = {**runtime_calibration(everyone_actions, num_stages).overhead_s,
                **runtime_calibration(recent_actions, num_stages).overhead_s}
    if own_frames:
        overhead.update(runtime_calibration(pd.concat(own_frames, ignore_index=True), num_stages).overhead_s)
    return RuntimeCalibration(_as_scale(ratios, num_stages), overhead)
