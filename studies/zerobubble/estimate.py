"""The zero-bubble makespan estimates (``dynmb.timing.makespan_zb``, ``dynmb.timing.makespan_zbv``) against the simulator.

    python -m studies.zerobubble.estimate [--random 200] [--traces sharegpt,wikitext2,longtail]
        [--stages 2,4,8,16] [--tokens 1M] [--dp 8] [--divisors 1,2,4,8,16]

1. Random pipelines (``--random`` of them; P in 2-16, m from P / 2 to 16 P, microbatch sizes equal,
   lognormal or heavy-tailed, per-stage speeds, P2P time up to 30% of a forward, I / W shares of B
   drawn per stage): the estimate ``makespans(..., kind, shares=the true I / B, W / B)`` against
   ``simulate`` of the schedule ``zb_h1`` / ``zb_limit_aware`` (no memory limit) / ``zb_v`` (the P stages as
   P / 2 ranks of two chunks) builds with the simulator as judge: the estimate's own error.
2. The shipped traces: Llama-2-7B on the scaling study's H100 cost model (``studies/scaling/scaling.py``'s
   models, even split), ``--tokens`` per step over ``--dp`` replicas, the plans ``balanced`` makes at
   budgets memory maximum / d (``--divisors``: few to many microbatches); the slowest replica by the
   packer's estimate of each plan, estimated as the packers do (``shares`` from ``backward_shares``)
   and simulated as ``planning.make_schedule`` builds it for zb-h1 and zb (80 GiB, memory model on).
   Rank agreement: over the pairs of plans of one cell (trace, P, kind), the share the estimate
   orders as the simulator does (pairs within 0.5% by the simulator left out).

Prints the error distribution (estimate / simulated - 1) per part and kind.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import numpy as np

from dynmb.timing.makespan import makespans
from dynmb.timing.makespan_zb import backward_shares
from dynmb.schedule.vshape import zb_v
from dynmb.schedule.zerobubble import ZBInputs, zb_h1, zb_limit_aware
from dynmb.timing.simulate import simulate_costs
from dynmb.core.planspec import PlanSpec
from dynmb.costmodel.loader import Models


def _evaluator(F, B, I, W, comm):  # noqa: E741
    """The simulated step of a built schedule at these per-op costs (the judge ``best_*`` search takes)."""
    costs = {"F": F, "B": B, "I": I, "W": W}
    return lambda s: (simulate_costs(s, costs, comm).makespan_s, np.zeros(F.shape[0]))


def random_case(rng: np.random.Generator) -> dict:
    P = int(rng.choice([2, 4, 8, 16]))
    m = int(rng.choice([max(1, P // 2), P, 2 * P, 4 * P, 8 * P, 16 * P]))
    dist = str(rng.choice(["equal", "lognormal", "tail"]))
    tok = np.ones(m) if dist == "equal" else rng.lognormal(0, 0.5 if dist == "lognormal" else 1.2, m)
    F = rng.uniform(0.8, 1.3, P)[:, None] * (tok + 0.1 * tok ** 2)
    B = rng.uniform(1.8, 2.4, P)[:, None] * F
    wshare = rng.uniform(0.3, 0.55, P)[:, None]
    W, I = wshare * B, (1.04 - wshare) * B  # noqa: E741
    comm = rng.uniform(0, 0.3) * tok
    ev = _evaluator(F, B, I, W, comm)
    inp = ZBInputs(F, B, I, W, comm, np.ones((P, m), dtype=bool))
    sims = {"zb-h1": ev(zb_h1(P, m, inp, evaluate=ev))[0],
            "zb": ev(zb_limit_aware(P, m, inp, [np.inf] * P, np.inf, ev))[0], "zb-v": ev(zb_v(P, m, inp, evaluate=ev))[0]}
    shares = np.stack([1.04 - wshare[:, 0], wshare[:, 0]])
    est = {k: float(makespans(F, B, comm, [m], k, shares=shares, virtual=2 if k == "zb-v" else 1)[0]) for k in sims}
    return {"P": P, "m": m, "dist": dist, "sim": sims, "est": est}


def trace_cases(traces, stages, tokens, dp, divisors) -> list[dict]:
    from studies.scaling import scaling as S
    import dynmb
    from dynmb import data
    from dynmb.packing import pack
    from dynmb.planning.planner import make_schedule
    from dynmb.timing.simulate import comm_times
    out = []
    for t in traces:
        trace = data.load_trace(t)
        for P in stages:
            args = S.build_parser().parse_args(["--traces", t, "--tokens", tokens, "--stages", str(P), "--dp", str(dp),
                                                "--methods", "balanced"])
            c = S.configurations(args)[0]
            cell = S.Cell(c, trace, S.model_for(args.model, [trace]))
            _, cm, _, mm = cell.models("even")
            shares = backward_shares(cm, cell.batch, P)
            seen = set()
            for kind in ("zb-h1", "zb"):
                for d in divisors:
                    plan = pack(cell.batch, PlanSpec(method="balanced", num_stages=P,
                                                     memory_limit_bytes=c["memory_limit_bytes"], mbs=d, dp=dp,
                                                     oversize=c["oversize"], schedule_kind=kind), models=Models(cm, mm))
                    if (kind, plan.num_microbatches) in seen:
                        continue
                    seen.add((kind, plan.num_microbatches))
                    est_r = np.asarray(plan.predictions["est_replica_makespan_s"] or [plan.predictions["est_makespan_s"]])
                    sub = plan.replica(int(np.argmax(est_r))) if dp > 1 else plan
                    cost = cm.plan_costs(sub)
                    est = float(makespans(cost["F"], cost["B"], comm_times(cm, sub), [sub.num_microbatches], kind,
                                          shares=shares)[0])
                    sim = dynmb.simulate(make_schedule(sub, kind, models=Models(cm, mm)), sub, cm, mm).makespan_s
                    out.append({"trace": t, "P": P, "kind": kind, "div": d, "m": sub.num_microbatches, "est": est, "sim": sim})
                    print(f"{t} P{P} {kind} balanced/{d}: m {sub.num_microbatches} est {est:.4f} sim {sim:.4f} "
                          f"({est / sim - 1:+.2%})", flush=True)
    return out


def _dist(err: np.ndarray) -> str:
    q = np.percentile(err, [0, 5, 50, 95, 100])
    return (f"n {len(err)}: min {q[0]:+.1%} p5 {q[1]:+.1%} median {q[2]:+.1%} p95 {q[3]:+.1%} max {q[4]:+.1%}, "
            f"mean |err| {np.mean(np.abs(err)):.1%}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--traces", default="sharegpt,wikitext2,longtail")
    ap.add_argument("--stages", default="2,4,8,16")
    ap.add_argument("--tokens", default="1M")
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--divisors", default="1,2,4,8,16")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(a.seed)
    rand = [random_case(rng) for _ in range(a.random)]
    for kind in ("zb-h1", "zb", "zb-v"):
        err = np.array([r["est"][kind] / r["sim"][kind] - 1 for r in rand])
        if len(err):
            print(f"random, {kind}: {_dist(err)}")
    if not a.traces:
        return 0
    rows = trace_cases(a.traces.split(","), [int(x) for x in a.stages.split(",")], a.tokens, a.dp,
                       [int(x) for x in a.divisors.split(",")])
    for kind in ("zb-h1", "zb"):
        sel = [r for r in rows if r["kind"] == kind]
        print(f"traces, {kind}: {_dist(np.array([r['est'] / r['sim'] - 1 for r in sel]))}")
        agree = total = 0
        for (_, _), grp in itertools.groupby(sorted(sel, key=lambda r: (r["trace"], r["P"])), key=lambda r: (r["trace"], r["P"])):
            for x, y in itertools.combinations(list(grp), 2):
                if abs(x["sim"] / y["sim"] - 1) < 0.005:
                    continue
                total += 1
                agree += (x["est"] < y["est"]) == (x["sim"] < y["sim"])
        print(f"traces, {kind}: pairs of plans ordered as the simulator orders them: {agree} of {total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
