"""Factories that break the stage contract, for the launcher's preflight tests (``--model tests.bad_factories:NAME``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dynmb.core.config import model_config
from dynmb.models.families import family_factory


def raising() -> Any:
    """A factory whose call raises (not a ``ValueError``)."""
    raise RuntimeError("the checkpoint shard is missing")


@dataclass
class _NotStages:
    """Keeps the factory's attributes, but ``build_stage`` returns a plain dict."""

    config: Any
    attention_work: str = "document"

    def build_stage(self, stage: int, num_stages: int, *, seed: int = 0, dtype: Any = None, device: Any = None) -> Any:
        return {"stage": stage}


def not_stages() -> Any:
    return _NotStages(model_config("tiny"))


def tiny() -> Any:
    """dynmb's own tiny GPT, through the factory door."""
    return family_factory(model_config("tiny"))


def slow_on_rank1() -> Any:
    """dynmb's tiny GPT whose stages take 40 s to build on rank 1 (``RANK`` 1 of a torchrun job)."""
    import os
    import time

    factory = family_factory(model_config("tiny"))
    if os.environ.get("RANK") == "1":
        time.sleep(40)
    return factory
