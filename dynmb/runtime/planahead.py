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

Shared (``share``, a ``dynmb.runtime.planshare.PlanShare``; the runtime passes one whenever the job
has more than one rank): each rank plans only the steps it owns (``k mod W``) and reads the others'
from the job's store, and the window is ``n x W`` steps (step k planned with the model of step
k - n W), so the ``n x W`` planner processes of the job plan ``n x W`` steps at once. An owner
publishes a plan as soon as it sees it done (at every ``get``), an error too: every rank raises
the owner's error at the step that needed the plan.

Steady state: the plan of step k is submitted when step k - n starts and ``n`` processes plan
``n`` steps at once, so planning delays a step only when one plan takes longer than ``n`` steps
(``plan_s > n x step_s``; shared, ``plan_s > n x W x step_s``). Per step the ``steps`` table keeps the planner's own time
(``plan_s``) and how long the step's start waited for it (``plan_wait_s``: the whole ``plan_s``
in line, zero when planning kept ahead). A planner's error (an unplannable batch) is raised by
the step that needed the plan, as in line; a planner process that dies fails the run naming it.

A planner process that dies or is stopped (``planahead_procs.PlannerPool``: plain child processes,
no multiprocessing semaphores or resource tracker) does not fail the run: the rank logs one warning
naming itself, the process and how it ended, stops the others, and from then on plans in line, each
step with the cost model it was submitted with, so every rank still gets the same plans.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable

import numpy as np

from dynmb.costmodel.loader import Models
from dynmb.planning import plan_step
from dynmb.runtime.planshare import PlanShare
from dynmb.runtime.planahead_procs import PlannerDied, PlannerPool

__all__ = ["PlanAhead"]

logger = logging.getLogger(__name__)

def _plan(lengths: np.ndarray, models: Models[Any], spec: Any, model_cfg: Any) -> Any:
    """In a planner process: ``planning.plan_step`` of one global batch."""
    return plan_step(lengths, spec, model_cfg=model_cfg, models=models)


class PlanAhead:
    """``n`` planner processes planning up to ``n`` steps (shared: ``n x W``) ahead of the step being
    trained: ``plan_step(lengths_of(k), spec, model_cfg=, models=)`` for every step k
    up to ``last``, the run's last step (shared: the steps this rank owns)."""

    def __init__(self, n: int, lengths_of: Callable[[int], np.ndarray], last: int, *, spec: Any, model_cfg: Any,
                 memory_model: Any, share: PlanShare | None = None) -> None:
        if n < 1:
            raise ValueError(f"plan_ahead must be >= 1 to plan ahead, got {n}")
        self.n, self.last, self.share = n, last, share
        self.window = n * (share.world if share is not None else 1)
        self._lengths_of, self._args, self._memory_model = lengths_of, (spec, model_cfg), memory_model
        self._pool: PlannerPool | None = PlannerPool(n)
        self._futures: dict[int, Future] = {}        # owned step -> its plan
        self._models: dict[int, Models[Any]] = {}    # owned step -> the models it was submitted with
        self._lengths: dict[int, np.ndarray] = {}    # submitted step -> its batch's lengths
        self._published: set[int] = set()
        self._next = 0

    def _owns(self, step: int) -> bool:
        return self.share is None or self.share.owns(step)

    def get(self, step: int, cost_model: Any) -> tuple[Any, np.ndarray, float]:
        """``(planned, lengths, wait_s)`` of step ``step``: what ``plan`` returned, the batch's
        lengths, and the seconds this call waited for it. Submits steps up to ``step + window`` first."""
        self.submit_through(step + self.window, cost_model)
        self._publish_done()
        if step not in self._lengths:
            raise RuntimeError(f"plan ahead: step {step} was not submitted (steps are asked for in order)")
        lengths = self._lengths.pop(step)
        if not self._owns(step):
            assert self.share is not None
            (ok, planned), wait_s = self.share.fetch(step)
            if not ok:
                raise planned
            return planned, lengths, wait_s
        future, models = self._futures.pop(step, None), self._models.pop(step)
        t0 = time.perf_counter()
        try:
            planned = self._wait(step, future) if future is not None else None
            if planned is None:                     # no planner process left: in line, with the step's model
                planned = _plan(lengths, models, *self._args)
        except Exception as e:
            self._publish(step, (False, e))
            raise
        self._publish(step, (True, planned))
        return planned, lengths, time.perf_counter() - t0

    def _wait(self, step: int, future: Future) -> Any:
        """The plan ``future`` holds, or None when a planner process died or stopped (then every
        planner process is stopped, with one warning, and the rest of the run plans in line)."""
        while True:
            try:
                return future.result(timeout=0.5)
            except PlannerDied as e:
                self._give_up(step, str(e))
                return None
            except FutureTimeout:
                stopped = self._pool.stopped() if self._pool is not None else None
                if stopped is not None:
                    self._give_up(step, stopped)
                    return None

    def _give_up(self, step: int, what: str) -> None:
        rank = self.share.rank if self.share is not None else os.environ.get("RANK", "0")
        logger.warning("rank %s: %s while planning step %d ahead; planning in line from here on "
                       "(each step with the cost model it was submitted with)", rank, what, step)
        self.close()

    def _publish(self, step: int, result: tuple[bool, Any]) -> None:
        if self.share is not None and step not in self._published:
            self.share.publish(step, result)
            self._published.add(step)

    def _publish_done(self) -> None:
        """Publish every owned plan that is done (a plan error too) without waiting for any."""
        for step, future in self._futures.items():
            if self.share is not None and step not in self._published and future.done():
                error = future.exception()
                if not isinstance(error, PlannerDied):
                    self._publish(step, (False, error) if error is not None else (True, future.result()))

    def submit_through(self, step: int, cost_model: Any) -> None:
        """Submit every step not yet submitted up to ``step`` (and the run's last), planned with
        ``cost_model`` (shared: the owned ones; the others' lengths are kept for ``get``).
        ``RunState`` submits the first ``window + 1`` steps at set-up, so the planner processes
        start (a few seconds of imports) while the rank builds its model."""
        for k in range(self._next, min(step, self.last) + 1):
            self._lengths[k] = lengths = self._lengths_of(k)
            if self._owns(k):
                self._models[k] = models = Models(cost_model, self._memory_model)
                if self._pool is not None:
                    self._futures[k] = self._pool.submit(_plan, lengths, models, *self._args)
            self._next = k + 1

    def close(self) -> None:
        """Stop the planner processes; plans not yet asked for are planned in line when asked."""
        pool, self._pool = self._pool, None
        self._futures = {k: f for k, f in self._futures.items() if f.done() and f.exception() is None}
        if pool is not None:
            pool.close()
