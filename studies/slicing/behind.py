"""Why ``dynamic`` is behind a plain method on one ``longdoc`` cell (issue 39, "dynamic never behind any method").

The cell as ``longdoc.cell`` plans it (batch, layout, models, ``Planner(schedule="auto", oversize="split",
recompute="auto")``, 80 GiB). Printed, one line each: the plain method's plan (kind, microbatches, slices, cuts,
placement, recomputed share, filled rows, chain lookahead) and its step per kind (``meta.schedule_auto``);
``dynamic`` as shipped; ``dynamic``'s own sliced search per kind (the weighing off, ``own_searches_only``: what
``KIND_SCREEN`` ranks the kinds by); ``dynamic`` with the kind screen off (``kinds_screened(None)``: the weighing on
every kind); and ``dynamic`` with the schedule fixed to the method's kind. Where the last two reach the method's
step and the first does not, the kind screen is what drops it.

    PYTHONPATH=$PWD nice -n 15 python3 -m studies.slicing.behind --trace pycode --model llama3.1-8b --stages 8 \\
        --method fixed
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Iterator

import dynmb
from dynmb.planning import planner as planner_module
from dynmb.planning import slicing
from dynmb.planning.slicing import kinds_screened, own_searches_only, reuse_searches, weighing_alternatives
from studies.slicing import longdoc


def describe(label: str, step: dynmb.PlannedStep, cpu_s: float) -> str:
    """One line: ``label``, the step, kind, microbatches, the sliced plan's settings and the kinds' steps."""
    meta = step.plan.meta
    keys = ("slice_len", "slice_cuts", "slice_placement", "slice_recompute", "slice_recompute_share", "slice_fill",
            "slice_lookahead", "slice_shorts")
    sliced = ", ".join(f"{k.removeprefix('slice_')} {meta.get(k)}" for k in keys)
    kinds = meta.get("schedule_auto") or {}
    per_kind = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in kinds.items())
    chose = f", grouping {meta.get('grouping')}" if meta.get("grouping") else ""
    return (f"{label}: {step.sim.makespan_s:.5f} s{chose}, {step.plan.schedule_kind}, {step.plan.num_microbatches} mb, "
            f"{len(step.plan.slice_groups())} sliced ({sliced}); kinds: {per_kind}; {cpu_s:.1f} CPU s")




def _where(t: object) -> str:
    """A screen centre (``slicing._Try``) in a few words."""
    return (f"{t.slice_len} {'/'.join(t.placements)} fill {t.fills} lookahead {t.lookahead}"   # type: ignore[attr-defined]
            f"{' rc ' + str(t.rc_share) if t.use_rc else ''}")                                # type: ignore[attr-defined]


@contextlib.contextmanager
def screen_logged() -> Iterator[None]:
    """Within it ``slicing._screen`` prints its centres, each alternative's screened step and plan, and the
    alternatives whose whole search it runs (the weighing's finalists)."""
    screen, screened = slicing._screen, slicing._screened

    def logged_screen(job, found, alts):  # type: ignore[no-untyped-def]
        if found.best is not None:
            print(f"  screen of {job.spec.schedule_kind}: dynamic's best {found.best[0]:.4f}; centres: "
                  + "; ".join(_where(t) for t in slicing._centres(job, found)))
        whole = screen(job, found, alts)
        print(f"  whole searches: {', '.join(name for name, _ in whole)}")
        return whole

    def logged_screened(job, found, centres, packer):  # type: ignore[no-untyped-def]
        tried = screened(job, found, centres, packer)
        meta = None if tried.best is None else tried.best[1].meta
        print(f"    {'/'.join(str(x) for x in packer if x is not None)}: " + ("fits nowhere" if meta is None else
              f"{tried.best[0]:.4f} at {meta['slice_len']} {meta['slice_placement']} lookahead {meta['slice_lookahead']}"))
        return tried

    slicing._screen, slicing._screened = logged_screen, logged_screened
    try:
        yield
    finally:
        slicing._screen, slicing._screened = screen, screened


@contextlib.contextmanager
def final_logged() -> Iterator[None]:
    """Within it ``dynamic``'s final check (plans without slices: ``planner._plan_final``) prints, per kind, each
    alternative's step (``pruned``: its floor was above the best so far, not simulated; ``over``: over the limit)
    and the choice (``search.robust``)."""
    robust = planner_module.robust

    def logged(own, outcomes, cost_model):  # type: ignore[no-untyped-def]
        chosen, choice = robust(own, outcomes, cost_model)
        steps = ", ".join(f"{o.name} " + ("pruned" if o.verdict is None else f"{o.verdict.score:.5f}"
                                           + ("" if o.fits else " over")) for o in outcomes)
        own_s = "none" if own is None else f"{own[2].makespan_s:.5f}"
        print(f"  final check of {chosen[0].schedule_kind}: own {own_s}; {steps}; chosen {choice.candidate}")
        return chosen, choice

    planner_module.robust = logged
    try:
        yield
    finally:
        planner_module.robust = robust


def _auto(planner: dynmb.Planner, batch: object) -> None:
    """``dynamic`` under ``--schedule auto``: as shipped, its own searches only, every kind weighed."""
    with final_logged():
        shipped = longdoc.plan_method(planner, batch, "dynamic")
    print(describe("dynamic", *shipped), flush=True)
    if not shipped[0].plan.slice_groups():
        with planner_module.unpruned_final_check():
            print(describe("dynamic, final check unpruned", *longdoc.plan_method(planner, batch, "dynamic")))
        return
    with own_searches_only():
        own = longdoc.plan_method(planner, batch, "dynamic")
    print(describe("dynamic, own searches (weighing off)", *own), flush=True)
    with kinds_screened(None):
        print(describe("dynamic, every kind weighed", *longdoc.plan_method(planner, batch, "dynamic")), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="pycode")
    ap.add_argument("--model", default="llama3.1-8b")
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--method", default="fixed", help="the plain method dynamic is behind (name or name/mbs)")
    ap.add_argument("--cache", type=Path, default=Path("results/traces"))
    ap.add_argument("--kind-only", action="store_true", help="only the method and dynamic on the method's kind")
    args = ap.parse_args(argv)
    trace = longdoc.load(args.trace, args.cache)
    planner, batch, _ = longdoc.cell_planner(args.trace, trace, args.model, args.stages)
    with reuse_searches():
        other, cpu = longdoc.plan_method(planner, batch, args.method)
        print(describe(args.method, other, cpu), flush=True)
        if not args.kind_only:
            _auto(planner, batch)
        kind = other.plan.schedule_kind
        fixed = longdoc.cell_planner(args.trace, trace, args.model, args.stages, schedule=kind)[0]
        with screen_logged():
            print(describe(f"dynamic, schedule {kind}", *longdoc.plan_method(fixed, batch, "dynamic")), flush=True)
        with weighing_alternatives(finalists=None):
            print(describe(f"dynamic, schedule {kind}, every method's whole search",
                           *longdoc.plan_method(fixed, batch, "dynamic")), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
