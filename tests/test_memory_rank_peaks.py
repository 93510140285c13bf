"""The GPU's predicted peak in the memory rows (``MemoryRow.pred_rank_peak_bytes``) comes from the plan's predictions.

``Predictions.pred_rank_peak_bytes`` (``[replica][pipeline rank]``) is filled where the planner simulates each
replica (``planning.predict_replicas``); the step reads it and simulates nothing (before, ``runtime.step._rank_peak``
re-simulated the replica's schedule every step). Checked here:

- the field round-trips through a plan file; a plan file written before it existed loads (the field None) and its
  run fills it where the runtime predicts a plan file's steps (``RunState._plan_file_batch``);
- ``predict_replicas`` fills each replica's ``peak_bytes_rank``, rounded up, in replica order (two replicas);
- on 2 gloo ranks (and 4, slow): every memory row's ``pred_rank_peak_bytes`` equals what the old step computed
  (``ceil`` of ``simulate(replica's schedule).peak_bytes_rank`` of the rank; the stage's ``pred_peak_bytes`` where
  the rank holds one stage), for interleaved chunks, ``zb-v``, ``zb`` with the embedding on the last rank, recomputed
  blocks, two replicas of two ranks, a plan file without the field; fp64 gradients verified. Every case runs under
  ``NoSimulation``, a hook that fails the step where anything simulates a schedule between the rank's first action
  and its memory rows: the old code fails it on every case whose ranks hold two stages.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from dynmb.core.config import PlanSpec, RunConfig, model_config
from dynmb.core.predictions import Predictions
from dynmb.core.types import Plan
from dynmb.runtime.hooks import NoHooks
from dynmb.runtime.spec import HookRef, RunSpec
from tests.gloo_jobs import register

pytestmark = pytest.mark.filterwarnings("ignore::dynmb.costmodel.standin.StandInModelWarning")
HOOK = HookRef(target=f"{__name__}:NoSimulation")


class NoSimulation(NoHooks):
    """Step hook: the step fails (``RuntimeError`` from ``memory_limit``) where a schedule was simulated
    (``dynmb.timing.simulate.simulate_costs``, which every simulation runs) between the rank's first action and
    its memory rows."""

    def __init__(self) -> None:
        import dynmb.timing.simulate as sim

        self.active, self.calls = False, 0
        real: Callable[..., Any] = getattr(sim.simulate_costs, "unwatched", sim.simulate_costs)

        def watched(*args: Any, **kwargs: Any) -> Any:
            self.calls += self.active
            return real(*args, **kwargs)
        watched.unwatched = real          # type: ignore[attr-defined]
        sim.simulate_costs = watched

    def before_action(self, rank: int, step: int, index: int, actions: Any) -> None:
        if index == 0:
            self.active, self.calls = True, 0

    def memory_limit(self, rank: int, step: int, stage: int, limit_bytes: int, peak_bytes: int) -> int:
        if self.calls:
            raise RuntimeError(f"rank {rank} step {step}: the step simulated a schedule {self.calls} time(s)")
        self.active = False
        return limit_bytes


def _run(stages: int, kind: str, *, dp: int = 1, virtual: int = 1, embedding: str = "first",
         layers: int = 4, split: tuple | None = None, rc: tuple | None = None, method: str = "dynamic") -> RunConfig:
    model = replace(model_config(f"llama-tiny:dtype=float64,n_layers={layers}"), layer_split=split,
                    recompute_blocks=rc)
    spec = PlanSpec(method=method, num_stages=stages, virtual=virtual, schedule_kind=kind, dp=dp,
                    embedding=embedding, memory_limit_bytes=256 * 2**20)
    spec = spec.with_(mbs=1) if method == "fixed" else spec
    return RunConfig(model=model, spec=spec, seed=3, steps=2, warmup=0, backend="gloo", device="cpu",
                     timeout_s=120.0, dataset="gsm8k", global_batch=8)


TWO = {"rankpeak-interleaved-2": _run(4, "interleaved", virtual=2),
       "rankpeak-zbv-2": _run(4, "zb-v", virtual=2),
       "rankpeak-embedlast-zb-2": _run(2, "zb", embedding="last"),
       "rankpeak-rcblocks-2": _run(4, "interleaved", virtual=2, split=(1.5, 1, 1, 0.5), rc=(1, 0, 1, 0),
                                   method="fixed")}
FOUR = {"rankpeak-dp2-interleaved-4": _run(4, "interleaved", virtual=2, dp=2),
        "rankpeak-zbv-4": _run(8, "zb-v", virtual=2, layers=8),
        "rankpeak-embedlast-zb-4": _run(4, "zb", embedding="last")}
PLANFILE = "rankpeak-planfile-2"
"""A run of ``rankpeak-interleaved-2``'s first plan from a file whose predictions lack the field."""


