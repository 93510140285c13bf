"""Planning defaults: the microbatch order each method runs in, and the shipped cost models.

- ``AUTO_REORDER`` / ``reorder_for(method, reorder)``: under ``--reorder auto`` each method
  runs its microbatches in the order of the system it stands for. Megatron, DeepSpeed and
  fairseq do not reorder (``none``); DynaPipe searches permutations of cost clusters
  (``dynapipe``); dynmb's own method uses its simulator-guided search (``search``). See
  ``dynmb.planning.reorder`` for the passes.
- ``default_cost_model_path(model, stages, device)``: the fitted cost model shipped for that
  model preset, stage count and device kind (``<model>-p<stages>-<device>.json`` in the
  repository's ``data/costmodels/``, package data of a wheel: ``dynmb.data.shipped_dir``), or
  None when there is none (the analytic stand-in is used then).
- Stand-ins (re-exported from ``dynmb.costmodel.standin``): planning with an analytic stand-in
  instead of a fitted model is said once (``warn_stand_ins``), by the one loader
  ``dynmb.costmodel.loader.load_models``.
"""

from __future__ import annotations

import logging

from dynmb.costmodel.loader import shipped_cost_model_path
from dynmb.costmodel.standin import (StandInModelWarning, reset_stand_in_warnings, stand_ins_of,
                                     suppress_stand_in_warnings, warn_stand_ins)

__all__ = ["AUTO_REORDER", "reorder_for", "default_cost_model_path", "StandInModelWarning", "stand_ins_of",
           "warn_stand_ins", "suppress_stand_in_warnings", "reset_stand_in_warnings"]

log = logging.getLogger(__name__)

AUTO_REORDER = {"dynamic": "search", "dynapipe": "dynapipe"}
"""The reorder pass of each method under ``--reorder auto`` (``none`` for the others)."""



def reorder_for(method: str, reorder: str) -> str:
    """The reorder pass of ``method`` under ``--reorder`` (``auto``: see ``AUTO_REORDER``)."""
    return AUTO_REORDER.get(method, "none") if reorder == "auto" else reorder


def default_cost_model_path(model: str, stages: int, device: str = "cpu") -> str | None:
    """The shipped fitted cost model for (model, stages) on ``device`` ("cpu"/"cuda"), if there is one
    (``dynmb.costmodel.loader.shipped_cost_model_path``, the one place that knows)."""
    return shipped_cost_model_path(model, stages, device)
