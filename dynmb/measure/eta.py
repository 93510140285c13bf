"""The remaining time of a profile: ``Eta`` from the runs measured so far, ``Progress`` showing it.

Every run has an analytic estimate (``grid.estimate_run_seconds``) and may carry a one-off extra
with its own estimate (the memory columns of a point's first repeat: a fresh stage, one more
forward and backward under the memory meter). Once the first runs are measured, each run's wall
seconds are fitted, by non-negative least squares over every run done, as ``a x estimate + c +
[extra] (e + f x extra's estimate)``: the machine's speed on the analytic model's seconds, what a
run costs beyond them (inputs, graph, Python) and what the extra costs; the time left is that fit summed
over the runs left, refitted after every run. A plain ratio measured / estimated over the first,
small runs (all overhead) misjudges the large ones; the profiler therefore runs a few probes first
(the largest point, and a later repeat, ``profiler._probes_first``) so the fit spans the grid early.
``Progress`` shows it on a tqdm bar over estimated seconds (on a terminal) or as INFO log lines of
the ``dynmb.measure`` logger (every 30 s, or when the projected finish moves by more than a
quarter of what was left), plus the first estimate and the total.
"""

from __future__ import annotations

import logging
import sys
import time

import numpy as np
from scipy.optimize import nnls

__all__ = ["Eta", "Progress", "minutes"]

logger = logging.getLogger("dynmb.measure")
"""The ETA lines (``dynmb profile`` shows them at INFO)."""


def minutes(seconds: float) -> str:
    """``42 s`` under two minutes, else ``3.4 min`` (fixed-point)."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _spread(values: np.ndarray) -> bool:
    """Whether positive ``values`` differ by 2x or more (a second coefficient can be fitted on them)."""
    return bool(values.size and values.min() > 0 and values.max() >= 2 * values.min())


class Eta:
    """An honest remaining time of a profile, from the runs measured so far.

    Every run has an analytic estimate (``estimate_run_seconds``) and ``extras``, the estimate of a
    one-off extra (0: none); after the first ``first_runs`` runs (and ``first_s`` seconds) the remaining time is the
    fit of the module docstring over the runs left, so it is calibrated on this machine and keeps
    being recalibrated as larger points come. ``update(est_s)`` after each
    run returns a log line when one is due: the first estimate, then every ``every_s`` seconds
    or when the remaining time moved by more than a quarter since the last line."""

    def __init__(self, estimates: list[float], *, extras: list[float] | None = None, first_runs: int = 3,
                 first_s: float = 2.0, every_s: float = 30.0, clock=time.monotonic) -> None:
        self.total_est, self.runs = float(sum(estimates)), len(estimates)
        self.estimates = np.asarray(estimates, dtype=float)
        self.extras = np.zeros(self.runs) if extras is None else np.asarray(extras, dtype=float)
        self.first_runs, self.first_s, self.every_s, self.clock = first_runs, first_s, every_s, clock
        self.t0 = self.last_t = clock()
        self.done_runs, self.done_est = 0, 0.0
        self.durations: list[float] = []
        self.last_line_at: float | None = None
        self.last_end: float | None = None      # elapsed + remaining at the last line
        self.last_remaining = 0.0
        self.projected: tuple[int, float] | None = None   # (runs, projected total seconds) of the first line

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def _features(self, lo: int, hi: int) -> np.ndarray:
        """``[estimate, 1, has extra, extra's estimate]`` of runs ``lo..hi - 1``."""
        extra = self.extras[lo:hi]
        return np.column_stack([self.estimates[lo:hi], np.ones(hi - lo), (extra > 0).astype(float), extra])

    def remaining(self) -> float | None:
        """Seconds left (None before the first run is measured): the module docstring's fit."""
        n = self.done_runs
        if n == 0 or self.done_est <= 0:
            return None
        done = self._features(0, n)
        # only what the runs so far can tell apart: a constant once the estimates differ 2x, the extras once
        # some runs had one and some did not (their size once those differ 2x); else the plain ratio
        used = [True, _spread(done[:, 0]), bool(np.ptp(done[:, 2]) > 0), _spread(done[done[:, 2] > 0, 3])]
        used[3] = used[3] and used[2]
        coef = np.zeros(4)
        coef[used], _ = nnls(done[:, used], np.asarray(self.durations))
        return float(max(0.0, (self._features(n, self.runs) @ coef).sum()))

    def update(self, est_s: float) -> str | None:
        now_t = self.clock()
        self.durations.append(now_t - self.last_t)
        self.last_t = now_t
        self.done_runs += 1
        self.done_est += float(est_s)
        now, left = self.elapsed(), self.remaining()
        if left is None or self.done_runs >= self.runs or self.done_runs < self.first_runs or now < self.first_s:
            return None
        # moved: the projected finish shifted by more than a quarter of what was left (and 10 s)
        moved = self.last_end is not None and abs(now + left - self.last_end) > max(0.25 * self.last_remaining, 10.0)
        if self.last_line_at is not None and now - self.last_line_at < self.every_s and not moved:
            return None
        self.last_line_at, self.last_end, self.last_remaining = now, now + left, left
        if self.projected is None:
            self.projected = (self.done_runs, now + left)
        return (f"profile: {self.done_runs}/{self.runs} runs in {minutes(now)}; about {minutes(left)} left "
                f"(from the runs measured so far; first estimate {minutes(self.total_est)})")

    def postfix(self) -> str:
        left = self.remaining()
        return "ETA ?" if left is None or self.done_runs < self.first_runs else f"ETA {minutes(left)}"

    def final(self) -> str:
        """The total, the analytic first estimate and the first fitted projection (measured / projected)."""
        took = self.elapsed()
        fitted = "" if self.projected is None or self.projected[1] <= 0 else (
            f"; projected {minutes(self.projected[1])} after {self.projected[0]} runs, "
            f"measured / projected {took / self.projected[1]:.2f}")
        return f"profile: {self.done_runs} runs in {minutes(took)} (first estimate {minutes(self.total_est)}{fitted})"


class Progress:
    """Progress of a profile: on a terminal a tqdm bar over estimated seconds with the ``Eta`` in
    it (when ``bar``), else the ``Eta`` lines (INFO); the first estimate and the total always."""

    def __init__(self, estimates: list[float], desc: str, bar: bool, extras: list[float] | None = None) -> None:
        self.eta = Eta(estimates, extras=extras)
        self.bar = None
        if bar and sys.stderr.isatty():
            try:
                from tqdm.auto import tqdm
            except ImportError:  # pragma: no cover
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=self.eta.total_est, desc=desc, unit="est-s",
                                bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed} elapsed{postfix}")
                self.bar.set_postfix_str("ETA ?")
        logger.info("profile: %d runs; first estimate %s (analytic, before any is measured)", self.eta.runs,
                    minutes(self.eta.total_est))

    def update(self, est_s: float, what: str) -> None:
        line = self.eta.update(est_s)
        if self.bar is not None:
            self.bar.update(est_s)
            self.bar.set_postfix_str(f"{self.eta.postfix()}; {what}")
        if line is not None and self.bar is None:
            logger.info("%s", line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.eta.runs:
            logger.info("%s", self.eta.final())

