"""Why the real 2x2 runs put lockstep level with ``packed`` where the planner predicted 0.93 (issue 38, part B).

    python studies/lockstep/real_actions.py studies/lockstep/results/real_idle --cores 2

Reads the runs ``real_runs.py`` wrote (``<method>_<round>/actions.csv`` and ``steps.csv``; the warm-up step left
out) and prints, per method:

1. per stage, op and row class (``lone``: one document in the row, priced at ``T^2`` attention; ``multi``: packed
   rows, ``sum s^2``): the ops' measured wall seconds, their CPU seconds (``cpu_s``), the shipped fit's prediction
   (``raw_pred_s``) and the online refit's (``pred_s``), summed;
2. per step, the measured step against the step's CPU work spread over the box's cores (``sum cpu_s / cores``):
   a box of fewer cores than ranks runs the ranks' work in turn, so an idle rank's core goes to a busy one;
3. each method's step, summed over its measured steps, over ``packed``'s and in-order's, measured and re-predicted
   from the runs' own rows: the 1F1B makespan of every replica's ops (the slowest replica; the P2P of the fit's
   ``comm``) priced by the shipped fit, by the refit, by the op's own measured CPU and wall seconds, and the
   shared-core work ``sum / cores`` of the fit's and the measured CPU seconds;
4. each run's summed step and CPU work over the baseline run of its own round.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from dynmb.costmodel import CostModel
from dynmb.timing.makespan import makespan

PRICES = {"fit": "raw_pred_s", "refit": "pred_s", "cpu": "cpu_s", "wall": "wall_s"}
"""The op prices the re-prediction uses (columns of the actions table; ``wall_s`` = end - start)."""


def load(folder: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(actions, steps) of every ``<method>_<round>`` run of ``folder``, measured steps only."""
    acts, steps = [], []
    for run in sorted(p for p in folder.iterdir() if (p / "actions.csv").exists()):
        method = run.name.rsplit("_", 1)[0]
        a, s = pd.read_csv(run / "actions.csv"), pd.read_csv(run / "steps.csv")
        measured = set(s.loc[~s.warmup.astype(bool), "step"])
        acts.append(a[a.step.isin(measured)].assign(method=method, run=run.name))
        steps.append(s[s.step.isin(measured)].assign(method=method, run=run.name))
    if not acts:
        raise SystemExit(f"real_actions: no <method>_<round>/actions.csv under {folder}")
    a = pd.concat(acts, ignore_index=True)
    a["wall_s"] = a.end_s - a.start_s
    a["row_class"] = np.where(a.docs > a.batch, "multi", "lone")
    return a, pd.concat(steps, ignore_index=True)


def per_op(a: pd.DataFrame) -> pd.DataFrame:
    """Table 1: per method, stage, op, row class."""
    t = a.groupby(["method", "stage", "op", "row_class"]).agg(
        ops=("wall_s", "size"), wall_s=("wall_s", "sum"), cpu_s=("cpu_s", "sum"), fit_s=("raw_pred_s", "sum"),
        refit_s=("pred_s", "sum"), attn_work=("attn_work", "mean"))
    return t.assign(cpu_over_fit=t.cpu_s / t.fit_s, wall_over_cpu=t.wall_s / t.cpu_s).reset_index()


def comm_seconds(folder: Path, a: pd.DataFrame) -> pd.Series:
    """P2P seconds of every action's microbatch by the runs' fitted model's ``comm`` (alpha + its hidden state's
    bytes / bandwidth); 0 where the model file is not found (run from the repository root)."""
    path = Path(json.loads(next(folder.glob("*/spec.json")).read_text())["run"]["cost_model"])
    if not path.exists():
        return pd.Series(0.0, index=a.index)
    comm = CostModel.load(path).comm_s(a.batch.to_numpy(), a.padded_len.to_numpy())
    return pd.Series(np.asarray(comm, dtype=np.float64).reshape(-1), index=a.index)


