"""Memory meter: the peak bytes of a pipeline rank, per stage, as DESIGN.md "Memory" defines them.

On CUDA: ``torch.cuda.max_memory_allocated(device)`` between ``reset_peak_memory_stats``
(the runtime samples it after every action; per-stage numbers are the rank's number).

On CPU, by accounting (what would be allocated on a device without a caching allocator):

    states  = parameter storages + gradients (same size, counted from the start) +
              optimizer states (the optimizer's actual state tensors once it has stepped,
              else Adam's two fp32 states per parameter)
    held    = storages saved for backward (``torch.autograd.graph.saved_tensors_hooks``;
              each storage once, keyed by ``untyped_storage().data_ptr()``; parameters
              excluded) + the stage outputs kept until their backward (forward hooks)
    current = states + held;   peak = max over samples of current + transient

Liveness: each saved tensor / stage output gets a ``weakref.finalize``; a storage stops
counting when the last tracked tensor on it is freed (autograd releases saved tensors
during backward, the runtime drops the stage output after it). Transient (the buffers of
the op being run that are not held): at the start of a stage's backward (module
backward pre-hook) the incoming gradient and the input gradient being produced, plus on
the stage with the LM head its logits gradient (rows x len x vocab, fp32). Samples are
taken at the end of each forward, at the start of each backward and whenever the
runtime calls ``sample``.

Runtime interface: ``MemoryMeter(device, modules, optimizer)``; ``saving(stage)`` /
``start_forward(mb)`` context around a forward; ``end_backward(mb)`` / ``sample(stage)``
after actions; ``sample_states()`` after the optimizer step; ``peaks()`` ->
{stage: bytes}; ``current_bytes``, ``peak_bytes``, ``reset_peak()``, ``reset_step()``.
``measure_stage_memory`` measures one microbatch through one stage.
"""

from __future__ import annotations

import warnings
import weakref
from collections import deque
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch

from dynmb.models import build_stage, full_microbatch, make_inputs, synthetic_tokens, torch_dtype

__all__ = ["MemoryMeter", "measure_stage_memory", "measure_grid"]

# the first stage's inputs need no gradient; its backward pre-hook still fires (on outputs)
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size()) if isinstance(t, torch.Tensor) else 0


