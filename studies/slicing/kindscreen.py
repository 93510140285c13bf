"""Plan CPU of ``dynamic`` under ``--schedule auto`` per kind screen, paired in one process (tenth session, issue 39):
one ``longdoc`` cell planned per mode, the modes interleaved, CPU seconds (``time.process_time``) and the step.

    PYTHONPATH=$PWD nice -n 10 python3 -m studies.slicing.kindscreen --trace pycode --model llama2-7b --stages 8

Modes: ``5%`` (``KIND_SCREEN`` 0.05, as before the tenth session), ``20%-full`` (``KIND_SCREEN`` 0.20, every kind it
keeps weighed in full) and ``20%-tiered`` (as shipped: the kinds beyond ``KIND_SCREEN_NEAR`` by the screen alone). The
first mode of the first round also warms the process's caches: compare the later rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path
from typing import Iterator

from dynmb.planning import planner as planner_module
from dynmb.planning import slicing
from studies.slicing import longdoc


@contextlib.contextmanager
def mode(name: str) -> Iterator[None]:
    """Within it the kind screen is ``name``'s (module doc)."""
    near = planner_module.KIND_SCREEN_NEAR
    if name == "20%-full":
        planner_module.KIND_SCREEN_NEAR = 0.20
    try:
        with slicing.kinds_screened(0.05 if name == "5%" else 0.20):
            yield
    finally:
        planner_module.KIND_SCREEN_NEAR = near


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="pycode")
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=Path("results/traces"))
    args = ap.parse_args(argv)
    planner, batch, _ = longdoc.cell_planner(args.trace, longdoc.load(args.trace, args.cache), args.model, args.stages)
    for r in range(args.rounds):
        for name in ("5%", "20%-full", "20%-tiered"):
            with mode(name):
                t0 = time.process_time()
                step = planner.plan(batch, method="dynamic")
                print(f"round {r} {name}: step {step.sim.makespan_s:.4f} s, {step.plan.schedule_kind}, "
                      f"{time.process_time() - t0:.1f} CPU s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
