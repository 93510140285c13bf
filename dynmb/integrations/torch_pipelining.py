"""Run a dynmb plan and schedule with torch.distributed.pipelining's own runtime.

``run_with_torch_pipelining(stages, plan, schedule, tokens, settings, group)`` runs one step
(forwards and backwards of every microbatch; the optimizer is yours) with torch's
``PipelineStage`` and the CSV schedule runtime ``_PipelineScheduleRuntime``, although the
microbatches have different shapes (rows x padded length), which torch's stage does not allow:

1. **Checks, before any process talks.** The plan is one pipeline's (``dp == 1``; under data
   parallelism run ``plan.replica(r)`` and pass the global token count as
   ``TorchPipeliningSettings.loss_tokens``), holds no slices of long sequences, offloads no activations
   (``PlanMeta.offload_blocks``: dynmb's own runtime does, ``dynmb.runtime.offload``), and matches the
   schedule (microbatches, stages, ranks, this rank's stages); the last stage runs its forwards
   in microbatch order (torch keeps the losses in a list in forward order and reads them back by
   microbatch index). Each failure is one ``TorchPipeliningError`` line.
2. **The ranks agree** (``settings.check_digest``): sha256 of the plan's digest, the schedule
   text and the loss divisor are all-gathered over ``group``; a rank that differs from the
   group's rank 0 stops every rank with ``dynmb.runtime.checks.PlanDivergenceError``.
3. **Stages without a shape handshake.** Each dynmb stage module becomes a ``PlanShapedStage``
   (a ``PipelineStage`` subclass) built in torch's *static* metadata mode: the example input and
   output tensors have the right dtype and rank but zero rows, so torch infers nothing (no
   metadata forward, no ``send_object_list``) and its up-front receive buffers are empty. The
   subclass overrides two methods, ``get_fwd_recv_ops`` and ``get_bwd_recv_ops``: before torch
   posts the ``irecv`` of microbatch i it replaces that microbatch's buffer with a fresh tensor of
   the plan's shape, ``(mb.batch, mb.padded_len, d_model)`` (``dynmb.models.inputs.hidden_shape``; after a
   shard of an LM head split by vocabulary, ``ModelConfig.head_split``, the wider message of the
   sending stage, ``cfg.message_channels``), the shape of what the stage sends for the gradient. After the step the buffers are released (zero-size again).
4. **Inputs as keyword arguments.** torch calls ``submod(*args, **kwargs)``; a dynmb stage's
   forward is ``forward(x, inputs, *, recompute=False)``. The first stage gets the microbatch's
   token ids as ``x`` (ignored by the contract: it embeds ``inputs.input_ids``), every stage
   gets ``inputs=MicrobatchInputs`` and ``recompute=mb.recompute`` through
   ``_step_microbatches``'s per-microbatch keyword list, so the stage module runs unwrapped.
5. **Token-weighted loss, backward run.** The schedule's loss function divides the last stage's
   summed cross-entropy by the global batch's real tokens; torch's gradient scaling is off
   (``scale_grads=False``; it would divide by the microbatch count). ``_step_microbatches``
   leaves ``stage.has_backward`` unset (only ``step()`` sets it, and with it unset every ``B``
   silently does nothing), so it is set here, with ``clear_runtime_states()`` that ``step()``
   would also call. ``F``/``B`` and the split ``I``/``W`` run as torch lowers them (tested on
   gloo: GPipe, 1F1B, ZB-H1, interleaved with two stages per rank, recomputed microbatches, two
   data-parallel pipelines on subgroups; pass ``dp_group=`` there and the replicas start from the
   first one's weights);
   gradients accumulate in the stage modules' ``.grad``.

torch internals relied on (written against torch 2.13.0; ``check_torch_internals()`` lists what
is missing in the installed torch, and ``tests/test_torch_pipelining.py`` fails on it):

- ``torch.distributed.pipelining.schedules._PipelineScheduleRuntime`` (private): constructed
  with ``stages, n_microbatches, loss_fn, scale_grads``; ``_load_csv(path, format="compute_only")``
  (private) and ``_step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs)``
  (private); its per-microbatch losses are kept in forward order (behaviour, checked in 1).
- ``torch.distributed.pipelining.PipelineStage``: static mode when ``input_args`` and
  ``output_args`` are given; the overridden ``get_fwd_recv_ops`` / ``get_bwd_recv_ops``
  (public names, undocumented); ``clear_runtime_states()``; the ``has_backward`` property.
- Instance state of the stage: ``args_recv_info[mb]`` / ``grad_recv_info[mb]``, tuples of
  ``torch.distributed.pipelining.stage._RecvInfo`` (private) whose ``buffer`` is replaced and
  whose ``is_root_arg`` is read; ``_runtime_validate`` (private) is set False, because torch's
  ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` validation compares every microbatch with the zero-row
  example shapes.

**Data parallelism** (``tests/test_fsdp.py`` runs it on 4 gloo ranks, 2 x 2): pipeline ``r`` runs
``plan.replica(r)`` on its pipeline group with ``TorchPipeliningSettings(loss_tokens=plan.real_tokens)``
(the global batch's real tokens: every replica divides by the same count), and the replicas' gradients
are *summed*. With plain replicas, all-reduce ``.grad`` (SUM) over the data-parallel group yourself;
with FSDP2, ``shard_stages(stages, dp_group)`` (``dynmb.runtime.fsdp.shard_stage``: blocks, then the
stage, gradients reduced by a plain sum, which works on gloo) before the optimizer is built, and torch's
runtime gathers, reduces and reshards each step (its ``UNSHARD`` / ``RESHARD`` / ``REDUCE_GRAD``
actions). Pass ``dp_group=`` to ``run_with_torch_pipelining`` and ``loss`` is the global batch's loss,
the same on every rank; without it, it is this pipeline's share (its replica's summed CE / ``loss_tokens``).

Example, the way a torchtitan-style loop calls it (``torchrun --nproc-per-node 2 train.py``;
every rank sees the same global batch and plans it itself; ``tests/test_torch_pipelining.py``
runs this block on 2 gloo ranks)::

    import torch, torch.distributed as dist
    from dynmb import ModelConfig, Planner
    from dynmb.models.inputs import synthetic_tokens
    from dynmb.models import build_stage
    from dynmb.integrations.torch_pipelining import TorchPipeliningSettings, run_with_torch_pipelining

    dist.init_process_group("gloo")
    rank, cfg = dist.get_rank(), ModelConfig.preset("tiny")
    stage = build_stage(cfg, rank, 2, seed=0)                 # this rank's stage of the model
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-3)
    planner = Planner(model=cfg, num_stages=2, memory_limit="64MiB", schedule="1f1b")
    settings = TorchPipeliningSettings(model=cfg)
    for lengths in [[37, 5, 120, 64, 9, 300, 12, 80, 700, 3, 45, 210]]:    # your loader's global batches
        tokens = synthetic_tokens(lengths, cfg.vocab_size)     # token ids of each sequence
        step = planner.plan(lengths, method="dynamic")         # microbatches of different shapes
        out = run_with_torch_pipelining(stage, step.plan, step.schedule, tokens, settings)
        opt.step()                                             # out.loss: the same on every rank
        opt.zero_grad()
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, schedules

from dynmb.core.config import ModelConfig
from dynmb.core.contract import StageModule
from dynmb.models.inputs import hidden_shape, make_inputs
from dynmb.runtime.checkpoint import CheckpointInfo, load_checkpoint, save_checkpoint
from dynmb.runtime.checks import PlanDivergenceError
from dynmb.runtime.fsdp import shard_stage
from dynmb.runtime.replicas import sync_replicas
from dynmb.schedule import from_csv, to_csv, to_str
from dynmb.core.types import Plan, Schedule

__all__ = ["TorchPipeliningSettings", "TorchPipeliningResult", "TorchPipeliningError", "PlanShapedStage",
           "run_with_torch_pipelining", "shard_stages", "check_torch_internals", "TORCH_VERSION_WRITTEN_FOR"]

logger = logging.getLogger(__name__)

TORCH_VERSION_WRITTEN_FOR = "2.13.0"
"""The torch release whose pipelining internals (module docstring) this adapter was written against."""


class TorchPipeliningError(ValueError):
    """The plan, schedule, stages or installed torch cannot run through torch's pipelining runtime."""