class MemoryMeter:
    """Per-rank memory meter (CPU accounting or CUDA allocator statistics)."""

    def __init__(self, device: Any = "cpu", modules: Sequence[torch.nn.Module] = (), optimizer: Any = None,
                 optimizer_kind: str = "adam") -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.modules = list(modules)
        self.optimizer, self.optimizer_kind = optimizer, optimizer_kind
        self._params = {p.untyped_storage().data_ptr() for m in self.modules for p in m.parameters()}
        self._live: dict[int, list[int]] = {}          # data_ptr -> [nbytes, tracked tensors]
        self._held = 0
        self._peak = 0
        self._stage_peak: dict[int, int] = {}
        self._stage = 0
        self._logits: dict[int, deque] = {}            # per stage, FIFO over microbatches
        self._in_backward = False                      # a recomputing backward reruns the head: not a forward
        self._inputs: dict[int, deque] = {}
        self._hooks = []
        for m in self.modules:
            st = int(getattr(m, "stage", 0))
            self._hooks.append(m.register_forward_hook(self._fwd_hook(st)))
            self._hooks.append(m.register_full_backward_pre_hook(self._bwd_pre_hook(st)))
            for blk in getattr(m, "blocks", {}).values():   # also inside a recomputing backward
                self._hooks.append(blk.register_forward_hook(self._block_hook(st)))
            head = getattr(m, "lm_head", None)
            if isinstance(head, torch.nn.Module):
                self._hooks.append(head.register_forward_hook(self._head_hook(st)))
        self.state_bytes = self._state_bytes()

    # --- accounting -----------------------------------------------------------
    def _state_bytes(self) -> int:
        params = [p for m in self.modules for p in m.parameters()]
        n = sum(_nbytes(p) for p in params)
        opt = 0
        if self.optimizer is not None and getattr(self.optimizer, "state", None):
            opt = sum(_nbytes(v) for s in self.optimizer.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor) and v.dim() > 0)
        elif self.optimizer_kind == "adam":
            opt = sum(8 * p.numel() for p in params)
        return 2 * n + opt

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
            if not self.cuda:
                x = args[0] if args else None
                self._inputs.setdefault(stage, deque()).append(
                    _nbytes(x) if isinstance(x, torch.Tensor) and x.requires_grad else 0)
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    self._track(out)
                self._note(stage)
        return hook

    def _block_hook(self, stage: int):
        def hook(mod, args, out):
            if not self.cuda:
                self._note(stage)
        return hook

    def _head_hook(self, stage: int):
        def hook(mod, args, out):
            if not self.cuda and isinstance(out, torch.Tensor):
                if not self._in_backward:
                    self._logits.setdefault(stage, deque()).append(out.numel() * 4)
                self._note(stage, _nbytes(out))
        return hook

    def _bwd_pre_hook(self, stage: int):
        def hook(mod, grad_output):
            self._in_backward = True
            if not self.cuda:
                extra = sum(_nbytes(g) for g in grad_output)
                for q in (self._logits.get(stage), self._inputs.get(stage)):
                    extra += q.popleft() if q else 0
                self._note(stage, extra)
            return None
        return hook

    # --- runtime interface ----------------------------------------------------
    @property
    def current_bytes(self) -> int:
        if self.cuda:
            return int(torch.cuda.memory_allocated(self.device))
        return self.state_bytes + self._held

    @property
    def peak_bytes(self) -> int:
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device))
        return max(self._peak, self.current_bytes)

    def reset_peak(self) -> None:
        """Restart the peak from the current bytes (CUDA: reset the allocator's peak)."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self._peak = self.current_bytes
        self._stage_peak = {}

    reset_step = reset_peak

    @contextmanager
    def saving(self, stage: int = 0) -> Iterator["MemoryMeter"]:
        """Context around a forward of ``stage``: its saved tensors are accounted."""
        self._stage = stage
        if self.cuda:
            yield self
            return
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self
        self._note(stage)

    def hold(self, tensors: Sequence[torch.Tensor], stage: int = 0) -> None:
        """Account ``tensors`` as held until they are freed (each storage once), then sample:
        what a split backward keeps from ``I`` to ``W`` (layer inputs and output gradients)."""
        if not self.cuda:
            for t in tensors:
                self._track(t)
        self.sample(stage)

    def start_forward(self, mb: int = 0, stage: int | None = None):
        return self.saving(self._stage if stage is None else stage)

    def end_backward(self, mb: int = 0, stage: int | None = None) -> None:
        self.sample(self._stage if stage is None else stage)

    def sample(self, stage: int = 0) -> None:
        self._in_backward = False
        if self.cuda:
            v = int(torch.cuda.max_memory_allocated(self.device))
            self._stage_peak[stage] = max(self._stage_peak.get(stage, 0), v)
            self._peak = max(self._peak, v)
        else:
            self._note(stage)

    def sample_states(self) -> None:
        """Recount the states after an optimizer step (its real state tensors now exist)."""
        if not self.cuda:
            self.state_bytes = self._state_bytes()
        for m in self.modules:
            self.sample(int(getattr(m, "stage", 0)))

    def peaks(self) -> dict[int, int]:
        """{stage: peak bytes} for this rank's stages (on CUDA the rank's peak for each)."""
        stages = [int(getattr(m, "stage", 0)) for m in self.modules] or [0]
        if self.cuda:
            v = self.peak_bytes
            return {s: v for s in stages}
        return {s: int(self._stage_peak.get(s, self.current_bytes)) for s in stages}

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def measure_stage_memory(model_cfg: Any, num_stages: int, stage: int, rows: int, padded_len: int,
                         packed: bool = False, device: Any = "cpu", seed: int = 0,
                         docs_per_row: int | None = None) -> dict[str, int]:
    """One microbatch (rows x padded_len) through one stage, forward then backward, with
    Adam states; attention as ``model_cfg.attention`` says. Rows are full: one document
    each, ``docs_per_row`` documents splitting the row as evenly as possible
    (``full_microbatch``), or two with ``packed``. Returns ``state_bytes`` (params + grads
    + optimizer), ``act_bytes`` (held after the forward) and ``peak_bytes``."""
    dev = torch.device(device)
    b, s = int(rows), int(padded_len)
    docs = docs_per_row if docs_per_row is not None else 2 if packed and s >= 2 else 1
    mb = full_microbatch(b, s, docs)
    lens = mb.lengths
    mod = build_stage(model_cfg, stage, num_stages, seed, device=dev)
    inputs = make_inputs(mb, synthetic_tokens(lens, model_cfg.vocab_size, seed), cfg=model_cfg, device=dev)
    x = None
    if stage > 0:
        x = torch.randn(b, s, model_cfg.d_model, dtype=torch_dtype(model_cfg), device=dev, requires_grad=True)
    if dev.type == "cuda":
        for p in mod.parameters():
            p.grad = torch.zeros_like(p)
        opt_states = [torch.zeros(p.shape, dtype=torch.float32, device=dev) for p in mod.parameters() for _ in range(2)]
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        # the received hidden state and the microbatch's inputs (a dense b x s x s attention
        # mask above all) are held by the runtime from the forward to the backward: activation bytes
        state = base - (_nbytes(x) if x is not None else 0) - sum(_nbytes(t) for t in inputs.tensors())
        out = mod(x, inputs)
        torch.cuda.synchronize(dev)
        act = torch.cuda.memory_allocated(dev) - state
        out.backward(torch.ones_like(out) if out.dim() else None)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        del opt_states
        return {"state_bytes": int(state), "act_bytes": int(act), "peak_bytes": int(peak)}
    meter = MemoryMeter(dev, [mod], optimizer=None, optimizer_kind="adam")
    try:
        meter.reset_peak()
        with meter.saving(stage):
            out = mod(x, inputs)
        act = meter.current_bytes - meter.state_bytes
        grad = torch.ones_like(out) if out.dim() else None
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            out.backward(grad)
        del out, grad
        meter.sample(stage)
        return {"state_bytes": int(meter.state_bytes), "act_bytes": int(act), "peak_bytes": int(meter.peak_bytes)}
    finally:
        meter.close()


def measure_grid(model_cfg: Any, num_stages: int, rows: Sequence[int], padded_lens: Sequence[int],
                 device: Any = "cpu", packed: bool = False) -> list[dict[str, Any]]:
    """``measure_stage_memory`` for every stage and (rows, padded_len) of the grid: tidy rows
    (stage, rows, padded_len, packed, device, state_bytes, act_bytes, peak_bytes)."""
    out = []
    for st in range(num_stages):
        for b in rows:
            for s in padded_lens:
                r = measure_stage_memory(model_cfg, num_stages, st, b, s, packed=packed, device=device)
                out.append({"stage": st, "rows": int(b), "padded_len": int(s), "packed": packed,
                            "device": str(device), **r})
    return out
