"""The table ``dynmb compare`` prints: ``summarise``'s rows named by case, with the best fixed mbs and the
best token budget in hindsight as rows of their own, formatted with dynamic's paired ratio to each, and
the verdict line.

The verdict (``verdict``): the case dynamic is closest to (smallest paired median ratio ``x_dynamic``,
the ``-best`` repeats left out), its ratio with the 95% paired-bootstrap interval
(``analysis.paired_bootstrap``), "within noise" when the interval covers 1, and the box's state while
the job ran: the repeat noise (``analysis.repeat_noise``: how much one case's step moved between
repeats of the same batch; measured with ``--repeats`` >= 2) and the 1-minute load average
(``dynmb.io.hostinfo.LoadSampler``) against the usable cores. The printed headers are the CSV's column
names; one legend line says what each holds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import pandas as pd

__all__ = ["FIXED_SIZE_METHODS", "BUDGET_METHODS", "display_summary", "format_summary", "Verdict", "verdict",
           "BoxState", "LEGEND"]

FIXED_SIZE_METHODS = ("fixed", "sorted", "packed")
BUDGET_METHODS = ("token-budget", "balanced")
"""Methods with a token budget: the memory maximum (their main case) and, for the best budget in
hindsight, the memory maximum divided by 2, 4, ... (their ``mbs``, ``budget_candidates``)."""


def display_summary(summary: pd.DataFrame, labels: list[str]) -> pd.DataFrame:
    """``summarise``'s rows indexed by a display name, in case order: ``fixed (mbs 3)`` for the
    largest mbs that fits, ``fixed (mbs 1)`` ... for the hindsight candidates, then a
    ``fixed-best (mbs B)`` row repeating the fastest fixed case."""
    flat = summary.reset_index()
    flat = flat.set_index("label").reindex([lb for lb in labels if lb in set(flat["label"])]).reset_index()

    def name(row: pd.Series) -> str:
        if row["method"] in FIXED_SIZE_METHODS and row["method"] != "packed" and row.get("mbs"):
            return f"{row['method']} (mbs {row['mbs']})"
        return str(row["label"])

    flat.insert(0, "case", flat.apply(name, axis=1))
    fixed = flat[flat["method"] == "fixed"]
    if len(fixed) > 1:
        best = fixed.loc[fixed["tokens_per_s"].idxmax()].copy()
        best["case"] = f"fixed-best (mbs {best['mbs']})"
        at = int(fixed.index.max()) + 1
        flat = pd.concat([flat.iloc[:at], best.to_frame().T, flat.iloc[at:]], ignore_index=True)
    for method in BUDGET_METHODS:      # the best token budget in hindsight: cap (d = 1) or cap / d
        rows = flat[flat["method"] == method]
        if len(rows) > 1:
            best = rows.loc[rows["tokens_per_s"].astype(float).idxmax()].copy()
            d = str(best["label"]).rpartition("div=")[2] if "div=" in str(best["label"]) else "1"
            best["case"] = f"{method}-best (cap/{d})"
            at = int(rows.index.max()) + 1
            flat = pd.concat([flat.iloc[:at], best.to_frame().T, flat.iloc[at:]], ignore_index=True)
    return flat.set_index("case")


_FORMATS = {"tokens_per_s": "{:,.0f}", "x_dynamic": "{:.2f}", "x_dynamic_ci_lo": "{:.2f}",
            "x_dynamic_ci_hi": "{:.2f}", "padding_fraction": "{:.3f}", "mean_bubble": "{:.3f}",
            "peak_over_limit": "{:.3f}", "pred_step_s": "{:.2f}", "step_s": "{:.2f}", "pred_err": "{:.1%}",
            "step_ratio": "{:.2f}", "action_ratio": "{:.2f}", "replay_err": "{:.1%}", "gap_to_bound": "{:.1%}", "gap_to_ideal": "{:.1%}",
            "num_microbatches": "{:.1f}", "distinct_shapes": "{:.1f}", "new_shapes": "{:.0f}", "plan_s": "{:.4f}"}
"""The printed columns, in order, under their ``summary.csv`` names."""
LEGEND = ("x_dynamic: dynamic's tokens/s over the case's, median of per-step paired ratios (> 1: dynamic faster), "
          "x_dynamic_ci_lo/_ci_hi its 95% paired-bootstrap interval; padding_fraction, mean_bubble: fractions; "
          "peak_over_limit: measured peak / limit; step_s, pred_step_s: median measured / predicted s; step_ratio, action_ratio: median measured / "
          "predicted step and action; pred_err, "
          "gap_to_bound, gap_to_ideal: relative; plan_s: median s per step (docs/design.md has every column)")


@dataclass(frozen=True)
class BoxState:
    """How busy the machine was while the job ran."""

    load_peak: float
    """Highest 1-minute load average sampled (NaN: none)."""
    load_mean: float
    cores: int
    """Usable CPU cores (``dynmb.io.hostinfo.usable_cores``)."""
    repeat_noise: float
    """Median relative deviation of a case's step from its median over repeats (NaN: one repeat)."""
    repeats: int
    order_seed: int | None
    """The seed of the rounds' random case order (repeat r uses ``order_seed + r``)."""
    job_ranks: int = 0
    """The job's own rank processes: they count in the load average, so only load beyond them is others'."""

    @property
    def others_load(self) -> float:
        """Mean load beyond the job's own ranks (what other work on the machine added; NaN: not sampled)."""
        return self.load_mean - self.job_ranks

    @property
    def loaded(self) -> bool:
        """Other work averaged more than half a core while the job ran."""
        return self.others_load > 0.5