@dataclass(frozen=True, kw_only=True)
class TorchPipeliningSettings:
    """How a step runs; the same on every rank."""

    model: ModelConfig
    """The model's sizes: the hidden width of the receive buffers and the inputs' checks and attention."""
    device: str = "cpu"
    """Where inputs and receive buffers live (the stage modules must already be there)."""
    hidden_dtype: torch.dtype | None = None
    """dtype of the hidden states and gradients sent between stages; None: the stage parameters' dtype."""
    loss_tokens: int | None = None
    """The loss divisor: the global batch's real tokens (all data-parallel replicas); None: ``plan.real_tokens``."""
    check_digest: bool = True
    """All-gather the plan and schedule digest over the group and refuse to run a divergent plan."""


@dataclass(frozen=True)
class TorchPipeliningResult:
    """One step's outcome on a rank."""

    loss: float
    """The token-weighted loss (sum of cross-entropy / ``loss_tokens``), the same on every rank of the group:
    with ``dp_group`` the whole global batch's; without, under data parallelism, this pipeline's share only."""
    microbatch_losses: tuple[float, ...]
    """Each microbatch's share of ``loss`` in plan order, on the rank holding the last stage; empty elsewhere."""
    digest: str
    """sha256 of the plan digest, schedule text and loss divisor the ranks agreed on."""


