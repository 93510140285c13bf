"""Per-stage recomputation of leading blocks (``ModelConfig.recompute_blocks``): the model and runtime side.

A stage's first ``k`` blocks (``DecoderStage.recomputed_blocks``, the entries of ``stage_blocks``: a half-block or
pieces of one at a boundary count one) run under ``RecomputedBlock`` in every microbatch, so each keeps only its
input for the backward. Checked here:

- the forward's output is bit-equal with and without the field, and the CPU meter sees the stage save exactly the
  stage without it minus, per recomputed block, its saved bytes but its input (``dynmb.memory.coef``);
- the split backward stays exact: a recomputed block's weight gradients come from its nested backward in ``I``,
  the deferred ``W`` covers the other blocks' Linear calls only (one process, fp64, with and without slices);
- fp64 gradients on real gloo ranks equal the single-process reference to 1e-10 (``--verify``): ``1f1b`` and
  ``zb``, both families, half-block and piece splits, on 2 ranks (a quick pair in the shared job, the rest slow)
  and 4 ranks (slow), interleaved chunks, the embedding on the last rank, a chain of slices, and a run of a plan
  file (``dynmb plan`` of a JSON model file with the field, then ``dynmb run --plan``);
- the one-line refusals: a stage that both offloads and recomputes blocks, a model that is not dynmb's family.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dynmb.core.config import ModelConfig, PlanSpec, RunConfig, model_config
from dynmb.core.types import Microbatch
from dynmb.memory.model import MemoryModel
from dynmb.memory.coef import piece_act_coef
from dynmb.models import build_stages, make_inputs, reference_grads, synthetic_tokens
from dynmb.runtime.checks import VERIFY_RTOL_FP64
from dynmb.runtime.meter import MemoryMeter
from dynmb.runtime.spec import RunSpec
from dynmb.runtime.splitbackward import backward_input, backward_weight, record_linears
from tests.gloo_jobs import own_job, register
from tests.plan_runner import run_plan, sliced_plan

LAYOUTS = [((2, 2), (1, 0)), ((2.5, 1.5), (2, 1)), ((1.75, 2.25), (1, 2)), ((2.75, 1.25), (3, 1)),
           ((1.5, 1, 1, 0.5), (1, 0, 1, 0))]
"""``(layer_split, recompute_blocks)``: whole blocks, half-blocks, a boundary inside an MLP half (stage 1's first
block is pieces of one, its input ``[y | h]``), and four stages."""


def _layout(family: str, split: tuple, rc: tuple | None, **fields) -> ModelConfig:
    return replace(model_config(family), layer_split=split, recompute_blocks=rc, **fields)


def _microbatch(cfg: ModelConfig, rows: int = 2, s: int = 24):
    """``rows`` documents of ``s`` tokens, one per row (no padding: every saved tensor is the coefficients')."""
    mb = Microbatch(seq_ids=np.arange(rows), lengths=[s] * rows, padded_len=s, batch=rows)
    return mb, make_inputs(mb, synthetic_tokens(mb.lengths, cfg.vocab_size, seed=2), cfg=cfg)


def _held(cfg: ModelConfig, stage: int, inputs, rows: int, s: int,
          recompute: bool = False) -> tuple[torch.Tensor, int, nn.Module]:
    """(output, bytes the CPU meter holds after one forward, the stage) of ``stage`` of ``cfg``; ``recompute``:
    the microbatch is flagged to recompute."""
    num_stages = len(cfg.layer_split or ())
    st = build_stages(cfg, num_stages, seed=1)[stage]
    meter = MemoryMeter("cpu", [st])
    width = cfg.message_channels(stage - 1, num_stages) if stage else cfg.d_model
    x = None if stage == 0 else torch.randn(rows, s, width, generator=torch.Generator().manual_seed(stage),
                                            requires_grad=True)
    with meter.saving(stage):
        y = st(x, inputs, recompute=recompute)
    held = meter.current_bytes - meter.state_bytes
    meter.close()
    return y, held, st


def _recomputed_saved_bytes(cfg: ModelConfig, st, k: int, tokens: int, rows_s2: int) -> float:
    """What the first ``k`` blocks of ``st`` do not save when recomputed: per block its pieces'
    ``piece_act_coef`` but its input (``e d`` per token, ``2 e d`` for ``[y | h]`` where it starts inside a half)."""
    out = 0.0
    for _, pieces in st.units[:k]:
        a1, a2 = sum((piece_act_coef(cfg, pc) for pc in pieces), np.zeros(2))
        kept = cfg.dtype_bytes * cfg.d_model * (2 if pieces[0].chunks.start else 1)
        out += (a1 - kept) * tokens + a2 * rows_s2
    return out


# ------------------------------------------------------------------ one process
@pytest.mark.parametrize("family", ["tiny", "llama-tiny"])
@pytest.mark.parametrize("split,rc", LAYOUTS, ids=str)
def test_a_stage_saves_exactly_its_recomputed_blocks_less_and_its_output_is_bit_equal(family, split, rc):
    """Per stage, the CPU meter's bytes after a forward with the field are the bytes without it less the
    coefficients' count of the recomputed blocks but their inputs (dense attention: the coefficients are exact for
    one document per row; the rotary tables, the mask and the stage output are the same storages either way); the
    output is bit-equal. Fails if the stage ignores the field (no bytes saved) or recomputes one block too many or
    few (a block's bytes off)."""
    plain = _layout(family, split, None, attention="dense")
    redone = replace(plain, recompute_blocks=rc)
    rows, s = 2, 24
    _, inputs = _microbatch(plain, rows, s)
    for stage, k in enumerate(rc):
        y0, held0, st = _held(plain, stage, inputs, rows, s)
        y1, held1, st1 = _held(redone, stage, inputs, rows, s)
        assert st1.recomputed_blocks == k and st.recomputed_blocks == 0
        assert torch.equal(y0, y1), (family, split, stage)
        assert held0 - held1 == _recomputed_saved_bytes(plain, st, k, rows * s, rows * s * s), (family, split, stage)
        planned = [float(np.sum(MemoryModel.analytic(c, len(rc)).activation_bytes(stage, [rows], [s]))) for c in (plain, redone)]
        assert held0 - held1 == pytest.approx(planned[0] - planned[1], rel=1e-12), (family, split, stage)  # the planner's


def _pipeline_grads(cfg: ModelConfig, split_backward: bool) -> tuple[dict[str, torch.Tensor], list[int]]:
    """One fp64 microbatch through every stage of ``cfg`` in one process, backward full or as ``I`` then ``W``:
    ``({name: gradient}, Linear calls each stage's tape held for W)``."""
    num_stages = len(cfg.layer_split or ())
    stages = build_stages(cfg, num_stages, seed=3, dtype=torch.float64)
    _, inputs = _microbatch(cfg, 2, 20)
    chain, x = [], None
    for st in stages:
        x = None if x is None else x.detach().requires_grad_(True)
        with record_linears(st) as tape:
            y = st(x, inputs)
        chain.append((st, x, y, tape if split_backward else None))
        x = y
    grad, calls = None, []
    for st, x_in, out, tape in reversed(chain):
        if tape is not None:
            calls.insert(0, len(tape.calls))
            grad = backward_input(st, out, grad, x_in, tape)
        else:
            out.backward(grad)
            grad = None if x_in is None else x_in.grad
    for _, _, _, tape in chain:
        if tape is not None:
            backward_weight(tape)
    return {n: p.grad for st in stages for n, p in st.named_parameters()}, calls


def _linears_outside_recomputed(cfg: ModelConfig) -> list[int]:
    """Per stage, the Linear modules that run with a graph: all but those of the recomputed leading blocks."""
    num_stages = len(cfg.layer_split or ())
    out = []
    for st in build_stages(cfg, num_stages, seed=0, device="meta"):
        redone = {id(m) for blk in list(st.blocks.values())[:st.recomputed_blocks] for m in blk.modules()}
        out.append(sum(isinstance(m, nn.Linear) and id(m) not in redone for m in st.modules()))
    return out


@pytest.mark.parametrize("family,split,rc", [(("tiny", "llama-tiny")[i % 2], *lay) for i, lay in enumerate(LAYOUTS)],
                         ids=str)
def test_the_split_backward_of_recomputed_blocks_is_exact_and_defers_only_the_others(family, split, rc):
    """``I`` then ``W`` with recomputed leading blocks equals the full backward without the field (fp64, 1e-12
    relative): the tape holds exactly the Linear calls of the other blocks and the head, so a recomputed block's
    weight gradient comes once, from its nested backward. Fails if the recomputation's Linear calls are recorded
    (their weights' gradients doubled by ``W``) or a recomputed block's backward skips its weights (missing)."""
    cfg = _layout(family, split, rc, dtype="float64")
    ref, _ = _pipeline_grads(replace(cfg, recompute_blocks=None), split_backward=False)
    got, calls = _pipeline_grads(cfg, split_backward=True)
    assert calls == _linears_outside_recomputed(cfg) and calls != _linears_outside_recomputed(
        replace(cfg, recompute_blocks=None))
    for name, g in ref.items():
        assert float((got[name] - g).abs().max()) <= 1e-12 * float(g.abs().max()), name


@pytest.mark.parametrize("family,split", [("llama-tiny", True), ("tiny", False)])
def test_a_chain_of_slices_through_recomputed_blocks_equals_the_whole_documents(family, split):
    """Sequence 0 in three slices (``tests/plan_runner.sliced_plan``) through two stages whose leading blocks
    recompute (attention halves among them: the recomputation re-keeps their keys and values, whose gradients
    from later slices join its nested backward): fp64 gradients equal the reference of whole documents, with the
    full backward and with ``I``/``W``."""
    cfg = _layout(family, (2.5, 1.5), (2, 1), dtype="float64")
    plan, lengths = sliced_plan()
    tokens = synthetic_tokens(lengths, cfg.vocab_size, seed=5)
    stages, _ = run_plan(plan, tokens, cfg, 2, split=split)
    _, ref = reference_grads(replace(cfg, recompute_blocks=None), 2, plan, tokens, 0, dtype=torch.float64)
    assert [st.recomputed_blocks for st in stages] == [2, 1]
    for st in stages:
        for name, p in st.named_parameters():
            assert float((p.grad - ref[name]).abs().max()) <= 1e-10 * float(ref[name].abs().max()) + 1e-300, name


def test_the_whole_model_in_one_stage_and_a_flagged_microbatch():
    """One stage of a config split over two holds the whole model (as ``layer_split`` does) and recomputes none
    of it; a microbatch flagged ``recompute`` recomputes every block of a stage whatever the field says."""
    cfg = _layout("llama-tiny", (2.5, 1.5), (1, 0))
    whole = build_stages(cfg, 1, seed=0, device="meta")[0]
    assert whole.recomputed_blocks == 0 and len(whole.blocks) == cfg.n_layers
    _, inputs = _microbatch(cfg, 1, 16)
    for stage in (0, 1):
        flagged = [_held(c, stage, inputs, 1, 16, recompute=True)[1] for c in (cfg, replace(cfg, recompute_blocks=None))]
        assert flagged[0] == flagged[1] < _held(cfg, stage, inputs, 1, 16)[1], stage


# ------------------------------------------------------------------ refusals
def test_offload_and_recompute_on_one_stage_are_refused_in_one_line(tmp_path):
    """A plan file that offloads blocks of a stage that recomputes blocks is refused before any rank starts
    (``load_plan_files``), and by the ranks' offload session; other stages may offload."""
    from dynmb.planning import plan_step
    from dynmb.runtime.offload import OffloadSession
    from dynmb.runtime.spec import load_plan_files, refuse_offload_with_recompute

    refuse_offload_with_recompute([0, 1], [1, 0], "ok")           # different stages: fine
    cfg = _layout("tiny", (2, 2), (1, 0))
    run = RunConfig(model=cfg, spec=PlanSpec(method="fixed", mbs=1, num_stages=2, memory_limit_bytes=256 * 2**20),
                    dataset="gsm8k", global_batch=4, steps=1, warmup=0)
    lengths = np.array([30, 40, 50, 60])
    plan, _, _ = plan_step(lengths, run.plan_spec, model_cfg=cfg)
    for blocks, refused in (([0, 1], False), ([1, 0], True)):
        path = tmp_path / f"plan-{blocks[0]}.json"
        replace(plan, meta=plan.meta.with_(offload_blocks=blocks)).save(path)
        spec = RunSpec.create(run, tmp_path / f"out-{blocks[0]}", plan=path)
        if not refused:
            load_plan_files(spec)
            continue
        with pytest.raises(ValueError, match=r"stage 0 both offloads 1 block\(s\) .* and recomputes 1") as err:
            load_plan_files(spec)
        assert "\n" not in str(err.value)
        stages = dict(enumerate(build_stages(cfg, 2, seed=0, device="meta")))
        with pytest.raises(ValueError, match="both offloads"):
            OffloadSession.for_plan(replace(plan, meta=plan.meta.with_(offload_blocks=blocks)), stages, 0, "cpu")


def test_models_that_are_not_dynmbs_families_refuse_the_field():
    """A model of the user's own (``refuse_foreign_layout``, before torchrun starts and on the ranks) and a
    transformers model's factory refuse ``recompute_blocks`` in one line naming the model; a stage count that is
    not the field's is refused by the stage."""
    from dynmb.runtime.spec import refuse_foreign_layout

    cfg = _layout("llama-tiny", (2, 2), (1, 0))
    with pytest.raises(ValueError, match=r"--model pkg.mod:factory: recomputing leading blocks per stage "
                                         r"\(recompute_blocks \[1, 0\]\) runs on dynmb's own model families only"):
        refuse_foreign_layout(cfg, "--model pkg.mod:factory")
    refuse_foreign_layout(replace(cfg, recompute_blocks=None), "x")
    transformers = pytest.importorskip("transformers")
    from dynmb.models.hf import HFStageFactory

    hf_cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2)
    factory = HFStageFactory.from_config(hf_cfg, name="hf-tiny")
    factory.config = replace(factory.config, layer_split=(2, 2), recompute_blocks=(1, 0))
    with pytest.raises(ValueError, match=r"model 'hf-tiny': recomputing leading blocks per stage"):
        factory.build_stage(0, 2, device="meta")


