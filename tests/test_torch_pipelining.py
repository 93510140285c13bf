"""dynmb plans on torch.distributed.pipelining's runtime (``dynmb.integrations.torch_pipelining``).

Real gloo ranks: one spawned job per rank count (2 and 4) runs every case of that count in one
process group, one after another (torch's import and gloo's set-up cost seconds per process on a
small box); each rank saves its stage's gradients and loss, and the test compares them with the
single-process reference (``dynmb.models.reference_grads``). The plan's microbatches all differ in
rows and padded length, padded and packed rows mixed. Cases: GPipe, 1F1B, ZB-H1 (torch's I/W),
interleaved, recomputed microbatches, fp32 and fp64, an LM head split by vocabulary (ZB-H1; the
reference is the same split in one process, ``tests/test_vocab_split.py`` ties it to the unsplit
model), pp2 x dp2 on pipeline subgroups, the module
docstring's example, and a divergent plan every rank must refuse. The job is killed and the test fails if it
runs past ``JOB_TIMEOUT_S``.
"""

from __future__ import annotations

import re
import textwrap
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dynmb.core.config import ModelConfig
from dynmb.integrations import torch_pipelining
from dynmb.integrations.torch_pipelining import (TORCH_VERSION_WRITTEN_FOR, TorchPipeliningError,
                                                 TorchPipeliningSettings, check_torch_internals,
                                                 run_with_torch_pipelining)
from dynmb.models import build_stage, reference_grads, synthetic_tokens
from dynmb.schedule import build_schedule
from dynmb.core.types import Microbatch, Plan
from tests.spawn_ranks import spawn_ranks

CFG = ModelConfig.preset("tiny", max_seq_len=256)
VOCAB_SPLIT = replace(CFG, layer_split=(4, 0), head_split=(200, 312))
"""Two stages, the LM head split by vocabulary: rows 0..199 beside every layer, the rest alone (wider message)."""
SEED = 3
JOB_TIMEOUT_S = 300
TOL = {"float32": 1e-5, "float64": 1e-10}
"""Max abs gradient error over max |reference gradient|, per parameter."""


def _plan(num_stages: int, recompute: bool = False) -> tuple[Plan, list[torch.Tensor]]:
    """Six microbatches, every one a different (rows, padded_len): padded rows, one long sequence,
    packed rows of several documents (document-causal attention), extra padding."""
    lengths = np.random.default_rng(7).integers(3, 60, size=20)
    lengths[3] = 150
    groups = [([0, 1, 2], None, 3), ([3], None, 0), ([4, 5, 6, 7, 8, 9], [0, 0, 0, 1, 1, 1], 1),
              ([10, 11], None, 5), ([12, 13, 14], [0, 0, 0], 0), ([15, 16, 17, 18, 19], None, 2)]
    mbs = []
    for i, (ids, rows, extra) in enumerate(groups):
        ids = np.array(ids)
        if rows is None:
            mbs.append(Microbatch(ids, lengths[ids], int(lengths[ids].max()) + extra, len(ids),
                                  recompute=recompute and i % 2 == 1))
        else:
            fill = np.bincount(rows, weights=lengths[ids]).astype(int)
            mbs.append(Microbatch(ids, lengths[ids], int(fill.max()) + extra, max(rows) + 1, rows,
                                  recompute=recompute and i % 2 == 1))
    plan = Plan(microbatches=tuple(mbs), method="test", num_stages=num_stages, memory_limit_bytes=1,
                num_sequences=len(lengths))
    return plan, synthetic_tokens(lengths, CFG.vocab_size, seed=1)


