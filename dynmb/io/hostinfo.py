"""What the host offers the ranks of a run: usable CPU cores, and the warning when ranks outnumber them.

``usable_cores()`` is the number of CPU cores this process may run on: its affinity mask
(``os.sched_getaffinity``, which ``taskset`` and container cpusets narrow), further capped by a
cgroup v2 CPU quota (``/sys/fs/cgroup/cpu.max``, e.g. ``docker --cpus 2``), else ``os.cpu_count()``.

``cores_warning(nproc)`` is one line when ``nproc`` ranks (times ``threads`` torch threads each)
need more cores than that, None otherwise: the ranks then time-share cores, so measured step and
action times include waiting for a core, and the cost model's predictions (fitted on a dedicated
core) look too optimistic. ``dynmb run`` and ``dynmb compare`` log it with ``logging.warning``
before launching. ``LoadSampler`` samples the 1-minute load average (``os.getloadavg``) while a job runs,
so a verdict can say how busy the box was. Standard library only.
"""

from __future__ import annotations

import math
import os
import threading
from pathlib import Path

__all__ = ["usable_cores", "cores_warning", "LoadSampler"]

CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
"""cgroup v2 CPU quota: ``"<quota_us> <period_us>"`` or ``"max <period_us>"``."""


def _quota_cores(path: Path = CPU_MAX) -> int | None:
    """Cores allowed by the cgroup v2 quota (rounded up), None without one."""
    try:
        quota, period = path.read_text().split()[:2]
        if quota == "max":
            return None
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        return None


def usable_cores() -> int:
    """CPU cores this process may run on (affinity mask, capped by a cgroup quota); at least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # not Linux
        n = os.cpu_count() or 1
    quota = _quota_cores()
    return max(1, min(n, quota) if quota else n)


def cores_warning(nproc: int, threads: int = 1, cores: int | None = None) -> str | None:
    """One line when ``nproc`` ranks of ``threads`` torch threads each outnumber the usable cores
    (``cores``, default ``usable_cores()``); None when every rank has its own cores."""
    cores = usable_cores() if cores is None else int(cores)
    need = int(nproc) * max(1, int(threads))
    if need <= cores:
        return None
    what = f"{int(nproc)} ranks" + (f" x {int(threads)} threads" if int(threads) > 1 else "")
    most = max(1, cores // max(1, int(threads)))
    return (f"{what} on {cores} CPU core{'s' if cores != 1 else ''}: ranks share cores, so measured step and "
            f"action times include waiting for a core (predictions assume a core each); use at most "
            f"{most} rank{'s' if most != 1 else ''} for clean timings")


class LoadSampler:
    """``with LoadSampler() as load: ...``: the 1-minute load average at the start, then every
    ``period_s`` in a daemon thread, and at the end; ``peak`` and ``mean`` of the samples (NaN where the
    platform has no load average)."""

    def __init__(self, period_s: float = 5.0) -> None:
        self.period_s = period_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dynmb-load", daemon=True)

    def sample(self) -> None:
        try:
            self.samples.append(float(os.getloadavg()[0]))
        except OSError:
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def __enter__(self) -> "LoadSampler":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(1.0)
        self.sample()

    @property
    def peak(self) -> float:
        return max(self.samples) if self.samples else float("nan")

    @property
    def mean(self) -> float:
        return sum(self.samples) / len(self.samples) if self.samples else float("nan")
