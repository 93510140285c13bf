"""Activation offload to host memory, the runtime side (``dynmb.runtime.offload``; issue 39).

One process (the interpreter's ``run_actions`` on a one-stage float64 ``llama-tiny`` plan, offload set by hand in
``plan.meta.offload_blocks``): gradients bit-equal to the plain run (GPipe, 1F1B, a split backward, recomputed
microbatches); each forward's events in order (pack, D2H, reload, backward) with every reload issued when the
action before its backward starts and none late; each saved storage copied once, no parameter; the CPU meter's
accounting (the held bytes after the forwards lower by exactly the bytes offloaded, each reload adding its
forward's back, nothing left after the step). Three named mutations are caught: the prefetch skipped (the order
check fails), the reload skipped (late reloads), a host buffer given back to the pool at its D2H, before its
reload read it (gradients differ).

Real gloo ranks (``--verify`` in float64: every rank's gradients against the single-process reference, 1e-10):
the offload set through the ``plan`` step hook (``OffloadPlan``) on 1F1B, zb (split backward), recomputed
microbatches and a chain of slices (2 ranks, the shared job); the embedding on the last rank, interleaved
virtual stages, two FSDP2 replicas and a chain of recomputed slices (2 ranks, slow, a job of its own); all of them
on 4 ranks (slow, the shared 4-rank job). Slow too: ``benchmarks/offload_check.py`` (the GPU check's step 9) in its
CPU dry mode. Offload all zeros, and offload on, give the plain run's loss and gradient error bit for bit; the
memory table's ``offloaded_bytes`` is positive exactly on the stages that offload, every stage's measured peak
is not higher than the plain run's and lower by no more than its rank offloaded, and where the first stage holds
several microbatches in flight its peak is lower.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch

from dynmb.core.config import PipelineConfig, RunConfig, model_config
from dynmb.core.types import Action, Microbatch, Plan
from dynmb.models import build_stages, make_inputs, synthetic_tokens
from dynmb.planning import make_schedule
from dynmb.runtime import interpreter, offload
from dynmb.runtime.checks import VERIFY_RTOL_FP64
from dynmb.runtime.comm import P2P
from dynmb.runtime.device import HostCopies, device_ops
from dynmb.runtime.hooks import NoHooks
from dynmb.runtime.interpreter import ActionContext, run_actions
from dynmb.runtime.launch import launch_job
from dynmb.runtime.meter import MemoryMeter
from dynmb.runtime.offload import OffloadSession, OffloadStats, prefetch_points
from dynmb.runtime.spec import HookRef, JobSpec, RunSpec
from tests.gloo_jobs import register

CFG = model_config("llama-tiny:dtype=float64,n_layers=3")
LENGTHS = np.array([14, 11, 16, 9], dtype=np.int64)


# ------------------------------------------------------------------ one process
def _plan(blocks: int, recompute: tuple[bool, ...] = ()) -> Plan:
    mbs = [Microbatch([i], LENGTHS[[i]], 16, 1, recompute=i in recompute) for i in range(LENGTHS.size)]
    plan = Plan(microbatches=tuple(mbs), method="test", num_stages=1, memory_limit_bytes=1 << 30,
                num_sequences=LENGTHS.size)
    return replace(plan, meta=plan.meta.with_(offload_blocks=[blocks])) if blocks >= 0 else plan


def _split_actions(m: int) -> list[Action]:
    """Every forward, then I of each microbatch with the W of the one before it (a split backward)."""
    out = [Action(0, "F", i) for i in range(m)]
    for i in range(m):
        out += [Action(0, "I", i)] + ([Action(0, "W", i - 1)] if i else [])
    return out + [Action(0, "W", m - 1)]


@dataclass
class _Run:
    grads: dict[str, torch.Tensor]
    stats: OffloadStats | None
    held_after_forwards: int
    held_after_reload: list[int]
    """What each reload added to the meter's held bytes."""
    left_bytes: int
    records: list[Any]
    params: set[int]


