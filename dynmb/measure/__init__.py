"""Measurements of any stage that keeps the stage contract -> samples tables for the fitted models.

- ``profiler``: ``profile(cfg, num_stages, ProfileSettings(...), output=)``: forward/backward (and
  split backward) times per stage over a grid of microbatch shapes, alone or one process per stage
  at once (``dynmb profile``).
- ``grid``: the grid's points and their synthetic microbatches; the analytic estimate of a run.
- ``timing``: ``time_stage``: one stage's ops timed on fresh graphs on the device's clock.
- ``eta``: the remaining time of a profile, calibrated on the runs measured so far.
- ``samples``: the samples table: rows, reading (``load_samples``), resuming, model checks.
- ``memory``: ``measure_stage_memory`` / ``measure_grid``: state, activation and peak bytes of one
  microbatch through one stage (``dynmb memory``).
- ``pingpong``: P2P one-way times between two local processes (``dynmb profile --comm``).

Device-specific calls go through ``dynmb.runtime.device``. The public names below load on first
use, so that ``import dynmb.measure`` imports no torch.
"""

from __future__ import annotations

import importlib

__all__ = ["profile", "ProfileSettings", "load_samples", "check_samples_model", "default_grid",
           "synthetic_microbatch", "estimate_run_seconds", "time_stage", "Eta", "measure_stage_memory",
           "measure_grid", "ping_pong", "GRID_ROWS", "GRID_LENS", "GRID_DOCS", "PACKED_ROWS", "PACKED_LENS",
           "MIN_DOC_TOKENS"]

_HOME = {"profile": "profiler", "ProfileSettings": "profiler", "load_samples": "samples",
         "check_samples_model": "samples", "default_grid": "grid", "synthetic_microbatch": "grid",
         "estimate_run_seconds": "grid", "time_stage": "timing", "Eta": "eta", "measure_stage_memory": "memory",
         "measure_grid": "memory", "ping_pong": "pingpong", "GRID_ROWS": "grid", "GRID_LENS": "grid",
         "GRID_DOCS": "grid", "PACKED_ROWS": "grid", "PACKED_LENS": "grid", "MIN_DOC_TOKENS": "grid"}


def __getattr__(name: str) -> object:
    if name in _HOME:
        return getattr(importlib.import_module(f"dynmb.measure.{_HOME[name]}"), name)
    raise AttributeError(f"module 'dynmb.measure' has no attribute {name!r}")
