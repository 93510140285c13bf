"""Summaries of results tables: one row per configuration, the numbers the README quotes.

``summarise(tables, by=None)`` takes the dict from ``dynmb.io.results.load_results`` and
returns a DataFrame with one row per configuration. A configuration is every setting
that changes what a step computes: ``CONFIG_KEYS`` (dataset, limit, model, stages,
schedule, attention, rounding, global batch, seed, method, the *requested* mbs and pack
length, the case label) -- rows of different configurations are never merged.
``by`` replaces the keys (it must keep them apart: a ``ValueError`` names a key that
would merge runs of different configurations).

Per configuration (warm-up steps excluded):

- ``tokens_per_s``: sum of real tokens / sum of ``step_s`` over its measured steps (every
  method of one run sees the same global batches, so totals compare like with like);
- ``x_<reference>``: the reference method's (``dynamic``) advantage, the median over
  steps of the paired ratio ``reference tokens/s at step k / this tokens/s at step k``
  (steps paired by index within the same context: same dataset, limit, model, stages,
  schedule, attention, rounding, global batch, seed; and repeat, when the steps carry a ``repeat``
  column, so each repeat of a compare is paired with itself), with ``x_<reference>_lo`` / ``_hi``: the
  smallest and largest paired ratio, and ``x_<reference>_ci_lo`` / ``_ci_hi``: the 95% interval of that
  median by a paired bootstrap (``paired_bootstrap``: the paired ratios resampled with replacement
  ``BOOTSTRAP_DRAWS`` times, seeded; the percentiles of the resampled medians), ``pairs`` their count;
- ``speedup_vs_fixed``: the paired median ratio this / ``fixed`` (the largest-mbs
  ``fixed`` case of the context when there are several);
- ``padding_fraction``: 1 - real / computed tokens over the steps; ``num_microbatches``,
  ``distinct_shapes``: means; ``new_shapes``: sum;
- ``mean_bubble``: median of the per-step mean bubble fraction;
- ``peak_over_limit``: max over steps and stages of measured peak / limit;
- ``step_s``, ``pred_step_s``: medians; ``pred_err``: median of |pred - measured| / measured;
- ``step_ratio``: median measured / predicted step time; ``action_ratio``: median measured / predicted
  seconds of the steps' actions (with an ``actions`` table): the bias of the predictions a case ran by;
- ``replay_err``: median of |replay - measured| / measured, ``replay_step_s`` being the
  simulator's step time with the measured action times (the simulator's own error; what
  ``pred_err`` adds to it is the cost model's); absent when no step has a replay;
- ``gap_to_bound`` / ``gap_to_ideal``: medians of ``step_s / bound_s - 1`` and ``step_s /
  batch_ideal_s - 1`` (``dynmb.timing.bounds``; present when the steps carry them). ``ideal_s`` is the limit of
  the batch, the same for every method, but each run prices it with its own run-time-calibrated cost
  model (on a noisy box the cases of one compare differ by +-5% at the same step); ``batch_ideal_s`` is
  the median over the runs that saw that batch (same context, ``oversize`` and step) of their
  ``ideal_s``, so every method's gap is measured against one ideal per batch;
- ``plan_s``: median planning time per step; ``mbs``: the microbatch sizes the steps
  used (``"3"``, or ``"2-3"`` when an automatic mbs varied).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

__all__ = ["summarise", "paired_bootstrap", "repeat_noise", "Summary", "CONFIG_KEYS", "CONTEXT_KEYS", "READ_COLUMNS", "BOOTSTRAP_DRAWS"]

BOOTSTRAP_DRAWS = 4000
"""Resamples of the paired bootstrap (the interval's percentiles move by < 0.5% between seeds)."""
READ_COLUMNS = ("steps", "tokens_per_s", "x_dynamic", "x_dynamic_ci_lo", "x_dynamic_ci_hi", "speedup_vs_fixed",
                "padding_fraction", "mean_bubble", "peak_over_limit", "step_s", "pred_step_s", "pred_err")
"""The columns ``print(summarise(...))`` shows (``Summary``); every column stays in the frame."""

CONTEXT_KEYS = ("dataset", "memory_limit_bytes", "model", "num_stages", "virtual", "dp", "schedule", "attention",
                "round_to", "global_batch", "seed")
"""What makes two runs see the same global batches on the same pipeline."""
CONFIG_KEYS = CONTEXT_KEYS + ("method", "mbs_setting", "pack_len_setting", "reorder", "label")
"""The step-table columns that make two runs different configurations."""
RUN_SETTING_KEYS = ("recompute", "oversize", "slice_fitting", "cost_model", "memory_model", "lr", "backend", "device", "prewarm",
                    "calibrate", "corpus", "tokenizer", "stage_split")
"""Settings of the run spec (the ``runs`` table) that change what a step computes or how it is timed;
``summarise`` keys on them too (and on every ``model.*`` field), so runs that differ in any of them
are never merged, whether or not the steps table repeats them."""


def _measured(steps: pd.DataFrame) -> pd.DataFrame:
    if "warmup" in steps.columns:
        steps = steps[~steps["warmup"].astype(bool)]
    return steps


def _run_settings(steps: pd.DataFrame, runs: pd.DataFrame | None) -> tuple[pd.DataFrame, list[str]]:
    """Join the run spec's settings (``RUN_SETTING_KEYS`` and ``model.*``) onto the steps by run id;
    returns the steps and the names of the setting columns: those joined and those the steps table
    carries itself (``recompute``, ``oversize``: a key whichever table holds it)."""
    own = [c for c in steps.columns if c in RUN_SETTING_KEYS]     # settings the steps table carries itself
    if runs is None or runs.empty or "run_id" not in runs.columns:
        return steps, own
    wanted = [c for c in runs.columns if c in RUN_SETTING_KEYS or c.startswith("model.")]
    wanted = [c for c in wanted if c not in steps.columns]
    if not wanted:
        return steps, own
    first = runs.drop_duplicates("run_id")
    spec = first[wanted].astype(object).where(first[wanted].notna(), "")   # NaN never equals NaN: keys need a value
    spec.index = first["run_id"].astype(str)
    rid = steps["run_id"].astype(str)
    return steps.assign(**{c: rid.map(spec[c].astype(str)).fillna("") for c in wanted}), own + wanted


def _with_settings(steps: pd.DataFrame, runs: pd.DataFrame | None) -> pd.DataFrame:
    """Add ``mbs_setting`` / ``pack_len_setting``: what the run asked for (its config), not
    what each step used (an automatic mbs may differ from step to step)."""
    steps = steps.copy()
    for col in ("mbs", "pack_len"):
        setting = f"{col}_setting"
        if runs is not None and not runs.empty and col in runs.columns:
            asked = runs.drop_duplicates("run_id").set_index("run_id")[col]
            steps[setting] = steps["run_id"].map(asked)
        else:
            steps[setting] = np.nan
        steps[setting] = steps[setting].map(lambda v: "auto" if pd.isna(v) else str(int(v)))
    return steps


def _span(values: pd.Series) -> str:
    v = values.dropna()
    if v.empty:
        return ""
    lo, hi = int(v.min()), int(v.max())
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def _batch_ideal(steps: pd.DataFrame, ctx: list[str]) -> pd.Series:
    """Per step row, the median ``ideal_s`` over the runs that saw the same batch (module doc)."""
    ideal = pd.to_numeric(steps["ideal_s"], errors="coerce")
    batch = ctx + [k for k in ("oversize",) if k in steps.columns] + ["step"]
    return ideal.groupby([steps[k] for k in batch], dropna=False).transform("median")


def paired_bootstrap(ratios: np.ndarray, *, draws: int = BOOTSTRAP_DRAWS, level: float = 0.95,
                     seed: int = 0) -> tuple[float, float]:
    """The ``level`` interval of the median of paired ``ratios`` (NaNs dropped): resample the pairs with
    replacement ``draws`` times (``numpy.random.default_rng(seed)``), take each resample's median, return
    the percentiles. One pair: ``(r, r)``; none: NaNs."""
    values = np.asarray(ratios, dtype=float)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return float("nan"), float("nan")
    picks = np.random.default_rng(seed).integers(0, values.size, size=(draws, values.size))
    medians = np.median(values[picks], axis=1)
    tail = 100 * (1 - level) / 2
    return float(np.percentile(medians, tail)), float(np.percentile(medians, 100 - tail))


def repeat_noise(steps: pd.DataFrame) -> float:
    """How much the same step of the same case moved between repeats (a ``repeat`` column): the median over
    (run label, step, repeat) of ``|tokens_per_s / its median over the repeats - 1|``; NaN with one repeat."""
    steps = _measured(steps)
    if "repeat" not in steps.columns or steps["repeat"].nunique() < 2:
        return float("nan")
    by = [steps["label"] if "label" in steps.columns else steps["method"], steps["step"]]
    tps = pd.to_numeric(steps["tokens_per_s"], errors="coerce")
    median = tps.groupby(by).transform("median")
    several = tps.groupby(by).transform("size") > 1
    deviation = (tps / median - 1.0).abs()[several]
    return float(deviation.median()) if len(deviation) else float("nan")


def _paired(steps: pd.DataFrame, keys: list[str], pair: list[str], ref: pd.Series) -> pd.DataFrame:
    """Per configuration: median, min, max and bootstrap interval over steps of ``ref_tps[step] / tps[step]``."""
    own = steps.set_index(pair)["tokens_per_s"]
    ratio = ref.reindex(own.index).to_numpy() / own.to_numpy()
    frame = steps[keys].copy()
    frame["ratio"] = ratio
    g = frame.groupby(keys, dropna=False)["ratio"]
    ci = g.agg(lambda r: paired_bootstrap(r.to_numpy()))
    return pd.DataFrame({"median": g.median(), "lo": g.min(), "hi": g.max(), "pairs": g.count(),
                         "ci_lo": ci.map(lambda c: c[0]), "ci_hi": ci.map(lambda c: c[1])})


def _against(steps: pd.DataFrame, keys: list[str], pair: list[str], name: str,
             pick_largest_mbs: bool) -> pd.DataFrame | None:
    """Every configuration's paired ratios to method ``name`` (``_paired``); None when it did not run."""
    rows = steps[steps["method"] == name]
    if rows.empty:
        return None
    if pick_largest_mbs and rows["mbs_setting"].nunique() > 1:
        # several fixed cases: the baseline is the largest microbatch that fits (the common default)
        rows = rows[rows["label"] == rows.sort_values("mbs").iloc[-1]["label"]]
    if rows.groupby(pair, dropna=False).size().max() > 1:
        rows = rows[rows["label"] == rows["label"].iloc[0]]
    # several runs of the reference configuration (a repeated run into one folder): pair each
    # step with their median, so the reference is one value per (context, step)
    return _paired(steps, keys, pair, rows.groupby(pair, dropna=False)["tokens_per_s"].median())


def _prediction_ratios(steps: pd.DataFrame, actions: pd.DataFrame | None, keys: list[str]) -> pd.DataFrame:
    """Per configuration, the median measured / predicted step time (``step_ratio``) and, with an
    ``actions`` table, seconds of the measured steps' actions (``action_ratio``)."""
    out = pd.DataFrame({"step_ratio": (steps["step_s"] / steps["pred_step_s"]).groupby(
        [steps[k] for k in keys], dropna=False).median()})
    if actions is None or actions.empty or not {"pred_s", "start_s", "end_s"} <= set(actions.columns):
        return out
    acts = actions[actions["pred_s"] > 0]
    ratio = ((acts["end_s"] - acts["start_s"]) / acts["pred_s"]).rename("ratio")
    step_keys = steps.drop_duplicates(["run_id", "step"]).set_index(["run_id", "step"])[keys]
    joined = acts[["run_id", "step"]].join(ratio).join(step_keys, on=["run_id", "step"], how="inner")
    out["action_ratio"] = joined.groupby(keys, dropna=False)["ratio"].median()
    return out


def summarise(tables: dict[str, pd.DataFrame], by: Sequence[str] | None = None, *,
              reference: str = "dynamic", baseline: str = "fixed") -> pd.DataFrame:
    """One row per configuration; see the module docstring."""
    steps = _measured(tables["steps"])
    if steps.empty:
        raise ValueError("no measured steps in the results tables")
    steps = _with_settings(steps, tables.get("runs"))
    steps, spec_keys = _run_settings(steps, tables.get("runs"))
    if "label" not in steps.columns:
        steps["label"] = steps["method"]
    steps["label"] = steps["label"].fillna(steps["method"])
    present = [k for k in CONFIG_KEYS if k in steps.columns]
    present += [k for k in spec_keys if by is not None or steps[k].nunique(dropna=False) > 1]
    keys = list(by) if by is not None else present
    missing = [k for k in keys if k not in steps.columns]
    if missing:
        raise ValueError(f"summarise: no column(s) {missing} in the steps table")
    for k in present:
        if k not in keys and steps.groupby(keys, dropna=False)[k].nunique(dropna=False).max() > 1:
            raise ValueError(f"summarise(by={list(keys)}) would merge runs of different {k!r}; add it to `by`")
    ctx = [k for k in CONTEXT_KEYS if k in keys]
    pair = ctx + ["step"] + (["repeat"] if "repeat" in steps.columns else [])
    steps = steps.copy()
    steps["pred_err"] = (steps["pred_step_s"] - steps["step_s"]).abs() / steps["step_s"]
    g = steps.groupby(keys, dropna=False)
    out = pd.DataFrame({
        "steps": g.size(),
        "tokens_per_s": g["real_tokens"].sum() / g["step_s"].sum(),
        "step_s": g["step_s"].median(),
        "pred_step_s": g["pred_step_s"].median(),
        "pred_err": g["pred_err"].median(),
        "padding_fraction": 1.0 - g["real_tokens"].sum() / g["computed_tokens"].sum(),
        "num_microbatches": g["num_microbatches"].mean(),
    })
    out = out.join(_prediction_ratios(steps, tables.get("actions"), keys))
    out = _optional_columns(out, steps, keys, ctx, tables.get("memory"))
    for name, col, pick_largest_mbs in ((reference, f"x_{reference}", False), (baseline, "speedup_vs_fixed", True)):
        pr = _against(steps, keys, pair, name, pick_largest_mbs)
        if pr is None:
            continue
        if name == reference:
            out[col], out[f"{col}_lo"], out[f"{col}_hi"] = pr["median"], pr["lo"], pr["hi"]
            out[f"{col}_ci_lo"], out[f"{col}_ci_hi"], out["pairs"] = pr["ci_lo"], pr["ci_hi"], pr["pairs"]
        else:
            out[col] = 1.0 / pr["median"]
    return Summary(out)


def _optional_columns(out: pd.DataFrame, steps: pd.DataFrame, keys: list[str], ctx: list[str],
                      mem: pd.DataFrame | None) -> pd.DataFrame:
    """``out`` with the columns of the steps (and memory) table's optional fields; adds their per-step errors to
    ``steps``."""
    g = steps.groupby(keys, dropna=False)
    if "replay_step_s" in steps.columns and steps["replay_step_s"].notna().any():
        replay = pd.to_numeric(steps["replay_step_s"], errors="coerce")
        steps["replay_err"] = (replay - steps["step_s"]).abs() / steps["step_s"]
        out["replay_err"] = steps.groupby(keys, dropna=False)["replay_err"].median()
    if "ideal_s" in steps.columns:      # gaps to the step's lower bounds (dynmb.timing.bounds)
        steps["gap_to_ideal"] = steps["step_s"] / _batch_ideal(steps, ctx) - 1.0
        steps["gap_to_bound"] = pd.to_numeric(steps["gap_to_bound"], errors="coerce")
        for col in ("gap_to_bound", "gap_to_ideal"):
            out[col] = steps.groupby(keys, dropna=False)[col].median()
    for col, how in (("mean_bubble", "median"), ("plan_s", "median"), ("distinct_shapes", "mean"),
                     ("new_shapes", "sum")):
        if col in steps.columns:
            out[col] = g[col].agg(how)
    if "mbs" in steps.columns:
        out["mbs"] = g["mbs"].agg(_span)
    if mem is not None and not mem.empty:
        mem = mem.copy()
        mem["ratio"] = mem["peak_bytes"] / mem["limit_bytes"]
        step_keys = steps.drop_duplicates(["run_id", "step"]).set_index(["run_id", "step"])[keys]
        mem = mem.join(step_keys, on=["run_id", "step"], how="inner")   # measured steps only
        out = out.join(mem.groupby(keys, dropna=False)["ratio"].max().rename("peak_over_limit"))
    return out


class Summary(pd.DataFrame):
    """``summarise``'s frame: every column and index level as computed; printed (``repr``, ``print``) as the
    few columns people read (``READ_COLUMNS``) by case (``label``), with one line naming the rest. Anything
    derived from it (``reset_index``, selections) is a plain ``DataFrame``."""

    @property
    def _constructor(self):
        return pd.DataFrame

    def readable(self) -> pd.DataFrame:
        """The printed view: ``READ_COLUMNS`` present, indexed by the index levels that differ between rows."""
        flat = pd.DataFrame(self).reset_index()
        names = [n for n in self.index.names if n is not None]
        varying = [n for n in names if flat[n].astype(str).nunique() > 1] or names[-1:] or ["index"]
        shown = [c for c in READ_COLUMNS if c in flat.columns]
        return flat.set_index(varying)[shown]

    def __repr__(self) -> str:
        view = self.readable()
        hidden = len(self.columns) - len(view.columns)
        with pd.option_context("display.max_columns", None, "display.width", 200, "display.precision", 3):
            text = view.to_string()
        return text + (f"\n[{len(self)} rows; {hidden} more columns and {self.index.nlevels} index levels: "
                       f"pd.DataFrame(summary) shows them all]" if hidden else "")
