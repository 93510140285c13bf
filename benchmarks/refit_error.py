"""Held-out action error of the online cost-model refit, by token bucket, on a recorded compare.

Replays a ``dynmb compare`` results folder step by step in the order its steps ran (the ``steps`` table's
row order, which rank 0 writes as they finish): every F / B action of step k is predicted by

- ``prior``: the cost model the job was planned with, uncalibrated (the actions' ``raw_pred_s``);
- ``scale``: the runtime calibration that ran (one scale per (stage, op) and overheads: ``pred_s``);
- ``refit``: ``dynmb.costmodel.refit.job_refit`` of the prior on the steps before k only,

and the absolute relative error against the measured ``end_s - start_s`` is summarised per bucket of
computed tokens (``TOKEN_BUCKETS``): mean (MAPE), median, and the median measured / predicted ratio.
The first ``--skip`` steps (the job's first round, which has no history) are left out.

    dynmb compare --methods fixed,token-budget,balanced,dynamic --steps 6 --out /tmp/cmp
    python benchmarks/refit_error.py /tmp/cmp --cost-model data/costmodels/small-p2-cpu.json

Not a timed test: a study of prediction error on one machine's recorded actions (say whether that box
was loaded).
"""

from __future__ import annotations

import argparse
import json
import logging

import numpy as np
import pandas as pd

from dynmb import load_results
from dynmb.costmodel import CostModel
from dynmb.costmodel.refit import TOKEN_BUCKETS, RefitSettings, job_refit, refit_actions, token_bucket

log = logging.getLogger("refit_error")


class _Step:
    """One history step as ``job_refit`` reads it."""

    def __init__(self, actions: pd.DataFrame) -> None:
        self.actions = actions


def replay(actions: pd.DataFrame, order: list[tuple[str, int]], prior: CostModel,
           settings: RefitSettings) -> pd.DataFrame:
    """Every F / B action of every step after the first with its three predictions (module doc)."""
    by_step = {key: g for key, g in actions.groupby(["run_id", "step"])}
    history: list[_Step] = []
    rows = []
    for key in order:
        g = by_step.get(key)
        if g is None:
            continue
        model = job_refit(prior, history, settings=settings)
        fb = g[g["op"].isin(("F", "B"))]
        refit = np.empty(len(fb))
        for i, (stage, op, b, s, a) in enumerate(fb[["stage", "op", "batch", "padded_len", "attn_work"]].itertuples(
                index=False)):
            refit[i] = float(model.predict(int(stage), str(op), b, s, a))
        rows.append(fb.assign(refit_s=refit, history=len(history), measured_s=fb["end_s"] - fb["start_s"]))
        history.append(_Step(g))
    return pd.concat(rows, ignore_index=True)


def summary(rep: pd.DataFrame, skip: int) -> pd.DataFrame:
    """Per token bucket: actions, and per predictor the MAPE, median APE and median measured / predicted."""
    rep = rep[rep["history"] >= skip]
    rep = rep.assign(bucket=token_bucket(rep["batch"] * rep["padded_len"]))
    names = [f"<={e}" for e in TOKEN_BUCKETS] + [f">{TOKEN_BUCKETS[-1]}"]
    out = []
    for k, g in [*rep.groupby("bucket"), ("all", rep)]:
        row = {"tokens": names[int(k)] if k != "all" else "all", "actions": len(g)}
        for name, col in (("prior", "raw_pred_s"), ("scale", "pred_s"), ("refit", "refit_s")):
            ape = np.abs(g[col] - g["measured_s"]) / g["measured_s"]
            row[f"{name}_mape"] = float(ape.mean())
            row[f"{name}_median_ape"] = float(ape.median())
            row[f"{name}_ratio"] = float((g["measured_s"] / g[col]).median())
        out.append(row)
    return pd.DataFrame(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="a dynmb compare results folder (steps and actions tables)")
    ap.add_argument("--cost-model", required=True, help="the cost-model JSON the compare planned with")
    ap.add_argument("--skip", type=int, default=13, help="history steps before an action is scored (default 13)")
    ap.add_argument("--half-life", type=float, default=RefitSettings().half_life_steps)
    ap.add_argument("--prior-weight", type=float, default=RefitSettings().prior_weight)
    ap.add_argument("--json", action="store_true", help="print the table as JSON records")
    args = ap.parse_args()
    tables = load_results(args.results)
    order = list(tables["steps"][["run_id", "step"]].itertuples(index=False, name=None))
    settings = RefitSettings(half_life_steps=args.half_life, prior_weight=args.prior_weight)
    table = summary(replay(tables["actions"], order, CostModel.load(args.cost_model), settings), args.skip)
    n = len(refit_actions([tables["actions"]]))
    log.info("%d F/B actions in %d steps", n, len(order))
    if args.json:
        print(json.dumps(table.to_dict(orient="records")))
    else:
        print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))


if __name__ == "__main__":
    main()
