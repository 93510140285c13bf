"""Slicing long sequences (``--oversize split``) against truncating them (``--oversize truncate``).

On the ``longtail`` trace (chat prompts mixed with whole WikiText-2 articles, up to 20,980
tokens), at a memory limit where the longest articles are several times the longest row
that fits, every method is planned both ways:

- ``split``: every token trained; a long article runs as a chain of slices
  (``dynmb.planning.slicing``).
- ``truncate``: a long article is cut to the longest row that fits; the rest of it is lost
  (``truncate`` without recomputation, ``truncate+rc`` with ``--recompute auto``, under which
  a longer row fits and is run whole with recomputation).

``--real``: real runs on ``--stages`` gloo ranks (``small`` model, the shipped CPU cost model,
``--recompute auto`` for ``split``), all cases in one interleaved job (round by round, so outside load hits
them alike); per case the median step time, trained tokens per step, trained tokens/s, the
measured peak over the limit and the step-time prediction error. ``--sim``: the simulator at
``--sim-stages`` (default 4, 8, 16) with a larger preset and the analytic cost model:
predicted step time, trained tokens and tokens/s, peak over limit.

    python experiments/slicing.py --real --out results/slicing
    python experiments/slicing.py --sim --out results/slicing
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

import dynmb
from dynmb.config import parse_bytes
from dynmb.data import load_trace, sample_batch
from dynmb.packing import PackingError
from dynmb.planning import default_cost_model_path
from dynmb.runtime.launch import launch_job
from dynmb.runtime.spec import JobSpec, RunSpec

COST_MODEL = default_cost_model_path("small", 2)   # the shipped data/costmodels/small-p2-cpu.json


CASES = (("split", "auto"), ("truncate", "never"), ("truncate+rc", "auto"))
"""(case name, recompute policy); the oversize policy is the name before ``+``."""


def real(args: argparse.Namespace) -> pd.DataFrame:
    out = Path(args.out) / "real"
    cfg_model = dynmb.model_config(args.model)
    cases = []
    for method in args.methods.split(","):
        for case, recompute in CASES:
            oversize = case.split("+")[0]
            cfg = dynmb.RunConfig(
                model=cfg_model, pipeline=dynmb.PipelineConfig(num_stages=args.stages,
                                                               memory_limit_bytes=parse_bytes(args.memory_limit)),
                dataset=args.dataset, global_batch=args.global_batch, method=method, seed=args.seed, steps=args.steps,
                warmup=args.warmup, backend="gloo", device="cpu", cost_model=str(COST_MODEL), timeout_s=600.0,
                oversize=oversize, recompute=recompute)
            cases.append(RunSpec.create(cfg, out, run_id=f"{method}-{case}-s{args.seed}"))
    result = launch_job(JobSpec(out_dir=str(out.resolve()), cases=tuple(cases), interleave=True), args.stages,
                        quiet=args.quiet)
    if result.returncode != 0:
        print("\n".join(result.failures), file=sys.stderr)
        raise SystemExit(result.returncode)
    t = dynmb.load_results(out)
    steps = t["steps"][~t["steps"]["warmup"].astype(bool)].copy()
    trace = load_trace(args.dataset)
    steps["batch_tokens"] = [int(sample_batch(trace, args.global_batch, args.seed, step=int(k)).sum())
                             for k in steps["step"]]
    steps["pred_err"] = (steps["pred_step_s"] - steps["step_s"]).abs() / steps["step_s"]
    mem = t["memory"].assign(peak_over_limit=lambda d: d["peak_bytes"] / d["limit_bytes"],
                             pred_over_measured=lambda d: d["pred_peak_bytes"] / d["peak_bytes"] - 1)
    rows = []
    for rid, g in steps.groupby("run_id"):
        method, case = rid.split("-")[:2]
        m = mem[mem["run_id"] == rid]
        rows.append({"method": method, "case": case, "steps": len(g),
                     "median_step_s": g["step_s"].median(),
                     "trained_tokens_per_step": g["real_tokens"].mean(),
                     "tokens_kept": g["real_tokens"].sum() / g["batch_tokens"].sum(),
                     "trained_tokens_per_s": g["real_tokens"].sum() / g["step_s"].sum(),
                     "max_peak_over_limit": m["peak_over_limit"].max(),
                     "pred_peak_minus_measured_max": m["pred_over_measured"].abs().max(),
                     "median_step_pred_err": g["pred_err"].median()})
    return pd.DataFrame(rows).sort_values(["method", "case"])


def simulated(args: argparse.Namespace) -> pd.DataFrame:
    trace = load_trace(args.dataset)
    rows = []
    for stages in [int(x) for x in args.sim_stages.split(",")]:
        for method in args.methods.split(","):
            for case, recompute in CASES:
                planner = dynmb.Planner(model=args.sim_model, num_stages=stages, memory_limit=args.sim_memory_limit,
                                        cost_model=None, oversize=case.split("+")[0], recompute=recompute,
                                        device="cuda")
                steps, tokens, batch_tokens, peaks, cap = [], [], [], [], 0
                try:
                    for k in range(args.steps):
                        batch = sample_batch(trace, args.sim_global_batch, args.seed, step=k)
                        planned = planner.plan(batch, method=method)
                        steps.append(planned.plan.predictions["pred_step_s"])
                        tokens.append(planned.plan.real_tokens)
                        batch_tokens.append(int(batch.sum()))
                        peaks.append(max(planned.plan.predictions["pred_peak_bytes"]) / planner.memory_limit_bytes)
                        cap = planned.plan.meta.get("longest_fitting_length", cap)
                except PackingError as e:
                    rows.append({"stages": stages, "method": method, "case": case, "status": str(e)[:100]})
                    continue
                rows.append({"stages": stages, "method": method, "case": case, "status": "ok",
                             "longest_row": cap, "median_pred_step_s": float(np.median(steps)),
                             "tokens_kept": sum(tokens) / sum(batch_tokens),
                             "pred_trained_tokens_per_s": sum(tokens) / sum(steps),
                             "max_pred_peak_over_limit": max(peaks)})
    return pd.DataFrame(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real", action="store_true")
    ap.add_argument("--sim", action="store_true")
    ap.add_argument("--out", default="results/slicing")
    ap.add_argument("--dataset", default="longtail")
    ap.add_argument("--methods", default="dynamic,fixed")
    ap.add_argument("--model", default="small:max_seq_len=20980")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--memory-limit", default="384MiB")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--sim-model", default="gpt2-1b:max_seq_len=20980")
    ap.add_argument("--sim-stages", default="4,8,16")
    ap.add_argument("--sim-memory-limit", default="6GiB")
    ap.add_argument("--sim-global-batch", type=int, default=64)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    if not (args.real or args.sim):
        ap.error("pick --real and/or --sim")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    pd.set_option("display.width", 200)
    if args.sim:
        df = simulated(args)
        df.to_csv(Path(args.out) / "simulated.csv", index=False)
        print(df.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    if args.real:
        df = real(args)
        df.to_csv(Path(args.out) / "real.csv", index=False)
        print(df.to_string(index=False, float_format=lambda x: f"{x:.3f}"))


if __name__ == "__main__":
    main()