def _run(blocks: int, actions: str = "gpipe", recompute: tuple[bool, ...] = ()) -> _Run:
    """One step of the one-stage plan (``blocks`` < 0: no offload_blocks at all)."""
    plan = _plan(blocks, recompute)
    acts = _split_actions(plan.num_microbatches) if actions == "split" else list(make_schedule(plan, actions).ranks[0])
    torch.manual_seed(0)
    stage = build_stages(CFG, 1, seed=3, dtype=torch.float64)[0]
    tokens = synthetic_tokens(LENGTHS, CFG.vocab_size, seed=1)
    meter = MemoryMeter("cpu", [stage])
    session = OffloadSession.for_plan(plan, {0: stage}, 0, "cpu", meter)
    first_back = next(i for i, a in enumerate(acts) if a.op in ("B", "I"))
    seen: dict[str, Any] = {"held": [], "records": []}

    def on_action(i: int, a: Action) -> None:
        if session is not None:
            session.stats.events.append(("action", (i, i)))
            seen["records"] += [(r.ptr, r.offloaded) for fw in session._forwards.values() for r in fw.records]
        if i == first_back:
            seen["after_forwards"] = meter.current_bytes
    if session is not None:
        reload = session.reload

        def counted(key: tuple[int, int]) -> None:
            before = meter.current_bytes
            reload(key)
            seen["held"].append(meter.current_bytes - before)
        session.reload = counted              # type: ignore[method-assign]
    run_actions(acts, ActionContext(stages={0: stage}, plan=plan, inputs=lambda m: make_inputs(
        plan.microbatches[m], tokens, cfg=CFG), p2p=cast(P2P, None), loss_scale=1.0 / plan.real_tokens,
        clock=device_ops(torch.device("cpu")), meter=meter, on_action=on_action, offload=session))
    stats = session.stats if session is not None else None        # run_actions finished it
    grads = {n: p.grad.detach().clone() for n, p in stage.named_parameters() if p.grad is not None}
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    for p in stage.parameters():
        p.grad = None
    return _Run(grads, stats, int(seen["after_forwards"]), seen["held"], meter.current_bytes - meter.state_bytes,
                seen["records"], params)


def _order_problems(stats: OffloadStats, actions: list[Action]) -> list[str]:
    """Each offloaded (stage, mb): pack < d2h < reload < backward, the reload issued at its prefetch point, every
    unpack after the reload."""
    points = {key: at for at, keys in prefetch_points(actions, lambda s: True).items() for key in keys}
    action_at = {i: n for n, (what, (i, _)) in enumerate(stats.events) if what == "action"}
    problems = []
    for key, at in points.items():
        seq = [n for n, (what, k) in enumerate(stats.events) if k == key and what not in ("action", "unpack")]
        kinds = [stats.events[n][0] for n in seq]
        if kinds[:1] != ["pack"] or "d2h" not in kinds or kinds[-2:] != ["reload", "backward"]:
            problems.append(f"{key}: {kinds}")
            continue
        reload_at = seq[kinds.index("reload")]
        unpacks = [n for n, (what, k) in enumerate(stats.events) if k == key and what == "unpack"]
        if not unpacks or min(unpacks) < reload_at:
            problems.append(f"{key}: unpacked at events {unpacks[:3]}, reloaded at {reload_at}")
        if not action_at[at] < reload_at < action_at.get(at + 1, len(stats.events)):
            problems.append(f"{key}: reloaded at event {reload_at}, its prefetch action {at} is event {action_at[at]}")
    return problems