# ------------------------------------------------------------------ plan files
def _model_file(tmp_path: Path) -> Path:
    path = tmp_path / "rc-llama.json"
    path.write_text(json.dumps({**{k: v for k, v in model_config("llama-tiny").to_dict().items() if k != "name"},
                                "dtype": "float64", "layer_split": [2.5, 1.5], "recompute_blocks": [2, 1]}))
    return path


def _planned(tmp_path: Path) -> Path:
    from dynmb.cli.main import main

    plan = tmp_path / "p.json"
    assert main(["plan", "--dataset", "gsm8k", "--global-batch", "8", "--model", str(_model_file(tmp_path)),
                 "--stages", "2", "--schedule", "zb", "--memory-limit", "256MiB", "-o", str(plan)]) == 0
    return plan


def test_a_plan_file_carries_the_field_to_the_run_config(tmp_path):
    """``dynmb plan`` of a JSON model file with the field records it in the plan; ``dynmb run --plan`` takes it
    (``plan_run_config``), its spec file keeps it, and ``--stage-split`` naming the plan's own split is accepted
    (it failed with 'recompute_blocks needs a layer_split' before the split check cleared the field)."""
    from dynmb.cli.main import build_parser
    from dynmb.cli.planfile import refuse_split_conflict
    from dynmb.cli.run import plan_run_config
    from dynmb.core.types import Plan

    plan = _planned(tmp_path)
    assert Plan.load(plan).meta["model"]["recompute_blocks"] == [2, 1]
    args = build_parser().parse_args(["run", "--plan", str(plan), "--out", str(tmp_path / "out"),
                                      "--stage-split", "2.5,1.5"])
    cfg, _, _ = plan_run_config(args)
    assert cfg.model.recompute_blocks == (2, 1) and cfg.model.layer_split == (2.5, 1.5)
    refuse_split_conflict(args, Plan.load(plan), cfg.model)
    spec = RunSpec.create(cfg, tmp_path / "out", plan=plan)
    assert RunSpec.from_dict(json.loads(json.dumps(spec.to_dict()))).run.model == cfg.model


