"""The remaining time of a profile: ``Eta`` from the runs measured so far, ``Progress`` showing it.

Every run has an analytic estimate (``grid.estimate_run_seconds``). Once the first runs are
measured, the time left is the estimate of what is left times measured / estimated seconds of what
is done, recalibrated after every run (so large points late in a pass do not make it lie).
``Progress`` shows it on a tqdm bar over estimated seconds (on a terminal) or as INFO log lines of
the ``dynmb.measure`` logger (every 30 s, or when the projected finish moves by more than a
quarter of what was left), plus the first estimate and the total.
"""

from __future__ import annotations

import logging
import sys
import time

__all__ = ["Eta", "Progress", "minutes"]

logger = logging.getLogger("dynmb.measure")
"""The ETA lines (``dynmb profile`` shows them at INFO)."""


def minutes(seconds: float) -> str:
    """``42 s`` under two minutes, else ``3.4 min`` (fixed-point)."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


class Eta:
    """An honest remaining time of a profile, from the runs measured so far.

    Every run has an analytic estimate (``estimate_run_seconds``); after the first
    ``first_runs`` runs (and ``first_s`` seconds) the remaining time is the estimate of what is
    left times measured / estimated seconds of what is done, so it is calibrated on this
    machine and keeps being recalibrated as larger points come. ``update(est_s)`` after each
    run returns a log line when one is due: the first estimate, then every ``every_s`` seconds
    or when the remaining time moved by more than a quarter since the last line."""

    def __init__(self, estimates: list[float], *, first_runs: int = 3, first_s: float = 2.0, every_s: float = 30.0,
                 clock=time.monotonic) -> None:
        self.total_est, self.runs = float(sum(estimates)), len(estimates)
        self.first_runs, self.first_s, self.every_s, self.clock = first_runs, first_s, every_s, clock
        self.t0 = clock()
        self.done_runs, self.done_est = 0, 0.0
        self.last_line_at: float | None = None
        self.last_end: float | None = None      # elapsed + remaining at the last line
        self.last_remaining = 0.0

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def remaining(self) -> float | None:
        """Seconds left (None before the first run is measured)."""
        if self.done_runs == 0 or self.done_est <= 0:
            return None
        return max(0.0, self.total_est - self.done_est) * self.elapsed() / self.done_est

    def update(self, est_s: float) -> str | None:
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
        return (f"profile: {self.done_runs}/{self.runs} runs in {minutes(now)}; about {minutes(left)} left "
                f"(from the runs measured so far; first estimate {minutes(self.total_est)})")

    def postfix(self) -> str:
        left = self.remaining()
        return "ETA ?" if left is None or self.done_runs < self.first_runs else f"ETA {minutes(left)}"

    def final(self) -> str:
        return (f"profile: {self.done_runs} runs in {minutes(self.elapsed())} "
                f"(first estimate {minutes(self.total_est)})")


class Progress:
    """Progress of a profile: on a terminal a tqdm bar over estimated seconds with the ``Eta`` in
    it (when ``bar``), else the ``Eta`` lines (INFO); the first estimate and the total always."""

    def __init__(self, estimates: list[float], desc: str, bar: bool) -> None:
        self.eta = Eta(estimates)
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

