"""``dynmb datasets``: the shipped length traces with count, mean, median, p90, p99, max."""

from __future__ import annotations

import argparse
import json

from dynmb.data import data_dir, datasets_table

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction, help_text: str) -> None:
    parser = subparsers.add_parser("datasets", help=help_text)
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    table = datasets_table()
    if table.empty:
        raise ValueError(f"no shipped length traces in {data_dir()} (set DYNMB_DATA_DIR?)")
    if args.json:
        print(json.dumps(table.to_dict(orient="records")))
    else:
        print(table.to_string(index=False, formatters={c: "{:.1f}".format for c in ("mean", "median", "p90", "p99")}))
    return 0