@pytest.mark.slow
@pytest.mark.dist
def test_dynmb_run_of_the_plan_file_recomputes_and_verifies(tmp_path):
    """``dynmb run --plan --verify`` of that plan on two gloo ranks: fp64 gradients to 1e-10, ``I`` and ``W`` ran,
    and the runs table records the field."""
    from dynmb.cli.main import main
    from dynmb.io.results import load_results

    plan = _planned(tmp_path)
    assert main(["run", "--plan", str(plan), "--out", str(tmp_path / "out"), "--verify", "--steps", "1",
                 "--warmup", "0"]) == 0
    t = load_results(tmp_path / "out")
    assert t["steps"]["verified"].all() and (t["steps"]["grad_rel_err"] <= VERIFY_RTOL_FP64).all()
    assert {"I", "W"} <= set(t["actions"]["op"])
    assert str(t["runs"]["model.recompute_blocks"].iloc[0]).replace(" ", "") in ("(2,1)", "[2,1]")


# ------------------------------------------------------------------ real gloo ranks
@dataclass(frozen=True)
class Case:
    """One fp64 ``--verify`` run: schedule kind, family, layout, ranks and path (``kind``: eight single-row
    microbatches; ``slices``: a document too long for a row cut into a chain of slices; ``embedlast``: the
    embedding on the last rank)."""

    kind: str
    family: str
    split: tuple
    rc: tuple | None
    nproc: int
    path: str = "kind"

    @property
    def name(self) -> str:
        layout = "-".join(f"{x:g}" for x in self.split) + "-rc" + "".join(str(k) for k in self.rc or ())
        return f"rcblocks-{self.path}-{self.kind}-{self.family}-{layout}-{self.nproc}"


