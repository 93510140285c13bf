"""Plan time of ``dynamic``'s sliced plan with and without weighing the plain methods' sliced searches, paired
(issue 39): one ``longdoc`` cell (``studies.slicing.longdoc.cell``'s batch, layout, models and planner), dynamic
planned once per mode in one process, CPU seconds (``time.process_time``) and the predicted step of each.

    PYTHONPATH=$PWD nice -n 19 python3 -m studies.slicing.plantime --traces wikitext2 --models llama2-7b --stages 8

Modes: ``off`` (``weighing_alternatives(False)``: dynamic's own search only), ``full`` (``on`` the same:
``weighing_alternatives(finalists=None)``, every plain method's whole sliced search weighed), ``screened`` (the default
since the weighcost branch: every plain method's short packing tried at dynamic's best candidate and around it,
``slicing._centres``, then the whole searches of those within ``slicing.SCREEN_ERROR`` of the best, at most two;
``--finalists K`` or mode ``screenedK``: at most K; on the kinds ``slicing.KIND_SCREEN`` keeps, ``screened-allkinds``: on
every kind, as before the sixth session); the floor pruning and shared simulations of this checkout. Run with another checkout on ``PYTHONPATH`` for its
numbers; compare CPU seconds only within one run (the box's load varies).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import dynmb
from dynmb.costmodel.gpu import GPUCostModel
from dynmb.planning import slicing
from studies.scaling import scaling
from studies.slicing import longdoc


MODES = {"off": (False, None), "full": (True, None), "on": (True, None), "screened": (True, 2)}
"""mode -> (``WEIGH_ALTERNATIVES``, ``WEIGH_FINALISTS``); ``screened``'s finalists: ``--finalists``."""


def plan_times(trace_name: str, model: str, P: int, modes: list[str], cache: Path, finalists: int = 2) -> list[dict]:
    """One row per mode: CPU seconds of dynamic's plan and its predicted step."""
    trace = longdoc.load(trace_name, cache)
    cfg = scaling.model_for(model, [trace])
    batch = scaling.token_batch(trace, 500_000, 1, 0)
    cfg = scaling.resolve_stage_split(cfg, P, "auto", stage_cost=scaling.ideal_cost(batch, "ib"))
    rows = []
    for mode in modes:
        planner = dynmb.Planner(model=cfg, num_stages=P, memory_limit="80GiB", cost_model=GPUCostModel(cfg, P),
                                schedule="auto", oversize="split", recompute="auto")
        base = mode.removesuffix("-allkinds")
        on, top = MODES[base.rstrip("0123456789")]
        if base.startswith("screened"):
            top = int(base[len("screened"):] or finalists)
        with slicing.weighing_alternatives(on, top), slicing.kinds_screened(None if "allkinds" in mode else
                                                                          slicing.KIND_SCREEN):
            t0 = time.process_time()
            step = planner.plan(batch, method="dynamic")
            rows.append({"trace": trace_name, "model": model, "P": P, "mode": mode,
                         "plan_cpu_s": time.process_time() - t0, "step_s": step.sim.makespan_s,
                         "slice_shorts": step.plan.meta.get("slice_shorts"), "kind": step.plan.schedule_kind,
                         "kinds": step.plan.meta.get("schedule_auto") or {}})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default="wikitext2,longtail,pycode", help="trace names (longdoc's)")
    ap.add_argument("--models", default="llama2-7b,llama3.1-8b", help="model presets")
    ap.add_argument("--stages", default="8", help="pipeline depths P")
    ap.add_argument("--modes", default="off,screened,full", help="off, screened, full (on: full; module doc)")
    ap.add_argument("--finalists", type=int, default=2, help="screened: at most K whole searches")
    ap.add_argument("--cache", type=Path, default=Path("results/traces"), help="where the pycode trace is cached")
    args = ap.parse_args(argv)
    for name in args.traces.split(","):
        for model in args.models.split(","):
            for P in map(int, args.stages.split(",")):
                for r in plan_times(name, model, P, args.modes.split(","), args.cache, args.finalists):
                    print(f"{r['trace']} {r['model']} P{r['P']} {r['mode']}: {r['plan_cpu_s']:.1f} CPU s, "
                          f"step {r['step_s']:.4f} s, shorts {r['slice_shorts']}, kind {r['kind']} (" +
                          ", ".join(f"{k} {v:.4f}" for k, v in r["kinds"].items() if v is not None) + ")", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
