"""Scaling at realistic load (simulated): global batches of millions of tokens, P 4-32, DP 8-256, H100 costs.

What one row is: for a (trace, tokens, P, DP, method, stage split) ONE global batch is drawn
(sequences sampled from the trace with ``default_rng([seed, tokens])`` until ``tokens`` is reached,
the count then rounded up to a multiple of DP so every replica can hold whole sequences; fewer
sequences than replicas: ``status`` infeasible), packed for
DP pipelines of P stages with ``dynmb.packing.pack(..., dp=DP)`` (the packers balance the replicas),
each simulated replica reordered as ``dynmb.Planner`` does (``--reorder auto``: ``search`` for dynamic,
``dynapipe`` for dynapipe, none for the others), given its schedule and simulated
(``dynmb.timing.simulate``). The replicas simulated are the ``--sim-replicas`` (default 2; 0: all) the packer's
estimate ``predictions["est_replica_makespan_s"]`` says are slowest; the step is the slowest simulated.
The schedule (``--schedule``, ``studies/scaling/sched.py``): ``1f1b`` (default, the study as before)
or ``auto``: for every method, each simulated replica reordered, scheduled and simulated under each kind
of ``dynmb.schedule.kinds.auto_kinds()`` (1f1b, zb-h1, zb; one packing per packing key: three),
the fastest kind whose simulated peak fits kept (``plan_auto``'s rule); the row records it (``schedule``),
every kind's step (``step_<kind>_s``) and the kinds over the limit (``kinds_over_limit``). ``--virtual V``
(``studies/scaling/virtual.py``): P GPUs of V model chunks each, the interleaved schedule; ``auto``: V chosen
per cell by simulated step (``virtual_chosen``).

Model and costs: a model preset (``--model``, default ``llama2-7b``: the Llama family, SwiGLU,
RMSNorm, rotary positions, no biases; ``llama3.1-8b`` / ``llama3.2-1b`` with grouped-query attention
and a 128k vocabulary; ``dynmb.core.config`` cites their sizes), ``max_seq_len`` raised to cover the longest
trace length (sequences longer than fit alone in memory are truncated, counted in ``truncated``), an 80 GiB limit, the
analytic memory model and ``dynmb.costmodel.gpu.GPUCostModel`` (H100 SXM, ``--link ib|nvlink``; its
constants and their public sources are printed first). ``--stage-split even|auto|search`` (even and auto by default;
``search``: the split the library chooses by simulated step, ``_scaling_split``, its CPU s in ``split_choice_s``)
applies to ``dynamic`` (``auto``: half-blocks balancing ``ideal_cost``, the batch's ideal F + B seconds per stage that
``ideal_s`` is made of); the other methods run ``--others-split`` (default even).

Methods: ``fixed`` (largest microbatch size that fits), ``sorted`` at mbs 1, ``packed``,
``token-budget`` and ``balanced`` at the memory-maximum budget AND, as ``token-budget-best`` /
``balanced-best``, at the best budget in hindsight: budgets cap / 2^j (j = 0, 1, ... until the
microbatch count stops changing, the step has grown on two budgets in a row past the best, or the next
budget would make more than ``MAX_SWEEP_MICROBATCHES`` microbatches in all: the packers' replica
balancing merges the cheapest pair over all O(n^2) pairs when the count is not a multiple of DP, which
took over 10 GB at 4M sharegpt tokens), each simulated, the shortest predicted step kept (``budget_div``
is its 2^j, ``budgets_tried`` how many ran; its plan time is that one budget's: a tuned budget is set once, not
searched per step), ``dynapipe`` and ``dynamic`` (with the Planner's final check against ``balanced``, ``_scaling_final``:
``grouping``; with ``--slice-fitting auto`` then weighed against slicing sequences that fit, ``_scaling_slicefit``).

Columns (table ``scaling``):
- ``pred_step_s``: the slowest simulated replica's makespan; ``mean_bubble`` of it;
- ``bound_s``: that replica's dependency bound (``SimResult.bound_s``, ``dynmb.timing.bounds``);
  ``gap_to_bound = pred_step_s / bound_s - 1`` (what order, ends and schedule leave);
- ``ideal_s``: ``dynmb.timing.bounds.plan_ideal`` of the whole plan (DP replicas: busiest stage's real-token
  work / DP + shortest fill and drain), priced by the same GPU model with GEMMs at their
  large-problem efficiency (``gemm_m_half`` -> 0). Why: ``plan_ideal`` prices each sequence alone in
  one row, and ``GPUCostModel``'s GEMM efficiency ``M / (M + 128)`` grows with the tokens M of a
  microbatch, so a sequence alone is dearer than in a packed microbatch: the cost is subadditive and
  the per-sequence sum is NOT a lower bound (sharegpt, 0.5M tokens, P 8, DP 8: 0.76 s against dynamic's
  0.55 s). With saturated GEMMs the linear part is additive and the attention part
  (``a / eff(a / tokens)``, ``eff`` saturating) is exactly additive, so every plan's step is >= it
  (``GPUCostModel.ideal_stage_costs``), the same work ``attainable`` counts.
  ``ideal_dynmb_s`` keeps the unmodified ``plan_ideal`` for reference. ``gap_to_ideal = pred_step_s / ideal_s - 1``;
  ``gap_<term>`` (``_scaling_gap``): where it goes (schedule, ends, ..., padding, shape), fractions summing to it;
  ``ideal_whole_s``: ``ideal_s`` with sequences whole, at least the longest sequence's own ideal on the
  replica holding it (with few tokens per replica, DP 256, or long-tail traces, no plan can spread the
  work evenly: ``ideal_s`` is then far below any step);
- ``attainable = sum over stages of the ideal real-token work / (P x pred_step_s)`` (the same work as
  ``ideal_s``: every sequence's own F + B at its own length, GEMMs saturated, no padding, no per-op
  overhead, divided by DP): the fraction of the machine doing real-token work at the best rate the
  cost model allows; 1.0 only with no bubble, no padding, no overhead, full-size GEMMs and balanced
  stages. ``efficiency`` = real-token FLOPs / (DP x P x pred_step_s x peak) (model FLOPs utilisation);
- ``pack_s`` (packing the whole global batch for DP replicas: the packers balance replicas, so this
  part does not split over replicas today), ``reorder_s`` + ``sched_s`` (one replica: every replica
  does its own in parallel), ``plan_s`` = their sum, ``plan_over_step = plan_s / pred_step_s``;
- ``padding_fraction``, ``num_microbatches`` (per replica), ``mbs_used``, ``layer_split``,
  ``tokens_per_replica``, ``load_ok`` (the replica holds >= 4P microbatches' worth of tokens, a
  microbatch's worth being ``--mb-tokens``, default 4096: one full Llama-2 context row),
  ``truncated``, ``pred_peak_over_limit``; ``schedule_key`` (the ``--schedule`` setting, a resume key;
  rows from before the flag count as ``1f1b``), ``schedule``, ``step_<kind>_s``, ``kinds_over_limit``;
  ``virtual`` (``--virtual``, a resume key; rows from before count as 1).

Timings are CPU seconds of this process (``time.process_time``): on a loaded shared box the wall time
mostly measures waiting for a core (``row_wall_s``, the row's pack + reorder + schedule + simulation, shows
it), while CPU time is close to what the planning costs on a core of its own. Resumable by settings
columns; ``--summary`` prints the markdown tables of an existing results folder. The old small-batch grid (256
sequences per replica, analytic costs, P up to 64): ``--small-batch`` (``studies/scaling/small.py``).

    nice python -m studies.scaling.scaling --quick --schedule auto --out results/scaling_quick_auto
    nice python -m studies.scaling.scaling --out results/scaling                  # full grid
    python -m studies.scaling.scaling --summary --out results/scaling            # markdown tables
    python -m studies.scaling.scaling --small-batch --quick                      # the old grid
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import replace

import numpy as np
import pandas as pd
from studies.common import Resume, progress, split_list
from studies.scaling.final import final_check
from studies.scaling.gap import gap_columns
from studies.scaling.slicefit import slice_check
from studies.scaling.sched import SCHEDULES, choose, kind_columns, kinds_for, packing_groups, run_kind
from studies.scaling.summary import spec_header, summary_markdown
from studies.scaling.split import SEARCH, layout_label, searched_split
from studies.scaling.virtual import (Writer, auto_apart, check, choose_v, parse_virtual, plan_ideal_v, ranks, real_flops,
                              real_work, weighs)

import dynmb
from dynmb import data
from dynmb.timing.bounds import ideal_bound
from dynmb.core.config import parse_bytes
from dynmb.costmodel import gpu
from dynmb.memory.model import get_memory_model
from dynmb.packing import PackingError, pack
from dynmb.planning import reorder_for
from dynmb.planning.split_work import workload_cost
from dynmb.planning.stage_split import resolve_stage_split
from dynmb.core.planspec import PlanSpec
from dynmb.costmodel.loader import Models

KEYS = ("dataset", "model", "tokens", "num_stages", "dp", "method", "stage_split", "link", "memory_limit_bytes",
        "seed", "oversize", "sim_replicas", "schedule_key", "virtual", "slice_fitting")
METHODS = ("fixed", "sorted", "packed", "token-budget", "token-budget-best", "balanced", "balanced-best",
           "dynapipe", "dynamic")
FULL = dict(traces="sharegpt,wikitext2,longtail", tokens="0.5M,4M", stages="4,8,16,32", dp="8,256")
QUICK = dict(traces="sharegpt,longtail", tokens="0.5M", stages="4,16", dp="8")
MAX_SWEEP_MICROBATCHES = 8192
"""The -best sweeps stop before a budget that would make more microbatches than this in all."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--small-batch", action="store_true", help="run the old small-batch grid instead (its own flags)")
    ap.add_argument("--quick", action="store_true", help=f"smaller grid: {QUICK}")
    ap.add_argument("--traces", default=None, help=f"comma-separated traces (default {FULL['traces']})")
    ap.add_argument("--tokens", default=None, help=f"global-batch token targets, e.g. 0.5M,4M (default {FULL['tokens']})")
    ap.add_argument("--stages", default=None, help=f"comma-separated P (default {FULL['stages']})")
    ap.add_argument("--dp", default=None, help=f"comma-separated DP (default {FULL['dp']})")
    ap.add_argument("--methods", default=",".join(METHODS), help="methods, -best variants included (default all)")
    ap.add_argument("--stage-split", default="even,auto",
                    help="layer splits of dynamic: even, auto (min-max), search (chosen by simulated step) (default even,auto)")
    ap.add_argument("--others-split", default="even", help="layer split of the other methods (default even)")
    ap.add_argument("--model", default="llama2-7b", help="model preset or spec (default llama2-7b)")
    ap.add_argument("--link", default="ib", choices=sorted(gpu.LINKS), help="P2P link between stages (default ib)")
    ap.add_argument("--memory-limit", default="80GiB", help="per-GPU limit (default 80GiB)")
    ap.add_argument("--mb-tokens", type=int, default=4096, help="a microbatch's worth of tokens for load_ok (default 4096)")
    ap.add_argument("--sim-replicas", type=int, default=2, help="replicas simulated, the predicted slowest (default 2; 0: all)")
    ap.add_argument("--schedule", default="1f1b", choices=SCHEDULES,
                    help="1f1b (default, as before), interleaved, or auto: each auto kind's step, the fastest that fits")
    ap.add_argument("--virtual", default="1", help="model chunks per GPU, comma-separated (default 1; > 1: interleaved; "
                    "auto: chosen per cell by simulated step)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the global batches (default 0)")
    ap.add_argument("--oversize", default="truncate", choices=["error", "truncate", "drop"],
                    help="a sequence that cannot fit alone (default truncate, counted)")
    ap.add_argument("--slice-fitting", default="never", choices=["never", "auto"], help="dynamic: + fitting slices (_scaling_slicefit)")
    ap.add_argument("--summary", action="store_true", help="only print the markdown summary of --out (folders, comma-separated)")
    ap.add_argument("--out", default="results/scaling", help="results folder (default results/scaling)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def parse_tokens(text: str) -> int:
    """``0.5M`` / ``4M`` / ``500k`` / ``500000`` -> tokens."""
    t = text.strip().upper()
    scale = {"K": 1e3, "M": 1e6}.get(t[-1:], 1.0)
    try:
        value = float(t[:-1] if t[-1:] in "KM" else t) * scale
    except ValueError:
        raise ValueError(f"--tokens: {text!r} is not a token count such as 0.5M or 500000") from None
    if value < 1:
        raise ValueError(f"--tokens: {text!r} must be >= 1 token")
    return int(round(value))


def model_for(spec: str, traces: list[np.ndarray]) -> dynmb.ModelConfig:
    """The preset ``spec``, its ``max_seq_len`` raised to the longest length of ``traces`` and of every
    shipped trace (the same model whatever traces a run holds), rounded up to 1024."""
    longest = max(int(t.max()) for t in [*traces, *(data.load_trace(n) for n in data.list_traces())])
    need = -(-longest // 1024) * 1024
    cfg = dynmb.model_config(spec)
    return replace(cfg, max_seq_len=max(cfg.max_seq_len, need))


def token_batch(trace: np.ndarray, tokens: int, dp: int, seed: int) -> np.ndarray:
    """Sequences drawn from ``trace`` (stream ``default_rng([seed, tokens])``, with replacement) until their
    tokens reach ``tokens``; the count rounded up to a multiple of ``dp``. Deterministic by seed."""
    rng = np.random.default_rng([int(seed), int(tokens)])
    n = int(tokens / max(float(trace.mean()), 1.0) * 1.5) + 4 * dp + 16
    idx = rng.integers(0, trace.size, size=n)
    while int(trace[idx].sum()) < tokens + int(trace.max()) * dp:   # enough for the target and the rounding
        idx = np.concatenate([idx, rng.integers(0, trace.size, size=n)])
    lens = trace[idx]
    k = int(np.searchsorted(np.cumsum(lens), tokens)) + 1
    if k < dp:
        raise PackingError(f"{tokens} tokens are {k} sequences, fewer than the {dp} replicas")
    return lens[: -(-k // dp) * dp].astype(np.int64)


def saturated(cm: gpu.GPUCostModel) -> gpu.GPUCostModel:
    """The same GPU model with GEMMs at their large-problem efficiency (the ``ideal_s`` pricing)."""
    return gpu.GPUCostModel(cm.model_cfg, cm.num_stages, spec=replace(cm.spec, gemm_m_half=1e-9), comm=cm.comm)


def ideal_cost(lengths: np.ndarray, link: str):
    """``--stage-split auto``'s work model: a layout's stage's ideal F + B seconds of the batch (what
    ``ideal_s`` is made of), the library's ``split_work.workload_cost`` priced by the GPU model."""
    return lambda cfg, stage, P: workload_cost(lengths, cfg, gpu.GPUCostModel(cfg, P, link=link))(cfg, stage, P)


def whole_ideal(cm_sat: gpu.GPUCostModel, lengths: np.ndarray, ideal_s: float, virtual: int = 1) -> float:
    """``ideal_s`` with sequences whole on one replica: at least the longest sequence's own ideal on the
    replica that holds it (its work on the busiest stage + its fill and drain; ``ideal_s`` spreads the
    work evenly over the DP replicas as if sequences could be cut between them)."""
    return max(float(ideal_s), ideal_bound(np.array([int(np.max(lengths))]), cm_sat,
                                           stage_rank=ranks(cm_sat.num_stages, virtual)))


def complete(df: pd.DataFrame, spec: str) -> pd.DataFrame:
    """Rows of older runs given ``ideal_whole_s`` (recomputed from the deterministic batches, the longest
    sequence cut to the longest one-row length that fits, as ``--oversize truncate`` cuts it)."""
    if "ideal_whole_s" in df and df["ideal_whole_s"].notna().all():
        return df
    df = df.reset_index(drop=True).copy()
    cfg = model_for(spec, [])
    traces: dict = {}
    todo = df["status"].eq("ok") & (df["ideal_whole_s"].isna() if "ideal_whole_s" in df else True)
    for key, g in df[todo].groupby(["dataset", "tokens", "num_stages", "dp", "stage_split", "seed"]):
        trace, tokens, P, dp, split, seed = key
        tr = traces.setdefault(trace, data.load_trace(trace))
        lens = token_batch(tr, int(tokens), int(dp), int(seed))
        c = resolve_stage_split(cfg, int(P), str(split), stage_cost=ideal_cost(lens, str(g["link"].iloc[0])))
        cm = gpu.GPUCostModel(c, int(P), link=str(g["link"].iloc[0]))
        limit = int(g["memory_limit_bytes"].iloc[0])
        fits = pack(lens[[int(np.argmax(lens))]],           # truncation, as the packers cut
                    PlanSpec(method="fixed", num_stages=int(P), memory_limit_bytes=limit, oversize="truncate"),
                    models=Models(cm, get_memory_model(None, c, int(P)))).meta["longest_fitting_length"]
        df.loc[g.index, "ideal_whole_s"] = [whole_ideal(saturated(cm), np.minimum(lens, fits), x) for x in g["ideal_s"]]
    return df


def slowest(plan, k: int) -> list[int]:
    if plan.dp == 1:
        return [0]
    est = np.asarray(plan.predictions["est_replica_makespan_s"])
    return [int(r) for r in np.argsort(-est, kind="stable")[:k or plan.dp]]


class Cell:
    """One (trace, tokens, P, DP, V) batch with its models (P V chunks) per layer split."""

    def __init__(self, c: dict, trace: np.ndarray, cfg: dynmb.ModelConfig) -> None:
        self.batch = token_batch(trace, c["tokens"], c["dp"], c["seed"])
        self.V, self.virtual_cpu_s = choose_v(c, trace, cfg, self.batch, ideal_cost) if c["virtual"] == "auto" \
            else (c["virtual"], 0.0)                # --virtual auto: chosen once per cell (_scaling_virtual)
        self.cfg, self.P, self.link, self._models = cfg, c["num_stages"] * self.V, c["link"], {}
        self.trace, self.split_cpu_s = trace, {}

    def models(self, split: str, c: dict | None = None):
        if split not in self._models:
            if split == SEARCH:
                cfg, self.split_cpu_s[split] = searched_split(self.cfg, c, self.P, self.V, self.trace,
                                                              int(self.batch.size), ideal_cost(self.trace, self.link))
            else:
                cfg = resolve_stage_split(self.cfg, self.P, split, stage_cost=ideal_cost(self.batch, self.link),
                                          virtual=self.V)
            cm = gpu.GPUCostModel(cfg, self.P, link=self.link)
            self._models[split] = (cfg, cm, saturated(cm), get_memory_model(None, cfg, self.P))
        return self._models[split]


def plan_once(cell: Cell, c: dict, base: str, mbs: int | None) -> dict:
    """Pack the global batch, then reorder, schedule and simulate the slowest replicas under each kind of
    ``--schedule`` (``_scaling_sched``), keeping the fastest that fits."""
    cfg, cm, cm_sat, mm = cell.models(c["stage_split"], c)
    P, V, limit = c["num_stages"], cell.V, c["memory_limit_bytes"]
    wall0, pack_s, runs = time.perf_counter(), 0.0, []
    how = reorder_for(base, "auto")
    for group in packing_groups(kinds_for(c["schedule_key"], V)):
        t0 = time.process_time()
        plan = pack(cell.batch, PlanSpec(method=base, num_stages=P * V, virtual=V, memory_limit_bytes=limit, mbs=mbs,
                                         dp=c["dp"], oversize=c["oversize"], schedule_kind=group[0]), models=Models(cm, mm))
        pack_s += time.process_time() - t0
        runs += [run_kind(plan, slowest(plan, c["sim_replicas"]), k, how, cm, mm, V) for k in group]
    chosen, cols = choose(runs), kind_columns(runs)
    plan, sims, worst = chosen.plan, chosen.sims, chosen.worst
    lengths = np.concatenate([mb.lengths for mb in plan.microbatches])
    ideal = plan_ideal_v(plan, cm_sat, V)
    work = real_work(cm_sat, lengths, c["dp"])
    step = worst.makespan_s
    peak = max(float(np.max(s.peak_bytes)) for s in sims if s.peak_bytes is not None)
    plan_s = pack_s + cols["reorder_s"] + cols["sched_s"]
    wall_s = time.perf_counter() - wall0
    tokens_per_replica = int(cell.batch.sum()) / c["dp"]
    return {"status": "ok", "error": "", "base_method": base, "layer_split": layout_label(cfg, P * V),
            "num_sequences": int(cell.batch.size), "real_tokens": plan.real_tokens,
            "tokens_per_replica": tokens_per_replica, "load_ok": tokens_per_replica >= 4 * P * c["mb_tokens"],
            **cols, "pack_s": pack_s, "plan_s": plan_s, "row_wall_s": wall_s,
            "pred_step_s": step, "bound_s": worst.bound_s, "ideal_s": ideal,
            "ideal_dynmb_s": plan_ideal_v(plan, cm, V), "ideal_whole_s": whole_ideal(cm_sat, lengths, ideal, V),
            "gap_to_bound": step / worst.bound_s - 1,
            "gap_to_ideal": step / ideal - 1, "attainable": work / (P * step), **gap_columns(chosen, cm, cm_sat, V),
            "efficiency": real_flops(cfg, P * V, lengths) / (c["dp"] * P * step * cm.spec.peak_flops),
            "mean_bubble": worst.mean_bubble, "padding_fraction": plan.padding_fraction,
            "num_microbatches": plan.num_microbatches // plan.dp, "mbs_used": plan.meta.get("mbs"),
            "plan_over_step": plan_s / step, "tokens_per_s": plan.real_tokens / step,
            "truncated": len(plan.meta.get("truncated", [])), "dropped": len(plan.meta.get("dropped", [])),
            "pred_peak_over_limit": peak / limit, "virtual_chosen": V, "virtual_cpu_s": cell.virtual_cpu_s,
            "split_choice_s": cell.split_cpu_s.get(c["stage_split"], 0.0)}


def one_row(c: dict, cell: Cell) -> dict:
    method = c["method"]
    base = method.removesuffix("-best")
    try:
        if not method.endswith("-best"):
            r = plan_once(cell, c, base, 1 if base == "sorted" else None)      # dynamic: + the Planner's check
            return {**c, **(slice_check(cell, c, final_check(cell, c, r, plan_once)) if base == "dynamic" else r), "budget_div": 1,
                    "budgets_tried": 1}
        best, last, worse, tried = None, None, 0, 0
        for j in range(12):                       # budgets cap / 2^j: stop rules in the module docstring
            if last is not None and 2 * last * c["dp"] > MAX_SWEEP_MICROBATCHES:
                break
            try:
                r = plan_once(cell, c, base, 1 << j)
            except PackingError:
                break
            tried += 1
            if best is None or r["pred_step_s"] < best["pred_step_s"]:
                best, worse = {**r, "budget_div": 1 << j}, 0
            else:
                worse += 1
            if r["num_microbatches"] == last or worse >= 2:
                break
            last = r["num_microbatches"]
        if best is None:
            raise PackingError(f"{base}: no budget cap/2^j fits")
        return {**c, **best, "budgets_tried": tried}
    except PackingError as e:
        return {**c, "status": "infeasible", "error": str(e)[:300]}


def configurations(args: argparse.Namespace) -> list[dict]:
    grid = QUICK if args.quick else FULL
    limit = parse_bytes(args.memory_limit)
    out = []
    for t in split_list(args.traces or grid["traces"]):
        for tok in (parse_tokens(x) for x in split_list(args.tokens or grid["tokens"])):
            for p in map(int, split_list(args.stages or grid["stages"])):
                for d in map(int, split_list(args.dp or grid["dp"])):
                    for m, v in itertools.product(split_list(args.methods), map(parse_virtual, split_list(args.virtual))):
                        splits = split_list(args.stage_split if m == "dynamic" else args.others_split)
                        out += [dict(dataset=t, model=args.model, tokens=tok, num_stages=p, dp=d, method=m,
                                     stage_split=s, link=args.link, memory_limit_bytes=limit, seed=args.seed,
                                     oversize=args.oversize, sim_replicas=args.sim_replicas, mb_tokens=args.mb_tokens,
                                     schedule_key=args.schedule, virtual=v, slice_fitting=args.slice_fitting)
                                for s in splits]
    unknown = sorted({c["method"] for c in out} - set(METHODS))
    if unknown:
        raise SystemExit(f"scaling.py: unknown method(s) {unknown}; expected some of {', '.join(METHODS)}")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--small-batch" in argv:
        from studies.scaling import small as _scaling_small
        return _scaling_small.main([a for a in argv if a != "--small-batch"])
    args = build_parser().parse_args(argv)
    if args.summary:
        df, auto_md = auto_apart(pd.concat([pd.read_csv(f"{d}/scaling.csv") for d in split_list(args.out)], ignore_index=True))
        print((summary_markdown(complete(df, args.model)) if len(df) else "") + auto_md)
        return 0
    configs = configurations(args)
    traces = {t: data.load_trace(t) for t in {c["dataset"] for c in configs}}
    cfg = model_for(args.model, list(traces.values()))
    check(cfg.n_layers, sorted({c["num_stages"] for c in configs}), sorted({c["virtual"] for c in configs}, key=str),
          {c["stage_split"] for c in configs}, args.schedule)
    print(spec_header(args.link))
    print(f"model: {cfg}\nmemory limit: {args.memory_limit}; schedule {args.schedule}, virtual {args.virtual} (weighs "
          f"{weighs(args.schedule, list(map(parse_virtual, split_list(args.virtual))))}); splits: dynamic {args.stage_split}, "
          f"others {args.others_split}", flush=True)
    resume = Resume(args.out, "scaling", KEYS, defaults={"schedule_key": "1f1b", "virtual": 1, "slice_fitting": "never"})
    todo = [c for c in configs if not resume.done(c)]
    todo.sort(key=lambda c: (c["tokens"], c["dataset"], c["num_stages"], c["dp"], str(c["virtual"])))   # cells grouped
    print(f"scaling: {len(configs)} configurations, {len(configs) - len(todo)} already done", file=sys.stderr)
    cells: dict = {}
    with Writer(args.out) as w:
        for c in progress(todo, total=len(todo), desc="scaling", disable=args.no_progress):
            key = (c["dataset"], c["tokens"], c["num_stages"], c["dp"], c["virtual"])
            if key not in cells:
                cells.clear()                      # one cell at a time: configurations are grouped by cell
                try:
                    cells[key] = Cell(c, traces[c["dataset"]], cfg)
                except PackingError as e:
                    cells[key] = e
            cell = cells[key]
            row = {**c, "status": "infeasible", "error": str(cell)} if isinstance(cell, PackingError) else one_row(c, cell)
            w.append("scaling", [{**row, "model": c["model"]}])
    return 0


if __name__ == "__main__":
    sys.exit(main())
