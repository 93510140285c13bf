"""Which dimension of a static-shape step is worth balancing: data-parallel replicas D, pipeline microbatches M,
or accumulation groups G? (torchtitan #3938, simulated.)

    python studies/lockstep/lockstep_study.py --out results/lockstep_study

One global batch per cell: documents drawn from a shipped trace (or ``--lengths``) until
``D x G x M x T x --fill`` tokens, longer ones truncated to T; ``M = P`` microbatches per group, ``G``
(``--groups``) groups. Costs: ``dynmb.costmodel.gpu.GPUCostModel`` (H100, ``ib`` link) of the model preset
at P stages; a step of static rows is the sum over groups of the 1F1B makespan of every slot's slowest
replica (the replicas meet at every microbatch: FSDP collectives), ``dynmb.packing.lockstep``. Memory is not
checked for (a)-(e) (a static engine picks T to fit). Variants:

(a0) ``in-order``: no planning, the issue's "(a) in-order packing" -- ``--method in-order``
    (``dynmb.packing.in_order``: next-fit rows in sample order dealt round-robin to the replicas, as a
    distributed sampler and a concatenating loader do), each replica's rows in order, M per group
    (``layout_of_plan``);
(a) ``packed``: today's ``packed`` plan for D replicas (``dynmb.packing.pack``: best-fit-decreasing rows dealt
    largest first to the replica of least work, a stronger baseline), laid out the same way; (b) / (c) / (d): (a0)
    with the rows of one slot across D / of one pipeline
    call across M / of one position across G re-filled by the balanced fill (``rebalance``); (e) ``lockstep``
    (``plan_lockstep``, the same M); (f) ``dynamic``: dynmb's variable-shape plan at an 80 GiB limit, replicas
    independent, one group (its packer's estimate), only up to ``--dynamic-max-tokens``.
Why (e) gains what it gains (the same static grid, G groups of M microbatches of rows of T tokens):
``floor_s``: the step if no row cost any attention (every microbatch at its rows' linear work): no placement of
the documents into the grid can be faster (the makespan only grows with op costs), so ``1 - floor/a`` is the
most any row planner could gain; ``uniform_s``: every microbatch at the mean of (a)'s (perfect balance across
D, M and G at once, no skew); ``attn_share``: the part of (a)'s summed predicted F + B seconds that is
attention (the rest, the linear work of T tokens a row, is the same for every row).
``lb_s`` (``dynmb.packing.lockstep.step_lower_bound``): a lower bound of the predicted step of ANY row planner on
the cell's shape (G groups, D replicas, b = 1 rows of T tokens), not only on (a)'s grid. Derivation: whole documents
of at most T tokens need ``K >= K_min`` rows (Martello-Toth L2 >= ceil(tokens / T)), so a group runs ``M >= M_min =
ceil(K_min / (G D b))`` microbatches (``lb_M``); at the static shape an op costs ``c0 + k a`` (affine in the
attention work a; checked), and a microbatch's ``a >= sum s^2`` of its documents (a lone row's ``T^2`` is more), so
stage s's ops over the step cost at least ``G M_min c0_s + k_s sum_i s_i^2 / D`` (a slot runs at its slowest
replica, at least the replicas' mean; ``sum s_i^2`` is fixed by the truncated documents); each group's stage s
starts after one forward through stages ``< s`` and ends after one backward back through them (the cheapest
microbatch's F and B, plus P2P), and groups run in turn: ``lb = max_s G (fill_s + drain_s) + work_s``. ``lb/in-order``
and ``lb/packed`` above 0.95: no row planner at all is 5% faster than that baseline in the cell.
``--bound-only``: only (a0), (a), ``lb_s``, ``floor_s`` and the ideal (``bound.csv``, about a second a cell).
``e_per_group_s``: lockstep planned one group at a time (the batch cut in G parts in sample order, each
planned with G = 1 and the same M; nan where a part needs more rows, and above ``--per-group-max-dp``): ``e / e_per_group`` is what planning
the G groups jointly buys (item: is G worth a planner option).
``ideal_s``: ``dynmb.timing.bounds.ideal_bound`` of the batch (real tokens only, GEMMs saturated, D replicas);
``gap_x = x / ideal - 1``; ``share_D`` etc. = ``(a0 - b) / (a0 - e)``: the part of lockstep's gain over the
unplanned stream that re-filling one dimension alone buys. Cells of more than ``--max-tokens`` are skipped (the
box's CPU time); ``lockstep.csv`` is rewritten after every cell.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd

import dynmb
from dynmb import data
from dynmb.core.planspec import PlanSpec
from dynmb.costmodel import gpu
from dynmb.memory.model import get_memory_model
from dynmb.packing import PackingError, pack
from dynmb.packing.lockstep import (LockstepLayout, LockstepShape, layout_of_plan, plan_lockstep, rebalance,
                                    step_lower_bound)
from dynmb.timing.makespan import makespans
from dynmb.timing.bounds import ideal_bound
from dynmb.costmodel.loader import Models

log = logging.getLogger("lockstep_study")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default="longtail,wikitext2", help="shipped traces (comma-separated)")
    ap.add_argument("--lengths", type=Path, help="a length trace CSV instead of --traces")
    ap.add_argument("--P", default="4,16", help="pipeline stages")
    ap.add_argument("--D", default="8,64", help="data-parallel replicas")
    ap.add_argument("--T", default="4096,32768", help="row lengths")
    ap.add_argument("--models", default="llama2-7b,llama3.1-8b", help="model presets")
    ap.add_argument("--groups", type=int, default=2, help="G: accumulation groups per step")
    ap.add_argument("--fill", type=float, default=0.9, help="batch tokens / the rows' tokens")
    ap.add_argument("--dynamic-max-tokens", type=float, default=3e6, help="run (f) dynamic up to this many tokens")
    ap.add_argument("--per-group-max-dp", type=int, default=8, help="plan lockstep group by group up to this D")
    ap.add_argument("--max-tokens", type=float, default=float("inf"), help="skip cells of more batch tokens")
    ap.add_argument("--seed", type=int, default=0, help="batch seed")
    ap.add_argument("--out", type=Path, help="folder for lockstep.csv")
    ap.add_argument("--tables", help="only print the tables of these lockstep.csv files (comma-separated), merged")
    ap.add_argument("--bound-only", action="store_true",
                    help="only the baselines, the lower bound and the ideal of every cell (bound.csv; seconds a cell)")
    return ap


def batch(trace: np.ndarray, tokens: int, T: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, tokens, T])
    lens = trace[rng.integers(0, trace.size, int(tokens / trace.mean() * 1.3) + 64)]
    while lens.sum() < tokens:
        lens = np.concatenate([lens, trace[rng.integers(0, trace.size, 1024)]])
    k = int(np.searchsorted(np.cumsum(lens), tokens)) + 1
    return np.minimum(lens[:k], T).astype(np.int64)


def per_group(lens: np.ndarray, shape: LockstepShape, cm: gpu.GPUCostModel) -> float:
    """``e_per_group_s``: the batch cut in G parts of equal tokens (sample order), each planned with G = 1."""
    cuts = np.searchsorted(np.cumsum(lens), np.arange(1, shape.groups) * lens.sum() / shape.groups)
    try:
        return sum(plan_lockstep(part, replace(shape, groups=1), cm).step_s for part in np.split(lens, cuts))
    except PackingError:
        return float("nan")


def headroom(a: LockstepLayout, cm: gpu.GPUCostModel, T: int) -> dict[str, float]:
    """``floor_s``, ``uniform_s``, ``attn_share`` of (a)'s grid (module doc)."""
    P = a.F.shape[0]
    G, M, D, b = a.grid
    lin = cm.stage_costs(np.array([b]), np.array([T]), np.array([1.0]))
    comm = float(np.asarray(cm.comm_s(np.array([b]), np.array([T]))).reshape(-1)[0])

    def step(F: np.ndarray, B: np.ndarray) -> float:
        return float(makespans(F.reshape(P, G * M), B.reshape(P, G * M), comm, [M] * G, "1f1b").sum())

    ones = np.ones((P, G, M))
    floor = step(lin["F"][:, :1, None] * ones, lin["B"][:, :1, None] * ones)
    uniform = step(a.F.mean(axis=(1, 2, 3))[:, None, None] * ones, a.B.mean(axis=(1, 2, 3))[:, None, None] * ones)
    total = float((a.F + a.B).sum())
    linear = float((lin["F"] + lin["B"]).sum()) * G * M * D
    return {"floor_s": floor, "uniform_s": uniform, "attn_share": 1 - linear / total}