# --- torch internals ---------------------------------------------------------------------------
def _params(fn: Any) -> set[str]:
    return set(inspect.signature(fn).parameters)


def check_torch_internals() -> list[str]:
    """What the installed torch lacks of the internals this adapter uses (empty when all are there)."""
    from torch.distributed.pipelining import stage

    problems: list[str] = []
    runtime = getattr(schedules, "_PipelineScheduleRuntime", None)
    if runtime is None:
        return ["torch.distributed.pipelining.schedules._PipelineScheduleRuntime is gone"]
    wanted = {
        "_load_csv": {"filename", "format"},
        "_step_microbatches": {"arg_mbs", "kwarg_mbs", "target_mbs", "losses", "return_outputs"},
    }
    for name, params in wanted.items():
        fn = getattr(runtime, name, None)
        if fn is None or not params <= _params(fn):
            problems.append(f"_PipelineScheduleRuntime.{name}{tuple(sorted(params))} is gone or changed")
    base = runtime.__mro__[1]
    if not {"stages", "n_microbatches", "loss_fn", "scale_grads"} <= _params(base.__init__):
        problems.append(f"{base.__name__}(stages, n_microbatches, loss_fn, scale_grads) changed")
    if not {"input_args", "output_args", "group"} <= _params(PipelineStage.__init__):
        problems.append("PipelineStage(input_args=, output_args=, group=) changed")
    for name in ("get_fwd_recv_ops", "get_bwd_recv_ops", "clear_runtime_states"):
        if not callable(getattr(PipelineStage, name, None)):
            problems.append(f"PipelineStage.{name} is gone")
    if not isinstance(getattr(stage._PipelineStageBase, "has_backward", None), property):
        problems.append("_PipelineStageBase.has_backward is no longer a property")
    recv_info = getattr(stage, "_RecvInfo", None)
    if recv_info is None or not {"buffer", "is_root_arg"} <= _params(recv_info.__init__):
        problems.append("torch.distributed.pipelining.stage._RecvInfo(buffer, is_root_arg) is gone or changed")
    source = inspect.getsource(stage._PipelineStageBase.__init__)
    for attr in ("args_recv_info", "grad_recv_info", "_runtime_validate"):
        if f"self.{attr}" not in source:
            problems.append(f"_PipelineStageBase no longer sets self.{attr}")
    return problems


def _require_torch_internals() -> None:
    problems = check_torch_internals()
    if problems:
        raise TorchPipeliningError(
            f"torch {torch.__version__} lacks what dynmb.integrations.torch_pipelining uses (written against torch "
            f"{TORCH_VERSION_WRITTEN_FOR}): {'; '.join(problems)}")


