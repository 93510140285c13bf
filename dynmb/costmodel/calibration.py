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

    own bias x speed now,   bias = sum(own measured) / sum(own predicted x speed then)

where *speed then* is the job's ratio of sums (as in step 1) over each own step and the
``RECENT_STEPS`` steps before it, and *speed now* the ratio over the job's last ``RECENT_STEPS``
steps. A missing ratio falls back to the whole job's; a run with under ``SCALE_MIN_PRED_S`` of
own predicted work has bias 1, so with no steps of its own it takes the job's speed now; a run
alone in its job takes its own ratio over all its steps. The per-action overhead is the run's
own (each fit with its own scale) once it has ``OVERHEAD_MIN_ACTIONS`` small actions of an op,
else the recent window's, else everyone's: what an action pays beyond its op depends on the
method's actions.

Why both terms: the profile is off by a factor that depends on the shapes a method runs (on the
development box the padded rows of ``fixed`` ran 1.15-1.3x their prediction while ``packed``
rows ran 1.0x), which only the run's own actions show; and the machine's speed drifts by up to
30% within a minute, which only the latest actions show, whoever ran them. Replayed on seven
recorded default compares (``studies/prediction/calibration_study.py``; 63 case-runs), the median
step-time error per case is 11.1% calibrating once on the warm-up step, 9.4% on the run's own
steps, 6.3% with this rule (dynamic's 5.8%), the worst 26%, 19% and 20%. Measuring the bias
against the job's speed at the time of each own step, not against the job's average, is what
took dynamic from 12.3% to 5.8%: a run whose warm-up fell in a slow minute otherwise carried
that minute as its bias.

What the pipeline pays between actions (``dynmb.costmodel.p2pfit``) is fitted on the whole job's
history, whoever ran it, since it is the machine's and the transport's, not a method's:
``latency_s``, the mean receive wait the simulator does not explain (a message the receiver
asked for after its sender had moved on arrived 5-100 ms late on the loaded 2-core box), is
added to every receiving action (``CostModel.with_recv_latency``), and ``gap_s[op]``, the
median time between an action's end and the next ``op``'s receive on a rank (about 1.3 ms of
input building before every ``F``), to every action's overhead (``per_action_s``). Both are paid
once per microbatch and stage, so a plan of many microbatches is charged for them and a plan of
few is not: without them the replay of a default ``dynmb compare`` recorded on the loaded 2-core box (c0fe06a) with every action's
*measured* time ran 4.1% fast on dynamic's steps (11 microbatches) against 1.3% on
balanced div=16's (4-8), and the planner's choice between them leaned the same way.

Every rank appends the same gathered actions in the same order, so every rank computes the same
calibration and plans the same step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Sequence

import numpy as np
import pandas as pd

from dynmb.costmodel.p2pfit import RECEIVE_COLUMNS, action_gaps, gap_per_op, has_receive_columns, p2p_latency, receive_waits

__all__ = ["SCALE_MIN_PRED_S", "OVERHEAD_SMALL_S", "OVERHEAD_MIN_ACTIONS", "RECENT_STEPS", "RuntimeCalibration",
           "CalibrationStep", "runtime_calibration", "job_calibration"]

SCALE_MIN_PRED_S = 0.25
"""A (stage, op) is scaled once its big actions add up to 0.25 s of predicted work."""

OVERHEAD_SMALL_S, OVERHEAD_MIN_ACTIONS = 0.05, 8
"""Actions predicted under 50 ms give the per-action overhead (8 of an op needed), the others the scale."""

RECENT_STEPS = 2
"""``job_calibration``'s window on the machine's current speed: the job's last two steps."""

_OPS = ("F", "B", "I", "W")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeCalibration:
    """What running steps measured against the cost model: ``scale[op][stage]`` multiplies the
    uncalibrated prediction (``CostModel.with_scale``), ``overhead_s[op]`` (in the op's compute)
    plus ``gap_s[op]`` (before it on the rank) seconds are added per action (``per_action_s``,
    ``CostModel.with_overhead``), and ``latency_s`` seconds per receiving action
    (``CostModel.with_recv_latency``)."""

    scale: dict[str, list[float]] = field(default_factory=dict)
    overhead_s: dict[str, float] = field(default_factory=dict)
    gap_s: dict[str, float] = field(default_factory=dict)
    latency_s: float = 0.0

    @property
    def per_action_s(self) -> dict[str, float]:
        """Seconds added to every action of an op: its overhead plus the gap before it."""
        return {op: self.overhead_s.get(op, 0.0) + self.gap_s.get(op, 0.0)
                for op in dict.fromkeys([*self.overhead_s, *self.gap_s])}


@dataclass(frozen=True)
class CalibrationStep:
    """One measured step of a job's history: the run it belongs to and every rank's actions
    (``stage``, ``op``, ``start_s``, ``end_s`` and the uncalibrated prediction ``pred_s``)."""

    run_id: str
    actions: pd.DataFrame

    @cached_property
    def receive_waits(self) -> pd.Series | None:
        """The step's unexplained receive waits (``p2pfit.receive_waits``); None without the
        receive columns."""
        return receive_waits(self.actions) if has_receive_columns(self.actions) else None

    @cached_property
    def gaps(self) -> pd.DataFrame | None:
        """The step's gaps between actions (``p2pfit.action_gaps``); None without the columns."""
        return action_gaps(self.actions) if has_receive_columns(self.actions) else None


def _measured(actions: pd.DataFrame) -> pd.Series:
    return (actions["end_s"] - actions["start_s"]).astype(float)


def _sums(actions: pd.DataFrame) -> dict[tuple[str, int], tuple[float, float]]:
    """``(sum(measured), sum(predicted))`` per (op, stage) over the big actions."""
    big = actions[actions["op"].isin(_OPS) & (actions["pred_s"] >= OVERHEAD_SMALL_S)]
    return {(str(op), int(stage)): (float(_measured(g).sum()), float(g["pred_s"].sum()))
            for (op, stage), g in big.groupby(["op", "stage"])}


def _ratios(actions: pd.DataFrame) -> dict[tuple[str, int], float]:
    """``sum(measured) / sum(predicted)`` per (op, stage) over the big actions, where there are
    ``SCALE_MIN_PRED_S`` of predicted work."""
    return {key: measured / predicted for key, (measured, predicted) in _sums(actions).items()
            if predicted >= SCALE_MIN_PRED_S}


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


def _window(history: Sequence[CalibrationStep], end: int, steps: int) -> pd.DataFrame:
    """The actions of the ``steps`` history steps before index ``end``."""
    return pd.concat([h.actions for h in history[max(0, end - steps):end]], ignore_index=True)


def job_calibration(history: Sequence[CalibrationStep], run_id: str, num_stages: int, *,
                    recent_steps: int = RECENT_STEPS) -> RuntimeCalibration:
    """The calibration run ``run_id`` plans its next step with: its own bias against the job's
    speed at the time of each of its steps, times the job's speed over its last ``recent_steps``
    steps (module doc). Empty history: none."""
    if not history:
        return RuntimeCalibration()
    compute = _job_compute(history, run_id, num_stages, recent_steps)
    waits = [h.receive_waits for h in history if h.receive_waits is not None]
    if len(waits) < len(history):
        _warn_once("the job's history lacks the columns the P2P fit reads (%s): P2P latency and gaps between "
                   "actions not calibrated on those steps" % ", ".join(RECEIVE_COLUMNS))
    latency = p2p_latency(waits)
    return replace(compute, gap_s=gap_per_op([h.gaps for h in history if h.gaps is not None]),
                   latency_s=latency or 0.0)


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


def _job_compute(history: Sequence[CalibrationStep], run_id: str, num_stages: int,
                 recent_steps: int) -> RuntimeCalibration:
    """``job_calibration``'s scale and compute overhead (module doc)."""
    everyone_actions = pd.concat([h.actions for h in history], ignore_index=True)
    own = [i for i, h in enumerate(history) if h.run_id == run_id]
    if len(own) == len(history):
        return runtime_calibration(everyone_actions, num_stages)
    everyone = _ratios(everyone_actions)
    recent_actions = _window(history, len(history), recent_steps)
    speed_now = _ratios(recent_actions)
    measured: dict[tuple[str, int], float] = {}
    expected: dict[tuple[str, int], float] = {}
    predicted: dict[tuple[str, int], float] = {}
    for i in own:          # the job's speed around step i: it and the steps just before it
        speed_then = _ratios(_window(history, i + 1, recent_steps + 1))
        for key, (meas, pred) in _sums(history[i].actions).items():
            measured[key] = measured.get(key, 0.0) + meas
            expected[key] = expected.get(key, 0.0) + pred * speed_then.get(key, everyone.get(key, 1.0))
            predicted[key] = predicted.get(key, 0.0) + pred
    ratios = {}
    for key, all_r in everyone.items():
        bias = measured[key] / expected[key] if predicted.get(key, 0.0) >= SCALE_MIN_PRED_S else 1.0
        ratios[key] = bias * speed_now.get(key, all_r)
    overhead = {**runtime_calibration(everyone_actions, num_stages).overhead_s,
                **runtime_calibration(recent_actions, num_stages).overhead_s}
    if own:
        own_actions = pd.concat([history[i].actions for i in own], ignore_index=True)
        overhead.update(runtime_calibration(own_actions, num_stages).overhead_s)
    return RuntimeCalibration(_as_scale(ratios, num_stages), overhead)
