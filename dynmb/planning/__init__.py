"""Planning one global batch: pack -> reorder -> schedule -> simulate.

- ``planner``: ``plan_step`` (what ``dynmb plan``, every rank of ``dynmb run`` and ``dynmb
  compare`` call, so the plan that is simulated is the plan that runs) and ``make_schedule``.
- ``reorder``: microbatch order passes (``none``, ``descending``, ``ascending``, ``ends``,
  ``dynapipe``, ``search``), pure ``Plan -> Plan``, scored by the simulator.
- ``defaults``: the auto reorder table and the shipped cost models.

This layer sits below the simulator (DESIGN.md "Layout"): it may use the packers, the
schedule builders and the simulator; nothing above it imports it.
"""

from __future__ import annotations

from .defaults import AUTO_REORDER, default_cost_model_path, reorder_for
from .planner import make_schedule, plan_step
from .reorder import REORDER_METHODS

__all__ = ["plan_step", "make_schedule", "REORDER_METHODS", "AUTO_REORDER", "reorder_for", "default_cost_model_path"]