# --- the stage ---------------------------------------------------------------------------------
class PlanShapedStage(PipelineStage):
    """torch's ``PipelineStage`` whose receive buffers take the plan's shape of each microbatch.

    ``shapes[i]``: the hidden state of microbatch i the stage receives; ``out_shapes[i]`` what it sends
    (and so the gradient it receives; None: ``shapes``); built in torch's static metadata mode with
    zero-row examples (module docstring, step 3)."""

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, device: torch.device, *,
                 shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, loss_dtype: torch.dtype,
                 group: dist.ProcessGroup | None, out_shapes: Sequence[tuple[int, ...]] | None = None) -> None:
        out_shapes = shapes if out_shapes is None else out_shapes
        empty = (0,) * (len(shapes[0]) - 1) + (shapes[0][-1],)
        hidden = torch.zeros(empty, dtype=dtype, device=device, requires_grad=True)
        sent = torch.zeros(empty[:-1] + (out_shapes[0][-1],), dtype=dtype, device=device, requires_grad=True)
        first = torch.zeros(empty[:-1], dtype=torch.int64, device=device)
        last = torch.zeros((), dtype=loss_dtype, device=device, requires_grad=True)
        super().__init__(submodule, stage_index, num_stages, device,
                         input_args=first if stage_index == 0 else hidden,
                         output_args=last if stage_index == num_stages - 1 else sent, group=group)
        self._runtime_validate = False   # DETAIL validation would compare with the zero-row examples
        self._shapes = [tuple(int(n) for n in s) for s in shapes]
        self._out_shapes = [tuple(int(n) for n in s) for s in out_shapes]
        self._dtype = dtype

    def _size_buffers(self, infos: Sequence[Any], shape: tuple[int, ...]) -> None:
        for info in infos:
            if not info.is_root_arg and info.buffer is not None:
                info.buffer = torch.empty(shape, dtype=self._dtype, device=self.device)

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        self._size_buffers(self.args_recv_info[fwd_chunk_id], self._shapes[fwd_chunk_id])
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        if self.has_backward and not self.is_last:
            self._size_buffers(self.grad_recv_info[bwd_chunk_id], self._out_shapes[bwd_chunk_id])
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def release_buffers(self) -> None:
        """Point every receive buffer at a zero-size tensor (the step's buffers are freed)."""
        for table in (self.args_recv_info, self.grad_recv_info):
            for infos in table.values():
                for info in infos:
                    if not info.is_root_arg and info.buffer is not None:
                        info.buffer = torch.empty((0,), dtype=self._dtype, device=self.device)


class _TokenWeightedLoss:
    """torch's ``loss_fn(output, target)``: the last stage's summed CE over the global real tokens."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def __call__(self, output: torch.Tensor, target: Any = None) -> torch.Tensor:
        return output / self.tokens


# --- checks ------------------------------------------------------------------------------------
def _as_schedule(schedule: Schedule | str | Path, m: int) -> Schedule:
    if isinstance(schedule, Schedule):
        return schedule
    try:
        return from_csv(schedule, num_microbatches=m)
    except (OSError, ValueError) as e:
        raise TorchPipeliningError(f"{schedule}: {e}") from None


def _check_step(stages: Sequence[nn.Module], plan: Plan, schedule: Schedule, rank: int, group_size: int,
                loss_tokens: int) -> None:
    """The one-line refusals of the module docstring's step 1 (no process talks before them)."""
    if plan.dp != 1:
        raise TorchPipeliningError(f"the plan has dp={plan.dp}: run plan.replica(r) on pipeline r and pass "
                                   f"TorchPipeliningSettings(loss_tokens=plan.real_tokens)")
    if plan.has_slices:
        raise TorchPipeliningError("the plan slices long sequences (prefix attention across microbatches); "
                                   "torch's runtime cannot carry the prefix store: plan with --oversize error/truncate")
    if any(plan.meta.get("offload_blocks") or ()):
        raise TorchPipeliningError(f"the plan offloads activations to host memory (offload_blocks "
                                   f"{list(plan.meta['offload_blocks'])}); torch's runtime cannot: plan with offload='never'")
    if loss_tokens < 1:
        raise TorchPipeliningError(f"loss_tokens must be >= 1, got {loss_tokens}")
    if schedule.num_microbatches != plan.num_microbatches:
        raise TorchPipeliningError(f"the schedule has {schedule.num_microbatches} microbatches, the plan "
                                   f"{plan.num_microbatches}")
    if schedule.num_ranks != group_size:
        raise TorchPipeliningError(f"the schedule has {schedule.num_ranks} ranks, the process group {group_size}")
    for st in stages:
        missing = [a for a in ("stage", "num_stages", "is_first", "is_last") if not hasattr(st, a)]
        if missing:
            raise TorchPipeliningError(f"{type(st).__name__} is not a dynmb stage module (no {', '.join(missing)})")
        if st.num_stages != schedule.num_stages:
            raise TorchPipeliningError(f"stage {st.stage} was built for {st.num_stages} stages, the schedule has "
                                       f"{schedule.num_stages}")
    mine = sorted(s for s, r in schedule.stage_to_rank().items() if r == rank)
    given = sorted(int(cast(StageModule, st).stage) for st in stages)
    if mine != given:
        raise TorchPipeliningError(f"rank {rank} runs stages {mine} in the schedule but was given stages {given}")
    last = [a.mb for acts in schedule.ranks for a in acts if a.stage == schedule.num_stages - 1 and a.op == "F"]
    if last != sorted(last):
        raise TorchPipeliningError(f"the last stage runs its forwards in the order {last[:8]}...: torch's runtime "
                                   f"reads its losses back by microbatch index, so they must run in order")


