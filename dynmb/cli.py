"""The ``dynmb`` command. Thin: parses flags, calls the library, prints.

Verbs (``dynmb VERB --help`` for each): datasets, lengths, plan, schedule,
simulate, memory, profile, fit, run, compare.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

__all__ = ["main", "build_parser"]


# --------------------------------------------------------------------------
# shared flag groups
# --------------------------------------------------------------------------
def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="small",
                   help="model: a preset (tiny, small (CPU default), gpt2, gpt2-medium, llama-1b, llama-7b, deep-13b), "
                        "a preset with overrides (small:d_model=512,n_layers=8) or a JSON file of ModelConfig fields")
    p.add_argument("--attention", default=None, choices=["auto", "dense"],
                   help="auto (default): causal attention without a mask for one document per row, document-causal "
                        "(sum of s_i^2) for packed rows; dense: the (s, s) mask on every row (ablation)")


def _model_cfg(args: argparse.Namespace):
    """The ModelConfig of --model and --attention."""
    from dynmb.config import model_config

    return model_config(args.model, attention=getattr(args, "attention", None))


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_data_flags(p: argparse.ArgumentParser, *, global_batch: int = 64) -> None:
    src = p.add_mutually_exclusive_group(required=False)
    src.add_argument("--dataset", default=None, help="shipped length trace name (see `dynmb datasets`)")
    src.add_argument("--lengths", default=None, help="a length-trace CSV (header + one column `length`)")
    p.add_argument("--global-batch", type=int, default=global_batch,
                   help=f"sequences per global batch (default {global_batch})")
    p.add_argument("--seed", type=int, default=0, help="seed for sampling the global batch (default 0)")


def _add_packing_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    p.add_argument("--memory-limit", default="1GiB", help="per-GPU memory limit, e.g. 2GiB, 512MiB (default 1GiB)")
    p.add_argument("--method", default="dynamic", help="fixed, sorted, packed, token-budget, dynapipe, dynamic (default dynamic)")
    p.add_argument("--mbs", type=int, default=None, help="microbatch size for fixed-size methods (default: the largest that fits)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel pipelines the global batch is split over (default 1)")
    p.add_argument("--schedule-kind", default="1f1b", help="schedule the plan is made for: gpipe, 1f1b, interleaved, memory-aware, zb-h1, zb (default 1f1b)")
    p.add_argument("--cost-model", default=None, help="fitted cost-model JSON (`dynmb fit`); default: analytic stand-in")
    p.add_argument("--memory-model", default=None, help="fitted memory-model JSON (`dynmb memory`); default: analytic")
    p.add_argument("--oversize", default="error", choices=["error", "truncate", "drop"],
                   help="a sequence that cannot fit alone: error (default), truncate it to fit, or drop it (both reported)")
    _add_recompute_flag(p)
    _add_shape_flags(p)


def _add_recompute_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recompute", default="never", choices=["never", "always", "auto"],
                   help="full activation recomputation per microbatch: never (default), always, or auto (the "
                        "packer recomputes the microbatches for which it pays; dynmb.recompute)")


def _add_shape_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pack-len", type=_positive_int, default=None,
                   help="row length of the packed method (default: the longest row that fits under the limit)")
    p.add_argument("--round-to", type=_positive_int, default=1,
                   help="every microbatch's padded_len is a multiple of N (default 1; 64 suits GPUs)")


def _add_run_shape_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prewarm", action="store_true",
                   help="run one forward+backward of every distinct microbatch shape of the planned steps first")
    p.add_argument("--no-expandable-segments", action="store_true",
                   help="CUDA: do not set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the default)")


def _not_yet(name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        print(f"dynmb {name}: not implemented yet", file=sys.stderr)
        return 2
    return run


# --------------------------------------------------------------------------
# verbs — each _cmd_X(args) -> exit code
# --------------------------------------------------------------------------
def _cmd_datasets(args: argparse.Namespace) -> int:
    from dynmb.data import data_dir, datasets_table
    df = datasets_table()
    if df.empty:
        raise ValueError(f"no shipped length traces in {data_dir()} (set DYNMB_DATA_DIR?)")
    if args.json:
        print(json.dumps(df.to_dict(orient="records")))
    else:
        print(df.to_string(index=False, formatters={c: "{:.1f}".format for c in ("mean", "median", "p90", "p99")}))
    return 0


def _cmd_lengths(args: argparse.Namespace) -> int:
    from dynmb.data import build_trace, save_trace, trace_stats
    lengths = build_trace(args.corpus, args.field, args.tokenizer, join=args.join, txt_split=args.txt_split,
                          normalize=args.normalize, skip_empty=args.skip_empty, progress=not args.no_progress)
    path = save_trace(lengths, args.output)
    st = trace_stats(lengths)
    print(f"wrote {path}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in st.items()))
    return 0


def _load_batch(args: argparse.Namespace, step: int = 0):
    """The global batch selected by --dataset/--lengths, --global-batch, --seed."""
    from .data import load_trace, sample_batch

    if args.dataset is None and args.lengths is None:
        args.dataset = "sharegpt"
    trace = load_trace(args.lengths if args.lengths is not None else args.dataset)
    return sample_batch(trace, args.global_batch, args.seed, step=step)


def _cmd_plan(args: argparse.Namespace) -> int:
    from .config import ModelConfig, parse_bytes
    from .costmodel import get_cost_model
    from .memory import get_memory_model
    from .planner import plan_step

    cfg = _model_cfg(args)
    batch = _load_batch(args, args.step)
    plan, _, sim = plan_step(
        batch, method=args.method, model_cfg=cfg, num_stages=args.stages,
        memory_limit_bytes=parse_bytes(args.memory_limit), schedule_kind=args.schedule_kind,
        mbs=args.mbs, dp=args.dp, oversize=args.oversize, pack_len=args.pack_len, round_to=args.round_to,
        recompute=args.recompute, cost_model=get_cost_model(args.cost_model, cfg, args.stages),
        memory_model=get_memory_model(args.memory_model, cfg, args.stages),
        meta={"dataset": args.dataset or args.lengths, "seed": args.seed, "step": args.step, "model": args.model},
    )
    if args.output:
        plan.save(args.output)
    summary = {
        "method": plan.method, "num_sequences": plan.num_sequences, "num_microbatches": plan.num_microbatches,
        "real_tokens": plan.real_tokens, "computed_tokens": plan.computed_tokens,
        "padding_fraction": round(plan.padding_fraction, 6),
        "memory_limit_bytes": plan.memory_limit_bytes,
        "pred_peak_bytes": plan.predictions["pred_peak_bytes"],
        "pred_step_s": plan.predictions["pred_step_s"], "mean_bubble": plan.predictions["mean_bubble"],
        "plan_s": plan.predictions["plan_s"], "mbs": plan.meta.get("mbs"),
        "dropped": len(plan.meta.get("dropped", [])), "truncated": len(plan.meta.get("truncated", [])),
        "recomputed": int(plan.recompute_mask().sum()),
        "pack_len": plan.meta.get("pack_len"), "round_to": args.round_to, "attention": cfg.attention,
        "distinct_shapes": len({(mb.batch, mb.padded_len) for mb in plan.microbatches}),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        for k, v in summary.items():
            print(f"{k:>20}: {v}")
        if args.output:
            print(f"{'plan':>20}: {args.output}")
    return 0
def _cmd_schedule(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dynmb.config import ModelConfig, format_bytes
    from dynmb.costmodel import get_cost_model
    from dynmb.memory import get_memory_model
    from dynmb.schedule import build_schedule, to_csv, validate
    from dynmb.schedule.reorder import reorder
    from dynmb.simulate import memory_inputs, simulate
    from dynmb.types import Plan

    plan = Plan.load(args.plan)
    if plan.dp > 1:
        raise ValueError(f"{args.plan} holds {plan.dp} data-parallel pipelines; `dynmb schedule` takes a "
                         f"one-pipeline plan (plan with --dp 1, or use `dynmb run`, which schedules each replica)")
    if plan.schedule_kind != args.kind:
        print(f"dynmb schedule: note: the plan was packed for {plan.schedule_kind!r}, scheduling it as "
              f"{args.kind!r}; its memory guarantee is for the former", file=sys.stderr)
    cfg = _model_cfg(args)
    cm = get_cost_model(args.cost_model, cfg, plan.num_stages)
    mm = get_memory_model(args.memory_model, cfg, plan.num_stages)
    plan = reorder(plan, args.reorder, cost_model=cm, memory_model=mm, schedule_kind=args.kind, virtual=args.virtual)
    kw = {}
    if args.kind == "memory-aware":
        act, tr, state = memory_inputs(mm, plan)
        kw = dict(act_bytes=act, state_bytes=state, limit_bytes=plan.memory_limit_bytes, transient_bytes=tr)
    if args.kind in ("zb-h1", "zb"):
        from dynmb.zbplan import build_zb
        sched = build_zb(plan, args.kind, cost_model=cm, memory_model=mm)
    else:
        sched = build_schedule(args.kind, plan.num_stages, plan.num_microbatches, virtual=args.virtual, **kw)
    validate(sched)
    to_csv(sched, args.output)
    out = Path(args.output)
    plan_out = Path(args.plan_output) if args.plan_output else out.with_name(out.stem + ".plan.json")
    plan.save(plan_out)
    sim = simulate(sched, plan, cm, mm)
    peak = max(sim.peak_bytes_rank) if sim.peak_bytes_rank is not None else float("nan")
    print(f"{args.kind} schedule: {sched.num_ranks} ranks, {sched.num_stages} stages, {sched.num_microbatches} "
          f"microbatches, reorder {args.reorder}; predicted makespan {sim.makespan_s:.4g} s, mean bubble "
          f"{sim.mean_bubble:.3f}, peak {format_bytes(peak)} / limit {format_bytes(plan.memory_limit_bytes)}"
          f"{'' if sim.fits else ' (OVER THE LIMIT)'}")
    print(f"wrote {out} and {plan_out}")
    return 0
def _cmd_simulate(args: argparse.Namespace) -> int:
    from dynmb.config import ModelConfig, format_bytes
    from dynmb.costmodel import get_cost_model
    from dynmb.memory import get_memory_model
    from dynmb.schedule import from_csv
    from dynmb.simulate import simulate
    from dynmb.types import Plan

    plan = Plan.load(args.plan)
    sched = from_csv(args.schedule, num_microbatches=plan.num_microbatches)
    cfg = _model_cfg(args)
    cm = get_cost_model(args.cost_model, cfg, plan.num_stages)
    mm = get_memory_model(args.memory_model, cfg, plan.num_stages)
    sim = simulate(sched, plan, cm, mm)
    if args.timeline:
        sim.timeline.to_csv(args.timeline, index=False)
    if args.gantt:
        from dynmb.plots import gantt

        gantt(sim.timeline, args.gantt, title=f"{plan.method} plan, {sched.num_ranks} ranks, "
              f"{sched.num_microbatches} microbatches: predicted {sim.makespan_s:.4g} s, mean bubble {sim.mean_bubble:.2f}")
    summary = {
        "makespan_s": sim.makespan_s, "mean_bubble": sim.mean_bubble,
        "bubble_fraction": [float(x) for x in sim.bubble_fraction],
        "peak_bytes": [int(round(x)) for x in sim.peak_bytes],
        "peak_bytes_rank": [int(round(x)) for x in sim.peak_bytes_rank],
        "limit_bytes": int(plan.memory_limit_bytes), "fits": sim.fits,
        "num_ranks": sched.num_ranks, "num_stages": sched.num_stages, "num_microbatches": sched.num_microbatches,
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"predicted makespan {sim.makespan_s:.4g} s, mean bubble {sim.mean_bubble:.3f} "
          f"({sched.num_ranks} ranks, {sched.num_microbatches} microbatches)")
    for r, (b, busy) in enumerate(zip(sim.bubble_fraction, sim.busy_s)):
        print(f"  rank {r}: busy {busy:.4g} s, bubble {b:.3f}, peak {format_bytes(sim.peak_bytes_rank[r])}")
    print(f"limit {format_bytes(plan.memory_limit_bytes)}: {'fits' if sim.fits else 'OVER THE LIMIT'}")
    return 0
def _cmd_memory(args: argparse.Namespace) -> int:
    import numpy as np
    import pandas as pd

    from dynmb.config import ModelConfig, format_bytes
    from dynmb.memory import MemoryModel
    from dynmb.runtime.meter import measure_grid

    cfg = _model_cfg(args)
    rows, lens = ([1, 2, 4], [32, 64, 128, 256]) if args.quick else ([1, 2, 4, 8], [64, 128, 256, 512, 1024])
    if args.device == "cuda" and not args.quick:
        lens += [2048, 4096]    # a GPU has the room: cover the long sequences the traces hold
    df = pd.DataFrame(measure_grid(cfg, args.stages, rows, lens, device=args.device))
    pts = sorted({(b, s) for b, s in zip(df.rows, df.padded_len)})
    pick = np.random.default_rng(0).choice(len(pts), size=max(1, len(pts) // 4), replace=False)
    held = {pts[i] for i in pick}                       # a random quarter of the (rows, padded_len) points
    mask = np.array([(b, s) in held for b, s in zip(df.rows, df.padded_len)])
    mm = MemoryModel.analytic(cfg, args.stages).fit(df, holdout=mask)
    df["pred_act_bytes"] = [float(mm.activation_bytes(st, b, s)[0]) for st, b, s in zip(df.stage, df.rows, df.padded_len)]
    df["pred_peak_bytes"] = [float(mm.state_bytes[st] + mm.activation_bytes(st, b, s)[0] + mm.transient_bytes(st, b, s)[0])
                             for st, b, s in zip(df.stage, df.rows, df.padded_len)]
    df["heldout"] = mask
    print(f"dynmb memory: {cfg.name} at {args.stages} stages on {args.device}: {len(df)} samples, "
          f"{int(mask.sum())} held out; states per stage {[format_bytes(x) for x in mm.state_bytes]}")
    print(f"{'stage':>5} {'rows':>4} {'len':>5} {'act meas':>12} {'act pred':>12} {'err':>7} {'peak meas':>12} {'peak pred':>12} {'err':>7}")
    for r in df[df.heldout].itertuples():
        print(f"{r.stage:>5} {r.rows:>4} {r.padded_len:>5} {r.act_bytes:>12} {r.pred_act_bytes:>12.0f} "
              f"{(r.pred_act_bytes - r.act_bytes) / r.act_bytes:>+7.2%} {r.peak_bytes:>12} {r.pred_peak_bytes:>12.0f} "
              f"{(r.pred_peak_bytes - r.peak_bytes) / r.peak_bytes:>+7.2%}")
    rep = mm.report
    print(f"held-out max relative error: act {rep.get('act_heldout_max_rel_err', float('nan')):.3%}, "
          f"peak {rep.get('peak_heldout_max_rel_err', float('nan')):.3%}")
    mm.save(args.output)
    if args.samples:
        df.to_csv(args.samples, index=False)
    print(f"wrote {args.output}" + (f" and {args.samples}" if args.samples else ""))
    return 0
def _cmd_profile(args: argparse.Namespace) -> int:
    from dynmb.config import ModelConfig
    from dynmb.profile import profile
    cfg = _model_cfg(args)
    df = profile(cfg, args.stages, quick=args.quick, max_len=args.max_len, repeats=args.repeats, warmup=args.warmup,
                 device=args.device, threads=args.threads, output=args.output, comm=args.comm,
                 memory=not args.no_memory, concurrent=args.concurrent, token_cap=args.token_cap, split=args.split)
    fb = df[df["op"].isin(["F", "B"])]
    med = fb.groupby(["stage", "op"])["time_s"].agg(["size", "median", "max"])
    print(f"wrote {args.output}: {len(df)} samples ({len(fb.groupby(['stage', 'rows', 'padded_len', 'packed']))} stage x points)")
    print(med.to_string())
    return 0
def _cmd_fit(args: argparse.Namespace) -> int:
    from dynmb.config import ModelConfig
    from dynmb.costmodel import fit_cost_model, kfold_error, noise_floor
    from dynmb.profile import load_samples
    cfg = _model_cfg(args)
    df = load_samples(args.samples)
    for col, want in (("model", cfg.name), ("num_stages", args.stages)):
        got = set(df[col].dropna().unique()) if col in df else set()
        if got - {want}:
            raise ValueError(f"samples were measured for {col}={sorted(got)}, not {want}; pass --model/--stages to match")
    model = fit_cost_model(df, cfg, args.stages, kind=args.kind, folds=args.folds)
    err = kfold_error(df, args.kind, args.folds, model_cfg=cfg, num_stages=args.stages)
    tab = err.merge(noise_floor(df), on=["stage", "op"], how="left")
    tab["mape/noise"] = tab["mape"] / tab["noise"]
    print(f"{args.kind} cost model, {args.folds}-fold held-out error over points (vs point medians); "
          f"noise = median |t_r - median| / median over repeats")
    print(tab.to_string(index=False, float_format=lambda x: f"{x:.4f}"))
    if hasattr(model, "coefficients"):
        print("coefficients: t = c0 + c1_tok*b*s + c2_tok_len*b*s^2 + c3_row*b  (seconds; b rows, s padded_len)")
        print(model.coefficients().to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    print(f"comm: {model.comm}")
    model.save(args.output)
    print(f"wrote {args.output}")
    if args.plot:
        from dynmb.plots import cost_fit
        cost_fit(df, model, args.plot, errors=tab)
        print(f"wrote {args.plot}")
    return 0
def _cmd_run(args: argparse.Namespace) -> int:
    from dynmb.config import ModelConfig, PipelineConfig, RunConfig, parse_bytes
    from dynmb.runtime.launch import default_backend_device, launch

    backend, device = default_backend_device()
    kind = args.schedule if args.schedule != "1f1b" else args.schedule_kind
    cfg = RunConfig(
        model=_model_cfg(args),
        pipeline=PipelineConfig(num_stages=args.stages, virtual=args.virtual, schedule=kind, reorder=args.reorder,
                                memory_limit_bytes=parse_bytes(args.memory_limit)),
        dataset=args.lengths or args.dataset or "sharegpt", global_batch=args.global_batch, method=args.method,
        mbs=args.mbs, dp=args.dp, seed=args.seed, steps=args.steps, warmup=args.warmup,
        backend=args.backend or backend, device=args.device or device, cost_model=args.cost_model,
        timeout_s=args.timeout, oversize=args.oversize, pack_len=args.pack_len, round_to=args.round_to,
        prewarm=args.prewarm, expandable_segments=not args.no_expandable_segments, recompute=args.recompute)
    return launch(cfg, args.out, args.nproc, verify=args.verify, memory_model=args.memory_model,
                  allow_over_limit=getattr(args, "allow_over_limit", False))
def _cmd_compare(args: argparse.Namespace) -> int:
    from .compare import run_compare

    return run_compare(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dynmb", description="Dynamic microbatching for pipeline-parallel transformer training.")
    sub = ap.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = sub.add_parser("datasets", help="list shipped length traces with count, mean, median, p90, p99, max")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    p.set_defaults(func=lambda a: _cmd_datasets(a))

    p = sub.add_parser("lengths", help="build a length trace (token counts) from a jsonl/json/txt corpus")
    p.add_argument("corpus", nargs="+", help="path(s) to .jsonl, .json (a list of records), .txt (or .gz of them) corpora; several are read in order into one trace")
    p.add_argument("--field", action="append", default=None,
                   help="record field(s) to tokenize and concatenate; dotted paths like conversations.0.value; repeat for several (txt: ignored)")
    p.add_argument("--tokenizer", default="gpt2", help="gpt2 (offline BPE), a Hugging Face tokenizer name or tokenizer.json path (default gpt2)")
    p.add_argument("--txt-split", default="line", choices=["line", "article", "blank"],
                   help="txt corpora: one record per line, per top-level `= Title =` article, or per blank-line paragraph")
    p.add_argument("--join", default="\n", help="separator between the --field values of a record (default newline; '' concatenates)")
    p.add_argument("--normalize", default="none", choices=["none", "space", "wikitext"],
                   help="text clean-up before tokenizing: none (default), space (collapse whitespace), wikitext (also undo ' @-@ ', ' @,@ ', ' @.@ ')")
    p.add_argument("--skip-empty", action="store_true", help="skip (and report) records of 0 tokens instead of failing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("-o", "--output", required=True, help="output CSV path")
    p.set_defaults(func=lambda a: _cmd_lengths(a))

    p = sub.add_parser("plan", help="pack one global batch into microbatches under a memory limit")
    _add_data_flags(p)
    _add_packing_flags(p)
    _add_model_flags(p)
    p.add_argument("--step", type=int, default=0, help="which global batch of the seed's stream (default 0)")
    p.add_argument("-o", "--output", default=None, help="plan JSON path")
    p.add_argument("--json", action="store_true", help="print a one-line JSON summary")
    p.set_defaults(func=lambda a: _cmd_plan(a))

    p = sub.add_parser("schedule", help="build and validate a pipeline schedule for a plan")
    p.add_argument("--plan", required=True, help="plan JSON from `dynmb plan`")
    p.add_argument("--kind", default="1f1b", help="gpipe, 1f1b, interleaved, memory-aware, zb-h1, zb (default 1f1b)")
    p.add_argument("--virtual", type=int, default=1, help="model chunks per rank for interleaved (default 1: ranks = stages)")
    p.add_argument("--reorder", default="none", help="none, descending, ascending, ends, dynapipe, search (default none)")
    p.add_argument("--cost-model", default=None, help="fitted cost-model JSON; default analytic")
    p.add_argument("--memory-model", default=None, help="fitted memory-model JSON; default analytic")
    _add_model_flags(p)
    p.add_argument("-o", "--output", required=True, help="schedule CSV path (torch.distributed.pipelining compute-only format)")
    p.add_argument("--plan-output", default=None, help="write the reordered plan here (default: next to the schedule)")
    p.set_defaults(func=lambda a: _cmd_schedule(a))

    p = sub.add_parser("simulate", help="predict makespan, bubble and peak memory of a plan under a schedule")
    p.add_argument("--plan", required=True, help="plan JSON")
    p.add_argument("--schedule", required=True, help="schedule CSV")
    p.add_argument("--cost-model", default=None, help="fitted cost-model JSON; default analytic")
    p.add_argument("--memory-model", default=None, help="fitted memory-model JSON; default analytic")
    _add_model_flags(p)
    p.add_argument("--gantt", default=None, help="write a Gantt PNG of the predicted timeline here")
    p.add_argument("--timeline", default=None, help="write the timeline CSV here")
    p.add_argument("--json", action="store_true", help="print a one-line JSON summary")
    p.set_defaults(func=lambda a: _cmd_simulate(a))

    p = sub.add_parser("memory", help="measure activation/state bytes per stage on a (rows, padded_len) grid and fit the memory model")
    _add_model_flags(p)
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    p.add_argument("--quick", action="store_true", help="a small grid")
    p.add_argument("--device", default="cpu", help="cpu (storage accounting) or cuda (max_memory_allocated)")
    p.add_argument("-o", "--output", required=True, help="memory-model JSON path")
    p.add_argument("--samples", default=None, help="also write the measured samples CSV here")
    p.set_defaults(func=lambda a: _cmd_memory(a))

    p = sub.add_parser("profile", help="measure forward/backward time per stage over a (rows, padded_len) grid")
    _add_model_flags(p)
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    p.add_argument("--quick", action="store_true", help="a grid that finishes in about a minute")
    p.add_argument("--max-len", type=int, default=None, help="largest padded_len in the grid")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per point (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up runs per point (default 2)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as one rank per core)")
    p.add_argument("--comm", action="store_true", help="also measure P2P ping-pong (alpha, beta) on gloo")
    p.add_argument("--concurrent", action="store_true",
                   help="CPU: one process per stage, every stage of a point timed at once, as a pipeline runs them")
    p.add_argument("--token-cap", type=int, default=None,
                   help="largest rows x padded_len in the default grid (default 8192 on CPU, 65536 on CUDA)")
    p.add_argument("--split", action="store_true",
                   help="also time the split backward zero-bubble schedules run (I and W rows next to F and B)")
    p.add_argument("--no-memory", action="store_true",
                   help="skip the memory columns (each point's first repeat builds a fresh stage for them: "
                        "about 1 s per point for gpt2; `dynmb memory` measures memory on its own)")
    p.add_argument("-o", "--output", required=True, help="samples CSV (appended to / resumed if it exists)")
    p.set_defaults(func=lambda a: _cmd_profile(a))

    p = sub.add_parser("fit", help="fit the cost model to profiled samples; print held-out error")
    p.add_argument("samples", nargs="+", help="samples CSV(s) from `dynmb profile` or a run's actions table")
    p.add_argument("--kind", default="poly", help="poly (scipy least squares, default) or grid (interpolation)")
    _add_model_flags(p)
    p.add_argument("--stages", type=int, default=2, help="pipeline stages the samples were measured for")
    p.add_argument("--folds", type=int, default=5, help="k for k-fold held-out error (default 5)")
    p.add_argument("--plot", default=None, help="write a measured-vs-predicted PNG here")
    p.add_argument("-o", "--output", required=True, help="cost-model JSON path")
    p.set_defaults(func=lambda a: _cmd_fit(a))

    p = sub.add_parser("run", help="run the plan on a real torch.distributed pipeline (launched through torchrun)")
    _add_data_flags(p)
    _add_packing_flags(p)
    _add_model_flags(p)
    p.add_argument("--nproc", type=int, default=2, help="processes (ranks) = stages x dp / virtual (default 2)")
    p.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved, memory-aware, zb-h1, zb (default 1f1b)")
    p.add_argument("--virtual", type=int, default=1, help="model chunks per rank for interleaved (default 1)")
    p.add_argument("--reorder", default="none", help="microbatch reordering (default none)")
    p.add_argument("--steps", type=int, default=3, help="measured steps (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps (default 1)")
    p.add_argument("--backend", default=None, help="gloo or nccl (default: nccl with CUDA, else gloo)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--timeout", type=float, default=120.0, help="process-group / P2P timeout in seconds (default 120)")
    p.add_argument("--verify", action="store_true", help="check each step's gradients against a single-process reference")
    p.add_argument("--allow-over-limit", action="store_true", help="report a measured peak over the limit instead of failing")
    _add_run_shape_flags(p)
    p.add_argument("--out", required=True, help="results folder (tables steps/actions/memory/runs)")
    p.set_defaults(func=lambda a: _cmd_run(a))

    p = sub.add_parser("compare", help="the main job: fixed vs dynamic microbatching on real runs, with a table and plots")
    _add_data_flags(p, global_batch=32)
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    p.add_argument("--memory-limit", default=None, help="per-GPU memory limit (default 1GiB, which binds for the small model)")
    p.add_argument("--methods", default="fixed,sorted,packed,token-budget,dynapipe,dynamic", help="comma-separated methods")
    p.add_argument("--mbs", type=int, default=None, help="microbatch size for fixed-size methods (default: largest that fits)")
    p.add_argument("--oversize", default="error", choices=["error", "truncate", "drop"],
                   help="a sequence that cannot fit alone: error (default), truncate or drop (both reported)")
    _add_recompute_flag(p)
    _add_shape_flags(p)
    _add_run_shape_flags(p)
    p.add_argument("--schedule", default="1f1b", help="schedule kind: gpipe, 1f1b, memory-aware, zb-h1, zb (default 1f1b)")
    p.add_argument("--virtual", type=int, default=1,
                   help="model chunks per rank (default 1: one rank per stage; >1 runs the interleaved schedule on stages/virtual ranks)")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"],
                   help="cpu (gloo) or cuda (NCCL, one GPU per rank); default cuda when available")
    p.add_argument("--memory-model", default=None, help="fitted memory-model JSON (`dynmb memory`); default analytic")
    p.add_argument("--allow-over-limit", action="store_true",
                   help="finish and report a measured peak over the limit (exit 1) instead of stopping the run")
    p.add_argument("--reorder", default="auto",
                   help="microbatch order: auto (dynamic: search, dynapipe: its cluster permutation, others: none) "
                        "or one of none, descending, ascending, ends, dynapipe, search for every method")
    p.add_argument("--steps", type=int, default=3, help="measured steps per method (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps per method (default 1)")
    p.add_argument("--no-fixed-best", action="store_true",
                   help="skip the extra fixed cases (mbs 1, 2, 4, ... below the largest that fits) that find "
                        "the best fixed mbs in hindsight")
    p.add_argument("--sequential", action="store_true",
                   help="run the methods one after another; default on CPU: round by round (step k of every "
                        "method, then step k+1), so outside load hits every method alike")
    p.add_argument("--cost-model", default=None, help="fitted cost-model JSON (default: the one shipped for this model/stages on CPU, else analytic)")
    _add_model_flags(p)
    p.add_argument("--out", default="results/compare", help="results folder (default results/compare)")
    p.add_argument("--verbose", action="store_true", help="stream the workers' output")
    p.set_defaults(func=lambda a: _cmd_compare(a))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"dynmb {args.verb}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
