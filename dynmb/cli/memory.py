"""``dynmb memory``: measure activation and state bytes per stage on a (rows, padded_len) grid,
fit the memory model on three quarters of the points and print its error on the rest."""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd

from dynmb.io.atomic import atomic_path
from dynmb.cli.flags import add_model_flags, factory_from_args, positive_int
from dynmb.models.contract import planning_config
from dynmb.core.config import format_bytes
from dynmb.memory.model import MemoryModel
from dynmb.measure.memory import measure_grid
from dynmb.runtime.spec import check_device

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction, help_text: str) -> None:
    parser = subparsers.add_parser("memory", help=help_text)
    add_model_flags(parser)
    parser.add_argument("--stages", type=positive_int, default=2, help="pipeline stages (default 2)")
    parser.add_argument("--quick", action="store_true", help="a small grid")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cpu (storage accounting) or cuda (max_memory_allocated)")
    parser.add_argument("-o", "--output", required=True, help="memory-model JSON path")
    parser.add_argument("--samples", default=None, help="also write the measured samples CSV here")
    parser.set_defaults(func=run)


def _grid(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    """(rows, padded lengths) of the measured grid."""
    rows, lengths = ([1, 2, 4], [32, 64, 128, 256]) if args.quick else ([1, 2, 4, 8], [64, 128, 256, 512, 1024])
    if args.device == "cuda" and not args.quick:
        lengths += [2048, 4096]    # a GPU has the room: cover the long sequences the traces hold
    return rows, lengths


def run(args: argparse.Namespace) -> int:
    check_device("gloo", args.device)           # CUDA asked for where torch sees none: one line, no traceback
    factory = factory_from_args(args)
    model = planning_config(factory)
    rows, lengths = _grid(args)
    samples = pd.DataFrame(measure_grid(factory, args.stages, rows, lengths, device=args.device))
    points = sorted({(b, s) for b, s in zip(samples.rows, samples.padded_len)})
    pick = np.random.default_rng(0).choice(len(points), size=max(1, len(points) // 4), replace=False)
    held = {points[i] for i in pick}                       # a random quarter of the (rows, padded_len) points
    mask = np.array([(b, s) in held for b, s in zip(samples.rows, samples.padded_len)])
    fitted = MemoryModel.analytic(model, args.stages).fit(samples, holdout=mask)
    shapes = list(zip(samples.stage, samples.rows, samples.padded_len))
    samples["pred_act_bytes"] = [float(fitted.activation_bytes(st, b, s)[0]) for st, b, s in shapes]
    samples["pred_peak_bytes"] = [float(fitted.state_bytes[st] + fitted.activation_bytes(st, b, s)[0]
                                        + fitted.transient_bytes(st, b, s)[0]) for st, b, s in shapes]
    samples["heldout"] = mask
    print(f"dynmb memory: {model.name} at {args.stages} stages on {args.device}: {len(samples)} samples, "
          f"{int(mask.sum())} held out; states per stage {[format_bytes(x) for x in fitted.state_bytes]}")
    print(f"{'stage':>5} {'rows':>4} {'len':>5} {'act meas':>12} {'act pred':>12} {'err':>7} {'peak meas':>12} "
          f"{'peak pred':>12} {'err':>7}")
    for r in samples[samples.heldout].itertuples():
        print(f"{r.stage:>5} {r.rows:>4} {r.padded_len:>5} {r.act_bytes:>12} {r.pred_act_bytes:>12.0f} "
              f"{(r.pred_act_bytes - r.act_bytes) / r.act_bytes:>+7.2%} {r.peak_bytes:>12} {r.pred_peak_bytes:>12.0f} "
              f"{(r.pred_peak_bytes - r.peak_bytes) / r.peak_bytes:>+7.2%}")
    report = fitted.report
    print(f"held-out max relative error: act {report.get('act_heldout_max_rel_err', float('nan')):.3%}, "
          f"peak {report.get('peak_heldout_max_rel_err', float('nan')):.3%}")
    fitted.save(args.output)
    if args.samples:
        with atomic_path(args.samples) as tmp:
            samples.to_csv(tmp, index=False)
    print(f"wrote {args.output}" + (f" and {args.samples}" if args.samples else ""))
    return 0
