"""``dynmb plan``: pack one global batch into microbatches under a memory limit; print a summary (with
``--virtual auto`` the chunks per GPU chosen once first, ``cli.flags.with_virtual_choice``; with ``--embedding auto``,
the default under ``--stage-split auto``, the embedding's place chosen on the workload's sample batches, whatever
``--step`` is, as ``dynmb run`` chooses it: ``cli.flags.with_embedding_choice``)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

from dynmb.cli.flags import (add_data_flags, add_model_flags, add_packing_flags, add_state_shards_flag, load_rows,
                             model_from_args, names_factory, nonnegative_int, spec_from_flags, virtual_arg,
                             warn_own_model_stand_ins, with_virtual_choice, embedding_pending, with_embedding_choice,
                             workload_of)
from dynmb.cli.planfile import plan_meta, plan_pack_len
from dynmb.core.config import ModelConfig, PlanSpec, format_bytes
from dynmb.costmodel.loader import load_models
from dynmb.planning.embedding_choice import Workload
from dynmb.planning import plan_step
from dynmb.planning.spec_check import check_plan_spec
from dynmb.planning.virtual_search import describe
from dynmb.core.types import Plan

__all__ = ["add_parser", "run", "plan_spec"]


def add_parser(subparsers: argparse._SubParsersAction, help_text: str) -> None:
    parser = subparsers.add_parser("plan", help=help_text)
    add_data_flags(parser)
    add_packing_flags(parser)
    add_state_shards_flag(parser)
    add_model_flags(parser)
    parser.add_argument("--virtual", type=virtual_arg, default=1,
                        help="model chunks per GPU for interleaved (default 1; --stages counts chunks), or auto: "
                             "--stages counts the GPUs of one pipeline and V (1, 2 or 4) is chosen once by simulated "
                             "step on sample batches of --dataset/--lengths, as Planner(virtual='auto') does (needs "
                             "--global-batch, a layout-free --cost-model and --schedule auto or interleaved; "
                             "else V 1, said once)")
    parser.add_argument("--reorder", default="auto",
                        help="microbatch order pass before the plan is written (default auto: each method's own "
                             "order, as Planner, run and compare plan; none keeps the packer's order)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="which shipped cost model to plan with when --cost-model is not given (default cpu)")
    parser.add_argument("--step", type=nonnegative_int, default=0, help="which global batch of the seed's stream (default 0)")
    parser.add_argument("-o", "--output", default=None, help="plan JSON path")
    parser.add_argument("--json", action="store_true", help="print a one-line JSON summary")
    parser.set_defaults(func=run)


def plan_spec(args: argparse.Namespace, model: ModelConfig) -> PlanSpec:
    """The ``PlanSpec`` of ``dynmb plan``'s flags (``cli.flags.spec_from_flags``; its errors name the field)."""
    return spec_from_flags(args, model)


def _summary(plan: Plan, args: argparse.Namespace, attention: str) -> dict[str, Any]:
    choice = getattr(args, "virtual_choice", None)
    placed = getattr(args, "embedding_choice", None)
    return {
        "method": plan.method, "schedule_kind": plan.schedule_kind, "num_stages": plan.num_stages,
        "virtual": int(getattr(args, "virtual", 1) or 1),
        **({"virtual_choice": describe(choice)} if choice is not None else {}),
        "embedding": plan.spec.embedding if plan.spec is not None else "first",
        **({"embedding_choice": placed.describe()} if placed is not None else {}), "num_sequences": plan.num_sequences,
        "num_microbatches": plan.num_microbatches,
        "real_tokens": plan.real_tokens, "computed_tokens": plan.computed_tokens,
        "padding_fraction": round(plan.padding_fraction, 6),
        "memory_limit_bytes": plan.memory_limit_bytes,
        "pred_peak_bytes": plan.predictions["pred_peak_bytes"],
        "pred_step_s": plan.predictions["pred_step_s"], "mean_bubble": plan.predictions["mean_bubble"],
        "plan_s": plan.predictions["plan_s"], "mbs": plan.meta.mbs,
        "dropped": len(plan.meta.dropped or []), "truncated": len(plan.meta.truncated or []),
        "recomputed": int(plan.recompute_mask().sum()),
        "sliced": len(plan.slice_groups()), "slices": sum(len(w) for w in plan.slice_groups().values()),
        "longest_fitting_length": plan.meta.longest_fitting_length,
        "slice_threshold": plan.meta.slice_threshold,
        "pack_len": plan_pack_len(plan), "round_to": args.round_to, "attention": attention,
        "distinct_shapes": len({(mb.batch, mb.padded_len) for mb in plan.microbatches}),
    }


def _show(key: str, value: Any) -> str:
    """One printed value: sizes in GiB/MiB, seconds and fractions fixed-point, lists item by item
    (never ``1.33e+03`` or ``np.int64(...)``); ``--json`` keeps the raw numbers."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(key, v) for v in value) + "]"
    if value is None or isinstance(value, (bool, str)):
        return str(value)
    if key.endswith("_bytes"):
        return format_bytes(float(value))
    if isinstance(value, float) or hasattr(value, "dtype") and getattr(value.dtype, "kind", "") == "f":
        v = float(value)
        return f"{v:.3f}" if key.endswith("_s") else f"{v:.4f}"
    return str(int(value)) if hasattr(value, "dtype") else str(value)


def run(args: argparse.Namespace) -> int:
    args = with_virtual_choice(embedding_pending(args))      # --virtual auto: V chosen once; --stages then P V
    if args.embedding_auto:                # --embedding auto: the place chosen on the workload's sample batches
        args = with_embedding_choice(args, Workload(workload_of(args), args.global_batch, args.seed),
                                     device=args.device)
    model = model_from_args(args)
    spec = plan_spec(args, model)
    check_plan_spec(spec)                  # what run and compare refuse too, before any batch is read
    rows, batch = load_rows(args, args.step)
    if len(batch) < spec.dp:               # the real cause, not the memory limit the packer would blame
        raise ValueError(f"--global-batch {len(batch)} is smaller than --dp {spec.dp}: every data-parallel replica "
                         "needs at least one sequence of the global batch")
    own = names_factory(args.model)
    warn_own_model_stand_ins(args, model, args.cost_model, args.memory_model, args.stages, "dynmb plan")
    models = load_models(model, args.stages, cost=args.cost_model, memory=args.memory_model, virtual=spec.virtual,
                         device=args.device, own_model=own, who="dynmb plan")    # the one loader, as Planner's
    plan, _, _ = plan_step(
        batch, spec, model_cfg=model, models=models,
        meta={"dataset": args.dataset or args.lengths, "seed": args.seed, "step": args.step,
              **plan_meta(model, models, factory=args.model if own else None)},
    )
    plan = replace(plan, dataset_ids=tuple(rows.tolist()))   # the trace rows of its sequences
    if args.output:
        plan.save(args.output)
    summary = _summary(plan, args, model.attention)
    if args.json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            print(f"{key:>20}: {_show(key, value)}")
        if args.output:
            print(f"{'plan':>20}: {args.output}")
    return 0
