"""Pick the configuration of the real 2x2 gloo runs (``real_runs.py``) by simulation: the planner's predicted step of
in-order, packed, lockstep and dynamic, exactly as ``dynmb run`` would plan them.

    python studies/lockstep/pick_real.py --traces longtail,wikitext2 --T 2048,4096,8192 --global-batch 32,64 \\
        --model llama-small --cost-model data/costmodels/llama-small-p2-cpu.json --steps 1,2,3,4

For every (trace, T, global batch) it runs ``dynmb plan --dp 2 --stages 2 --method M --dataset TRACE
--global-batch N --oversize truncate --model MODEL:max_seq_len=T --cost-model FIT --memory-limit LIMIT --step k
--json``
(``--pack-len T`` for the row methods) in this process, steps ``k`` as given (the run's step 0 warms up, so
its measured steps are 1, 2, ...), and prints the median ``pred_step_s`` of each method and the medians of the
per-step ratios lockstep / in-order and lockstep / packed (and the worst step's), and dynamic / packed. The
configuration to run is the one whose two lockstep ratios are smallest in every step at a predicted step of about
10 s (the shipped CPU fit was measured with two processes on the two cores; four ranks share them in the run).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json

import numpy as np
import pandas as pd

from dynmb.cli.main import main as dynmb_main

METHODS = ("in-order", "packed", "lockstep", "dynamic")


def predicted(method: str, trace: str, T: int, batch: int, step: int, args: argparse.Namespace) -> float:
    """``pred_step_s`` of ``dynmb plan`` for one step (module doc); nan where it refuses."""
    argv = ["plan", "--dp", "2", "--stages", "2", "--method", method, "--dataset", trace, "--global-batch", str(batch),
            "--oversize", "truncate", "--model", f"{args.model}:max_seq_len={T}", "--cost-model", args.cost_model,
            "--memory-limit", args.memory_limit,
            "--step", str(step), "--json"] + ([] if method == "dynamic" else ["--pack-len", str(T)])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = dynmb_main(argv)
    if rc:
        return float("nan")
    return float(json.loads(out.getvalue().strip().splitlines()[-1])["pred_step_s"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default="longtail,wikitext2")
    ap.add_argument("--T", default="2048,4096,8192")
    ap.add_argument("--global-batch", default="32,64")
    ap.add_argument("--model", default="llama-small")
    ap.add_argument("--cost-model", default="data/costmodels/llama-small-p2-cpu.json",
                    help="the shipped CPU fit of the model (a preset with max_seq_len=T finds none by itself)")
    ap.add_argument("--memory-limit", default="2GiB")
    ap.add_argument("--steps", default="1,2,3,4")
    args = ap.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",")]     # noqa: E731
    rows = []
    for trace, T, batch in itertools.product(args.traces.split(","), ints(args.T), ints(args.global_batch)):
        pred = {m: np.array([predicted(m, trace, T, batch, k, args) for k in ints(args.steps)]) for m in METHODS}
        row = {"trace": trace, "T": T, "global_batch": batch}
        row.update({f"{m} s": float(np.median(v)) for m, v in pred.items()})
        for base in ("in-order", "packed"):
            ratio = pred["lockstep"] / pred[base]
            row[f"lockstep / {base}"] = float(np.median(ratio))
            row[f"worst step / {base}"] = float(np.max(ratio))
        row["dynamic / packed"] = float(np.median(pred["dynamic"] / pred["packed"]))
        rows.append(row)
        print(pd.DataFrame(rows[-1:]).to_string(index=False, header=len(rows) == 1,
                                                float_format=lambda v: f"{v:.3f}"), flush=True)
    print(pd.DataFrame(rows).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