QUICK = [Case("zb", "llama-tiny", (2.5, 1.5), (2, 1), 2), Case("zb", "llama-tiny", (2.5, 1.5), None, 2),
         Case("1f1b", "tiny", (1.75, 2.25), (1, 2), 2)]
"""The shared 2-rank job: zb's split backward on half-blocks (and the same run without the field, whose stage 0
must hold more), 1F1B with a stage whose first block starts inside an MLP half."""
SLOW2 = [Case("zb", "tiny", (2.75, 1.25), (3, 1), 2), Case("1f1b", "llama-tiny", (2, 2), (1, 0), 2),
         Case("interleaved", "tiny", (1.5, 1, 1, 0.5), (1, 0, 1, 0), 2),
         Case("zb", "llama-tiny", (2.5, 1.5), (1, 1), 2, "embedlast"),
         Case("zb", "llama-tiny", (2.5, 1.5), (2, 1), 2, "slices")]
SLOW4 = [Case("1f1b", "tiny", (1.5, 1, 1, 0.5), (1, 0, 1, 0), 4), Case("zb", "llama-tiny", (1.5, 1, 1, 0.5), (1, 0, 1, 0), 4),
         Case("zb", "tiny", (1.25, 0.75, 1, 1), (1, 1, 0, 1), 4), Case("1f1b", "llama-tiny", (1, 1, 1, 1), (1, 0, 1, 0), 4)]
