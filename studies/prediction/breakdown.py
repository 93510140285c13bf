"""Where a case's step-time prediction goes wrong, from a recorded ``dynmb compare`` folder.

Per case (the ``steps`` label), over its measured steps (medians):

1. **steps**: microbatches, ``pred_err`` = pred_step_s / step_s - 1 (signed; negative = predicted
   too fast), split into the simulator's part ``replay_err`` = replay_step_s / step_s - 1 (the
   schedule replayed with every action's measured time: what the simulator leaves out, P2P waits,
   gaps between actions, the step's tail) and the action times' part ``action_err`` =
   pred_step_s / replay_step_s - 1;
2. **actions by shape**: Σ measured / Σ pred_s (the calibrated prediction the step used) of the
   actions predicted at 20 ms or more, per op and rows-per-microbatch bucket (1, 2-4, 5+), and
   packed (documents > rows) or not;
3. **shapes within a step**: the same ratio per action, as log(measured / pred_s) minus its
   step's mean for that op, averaged per shape class over every case (the machine's speed
   drifts between steps by far more than shapes differ; within a step it is one speed), as a
   factor;
4. **between actions**: the mean unexplained receive wait (``costmodel.p2pfit.receive_waits``:
   the wait beyond the sender's end plus the model's P2P time, clock offset removed), the share
   of receives that waited over 5 ms, the median gap before an ``F`` (``p2pfit.action_gaps``),
   and the step's tail (step_s minus the last action's end).

    python -m studies.prediction.breakdown results/compare [more] [--out table.csv]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from dynmb.costmodel import get_cost_model
from dynmb.costmodel.p2pfit import action_gaps, receive_waits
from dynmb.io.results import load_results

from studies.prediction.calibration_study import model_from_runs


def _steps(steps: pd.DataFrame) -> pd.DataFrame:
    s = steps[~steps["warmup"].astype(bool)]
    out = pd.DataFrame({"label": s["label"], "microbatches": s["num_microbatches"],
                        "pred_err": s["pred_step_s"] / s["step_s"] - 1,
                        "replay_err": s["replay_step_s"] / s["step_s"] - 1,
                        "action_err": s["pred_step_s"] / s["replay_step_s"] - 1})
    return out.groupby("label").median()


def _shapes(actions: pd.DataFrame) -> pd.DataFrame:
    a = actions[actions["op"].isin(("F", "B")) & (actions["pred_s"] >= 0.02)]
    a = a.assign(measured=a["end_s"] - a["start_s"],
                 rows=pd.cut(a["batch"], [0, 1, 4, np.inf], labels=["1", "2-4", "5+"]),
                 packed=np.where(a["docs"] > a["batch"], "packed", "one doc/row"))
    g = a.groupby(["label", "op", "rows", "packed"], observed=True)
    return pd.DataFrame({"actions": g.size(), "measured/pred": g["measured"].sum() / g["pred_s"].sum()})


def _within(actions: pd.DataFrame) -> pd.DataFrame:
    a = actions[actions["op"].isin(("F", "B")) & (actions["pred_s"] >= 0.02)]
    a = a.assign(y=np.log((a["end_s"] - a["start_s"]) / a["pred_s"]),
                 rows=pd.cut(a["batch"], [0, 1, 4, np.inf], labels=["1", "2-4", "5+"]),
                 packed=np.where(a["docs"] > a["batch"], "packed", "one doc/row"))
    a = a.assign(y=a["y"] - a.groupby(["run_id", "step", "op"])["y"].transform("mean"))
    g = a.groupby(["op", "rows", "packed"], observed=True)["y"]
    return pd.DataFrame({"actions": g.size(), "factor": np.exp(g.mean()), "se": g.std() / np.sqrt(g.size())})


def _between(actions: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for (label, step), acts in actions.groupby(["label", "step"]):
        st = steps[(steps["label"] == label) & (steps["step"] == step)].iloc[0]
        if bool(st["warmup"]):
            continue
        waits, gaps = receive_waits(acts), action_gaps(acts)
        rows.append({"label": label, "wait_ms": 1e3 * waits.mean(), "waited_over_5ms": (waits > 0.005).mean(),
                     "gap_F_ms": 1e3 * gaps.loc[gaps["op"] == "F", "gap_s"].median(),
                     "tail_ms": 1e3 * (st["step_s"] - acts["end_s"].max())})
    return pd.DataFrame(rows).groupby("label").median()


def breakdown(folder: Path) -> dict[str, pd.DataFrame]:
    t = load_results(folder)
    steps, actions, runs = t["steps"], t["actions"], t["runs"]
    run = runs.iloc[0]
    path = run.get("cost_model")
    num_stages = int(steps["num_stages"].iloc[0])
    cost_model = get_cost_model(None if pd.isna(path) or not path else str(path), model_from_runs(run), num_stages)
    label = steps.set_index("run_id")["label"].groupby(level=0).first()
    actions = actions.assign(label=actions["run_id"].map(label),
                             comm_s=cost_model.comm_s(actions["batch"].to_numpy(), actions["padded_len"].to_numpy()))
    return {"steps": _steps(steps), "shapes": _shapes(actions), "within": _within(actions),
            "between": _between(actions, steps)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="write the steps and between-actions tables as one CSV")
    args = ap.parse_args(argv)
    pd.set_option("display.width", 200)
    tables = []
    for folder in args.folders:
        b = breakdown(folder)
        print(f"== {folder}\nsteps (medians over measured steps; errors signed, negative = predicted too fast):")
        print(b["steps"].round(3).to_string())
        print("\nactions: sum measured / sum calibrated prediction, by op, rows per microbatch, packing:")
        print(b["shapes"]["measured/pred"].unstack(["op", "rows", "packed"]).round(3).to_string())
        print("\nshapes within a step (factor on the step's own ratio, every case; se of its log):")
        print(b["within"].round(3).to_string())
        print("\nbetween actions (medians over measured steps):")
        print(b["between"].round(2).to_string())
        tables.append(b["steps"].join(b["between"]).assign(folder=folder.name))
    if args.out:
        pd.concat(tables).to_csv(args.out)


if __name__ == "__main__":
    main()