@dataclass(frozen=True)
class Case:
    name: str
    kind: str = "1f1b"
    dtype: str = "float64"
    recompute: bool = False
    virtual: int = 1
    """Stages per rank (interleaved: stage s on rank s % ranks)."""
    diverge: bool = False
    """Rank 1 runs a plan with one microbatch padded further: every rank must refuse to start."""
    example: bool = False
    """Run the module docstring's example block (with the process group already made)."""
    dp: int = 1
    """Data-parallel pipelines: ``plan.replica(r)`` on the pipeline subgroup r, gradients summed over replicas."""
    vocab_split: bool = False
    """The model ``VOCAB_SPLIT`` (two stages)."""
    layer_split: tuple[float, ...] | None = None
    """A layer split of ``CFG`` (boundaries inside a half-block: the ``[y | h]`` message of ``2 d``)."""

    @property
    def model(self) -> ModelConfig:
        return VOCAB_SPLIT if self.vocab_split else replace(CFG, layer_split=self.layer_split)


CASES = {
    2: [Case("1f1b"), Case("gpipe", kind="gpipe"), Case("zbh1", kind="zb-h1"), Case("1f1b_fp32", dtype="float32"),
        Case("recompute", recompute=True), Case("interleaved", kind="interleaved", virtual=2),
        Case("example", example=True), Case("diverge", diverge=True),
        Case("vocab_split_zbh1", kind="zb-h1", vocab_split=True),
        # boundaries inside a half-block: layer 1's attention after 2 of 8 chunks (1 of 4 heads); interleaved
        # chunks ending inside layer 0's MLP, layer 2's attention and layer 2's MLP
        Case("chunk_split_zbh1", kind="zb-h1", layer_split=(1.125, 2.875)),
        Case("chunk_split_interleaved", kind="interleaved", virtual=2, layer_split=(0.75, 1.375, 0.5, 1.375))],
    4: [Case("1f1b"), Case("gpipe_fp32", kind="gpipe", dtype="float32"), Case("zbh1", kind="zb-h1"),
        Case("pp2dp2", dp=2)],
}


def _example_code() -> str:
    return textwrap.dedent(torch_pipelining.__doc__.split("::\n\n", 1)[1])


def _run_example() -> dict:
    init = dist.init_process_group
    dist.init_process_group = lambda *a, **k: None      # the job made the group already
    try:
        ns: dict = {}
        exec(compile(_example_code(), "torch_pipelining example", "exec"), ns)
    finally:
        dist.init_process_group = init
    return {"loss": ns["out"].loss, "plan": ns["step"].plan.to_json(), "lengths": ns["lengths"]}


def _dp_plan(dp: int) -> tuple[Plan, list[torch.Tensor]]:
    plan, tokens = _plan(2)
    return replace(plan, dp=dp, replica_ids=tuple(i % dp for i in range(plan.num_microbatches))), tokens


def _run_dp(rank: int, world: int, case: Case) -> dict:
    """Pipelines of ``world // dp`` consecutive ranks; gradients all-reduced over the replicas."""
    pp = world // case.dp
    pp_groups = [dist.new_group(list(range(r * pp, (r + 1) * pp))) for r in range(case.dp)]
    dp_groups = [dist.new_group(list(range(s, world, pp))) for s in range(pp)]
    replica, stage_index = divmod(rank, pp)
    plan, tokens = _dp_plan(case.dp)
    mine = plan.replica(replica)
    stage = build_stage(CFG, stage_index, pp, SEED, dtype=getattr(torch, case.dtype))
    settings = TorchPipeliningSettings(model=CFG, loss_tokens=plan.real_tokens)
    out = run_with_torch_pipelining(stage, mine, build_schedule(case.kind, pp, mine.num_microbatches), tokens,
                                    settings, group=pp_groups[replica])
    for p in stage.parameters():
        dist.all_reduce(p.grad, group=dp_groups[stage_index])
    loss = torch.tensor([out.loss], dtype=torch.float64)
    dist.all_reduce(loss, group=dp_groups[stage_index])
    return {"loss": float(loss), "grads": {n: p.grad.clone() for n, p in stage.named_parameters()}}


