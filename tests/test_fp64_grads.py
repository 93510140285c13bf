"""Exact gradients in float64 on real gloo ranks: every schedule kind of the registry and the slice paths.

Each case is one ``--verify`` step of a float64 model (``ModelConfig.dtype="float64"``, GPT-2 ``tiny`` or
``llama-tiny``): every rank compares the gradient of every parameter it holds with the single-process
reference of the whole global batch (``dynmb.runtime.checks``: max abs error <= ``VERIFY_RTOL_FP64`` = 1e-10
x max |reference|, no absolute floor) and the ``steps`` table keeps the largest relative error over the
ranks (``grad_rel_err``). In float64 the pipeline and the reference differ only in the order of their sums,
so a wrong message, a lost slice key or value, or a misplaced ``W`` shows as an error of 1e-3 or more, where
the fp32 checks' 1e-5 could hide one.

Cases (``path``): ``kind`` runs the kind on eight padded single-row microbatches (``fixed``,
mbs 1; the interleaved and V-shape kinds with two chunks per rank); ``split`` cuts a 1,200-token document
longer than any row that fits (``oversize="split"``) into a chain of slices, run on a kind that takes
slices; ``fitting`` slices documents that fit, where predicted faster (``slice_fitting="auto"``, with
``oversize="truncate"``, so every slice is of a document that fits, and ``recompute="auto"``). The quick run (``FAST``) checks the zero-bubble kinds and each slice path on
2 ranks in the shared 2-rank job (``tests/gloo_jobs.py``), the two families alternating; the slow run
(``--runslow``) adds the other family of each and the split path on every kind that takes slices, on 2
ranks (a job of its own) and 4 ranks (the shared 4-rank job).
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch

from dynmb.core.config import ModelConfig, PipelineConfig, RunConfig, model_config
from dynmb.memory.model import MemoryModel
from dynmb.runtime.checks import VERIFY_RTOL_FP64, gradient_problems, relative_error
from dynmb.runtime.hooks import NoHooks
from dynmb.runtime.launch import launch_job
from dynmb.runtime.spec import HookRef, JobSpec, RunSpec
from dynmb.schedule import SCHEDULE_KINDS, get_kind
from tests.gloo_jobs import own_job, register
from tests.runtime_faults import REPO

KINDS = tuple(k for k in SCHEDULE_KINDS if get_kind(k).build.__module__.startswith("dynmb."))
"""Every schedule kind the package registers (``dynmb.schedule.kinds``; not a test's own): a kind added
there gets its cases here without an edit."""
FAMILIES = ("tiny", "llama-tiny")
SPLIT_KINDS = tuple(k for k in KINDS if get_kind(k).slices and get_kind(k).window is not None)
"""The kinds a document too long for a row runs on sliced: they take slices and hold a bounded window
(``gpipe`` holds every microbatch, so such a document never fits sliced under it either: the planner
refuses it; its slice order is checked in one process, ``tests/test_slices.py``)."""
SLICE_BATCH = np.array([1200, 500, 40, 60, 30, 50, 70, 20], dtype=np.int64)
"""The trace of the slice cases: at 40 MiB a float64 ``tiny``/``llama-tiny`` row holds 600-850 tokens."""
SLICE_LIMIT = 40 * 2**20


@dataclass(frozen=True)
class Case:
    """One fp64 ``--verify`` run: schedule kind, slice path (kind, split, fitting), model preset, ranks."""

    kind: str
    path: str
    family: str
    nproc: int

    @property
    def name(self) -> str:
        return f"fp64-{self.path}-{self.kind}-{self.family}-{self.nproc}"

    @property
    def virtual(self) -> int:
        """Model chunks per rank: the kind's exact count, else 2 where it takes virtual stages."""
        kind = get_kind(self.kind)
        return kind.chunks or (2 if kind.virtual_stages else 1)


def _other(family: str) -> str:
    return FAMILIES[1 - FAMILIES.index(family)]


def _each() -> list[Case]:
    """One case per kind and slice path on 2 ranks, the families alternating."""
    kinds = [Case(k, "kind", FAMILIES[i % 2], 2) for i, k in enumerate(KINDS)]
    return kinds + [Case("zb-h1", "split", "llama-tiny", 2), Case("1f1b", "fitting", "tiny", 2)]


QUICK_PATHS = {("zb", "kind"), ("zb-v", "kind"), ("zb-h1", "split"), ("1f1b", "fitting")}
"""What the default run checks: the zero-bubble kinds and the slice paths (the older kinds have fp32 checks
in the default run and every case here with ``--runslow``)."""


def _fast() -> list[Case]:
    return [c for c in _each() if (c.kind, c.path) in QUICK_PATHS]


def _slow(nproc: int) -> list[Case]:
    """The rest on 2 ranks (every kind, the other family of each, split on every kind that takes slices);
    everything on 4 ranks."""
    fast = _each()
    cases = fast + [replace(c, family=_other(c.family)) for c in fast]
    cases += [Case(k, "split", f, 2) for k in SPLIT_KINDS if k != "zb-h1" for f in FAMILIES]
    if nproc == 2:
        return [c for c in cases if c not in _fast()]
    return [replace(c, nproc=4) for c in cases]


FAST = _fast()
SLOW2 = _slow(2)
SLOW4 = _slow(4)


def run_config(case: Case, trace: Path) -> RunConfig:
    """The run of ``case``; ``trace``: the slice cases' length trace (``SLICE_BATCH``)."""
    stages = case.nproc * case.virtual
    model = model_config(f"{case.family}:dtype=float64,n_layers={max(4, stages)}")
    pipeline = PipelineConfig(num_stages=stages, virtual=case.virtual, schedule=case.kind,
                              memory_limit_bytes=SLICE_LIMIT if case.path != "kind" else 256 * 2**20)
    common = dict(model=model, pipeline=pipeline, seed=zlib.crc32(case.name.encode()) % 1000, steps=1, warmup=0,
                  backend="gloo", device="cpu", timeout_s=120.0)
    if case.path == "kind":
        return RunConfig(**common, dataset="gsm8k", global_batch=8, method="fixed", mbs=1)
    slicing = dict(oversize="split", recompute="never") if case.path == "split" else \
        dict(oversize="truncate", recompute="auto", slice_fitting="auto")
    return RunConfig(**common, dataset=str(trace), global_batch=SLICE_BATCH.size, method="dynamic", **slicing)


def _specs(cases: list[Case], out: Path) -> list[RunSpec]:
    trace = out / "fp64-slices.csv"
    trace.parent.mkdir(parents=True, exist_ok=True)
    trace.write_text("length\n" + "\n".join(str(x) for x in SLICE_BATCH) + "\n")
    return [RunSpec.create(run_config(c, trace), out / c.name, verify=True, run_id=c.name) for c in cases]


@register(2)
def _two(out: Path) -> list[RunSpec]:
    return _specs(FAST, out)


@register(4)
def _four(out: Path) -> list[RunSpec]:
    return _specs(SLOW4, out)


def _check(out: Path, case: Case) -> float:
    """The case's steps verified to 1e-10 with the slices and ops it is for; returns its ``grad_rel_err``."""
    from dynmb.io.results import load_results

    t = load_results(out / case.name)
    steps, ops = t["steps"], set(t["actions"]["op"])
    assert steps["verified"].all(), case.name
    err = float(steps["grad_rel_err"].max())
    assert 0 <= err <= VERIFY_RTOL_FP64, (case.name, err)
    assert (steps["schedule_kind"] == case.kind).all(), case.name
    assert (t["runs"]["model.dtype"] == "float64").all(), case.name
    if get_kind(case.kind).split_backward and case.path == "kind":
        assert {"I", "W"} <= ops, (case.name, ops)
    if case.path != "kind":
        assert (steps["sliced"] > 0).all(), case.name
    if case.path == "fitting":       # no slicing for size under oversize="truncate": the slices are of fitting documents
        assert steps["slice_threshold"].notna().all(), case.name
    assert (t["memory"]["peak_bytes"] <= t["memory"]["limit_bytes"]).all(), case.name
    return err


# ------------------------------------------------------------------ quick, in one process
def test_every_registered_kind_has_a_case():
    assert {"gpipe", "1f1b", "interleaved", "memory-aware", "zb-h1", "zb", "zb-v"} <= set(KINDS)
    assert {c.kind for c in FAST + SLOW2} == set(KINDS) and {c.path for c in FAST} == {"kind", "split", "fitting"}
    assert {c.family for c in FAST} == set(FAMILIES)
    assert {(c.kind, c.path, c.family) for c in SLOW4} == {(c.kind, c.path, c.family) for c in FAST + SLOW2}


def test_float64_reaches_sizes_memory_and_the_parser():
    cfg = model_config("small:dtype=float64")
    assert cfg.dtype == "float64" and cfg.dtype_bytes == 8
    with pytest.raises(ValueError, match="float64"):
        ModelConfig(dtype="float128")
    fp32 = MemoryModel.analytic(replace(cfg, dtype="float32"), 2)
    fp64 = MemoryModel.analytic(cfg, 2)
    assert np.array_equal(fp64.state_bytes, 2 * fp32.state_bytes)
    assert np.array_equal(fp64.act_coef, 2 * fp32.act_coef) and np.array_equal(fp64.w_coef, 2 * fp32.w_coef)
    split = replace(model_config("tiny:dtype=float64"), layer_split=(4, 0), head_split=(256, 256))
    assert split.message_channels(0, 2) == split.d_model + 2            # the head's statistics: one part each


def test_the_fp64_tolerance_has_no_absolute_floor():
    ref = {"w": torch.full((3,), 1e-6, dtype=torch.float64)}
    off = {"w": ref["w"] * (1 + 1e-9)}
    assert gradient_problems(0, 0, off, ref) and not gradient_problems(0, 0, {"w": ref["w"].float()}, ref)
    assert relative_error(off, ref) == pytest.approx(1e-9, rel=1e-3)
    assert not gradient_problems(0, 0, {"w": ref["w"] * (1 + 1e-11)}, ref)


# ------------------------------------------------------------------ real gloo ranks
@pytest.mark.dist
@pytest.mark.parametrize("case", FAST, ids=lambda c: c.name)
def test_two_ranks_fp64_gradients_equal_the_reference(gloo_job, case):
    job = gloo_job(2)
    assert job.returncode == 0, job.errors
    _check(job.out, case)


@pytest.fixture(scope="module")
def slow_two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp64-2")
    return own_job(out, _specs(SLOW2, out), 2)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("case", SLOW2, ids=lambda c: c.name)
def test_two_ranks_fp64_every_case(slow_two_ranks, case):
    _check(slow_two_ranks, case)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("case", SLOW4, ids=lambda c: c.name)
def test_four_ranks_fp64_every_case(gloo_job, case):
    job = gloo_job(4)
    assert job.returncode == 0, job.errors
    _check(job.out, case)


class Nudge(NoHooks):
    """Rank 0 scales its first parameter's gradient by 1 + 1e-8 before the check: inside fp32's tolerance,
    far outside float64's."""

    def gradients(self, rank, step, params) -> None:
        if rank == 0:
            next(iter(params.values())).grad.mul_(1 + 1e-8)


@pytest.mark.slow
@pytest.mark.dist
def test_a_nudge_fp32_passes_fails_the_fp64_check(tmp_path, monkeypatch):
    """The fp64 check can fail: a gradient off by 1e-8 relative passes fp32's ``--verify`` and stops fp64's,
    naming the parameter."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    nudge = HookRef(target="tests.test_fp64_grads:Nudge")
    case = Case("1f1b", "kind", "tiny", 2)
    fp64 = run_config(case, tmp_path / "unused.csv")
    fp32 = replace(fp64, model=replace(fp64.model, dtype="float32"))
    specs = [RunSpec.create(cfg, tmp_path / name, verify=True, run_id=name, hooks=nudge)
             for name, cfg in (("fp32", fp32), ("fp64", fp64))]
    result = launch_job(JobSpec(out_dir=str(tmp_path.resolve()), cases=tuple(specs)), 2, quiet=True)
    from dynmb.io.results import load_results

    assert not result.ok and "1e-10 x max|ref|" in "\n".join(result.failures), result.failures
    assert load_results(tmp_path / "fp32")["steps"]["verified"].all()
