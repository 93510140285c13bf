"""What a plan file carries beyond its microbatches, and how the verbs that read a plan take it.

``dynmb plan`` records in the plan (``Plan.meta``) the resolved model config (every field, never a
path: editing a model file later does not change what the plan means; a model of the user's own
also its ``package.module:factory``) and the identity of the cost
and memory models it was planned with (``{"path", "sha256"}`` of the file, or ``{"kind":
"analytic"}`` for the stand-in); ``Plan.spec`` holds the planning settings (method, kind, reorder,
limit, dp, mbs, pack length, round-to, oversize, recompute, attention).

``dynmb schedule``, ``dynmb simulate`` and ``dynmb run --plan`` then take every one of these from
the plan when the flag is absent (``plan_models``). A flag that says otherwise is refused with one
line naming the flag, the plan and the plan's value; a recorded model file whose bytes changed since
planning is refused the same way (plan again, or pass the file that was used).
"""

from __future__ import annotations

import argparse
import hashlib
from dataclasses import replace
from pathlib import Path
from typing import Any

from dynmb.cli.flags import names_factory
from dynmb.core.config import ModelConfig, model_config
from dynmb.costmodel.loader import STAND_IN, PredictionModels, check_plan_models, load_models, spec_models
from dynmb.costmodel.standin import suppress_stand_in_warnings
from dynmb.core.types import Plan

__all__ = ["model_identity", "plan_meta", "plan_model", "plan_models", "recorded_model_file", "plan_pack_len",
           "refuse_split_conflict"]


def plan_pack_len(plan: Plan) -> int | None:
    """The row length a ``packed`` plan was built with: ``meta["pack_len"]``, or, for a plan with
    slices (whose meta has none: its rows are the longest row, ``meta["longest_fitting_length"]``,
    the pack length rounded), that; None for the other methods."""
    if plan.method != "packed":
        return None
    value = plan.meta.pack_len or plan.meta.longest_fitting_length or (
        plan.spec.pack_len if plan.spec is not None else None)
    return None if value is None else int(value)


def model_identity(path: str | None) -> dict[str, Any]:
    """``{"path", "sha256"}`` of a cost- or memory-model file, ``{"kind": "analytic"}`` without one."""
    if path is None or path == STAND_IN:
        return {"kind": "analytic"}
    try:
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as e:
        raise ValueError(f"{path}: cannot read the model file ({e.strerror or e})") from None
    return {"path": str(Path(path).resolve()), "sha256": digest}


def plan_meta(model: ModelConfig, models: PredictionModels, factory: str | None = None) -> dict[str, Any]:
    """The ``Plan.meta`` entries ``dynmb plan`` records (module docstring): the model and the files of its
    ``models`` (``model_identity``); ``factory``: the ``package.module:factory`` of a model of the user's own,
    which a run of the plan builds."""
    return {"model": model.to_dict(), "cost_model": model_identity(models.cost_path),
            "memory_model": model_identity(models.memory_path), **({"model_factory": factory} if factory else {})}


def plan_model(plan: Plan, args: argparse.Namespace, plan_path: str) -> ModelConfig:
    """The plan's model config (its recorded fields, or a recorded preset name from an older plan);
    ``--model`` / ``--attention`` must agree with it (one-line ``ValueError`` otherwise)."""
    recorded = plan.meta.model
    if isinstance(recorded, dict):
        model = ModelConfig.from_dict(recorded)
    elif recorded:
        model = model_config(str(recorded))
    else:
        model = model_config(getattr(args, "model", None) or "small")
    if plan.spec is not None and plan.spec.attention is not None and model.attention != plan.spec.attention:
        model = replace(model, attention=plan.spec.attention)
    flag_model = getattr(args, "model", None)
    factory = plan.meta.model_factory
    if flag_model is not None and (factory or names_factory(flag_model)):
        if flag_model != factory:
            raise ValueError(f"--model {flag_model} conflicts with the plan {plan_path}, which was planned for model "
                             f"{factory or model.name!r}; leave --model out to use the plan's")
    elif flag_model is not None and isinstance(recorded, (dict, str)) and recorded:
        given = model_config(flag_model, attention=model.attention)
        if given.architecture() != model.architecture():
            raise ValueError(f"--model {flag_model} conflicts with the plan {plan_path}, which was planned for model "
                             f"{model.name!r}; leave --model out to use the plan's")
    attention = getattr(args, "attention", None)
    if attention is not None and attention != model.attention:
        raise ValueError(f"--attention {attention} conflicts with the plan {plan_path}, which was planned with "
                         f"attention {model.attention}; leave --attention out to use the plan's")
    return model


