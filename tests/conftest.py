"""Shared fixtures: one torchrun job per rank count for the modules' gloo cases (``tests/gloo_jobs.py``)."""

from __future__ import annotations

from typing import Callable

import pytest

from dynmb.runtime.launch import launch_job
from dynmb.runtime.spec import JobSpec
from tests.gloo_jobs import PROVIDERS, GlooJob


@pytest.fixture(scope="session")
def gloo_job(tmp_path_factory) -> Callable[[int], GlooJob]:
    """``gloo_job(nproc)``: run (once per session) every case registered for ``nproc`` ranks in one job."""
    done: dict[int, GlooJob] = {}

    def get(nproc: int) -> GlooJob:
        if nproc not in done:
            out = tmp_path_factory.mktemp(f"gloo{nproc}")
            specs = [spec for provider in PROVIDERS.get(nproc, []) for spec in provider(out)]
            rc = launch_job(JobSpec(out_dir=str(out.resolve()), cases=tuple(specs)), nproc, quiet=True).returncode
            errs = sorted((out / "errors").glob("*.txt")) if (out / "errors").exists() else []
            done[nproc] = GlooJob(rc, "\n".join(e.read_text() for e in errs), out)
        return done[nproc]

    return get