def _spec(out: Path, name: str, run: RunConfig, plan: Path | None = None) -> RunSpec:
    return RunSpec.create(run, out / name, verify=True, run_id=name, calibrate=False, hooks=HOOK, plan=plan)


def _old_file(out: Path) -> Path:
    """``PLANFILE``'s plan: the planner's plan of the interleaved case's first batch, saved without the field."""
    from dynmb.planning import plan_step

    run = TWO["rankpeak-interleaved-2"]
    plan = plan_step(_lengths(run, 0), run.plan_spec, model_cfg=run.model,
                     models=_spec(out, PLANFILE, run).models())[0]
    data = plan.to_dict()
    del data["predictions"]["pred_rank_peak_bytes"]
    path = out / f"{PLANFILE}.json"
    path.write_text(json.dumps(data))
    return path


@register(2)
def _two(out: Path) -> list[RunSpec]:
    out.mkdir(parents=True, exist_ok=True)
    run = replace(TWO["rankpeak-interleaved-2"], steps=1)
    return [_spec(out, n, r) for n, r in TWO.items()] + [_spec(out, PLANFILE, run, plan=_old_file(out))]


@register(4)
def _four(out: Path) -> list[RunSpec]:
    return [_spec(out, n, r) for n, r in FOUR.items()]


def _lengths(run: RunConfig, step: int) -> np.ndarray:
    from dynmb.data import load_trace, sample_indices

    trace = load_trace(run.dataset)
    return trace[sample_indices(len(trace), run.global_batch, run.seed, step=step, note=False)]


def _old_rank_peaks(spec: RunSpec, step: int) -> tuple[list[float], list[list[float]]]:
    """What the old step computed for step ``step`` of ``spec`` (its models uncalibrated): the plan's
    ``pred_peak_bytes`` and, per replica, ``simulate(schedule, replica).peak_bytes_rank``, each replica's schedule
    built as the step builds it (replica 0's the planner's)."""
    from dynmb.planning import plan_step, replica_schedules, replicas_of
    from dynmb.timing.simulate import simulate

    run, models = spec.run, spec.models()
    if spec.plan is not None:
        plan, first = Plan.load(spec.plan), None
    else:
        plan, first, _ = plan_step(_lengths(run, step), run.plan_spec, model_cfg=run.model, models=models)
    replicas = replicas_of(plan)
    scheds = replica_schedules(replicas, run.plan_spec, models=models, first=first)
    sims = [simulate(s, p, models.cost, models.memory) for s, p in zip(scheds, replicas)]
    stage_peaks = np.max([np.asarray(sim.peak_bytes) for sim in sims], axis=0)
    return [int(x) for x in stage_peaks], [list(np.ceil(np.asarray(sim.peak_bytes_rank))) for sim in sims]


def _case(out: Path, name: str) -> RunSpec:
    """The spec ``name`` was registered with (``_two`` / ``_four``)."""
    if name == PLANFILE:
        return _spec(out, name, replace(TWO["rankpeak-interleaved-2"], steps=1), plan=out / f"{PLANFILE}.json")
    return _spec(out, name, {**TWO, **FOUR}[name])