SLICE_BATCH = np.array([1200, 500, 40, 60, 30, 50, 70, 20], dtype=np.int64)
"""The slice case's trace (``tests/test_fp64_grads.py``'s). Its limit is 24 MiB: with ``(2, 1)`` recomputed the planner
counts the stages' smaller bytes, and at 28 MiB or more the 1,200-token document fits a row (no slices)."""


def run_config(case: Case, trace: Path) -> RunConfig:
    model = replace(model_config(f"{case.family}:dtype=float64"), layer_split=case.split, recompute_blocks=case.rc)
    stages = len(case.split)
    common = dict(num_stages=stages, virtual=stages // case.nproc, schedule_kind=case.kind,
                  embedding="last" if case.path == "embedlast" else "first")
    if case.path == "slices":
        spec = PlanSpec(method="dynamic", memory_limit_bytes=24 * 2**20, oversize="split", recompute="never", **common)
        data = dict(dataset=str(trace), global_batch=SLICE_BATCH.size)
    else:
        spec = PlanSpec(method="fixed", mbs=1, memory_limit_bytes=256 * 2**20, **common)
        data = dict(dataset="gsm8k", global_batch=8)
    seed = zlib.crc32(f"{case.path}-{case.kind}-{case.family}-{case.nproc}".encode()) % 1000   # the field aside
    return RunConfig(model=model, spec=spec, seed=seed, steps=1,
                     warmup=0, backend="gloo", device="cpu", timeout_s=120.0, **data)


