"""Interleaved (virtual) pipeline stages in ``studies/scaling/scaling.py`` (``--virtual V``).

``--stages P`` stays the number of GPUs in one pipeline; with ``--virtual V`` the model is cut into
``S = P V`` chunks, chunk ``s`` on GPU ``s % P`` (``dynmb.schedule.builders.interleaved``), and every
method is packed with ``num_stages=S, virtual=V`` (the packing context budgets a GPU's chunks together:
``dynmb.packing.context``), scheduled and simulated on the P GPUs. The kinds a row weighs: ``--schedule
auto`` gives ``auto_kinds(virtual=V)`` (with V > 1 the kinds with virtual stages: interleaved),
``--schedule interleaved`` that kind; ``1f1b`` runs one chunk per GPU and is refused with V > 1.

``--stage-split auto`` with V > 1 balances each GPU's total work, the sum of its V chunks
(``resolve_stage_split(..., virtual=V)``: ``dynmb.planning.gpu_split``), not each chunk's.

Refused before anything runs (one line, ``check``): a (P, V, split) whose chunks the model's layers do
not cover: the even split needs ``n_layers >= P V`` whole layers, ``--stage-split auto`` (half-blocks of
dynmb's families) ``2 n_layers >= P V`` half-blocks (more chunks than layers: half-blocks only).

What a row's bounds and metrics read with chunks (``ranks``): ``ideal_s`` / ``ideal_whole_s`` are
``dynmb.timing.bounds.ideal_bound`` with each chunk's work charged to its GPU (the busiest GPU's work, its
shortest fill and drain), ``attainable`` the chunks' ideal work over ``P x step`` (GPUs), ``efficiency``
the FLOPs of all chunks over ``DP x P`` GPUs (``real_work``, ``real_flops``: sums over every chunk). The row key ``virtual`` (rows from before the flag: 1)
keeps V = 1 and V = 2 rows of one cell apart in one results folder; the summary labels rows with V > 1
`` v<V>`` after the schedule setting (``setting_label``).

``--virtual auto`` (``choose_v``): once per cell, V among 1, 2, 4 that the layers allow under the row's
split setting (``dynmb.planning.virtual_search.admissible``) chosen by the library's ``VirtualSearch``: the
workload's (the trace's) sample batches, one replica's share of the cell's global batch, planned with
``dynamic`` under the row's settings (``--schedule``, limit, dp, oversize) at each V's layout (the row's own
split, ``resolve_stage_split`` with the study's ``ideal_cost``), priced by the study's GPU model; V 1 unless
another is strictly faster per real token. The row key stays ``virtual = auto``; the row records the chosen
V (``virtual_chosen``) and the choice's CPU seconds (``virtual_cpu_s``); its step is planned at that V.
A folder holding both kinds of rows writes ``virtual`` as text in its parquet copy (``Writer``); the summary
lists the ``auto`` rows in a table of their own (``auto_apart``).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from studies.common import canon
from studies.scaling.split import row_search


from dynmb.timing.bounds import ideal_bound, plan_lengths_pieces
from dynmb.costmodel.gpu import GPUCostModel
from dynmb.planning.stage_split import resolve_stage_split
from dynmb.planning.virtual_search import AUTO_VIRTUAL, CANDIDATES, VirtualSearch, admissible, say
from dynmb.io.results import TableWriter
from dynmb.schedule.kinds import AUTO, auto_kinds, get_kind

__all__ = ["kinds", "check", "ranks", "plan_ideal_v", "setting_label", "real_work", "real_flops", "parse_virtual",
           "weighs", "choose_v", "auto_apart", "Writer"]


def parse_virtual(text: str) -> int | str:
    """A ``--virtual`` entry: ``auto`` or a whole number."""
    return AUTO_VIRTUAL if text.strip() == AUTO_VIRTUAL else int(text)


def weighs(setting: str, virtuals: list) -> str:
    """The kinds each ``--virtual`` entry weighs (``auto``: those of every candidate V), for the header."""
    return "; ".join(", ".join(dict.fromkeys(k for w in (CANDIDATES if v == AUTO_VIRTUAL else (v,))
                                             for k in kinds(setting, w))) for v in virtuals)


def choose_v(c: dict, trace: np.ndarray, cfg, batch: np.ndarray, ideal_cost) -> tuple[int, float]:
    """``--virtual auto``: (the chosen V, its CPU seconds) of the cell of row settings ``c`` (module doc);
    ``ideal_cost(batch, link)``: the study's work model of ``--stage-split auto``."""
    P, split = int(c["num_stages"]), str(c["stage_split"])
    search = row_search(cfg, c, P, 1, int(batch.size))

    def layout_of(v: int, _search) -> object:
        return resolve_stage_split(cfg, P * v, split, stage_cost=ideal_cost(batch, c["link"]), virtual=v)

    choice = VirtualSearch(search).choose(cfg, layout_of, candidates=admissible(cfg.n_layers, P, split),
                                          workload=trace, cost_model=GPUCostModel(cfg, P, link=c["link"]))
    say(choice)
    return choice.virtual, choice.cpu_s


