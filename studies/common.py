"""Helpers shared by the experiment scripts in ``experiments/`` (never imported by the package).

- Settings and resuming: a *configuration* is a dict of settings columns (dataset,
  memory_limit_bytes, method, mbs, ...). ``Resume(out_dir, table, keys)`` reads the rows
  already in ``out_dir/<table>.csv`` and answers ``done(settings)`` by comparing the
  settings columns (canonicalised: ``None``/NaN -> "", 2.0 -> "2"), never folder names.
- Simulated steps: ``simulate_rows`` plans ``steps`` global batches of one configuration
  with the public ``dynmb.Planner`` and returns one tidy row per step (settings + predicted
  metrics); a configuration the packer refuses gives one row with ``status='infeasible'``.
- Real runs: ``run_real`` launches pending configurations (``dynmb.RunConfig``s) as the cases of
  one torchrun job through the public ``dynmb.run`` (round by round on CPU: ``interleave``); the
  worker writes the ``steps``/``actions``/``memory``/``runs`` tables into ``out_dir`` and this adds
  one ``configs`` row per case (settings + run_id + status). A case that fails is recorded as
  ``failed`` with its error and the remaining cases are relaunched.

Public names (``import dynmb``) wherever one exists; beyond them only ``dynmb.data`` (traces,
``sample_batch``), ``dynmb.packing.PackingError`` and ``dynmb.io.results.TableWriter``; nothing of
``dynmb.runtime``.
- ``measured(out_dir, run_id)``: medians of one run's measured (non-warm-up) steps.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import pandas as pd

import dynmb
from dynmb.io.results import TableWriter

__all__ = ["canon", "Resume", "progress", "split_list", "parse_batches", "simulate_rows", "run_real",
           "measured", "add_model_flags", "real_flags", "SIM_SETTINGS"]

SIM_SETTINGS = ("dataset", "model", "num_stages", "dp", "global_batch", "memory_limit_bytes", "method", "mbs",
                "schedule", "reorder", "cost_model", "seed", "oversize")


# --------------------------------------------------------------------------- settings / resume
def canon(v: Any) -> str:
    """A settings value as a comparable string (CSV round trips turn 2 into 2.0 and None into NaN)."""
    if v is None:
        return ""
    if isinstance(v, (float, np.floating)):
        if math.isnan(v):
            return ""
        if float(v).is_integer():
            return str(int(v))
    if isinstance(v, (bool, np.bool_)):
        return str(bool(v))
    return str(v)


class Resume:
    """Which configurations already have rows in ``out_dir/<table>.csv`` (by settings columns)."""

    def __init__(self, out_dir: str | Path, table: str, keys: Iterable[str],
                 where: Callable[[pd.DataFrame], pd.Series] | None = None,
                 defaults: dict[str, Any] | None = None) -> None:
        """``defaults``: the value of a key in rows written before that key existed (missing or empty)."""
        self.keys = tuple(keys)
        p = Path(out_dir) / f"{table}.csv"
        df = pd.read_csv(p) if p.exists() and p.stat().st_size > 0 else pd.DataFrame()
        for k, v in (defaults or {}).items():
            if not df.empty:
                df[k] = df[k].astype(object).fillna(v) if k in df else v
        if not df.empty and where is not None:
            df = df[where(df)]
        self._done = {self.key(r) for r in df.to_dict("records")} if not df.empty else set()

    def key(self, settings: dict[str, Any]) -> tuple[str, ...]:
        return tuple(canon(settings.get(k)) for k in self.keys)

    def done(self, settings: dict[str, Any]) -> bool:
        return self.key(settings) in self._done

    def add(self, settings: dict[str, Any]) -> None:
        self._done.add(self.key(settings))


def progress(it: Iterable[Any], total: int | None = None, desc: str = "", disable: bool = False) -> Any:
    """tqdm on stderr (a plain iterator when tqdm is missing)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        return it
    return tqdm(it, total=total, desc=desc, disable=disable, file=sys.stderr, dynamic_ncols=True)


