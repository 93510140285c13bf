"""Slicing long sequences (``--oversize split``) against truncating them (``--oversize truncate``).

On the ``longtail`` trace (chat prompts mixed with whole WikiText-2 articles, up to 20,980
tokens), at a memory limit where the longest articles are several times the longest row
that fits, every method is planned both ways:

- ``split``: every token trained; a long article runs as a chain of slices
  (``dynmb.planning.slicing``).
- ``truncate``: a long article is cut to the longest row that fits; the rest of it is lost
  (``truncate`` without recomputation, ``truncate+rc`` with ``--recompute auto``, under which
  a longer row fits and is run whole with recomputation).

Positions: a model with rotary positions (``ModelConfig.learned_positions`` False, the Llama
family) is run as given: no table, no cap on a document's length. A model with learned
positions (GPT-2) needs a table as long as the longest document it slices, so its
``max_seq_len`` is raised to the trace's longest sequence (said once on stderr); the table's
parameters, gradients and optimizer states then count against the memory limit.

``--real``: real runs on ``--stages`` gloo ranks (``--model``, default ``llama-small``, with its
shipped CPU cost model ``dynmb.planning.default_cost_model_path``, or ``--cost-model``;
``--recompute auto`` for ``split``), all cases in one interleaved ``dynmb.run`` job (round by
round, so outside load hits them alike); per case the median step time, trained tokens per
step, trained tokens/s, the measured peak over the limit and the step-time prediction error.
``--sim``: the simulator at ``--sim-stages`` for each of ``--sim-model`` (comma-separated,
default ``llama3.2-1b``) with the analytic cost model: the longest row that fits, the largest
stage's model states over the limit, predicted step time, trained tokens and tokens/s, peak
over limit. ``--reach``: for each of ``--reach-models`` at each of ``--reach-limits`` on
``--stages`` stages (shipped cost models, ``--recompute auto``), the longest single document the
planner slices under the limit (doubling, then bisection to ``--reach-tol``); a learned-position
model's table is sized to the document tried, so its states grow with it.

    python -m studies.slicing.slicing --real --out results/slicing
    python -m studies.slicing.slicing --sim --out results/slicing
    python -m studies.slicing.slicing --sim --sim-model llama2-7b,gpt2-7b --sim-stages 8,16,32 \\
        --sim-memory-limit 24GiB --out results/slicing-7b
    python -m studies.slicing.slicing --reach --out results/slicing
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np
import pandas as pd

import dynmb
from dynmb.core.config import parse_bytes
from dynmb.data import load_trace, sample_batch
from dynmb.packing import PackingError
from dynmb.planning import default_cost_model_path

CASES = (("split", "auto"), ("truncate", "never"), ("truncate+rc", "auto"))
"""(case name, recompute policy); the oversize policy is the name before ``+``."""


def model_for_trace(spec: str, trace: np.ndarray) -> dynmb.ModelConfig:
    """``spec``'s model, with a learned position table sized to the longest sequence of ``trace``
    (a rotary model is returned as it is: it has no table to size)."""
    cfg = dynmb.model_config(spec)
    longest = int(trace.max())
    if cfg.learned_positions and cfg.max_seq_len < longest:
        print(f"slicing: {spec}: learned positions; position table sized to the trace's longest sequence, "
              f"max_seq_len {cfg.max_seq_len} -> {longest}", file=sys.stderr)
        cfg = dataclasses.replace(cfg, max_seq_len=longest)
    return cfg


def position_table(cfg: dynmb.ModelConfig) -> int:
    """Rows of the learned position table (0: rotary positions, no table)."""
    return cfg.max_seq_len if cfg.learned_positions else 0


def real(args: argparse.Namespace) -> pd.DataFrame:
    out = Path(args.out) / "real"
    trace = load_trace(args.dataset)
    cfg_model = model_for_trace(args.model, trace)
    cost_model = args.cost_model or default_cost_model_path(cfg_model.name, args.stages)
    if cost_model is None:
        raise SystemExit(f"slicing: no shipped CPU cost model for {cfg_model.name!r} on {args.stages} stages; "
                         f"fit one (dynmb profile + dynmb fit) and pass --cost-model FILE")
    configs, labels = [], []
    for method in args.methods.split(","):
        for case, recompute in CASES:
            configs.append(dynmb.RunConfig(
                model=cfg_model, pipeline=dynmb.PipelineConfig(num_stages=args.stages,
                                                               memory_limit_bytes=parse_bytes(args.memory_limit)),
                dataset=args.dataset, global_batch=args.global_batch, method=method, seed=args.seed, steps=args.steps,
                warmup=args.warmup, backend="gloo", device="cpu", cost_model=str(cost_model), timeout_s=600.0,
                oversize=case.split("+")[0], recompute=recompute))
            labels.append(f"{method}-{case}")
    result = dynmb.run(configs, out=out, nproc=args.stages, labels=labels, interleave=True,
                       output="quiet" if args.quiet else "stream")
    if not result.ok:
        print("\n".join(result.failures), file=sys.stderr)
        raise SystemExit(result.returncode)
    case_of = dict(zip(result.run_ids, labels))
    t = result.tables
    steps = t["steps"][~t["steps"]["warmup"].astype(bool)].copy()
    steps["batch_tokens"] = [int(sample_batch(trace, args.global_batch, args.seed, step=int(k)).sum())
                             for k in steps["step"]]
    steps["pred_err"] = (steps["pred_step_s"] - steps["step_s"]).abs() / steps["step_s"]
    mem = t["memory"].assign(peak_over_limit=lambda d: d["peak_bytes"] / d["limit_bytes"],
                             pred_over_measured=lambda d: d["pred_peak_bytes"] / d["peak_bytes"] - 1)
    rows = []
    for rid, g in steps.groupby("run_id"):
        method, case = case_of[rid].split("-", 1)
        m = mem[mem["run_id"] == rid]
        rows.append({"model": cfg_model.name, "position_table": position_table(cfg_model), "method": method,
                     "case": case, "steps": len(g),
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
    for spec in args.sim_model.split(","):
        model = model_for_trace(spec, trace)
        for stages in [int(x) for x in args.sim_stages.split(",")]:
            for method in args.methods.split(","):
                for case, recompute in CASES:
                    rows.append(_simulate_case(args, trace, model, stages, method, case, recompute))
    return pd.DataFrame(rows)


def _simulate_case(args: argparse.Namespace, trace: np.ndarray, model: dynmb.ModelConfig, stages: int, method: str,
                   case: str, recompute: str) -> dict:
    """One (model, stages, method, case) of the ``--sim`` study over ``args.steps`` batches."""
    row = {"model": model.name, "position_table": position_table(model), "stages": stages, "method": method,
           "case": case}
    steps, tokens, batch_tokens, peaks, cap = [], [], [], [], 0
    try:
        planner = dynmb.Planner(model=model, num_stages=stages, memory_limit=args.sim_memory_limit, cost_model=None,
                                oversize=case.split("+")[0], recompute=recompute, device="cuda")
        states = planner.memory_model.rank_state_bytes(planner.schedule).max() / planner.memory_limit_bytes
        for k in range(args.steps):
            batch = sample_batch(trace, args.sim_global_batch, args.seed, step=k)
            planned = planner.plan(batch, method=method)
            steps.append(planned.plan.predictions["pred_step_s"])
            tokens.append(planned.plan.real_tokens)
            batch_tokens.append(int(batch.sum()))
            peaks.append(max(planned.plan.predictions["pred_peak_bytes"]) / planner.memory_limit_bytes)
            cap = planned.plan.meta.get("longest_fitting_length", cap)
    except PackingError as e:                   # also: the model states alone exceed the limit
        return {**row, "status": str(e)[:100]}
    return {**row, "status": "ok", "longest_row": cap, "states_over_limit": float(states),
            "median_pred_step_s": float(np.median(steps)), "tokens_kept": sum(tokens) / sum(batch_tokens),
            "pred_trained_tokens_per_s": sum(tokens) / sum(steps), "max_pred_peak_over_limit": max(peaks)}


def _fits_sliced(spec: str, length: int, stages: int, limit: str) -> bool:
    """Whether one document of ``length`` tokens plans sliced on ``spec`` under ``limit``."""
    cfg = dynmb.model_config(spec)
    if cfg.learned_positions and cfg.max_seq_len < length:
        cfg = dataclasses.replace(cfg, max_seq_len=length)
    planner = dynmb.Planner(model=cfg, num_stages=stages, memory_limit=limit, oversize="split", recompute="auto")
    try:
        planner.plan(np.array([length]), method="dynamic")
    except PackingError:
        return False
    return True


def reach(args: argparse.Namespace) -> pd.DataFrame:
    rows = []
    for spec in args.reach_models.split(","):
        for limit in args.reach_limits.split(","):
            lo, hi = 0, 1024
            while _fits_sliced(spec, hi, args.stages, limit):
                lo, hi = hi, 2 * hi
            while hi - lo > max(1, int(args.reach_tol * lo)):
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if _fits_sliced(spec, mid, args.stages, limit) else (lo, mid)
            cfg = dynmb.model_config(spec)
            rows.append({"model": cfg.name, "learned_positions": cfg.learned_positions, "stages": args.stages,
                         "memory_limit": limit, "longest_document": lo, "first_refused": hi})
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real", action="store_true")
    ap.add_argument("--sim", action="store_true")
    ap.add_argument("--out", default="results/slicing")
    ap.add_argument("--dataset", default="longtail")
    ap.add_argument("--methods", default="dynamic,fixed")
    ap.add_argument("--model", default="llama-small",
                    help="--real model; learned positions are sized to the trace, rotary ones need nothing")
    ap.add_argument("--cost-model", default=None,
                    help="--real cost model JSON (default: the shipped one for --model on --stages ranks)")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--memory-limit", default="384MiB")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--sim-model", default="llama3.2-1b", help="--sim models, comma-separated")
    ap.add_argument("--sim-stages", default="4,8,16")
    ap.add_argument("--sim-memory-limit", default="12GiB")
    ap.add_argument("--sim-global-batch", type=int, default=64)
    ap.add_argument("--reach", action="store_true")
    ap.add_argument("--reach-models", default="small,llama-small")
    ap.add_argument("--reach-limits", default="384MiB,1GiB")
    ap.add_argument("--reach-tol", type=float, default=0.01, help="--reach: relative width of the last bracket")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if not (args.real or args.sim or args.reach):
        ap.error("pick --real, --sim and/or --reach")
    try:
        for spec in [args.model] + args.sim_model.split(",") + args.reach_models.split(","):
            dynmb.model_config(spec)
        for limit in [args.memory_limit, args.sim_memory_limit] + args.reach_limits.split(","):
            parse_bytes(limit)
    except ValueError as e:
        ap.error(str(e))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    pd.set_option("display.width", 200)
    if args.sim:
        df = simulated(args)
        df.to_csv(Path(args.out) / "simulated.csv", index=False)
        print(df.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    if args.reach:
        df = reach(args)
        df.to_csv(Path(args.out) / "reach.csv", index=False)
        print(df.to_string(index=False))
    if args.real:
        df = real(args)
        df.to_csv(Path(args.out) / "real.csv", index=False)
        print(df.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