def _specs(cases: list[Case], out: Path) -> list[RunSpec]:
    trace = out / "rcblocks-slices.csv"
    trace.parent.mkdir(parents=True, exist_ok=True)
    trace.write_text("length\n" + "\n".join(str(x) for x in SLICE_BATCH) + "\n")
    return [RunSpec.create(run_config(c, trace), out / c.name, verify=True, run_id=c.name) for c in cases]


@register(2)
def _two(out: Path) -> list[RunSpec]:
    return _specs(QUICK, out)


@register(4)
def _four(out: Path) -> list[RunSpec]:
    return _specs(SLOW4, out)


def _check(out: Path, case: Case):
    """The case's step verified to 1e-10 with the ops, slices and field it is for; returns its tables."""
    from dynmb.io.results import load_results

    t = load_results(out / case.name)
    steps, ops = t["steps"], set(t["actions"]["op"])
    assert steps["verified"].all() and (steps["grad_rel_err"] <= VERIFY_RTOL_FP64).all(), case.name
    assert (steps["schedule_kind"] == case.kind).all(), case.name
    assert (t["memory"]["peak_bytes"] <= t["memory"]["limit_bytes"]).all(), case.name
    if case.kind.startswith("zb"):
        assert {"I", "W"} <= ops, (case.name, ops)
    if case.path == "slices":
        assert (steps["sliced"] > 0).all(), case.name
    recorded = str(t["runs"]["model.recompute_blocks"].iloc[0]).replace(" ", "")
    assert recorded in ((str(tuple(case.rc)).replace(" ", ""), str(list(case.rc)).replace(" ", "")) if case.rc
                        else ("None", "nan", "")), (case.name, recorded)
    return t


@pytest.mark.dist
@pytest.mark.parametrize("case", QUICK, ids=lambda c: c.name)
def test_two_ranks_fp64_gradients_equal_the_reference(gloo_job, case):
    job = gloo_job(2)
    assert job.returncode == 0, job.errors
    _check(job.out, case)


@pytest.mark.dist
def test_the_ranks_recompute_stage_0s_leading_blocks(gloo_job):
    """The same zb run with and without ``(2, 1)``: stage 0's measured peak is lower with it, stage 1's too (the
    ranks build their stages from the field, not only record it)."""
    job = gloo_job(2)
    assert job.returncode == 0, job.errors
    with_rc, without = (_check(job.out, c)["memory"].groupby("stage")["peak_bytes"].max() for c in QUICK[:2])
    assert (with_rc < without).all(), (with_rc.tolist(), without.tolist())


@pytest.fixture(scope="module")
def slow_two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("rcblocks-2")
    return own_job(out, _specs(SLOW2, out), 2)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("case", SLOW2, ids=lambda c: c.name)
def test_two_ranks_fp64_every_layout(slow_two_ranks, case):
    _check(slow_two_ranks, case)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("case", SLOW4, ids=lambda c: c.name)
def test_four_ranks_fp64_every_layout(gloo_job, case):
    job = gloo_job(4)
    assert job.returncode == 0, job.errors
    _check(job.out, case)
