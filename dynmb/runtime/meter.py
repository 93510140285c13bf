"""Memory meter: the peak bytes of a pipeline rank, per stage, as DESIGN.md "Memory" defines them.

On a device whose allocator keeps statistics (CUDA, ``DeviceOps.allocator_stats``): its peak
allocated bytes between resets (``DeviceOps.peak_allocated_bytes`` / ``reset_peak``; the runtime
samples it after every action; per-stage numbers are the rank's number). No hooks are installed.
Either way a number is the rank's bytes (a rank holding several stages, interleaved chunks or the embedding
stage beside the last, counts all their states and everything held; on CPU a stage's number is the highest
at that stage's samples, so the highest of a rank's is its peak): the runtime sets the GPU's prediction beside it
(``MemoryRow.pred_rank_peak_bytes``; a plan's ``pred_peak_bytes`` is per stage).

Otherwise (CPU), by accounting (what would be allocated on a device without a caching allocator):

    states  = parameter storages + gradients (same size, counted from the start) +
              optimizer states (the optimizer's actual state tensors once it has stepped,
              else Adam's two states per parameter at its dtype, at least fp32)
              (FSDP2, ``--shard``: a DTensor counts its local shard; between ``begin_step`` and
              ``finish_step``, when ``sample_states`` recounts, the modules' parameters are the gathered
              whole weights: they and their whole gradients count, and the shards beside them; what
              ``MemoryModel.sharded`` predicts)
    held    = storages saved for backward (``torch.autograd.graph.saved_tensors_hooks``;
              each storage once, keyed by ``untyped_storage().data_ptr()``; parameters
              excluded) + the stage outputs kept until their backward (forward hooks)
    current = states + held;   peak = max over samples of current + transient

Liveness: each saved tensor / stage output gets a ``weakref.finalize``; a storage stops
counting when the last tracked tensor on it is freed (autograd releases saved tensors
during backward, the runtime drops the stage output after it). Transient (the buffers of
the op being run that are not held): at the start of a stage's backward the incoming gradient
and the input gradient being produced, plus on the stage with the LM head its logits gradient
(rows x len x vocab at the logits' dtype, at least fp32; a head shard's rows only,
``head_linear()``), each of the microbatch whose backward it is: the forward hook hangs them
on a gradient hook of that forward's own output, which fires when its backward starts (a
chain of slices runs its backwards in reverse order, so no first-in-first-out guess). Samples
are taken at the end of each forward, at the start of each backward and whenever the runtime
calls ``sample``.

Runtime interface: ``MemoryMeter(device, modules, optimizer)``; ``saving(stage)`` context
around a forward or backward; ``hold(tensors, stage)`` for what a split backward keeps;
``sample(stage)`` after actions; ``track(t)`` for what activation offload packs and reloads under its own
hooks (``dynmb.runtime.offload``; an offloaded storage counts while it is on the device: from its pack until
its copy to host memory is done, and from its reload on); ``sample_states()`` after the optimizer step; ``peaks()`` ->
{stage: bytes}; ``current_bytes``, ``peak_bytes``, ``reset_peak()``, ``reset_step()``.
``dynmb.measure.memory`` measures one microbatch through one stage with it.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Iterator, Sequence, cast

import torch

from dynmb.core.contract import StageModule
from dynmb.runtime.device import device_ops

__all__ = ["MemoryMeter", "tensor_bytes"]

def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (an FSDP2 ``DTensor``: its shard); others as they are."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def tensor_bytes(t: Any) -> int:
    """Bytes of a tensor's elements on this rank (a sharded one's shard; 0 for anything else)."""
    return int(_local(t).numel() * t.element_size()) if isinstance(t, torch.Tensor) else 0


class MemoryMeter:
    """Per-rank memory meter (CPU accounting or the device allocator's statistics)."""

    def __init__(self, device: Any = "cpu", modules: Sequence[torch.nn.Module] = (), optimizer: Any = None,
                 optimizer_kind: str = "adam") -> None:
        self.device = torch.device(device)
        self.ops = device_ops(self.device)
        self.accounting = not self.ops.allocator_stats    # count storages here (no allocator statistics)
        self.modules = list(modules)
        self.optimizer, self.optimizer_kind = optimizer, optimizer_kind
        self._home = [p for m in self.modules for p in m.parameters()]   # as the optimizer holds them (FSDP2: shards)
        self._params: set[int] = set()                 # parameter storages: never held activations
        self._live: dict[int, list[int]] = {}          # data_ptr -> [nbytes, tracked tensors]
        self._held = 0
        self._peak = 0
        self._stage_peak: dict[int, int] = {}
        self._logits: dict[int, int] = {}              # per stage: logits bytes of the forward running there
        self._in_backward = False                      # a recomputing backward reruns the head: not a forward
        self._hooks = []
        for m in self.modules if self.accounting else ():
            st = int(cast(StageModule, m).stage)
            self._hooks.append(m.register_forward_hook(self._fwd_hook(st)))
            for blk in getattr(m, "blocks", {}).values():   # also inside a recomputing backward
                self._hooks.append(blk.register_forward_hook(self._block_hook(st)))
            find = getattr(m, "head_linear", None)
            head = find() if callable(find) else getattr(m, "lm_head", None)
            if isinstance(head, torch.nn.Module):
                self._hooks.append(head.register_forward_hook(self._head_hook(st)))
        self.state_bytes = self._state_bytes()

    # --- accounting -----------------------------------------------------------
    def _state_bytes(self) -> int:
        """The states now (module docstring); FSDP2 inside a step (``dynmb.runtime.fsdp.begin_step``): the modules'
        parameters are the gathered whole weights, their gradients whole too, the shards held beside them."""
        params = [p for m in self.modules for p in m.parameters()]
        self._params = {_local(p).untyped_storage().data_ptr() for p in params + self._home}
        n = sum(tensor_bytes(p) for p in params)
        now = {id(p) for p in params}
        beside = sum(tensor_bytes(p) for p in self._home if id(p) not in now)   # FSDP2's shards while gathered
        opt = 0
        if self.optimizer is not None and self.optimizer.state:
            opt = sum(tensor_bytes(v) for s in self.optimizer.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor) and v.dim() > 0)
        elif self.optimizer_kind == "adam":
            opt = sum(2 * max(4, p.element_size()) * _local(p).numel() for p in self._home)
        return 2 * n + beside + opt

    def _track(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type != self.device.type:
            return
        st = t.untyped_storage()
        ptr, nb = st.data_ptr(), st.nbytes()
        if nb == 0 or ptr in self._params:
            return
        ent = self._live.get(ptr)
        if ent is None:
            self._live[ptr] = [nb, 1]
            self._held += nb
        else:
            ent[1] += 1
        weakref.finalize(t, self._release, ptr)

    def _release(self, ptr: int) -> None:
        ent = self._live.get(ptr)
        if ent is None:
            return
        ent[1] -= 1
        if ent[1] == 0:
            del self._live[ptr]
            self._held -= ent[0]

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._track(t)
        return t

    def _note(self, stage: int, extra: int = 0) -> None:
        v = self.current_bytes + extra
        self._peak = max(self._peak, v)
        self._stage_peak[stage] = max(self._stage_peak.get(stage, 0), v)

    def _fwd_hook(self, stage: int):
        def hook(mod, args, out):
            x = args[0] if args else None
            charge = self._logits.pop(stage, 0)    # this forward's logits: their gradient, and its input's
            charge += tensor_bytes(x) if isinstance(x, torch.Tensor) and x.requires_grad else 0
            if isinstance(out, torch.Tensor) and out.requires_grad:
                self._track(out)
                out.register_hook(self._bwd_start_hook(stage, charge))
            self._note(stage)
        return hook

    def _block_hook(self, stage: int):
        def hook(mod, args, out):
            self._note(stage)
        return hook

    def _head_hook(self, stage: int):
        def hook(mod, args, out):
            if isinstance(out, torch.Tensor):
                if not self._in_backward:
                    self._logits[stage] = self._logits.get(stage, 0) + out.numel() * max(4, out.element_size())
                self._note(stage, tensor_bytes(out))
        return hook

    def _bwd_start_hook(self, stage: int, charge: int):
        """The gradient hook of one forward's output: its backward starts; ``charge``: that forward's input and
        logits bytes (their gradients are made in this backward)."""
        def hook(grad):
            self._in_backward = True
            self._note(stage, charge + tensor_bytes(grad))
            return None
        return hook

    # --- runtime interface ----------------------------------------------------
    @property
    def current_bytes(self) -> int:
        allocated = self.ops.allocated_bytes()
        return self.state_bytes + self._held if allocated is None else allocated

    @property
    def peak_bytes(self) -> int:
        peak = self.ops.peak_allocated_bytes()
        return max(self._peak, self.current_bytes) if peak is None else peak

    def reset_peak(self) -> None:
        """Restart the peak from the current bytes (and the allocator's peak, where it keeps one)."""
        self.ops.reset_peak()
        self._peak = self.current_bytes
        self._stage_peak = {}

    reset_step = reset_peak

    @contextmanager
    def saving(self, stage: int = 0) -> Iterator["MemoryMeter"]:
        """Context around a forward of ``stage``: its saved tensors are accounted."""
        if not self.accounting:
            yield self
            return
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self
        self._note(stage)

    def track(self, t: torch.Tensor) -> None:
        """Account saved tensor ``t``'s storage as held while ``t`` lives (each storage once): what activation
        offload (``dynmb.runtime.offload``) packs under its own saved-tensor hooks and what it reloads. An
        offloaded storage so counts until its copy to host memory is done and again from its reload on."""
        if self.accounting:
            self._track(t)

    def hold(self, tensors: Sequence[torch.Tensor], stage: int = 0) -> None:
        """Account ``tensors`` as held until they are freed (each storage once), then sample:
        what a split backward keeps from ``I`` to ``W`` (layer inputs and output gradients)."""
        if self.accounting:
            for t in tensors:
                self._track(t)
        self.sample(stage)

    def sample(self, stage: int = 0) -> None:
        self._in_backward = False
        v = self.ops.peak_allocated_bytes()
        if v is not None:
            self._stage_peak[stage] = max(self._stage_peak.get(stage, 0), v)
            self._peak = max(self._peak, v)
        else:
            self._note(stage)

    def sample_states(self) -> None:
        """Recount the states: after an optimizer step (its real state tensors now exist), and under FSDP2 after
        ``begin_step`` (the gathered weights and their whole gradients, the shards beside them)."""
        if self.accounting:
            self.state_bytes = self._state_bytes()
        for stage in self._stages():
            self.sample(stage)

    def peaks(self) -> dict[int, int]:
        """{stage: peak bytes} for this rank's stages (with allocator statistics the rank's peak for each)."""
        stages = self._stages() or [0]
        if not self.accounting:
            v = self.peak_bytes
            return {s: v for s in stages}
        return {s: int(self._stage_peak.get(s, self.current_bytes)) for s in stages}

    def _stages(self) -> list[int]:
        return [int(cast(StageModule, m).stage) for m in self.modules]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