def replica_makespans(a: pd.DataFrame, price: str) -> pd.DataFrame:
    """Per run and step: the slowest replica's 1F1B makespan with every op at its ``price`` column."""
    out = []
    for (run, step, d), g in a.groupby(["run", "step", "dp_rank"]):
        mbs = np.sort(g.mb.unique())
        P = int(g.stage.max()) + 1
        F, B = np.zeros((P, len(mbs))), np.zeros((P, len(mbs)))
        col = np.searchsorted(mbs, g.mb.to_numpy())
        for arr, op in ((F, "F"), (B, "B")):
            m = (g.op == op).to_numpy()
            arr[g.stage.to_numpy()[m], col[m]] = g[price].to_numpy()[m]
        comm = g.groupby("mb").comm_s.first().reindex(mbs).to_numpy()
        out.append({"run": run, "step": step, "dp_rank": d, "makespan_s": makespan(F, B, comm, "1f1b")})
    return pd.DataFrame(out).groupby(["run", "step"]).makespan_s.max().rename(price).reset_index()


def per_step(a: pd.DataFrame, steps: pd.DataFrame, cores: int) -> pd.DataFrame:
    """Table 2 and the re-predictions: per run and step, measured step, runtime prediction, every makespan and
    the shared-core work."""
    t = steps[["method", "run", "step", "step_s", "pred_step_s"]].copy()
    for price in PRICES.values():
        t = t.merge(replica_makespans(a, price).rename(columns={price: f"makespan_{price}"}), on=["run", "step"])
    work = a.groupby(["run", "step"]).agg(fit_work=("raw_pred_s", "sum"), cpu_work=("cpu_s", "sum")).reset_index()
    t = t.merge(work, on=["run", "step"])
    t["shared_fit_s"], t["shared_cpu_s"] = t.fit_work / cores, t.cpu_work / cores
    t["step_over_shared_cpu"] = t.step_s / t.shared_cpu_s
    return t


def ratios(t: pd.DataFrame) -> pd.DataFrame:
    """Table 3: each method's summed steps over ``packed``'s and in-order's, per measure."""
    cols = ["step_s", "pred_step_s"] + [f"makespan_{p}" for p in PRICES.values()] + ["shared_fit_s", "shared_cpu_s"]
    s = t.groupby("method")[cols].sum()
    rows = [s.div(s.loc[base]).assign(over=base) for base in ("packed", "in-order") if base in s.index]
    return pd.concat(rows).reset_index().set_index(["over", "method"])


def per_round(t: pd.DataFrame) -> pd.DataFrame:
    """Each run's summed measured step and CPU work over the baseline run of the same round (``<method>_<round>``)."""
    s = t.groupby("run")[["step_s", "shared_cpu_s"]].sum()
    method, rnd = s.index.str.rsplit("_", n=1).str[0], s.index.str.rsplit("_", n=1).str[1]
    rows = []
    for base in ("packed", "in-order"):
        ref = s[method == base].set_axis(rnd[method == base])
        for run, m, r in zip(s.index, method, rnd):
            if r in ref.index and m != base:
                rows.append({"over": base, "run": run, **(s.loc[run] / ref.loc[r]).to_dict()})
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path, help="the runs' folder (real_runs.py's output)")
    ap.add_argument("--cores", type=int, default=2, help="the box's cores")
    args = ap.parse_args(argv)
    a, steps = load(args.folder)
    a["comm_s"] = comm_seconds(args.folder, a)
    pd.set_option("display.width", 250)
    print(per_op(a).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    t = per_step(a, steps, args.cores)
    print()
    print(t[["run", "step", "step_s", "pred_step_s", "makespan_raw_pred_s", "makespan_cpu_s", "shared_cpu_s",
             "step_over_shared_cpu"]].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"\nmeasured step / (CPU seconds / {args.cores} cores): {t.step_over_shared_cpu.min():.3f} - "
          f"{t.step_over_shared_cpu.max():.3f} over {len(t)} steps")
    print()
    print(ratios(t).to_string(float_format=lambda v: f"{v:.3f}"))
    print()
    print(per_round(t).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