def kinds(setting: str, virtual: int) -> tuple[str, ...]:
    """The kinds a ``--schedule`` setting weighs with ``virtual`` chunks per GPU."""
    return auto_kinds(virtual=virtual) if setting == AUTO else (setting,)


def check(n_layers: int, stages: list[int], virtuals: list[int], splits: set[str], setting: str) -> None:
    """``SystemExit`` with one line where a setting cannot run (module doc)."""
    for v in (v for v in virtuals if v != AUTO_VIRTUAL):       # auto: the V the layers allow (admissible)
        if v < 1:
            raise SystemExit(f"scaling.py: --virtual must be >= 1, got {v}")
        if v > 1 and setting != AUTO and not get_kind(setting).virtual_stages:
            raise SystemExit(f"scaling.py: --virtual {v} needs a kind with virtual stages: --schedule auto or "
                             f"interleaved, not {setting}")
        for p in stages:
            for split in sorted(splits):
                units, what = (2 * n_layers, "half-blocks") if split in ("auto", "search") else (n_layers, "whole layers")
                if p * v > units:
                    raise SystemExit(f"scaling.py: P {p} x virtual {v} = {p * v} chunks, but the {split} split has "
                                     f"{units} {what} ({n_layers} layers): use a smaller P or V")


def ranks(num_chunks: int, virtual: int) -> np.ndarray:
    """The GPU of every chunk: ``s % P`` with ``P = num_chunks / virtual``."""
    return np.arange(num_chunks) % (num_chunks // virtual)


def plan_ideal_v(plan, cost_model, virtual: int) -> float:
    """``dynmb.timing.bounds.plan_ideal`` with each chunk's work on its GPU (``ranks``)."""
    lengths, shortest = plan_lengths_pieces(plan)
    return ideal_bound(lengths, cost_model, stage_rank=ranks(plan.num_stages, virtual), dp=plan.dp,
                       shortest_piece=shortest)


def setting_label(setting: object, virtual: object) -> str:
    """The summary's schedule setting of a row: ``--schedule`` and, with V > 1, `` v<V>``."""
    if str(virtual) == AUTO_VIRTUAL:
        return f"{setting} vauto"
    v = 1 if virtual is None or (isinstance(virtual, float) and np.isnan(virtual)) else int(virtual)
    return str(setting) if v == 1 else f"{setting} v{v}"


def real_work(cm, lengths: np.ndarray, dp: int) -> float:
    """Sum over stages of every sequence's own F + B at its own length (intercept removed), / dp."""
    uniq, count = np.unique(lengths.astype(np.float64), return_counts=True)
    L = np.concatenate([[0.0], uniq])
    with np.errstate(invalid="ignore", divide="ignore"):
        c = cm.stage_costs(np.ones_like(L), L, L * L)
    total = 0.0
    for op in ("F", "B"):
        a = np.asarray(c[op], dtype=np.float64).reshape(cm.num_stages, -1)
        total += float(np.maximum(a[:, 1:] - a[:, :1], 0.0).sum(axis=0) @ count)
    return total / dp


def real_flops(cfg, P: int, lengths: np.ndarray) -> float:
    """Forward + backward (3x forward) FLOPs of every sequence at its own length."""
    return 3.0 * float(sum(np.sum(cfg.stage_flops(s, P, 1, lengths.astype(np.float64))) for s in range(P)))


class Writer(TableWriter):
    """``TableWriter`` whose parquet copy takes a ``virtual`` column of numbers and ``auto`` (as text)."""

    def close(self) -> None:
        for df in self._frames.values():
            if "virtual" in df and df["virtual"].map(type).nunique() > 1:
                df["virtual"] = df["virtual"].map(canon)
        super().close()


AUTO_COLUMNS = ("dataset", "tokens", "num_stages", "dp", "method", "stage_split", "schedule_key", "virtual_chosen",
                "schedule", "pred_step_s", "gap_to_ideal", "attainable", "tokens_per_s", "virtual_cpu_s")


def auto_apart(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """(the rows of a numeric ``virtual``, for the summary's tables; a markdown table of the ``auto`` rows)."""
    if "virtual" not in df:
        return df, ""
    auto = df["virtual"].astype(str) == AUTO_VIRTUAL
    rest = df[~auto].copy()
    rest["virtual"] = pd.to_numeric(rest["virtual"])
    rows = df[auto & (df["status"] == "ok")]
    if rows.empty:
        return rest, ""
    cols = [c for c in AUTO_COLUMNS if c in rows]
    fmt = {"pred_step_s": "{:.3f}", "gap_to_ideal": "{:.1%}", "attainable": "{:.2f}", "tokens_per_s": "{:,.0f}",
           "virtual_cpu_s": "{:.1f}"}
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt.get(c, "{}").format(r[c]) for c in cols) + " |" for _, r in rows.iterrows()]
    return rest, "\n\n`--virtual auto` rows (V chosen per cell by simulated step):\n\n" + "\n".join(lines) + "\n"
