"""One torchrun job per rank count for the gloo tests of every test module.

A torchrun start costs several seconds of the 2-core box's time (interpreters, torch import and
gloo set-up on every rank), so test modules do not launch their own jobs for plain verified runs:
each registers a *provider* (``register(nproc)``, at import) that returns its cases' ``RunSpec``s
for an output folder, and the session fixture ``gloo_job(nproc)`` (``tests/conftest.py``) runs every
registered case of that rank count in one job (``runtime.worker.run_cases``: one after another,
each case's model freed before the next). A test then reads its own cases' tables. Tests that inject
faults or need a job of their own still launch it themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dynmb.runtime.spec import RunSpec

__all__ = ["register", "PROVIDERS", "GlooJob", "own_job"]

Provider = Callable[[Path], list[RunSpec]]
PROVIDERS: dict[int, list[Provider]] = {2: [], 4: []}


def register(nproc: int) -> Callable[[Provider], Provider]:
    """Decorator: ``provider(out_dir) -> [RunSpec, ...]`` joins the shared ``nproc``-rank job."""
    def deco(provider: Provider) -> Provider:
        PROVIDERS.setdefault(nproc, []).append(provider)
        return provider
    return deco


@dataclass(frozen=True)
class GlooJob:
    """How the shared job ended: its exit code, the workers' error files, and its folder."""

    returncode: int
    errors: str
    out: Path


def own_job(out: Path, specs: list[RunSpec], nproc: int) -> Path:
    """A job of its own (a module's slow cases): ``specs`` on ``nproc`` gloo ranks in ``out``, which it returns;
    fails the test with the workers' error files unless every rank exits 0."""
    from dynmb.runtime.launch import launch_job
    from dynmb.runtime.spec import JobSpec

    rc = launch_job(JobSpec(out_dir=str(out.resolve()), cases=tuple(specs)), nproc, quiet=True).returncode
    errs = sorted((out / "errors").glob("*.txt")) if (out / "errors").exists() else []
    assert rc == 0, "\n".join(e.read_text() for e in errs)
    return out
