"""Real CPU pipeline runs: zero-bubble vs 1F1B, and recompute auto vs never, side by side.

Two studies, each one torchrun job of 2 gloo ranks (``dynmb.runtime``) whose cases run round by
round (step k of every case, then step k + 1: outside load hits every case alike), every case
planning the same global batches of ``--dataset`` with ``dynamic``:

- ``schedules``: the same dynamic plans under ``1f1b``, ``zb-h1`` and ``zb``;
- ``recompute``: at a tight ``--memory-limit`` where ``--recompute never`` must truncate the
  long sequences (``oversize=truncate``), ``never`` vs ``auto`` (which recomputes the
  microbatches that cannot fit otherwise and runs every sequence whole).

Prints per case: throughput = sum of real tokens / sum of step_s over measured steps, the median
of per-step paired ratios to the first case, measured bubble, peak / limit, truncated sequences,
recomputed microbatches (from the plan), predicted vs measured step. The tables (``steps``,
``actions``, ``memory``, ``runs``) are in ``--out``.

    python -m studies.zerobubble.zb_real schedules --global-batch 64 --steps 12 --out results/zb_real
    python -m studies.zerobubble.zb_real recompute --memory-limit 128MiB --steps 8 --out results/zb_recompute
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from dynmb import PipelineConfig, RunConfig, model_config
from dynmb.core.config import parse_bytes
from dynmb.planning import default_cost_model_path
from dynmb.runtime.launch import launch_job   # the public dynmb.run once it lands
from dynmb.runtime.spec import JobSpec, RunSpec


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("study", choices=["schedules", "recompute"], help="which comparison")
    ap.add_argument("--dataset", default="sharegpt", help="trace (default sharegpt)")
    ap.add_argument("--model", default="small", help="model preset (default small)")
    ap.add_argument("--stages", type=int, default=2, help="pipeline stages = ranks (default 2)")
    ap.add_argument("--global-batch", type=int, default=32, help="sequences per step (default 32)")
    ap.add_argument("--memory-limit", default="1GiB", help="per-rank limit (default 1GiB)")
    ap.add_argument("--steps", type=int, default=6, help="measured steps per case (default 6)")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up steps per case (default 1)")
    ap.add_argument("--reorder", default="none", help="microbatch order pass (default none: the same order for every case)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the global batches (default 0)")
    ap.add_argument("--verify", action="store_true", help="check gradients against the single-process reference")
    ap.add_argument("--out", default="results/zb_real", help="results folder")
    return ap


def cases(args: argparse.Namespace) -> dict[str, RunConfig]:
    cm = default_cost_model_path(args.model, args.stages)

    def cfg(kind: str, recompute: str = "never", oversize: str = "error") -> RunConfig:
        return RunConfig(model=model_config(args.model),
                         pipeline=PipelineConfig(num_stages=args.stages, schedule=kind, reorder=args.reorder,
                                                 memory_limit_bytes=parse_bytes(args.memory_limit)),
                         dataset=args.dataset, global_batch=args.global_batch, method="dynamic", seed=args.seed,
                         steps=args.steps, warmup=args.warmup, backend="gloo", device="cpu", cost_model=cm,
                         timeout_s=600.0, oversize=oversize, recompute=recompute)
    if args.study == "schedules":
        return {"1f1b": cfg("1f1b"), "zb-h1": cfg("zb-h1"), "zb": cfg("zb")}
    return {"never (truncate)": cfg("1f1b", "never", "truncate"), "auto": cfg("1f1b", "auto"),
            "auto zb-h1": cfg("zb-h1", "auto")}


def summarise(out: Path, labels: list[str]) -> pd.DataFrame:
    steps = pd.read_csv(out / "steps.csv")
    steps = steps[~steps["warmup"].astype(bool)]
    mem = pd.read_csv(out / "memory.csv")
    base = steps[steps["label"] == labels[0]].set_index("step")
    rows = []
    for lab in labels:
        s = steps[steps["label"] == lab].set_index("step")
        rid = s["run_id"].iloc[0]
        m = mem[mem["run_id"] == rid]
        paired = (s["tokens_per_s"] / base["tokens_per_s"]).dropna()
        rows.append({"case": lab, "steps": len(s), "tokens_per_s": s["real_tokens"].sum() / s["step_s"].sum(),
                     "ratio_vs_first": float(np.median(paired)), "step_s": float(s["step_s"].median()),
                     "pred_step_s": float(s["pred_step_s"].median()), "bubble": float(s["mean_bubble"].median()),
                     "pred_bubble": float(s["pred_mean_bubble"].median()),
                     "peak_over_limit": float((m["peak_bytes"] / m["limit_bytes"]).max()),
                     "real_tokens": int(s["real_tokens"].sum()), "truncated": int(s["truncated"].sum()),
                     "recomputed": int(s["recomputed"].sum()) if "recomputed" in s else 0,
                     "microbatches": float(s["num_microbatches"].mean())})
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    todo = cases(args)
    # no per-case calibration of the cost model from its own warm-up: every case plans with the
    # same costs, so the schedules run the same plans (schedules study)
    specs = tuple(RunSpec.create(c, out, run_id=f"{args.study}-{i}", label=lab, verify=args.verify, calibrate=False)
                  for i, (lab, c) in enumerate(todo.items()))
    rc = launch_job(JobSpec(out_dir=str(out.resolve()), cases=specs, interleave=True), args.stages,
                    progress=True).returncode
    if rc != 0:
        print(f"zb_real: the job failed (exit {rc}); see {out}/errors", file=sys.stderr)
        return rc
    pd.set_option("display.width", 200)
    print(summarise(out, list(todo)).to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
