"""Planning ahead of training: planner processes plan the next steps while this rank trains.

With ``RunConfig.plan_ahead = n`` (``--plan-ahead N``; 0, the default, plans each step in line,
on the critical path), each rank starts ``n`` planner processes (``spawn``; the kernel kills
them with the rank, ``processes.set_parent_death_signal``). ``PlanAhead.get(step, model)``:

1. submits every step from the next unsubmitted one up to ``step + n`` (steps past the run's
   last are never planned), each planned with ``model``, the cost model the rank holds at that
   moment (calibrated on the steps measured so far);
2. waits for step ``step``'s plan and returns it with the wait.

Every rank submits the same steps with the same models at the same points of the run, and
planning is deterministic, so every rank receives the same plan (the step still compares plan
digests, ``checks.check_plan_digest``). What changes against in-line planning is only which
calibration a plan uses: step k is planned with the model of step k - n.

Steady state: the plan of step k is submitted when step k - n starts and ``n`` processes plan
``n`` steps at once, so planning delays a step only when one plan takes longer than ``n`` steps
(``plan_s > n x step_s``). Per step the ``steps`` table keeps the planner's own time
(``plan_s``) and how long the step's start waited for it (``plan_wait_s``: the whole ``plan_s``
in line, zero when planning kept ahead). A planner's error (an unplannable batch) is raised by
the step that needed the plan, as in line; a planner process that dies fails the run naming it.
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable

import numpy as np

from dynmb.planning import plan_step
from dynmb.runtime.processes import set_parent_death_signal

__all__ = ["PlanAhead"]


def _init_planner() -> None:
    """A planner process: dies with its rank; one thread (the rank's cores are for training)."""
    set_parent_death_signal()
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:      # pragma: no cover - torch is a dependency of the runtime
        pass


def _plan(lengths: np.ndarray, cost_model: Any, spec: Any, model_cfg: Any, memory_model: Any) -> Any:
    """In a planner process: ``planning.plan_step`` of one global batch."""
    return plan_step(lengths, spec, model_cfg=model_cfg, cost_model=cost_model, memory_model=memory_model)


class PlanAhead:
    """``n`` planner processes planning up to ``n`` steps ahead of the step being trained:
    ``plan_step(lengths_of(k), spec, model_cfg=, cost_model=, memory_model=)`` for every step k
    up to ``last``, the run's last step."""

    def __init__(self, n: int, lengths_of: Callable[[int], np.ndarray], last: int, *, spec: Any, model_cfg: Any,
                 memory_model: Any) -> None:
        if n < 1:
            raise ValueError(f"plan_ahead must be >= 1 to plan ahead, got {n}")
        self.n, self.last = n, last
        self._lengths_of, self._args = lengths_of, (spec, model_cfg, memory_model)
        self._pool = ProcessPoolExecutor(max_workers=n, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_init_planner)
        self._futures: dict[int, tuple[Future, np.ndarray]] = {}   # step -> (its plan, its lengths)
        self._next = 0

    def get(self, step: int, cost_model: Any) -> tuple[Any, np.ndarray, float]:
        """``(planned, lengths, wait_s)`` of step ``step``: what ``plan`` returned, the batch's
        lengths, and the seconds this call waited for it. Submits steps up to ``step + n`` first."""
        self.submit_through(step + self.n, cost_model)
        if step not in self._futures:
            raise RuntimeError(f"plan ahead: step {step} was not submitted (steps are asked for in order)")
        future, lengths = self._futures.pop(step)
        t0 = time.perf_counter()
        try:
            planned = future.result()
        except BrokenProcessPool as e:
            raise RuntimeError(f"plan ahead: a planner process died while planning step {step} ({e})") from None
        return planned, lengths, time.perf_counter() - t0

    def submit_through(self, step: int, cost_model: Any) -> None:
        """Submit every step not yet submitted up to ``step`` (and the run's last), planned with
        ``cost_model``. ``RunState`` submits the first ``n + 1`` steps at set-up, so the planner
        processes start (a few seconds of imports) while the rank builds its model."""
        for k in range(self._next, min(step, self.last) + 1):
            lengths = self._lengths_of(k)
            self._futures[k] = (self._pool.submit(_plan, lengths, cost_model, *self._args), lengths)
            self._next = k + 1

    def close(self) -> None:
        """Stop the planner processes; plans not yet asked for are dropped."""
        self._pool.shutdown(wait=False, cancel_futures=True)