@dataclass(frozen=True)
class Verdict:
    """Dynamic against the closest other case, with its uncertainty."""

    reference: str
    best_other: str
    ratio: float
    """Median of per-step paired ratios reference / best_other (> 1: the reference is faster)."""
    ci_lo: float
    ci_hi: float
    pairs: int
    box: BoxState

    @property
    def within_noise(self) -> bool:
        """The interval covers 1, or the ratio is closer to 1 than the box's repeat noise."""
        covers = not (self.ci_lo > 1.0 or self.ci_hi < 1.0)
        return covers or (not math.isnan(self.box.repeat_noise) and abs(self.ratio - 1.0) <= self.box.repeat_noise)

    @property
    def reading(self) -> str:
        if self.within_noise:
            return "within noise: no difference can be told"
        return f"{self.reference} {'faster' if self.ratio > 1 else 'slower'}"

    def line(self) -> str:
        box = self.box
        noise = (f"repeat noise {box.repeat_noise:.1%} over {box.repeats} repeats" if not math.isnan(box.repeat_noise)
                 else "repeat noise not measured (--repeats 2 or more)")
        load = (f"load average {box.load_mean:.1f} (peak {box.load_peak:.1f}) on {box.cores} cores, "
                f"{box.job_ranks} of it the job's own ranks" if not math.isnan(box.load_peak) else "load average unknown")
        return (f"{self.reference} is {self.ratio:.2f}x the closest other case ({self.best_other}), 95% interval "
                f"{self.ci_lo:.2f}-{self.ci_hi:.2f} (paired bootstrap over {self.pairs} steps): {self.reading}; "
                f"{noise}; {load}{'; a loaded box: other work ran beside the job' if box.loaded else ''}")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "within_noise": self.within_noise, "line": self.line()}


def verdict(summary: pd.DataFrame, box: BoxState, reference: str = "dynamic") -> Verdict | None:
    """The verdict of ``display_summary``'s table (None without the reference and another case)."""
    col = f"x_{reference}"
    if col not in summary or not (summary["method"] == reference).any():
        return None
    others = summary[(summary["method"] != reference) & ~summary.index.str.contains("-best")]
    others = others[others[col].notna()]
    if others.empty:
        return None
    best = others[col].astype(float).idxmin()
    row = others.loc[best]
    return Verdict(reference, str(best), float(row[col]), float(row[f"{col}_ci_lo"]), float(row[f"{col}_ci_hi"]),
                   int(row["pairs"]), box)


def format_summary(summary: pd.DataFrame, reference: str = "dynamic", box: BoxState | None = None) -> str:
    """The printed table under the CSV's column names, the legend line, and (with ``box``) the verdict."""
    view = pd.DataFrame(index=summary.index)
    for key, f in _FORMATS.items():
        if key in summary:
            view[key] = summary[key].map(lambda v, f=f: "" if pd.isna(v) else f.format(float(v)))
    lines = [view.to_string(), LEGEND]
    found = verdict(summary, box, reference) if box is not None else None
    if found is not None:
        lines.append(found.line())
    return "\n".join(lines)