@pytest.fixture(scope="module")
def plain() -> dict[str, _Run]:
    return {kind: _run(-1, kind) for kind in ("gpipe", "1f1b", "split")}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_prefetch_points_are_the_action_before_each_backward():
    acts = [Action(0, "F", 0), Action(0, "F", 1), Action(1, "F", 0), Action(0, "B", 0), Action(1, "B", 0),
            Action(0, "I", 1), Action(0, "W", 1)]
    assert prefetch_points(acts, lambda s: True) == {2: [(0, 0)], 3: [(1, 0)], 4: [(0, 1)]}
    assert prefetch_points(acts, lambda s: s == 1) == {3: [(1, 0)]}
    one = [Action(0, "F", 0), Action(0, "B", 0)]           # the forward right before: at the backward itself
    assert prefetch_points(one, lambda s: True) == {1: [(0, 0)]}


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "split"])
@pytest.mark.parametrize("blocks", [0, 2])
def test_offload_gradients_equal_the_plain_run_bit_for_bit(plain, kind, blocks):
    run = _run(blocks, kind)
    assert _equal(run.grads, plain[kind].grads)
    if blocks == 0:
        assert run.stats is None                  # all zeros: no session, the plain path
        return
    assert run.stats is not None and run.stats.late == 0 and run.stats.reloads == LENGTHS.size
    acts = _split_actions(LENGTHS.size) if kind == "split" else list(make_schedule(_plan(0), kind).ranks[0])
    assert _order_problems(run.stats, acts) == []
    assert run.stats.bytes_by_stage[0] > 0 and run.left_bytes == plain[kind].left_bytes == 0


def test_recomputed_microbatches_offload_the_block_inputs_exactly():
    base = _run(-1, "gpipe", recompute=(1, 3))
    for blocks in (1, 3):
        run = _run(blocks, "gpipe", recompute=(1, 3))
        assert _equal(run.grads, base.grads) and run.stats is not None and run.stats.late == 0
    # a recomputed microbatch saves only its block inputs (and the rotary tables): far less to move
    full = _run(3, "gpipe").stats
    assert full is not None and run.stats is not None
    assert run.stats.bytes_by_stage[0] < full.bytes_by_stage[0]


def test_each_storage_once_and_no_parameter():
    """The session's records equal the distinct storages a plain forward saves (a hook keeping them alive, so
    no data pointer is reused), parameters and leaves left out."""
    run = _run(3, "gpipe")
    assert run.stats is not None and run.records
    assert not {ptr for ptr, moved in run.records if moved} & run.params
    stage = build_stages(CFG, 1, seed=3, dtype=torch.float64)[0]
    kept: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not (t.is_leaf and t.requires_grad) and t.untyped_storage().data_ptr() not in params:
            kept.append(t)
        return t
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    inputs = make_inputs(_plan(0).microbatches[0], synthetic_tokens(LENGTHS, CFG.vocab_size, seed=1), cfg=CFG)
    x, extra = stage.embed_inputs(inputs), stage.block_args(inputs)      # outside the blocks: not offloaded
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for blk in stage.blocks.values():
            x = blk(x, inputs, *extra)
    distinct = len({t.untyped_storage().data_ptr() for t in kept})
    assert run.stats.storages + run.stats.kept_storages == distinct * LENGTHS.size
    assert run.stats.storages > run.stats.kept_storages


