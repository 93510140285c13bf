"""The torchrun entry point of ``dynmb run``: one process per pipeline rank.

Single node (what ``dynmb run --nproc 2 ...`` starts)::

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m dynmb.runtime.worker --spec out/spec.json

Multi-node (same spec file on every node, e.g. on a shared file system)::

    torchrun --nnodes 2 --node-rank $NODE --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint $HOST:29500 \\
        -m dynmb.runtime.worker --spec /shared/out/spec.json

The spec is ``{"run": RunConfig.to_dict(), "out_dir": ..., "run_id": ...,
"verify": bool, "allow_over_limit": bool, "memory_model": path|None,
"fault": {"rank", "step", "kind"}|None}`` (``launch.write_spec`` writes it). Fault
kinds (tests): ``exit`` (``os._exit(13)`` half-way through the rank's actions),
``raise``, ``diverge`` (the rank perturbs its plan), ``corrupt`` (scales one
gradient before the verify), ``overlimit`` (checks the peak against peak - 1). A
form ``{"out_dir": ..., "cases": [spec, ...], "interleave": bool}`` runs several specs
in the same process group (start-up paid once): one after another, or with
``interleave`` (CPU) round by round, step k of every spec before step k + 1
(``run_cases``; what ``dynmb compare`` does on CPU).

Algorithm per run
-----------------
Topology: global rank = ``dp_idx * R + pp_idx`` with ``R = num_stages / virtual``
pipeline ranks; stage ``s`` lives on pipeline rank ``s % R``. Pair groups (P2P),
DP groups (gradient all-reduce) and PP groups (weight gather for ``--verify``) are
created here and passed in. Every step ``k`` (warm-up steps first, logged with
``warmup=True``):

1. every rank samples the global batch (``data.sample_batch(trace, B, seed, k)``)
   and plans it itself with ``planner.plan_step`` (deterministic); the plans'
   digests are all-gathered and a rank whose plan differs from rank 0's stops the
   run with an error naming it;
2. barrier; the interpreter runs this rank's actions of its replica's schedule;
   sends are drained; gradients are summed over the DP group; Adam steps;
   barrier: ``step_s`` is barrier to barrier;
3. the measured peak memory of each rank's stages is checked against the plan's
   limit (over the limit fails the run unless ``allow_over_limit``); with
   ``verify`` every rank recomputes the step's gradients in one process from the
   pre-step weights and compares its own parameters (fp32, relative 1e-5);
4. all reports are all-gathered; rank 0 appends rows to the ``steps``,
   ``actions`` and ``memory`` tables (atomic, step by step), then any failure of
   step 3 is raised on every rank, naming the rank and the reason.

Any exception writes ``out_dir/errors/rank<k>.txt`` (rank, host, error,
traceback) and exits with status 1, so torchrun tears the other ranks down.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import time
import traceback
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dynmb.config import RunConfig
from dynmb.runtime.comm import P2P, make_pair_groups
from dynmb.runtime.hostmem import prefault, retain_freed_memory
from dynmb.runtime.interpreter import Clock, run_actions
from dynmb.runtime.launch import PROGRESS
from dynmb.types import Microbatch, Plan

__all__ = ["main", "run_spec", "run_cases", "PlanDivergenceError", "StepCheckError"]

VERIFY_RTOL = 1e-5


class PlanDivergenceError(RuntimeError):
    """Ranks planned different steps; running them would deadlock or corrupt gradients."""


class StepCheckError(RuntimeError):
    """A step broke the memory limit or its gradients differ from the reference."""


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------
def _token_seed(seed: int, step: int) -> int:
    return seed * 1_000_003 + step


def check_plan_digest(plan: Plan, step: int, device: torch.device) -> None:
    """All-gather the plan digest; raise ``PlanDivergenceError`` naming the ranks that differ from rank 0."""
    mine = torch.tensor(list(bytes.fromhex(plan.digest())), dtype=torch.uint8, device=device)
    got = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(got, mine)
    bad = [r for r, g in enumerate(got) if not torch.equal(g, got[0])]
    if bad:
        raise PlanDivergenceError(
            f"step {step}: the plan of rank(s) {bad} differs from rank 0's "
            f"(digest {bytes(got[bad[0]].cpu().tolist()).hex()[:12]} vs {bytes(got[0].cpu().tolist()).hex()[:12]}); "
            "refusing to run a divergent plan")


def _perturb(plan: Plan) -> Plan:
    """Fault injection: the same plan with the first microbatch one column wider."""
    mb = plan.microbatches[0]
    wider = Microbatch(mb.seq_ids, mb.lengths, mb.padded_len + 1, mb.batch, mb.row_ids)
    return Plan(microbatches=(wider,) + plan.microbatches[1:], method=plan.method, num_stages=plan.num_stages,
                memory_limit_bytes=plan.memory_limit_bytes, num_sequences=plan.num_sequences,
                schedule_kind=plan.schedule_kind, dp=plan.dp, replica_ids=plan.replica_ids,
                predictions=plan.predictions, meta=plan.meta)


def _reference_grads(cfg: RunConfig, plan: Plan, tokens: list, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Single-process gradients of the whole global batch from the pre-step weights ``state``."""
    from dynmb.model import build_stages, make_inputs

    stages = build_stages(cfg.model, cfg.pipeline.num_stages, cfg.seed)
    for st in stages:
        st.load_state_dict({n: state[n] for n, _ in st.named_parameters()})
    total = plan.real_tokens
    for mb in plan.microbatches:
        x, inputs = None, make_inputs(mb, tokens, cfg=cfg.model)
        for st in stages:
            x = st(x, inputs)
        (x / total).backward()
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for st in stages for n, p in st.named_parameters()}


