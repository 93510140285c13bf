"""Which runtime calibration predicts real steps best? Offline, on recorded compare runs.

A ``dynmb compare`` folder holds every action's measured time and shape. This script re-predicts
every measured step of every case under several calibration rules and reports each rule's step
error next to what the run itself predicted. Per step it

1. prices every action with the shipped (uncalibrated) cost model: ``cost_model.predict`` of its
   stage, op, rows, padded_len and attention work, exactly what the run's warm-up predicted;
2. calibrates those prices with the rule (``costmodel.runtime_calibration`` fitted on the actions
   the rule allows: only ones measured *before* the step);
3. replays the schedule that ran (each rank's actions in the order they ran) in the simulator
   (``simulate.simulate_costs``, the cost model's P2P time): the rule's ``pred_step_s``.

Rules:

- ``none``: the profile as shipped;
- ``warmup``: calibrated once, on this case's warm-up step (``runtime_calibration``; the rule of
  releases before ``job``);
- ``pooled``: once, on every case's warm-up step (the whole first round of the job);
- ``rolling``: this case's warm-up and measured steps before this one;
- ``recent``: every case's actions of the ``--recent`` steps that ran just before this one in the
  job (the machine's speed right now);
- ``job0``: ``job_calibration``'s scale and compute overhead alone (the runtime's rule before the
  P2P fit: this case's bias against the job times the job's recent speed);
- ``job-gap``: ``job0`` plus the gap before each action (``p2pfit.action_gaps``);
- ``job-lat``: ``job0`` plus the wait per receiving action (``p2pfit.receive_waits``);
- ``job``: the runtime's rule, ``job_calibration`` on every step of the job before this one
  (``job0`` plus both).

``recorded`` is what the run itself predicted; on a run made with the ``job`` rule the two agree.
``measured_actions`` replays every action's measured time (P2P at the model's time, the
runtime's ``replay_step_s``), ``measured_actions+p2p`` adds the ``job`` rule's latency to every
receiving action and its gap to every action (the simulator's own error with the P2P fit). Besides the median |error| per case, the script prints the median signed error
(``--signed``: negative = predicted too fast).

For ``fixed``, ``sorted``, ``packed`` and ``token-budget`` the plan does not depend on the cost
model, so the replayed prediction is what the rule would have printed. ``dynamic`` and
``dynapipe`` plan with it; their numbers are the rule's error on the plan they ran.

    python -m studies.prediction.calibration_study results/compare [more folders] [--recent 4] [--signed]
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from dynmb.core.config import ModelConfig
from dynmb.costmodel import CalibrationStep, RuntimeCalibration, get_cost_model, job_calibration, runtime_calibration
from dynmb.io.results import load_results
from dynmb.timing.simulate import simulate_costs
from dynmb.core.types import Action, Schedule

RULES = ("none", "warmup", "pooled", "rolling", "recent", "job0", "job-gap", "job-lat", "job")


def _receiving(acts: pd.DataFrame, num_stages: int) -> np.ndarray:
    """Which actions receive a message (``CostModel.receives``)."""
    op, stage = acts["op"].to_numpy(), acts["stage"].to_numpy()
    return ((op == "F") & (stage > 0)) | (np.isin(op, ("B", "I")) & (stage < num_stages - 1))


def _calibrated(acts: pd.DataFrame, cal: RuntimeCalibration, num_stages: int) -> np.ndarray:
    """Each action's raw prediction under ``cal``: raw x scale[op][stage] + overhead[op] + gap[op],
    plus the latency on receiving actions (``CostModel.predict``)."""
    scale = [cal.scale[op][int(st)] if op in cal.scale else 1.0 for op, st in zip(acts["op"], acts["stage"])]
    per_action = cal.per_action_s
    overhead = [per_action.get(op, 0.0) for op in acts["op"]]
    return (acts["raw_s"].to_numpy() * np.asarray(scale) + np.asarray(overhead)
            + cal.latency_s * _receiving(acts, num_stages))


def _replay(acts: pd.DataFrame, seconds: np.ndarray, num_stages: int) -> float:
    """The simulator's step time of the schedule ``acts`` ran (each rank's actions in the order
    they started) with ``seconds`` per action and the cost model's P2P time (``comm_s``)."""
    acts = acts.assign(sec=seconds).sort_values(["rank", "start_s"])
    m = int(acts["mb"].max()) + 1
    ranks = [tuple(Action(int(s), str(o), int(b)) for s, o, b in zip(g["stage"], g["op"], g["mb"]))
             for _, g in acts.groupby("rank")]
    costs = {op: np.zeros((num_stages, m)) for op in acts["op"].unique()}
    comm = np.zeros(m)
    for s, o, b, sec, c in zip(acts["stage"], acts["op"], acts["mb"], acts["sec"], acts["comm_s"]):
        costs[o][int(s), int(b)] = sec
        comm[int(b)] = c
    return simulate_costs(Schedule(ranks, num_stages, m, kind="replay"), costs, comm).makespan_s