def test_the_meter_counts_offloaded_storages_only_on_the_device(plain):
    """At the first backward (every forward done, microbatch 0 reloaded at the action before) the held bytes are
    the plain run's minus exactly the bytes still offloaded; each reload adds exactly its forward's bytes back (the
    microbatches have one shape); nothing is left after the step."""
    run = _run(3, "gpipe")
    assert run.stats is not None
    moved, m = run.stats.bytes_by_stage[0], LENGTHS.size
    assert moved % m == 0 and moved > 0
    assert plain["gpipe"].held_after_forwards - run.held_after_forwards == moved - moved // m
    assert run.held_after_reload == [moved // m] * m
    assert run.left_bytes == 0 and plain["gpipe"].left_bytes == 0


# ------------------------------------------------------------------ mutations the checks catch
def test_a_skipped_prefetch_fails_the_order_check(monkeypatch):
    """Mutation: the interpreter issues no prefetch (``prefetch_points`` empty): each reload then happens at the
    backward's start, after its prefetch action, and the order check names every forward."""
    monkeypatch.setattr(interpreter, "prefetch_points", lambda actions, offloaded: {})
    run = _run(3, "gpipe")
    assert run.stats is not None
    assert len(_order_problems(run.stats, list(make_schedule(_plan(0), "gpipe").ranks[0]))) == LENGTHS.size


def test_a_skipped_reload_fails_the_step(monkeypatch):
    """Mutation: no prefetch and ``before_backward`` neither reloads nor waits: autograd unpacks the offloaded
    storages itself (late) and the step refuses the forwards left unreloaded."""
    monkeypatch.setattr(interpreter, "prefetch_points", lambda actions, offloaded: {})
    monkeypatch.setattr(OffloadSession, "before_backward", lambda self, key: None)
    with pytest.raises(RuntimeError, match="never reloaded"):
        _run(3, "gpipe")


def test_a_host_buffer_given_back_before_its_reload_breaks_the_gradients(plain, monkeypatch):
    """Mutation: each host buffer returns to the pool right after its D2H (not after its reload read it): a
    later forward's pack takes it and overwrites it, and the exact-gradient comparison fails."""
    d2h = OffloadSession._d2h

    def early(self: OffloadSession, fw: Any) -> None:
        d2h(self, fw)
        for rec in fw.records:
            if rec.host is not None and not getattr(rec, "given", False):
                self.pool.give(rec.host)
                rec.given = True
    monkeypatch.setattr(OffloadSession, "_d2h", early)
    run = _run(3, "gpipe")
    assert not _equal(run.grads, plain["gpipe"].grads)


class _RecordedCopies(HostCopies):
    """CPU copies whose events are tokens, so the order of copies out and waits can be read back."""

    def __init__(self, device: torch.device, log: list[tuple[str, int]]) -> None:
        super().__init__(device)
        self.log, self.made = log, 0

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> Any:
        super().to_host(src, dst)
        self.made += 1
        self.log.append(("d2h", self.made))
        return ("event", self.made)

    def wait(self, event: Any) -> None:
        if event is not None:
            self.log.append(("wait", event[1]))


def test_an_offloading_forward_waits_for_the_copies_out_two_forwards_back(monkeypatch):
    """GPipe's four forwards back to back: before forward ``i >= COPY_OUT_DEPTH`` the compute stream waits for
    exactly the copies out of forward ``i - 2`` (the planner's ``COPY_OUT_DEPTH``), never the previous one's; fails
    with ``_cap_copies_out`` a no-op (no waits) or waiting on the last forward's copies."""
    log: list[tuple[str, int]] = []

    class Ops:
        def copies(self) -> _RecordedCopies:
            return _RecordedCopies(torch.device("cpu"), log)
    monkeypatch.setattr(offload, "device_ops", lambda device: Ops())
    capped = OffloadSession._cap_copies_out

    def marked(self: OffloadSession) -> None:
        log.append(("forward", 0))
        capped(self)
    monkeypatch.setattr(OffloadSession, "_cap_copies_out", marked)
    _run(2, "gpipe")
    forwards: list[list[int]] = []            # each forward's copy-out tokens, in order
    waits_before: list[list[int]] = []        # the tokens waited on as each forward starts
    for kind, token in log:
        if kind == "forward":
            forwards.append([])
            waits_before.append([])
        elif kind == "wait":
            waits_before[-1].append(token)
        else:
            forwards[-1].append(token)
    assert offload.COPY_OUT_DEPTH == 2 and len(forwards) == LENGTHS.size and all(forwards)
    for i in range(LENGTHS.size):
        expected = sorted(forwards[i - 2]) if i >= 2 else []
        assert sorted(waits_before[i]) == expected, (i, waits_before, forwards)


def test_bad_offload_blocks_are_refused_in_one_line():
    stage = build_stages(CFG, 1, seed=3, dtype=torch.float64)[0]
    with pytest.raises(ValueError, match=r"offload_blocks\[0\] = 4, but stage 0 holds 3"):
        OffloadSession.for_plan(_plan(4), {0: stage}, 0, "cpu")
    bad = replace(_plan(0), meta=_plan(0).meta.with_(offload_blocks=[1, 1]))
    with pytest.raises(ValueError, match="one count >= 0 per stage"):
        OffloadSession.for_plan(bad, {0: stage}, 0, "cpu")
    assert offload.offload_blocks_of(_plan(-1)) == [0]


# ------------------------------------------------------------------ real gloo ranks
class OffloadPlan(NoHooks):
    """Step hook: every rank runs the plan with ``offload_blocks`` set by hand (the planner's side is another
    engineer's; the runtime executes whatever the plan's meta says)."""

    def __init__(self, blocks: list[int]) -> None:
        self.blocks = [int(b) for b in blocks]

    def plan(self, rank: int, step: int, plan: Plan) -> Plan:
        return replace(plan, meta=plan.meta.with_(offload_blocks=self.blocks))


@dataclass(frozen=True)
class GlooCase:
    """One fp64 ``--verify`` run with offload (``blocks``: per plan stage; None: the plain run, no hook)."""

    path: str                 # 1f1b, zeros, zb, recompute, slices, embedlast, interleaved, fsdp
    nproc: int
    blocks: tuple[int, ...] | None

    @property
    def name(self) -> str:
        what = "plain" if self.blocks is None else "off" + "".join(map(str, self.blocks))
        return f"offload-{self.path}-{what}-{self.nproc}"


SLICE_BATCH = np.array([1200, 500, 40, 60, 30, 50, 70, 20], dtype=np.int64)
"""The slices case's trace (``tests/test_fp64_grads.py``): a 1,200-token document cut into a chain of slices."""


def _stages(path: str, nproc: int) -> int:
    return {"interleaved": 2 * nproc, "fsdp": nproc // 2}.get(path, nproc)


def _cases(nproc: int, paths: tuple[str, ...]) -> list[GlooCase]:
    """Each path with every stage offloading its first block (stage 0 all of its blocks), and its plain run."""
    out = []
    for path in paths:
        stages = _stages(path, nproc)
        if path in ("recompute", "slicesrc"):   # two blocks a stage: the first one's input is the stage input
            blocks = (2,) * stages
        else:
            blocks = (0,) * stages if path == "zeros" else tuple(2 if s == 0 and stages == 2 and path != "fsdp" else 1
                                                                  for s in range(stages))
        out += [GlooCase(path, nproc, blocks)] + ([GlooCase(path, nproc, None)] if path != "zeros" else [])
    return out


LOWER = ("1f1b", "zb", "recompute", "embedlast", "interleaved")
"""Where the first stage's measured peak must be lower with offload (a chain of slices peaks where its
microbatches are back on the device; there and elsewhere it is never higher)."""
FAST_PATHS = ("1f1b", "zeros", "zb", "recompute", "slices")
SLOW_PATHS = ("embedlast", "interleaved", "fsdp", "slicesrc")
FAST = _cases(2, FAST_PATHS)
SLOW2 = _cases(2, SLOW_PATHS)
SLOW4 = _cases(4, FAST_PATHS + SLOW_PATHS)


def _run_config(case: GlooCase, trace: Path) -> RunConfig:
    stages = _stages(case.path, case.nproc)
    virtual = 2 if case.path == "interleaved" else 1
    kind = {"zb": "zb", "slices": "zb-h1", "slicesrc": "zb-h1", "interleaved": "interleaved"}.get(case.path, "1f1b")
    family = "llama-tiny" if case.path in ("zb", "slices", "slicesrc", "embedlast") else "tiny"
    layers = 2 * stages if case.path in ("recompute", "slicesrc") else max(4, stages)
    model = model_config(f"{family}:dtype=float64,n_layers={layers}")
    limit = 40 * 2**20 if case.path.startswith("slices") else 256 * 2**20
    pipeline = PipelineConfig(num_stages=stages, virtual=virtual, schedule=kind, memory_limit_bytes=limit)
    common: dict[str, Any] = dict(model=model, pipeline=pipeline, seed=7, steps=1, warmup=0, backend="gloo",
                                  device="cpu", timeout_s=120.0)
    if case.path.startswith("slices"):         # slicesrc: every slice recomputed (I runs its whole backward)
        return RunConfig(**common, dataset=str(trace), global_batch=SLICE_BATCH.size, method="dynamic",
                         oversize="split", recompute="always" if case.path == "slicesrc" else "never")
    extra: dict[str, Any] = {"recompute": "always"} if case.path == "recompute" else \
        {"embedding": "last"} if case.path == "embedlast" else {"dp": 2, "shard": True} if case.path == "fsdp" else {}
    return RunConfig(**common, dataset="gsm8k", global_batch=8, method="fixed", mbs=1, **extra)


def _specs(cases: list[GlooCase], out: Path) -> list[RunSpec]:
    trace = out / "offload-slices.csv"
    trace.parent.mkdir(parents=True, exist_ok=True)
    trace.write_text("length\n" + "\n".join(str(x) for x in SLICE_BATCH) + "\n")
    return [RunSpec.create(_run_config(c, trace), out / c.name, verify=True, run_id=c.name,
                           hooks=None if c.blocks is None else HookRef(
                               target="tests.test_offload_runtime:OffloadPlan", kwargs={"blocks": list(c.blocks)}))
            for c in cases]


@register(2)
def _two(out: Path) -> list[RunSpec]:
    return _specs(FAST, out)


@register(4)
def _four(out: Path) -> list[RunSpec]:
    return _specs(SLOW4, out)


def _check_pair(out: Path, case: GlooCase) -> None:
    """``case`` (offload) verified to 1e-10, bit-equal to its plain run, and its memory rows (module doc)."""
    from dynmb.io.results import load_results

    plain = replace(case, path="1f1b" if case.path == "zeros" else case.path, blocks=None)   # zeros: 1f1b's run
    off, base = load_results(out / case.name), load_results(out / plain.name)
    steps = off["steps"]
    assert steps["verified"].all() and 0 <= float(steps["grad_rel_err"].max()) <= VERIFY_RTOL_FP64, case.name
    for col in ("loss", "grad_rel_err"):
        assert steps[col].tolist() == base["steps"][col].tolist(), (case.name, col)
    if case.path.startswith("slices"):
        assert (steps["sliced"] > 0).all(), case.name
    assert case.blocks is not None
    mem, plain_mem = off["memory"], base["memory"].set_index(["dp_rank", "stage"])
    lift = int(mem["stage"].max() + 1 - len(case.blocks))         # the embedding's own stage first
    by_rank = mem.groupby("rank")["offloaded_bytes"].sum()       # a stage's peak is its rank's (virtual stages)
    for row in mem.itertuples():
        k = case.blocks[row.stage - lift] if row.stage >= lift else 0
        assert (row.offloaded_bytes > 0) == (k > 0), (case.name, row.stage, row.offloaded_bytes)
        saved = int(plain_mem.loc[(row.dp_rank, row.stage), "peak_bytes"]) - int(row.peak_bytes)
        assert 0 <= saved <= by_rank[row.rank], (case.name, row.stage, saved, by_rank[row.rank])
    if case.path in LOWER and len(case.blocks) > 1:   # the first stage holds the most in flight: a lower peak
        first = mem[mem["stage"] == lift]
        assert (first["peak_bytes"].to_numpy() < plain_mem.xs(lift, level="stage")["peak_bytes"].to_numpy()).all()
    assert (mem["peak_bytes"] <= mem["limit_bytes"]).all(), case.name


@pytest.mark.dist
@pytest.mark.parametrize("case", [c for c in FAST if c.blocks is not None], ids=lambda c: c.name)
def test_two_ranks_offload_is_exact(gloo_job, case):
    job = gloo_job(2)
    assert job.returncode == 0, job.errors
    _check_pair(job.out, case)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in SLOW4 if c.blocks is not None], ids=lambda c: c.name)