def _agree(plan: Plan, schedule: Schedule, loss_tokens: int, group: dist.ProcessGroup | None,
           device: torch.device, check: bool) -> str:
    """sha256 of what the ranks run; all-gathered over ``group`` when ``check``."""
    h = hashlib.sha256(f"{plan.digest()}\n{to_str(schedule)}\n{loss_tokens}".encode())
    digest = h.hexdigest()
    if not check:
        return digest
    mine = torch.tensor(list(h.digest()), dtype=torch.uint8, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    differ = [r for r, d in enumerate(gathered) if not torch.equal(d, gathered[0])]
    if differ:
        raise PlanDivergenceError(f"the plan or schedule of group rank(s) {differ} differs from group rank 0's "
                                  f"({bytes(gathered[differ[0]].cpu().tolist()).hex()[:12]} vs "
                                  f"{bytes(gathered[0].cpu().tolist()).hex()[:12]}); refusing to run a divergent plan")
    return digest


def _hidden_dtype(stages: Sequence[nn.Module], settings: TorchPipeliningSettings) -> torch.dtype:
    if settings.hidden_dtype is not None:
        return settings.hidden_dtype
    for st in stages:
        for p in st.parameters():
            if p.is_floating_point():
                return p.dtype
    raise TorchPipeliningError("no floating-point parameter to take the hidden dtype from: set hidden_dtype")


# --- data parallelism --------------------------------------------------------------------------
def shard_stages(stages: nn.Module | Sequence[nn.Module], dp_group: dist.ProcessGroup | None) -> list[nn.Module]:
    """FSDP2 over the data-parallel ``dp_group`` for this rank's stage module(s), as dynmb's own runtime
    shards them (``dynmb.runtime.fsdp.shard_stage``: each block, then the stage; gradients reduced by a
    plain sum, so the token-weighted loss needs no rescaling, on gloo too). Build the optimizer after."""
    stage_list = [stages] if isinstance(stages, nn.Module) else list(stages)
    _start_identical(stage_list, dp_group)             # replicas start identical, before their shards are cut
    return [shard_stage(st, dp_group) for st in stage_list]


# --- the step ----------------------------------------------------------------------------------
_SYNCED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
"""Stage modules that already took the first replica's weights (``_start_identical``)."""


def _start_identical(stages: Sequence[nn.Module], replica_group: dist.ProcessGroup | None) -> None:
    """Once per stage module: the first replica's weights."""
    fresh = [st for st in stages if st not in _SYNCED]
    if replica_group is not None and fresh:
        sync_replicas(fresh, replica_group)
        _SYNCED.update(fresh)


def _torch_runtime(stage_list: Sequence[nn.Module], plan: Plan, sched: Schedule, settings: TorchPipeliningSettings,
                   loss_tokens: int, group: dist.ProcessGroup | None,
                   ) -> tuple[list[PlanShapedStage], schedules._PipelineScheduleRuntime]:
    """This rank's stages wrapped as ``PlanShapedStage`` (in stage order, each told the hidden shapes it
    receives and sends per microbatch of ``plan``) and torch's runtime loaded with ``sched``."""
    device = torch.device(settings.device)
    dtype = _hidden_dtype(stage_list, settings)

    def shapes(sender: int) -> list[tuple[int, int, int]]:        # what stage ``sender`` sends, per microbatch
        return [hidden_shape(mb, settings.model, max(sender, 0), sched.num_stages) for mb in plan.microbatches]

    indices = sorted(int(cast(StageModule, st).stage) for st in stage_list)
    by_index = {int(cast(StageModule, st).stage): st for st in stage_list}
    torch_stages = [PlanShapedStage(by_index[s], s, sched.num_stages, device, shapes=shapes(s - 1),
                                    out_shapes=shapes(s), dtype=dtype,
                                    loss_dtype=torch.promote_types(dtype, torch.float32), group=group)
                    for s in indices]
    runtime = schedules._PipelineScheduleRuntime(stages=torch_stages, n_microbatches=plan.num_microbatches,
                                                 loss_fn=_TokenWeightedLoss(loss_tokens), scale_grads=False)
    with tempfile.TemporaryDirectory(prefix="dynmb-torch-pp-") as tmp:
        path = Path(tmp) / "schedule.csv"
        to_csv(sched, path)
        runtime._load_csv(str(path), format="compute_only")
    return torch_stages, runtime


def run_with_torch_pipelining(stages: nn.Module | Sequence[nn.Module], plan: Plan, schedule: Schedule | str | Path,
                              tokens: Sequence[torch.Tensor], settings: TorchPipeliningSettings,
                              group: dist.ProcessGroup | None = None, *,
                              dp_group: dist.ProcessGroup | None = None) -> TorchPipeliningResult:
    """Run one step of ``plan`` in ``schedule`` (a ``Schedule`` or a compute-only CSV path) on this
    rank's stage module(s) with torch's ``PipelineStage`` and ``_PipelineScheduleRuntime``.

    ``tokens[seq_id]``: the token ids of each sequence of the global batch (``length + 1`` ids).
    Gradients accumulate into the stage modules' ``.grad`` (token-weighted, unscaled by torch; summed
    over replicas when the stages were sharded by ``shard_stages``); collective over ``group`` (default:
    the world). ``dp_group``: under data parallelism, the ranks holding these stages in every replica: the
    loss is then the global batch's, and at the first call unsharded stages take the first replica's
    weights (``dynmb.runtime.replicas.sync_replicas``; ``shard_stages`` does it before sharding), so
    replicas start identical. See the module docstring."""
    _require_torch_internals()
    stage_list = [stages] if isinstance(stages, nn.Module) else list(stages)
    _start_identical(stage_list, dp_group)
    sched = _as_schedule(schedule, plan.num_microbatches)
    loss_tokens = int(settings.loss_tokens if settings.loss_tokens is not None else plan.real_tokens)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    _check_step(stage_list, plan, sched, rank, size, loss_tokens)
    device = torch.device(settings.device)
    digest = _agree(plan, sched, loss_tokens, group, device, settings.check_digest)

    torch_stages, runtime = _torch_runtime(stage_list, plan, sched, settings, loss_tokens, group)
    inputs = [make_inputs(mb, tokens, cfg=settings.model, device=device) for mb in plan.microbatches]
    arg_mbs = [(inp.input_ids,) for inp in inputs]
    kwarg_mbs = [{"inputs": inp, "recompute": bool(mb.recompute)} for inp, mb in zip(inputs, plan.microbatches)]
    losses: list[torch.Tensor] = []
    for st in torch_stages:
        st.has_backward = True            # _step_microbatches does not set it (step() would)
        st.clear_runtime_states()
    try:
        with torch.enable_grad():
            runtime._step_microbatches(arg_mbs, kwarg_mbs, [None] * plan.num_microbatches, losses,
                                       return_outputs=False)
    finally:
        for st in torch_stages:
            st.release_buffers()
    shares = tuple(float(x.detach()) for x in losses)
    total = torch.tensor([sum(shares)], dtype=torch.float64, device=device)
    dist.all_reduce(total, group=group)
    if dp_group is not None:
        dist.all_reduce(total, group=dp_group)     # every replica's share: the global batch's loss
    logger.debug("rank %d: ran %d microbatches of plan %s through torch's pipelining runtime", rank,
                 plan.num_microbatches, digest[:12])
    return TorchPipeliningResult(loss=float(total.item()), microbatch_losses=shares, digest=digest)


# --- checkpoints -------------------------------------------------------------------------------
__all__ += ["save_pipeline_checkpoint", "load_pipeline_checkpoint"]


def save_pipeline_checkpoint(directory: str | Path, stages: nn.Module | Sequence[nn.Module],
                             optimizer: torch.optim.Optimizer, step: int) -> Path:
    """Save this rank's stage module(s) and optimizer after ``step`` optimizer steps into ``directory`` with
    torch.distributed.checkpoint (collective over the world; every rank of every pipeline and replica calls
    it): global parameter names, the optimizer keyed by them, so it loads at any pipeline depth and dp
    (``dynmb.runtime.checkpoint``)."""
    first = stages if isinstance(stages, nn.Module) else next(iter(stages))
    info = CheckpointInfo(step=step, num_stages=int(getattr(first, "num_stages", 0)))
    return save_checkpoint(directory, stages, optimizer, info)


def load_pipeline_checkpoint(directory: str | Path, stages: nn.Module | Sequence[nn.Module],
                             optimizer: torch.optim.Optimizer) -> int:
    """Load a checkpoint (``save_pipeline_checkpoint`` or ``dynmb run --checkpoint``) into this rank's stage
    module(s) and optimizer, built for this run's layout (collective); returns the steps it was saved after."""
    return load_checkpoint(directory, stages, optimizer).step
