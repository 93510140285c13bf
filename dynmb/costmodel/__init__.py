"""Per-stage, per-op time model: the one cost lookup shared by packer, scheduler and simulator.

Modules, one way up (each imports only those above it):

- ``nnls``: the relative-error non-negative least-squares solver every fit uses.
- ``samples``: the tidy samples table (``dynmb profile``, or a run's ``actions``): per-point
  medians, the repeat noise.
- ``p2pfit``: what a running pipeline pays between its actions that the simulator does not
  know (the wait of a receive beyond the P2P model, the gap before an action), from its actions.
- ``calibration``: a running pipeline's speed against the model (scale per stage and op,
  overhead and gap per action, wait per received message), fitted on the steps a job has
  measured so far.
- ``base``: ``CostModelLike`` (the ``typing.Protocol`` consumers use), ``CommModel`` (P2P
  ``alpha_s + nbytes / bytes_per_s``, and the calibrated ``recv_latency_s`` of a receiving action) and ``CostModel`` (the lookup ``predict`` /
  ``stage_costs`` / ``plan_costs`` / ``comm_s``, config checks, JSON I/O of any kind).
- three kinds: ``analytic`` (``AnalyticCostModel``: FLOPs / flops_per_s + overhead, the stand-in
  before profiling), ``poly`` (``FittedCostModel``, the default: a non-negative polynomial in
  rows, padded_len and attention work per (stage, op), form chosen by held-out error), ``grid``
  (``GridCostModel``: DynaPipe-style bilinear interpolation of measured times, with a linear
  correction for packed rows); ``gpu`` (``GPUCostModel``: FLOPs at published GPU peaks and
  shape-dependent efficiencies, for simulated scaling studies).
- ``registry``: kind -> class, ``get_cost_model``, ``fit_cost_model``,
  ``kfold_error``.
- ``refit``: the online refit of a poly model's coefficients per (stage, op) from a job's measured
  actions, the fit as the prior (``job_refit``).
- ``standin`` and ``loader``: the ONE loader of the cost and memory models of a model, layout and
  device (``load_models`` -> ``PredictionModels``: file, shipped fit, or the stand-in said once), and
  what a plan records about them (``models_record``: digests, calibrated, refit version).

Every public name is importable from ``dynmb.costmodel``.
"""

from __future__ import annotations

from dynmb.costmodel.analytic import AnalyticCostModel
from dynmb.costmodel.base import CommModel, CostModelLike, CostModel
from dynmb.costmodel.grid import GridCostModel
from dynmb.costmodel.gpu import GPUCostModel, GPUSpec, H100_SXM, LINKS
from dynmb.costmodel.nnls import nnls_rel
from dynmb.costmodel.poly import COEFS, FORMS, FittedCostModel
from dynmb.costmodel.registry import COST_MODEL_KINDS, FIT_KINDS, fit_cost_model, get_cost_model, kfold_error
from dynmb.costmodel.calibration import (OVERHEAD_MIN_ACTIONS, OVERHEAD_SMALL_S, RECENT_STEPS, SCALE_MIN_PRED_S, CalibrationStep,
                          RuntimeCalibration, job_calibration, runtime_calibration)
from dynmb.costmodel.samples import noise_floor, point_medians, samples_from_actions, with_attention_work
from dynmb.costmodel.refit import RefitSettings, job_refit
from dynmb.costmodel.loader import PredictionModels, load_models, models_record

__all__ = [
    "CostModelLike", "CommModel", "CostModel", "AnalyticCostModel", "FittedCostModel", "GridCostModel",
    "GPUCostModel", "GPUSpec", "H100_SXM", "LINKS",
    "FORMS", "COEFS", "COST_MODEL_KINDS", "FIT_KINDS",
    "get_cost_model", "fit_cost_model", "kfold_error",
    "noise_floor", "point_medians", "samples_from_actions", "with_attention_work", "RuntimeCalibration",
    "runtime_calibration", "job_calibration", "CalibrationStep", "SCALE_MIN_PRED_S", "OVERHEAD_SMALL_S",
    "OVERHEAD_MIN_ACTIONS", "RECENT_STEPS", "nnls_rel", "RefitSettings", "job_refit", "PredictionModels",
    "load_models", "models_record",
]
