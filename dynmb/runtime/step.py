"""One optimizer step of one run on this rank: plan, run the actions, sum gradients, Adam, measure.

``run_step(state, k)`` (``state``: the run's ``dynmb.runtime.state.RunState``):

1. plan: global batch ``k`` and its plan (``RunState.plan_batch``, deterministic on every
   rank); the ranks compare plan digests (``checks.check_plan_digest``). A replica other
   than 0 builds its own schedule for its share of the plan. With ``verify`` the replica
   gathers its pre-step weights.
2. run: barrier; the interpreter runs this rank's actions of its replica's schedule
   (``interpreter.run_actions``; a microbatch's inputs are built at its first forward on
   this rank and dropped after its last; with the plan's ``offload_blocks`` an ``OffloadSession``,
   ``dynmb.runtime.offload``, moves saved activations to host memory and back); sends are drained; missing gradients are zeros;
   gradients are summed over the data-parallel group in one flat all-reduce; Adam steps;
   barrier. ``step_s`` is barrier to barrier. Python's cyclic collector is off from before
   the first barrier to the end of the step (Megatron-LM's --manual-gc: a collection inside
   a step stalls every peer waiting on this rank).
3. measure: one ``ActionRow`` per action (compute interval from the step start, receive
   wait, the cost model's prediction), one ``MemoryRow`` per stage (the meter's peak; the
   CUDA allocator's peaks; the stage's and the GPU's predicted peaks, read from the plan's
   predictions: the step simulates nothing); then the memory-limit and ``--verify`` checks
   (``dynmb.runtime.checks``). The ``StepReport`` carries rows and failed checks to the
   worker.

Tests act on the step through ``hooks.StepHooks`` (``state.hooks``).
"""

from __future__ import annotations

import gc
import time
from collections import Counter
from dataclasses import replace
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from dynmb.models import MicrobatchInputs, hidden_shape, make_inputs, torch_dtype
from dynmb.planning import make_schedule, replica_of
from dynmb.models.prefix import PrefixStore
from dynmb.runtime.checks import (
    check_plan_digest,
    gather_weights,
    gradient_problems,
    memory_problems,
    reference_gradients,
    relative_error,
)
from dynmb.runtime.comm import P2P
from dynmb.runtime.fsdp import begin_step, finish_step, full_tensors
from dynmb.runtime.interpreter import ActionContext, ActionTiming, run_actions
from dynmb.runtime.offload import OffloadSession
from dynmb.runtime.records import ActionRow, MemoryRow, StepReport
from dynmb.runtime.state import RunState
from dynmb.core.types import Action, Plan, Schedule
from dynmb.schedule.embedlast import is_lifted
from dynmb.timing.embedding import embed_costs, lifted_costs

__all__ = ["run_step"]


class _InputCache:
    """A microbatch's inputs, built at its first forward on this rank and dropped at its last:
    what autograd saved from them then lives only until the backward, as the memory model
    assumes, instead of every microbatch's inputs for the whole step."""

    def __init__(self, plan: Plan, actions: Sequence[Action], tokens: list[torch.Tensor], state: RunState,
                 prefix: PrefixStore | None, embeds: bool = False) -> None:
        self.plan, self.tokens, self.state, self.prefix = plan, tokens, state, prefix
        # ``embeds``: the schedule's stage 0 is the embedding, whose backward redoes its lookup from the inputs
        self.uses = Counter(a.mb for a in actions if a.op == "F" or (embeds and a.stage == 0))
        self.cache: dict[int, MicrobatchInputs] = {}

    def __call__(self, mb: int) -> MicrobatchInputs:
        inputs = self.cache.pop(mb, None)
        if inputs is None:
            inputs = make_inputs(self.plan.microbatches[mb], self.tokens, cfg=self.state.run.model,
                                 device=self.state.device)
            if inputs.has_slices:
                inputs = replace(inputs, prefix=self.prefix, microbatch=mb)
        self.uses[mb] -= 1
        if self.uses[mb] > 0:
            self.cache[mb] = inputs
        return inputs


def _sum_gradients(state: RunState) -> dict[str, torch.Tensor]:
    """Zeros for parameters without a gradient; the data-parallel sum in one flat all-reduce.
    Returns the gradients by parameter name."""
    grads = {}
    for name, p in state.params.items():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads[name] = p.grad
    if state.topology.dp_size > 1 and not state.sharded:     # sharded: FSDP2 summed them (finish_step)
        flat = torch.cat([g.reshape(-1) for g in grads.values()])
        dist.all_reduce(flat, group=state.groups.data_parallel)
        offset = 0
        for g in grads.values():
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    return grads


