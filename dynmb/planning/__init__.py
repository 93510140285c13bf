"""Planning one global batch: pack -> reorder -> schedule -> simulate.

- ``planner``: ``plan_step`` (what ``dynmb plan``, every rank of ``dynmb run`` and ``dynmb
  compare`` call, so the plan that is simulated is the plan that runs) and ``make_schedule``.
- ``replicas``: ``make_schedule`` (one replica's schedule, from the kind's record) and the one
  home of per-replica work: split a plan by replica, schedule and simulate each, stitch them back.
- ``slicing``: plans with slices of sequences longer than any row (``oversize='split'``).
- ``slice_fitting``: with ``slice_fitting='auto'`` plans that slice sequences which fit too, where faster.
- ``zerobubble``: the zero-bubble kinds' cost inputs and the simulator as their judge.
- ``reorder``: microbatch order passes (``none``, ``descending``, ``ascending``, ``ends``,
  ``dynapipe``, ``search``), pure ``Plan -> Plan``, scored by the simulator.
- ``defaults``: the auto reorder table and the shipped cost models.

This layer sits below the simulator (DESIGN.md "Layout"): it may use the packers, the
schedule builders and the simulator; nothing above it imports it.
"""

from __future__ import annotations

from dynmb.planning.defaults import AUTO_REORDER, default_cost_model_path, reorder_for
from dynmb.planning.planner import plan_step
from dynmb.planning.reorder import REORDER_METHODS
from dynmb.planning.replicas import make_schedule, predict_replicas, replica_of, replica_schedules, replicas_of, stitch

__all__ = ["plan_step", "make_schedule", "replica_of", "replicas_of", "replica_schedules", "predict_replicas",
           "stitch", "REORDER_METHODS", "AUTO_REORDER", "reorder_for", "default_cost_model_path"]