def saturated(cm: gpu.GPUCostModel) -> gpu.GPUCostModel:
    return gpu.GPUCostModel(cm.model_cfg, cm.num_stages, spec=replace(cm.spec, gemm_m_half=1e-9), comm=cm.comm)


class Context(NamedTuple):
    """What ``baselines`` built that the rest of a cell reuses (a NamedTuple: the smoke tests load this file
    without registering it as a module, which a dataclass needs)."""

    lens: np.ndarray
    models: Models
    shape: LockstepShape
    a: LockstepLayout
    a0: LockstepLayout


def baselines(trace_name: str, trace: np.ndarray, model: str, P: int, D: int, T: int,
              args: argparse.Namespace) -> tuple[dict, Context]:
    """The cell's batch, its two baselines' steps (in-order (a0), ``packed`` (a)), the lower bound ``lb_s`` of any
    row planner and the ideal: the cheap part of a cell (``--bound-only`` stops here)."""
    cfg = dynmb.model_config(model)
    cfg = replace(cfg, max_seq_len=max(cfg.max_seq_len, T))
    cm, mm = gpu.GPUCostModel(cfg, P, link="ib"), get_memory_model(None, cfg, P)
    lens = batch(trace, int(D * args.groups * P * T * args.fill), T, args.seed)
    spec = PlanSpec(method="packed", num_stages=P, dp=D, pack_len=T, memory_limit_bytes=2**50)
    shape = LockstepShape(pack_len=T, dp=D, groups=args.groups)
    a = layout_of_plan(pack(lens, spec, models=Models(cm, mm)), shape, cm)
    a0 = layout_of_plan(pack(lens, replace(spec, method="in-order"), models=Models(cm, mm)), shape, cm)
    lb = step_lower_bound(lens, shape, cm)
    row = {"trace": trace_name, "model": model, "P": P, "D": D, "T": T, "G": args.groups, "M": a.grid[1],
           "M_in_order": a0.grid[1], "docs": len(lens), "tokens": int(lens.sum()), "a_packed_s": a.step_s,
           "a0_in_order_s": a0.step_s, "lb_s": lb.lb_s, "lb_rows": lb.rows, "lb_M": lb.microbatches,
           "lb_attention_s": lb.attention_s, "ideal_s": ideal_bound(lens, saturated(cm), dp=D), **headroom(a, cm, T)}
    row.update(lb_vs_a0=lb.lb_s / a0.step_s, lb_vs_a=lb.lb_s / a.step_s, floor_vs_a=row["floor_s"] / a.step_s)
    return row, Context(lens, Models(cm, mm), shape, a, a0)


