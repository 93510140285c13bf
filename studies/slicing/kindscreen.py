"""Plan CPU of ``dynamic`` under ``--schedule auto`` per kind screen, paired in one process (tenth session, issue 39):
one ``longdoc`` cell planned per mode, the modes interleaved, CPU seconds (``time.process_time``) and the step.

    PYTHONPATH=$PWD nice -n 10 python3 -m studies.slicing.kindscreen --trace pycode --model llama2-7b --stages 8

Modes: ``KIND_SCREEN`` at each of ``--margins`` (``slicing.kinds_screened``; 0.05: as before the tenth session, 0.2:
since). The first mode of the first round also warms the process's caches: compare the later rounds.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dynmb.planning import slicing
from studies.slicing import longdoc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="pycode")
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--margins", default="0.05,0.2", help="KIND_SCREEN values, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=Path("results/traces"))
    args = ap.parse_args(argv)
    planner, batch, _ = longdoc.cell_planner(args.trace, longdoc.load(args.trace, args.cache), args.model, args.stages)
    for r in range(args.rounds):
        for margin in map(float, args.margins.split(",")):
            with slicing.kinds_screened(margin):
                t0 = time.process_time()
                step = planner.plan(batch, method="dynamic")
                print(f"round {r} KIND_SCREEN {margin}: step {step.sim.makespan_s:.4f} s, {step.plan.schedule_kind}, "
                      f"{time.process_time() - t0:.1f} CPU s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