def _check(out: Path, name: str) -> None:
    """``name``'s steps verified, a memory row per stage and step, each row's GPU peak the old step's."""
    from dynmb.io.results import load_results
    from dynmb.runtime.checks import VERIFY_RTOL_FP64

    spec = _case(out, name)
    run, t = spec.run, load_results(out / name)
    steps, mem = t["steps"], t["memory"]
    assert steps["verified"].all() and (steps["grad_rel_err"] <= VERIFY_RTOL_FP64).all(), name
    stages = run.spec.num_stages + (run.spec.embedding == "last")
    assert len(steps) == run.steps and len(mem) == run.steps * stages * run.spec.dp, name
    several = mem.groupby(["step", "rank"])["stage"].transform("size") > 1
    assert several.any(), f"{name}: no rank holds two stages"
    ranks_per_replica = run.spec.num_stages // run.spec.virtual
    for step, rows in mem.groupby("step"):
        stage_peaks, rank_peaks = _old_rank_peaks(spec, int(step))
        for row, many in zip(rows.itertuples(), several[rows.index]):
            old = rank_peaks[row.dp_rank][row.rank % ranks_per_replica] if many else row.pred_peak_bytes
            assert row.pred_rank_peak_bytes == old, (name, row.step, row.rank, row.stage, row.pred_rank_peak_bytes, old)
            if run.spec.embedding != "last":
                assert row.pred_peak_bytes == stage_peaks[row.stage], (name, row.step, row.stage)


def test_the_field_round_trips_and_an_old_plan_file_loads(tmp_path):
    """A plan with ``pred_rank_peak_bytes`` saves and loads it; its JSON without the key loads with None (fails
    where the field is missing from ``Predictions``, or an old file is refused)."""
    from dynmb.core.types import Microbatch

    mbs = tuple(Microbatch(seq_ids=np.array([i]), lengths=[8], padded_len=8, batch=1) for i in range(4))
    preds = Predictions(pred_peak_bytes=(5, 6), pred_rank_peak_bytes=[[7.0, 8], (9, 10)])
    plan = Plan(microbatches=mbs, method="test", num_stages=2, memory_limit_bytes=1 << 30, num_sequences=4, dp=2,
                replica_ids=(0, 0, 1, 1), predictions=preds)
    assert preds.pred_rank_peak_bytes == ((7, 8), (9, 10))
    plan.save(tmp_path / "new.json")
    assert Plan.load(tmp_path / "new.json").predictions.pred_rank_peak_bytes == ((7, 8), (9, 10))
    data = json.loads((tmp_path / "new.json").read_text())
    del data["predictions"]["pred_rank_peak_bytes"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = Plan.load(tmp_path / "old.json")
    assert old.predictions.pred_rank_peak_bytes is None and old.predictions.pred_peak_bytes == (5, 6)


def test_predict_replicas_fills_each_replicas_gpu_peaks():
    """Two replicas of an interleaved plan (2 ranks, 4 stages): ``pred_rank_peak_bytes`` is each replica's
    ``ceil(peak_bytes_rank)`` in replica order (fails where it is the first replica's twice, or left out)."""
    from dynmb.costmodel.loader import Models
    from dynmb.planning import plan_step, predict_replicas, replica_schedules, replicas_of
    from dynmb.timing.simulate import simulate

    run = replace(FOUR["rankpeak-dp2-interleaved-4"], global_batch=16)
    models: Models = RunSpec.create(run, Path("unused"), run_id="x").models()
    plan = plan_step(_lengths(run, 1), run.plan_spec, model_cfg=run.model, models=models)[0]
    replicas = replicas_of(plan)
    scheds = replica_schedules(replicas, run.plan_spec, models=models)
    want = [tuple(int(x) for x in np.ceil(simulate(s, p, models.cost, models.memory).peak_bytes_rank))
            for s, p in zip(scheds, replicas)]
    assert len(want) == 2 and want[0] != want[1]
    assert plan.predictions.pred_rank_peak_bytes == tuple(want)
    assert predict_replicas(replicas, scheds, models, Predictions()).predictions.pred_rank_peak_bytes == tuple(want)


@pytest.mark.dist
@pytest.mark.parametrize("name", [*TWO, PLANFILE])
def test_two_ranks_rows_carry_the_old_rank_peaks_without_simulating(gloo_job, name):
    job = gloo_job(2)
    assert job.returncode == 0, job.errors
    _check(job.out, name)


@pytest.mark.dist
@pytest.mark.parametrize("name", [*FOUR])
def test_four_ranks_rows_carry_the_old_rank_peaks_without_simulating(gloo_job, name):
    job = gloo_job(4)
    assert job.returncode == 0, job.errors
    _check(job.out, name)