def cell(trace_name: str, trace: np.ndarray, model: str, P: int, D: int, T: int, args: argparse.Namespace) -> dict:
    t0 = time.process_time()
    row, ctx = baselines(trace_name, trace, model, P, D, T, args)
    lens, cm, shape, a, a0 = ctx.lens, ctx.models.cost, ctx.shape, ctx.a, ctx.a0
    M_a = a.grid[1]
    for dims, key in (("D", "b_D_s"), ("M", "c_M_s"), ("G", "d_G_s")):
        row[key] = rebalance(a0, lens, dims, shape, cm).step_s
    e = plan_lockstep(lens, replace(shape, microbatches=M_a), cm)
    row.update(e_lockstep_s=e.step_s, e_candidate=e.report["candidate"], e_order=e.report["order"],
               e_replica_spread=e.report["replica_spread"], a_replica_spread=a.report["replica_spread"],
               e_per_group_s=per_group(lens, replace(shape, microbatches=M_a), cm) if D <= args.per_group_max_dp
               else np.nan)
    row["f_dynamic_s"] = np.nan
    if lens.sum() <= args.dynamic_max_tokens:
        try:
            dyn = pack(lens, PlanSpec(method="dynamic", num_stages=P, dp=D, memory_limit_bytes=80 * 2**30,
                                      oversize="truncate"), models=ctx.models)
            row["f_dynamic_s"] = dyn.predictions.est_makespan_s
        except PackingError as err:
            row["f_error"] = str(err)[:80]
    for x in ("a0_in_order", "a_packed", "b_D", "c_M", "d_G", "e_lockstep", "f_dynamic"):
        row[f"gap_{x}"] = row[f"{x}_s"] / row["ideal_s"] - 1
    gain0 = row["a0_in_order_s"] - row["e_lockstep_s"]
    for x, key in (("D", "b_D"), ("M", "c_M"), ("G", "d_G")):
        row[f"share_{x}"] = (row["a0_in_order_s"] - row[f"{key}_s"]) / gain0 if gain0 > 0 else np.nan
    row["e_vs_a"] = row["e_lockstep_s"] / row["a_packed_s"]
    row["uniform_vs_a"] = row["uniform_s"] / row["a_packed_s"]
    row["e_vs_per_group"] = row["e_lockstep_s"] / row["e_per_group_s"]
    row["e_vs_a0"] = row["e_lockstep_s"] / row["a0_in_order_s"]
    row["f_vs_a"] = row["f_dynamic_s"] / row["a_packed_s"]
    row["e_vs_lb"] = row["e_lockstep_s"] / row["lb_s"]
    row["cpu_s"] = time.process_time() - t0
    return row


