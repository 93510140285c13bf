"""Real runs from Python: ``dynmb.run(config_or_configs, out=...) -> RunResult``.

``run`` launches torchrun as ``dynmb run`` does (``launch.launch_job``: the same checks before
it starts, the same worker, stopping on SIGINT/SIGTERM from the main thread) and returns the
exit code, this run's tables and the failure lines::

    import dynmb
    cfg = dynmb.RunConfig(model=dynmb.model_config("tiny"), global_batch=8, steps=2)
    result = dynmb.run(cfg, out="results/try")       # or a list of configs: one torchrun job
    result.returncode, result.failures
    result.tables["steps"]                           # only the rows of this call's run ids

Several configs run as the cases of one torchrun job (start-up paid once), one after another
or, with ``interleave`` (CPU), round by round: step k of every case before step k + 1 of any, so
that outside load on a shared machine slows every case alike; they need the same rank count. Every call gets new run ids, so a folder that already
holds results keeps them and ``tables`` holds this call's rows only (``results.select_runs``).
``run_job`` is the same for a prepared ``JobSpec`` (what ``dynmb run`` uses).

Real text: ``run(cfg, out=..., corpus=dynmb.CorpusSource.create("data.jsonl", "text"))`` tokenizes
the corpus once into ``out/tokens/`` (``dynmb.data.prepare_tokens``; the tokenizer's vocabulary
is checked against every config's model first) and every ``RunConfig`` draws its global batches
from the corpus's records and trains on their ids (its ``dataset`` becomes the corpus's name).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import pandas as pd

from dynmb.core.config import RunConfig
from dynmb.data.tokens import CorpusSource, prepare_tokens
from dynmb.io.results import TABLES, load_results, select_runs
from dynmb.runtime.launch import LaunchResult, launch_job
from dynmb.runtime.spec import JobSpec, RunSpec

__all__ = ["RunResult", "run", "run_job"]


@dataclass
class RunResult:
    """What a run (or a job of runs) produced."""

    returncode: int
    """0 on success; 130 / 143 when SIGINT / SIGTERM stopped it; else torchrun's (or 124: the guard)."""
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    """``steps``, ``actions``, ``memory``, ``runs`` (``dynmb.load_results``), rows of ``run_ids`` only."""
    failures: tuple[str, ...] = ()
    """One line per failed rank (or the interruption), empty on success."""
    run_ids: tuple[str, ...] = ()
    """The run ids of this call's runs, in case order."""
    launch: LaunchResult = field(default_factory=lambda: LaunchResult(0))
    """The launcher's own result (signal, stopped workers, complete steps)."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def _tables(out_dirs: Sequence[str], run_ids: Sequence[str]) -> dict[str, pd.DataFrame]:
    loaded = [load_results(d) for d in dict.fromkeys(out_dirs) if Path(d).exists()]
    merged = {t: pd.concat([x[t] for x in loaded if not x[t].empty], ignore_index=True)
              if any(not x[t].empty for x in loaded) else pd.DataFrame() for t in TABLES}
    return select_runs(merged, run_ids)


def run_job(job: JobSpec, nproc: int, *, quiet: bool = False, progress: bool = False,
            guard_s: float | None = None) -> RunResult:
    """``launch_job(job, nproc)`` and the tables of the job's runs."""
    launched = launch_job(job, nproc, guard_s=guard_s, quiet=quiet, progress=progress)
    ids = tuple(c.run_id for c in job.cases)
    return RunResult(launched.returncode, _tables([c.out_dir for c in job.cases], ids), launched.failures, ids,
                     launched)


RUN_OUTPUT = ("quiet", "progress", "stream")
"""``dynmb.run(output=)``: what the caller sees while the job runs."""


def run(config_or_configs: RunConfig | RunSpec | Sequence[RunConfig | RunSpec], out: str | Path, *,
        nproc: int | None = None, verify: bool = False, allow_over_limit: bool = False,
        memory_model: str | None = None, labels: Sequence[str] | None = None, output: str = "quiet",
        interleave: bool = False, corpus: CorpusSource | None = None) -> RunResult:
    """Run one ``RunConfig`` (or several, as the cases of one torchrun job) into ``out``.

    ``RunSpec`` items are taken as they are (their own folder and run id, which must be new);
    ``RunConfig`` items get a new run id, ``verify``, ``allow_over_limit``, ``memory_model`` and
    their label from ``labels`` (default: the method). ``nproc`` defaults to the first case's
    ranks (stages x dp / virtual). ``output``: ``quiet`` (default: nothing), ``progress`` (a
    progress bar) or ``stream`` (the workers' output); ``interleave``: several CPU cases round by round (see the module doc); ``corpus``: the
    ``RunConfig`` items train on its text (module docstring). Bad
    inputs raise ``ValueError``/``OSError`` before torchrun starts."""
    items = [config_or_configs] if isinstance(config_or_configs, (RunConfig, RunSpec)) else list(config_or_configs)
    if not items:
        raise ValueError("dynmb.run: no config to run")
    if labels is not None and len(labels) != len(items):
        raise ValueError(f"dynmb.run: {len(labels)} labels for {len(items)} configs")
    tokens = None
    if corpus is not None:
        models = [c.model for c in items if isinstance(c, RunConfig)]
        smallest = min(models, key=lambda m: m.vocab_size) if models else None
        shortest = min((c.model.max_seq_len for c in items if isinstance(c, RunConfig) and c.oversize == "error"),
                       default=None)           # a record no row of such a run holds: refused as it is read
        tokens = prepare_tokens(corpus, out, vocab_size=smallest.vocab_size if smallest else None,
                                model_name=smallest.name if smallest else "model", max_len=shortest)
    specs = []
    for i, item in enumerate(items):
        if isinstance(item, RunSpec):
            specs.append(item)
        elif isinstance(item, RunConfig):
            cfg = item if tokens is None else replace(item, dataset=tokens.source.name)
            specs.append(RunSpec.create(cfg, out, label=labels[i] if labels is not None else None, verify=verify,
                                        allow_over_limit=allow_over_limit, memory_model=memory_model, corpus=tokens))
        else:
            raise TypeError(f"dynmb.run: expected RunConfig or RunSpec, got {type(item).__name__}")
    if interleave and any(s.run.device != "cpu" for s in specs):
        raise ValueError("dynmb.run: interleave is for CPU runs (a CUDA peak would count every case's states)")
    job = JobSpec(out_dir=str(Path(out).resolve()), cases=tuple(specs), interleave=interleave)
    first = specs[0].run
    if output not in RUN_OUTPUT:
        raise ValueError(f"dynmb.run: output must be one of {RUN_OUTPUT}, got {output!r}")
    return run_job(job, nproc or first.spec.num_ranks * first.spec.dp, quiet=output != "stream",
                   progress=output == "progress")