def _action_rows(state: RunState, step: int, plan: Plan, timings: list[ActionTiming],
                 start_mark: object, lift: bool = False) -> tuple[list[ActionRow], float]:
    """One row per timed action and this rank's busy seconds (``lift``: the schedule's stage 0 is the embedding's,
    priced by ``dynmb.timing.embedding``)."""
    costs = state.cost_model.plan_costs(plan, ops=("F", "B", "I", "W"))
    raw = state.profile_model.plan_costs(plan, ops=("F", "B", "I", "W"))
    if lift:
        costs = lifted_costs(costs, embed_costs(state.cost_model, plan))
        raw = lifted_costs(raw, embed_costs(state.profile_model, plan))
    rows, busy_s = [], 0.0
    for timing in timings:
        action, mb = timing.action, plan.microbatches[timing.action.mb]
        start = state.clock.seconds(start_mark, timing.t_start)
        end = state.clock.seconds(start_mark, timing.t_end)
        busy_s += end - start
        pred = costs[action.op][action.stage, action.mb] if action.op in costs else 0.0
        raw_pred = raw[action.op][action.stage, action.mb] if action.op in raw else 0.0
        rows.append(ActionRow(
            run_id=state.spec.run_id, step=step, rank=state.rank, dp_rank=state.topology.dp_index,
            stage=action.stage, op=action.op, mb=action.mb, batch=mb.batch, padded_len=mb.padded_len,
            docs=mb.num_seqs, attn_work=mb.attention_work(state.run.model.attention), start_s=start, end_s=end,
            pred_s=float(pred), wait_s=state.clock.seconds(timing.t_recv, timing.t_start),
            raw_pred_s=float(raw_pred), cpu_s=timing.cpu_s))
    return rows, busy_s


def _memory_rows(state: RunState, step: int, plan: Plan, offloaded: Mapping[int, int]) -> list[MemoryRow]:
    """One row per stage of this rank: measured peak, the limit it is checked against, the bytes it offloaded, the
    stage's and the GPU's predicted peaks (``_rank_peak``; None: the stage's)."""
    planned = list(plan.predictions.get("pred_peak_bytes", []))
    rank_peak = _rank_peak(state, plan)
    peaks = state.meter.peaks()
    allocated, reserved = state.ops.peak_allocated_bytes(), state.ops.peak_reserved_bytes()
    rows = []
    for stage in sorted(state.stages):
        peak = int(peaks[stage])
        limit = state.hooks.memory_limit(state.rank, step, stage, int(plan.memory_limit_bytes), peak)
        pred = int(planned[stage]) if stage < len(planned) else None
        rows.append(MemoryRow(
            run_id=state.spec.run_id, step=step, stage=stage, rank=state.rank, dp_rank=state.topology.dp_index,
            peak_bytes=peak, limit_bytes=int(limit), pred_peak_bytes=pred,
            pred_rank_peak_bytes=pred if rank_peak is None else rank_peak,
            allocated_bytes=allocated, reserved_bytes=reserved, offloaded_bytes=int(offloaded.get(stage, 0))))
    return rows


def _rank_peak(state: RunState, plan: Plan) -> int | None:
    """The predicted peak of this rank's GPU where it holds several stages (interleaved chunks; the embedding stage
    beside the last, ``dynmb.schedule.embedlast``): the plan's ``pred_rank_peak_bytes`` of this rank in its replica
    (the simulator's peak of the rank over the replica's schedule, made where the plan was predicted: what the
    planner holds under the limit; a plan's ``pred_peak_bytes`` is per stage, the meter's peak the rank's). None
    where it holds one stage, or without a memory prediction."""
    gpus = plan.predictions.pred_rank_peak_bytes
    if len(state.stages) < 2 or gpus is None:
        return None
    return gpus[state.topology.dp_index][state.topology.pp_index]


def _gather(state: RunState) -> None:
    """FSDP2 (``--shard``): every unit's weights gathered once, gradient sync off (``fsdp.begin_step``); the meter
    recounts the states (the gathered weights, their whole gradients, the shards beside them)."""
    if state.sharded:
        begin_step(state.stages.values())
        state.meter.sample_states()


