"""Real 2x2 gloo runs (pp 2 x dp 2) of in-order, packed, lockstep and dynamic on the same global batches, interleaved,
and their paired ratios.

    python studies/lockstep/real_runs.py studies/lockstep/results/real_quiet --run --rounds 3

runs, one after another, ``in-order packed lockstep dynamic`` ``--rounds`` times (A B C D A B C D ...), each
``dynmb run --nproc 4 --dp 2 --stages 2 --method M --dataset TRACE --global-batch N --oversize truncate
--model MODEL:max_seq_len=T --cost-model FIT --memory-limit LIMIT --steps S --out OUT/M_r`` (``--pack-len T``
for the row methods; the defaults below are the configuration ``pick_real.py`` chose), then prints the table;
without ``--run`` it only reads the runs already in OUT. Every run draws the same global batches (same trace,
seed and global batch; every method truncates documents at T: the row methods at ``--pack-len``, dynamic at the
model's ``max_seq_len``). Interleaving makes drift of the box's load fall on every method alike.

Per measured step (step 0 warms up), each run's ``step_s`` over each baseline run's (``in-order``: the issue's
"(a) in-order packing"; ``packed``: best-fit-decreasing rows dealt by work), and the same for the runtime's
predictions ``pred_step_s`` (its cost model is refit online from the run's own measurements, so it carries the
load of the box as well); medians over every step of every pairing of a method's runs with the baseline's runs
(a run never with itself), and over the neighbour pairs only (each run with the baseline run just before and
just after it, by ``runs.csv``'s ``date``): on a box whose load drifts, the neighbours see the closest load.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
from pathlib import Path

import pandas as pd

METHODS = ("in-order", "packed", "lockstep", "dynamic")
"""One round of runs, in this order."""
BASELINES = ("in-order", "packed")

log = logging.getLogger("real_runs")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="folder of the runs (one sub-folder per run)")
    ap.add_argument("--run", action="store_true", help="run the rounds first (else only read OUT)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the four methods")
    ap.add_argument("--steps", type=int, default=5, help="measured steps per run (after one warm-up step)")
    ap.add_argument("--dataset", default="wikitext2")
    ap.add_argument("--pack-len", type=int, default=4096, help="T: the row length (and dynamic's max_seq_len)")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--model", default="llama-small")
    ap.add_argument("--cost-model", default="data/costmodels/llama-small-p2-cpu.json")
    ap.add_argument("--memory-limit", default="2GiB")
    return ap


def run_command(method: str, folder: Path, args: argparse.Namespace) -> list[str]:
    """The ``dynmb run`` command line of one run (module doc)."""
    T = args.pack_len
    return (["dynmb", "run", "--nproc", "4", "--dp", "2", "--stages", "2", "--method", method, "--dataset",
             args.dataset, "--global-batch", str(args.global_batch), "--oversize", "truncate", "--model",
             f"{args.model}:max_seq_len={T}", "--cost-model", args.cost_model, "--memory-limit", args.memory_limit,
             "--steps", str(args.steps), "--out", str(folder)] + ([] if method == "dynamic" else ["--pack-len", str(T)]))


def run_rounds(args: argparse.Namespace) -> None:
    """A B C D, ``--rounds`` times; a run that fails stops the rounds (its command and exit status logged)."""
    for r in range(1, args.rounds + 1):
        for method in METHODS:
            cmd = run_command(method, args.out / f"{method}_{r}", args)
            log.info("%s", " ".join(cmd))
            done = subprocess.run(cmd, check=False)
            if done.returncode:
                raise SystemExit(f"real_runs: `{' '.join(cmd)}` exited {done.returncode}")


def load_runs(root: Path) -> tuple[dict[str, pd.DataFrame], list[str]]:
    """(measured steps of every run in ``root``, step 0 left out; the runs in the order they started)."""
    runs = {d.name: pd.read_csv(d / "steps.csv").set_index("step") for d in sorted(root.iterdir())
            if (d / "steps.csv").is_file()}
    started = {name: pd.read_csv(root / name / "runs.csv")["date"].iloc[0] for name in runs}
    return {name: df[df.index > 0] for name, df in runs.items()}, sorted(runs, key=started.__getitem__)


def method_of(name: str) -> str:
    return name.rsplit("_", 1)[0]


def paired(runs: dict[str, pd.DataFrame], order: list[str], m: str, base: str) -> dict[str, object]:
    """One row of the table: method ``m`` against baseline ``base`` (module doc)."""
    measured, predicted, near = [], [], []
    mine = [n for n in runs if method_of(n) == m]
    bases = [n for n in runs if method_of(n) == base]
    for name in mine:
        for base_name in (b for b in bases if b != name):
            both = runs[name].index.intersection(runs[base_name].index)
            measured.append(runs[name].step_s[both] / runs[base_name].step_s[both])
            predicted.append(runs[name].pred_step_s[both] / runs[base_name].pred_step_s[both])
        if m == base:
            continue
        k = order.index(name)
        for base_name in [b for b in order[:k] if b in bases][-1:] + [b for b in order[k + 1:] if b in bases][:1]:
            both = runs[name].index.intersection(runs[base_name].index)
            near.append(runs[name].step_s[both] / runs[base_name].step_s[both])
    median = lambda parts: pd.concat(parts).median() if parts else float("nan")     # noqa: E731
    return {"method": m, "baseline": base, "runs": len(mine), "pairs": len(measured),
            "median step_s": pd.concat([runs[n] for n in mine]).step_s.median() if mine else float("nan"),
            "step_s / baseline": median(measured), "neighbour pairs": len(near),
            "step_s / baseline (neighbours)": median(near), "pred_step_s / baseline": median(predicted)}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.run:
        run_rounds(args)
    runs, order = load_runs(args.out)
    rows = [paired(runs, order, m, base) for base in BASELINES for m in METHODS
            if m != base and any(method_of(n) == m for n in runs)]
    log.info("runs in time order: %s", ", ".join(order))
    log.info("%s", pd.DataFrame(rows).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
