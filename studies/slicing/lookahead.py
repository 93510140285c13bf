"""The chain lookahead on and off (issue 39): ``dynamic``'s own sliced search (without the plain methods' plans,
``slice_alternatives``) of one ``longdoc`` cell under each schedule kind, once without the lookahead candidates
(``chain_lookaheads`` empty) and once with them; prints both steps, the lookahead kept and the highest peak.

    PYTHONPATH=$PWD nice -n 19 python3 -m studies.slicing.lookahead wikitext2 llama2-7b 8 --kinds 1f1b,zb-h1,zb
"""

from __future__ import annotations

import argparse
from pathlib import Path

import dynmb
import dynmb.planning.slicing as slicing
from dynmb.costmodel.gpu import GPUCostModel
from studies.scaling import scaling
from studies.slicing.longdoc import load


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("model")
    ap.add_argument("stages", type=int)
    ap.add_argument("--kinds", default="1f1b,zb-h1,zb", help="schedule kinds")
    ap.add_argument("--cache", type=Path, default=Path("results/traces"), help="where the pycode trace is cached")
    args = ap.parse_args(argv)
    trace = load(args.trace, args.cache)
    cfg = scaling.model_for(args.model, [trace])
    batch = scaling.token_batch(trace, 500_000, 1, 0)
    cfg = scaling.resolve_stage_split(cfg, args.stages, "auto", stage_cost=scaling.ideal_cost(batch, "ib"))
    cm = GPUCostModel(cfg, args.stages)
    own, real = slicing.slice_alternatives, slicing.chain_lookaheads
    try:
        slicing.slice_alternatives = lambda: []                        # type: ignore[assignment]
        for kind in args.kinds.split(","):
            planner = dynmb.Planner(model=cfg, num_stages=args.stages, memory_limit="80GiB", cost_model=cm,
                                    schedule=kind, oversize="split", recompute="auto")
            out = []
            for on in (False, True):
                slicing.chain_lookaheads = real if on else (lambda spec: ())  # type: ignore[assignment]
                step = planner.plan(batch, method="dynamic")
                out.append((step.sim.makespan_s, step.plan.meta.get("slice_lookahead"),
                            max(step.plan.predictions["pred_peak_bytes"]) / 2**30))
            print(f"{args.trace} {args.model} P{args.stages} {kind}: off {out[0][0]:.4f} s ({out[0][2]:.1f} GiB) -> on "
                  f"{out[1][0]:.4f} s (lookahead {out[1][1]}, {out[1][2]:.1f} GiB): {100 * (out[1][0] / out[0][0] - 1):+.2f}%",
                  flush=True)
    finally:
        slicing.slice_alternatives, slicing.chain_lookaheads = own, real
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
