"""``dynmb fit``: fit the cost model to profiled samples; print the k-fold held-out error next to
the measurement noise, and the coefficients."""

from __future__ import annotations

import argparse

from dynmb.cli.flags import add_model_flags, int_at_least, model_from_args, positive_int
from dynmb.costmodel import fit_cost_model, kfold_error, noise_floor
from dynmb.report.plots import cost_fit
from dynmb.measure.samples import check_samples_model, load_samples

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction, help_text: str) -> None:
    parser = subparsers.add_parser("fit", help=help_text)
    parser.add_argument("samples", nargs="+", help="samples CSV(s) from `dynmb profile` or a run's actions table")
    parser.add_argument("--kind", default="poly", help="poly (scipy least squares, default) or grid (interpolation)")
    add_model_flags(parser)
    parser.add_argument("--stages", type=positive_int, default=2, help="pipeline stages the samples were measured for")
    parser.add_argument("--folds", type=int_at_least(2), default=5, help="k for k-fold held-out error (default 5; at least 2: one fold fits, another is held out)")
    parser.add_argument("--plot", default=None, help="write a measured-vs-predicted PNG here")
    parser.add_argument("-o", "--output", required=True, help="cost-model JSON path")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    model = model_from_args(args)
    samples = load_samples(args.samples)
    check_samples_model(samples, model, args.stages, source=f"samples {', '.join(map(str, args.samples))}")
    fitted = fit_cost_model(samples, model, args.stages, kind=args.kind, folds=args.folds)
    errors = kfold_error(samples, args.kind, args.folds, model_cfg=model, num_stages=args.stages)
    table = errors.merge(noise_floor(samples), on=["stage", "op"], how="left")
    table["mape/noise"] = table["mape"] / table["noise"]
    print(f"{args.kind} cost model, {args.folds}-fold held-out error over points (vs point medians); "
          f"noise = median |t_r - median| / median over repeats")
    print(table.to_string(index=False, float_format=lambda x: f"{x:.4f}"))
    if hasattr(fitted, "coefficients"):
        print("coefficients: t = c0 + c1_tok*b*s + c2_tok_len*b*s^2 + c3_row*b  (seconds; b rows, s padded_len)")
        print(fitted.coefficients().to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    print(f"comm: {fitted.comm}")
    fitted.save(args.output)
    print(f"wrote {args.output}")
    if args.plot:
        cost_fit(samples, fitted, args.plot, errors=table)
        print(f"wrote {args.plot}")
    return 0
