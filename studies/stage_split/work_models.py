"""``--stage-split auto``: the old default work model against the workload's own, paired on the study's batches.

For each (model, trace, P) cell of ``studies/scaling/scaling.py`` (H100 ``GPUCostModel``, ``--link``, 80 GiB,
``--tokens`` global batch drawn by its ``token_batch`` for DP ``--dp``, oversize truncate) the layer split of
``auto`` under three work models:

- ``old``: forward FLOPs of one 1,024-token row (``stage_split.flops_cost``: the library default before,
  and still what it uses when no workload is given);
- ``new``: the library default now, ``dynmb.Planner(stage_split="auto", workload=batch, cost_model=GPU model)``:
  every sequence's F + B seconds from the GPU model (``dynmb.planning.split_work``);
- ``flops``: the workload without a layout-free cost model (forward + backward FLOPs at the real lengths);

and whether ``new`` is the study's split (``scaling.ideal_cost``). Each distinct split's dynamic step is
then simulated by the study's own row code (``scaling.plan_once``: pack for DP replicas, the
``--sim-replicas`` predicted slowest reordered, scheduled under ``--schedule`` and simulated), so the
steps are comparable with studies/stage_split/notes.md "Half-block stage splits". Prints a markdown table; ``--out``
writes the rows as JSON.

``--choice``: min-max against the choice by simulated step (``dynmb.planning.split_search``). Per cell the
min-max split (the ``new`` one above: ``Planner(stage_split="auto", workload=batch, cost_model=GPU model)``)
and the split ``SplitSearch`` chooses with the Planner's own settings (``--schedule``, dp, 80 GiB, truncate)
and ``global_batch`` = the batch's sequences, the workload being the batch (its sample batches: one
replica's share drawn from it); each split's dynamic step, kind and attainable fraction by the study's
``plan_once`` on the whole batch (with its real tokens / s and truncated sequences), the chosen candidate's
score on the sample batches against the min-max split's (mean step per real token) and the choice's CPU s.

    PYTHONPATH=$PWD nice -n 19 python3 -m studies.stage_split.work_models --out /tmp/stage_split.json
    PYTHONPATH=$PWD nice -n 19 python3 -m studies.stage_split.work_models --choice --out /tmp/split_choice.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from studies.scaling import scaling

import dynmb
from dynmb import data
from dynmb.core.config import parse_bytes
from dynmb.costmodel import gpu
from dynmb.planning.split_search import SplitSearch
from dynmb.planning.split_work import workload_cost
from dynmb.planning.stage_split import flops_cost, resolve_stage_split


def split_text(cfg: dynmb.ModelConfig) -> str:
    """``even`` or the layers per stage, the form ``--stage-split`` takes."""
    return "even" if cfg.layer_split is None else ",".join(f"{n:g}" for n in cfg.layer_split)


def short(split: str) -> str:
    """A split for the table: runs of equal stages as ``n x k``."""
    if split == "even":
        return "even"
    parts, out = split.split(","), []
    i = 0
    while i < len(parts):
        j = i
        while j < len(parts) and parts[j] == parts[i]:
            j += 1
        out.append(f"{parts[i]} x {j - i}" if j - i > 2 else ",".join(parts[i:j]))
        i = j
    return ", ".join(out)


def cell_rows(model: str, trace_name: str, P: int, args: argparse.Namespace) -> dict:
    cfg = scaling.model_for(model, [])
    trace = data.load_trace(trace_name)
    c = dict(tokens=scaling.parse_tokens(args.tokens), dp=args.dp, seed=args.seed, num_stages=P, link=args.link,
             memory_limit_bytes=parse_bytes(args.memory_limit), oversize="truncate", sim_replicas=args.sim_replicas,
             schedule_key=args.schedule, mb_tokens=4096)
    cell = scaling.Cell(c, trace, cfg)
    batch = cell.batch
    t0 = time.process_time()
    planner = dynmb.Planner(model=cfg, num_stages=P, memory_limit=args.memory_limit, dp=args.dp,
                            cost_model=gpu.GPUCostModel(cfg, P, link=args.link), stage_split="auto",
                            workload=batch, oversize="truncate")
    new_s = time.process_time() - t0
    splits = {"old": split_text(resolve_stage_split(cfg, P, "auto", stage_cost=flops_cost(1024))),
              "new": split_text(planner.model_cfg),
              "flops": split_text(resolve_stage_split(cfg, P, "auto", workload=batch)),
              "study": split_text(resolve_stage_split(cfg, P, "auto", stage_cost=scaling.ideal_cost(batch, args.link)))}
    steps: dict[str, dict] = {}
    for split in dict.fromkeys(splits[k] for k in ("old", "new", "flops")):
        row = scaling.plan_once(cell, {**c, "stage_split": split}, "dynamic", None)
        steps[split] = {"step_s": row["pred_step_s"], "kind": row["schedule"], "attainable": row["attainable"]}
    return {"model": model, "trace": trace_name, "P": P, "sequences": int(batch.size), "tokens": int(batch.sum()),
            **{f"split_{k}": v for k, v in splits.items()}, "new_is_study": splits["new"] == splits["study"],
            "split_new_cpu_s": new_s, **{f"step_{k}_s": steps[splits[k]]["step_s"] for k in ("old", "new", "flops")},
            **{f"kind_{k}": steps[splits[k]]["kind"] for k in ("old", "new")}}


def choice_rows(model: str, trace_name: str, P: int, args: argparse.Namespace) -> dict:
    """``--choice``: the min-max split against the one chosen by simulated step (module docstring)."""
    cfg = scaling.model_for(model, [])
    c = dict(tokens=scaling.parse_tokens(args.tokens), dp=args.dp, seed=args.seed, num_stages=P, link=args.link,
             memory_limit_bytes=parse_bytes(args.memory_limit), oversize="truncate", sim_replicas=args.sim_replicas,
             schedule_key=args.schedule, mb_tokens=4096)
    cell = scaling.Cell(c, data.load_trace(trace_name), cfg)
    batch, cm = cell.batch, gpu.GPUCostModel(cfg, P, link=args.link)
    planner = dynmb.Planner(model=cfg, num_stages=P, memory_limit=args.memory_limit, dp=args.dp, cost_model=cm,
                            stage_split="auto", workload=batch, oversize="truncate", schedule=args.schedule)
    t0 = time.process_time()
    choice = SplitSearch(spec=planner.spec, global_batch=int(batch.size), batches=args.batches,
                         tolerance=args.tolerance, max_candidates=args.candidates).choose(
        cfg, P, workload_cost(batch, cfg, cm), workload=batch, cost_model=cm)
    cpu_s = time.process_time() - t0
    splits = {"minmax": split_text(planner.model_cfg),
              "sim": split_text(resolve_stage_split(cfg, P, ",".join(f"{n:g}" for n in choice.split)))}
    steps: dict[str, dict] = {}
    for split in dict.fromkeys(splits.values()):
        row = scaling.plan_once(cell, {**c, "stage_split": split}, "dynamic", None)
        steps[split] = {"step_s": row["pred_step_s"], "kind": row["schedule"], "attainable": row["attainable"],
                        "tokens_per_s": row["tokens_per_s"], "truncated": row["truncated"]}
    i = choice.candidates.index(choice.split)
    return {"model": model, "trace": trace_name, "P": P, "seed": args.seed, "sequences": int(batch.size),
            **{f"split_{k}": v for k, v in splits.items()}, "choice_cpu_s": cpu_s,
            "candidates": len(choice.candidates), "near_optimal": choice.near_optimal,
            "sample_step_minmax_s": choice.steps_s[0], "sample_step_sim_s": choice.steps_s[i],
            "sample_score_sim_s": choice.scores_s[i],
            **{f"{m}_{k}": steps[splits[k]][m] for k in splits
               for m in ("step_s", "kind", "attainable", "tokens_per_s", "truncated")}}


def choice_markdown(rows: list[dict]) -> str:
    out = ["| model | trace | P | seed | split, min-max | split, simulated choice | step s, min-max -> choice | change | "
           "tokens/s change | truncated | attainable | kind | sample score, choice / min-max | candidates (near-optimal) "
           "| choice CPU s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        same = r["split_minmax"] == r["split_sim"]
        out.append(f"| {r['model']} | {r['trace']} | {r['P']} | {r['seed']} | {short(r['split_minmax'])} | "
                   f"{'same' if same else short(r['split_sim'])} | {r['step_s_minmax']:.4f} -> {r['step_s_sim']:.4f} | "
                   f"{r['step_s_sim'] / r['step_s_minmax'] - 1:+.2%} | "
                   f"{r['tokens_per_s_sim'] / r['tokens_per_s_minmax'] - 1:+.2%} | "
                   f"{r['truncated_minmax']} -> {r['truncated_sim']} | {r['attainable_minmax']:.3f} -> "
                   f"{r['attainable_sim']:.3f} | {r['kind_minmax']} -> {r['kind_sim']} | "
                   f"{r['sample_score_sim_s'] / r['sample_step_minmax_s'] - 1:+.1%} | {r['candidates']} "
                   f"({r['near_optimal']}) | {r['choice_cpu_s']:.1f} |")
    return "\n".join(out)


def markdown(rows: list[dict]) -> str:
    out = ["| model | trace | P | split, old (1,024-token FLOPs) | split, new (workload) | new = study's | "
           "step s, old -> new | change | flops-at-lengths split = new | step s with it |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        same = r["split_old"] == r["split_new"]
        change = r["step_new_s"] / r["step_old_s"] - 1
        out.append(f"| {r['model']} | {r['trace']} | {r['P']} | {short(r['split_old'])} | "
                   f"{'same' if same else short(r['split_new'])} | {'yes' if r['new_is_study'] else 'NO'} | "
                   f"{r['step_old_s']:.4f} -> {r['step_new_s']:.4f} | {change:+.2%} | "
                   f"{'yes' if r['split_flops'] == r['split_new'] else short(r['split_flops'])} | {r['step_flops_s']:.4f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama2-7b,llama3.1-8b")
    ap.add_argument("--traces", default="sharegpt,wikitext2,longtail")
    ap.add_argument("--stages", default="8,16")
    ap.add_argument("--tokens", default="4M")
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--link", default="ib", choices=sorted(gpu.LINKS))
    ap.add_argument("--memory-limit", default="80GiB")
    ap.add_argument("--sim-replicas", type=int, default=1)
    ap.add_argument("--schedule", default="auto", choices=["1f1b", "auto"])
    ap.add_argument("--choice", action="store_true", help="min-max against the choice by simulated step")
    ap.add_argument("--batches", type=int, default=2, help="--choice: sample batches (default 2)")
    ap.add_argument("--candidates", type=int, default=8, help="--choice: candidates at most (default 8)")
    ap.add_argument("--tolerance", type=float, default=0.02, help="--choice: near-optimal within (default 0.02)")
    ap.add_argument("--out", default=None, help="JSON rows")
    args = ap.parse_args(argv)
    rows = []
    for model in args.models.split(","):
        for trace in args.traces.split(","):
            for P in (int(p) for p in args.stages.split(",")):
                t0 = time.perf_counter()
                rows.append((choice_rows if args.choice else cell_rows)(model, trace, P, args))
                print(f"{model} {trace} P{P}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(choice_markdown(rows) if args.choice else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