def run_step(state: RunState, step: int) -> tuple[StepReport, Plan, Schedule]:
    """Run step ``step`` on this rank (see the module docstring); returns this rank's report,
    the step's plan (the global batch's, every replica) and replica 0's schedule."""
    try:
        return _run_step(state, step)
    finally:
        gc.enable()


def _run_step(state: RunState, step: int) -> tuple[StepReport, Plan, Schedule]:
    run, pipeline, device, topology = state.run, state.run.spec, state.device, state.topology
    batch = state.plan_batch(step)
    plan = state.hooks.plan(state.rank, step, batch.plan)
    check_plan_digest(plan, step, device)
    replica = replica_of(plan, topology.dp_index)
    schedule = batch.schedule
    if topology.dp_index > 0:
        schedule = make_schedule(replica, pipeline.schedule_kind, virtual=pipeline.virtual,
                                 models=state.planning_models)
    if schedule.num_microbatches != replica.num_microbatches or schedule.num_ranks != topology.pipeline_size:
        raise RuntimeError(f"schedule for {schedule.num_microbatches} microbatches on {schedule.num_ranks} ranks "
                           f"does not fit replica {topology.dp_index}'s {replica.num_microbatches} microbatches "
                           f"on {topology.pipeline_size} ranks")
    tokens = state.tokens(batch, step)
    weights = gather_weights(full_tensors(state.params), state.groups.pipeline, topology.pipeline_size) \
        if state.spec.verify else None
    actions = schedule.ranks[topology.pp_index]
    lift = int(is_lifted(schedule, replica.num_stages))     # the embedding stage first (dynmb.schedule.embedlast)
    p2p = P2P(schedule, topology.pp_index, topology.pipeline_ranks(), state.groups.pairs,
              lambda mb, sender: hidden_shape(replica.microbatches[mb], run.model, sender - lift if sender >= lift
                                              else None, pipeline.num_stages),
              dtype=torch_dtype(run.model), device=device)
    offload = OffloadSession.for_plan(replica, state.stages, lift, device, state.meter)   # None: nothing offloaded
    state.meter.reset_step()     # also the allocator's peak counters
    gc.disable()   # no collector pauses inside the measured step; run_step turns it back on
    dist.barrier()
    t0, start_mark = time.perf_counter(), state.clock.mark()
    _gather(state)
    prefix = PrefixStore() if replica.has_slices else None
    timings, loss = run_actions(actions, ActionContext(
        stages=state.stages, plan=replica, inputs=_InputCache(replica, actions, tokens, state, prefix, bool(lift)),
        p2p=p2p, prefix=prefix,
        loss_scale=1.0 / plan.real_tokens, clock=state.clock, meter=state.meter, num_stages=schedule.num_stages,
        offload=offload, on_action=lambda index, _action: state.hooks.before_action(state.rank, step, index, actions)))
    p2p.finish()
    if state.sharded:
        finish_step(state.stages.values())     # reduce-scatter: the replicas' gradients summed
    grads = _sum_gradients(state)
    state.hooks.gradients(state.rank, step, state.params)
    verified_grads = {n: g.detach().clone() for n, g in full_tensors(grads).items()} if weights is not None else None
    state.optimizer.step()
    state.meter.sample_states()
    state.optimizer.zero_grad(set_to_none=True)
    state.ops.synchronize()
    dist.barrier()
    step_s = time.perf_counter() - t0

    action_rows, busy_s = _action_rows(state, step, replica, timings, start_mark, bool(lift))
    memory_rows = _memory_rows(state, step, plan, offload.stats.bytes_by_stage if offload is not None else {})
    problems = memory_problems(memory_rows, allow_over_limit=state.spec.allow_over_limit)
    grad_rel_err = None
    if weights is not None and verified_grads is not None:
        reference = reference_gradients(run, plan, tokens, weights, factory=state.spec.factory())
        problems += gradient_problems(state.rank, step, verified_grads, reference)
        grad_rel_err = relative_error(verified_grads, reference)
    report = StepReport(rank=state.rank, step_s=step_s, busy_s=busy_s, loss=loss, actions=action_rows,
                        memory=memory_rows, problems=problems, plan_wait_s=batch.wait_s, grad_rel_err=grad_rel_err)
    return report, plan, batch.schedule