def recorded_model_file(kind: str, flag: str | None, recorded: Any, plan_path: str) -> str | None:
    """The cost/memory model file to use: the flag's, which must be the recorded one, else the recorded one."""
    if not isinstance(recorded, dict):                    # an older plan: no record, the flag decides
        return flag
    if flag is not None:
        if model_identity(flag) != recorded:
            theirs = recorded.get("path") or "the analytic stand-in"
            raise ValueError(f"--{kind} {flag} conflicts with the plan {plan_path}, which was planned with {theirs}; "
                             f"leave --{kind} out to use the plan's")
        return flag
    path = recorded.get("path")
    if path is None:                                      # the analytic stand-in: asked for by name
        return STAND_IN if recorded.get("kind") == STAND_IN and kind == "cost-model" else None
    if not Path(path).is_file() or model_identity(path) != recorded:
        raise ValueError(f"the plan {plan_path} was planned with {kind} {path}, which is missing or has changed "
                         f"since (sha256 {str(recorded.get('sha256'))[:12]}); plan again or pass --{kind}")
    return path


def plan_models(plan: Plan, args: argparse.Namespace, plan_path: str) -> tuple[ModelConfig, PredictionModels]:
    """The model config and the cost and memory models a plan was made with (module docstring), through the
    one loader (``dynmb.costmodel.loader``); a plan that names the stand-in gets the stand-in, and the models
    loaded must have the digests the plan recorded (``Plan.meta.models``) unless it was planned with a
    calibrated model (a run's): then its predictions are made again with the uncalibrated one."""
    model = plan_model(plan, args, plan_path)
    recorded = plan.meta.cost_model
    cost_file = recorded_model_file("cost-model", getattr(args, "cost_model", None), recorded, plan_path)
    memory_file = recorded_model_file("memory-model", getattr(args, "memory_model", None), plan.meta.memory_model,
                              plan_path)
    cost = STAND_IN if cost_file is None and not isinstance(recorded, dict) else cost_file   # an older plan
    with suppress_stand_in_warnings():                    # the plan's models: said when it was planned
        models = load_models(model, plan.num_stages, cost=cost, memory=memory_file)
    if plan.spec is not None:                             # the embedding's place and the states' shards it planned with
        models = spec_models(models, plan.spec)
    check_plan_models(plan.meta.models, models, plan_path)
    return model, models


def refuse_split_conflict(args: argparse.Namespace, plan: Plan, model: ModelConfig) -> None:
    """``--stage-split`` with ``--plan``: only the plan's own split (one ``ValueError`` line otherwise)."""
    given = getattr(args, "stage_split", None)
    if given is None:
        return
    from dynmb.planning.stage_split import resolve_stage_split

    theirs = ",".join(f"{v:g}" for v in model.layer_split) if model.layer_split else "even"
    if given != "auto":
        asked = resolve_stage_split(replace(model, layer_split=None, head_split=None, recompute_blocks=None),
                                    plan.num_stages, given)
        if asked.layer_split == model.layer_split:
            return
    raise ValueError(f"--stage-split {given} conflicts with the plan {args.plan}, which has stage split {theirs}; "
                     "leave the flag out to run the plan as it is")