def markdown(df: pd.DataFrame) -> str:
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)     # noqa: E731
    lines = ["| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in df.itertuples(index=False)]
    return "\n".join(lines)


def summary(df: pd.DataFrame) -> str:
    """The criterion's numbers: (e) never slower than (a), the median e/a over every cell and per trace."""
    per_trace = df.groupby("trace").agg(e_vs_a0=("e_vs_a0", "median"), e_vs_a=("e_vs_a", "median"), floor_vs_a=("floor_vs_a", "median"),
                                        attn_share=("attn_share", "median"), cells_5pct=("e_vs_a", lambda x: (x <= 0.95).sum()))
    never = lambda x: f"{int((x <= 1 + 1e-12).sum())} of {len(x)}"     # noqa: E731
    return (f"\ncells {len(df)}; e never slower than in-order (a0) in {never(df.e_vs_a0)}, than packed (a) in "
            f"{never(df.e_vs_a)}; median e/a0 {df.e_vs_a0.median():.4f} (best {df.e_vs_a0.min():.4f}, cells <= 0.95: "
            f"{(df.e_vs_a0 <= 0.95).sum()}); median e/a "
            f"{df.e_vs_a.median():.4f} (best {df.e_vs_a.min():.4f}); median floor/a {df.floor_vs_a.median():.4f}; "
            f"cells with e/a <= 0.95: {(df.e_vs_a <= 0.95).sum()}\n"
            f"median shares (from a0): D {df.share_D.median():.2f} M {df.share_M.median():.2f} G {df.share_G.median():.2f}; "
            f"median e/a0 {df.e_vs_a0.median():.3f}; median e/e_per_group {df.e_vs_per_group.median():.4f}; "
            f"median f/a {df.f_vs_a.median():.3f}\n" + per_trace.to_string(float_format=lambda v: f"{v:.4f}"))


CELL_COLUMNS = {"trace": "trace", "model": "model", "P": "P", "D": "D", "T": "T", "M": "M", "M_in_order": "M in-order",
                "gap_a0_in_order": "gap in-order", "gap_a_packed": "gap packed", "gap_e_lockstep": "gap (e)",
                "e_vs_a0": "e/in-order", "e_vs_a": "e/packed", "lb_vs_a0": "lb/in-order", "lb_vs_a": "lb/packed",
                "floor_vs_a": "floor/packed", "attn_share": "attn share", "share_D": "D share", "share_M": "M share", "share_G": "G share", "f_vs_a": "f/packed",
                "e_candidate": "kept"}
"""The per-cell table's columns (README) and their headings."""


def per_trace(df: pd.DataFrame) -> pd.DataFrame:
    """Per trace: cells, e against both baselines (median, best, never slower), the median shares of D, M, G."""
    out = df.groupby("trace", sort=False).agg(
        cells=("e_vs_a0", "size"), e_in_order=("e_vs_a0", "median"), best_in_order=("e_vs_a0", "min"),
        never_slower_in_order=("e_vs_a0", lambda x: int((x <= 1 + 1e-12).sum())), e_packed=("e_vs_a", "median"),
        best_packed=("e_vs_a", "min"), never_slower_packed=("e_vs_a", lambda x: int((x <= 1 + 1e-12).sum())),
        D=("share_D", "median"), M=("share_M", "median"), G=("share_G", "median"))
    out.loc["all"] = [len(df), df.e_vs_a0.median(), df.e_vs_a0.min(), int((df.e_vs_a0 <= 1 + 1e-12).sum()),
                      df.e_vs_a.median(), df.e_vs_a.min(), int((df.e_vs_a <= 1 + 1e-12).sum()),
                      df.share_D.median(), df.share_M.median(), df.share_G.median()]
    return out.reset_index()


BOUND_COLUMNS = {"trace": "trace", "model": "model", "P": "P", "D": "D", "T": "T", "lb_M": "M min", "M": "M",
                 "M_in_order": "M in-order", "gap_a0_in_order": "gap in-order", "gap_a_packed": "gap packed",
                 "lb_vs_a0": "lb/in-order", "lb_vs_a": "lb/packed", "floor_vs_a": "floor/packed"}
"""The bound table's columns (README) and their headings."""


def bound_summary(df: pd.DataFrame) -> str:
    """The bar's question: in how many cells can no row planner be 5% faster than each baseline."""
    df = df.assign(gap_a0_in_order=df.a0_in_order_s / df.ideal_s - 1, gap_a_packed=df.a_packed_s / df.ideal_s - 1)
    per = df.groupby("trace", sort=False).agg(cells=("lb_vs_a0", "size"), lb_in_order=("lb_vs_a0", "median"),
                                              over_in_order=("lb_vs_a0", lambda x: int((x > 0.95).sum())),
                                              lb_packed=("lb_vs_a", "median"),
                                              over_packed=("lb_vs_a", lambda x: int((x > 0.95).sum())))
    per.loc["all"] = [len(df), df.lb_vs_a0.median(), int((df.lb_vs_a0 > 0.95).sum()), df.lb_vs_a.median(),
                      int((df.lb_vs_a > 0.95).sum())]
    extra, cols = "", dict(BOUND_COLUMNS)
    if "e_vs_a0" in df:
        cols.update(e_vs_a0="e/in-order", e_vs_lb="e/lb")
        extra = (f"\nmedian e/lb {df.e_vs_lb.median():.4f}; e/in-order <= 0.95 in {(df.e_vs_a0 <= 0.95).sum()} cells, "
                 f"lb/in-order <= 0.95 in {(df.lb_vs_a0 <= 0.95).sum()}")
    return (markdown(df[list(cols)].rename(columns=cols)) + "\n\n" + markdown(per.reset_index())
            + f"\n\ncells {len(df)}: lb/in-order > 0.95 in {int((df.lb_vs_a0 > 0.95).sum())}, median "
            f"{df.lb_vs_a0.median():.4f}; lb/packed > 0.95 in {int((df.lb_vs_a > 0.95).sum())}, median "
            f"{df.lb_vs_a.median():.4f}" + extra)


def print_tables(df: pd.DataFrame) -> None:
    """The per-cell table, the per-trace table and the summary (stdout); the bound's tables alone for a
    ``--bound-only`` file."""
    if "lb_vs_a0" in df:
        print(bound_summary(df))
        print()
    if "e_vs_a0" not in df:
        return
    cells = {k: v for k, v in CELL_COLUMNS.items() if k in df}
    print(markdown(df[list(cells)].rename(columns=cells)))
    print()
    print(markdown(per_trace(df)))
    print(summary(df))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.tables:
        print_tables(pd.concat([pd.read_csv(f) for f in args.tables.split(",")], ignore_index=True))
        return 0
    if args.out is None:
        raise SystemExit("lockstep_study: --out is required (or --tables)")
    ints = lambda s: [int(x) for x in s.split(",")]     # noqa: E731
    traces = {args.lengths.stem: data.load_trace(args.lengths)} if args.lengths else \
        {n: data.load_trace(n) for n in args.traces.split(",")}
    rows = []
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / ("bound.csv" if args.bound_only else "lockstep.csv")
    grid = itertools.product(traces.items(), args.models.split(","), ints(args.P), ints(args.D), ints(args.T))
    for (name, trace), model, P, D, T in grid:
        if D * args.groups * P * T * args.fill > args.max_tokens:
            continue
        lens = np.asarray(trace, dtype=np.int64)
        rows.append(baselines(name, lens, model, P, D, T, args)[0] if args.bound_only else
                    cell(name, lens, model, P, D, T, args))
        pd.DataFrame(rows).to_csv(out, index=False)
        log.info("%s %s P%d D%d T%d: lb/a0 %.3f lb/a %.3f", name, model, P, D, T, rows[-1]["lb_vs_a0"],
                 rows[-1]["lb_vs_a"])
    print_tables(pd.DataFrame(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
