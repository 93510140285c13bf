"""Moved to ``dynmb.planning`` (``dynmb.planning.planner``); this alias stays until every importer
has switched (RESHAPE_MOVES.md), then it goes."""

from __future__ import annotations

from dynmb.planning.planner import make_schedule, plan_step

__all__ = ["plan_step", "make_schedule"]
