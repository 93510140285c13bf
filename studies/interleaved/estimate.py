"""The interleaved schedule's fast makespan estimate against the simulator: before and after its own.

    python -m studies.interleaved.estimate [--random 200] [--traces sharegpt,wikitext2,longtail]
        [--stages 8,16] [--virtual 2] [--tokens 4M] [--dp 8] [--divisors 1,2,4,8,16,32]

Two estimates of an interleaved step on ``S = P v`` model chunks: ``as 1f1b`` (what the kind's
``estimate_as="1f1b"`` gave before ``dynmb.timing.makespan_interleaved``: 1F1B over S stages, each its own
GPU) and ``interleaved`` (``makespans(..., "interleaved", virtual=v)``), each against ``dynmb.timing.simulate``
of the schedule ``build_schedule("interleaved", S, m, virtual=v)``.

1. Random pipelines (``--random``; R in 2-8 GPUs, v in 2-4, m from 1 to 8 R, microbatch sizes equal,
   lognormal or heavy-tailed, per-chunk speeds, P2P time up to 30% of a forward).
2. The shipped traces: Llama-2-7B on the scaling study's H100 cost model (``studies/scaling/scaling.py``'s
   model, even split over P v chunks), ``--tokens`` per step over ``--dp`` replicas, the plans
   ``balanced`` makes for the interleaved kind at budgets memory maximum / d (``--divisors``: few to many
   microbatches), ``dynamic``'s plan, and ``dynamic (as 1f1b)``: the plan the dynamic packer makes when it
   plans with the estimate of before (a copy of the kind registered with ``estimate_as="1f1b"``), run as
   interleaved; the slowest replica by the packer's estimate of each plan,
   estimated both ways and simulated as ``planning.make_schedule`` builds it (80 GiB, memory model on).
   Rank agreement: over the pairs of plans of one cell (trace, P), the share each estimate orders as the
   simulator does (pairs within 0.5% by the simulator left out), and which plan each estimate ranks first.

Prints the error distribution (estimate / simulated - 1) per part and estimate.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import numpy as np

from dynmb.core.planspec import PlanSpec
from dynmb.timing.makespan import makespans
from dynmb.schedule.kinds import build_schedule
from dynmb.timing.simulate import simulate_costs
from studies.zerobubble.estimate import _dist  # (the same error summary as the zero-bubble estimate's)
from dynmb.costmodel.loader import Models

ESTIMATES = ("as 1f1b", "interleaved")
AS_1F1B = "interleaved-as-1f1b"
"""The interleaved kind estimated as 1F1B over the chunks (its ``estimate_as`` before its own estimate)."""


def register_as_1f1b() -> None:
    from dataclasses import replace

    from dynmb.schedule.kinds import get_kind, kind_names, register_kind
    if AS_1F1B not in kind_names():
        register_kind(replace(get_kind("interleaved"), name=AS_1F1B, estimate_as="1f1b", auto=False))


def estimates(F, B, comm, m: int, v: int) -> dict:
    return {"as 1f1b": float(makespans(F, B, comm, [m], "1f1b")[0]),
            "interleaved": float(makespans(F, B, comm, [m], "interleaved", virtual=v)[0])}


def random_case(rng: np.random.Generator) -> dict:
    R, v = int(rng.choice([2, 4, 8])), int(rng.choice([2, 3, 4]))
    S, m = R * v, int(rng.integers(1, 8 * R + 1))
    dist = str(rng.choice(["equal", "lognormal", "tail"]))
    tok = np.ones(m) if dist == "equal" else rng.lognormal(0, 0.5 if dist == "lognormal" else 1.2, m)
    F = rng.uniform(0.8, 1.3, S)[:, None] * (tok + 0.1 * tok ** 2)
    B = rng.uniform(1.8, 2.4, S)[:, None] * F
    comm = rng.uniform(0, 0.3) * tok
    sim = simulate_costs(build_schedule("interleaved", S, m, virtual=v), {"F": F, "B": B}, comm).makespan_s
    return {"R": R, "v": v, "m": m, "dist": dist, "sim": sim, "est": estimates(F, B, comm, m, v)}


def trace_cases(traces, stages, v, tokens, dp, divisors) -> list[dict]:
    from studies.scaling import scaling as S
    import dynmb
    from dynmb import data
    from dynmb.costmodel import gpu
    from dynmb.memory.model import get_memory_model
    from dynmb.packing import pack
    from dynmb.planning.replicas import make_schedule
    from dynmb.timing.simulate import comm_times
    out = []
    register_as_1f1b()
    for t in traces:
        trace = data.load_trace(t)
        cfg = S.model_for("llama2-7b", [trace])
        for P in stages:
            chunks = P * v
            batch = S.token_batch(trace, S.parse_tokens(tokens), dp, 0)
            cm, mm = gpu.GPUCostModel(cfg, chunks, link="ib"), get_memory_model(None, cfg, chunks)
            spec = PlanSpec(num_stages=chunks, virtual=v, memory_limit_bytes=80 << 30, dp=dp, oversize="truncate",
                            schedule_kind="interleaved")
            models = dict(models=Models(cm, mm))
            plans = {f"balanced/{d}": (lambda d=d: pack(batch, spec.with_(method="balanced", mbs=d), **models))
                     for d in divisors}
            plans["dynamic"] = lambda: pack(batch, spec.with_(method="dynamic"), **models)
            plans["dynamic (as 1f1b)"] = lambda: pack(batch, spec.with_(method="dynamic", schedule_kind=AS_1F1B), **models)
            seen = set()
            for name, make in plans.items():
                try:
                    plan = make()
                except Exception as e:          # noqa: BLE001  (a budget that does not fit: skipped)
                    print(f"{t} P{P} {name}: {e}", flush=True)
                    continue
                if plan.num_microbatches in seen and not name.startswith("dynamic"):
                    continue
                seen.add(plan.num_microbatches)
                est_r = np.asarray(plan.predictions["est_replica_makespan_s"] or [plan.predictions["est_makespan_s"]])
                sub = plan.replica(int(np.argmax(est_r))) if dp > 1 else plan
                cost = cm.plan_costs(sub)
                est = estimates(cost["F"], cost["B"], comm_times(cm, sub), sub.num_microbatches, v)
                res = dynmb.simulate(make_schedule(sub, "interleaved", virtual=v, models=Models(cm, mm)),
                                     sub, cm, mm)
                out.append({"trace": t, "P": P, "plan": name, "m": sub.num_microbatches, "est": est,
                            "sim": res.makespan_s, "peak": float(np.max(res.peak_bytes)) / (80 << 30)})
                print(f"{t} P{P} v{v} {name}: m {sub.num_microbatches} sim {res.makespan_s:.4f} "
                      + " ".join(f"{k} {x:.4f} ({x / res.makespan_s - 1:+.1%})" for k, x in est.items())
                      + f" peak/limit {out[-1]['peak']:.3f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--traces", default="sharegpt,wikitext2,longtail")
    ap.add_argument("--stages", default="8,16")
    ap.add_argument("--virtual", type=int, default=2)
    ap.add_argument("--tokens", default="4M")
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--divisors", default="1,2,4,8,16,32")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(a.seed)
    rand = [random_case(rng) for _ in range(a.random)]
    for k in ESTIMATES:
        if rand:
            print(f"random, {k}: {_dist(np.array([r['est'][k] / r['sim'] - 1 for r in rand]))}")
    if not a.traces:
        return 0
    rows = trace_cases(a.traces.split(","), [int(x) for x in a.stages.split(",")], a.virtual, a.tokens, a.dp,
                       [int(x) for x in a.divisors.split(",")])
    for k in ESTIMATES:
        print(f"traces, {k}: {_dist(np.array([r['est'][k] / r['sim'] - 1 for r in rows]))}")
        agree = total = first = cells = 0
        for _, grp in itertools.groupby(sorted(rows, key=lambda r: (r["trace"], r["P"])), key=lambda r: (r["trace"], r["P"])):
            grp = list(grp)
            cells += 1
            first += min(grp, key=lambda r: r["est"][k])["sim"] <= min(r["sim"] for r in grp) * 1.005
            for x, y in itertools.combinations(grp, 2):
                if abs(x["sim"] / y["sim"] - 1) < 0.005:
                    continue
                total += 1
                agree += (x["est"][k] < y["est"][k]) == (x["sim"] < y["sim"])
        print(f"traces, {k}: pairs of plans ordered as the simulator orders them: {agree} of {total}; "
              f"cells whose estimate-best plan is the simulated best (within 0.5%): {first} of {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