def _compare(mine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> list[str]:
    bad = []
    for n, a in mine.items():
        b = ref[n].to(a.device, a.dtype)
        err, scale = float((a - b).abs().max()), float(b.abs().max())
        if err > VERIFY_RTOL * scale + 1e-9:
            bad.append(f"param {n}: max abs error {err:.3g} > {VERIFY_RTOL:g} x max|ref| {scale:.3g}")
    return bad


class _Setup:
    """Everything one run keeps across steps on this rank."""

    def __init__(self, spec: dict[str, Any], device: torch.device) -> None:
        from dynmb.costmodel import get_cost_model
        from dynmb.data import load_trace
        from dynmb.memory import get_memory_model
        from dynmb.model import build_stage
        from dynmb.runtime.meter import MemoryMeter

        self.spec, self.device = spec, device
        self.cfg = cfg = RunConfig.from_dict(spec["run"])
        pc = cfg.pipeline
        self.S, self.R, self.dp = pc.num_stages, pc.num_ranks, cfg.dp
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world != self.R * self.dp:
            raise ValueError(f"world size {self.world} != pipeline ranks {self.R} (stages {self.S} / virtual "
                             f"{pc.virtual}) x dp {self.dp}")
        self.dp_idx, self.pp_idx = divmod(self.rank, self.R)
        timeout = timedelta(seconds=cfg.timeout_s)
        self.pair_groups = make_pair_groups(self.world, self.R, timeout, device)
        self.dp_group = self.pp_group = None
        for i in range(self.R):                      # collective: every rank creates every group
            g = dist.new_group([d * self.R + i for d in range(self.dp)], timeout=timeout)
            if i == self.pp_idx:
                self.dp_group = g
        for d in range(self.dp):
            g = dist.new_group([d * self.R + i for i in range(self.R)], timeout=timeout)
            if d == self.dp_idx:
                self.pp_group = g
        self.pp_ranks = [self.dp_idx * self.R + i for i in range(self.R)]
        self.stages = {s: build_stage(cfg.model, s, self.S, cfg.seed, device=device)
                       for s in range(self.S) if s % self.R == self.pp_idx}
        self.params = {n: p for m in self.stages.values() for n, p in m.named_parameters()}
        self.opt = torch.optim.Adam(self.params.values(), lr=cfg.lr)
        self.cost_model = get_cost_model(cfg.cost_model, cfg.model, self.S)
        self.memory_model = get_memory_model(spec.get("memory_model"), cfg.model, self.S)
        self.trace = load_trace(cfg.dataset)
        self.meter = MemoryMeter(device=device, modules=list(self.stages.values()), optimizer=self.opt)
        self.clock = Clock(device)
        self.run_id = spec.get("run_id") or "run"
        self.warm_actions: list[dict[str, Any]] = []   # every rank's warm-up actions, for _calibrate
        self.seen_shapes: set[tuple[int, int]] = set()  # (rows, padded_len) run so far (prewarm included)

    def plan(self, k: int) -> tuple[Any, Any, Any, Plan]:
        """Global batch ``k`` and its ``(plan, schedule, sim)``: deterministic, the same on every rank."""
        from dynmb.data import sample_batch
        from dynmb.planner import plan_step

        cfg, pc = self.cfg, self.cfg.pipeline
        lengths = sample_batch(self.trace, cfg.global_batch, cfg.seed, step=k)
        plan, sched, sim = plan_step(lengths, method=cfg.method, model_cfg=cfg.model, num_stages=self.S,
                                     memory_limit_bytes=pc.memory_limit_bytes, schedule_kind=pc.schedule,
                                     reorder=pc.reorder, mbs=cfg.mbs, dp=self.dp, virtual=pc.virtual,
                                     cost_model=self.cost_model, memory_model=self.memory_model,
                                     oversize=cfg.oversize, pack_len=cfg.pack_len, round_to=cfg.round_to,
                                     recompute=cfg.recompute)
        return lengths, plan, sched, sim


def _prewarm(st: _Setup) -> int:
    """Run one forward + backward of every distinct microbatch shape of this run's planned steps
    on this rank's stages, outside any measured step (``RunConfig.prewarm``), then drop the
    gradients. Shapes are planned with the cost model of set-up time (the warm-up calibration
    may change later plans; the ``new_shapes`` column says what was still new). Returns the
    number of shapes run."""
    from dynmb.model import hidden_shape, make_inputs, synthetic_tokens, torch_dtype

    cfg = st.cfg
    todo: dict[tuple[int, int, bool], tuple[Microbatch, Any]] = {}
    for k in range(cfg.warmup + cfg.steps):
        lengths, plan, _, _ = st.plan(k)
        for mb in plan.microbatches:
            todo.setdefault((mb.batch, mb.padded_len, mb.is_packed), (mb, lengths))
    for mb, lengths in todo.values():
        tokens = synthetic_tokens(lengths, cfg.model.vocab_size, 0)
        inputs = make_inputs(mb, tokens, cfg=cfg.model, device=st.device)
        for stage in st.stages.values():
            x = None if stage.is_first else torch.randn(hidden_shape(mb, cfg.model), dtype=torch_dtype(cfg.model),
                                                        device=st.device, requires_grad=True)
            y = stage(x, inputs)
            if stage.is_last:
                y.backward()
            else:
                y.backward(torch.ones_like(y))
        st.seen_shapes.add((mb.batch, mb.padded_len))
    st.opt.zero_grad(set_to_none=True)
    return len(todo)


# --------------------------------------------------------------------------
# one step
# --------------------------------------------------------------------------
def _step(st: _Setup, k: int) -> dict[str, Any]:
    from dynmb.model import hidden_shape, make_inputs, synthetic_tokens, torch_dtype
    from dynmb.planner import make_schedule

    cfg, pc, dev = st.cfg, st.cfg.pipeline, st.device
    lengths, plan, sched, sim = st.plan(k)
    fault = st.spec.get("fault") or {}

    def injected(kind: str) -> bool:
        return fault.get("rank") == st.rank and fault.get("step") == k and fault.get("kind") == kind

    if injected("diverge"):
        plan = _perturb(plan)
    check_plan_digest(plan, k, dev)
    sub = plan.replica(st.dp_idx) if st.dp > 1 else plan
    if st.dp_idx > 0:
        sched = make_schedule(sub, pc.schedule, virtual=pc.virtual, memory_model=st.memory_model,
                              cost_model=st.cost_model)
    if sched.num_microbatches != sub.num_microbatches or sched.num_ranks != st.R:
        raise RuntimeError(f"schedule for {sched.num_microbatches} microbatches on {sched.num_ranks} ranks does not "
                           f"fit replica {st.dp_idx}'s {sub.num_microbatches} microbatches on {st.R} ranks")
    tokens = synthetic_tokens(lengths, cfg.model.vocab_size, _token_seed(cfg.seed, k))
    state = None
    if st.spec.get("verify"):
        parts: list[Any] = [None] * st.R
        dist.all_gather_object(parts, {n: p.detach().cpu().clone() for n, p in st.params.items()}, group=st.pp_group)
        state = {n: t for part in parts for n, t in part.items()}
    # Inputs are built at a microbatch's first forward on this rank and dropped from the cache
    # at its last one: what autograd saved (the attention mask) then lives only until the
    # backward, as the memory model assumes, instead of every microbatch's mask for the whole step.
    cache: dict[int, Any] = {}
    uses = Counter(a.mb for a in sched.ranks[st.pp_idx] if a.op == "F")

    def inputs(m: int):
        x = cache.pop(m, None)
        if x is None:
            x = make_inputs(sub.microbatches[m], tokens, cfg=cfg.model, device=dev)
        uses[m] -= 1
        if uses[m] > 0:
            cache[m] = x
        return x

    def on_action(i: int, a) -> None:
        if i == len(actions) // 2:
            if injected("exit"):
                os._exit(13)
            if injected("raise"):
                raise RuntimeError(f"injected fault before action {a} (step {k})")

    actions = sched.ranks[st.pp_idx]
    p2p = P2P(sched, st.pp_idx, st.pp_ranks, st.pair_groups, lambda m: hidden_shape(sub.microbatches[m], cfg.model),
              dtype=torch_dtype(cfg.model), device=dev)
    st.meter.reset_step()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    gc.disable()   # no collector pauses inside the measured step; _run_step collects after it
    dist.barrier()
    t0, m0 = time.perf_counter(), st.clock.mark()
    timings, loss = run_actions(actions, stages=st.stages, plan=sub, inputs=inputs, p2p=p2p,
                                loss_scale=1.0 / plan.real_tokens, clock=st.clock, meter=st.meter,
                                on_action=on_action)
    p2p.finish()
    for p in st.params.values():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if st.dp > 1:
        flat = torch.cat([p.grad.reshape(-1) for p in st.params.values()])
        dist.all_reduce(flat, group=st.dp_group)
        off = 0
        for p in st.params.values():
            p.grad.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()
    if injected("corrupt"):
        next(iter(st.params.values())).grad.mul_(1.001)   # fault injection: --verify must catch this
    grads = {n: p.grad.detach().clone() for n, p in st.params.items()} if state is not None else None
    st.opt.step()
    st.meter.sample_states()
    st.opt.zero_grad(set_to_none=True)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dist.barrier()
    step_s = time.perf_counter() - t0
    problems: list[str] = []

    # --- measurements ---------------------------------------------------------
    costs = st.cost_model.plan_costs(sub, ops=("F", "B", "I", "W"))
    acts, busy = [], 0.0
    for t in timings:
        a, mb = t.action, sub.microbatches[t.action.mb]
        start, end = st.clock.seconds(m0, t.t_start), st.clock.seconds(m0, t.t_end)
        busy += end - start
        pred = costs[a.op][a.stage, a.mb] if a.op in costs else 0.0
        acts.append(dict(run_id=st.run_id, step=k, rank=st.rank, dp_rank=st.dp_idx, stage=a.stage, op=a.op, mb=a.mb,
                         batch=mb.batch, padded_len=mb.padded_len, docs=mb.num_seqs,
                         attn_work=mb.attention_work(cfg.model.attention), start_s=start, end_s=end, pred_s=float(pred),
                         wait_s=st.clock.seconds(t.t_recv, t.t_start)))
    limit = plan.memory_limit_bytes
    pred_peak = list(plan.predictions.get("pred_peak_bytes", []))
    peaks = st.meter.peaks()                           # {stage: bytes} of this rank's stages
    cuda_pool = dict(allocated_bytes=int(torch.cuda.max_memory_allocated(dev)),
                     reserved_bytes=int(torch.cuda.max_memory_reserved(dev))) if dev.type == "cuda" else {}
    mem = []
    for s in sorted(st.stages):
        peak = int(peaks[s])
        if injected("overlimit"):
            limit = peak - 1                           # fault injection: the check must fail
        mem.append(dict(run_id=st.run_id, step=k, stage=s, rank=st.rank, dp_rank=st.dp_idx, peak_bytes=peak,
                        limit_bytes=int(limit), pred_peak_bytes=int(pred_peak[s]) if s < len(pred_peak) else None,
                        **cuda_pool))
        if peak > limit and not st.spec.get("allow_over_limit"):
            problems.append(f"rank {st.rank} stage {s}: measured peak {peak} bytes exceeds the memory limit "
                            f"{limit} bytes at step {k}")
    if state is not None:
        ref = _reference_grads(cfg, plan, tokens, state)
        problems += [f"rank {st.rank} step {k} {msg}" for msg in _compare(grads, ref)[:5]]
    return dict(rank=st.rank, plan=plan, sim=sim, step_s=step_s, busy_s=busy, loss=loss, actions=acts,
                memory=mem, problems=problems)


def _record(st: _Setup, k: int, rep: dict[str, Any], reports: list[dict[str, Any]], writer: Any) -> None:
    """Rank 0: append this step's rows to the tables."""
    plan, cfg = rep["plan"], st.cfg
    step_s = max(r["step_s"] for r in reports)
    shapes = {(mb.batch, mb.padded_len) for mb in plan.microbatches}
    new_shapes = len(shapes - st.seen_shapes)
    st.seen_shapes |= shapes
    row = dict(run_id=st.run_id, method=cfg.method, dataset=cfg.dataset, step=k, warmup=k < cfg.warmup,
               step_s=step_s, pred_step_s=plan.predictions.get("pred_step_s"), real_tokens=plan.real_tokens,
               computed_tokens=plan.computed_tokens, tokens_per_s=plan.real_tokens / step_s,
               num_microbatches=plan.num_microbatches, padding_fraction=plan.padding_fraction,
               mean_bubble=sum(1 - r["busy_s"] / step_s for r in reports) / len(reports),
               pred_mean_bubble=plan.predictions.get("mean_bubble"), plan_s=plan.predictions.get("plan_s"),
               loss=sum(r["loss"] for r in reports), schedule=cfg.pipeline.schedule, reorder=cfg.pipeline.reorder,
               num_stages=st.S, virtual=cfg.pipeline.virtual, dp=st.dp, world_size=st.world,
               verified=bool(st.spec.get("verify")), memory_limit_bytes=int(plan.memory_limit_bytes),
               mbs=plan.meta.get("mbs"), model=cfg.model.name, global_batch=cfg.global_batch,
               truncated=len(plan.meta.get("truncated", [])), dropped=len(plan.meta.get("dropped", [])),
               recomputed=int(plan.recompute_mask().sum()),
               overhead_F_s=st.cost_model.runtime_overhead_s["F"], overhead_B_s=st.cost_model.runtime_overhead_s["B"],
               attention=cfg.model.attention, pack_len=plan.meta.get("pack_len"), round_to=cfg.round_to,
               distinct_shapes=len(shapes), new_shapes=new_shapes, prewarm=cfg.prewarm, seed=cfg.seed,
               label=st.spec.get("label") or cfg.method)
    writer.append("steps", [row])
    print(f"{PROGRESS}{st.run_id} {'warm-up ' if k < cfg.warmup else ''}step {k}: {step_s:.2f} s", flush=True)
    writer.append("actions", [a for r in reports for a in r["actions"]])
    writer.append("memory", [m for r in reports for m in r["memory"]])


def _open(spec: dict[str, Any], device: torch.device, writers: dict[str, Any]) -> _Setup:
    """Set up one spec on this rank; rank 0 opens (or reuses) the writer of its out_dir."""
    from dynmb.results import TableWriter, run_info

    st = _Setup(spec, device)
    if device.type == "cpu":   # fault the heap in now, not inside the first steps' actions
        prefault(st.cfg.pipeline.memory_limit_bytes, local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if st.rank == 0:
        w = writers.setdefault(spec["out_dir"], TableWriter(spec["out_dir"]))
        info = run_info(st.run_id, st.cfg.flat(), backend=dist.get_backend(), device=str(device), world_size=st.world)
        w.append("runs", [{**info, "verify": bool(spec.get("verify")), "nproc": st.world}])
    return st


def _run_step(st: _Setup, k: int, writers: dict[str, Any]) -> None:
    """Step ``k`` of one spec: run it, gather the reports, record them, raise any failure."""
    try:
        rep = _step(st, k)
    finally:
        gc.enable()
    reports: list[Any] = [None] * st.world
    light = {key: v for key, v in rep.items() if key not in ("plan", "sim")}
    dist.all_gather_object(reports, light)
    if st.rank == 0:
        _record(st, k, rep, reports, writers[st.spec["out_dir"]])
    problems = [p for r in reports for p in r["problems"]]
    if problems:
        raise StepCheckError("; ".join(problems))
    if k < st.cfg.warmup and st.spec.get("calibrate", st.device.type == "cpu"):
        st.warm_actions += [a for r in reports for a in r["actions"]]
        if k == st.cfg.warmup - 1:
            _calibrate(st)
    gc.collect()


def _calibrate(st: _Setup) -> None:
    """After the warm-up steps: add the per-action runtime overhead they measured to the cost
    model the next steps are planned and predicted with (``costmodel.runtime_overhead``).
    Every rank has every rank's warm-up actions (all-gathered), so all compute the same."""
    import pandas as pd

    from dynmb.costmodel import runtime_overhead

    oh = runtime_overhead(pd.DataFrame(st.warm_actions))
    st.cost_model = st.cost_model.with_overhead(**oh)
    st.warm_actions = []


def _close(setups: list[_Setup], writers: dict[str, Any], device: torch.device) -> None:
    # Free the runs' models, gradients and optimizer states before the next case of the job
    # starts: modules, hooks and the optimizer form reference cycles that only the cyclic
    # collector frees, and on CUDA the next case's measured peak would include them.
    for w in writers.values():
        w.close()
    writers.clear()
    for st in setups:
        st.meter.close()
    setups.clear()
    gc.unfreeze()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_cases(specs: list[dict[str, Any]], device: torch.device, *, interleave: bool = False) -> None:
    """Run specs in the current process group: one after another, or round by round.

    ``interleave`` (CPU only): all specs are set up first (their models and optimizers live
    side by side), then each round runs step k of every spec that has one, in an order
    rotated by one every round, so a burst of outside load on a shared machine slows every
    method's step alike instead of whichever method ran during it. Not on CUDA: the other
    specs' states would be in every measured peak.

    Python's cyclic collector, left on, runs a full collection now and then inside a step:
    ~0.1 s of one core over the ~220k objects torch, pandas and scipy leave, and the rank's
    peers wait for it (stalls of 0.2 s were measured mid-step). As Megatron-LM's --manual-gc
    does: freeze what set-up allocated, keep the collector off while a step runs (``_step``),
    collect between steps (``_run_step``)."""
    if interleave and device.type != "cpu":
        raise ValueError("interleaved cases are for CPU runs (the CUDA peak would count every case's states)")
    for group in ([specs] if interleave else [[s] for s in specs]):
        writers: dict[str, Any] = {}
        setups: list[_Setup] = []
        try:
            for spec in group:
                setups.append(_open(spec, device, writers))
                if setups[-1].cfg.prewarm:
                    _prewarm(setups[-1])
            gc.collect()
            gc.freeze()
            for k in range(max(st.cfg.warmup + st.cfg.steps for st in setups)):
                for i in range(len(setups)):
                    st = setups[(i + k) % len(setups)]
                    if k < st.cfg.warmup + st.cfg.steps:
                        _run_step(st, k, writers)
        finally:
            _close(setups, writers, device)


def run_spec(spec: dict[str, Any], device: torch.device) -> None:
    """Run one spec (all its steps) in the current process group."""
    run_cases([spec], device)


# --------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------
def _write_error(out_dir: Path, rank: int, err: BaseException) -> None:
    d = out_dir / "errors"
    d.mkdir(parents=True, exist_ok=True)
    text = (f"rank: {rank}\nhost: {socket.gethostname()}\nerror: {type(err).__name__}: {err}\n\n"
            + "".join(traceback.format_exception(err)))
    tmp = d / f".rank{rank}.txt.tmp"
    tmp.write_text(text)
    os.replace(tmp, d / f"rank{rank}.txt")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dynmb.runtime.worker", description=__doc__.split("\n")[0])
    ap.add_argument("--spec", required=True, help="spec JSON written by `dynmb run` (launch.write_spec)")
    args = ap.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    rank, local = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    out_dir = Path(spec["out_dir"])
    try:
        cases = spec.get("cases") or [spec]
        cfg = RunConfig.from_dict(cases[0]["run"])
        if cfg.device == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("device cuda asked for, but torch sees no CUDA GPU on this host")
            if local >= torch.cuda.device_count():
                raise RuntimeError(f"local rank {local} needs GPU {local}, but only {torch.cuda.device_count()} "
                                   "visible on this host: use fewer ranks per node (e.g. --virtual to put several "
                                   "stages on one rank) or set CUDA_VISIBLE_DEVICES")
            torch.cuda.set_device(local)
            device = torch.device("cuda", local)
        else:
            torch.set_num_threads(1)
            retain_freed_memory()
            device = torch.device("cpu")
        dist.init_process_group(cfg.backend, timeout=timedelta(seconds=cfg.timeout_s),
                                device_id=device if device.type == "cuda" else None)
        run_cases(cases, device, interleave=bool(spec.get("interleave")) and len(cases) > 1)
        dist.barrier()
        dist.destroy_process_group()
        return 0
    except BaseException as e:  # noqa: BLE001 - every failure must leave a trace and a non-zero exit
        _write_error(out_dir, rank, e)
        print(f"[dynmb rank {rank}] {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)   # do not wait for peers stuck in collectives; torchrun tears them down


if __name__ == "__main__":
    sys.exit(main())