def study(folder: Path, recent: int) -> pd.DataFrame:
    t = load_results(folder)
    steps, actions, runs = t["steps"], t["actions"].copy(), t["runs"]
    run = runs.iloc[0]
    num_stages = int(steps["num_stages"].iloc[0])
    path = run.get("cost_model")
    cost_model = get_cost_model(None if pd.isna(path) or not path else str(path), model_from_runs(run), num_stages)
    if "raw_pred_s" in actions:          # recorded by the runtime since the job rule
        actions["raw_s"] = actions["raw_pred_s"]
    else:                                # re-priced: what the run's uncalibrated model predicted
        actions["raw_s"] = [float(cost_model.predict(int(s), o, b, n, a)) for s, o, b, n, a in
                            zip(actions["stage"], actions["op"], actions["batch"], actions["padded_len"],
                                actions["attn_work"])]
    actions["comm_s"] = cost_model.comm_s(actions["batch"].to_numpy(), actions["padded_len"].to_numpy())
    fit = actions.assign(pred_s=actions["raw_s"])       # runtime_calibration reads raw predictions
    order = list(zip(steps["run_id"], steps["step"]))   # the job's execution order (rank 0 appends in order)
    position = {key: i for i, key in enumerate(order)}
    warm = steps[steps["warmup"].astype(bool)]
    warm_keys = set(zip(warm["run_id"], warm["step"]))
    key_of = list(zip(fit["run_id"], fit["step"]))
    in_warm = np.array([k in warm_keys for k in key_of])
    pooled = runtime_calibration(fit[in_warm], num_stages)
    rows = []
    for _, st in steps[~steps["warmup"].astype(bool)].iterrows():
        rid, k = st["run_id"], int(st["step"])
        here = (fit["run_id"] == rid) & (fit["step"] == k)
        mine = fit["run_id"] == rid
        before = np.array([position[key] < position[(rid, k)] for key in key_of])
        recent_keys = set(order[max(0, position[(rid, k)] - recent):position[(rid, k)]])
        history = [CalibrationStep(r, fit[(fit["run_id"] == r) & (fit["step"] == j)])
                   for r, j in order[:position[(rid, k)]]]
        job = job_calibration(history, rid, num_stages)
        job0 = replace(job, gap_s={}, latency_s=0.0)
        cals = {
            "none": RuntimeCalibration(),
            "warmup": runtime_calibration(fit[mine & in_warm], num_stages),
            "pooled": pooled,
            "rolling": runtime_calibration(fit[mine & before], num_stages),
            "recent": runtime_calibration(fit[np.array([key in recent_keys for key in key_of])], num_stages),
            "job0": job0,
            "job-gap": replace(job0, gap_s=job.gap_s),
            "job-lat": replace(job0, latency_s=job.latency_s),
            "job": job,
        }
        acts = fit[here]
        row = {"folder": folder.name, "method": st["method"], "label": st.get("label", st["method"]), "step": k,
               "step_s": st["step_s"], "recorded": st["pred_step_s"]}
        for name, cal in cals.items():
            row[name] = _replay(acts, _calibrated(acts, cal, num_stages), num_stages)
        measured = (acts["end_s"] - acts["start_s"]).to_numpy()
        row["measured_actions"] = _replay(acts, measured, num_stages)
        row["measured_actions+p2p"] = _replay(acts, measured + job.latency_s * _receiving(acts, num_stages)
                                              + acts["op"].map(job.gap_s).fillna(0.0).to_numpy(), num_stages)
        row["latency_ms"] = 1e3 * job.latency_s
        rows.append(row)
    return pd.DataFrame(rows)


def model_from_runs(run: pd.Series) -> ModelConfig:
    """The model of a ``runs`` row (its flattened ``model.*`` columns)."""
    return ModelConfig.from_dict({c[len("model."):]: run[c] for c in run.index if c.startswith("model.")})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--recent", type=int, default=4, help="steps of the job before this one for 'recent' (default 4)")
    ap.add_argument("-o", "--out", type=Path, default=None, help="write the per-step table as CSV")
    ap.add_argument("--signed", action="store_true", help="also print the median signed error per case")
    args = ap.parse_args(argv)
    df = pd.concat([study(f, args.recent) for f in args.folders], ignore_index=True)
    if args.out:
        df.to_csv(args.out, index=False)
    cols = ["recorded", *RULES, "measured_actions", "measured_actions+p2p"]
    err = df[cols].sub(df["step_s"], axis=0).abs().div(df["step_s"], axis=0)
    err[["folder", "label"]] = df[["folder", "label"]]
    per_case = err.groupby(["folder", "label"])[cols].median()      # a case's pred_err, per run
    pd.set_option("display.width", 200)
    print("median |pred - measured| / measured per case and run (the summary's pred_err), by rule:")
    print((per_case * 100).round(1).to_string())
    if args.signed:
        signed = df[cols].sub(df["step_s"], axis=0).div(df["step_s"], axis=0)
        signed[["folder", "label"]] = df[["folder", "label"]]
        print("\nmedian (pred - measured) / measured per case and run (negative: predicted too fast):")
        print((signed.groupby(["folder", "label"])[cols].median() * 100).round(1).to_string())
    print("\nover cases and runs: median, max, and how many case-runs within 10%:")
    print(pd.DataFrame({"median": per_case.median(), "max": per_case.max(),
                        "within_10pct": (per_case <= 0.10).mean()}).round(3).to_string())


if __name__ == "__main__":
    main()