def test_four_ranks_offload_is_exact(gloo_job, case):
    job = gloo_job(4)
    assert job.returncode == 0, job.errors
    _check_pair(job.out, case)


@pytest.fixture(scope="module")
def slow_two(tmp_path_factory) -> tuple[int, Path]:
    out = tmp_path_factory.mktemp("offload2")
    rc = launch_job(JobSpec(out_dir=str(out.resolve()), cases=tuple(_specs(SLOW2, out))), 2, quiet=True).returncode
    return rc, out


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in SLOW2 if c.blocks is not None], ids=lambda c: c.name)
def test_two_ranks_offload_composes(slow_two, case):
    rc, out = slow_two
    assert rc == 0, sorted((out / "errors").glob("*.txt"))
    _check_pair(out, case)


# ------------------------------------------------------------------ refused before any process starts
class _Wrapped(torch.nn.Module):
    """A stage module of a user's own: a dynmb stage inside, no ``block_scope`` of its own."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.stage, self.num_stages = inner.stage, inner.num_stages
        self.is_first, self.is_last = inner.is_first, inner.is_last

    def forward(self, x: Any, inputs: Any, **kw: Any) -> Any:
        return self.inner(x, inputs, **kw)


@dataclass
class _WrappingFactory:
    config: Any
    attention_work: str = "document"

    def build_stage(self, stage: int, num_stages: int, *, seed: int = 0, dtype: Any = None, device: Any = None) -> Any:
        from dynmb.models.families import build_stage
        return _Wrapped(build_stage(self.config, stage, num_stages, seed, dtype=dtype, device=device))


def wrapping() -> Any:
    return _WrappingFactory(model_config("tiny"))


def test_offload_on_stages_without_the_block_hook_is_refused_before_the_run():
    from dynmb.runtime.preflight import check_stages

    def spec(offload: str) -> RunSpec:
        cfg = RunConfig(model=model_config("tiny"), pipeline=PipelineConfig(num_stages=2, memory_limit_bytes=2**26),
                        offload=offload)
        return RunSpec.create(cfg, "unused", model_factory="tests.test_offload_runtime:wrapping")
    with pytest.raises(ValueError, match=r"offload='auto' needs stages with a block_scope .* stage 0 is a _Wrapped"):
        check_stages(spec("auto"))
    check_stages(spec("never"))
    stage = _WrappingFactory(model_config("tiny")).build_stage(0, 1)
    with pytest.raises(ValueError, match="has no block_scope"):
        OffloadSession.for_plan(replace(_plan(0), meta=_plan(0).meta.with_(offload_blocks=[1])), {0: stage}, 0, "cpu")


@pytest.mark.slow
def test_the_gpu_check_step_runs_on_the_cpu(tmp_path):
    """``benchmarks/offload_check.py`` (step 9 of ``benchmarks/gpu_check.sh``) in its CPU dry mode: exact, the
    meter's peak lower by what is off the device at the plain run's peak, bandwidths measured."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "offload.json"
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "offload_check.py"), "--device", "cpu",
                           "--model", "tiny", "--microbatches", "4", "--length", "32", "--copy-mib", "4",
                           "--out", str(out)], cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)})       # this tree's dynmb
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["exact"] and r["plain_max_diff"] == 0.0 and r["late_reloads"] == 0 and r["offloaded_bytes"] > 0
    assert r["saving_low"] <= r["peak_plain"] - r["peak_offload"] <= r["saving_high"]
    assert r["d2h_gbps"] > 0 and r["h2d_gbps"] > 0