def split_list(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def parse_batches(spec: str) -> Callable[[str], int]:
    """``'64,wikitext2=16'`` -> trace name -> global batch (64 unless overridden)."""
    default, per = None, {}
    for part in split_list(spec):
        if "=" in part:
            k, v = part.split("=", 1)
            per[k.strip()] = int(v)
        else:
            default = int(part)
    if default is None:
        raise ValueError(f"--global-batch {spec!r} needs a default number, e.g. '64,wikitext2=16'")
    return lambda trace: per.get(trace, default)


# --------------------------------------------------------------------------- flags
def add_model_flags(ap: argparse.ArgumentParser, *, stages: int = 2, model: str = "small") -> None:
    ap.add_argument("--model", default=model, help=f"model preset (default {model})")
    ap.add_argument("--stages", type=int, default=stages, help=f"pipeline stages (default {stages})")
    ap.add_argument("--schedule", default="1f1b", help="schedule kind the plans are made for (default 1f1b)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampled global batches (default 0)")
    ap.add_argument("--memory-model", default=None, help="fitted memory-model JSON (default analytic)")
    ap.add_argument("--oversize", default="truncate", choices=["error", "truncate", "drop"],
                    help="a sequence that cannot fit alone: truncate (default, counted), drop, or error")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")


def real_flags(ap: argparse.ArgumentParser, *, steps: int = 2) -> None:
    ap.add_argument("--steps", type=int, default=steps,
                    help=f"global batches per configuration: simulated, or measured after warm-up (default {steps})")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up steps of a real run (default 1)")
    ap.add_argument("--timeout", type=float, default=300.0, help="process-group timeout of a real run (s)")
    ap.add_argument("--quiet", action="store_true", help="do not stream the workers' output of real runs")


# --------------------------------------------------------------------------- simulated steps
def simulate_rows(settings: dict[str, Any], trace: np.ndarray, *, model_cfg: Any, cost_model: Any,
                  memory_model: Any, steps: int, virtual: int = 1) -> list[dict[str, Any]]:
    """One row per simulated global batch of ``settings`` (see ``SIM_SETTINGS``)."""
    from dynmb.data import sample_batch
    from dynmb.packing import PackingError

    rows = []
    limit = int(settings["memory_limit_bytes"])
    mbs = settings.get("mbs")
    mbs = None if mbs is None or (isinstance(mbs, float) and math.isnan(mbs)) else int(mbs)
    planner = dynmb.Planner(model=model_cfg, num_stages=int(settings["num_stages"]), memory_limit=limit,
                            cost_model=cost_model, memory_model=memory_model,
                            schedule=settings.get("schedule", "1f1b"), dp=int(settings.get("dp", 1)), virtual=virtual,
                            oversize=settings.get("oversize", "error"))
    for k in range(steps):
        batch = sample_batch(trace, int(settings["global_batch"]), int(settings["seed"]), step=k)
        t0 = time.perf_counter()
        try:
            step = planner.plan(batch, method=settings["method"], reorder=settings.get("reorder", "none"), mbs=mbs)
            plan, sched, sim = step.plan, step.schedule, step.sim
        except PackingError as e:
            return [{**settings, "step": 0, "status": "infeasible", "error": str(e)[:300]}]
        wall = time.perf_counter() - t0
        pr = plan.predictions
        peak = float(max(pr["pred_peak_bytes"])) if pr.get("pred_peak_bytes") else float("nan")
        rows.append({
            **settings, "step": k, "status": "ok", "error": "",
            "pred_step_s": pr["pred_step_s"], "real_tokens": plan.real_tokens,
            "computed_tokens": plan.computed_tokens, "pred_tokens_per_s": plan.real_tokens / pr["pred_step_s"],
            "padding_fraction": plan.padding_fraction, "num_microbatches": plan.num_microbatches,
            "mbs_used": plan.meta.get("mbs"), "pred_mean_bubble": pr.get("mean_bubble"),
            "pred_peak_bytes": peak, "pred_peak_over_limit": peak / limit, "plan_s": pr.get("plan_s"),
            "wall_s": wall, "truncated": len(plan.meta.get("truncated", [])),
            "dropped": len(plan.meta.get("dropped", [])), "_plan": plan, "_sched": sched, "_sim": sim,
        })
    return rows


def append_row(row: dict[str, Any], out: Path | None) -> None:
    """One cell's row appended to the JSON-lines file ``out`` (None: nothing written)."""
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(json.dumps(row, default=float) + "\n")


def strip_private(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]


# --------------------------------------------------------------------------- real runs
def _backend_device() -> tuple[str, str]:
    """nccl on CUDA when torch sees a GPU, else gloo on CPU."""
    import torch

    return ("nccl", "cuda") if torch.cuda.is_available() else ("gloo", "cpu")


def _run_config(s: dict[str, Any], steps: int, warmup: int, timeout: float,
                cost_model_path: str | None) -> dynmb.RunConfig:
    backend, device = _backend_device()
    mbs = s.get("mbs")
    mbs = None if mbs is None or (isinstance(mbs, float) and math.isnan(mbs)) else int(mbs)
    return dynmb.RunConfig(
        model=dynmb.model_config(str(s["model"])),
        pipeline=dynmb.PipelineConfig(num_stages=int(s["num_stages"]), schedule=s.get("schedule", "1f1b"),
                                      reorder=s.get("reorder", "none"),
                                      memory_limit_bytes=int(s["memory_limit_bytes"])),
        dataset=s["dataset"], global_batch=int(s["global_batch"]), method=s["method"], mbs=mbs,
        dp=int(s.get("dp", 1)), seed=int(s["seed"]), steps=steps, warmup=warmup, backend=backend, device=device,
        cost_model=cost_model_path, timeout_s=timeout, oversize=s.get("oversize", "error"))


def _complete_runs(out_dir: Path, need: int) -> dict[str, int]:
    p = out_dir / "steps.csv"
    if not p.exists() or p.stat().st_size == 0:
        return {}
    counts = pd.read_csv(p).groupby("run_id").size()
    return {str(r): int(n) for r, n in counts.items() if n >= need}


def run_real(cases: list[dict[str, Any]], out_dir: str | Path, *, steps: int, warmup: int, timeout: float,
             cost_model_path: Callable[[dict[str, Any]], str | None] | None = None, memory_model: str | None = None,
             quiet: bool = False) -> list[dict[str, Any]]:
    """Run ``cases`` (settings dicts, same stages/dp) as one torchrun job; returns their ``configs`` rows.

    Writes the ``configs`` rows to ``out_dir`` as each launch ends. A failed case is recorded
    with ``status='failed'`` and its error; the cases after it are launched again.
    """
    out = Path(out_dir)
    pending = list(cases)
    result: list[dict[str, Any]] = []
    # CPU: round by round (dynmb.run(..., interleave=True)), so outside load hits every case alike. A
    # failed interleaved job cannot say which case failed: its unfinished cases are then run
    # again one after another, which can.
    interleave = len(pending) > 1 and _backend_device()[1] == "cpu"
    while pending:
        configs = [_run_config(s, steps, warmup, timeout, cost_model_path(s) if cost_model_path else None)
                   for s in pending]
        nproc = int(pending[0]["num_stages"]) * int(pending[0].get("dp", 1))
        t0 = time.perf_counter()
        launched = dynmb.run(configs, out, nproc=nproc, memory_model=memory_model,
                             output="quiet" if quiet else "stream", interleave=interleave)
        specs = list(zip(pending, launched.run_ids))
        rc = launched.returncode
        wall = time.perf_counter() - t0
        done = _complete_runs(out, warmup + steps)
        if interleave and rc != 0:
            rows = [{**s, "run_id": rid, "status": "ok", "error": "", "launch_s": wall} for s, rid in specs
                    if rid in done]
            if rows:
                with TableWriter(out) as w:
                    w.append("configs", rows)
            result += rows
            pending = [s for s, rid in specs if rid not in done]
            interleave = False
            print("experiments: the interleaved job failed; running its unfinished cases one by one", file=sys.stderr)
            continue
        rows, failed_at = [], None
        for i, (s, rid) in enumerate(specs):
            if rid in done:
                rows.append({**s, "run_id": rid, "status": "ok", "error": "", "launch_s": wall})
            elif failed_at is None:
                failed_at = i
                err = "; ".join(launched.failures) or f"torchrun exited with code {rc}"
                rows.append({**s, "run_id": rid, "status": "failed", "error": err[:500], "launch_s": wall})
                print(f"experiments: case {s['method']} {s['dataset']} failed: {err[:300]}", file=sys.stderr)
        with TableWriter(out) as w:
            w.append("configs", rows)
        result += rows
        pending = [s for s, _ in specs[failed_at + 1:]] if failed_at is not None else []
        if rc == 0 and failed_at is not None:
            break          # the job succeeded but a run wrote no complete steps: do not loop forever
    return result


def measured(out_dir: str | Path, run_ids: Iterable[str]) -> pd.DataFrame:
    """Per run_id: median measured step_s, tokens_per_s, pred_step_s, mean_bubble, pred error, peak / limit."""
    out = Path(out_dir)
    steps = pd.read_csv(out / "steps.csv")
    steps = steps[steps["run_id"].isin(list(run_ids))]
    if "warmup" in steps:
        steps = steps[~steps["warmup"].astype(bool)]
    steps = steps.assign(pred_err=(steps["pred_step_s"] - steps["step_s"]).abs() / steps["step_s"])
    agg = steps.groupby("run_id").agg(step_s=("step_s", "median"), tokens_per_s=("tokens_per_s", "median"),
                                      runtime_pred_step_s=("pred_step_s", "median"),
                                      mean_bubble=("mean_bubble", "median"), pred_err=("pred_err", "median"))
    mp = out / "memory.csv"
    if mp.exists():
        mem = pd.read_csv(mp)
        mem = mem[mem["run_id"].isin(list(run_ids))]
        agg = agg.join((mem["peak_bytes"] / mem["limit_bytes"]).groupby(mem["run_id"]).max().rename("peak_over_limit"))
    return agg.reset_index()