def _run_case(rank: int, world: int, case: Case) -> dict:
    if case.example:
        return _run_example()
    if case.dp > 1:
        return _run_dp(rank, world, case)
    stages = world * case.virtual
    plan, tokens = _plan(stages, case.recompute)
    if case.diverge and rank == 1:
        mbs = list(plan.microbatches)
        mbs[1] = replace(mbs[1], padded_len=mbs[1].padded_len + 1)
        plan = replace(plan, microbatches=tuple(mbs))
    dtype = getattr(torch, case.dtype)
    mine = [build_stage(case.model, s, stages, SEED, dtype=dtype) for s in range(rank, stages, world)]
    schedule = build_schedule(case.kind, stages, plan.num_microbatches, virtual=case.virtual)
    out = run_with_torch_pipelining(mine, plan, schedule, tokens, TorchPipeliningSettings(model=case.model))
    grads = {n: p.grad.detach().clone() if p.grad is not None else None
             for st in mine for n, p in st.named_parameters()}
    return {"loss": out.loss, "grads": grads, "shares": out.microbatch_losses}


def _worker(rank: int, world: int, store: str, out: str, cases: list[Case]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        for case in cases:
            try:
                result = _run_case(rank, world, case)
            except Exception as e:  # noqa: BLE001 - recorded for the test to read
                result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            torch.save(result, Path(out) / f"{case.name}.rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _job(world: int, tmp: Path) -> Path:
    codes = spawn_ranks(_worker, world, lambda r: (r, world, str(tmp / "store"), str(tmp), CASES[world]),
                        JOB_TIMEOUT_S)
    assert codes == [0] * world, codes
    return tmp


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    done: dict[int, Path] = {}

    def get(world: int) -> Path:
        if world not in done:
            done[world] = _job(world, tmp_path_factory.mktemp(f"torchpp{world}"))
        return done[world]

    return get


def _results(out: Path, world: int, name: str) -> list[dict]:
    res = [torch.load(out / f"{name}.rank{r}.pt", weights_only=False) for r in range(world)]
    errors = [f"rank {r}: {x['traceback']}" for r, x in enumerate(res) if "error" in x]
    assert not errors, "\n".join(errors)
    return res


@pytest.mark.parametrize("world,case", [(w, c) for w, cs in CASES.items() for c in cs
                                        if not (c.diverge or c.example or c.dp > 1)],
                         ids=lambda x: x.name if isinstance(x, Case) else str(x))
def test_gradients_equal_the_single_process_reference(job, world, case):
    res = _results(job(world), world, case.name)
    plan, tokens = _plan(world * case.virtual, case.recompute)
    ref_loss, ref = reference_grads(case.model, world * case.virtual, plan, tokens, SEED,
                                    dtype=getattr(torch, case.dtype))
    got: dict[str, torch.Tensor] = {}
    for r in res:
        assert not set(got) & set(r["grads"])
        got.update(r["grads"])
    assert set(got) == set(ref)
    tol = TOL[case.dtype]
    bad = []
    for name, g in ref.items():
        assert got[name] is not None, f"{name}: no gradient (backward did not run)"
        err = float((got[name] - g).abs().max())
        if err > tol * float(g.abs().max()) + 1e-30:
            bad.append(f"{name}: max abs error {err:.3g}, max |ref| {float(g.abs().max()):.3g}")
    assert not bad, "\n".join(bad)
    for r in res:
        assert r["loss"] == pytest.approx(ref_loss, rel=10 * tol)
    assert sum(res[-1]["shares"]) == pytest.approx(ref_loss, rel=10 * tol)
    assert len(res[-1]["shares"]) == plan.num_microbatches and all(not r["shares"] for r in res[:-1])


def test_a_divergent_plan_is_refused_on_every_rank(job):
    res = [torch.load(job(2) / f"diverge.rank{r}.pt", weights_only=False) for r in range(2)]
    for r in res:
        assert r.get("error", "").startswith("PlanDivergenceError"), r
        assert "group rank(s) [1]" in r["error"]


def test_data_parallel_pipelines_on_subgroups_equal_the_reference(job):
    res = _results(job(4), 4, "pp2dp2")
    plan, tokens = _dp_plan(2)
    ref_loss, ref = reference_grads(CFG, 2, plan, tokens, SEED, dtype=torch.float64)
    got = {**res[0]["grads"], **res[1]["grads"]}
    assert set(got) == set(ref)
    for name, g in ref.items():
        assert float((got[name] - g).abs().max()) <= TOL["float64"] * float(g.abs().max()), name
        assert torch.equal(got[name], {**res[2]["grads"], **res[3]["grads"]}[name]), name
    assert all(r["loss"] == pytest.approx(ref_loss, rel=1e-9) for r in res)


def test_the_docstring_example_runs_on_two_ranks(job):
    res = _results(job(2), 2, "example")
    plan = Plan.from_json(res[0]["plan"])
    assert Plan.from_json(res[1]["plan"]).digest() == plan.digest() and plan.num_microbatches > 1
    assert len({(mb.batch, mb.padded_len) for mb in plan.microbatches}) == plan.num_microbatches
    tokens = synthetic_tokens(res[0]["lengths"], CFG.vocab_size)
    ref_loss, _ = reference_grads(ModelConfig.preset("tiny"), 2, plan, tokens, 0)
    assert res[0]["loss"] == res[1]["loss"] == pytest.approx(ref_loss, rel=1e-5)


def test_the_variable_shapes_are_real():
    plan, _ = _plan(2)
    shapes = {(mb.batch, mb.padded_len) for mb in plan.microbatches}
    assert len(shapes) == plan.num_microbatches
    assert any(mb.is_packed for mb in plan.microbatches)


def test_torch_internals_are_there():
    problems = check_torch_internals()
    assert problems == [], (f"torch {torch.__version__} changed what dynmb.integrations.torch_pipelining relies on "
                            f"(written against {TORCH_VERSION_WRITTEN_FOR}): {problems}")


def test_a_changed_internal_is_named_before_any_process_talks(monkeypatch):
    from torch.distributed.pipelining import stage as torch_stage

    monkeypatch.delattr(torch_stage, "_RecvInfo")
    assert any("_RecvInfo" in p for p in check_torch_internals())
    monkeypatch.setattr(dist, "get_rank", lambda group=None: pytest.fail("the run went past the internals check"))
    plan, tokens = _plan(2)
    with pytest.raises(TorchPipeliningError, match=rf"torch {re.escape(torch.__version__)} lacks .*_RecvInfo"):
        run_with_torch_pipelining(build_stage(CFG, 0, 2, SEED), plan, build_schedule("1f1b", 2, 6), tokens,
                                  TorchPipeliningSettings(model=CFG))


def test_zero_bubble_schedule_uses_torchs_split_backward():
    text = {str(a)[1:2] for acts in build_schedule("zb-h1", 2, 6).ranks for a in acts}
    assert {"I", "W"} <= text


@pytest.mark.parametrize("change,match", [
    (lambda p, s: (replace(p, dp=2, replica_ids=(0, 1) * 3), s), "dp=2"),
    (lambda p, s: (p, build_schedule("1f1b", 2, 5)), "5 microbatches"),
    (lambda p, s: (p, build_schedule("1f1b", 4, 6)), "4 ranks"),
    (lambda p, s: (replace(p, meta=p.meta.with_(offload_blocks=[1, 0])), s), r"offloads activations .*\[1, 0\]"),
])
def test_bad_input_is_refused_before_any_process_talks(monkeypatch, change, match):
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather", lambda *a, **k: pytest.fail("a collective ran before the checks"))
    plan, tokens = _plan(2)
    plan, schedule = change(plan, build_schedule("1f1b", 2, 6))
    stage = build_stage(CFG, 0, 2, SEED)
    with pytest.raises(TorchPipeliningError, match=match):
        run_with_torch_pipelining(stage, plan, schedule, tokens, TorchPipeliningSettings(model=CFG))


def test_the_wrong_stage_for_the_rank_is_refused(monkeypatch):
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    plan, tokens = _plan(2)
    with pytest.raises(TorchPipeliningError, match=r"rank 1 runs stages \[1\] .* given stages \[0\]"):
        run_with_torch_pipelining(build_stage(CFG, 0, 2, SEED), plan, build_schedule("1f1b", 2, 6), tokens,
                                  TorchPipeliningSettings(model=CFG))
