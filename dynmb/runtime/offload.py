"""Activation offload to host memory, the runtime side (PipeOffload-style, arXiv 2503.01328; issue 39).

``PlanMeta.offload_blocks[c] = k``: in every forward of model chunk (plan stage) ``c`` the tensors autograd saves
for backward in its leading ``k`` blocks live in host memory between that forward and its backward. One
``OffloadSession`` per rank and step (``OffloadSession.for_plan``; None where nothing is offloaded: the run is
then the plain one, bit for bit):

1. Pack (``torch.autograd.graph.saved_tensors_hooks``, entered by ``DecoderStage.block_scope`` around block
   ``i < k``'s call, a recomputed block's ``RecomputedBlock.apply`` included, so under recomputation what moves
   is what checkpointing saves: the block inputs). Returned as they are (and accounted as the meter would):
   leaves that require grad (parameters, the stage input, a slice's prefix leaves), views of the block's
   parameters, tensor subclasses, other devices. Any other saved tensor becomes a handle (its storage's record
   and its dtype, size, stride and offset); each storage once per forward: the views of a storage share one
   record (``StorageWeakRef``: found again while the storage lives).
2. D2H right after the block: each new record is copied into a host buffer (``DeviceOps.copies``: pinned on
   CUDA, on the rank's copy stream after an event of the compute stream), unless something else still holds its
   storage at that moment: a copy would then free nothing, so it stays on the device, as the stage input and the
   slices' carried keys and values in the prefix store (later slices read them) always do; the weight tape's
   references do not count (step 4). The device storage is referenced until its copy's event is done, then
   dropped (the memory frees); the host buffer until the reload's event is done, then it returns to the pool
   later packs take buffers from.
3. Reload, prefetched: ``prefetch_points`` maps each backward (``B`` / ``I``) of an offloaded (stage, mb) to the
   action before it in the rank's list (the backward itself where that is its own forward); when the rank starts
   that action it issues the pair's H2D copies into new device buffers (``reload``). The backward first makes
   the compute stream wait on those events (``before_backward``); a handle unpacked before its reload (none in a
   planned run) reloads at once and counts as ``late``.
4. Split backward (``I`` / ``W``): the weight-gradient tape's Linear inputs in offloaded blocks are offloaded
   storages; at D2H the tape's references are swapped for the records (else they would pin the device memory)
   and back to views of the reloaded storages in ``before_backward`` (``W`` reads them).

5. At most ``COPY_OUT_DEPTH`` (2) forwards' copies out in flight per rank, as the planner's memory view and the
   simulator count them (``dynmb.timing.offload``): an offloading forward first makes the compute stream wait for
   the copies out of the offloading forward ``COPY_OUT_DEPTH`` before it on this rank and drops their device
   storages (later kernels are ordered after the copies), so copies that fall behind stall compute instead of
   holding more than the plan counted.
6. A stage that recomputes leading blocks (``ModelConfig.recompute_blocks``) offloads none: a plan asking for
   both on one stage is refused in one line (``refuse_offload_with_recompute``: by ``load_plan_files`` and the
   launcher's preflight before any rank starts, again here), since the memory model counts one or the other.

CPU (host == device): the same path with synchronous copies into separate tensors (no events), so the
ordering, prefetch and freeing run in the gloo tests. The CPU memory meter (``MemoryMeter.track``) sees each
packed storage and each reloaded one: an offloaded storage counts from its pack until its D2H is done and again
from its reload on (its liveness), not in between.
"""

from __future__ import annotations

import logging
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from dynmb.core.types import Action, Plan
from dynmb.runtime.device import CopyEngine, device_ops
from dynmb.runtime.spec import refuse_offload_with_recompute
from dynmb.timing.offload import COPY_OUT_DEPTH

__all__ = ["OffloadSession", "OffloadStats", "prefetch_points", "offload_blocks_of"]

log = logging.getLogger(__name__)

Key = tuple[int, int]
"""(schedule stage, microbatch)."""


class SavedObserver(Protocol):
    """Who accounts saved storages (the CPU memory meter, ``MemoryMeter.track``)."""

    def track(self, t: torch.Tensor) -> None: ...


# ------------------------------------------------------------------ records
@dataclass(eq=False)
class _Storage:
    """One saved storage of one forward: on the device (``flat``, its bytes) or in host memory (``host``)."""

    key: Key
    nbytes: int
    ptr: int
    flat: torch.Tensor | None
    host: torch.Tensor | None = None
    kept: bool = False
    offloaded: bool = False


@dataclass(eq=False)
class _Saved:
    """What autograd holds for one offloaded saved tensor: its storage's record and how it views it."""

    storage: _Storage
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @classmethod
    def of(cls, storage: _Storage, t: torch.Tensor) -> "_Saved":
        """How ``t`` views ``storage``."""
        return cls(storage, t.dtype, tuple(int(n) for n in t.size()), tuple(int(n) for n in t.stride()),
                   int(t.storage_offset()))


@dataclass(eq=False)
class _Forward:
    """The records of one (stage, mb) forward, from its pack to its reload."""

    key: Key
    keep: Callable[[], Sequence[torch.Tensor]]
    tape: Any = None
    records: list[_Storage] = field(default_factory=list)
    new: list[_Storage] = field(default_factory=list)           # packed since the last D2H
    seen: dict[int, tuple[StorageWeakRef, _Storage]] = field(default_factory=dict)
    tape_links: list[tuple[Any, _Saved]] = field(default_factory=list)
    linked: int = 0                                                # tape calls looked at so far
    params: frozenset[int] = frozenset()
    out_events: list[Any] = field(default_factory=list)            # its copies out (D2H), block by block


@dataclass
class OffloadStats:
    """What one rank offloaded in one step."""

    bytes_by_stage: dict[int, int] = field(default_factory=dict)
    """Schedule stage -> bytes copied to host memory (each storage once per forward)."""
    storages: int = 0
    """Storages copied to host memory."""
    kept_bytes: int = 0
    """Bytes of saved storages left on the device: held elsewhere too at the block's end (the stage input, a
    slice's carried keys and values, tables every block reads, ...), where a copy would free nothing."""
    kept_storages: int = 0
    """How many storages were so left."""
    reloads: int = 0
    """Forwards whose storages were reloaded at their planned point."""
    late: int = 0
    """Storages reloaded only when autograd unpacked them (a reload not issued in time)."""
    events: list[tuple[str, Key]] = field(default_factory=list)
    """The order of ``pack``, ``d2h``, ``reload``, ``backward``, ``unpack`` and ``late`` per (stage, mb) (tests read
    it)."""


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over all of ``t``'s storage (it keeps the storage alive)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _users(flat: torch.Tensor) -> int:
    """How many tensors use ``flat``'s storage (``flat`` included; not the storage object asked through)."""
    return int(torch._C._storage_Use_Count(flat.untyped_storage()._cdata)) - 1


def _ptrs(tensors: Sequence[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}


def offload_blocks_of(plan: Plan) -> list[int]:
    """``plan.meta.offload_blocks`` checked against the plan's stages (all zeros where absent)."""
    blocks = plan.meta.get("offload_blocks")
    if blocks is None:
        return [0] * plan.num_stages
    out = [int(b) for b in blocks]
    if len(out) != plan.num_stages or min(out, default=0) < 0:
        raise ValueError(f"plan meta offload_blocks {out} must hold one count >= 0 per stage "
                         f"({plan.num_stages} stages)")
    return out


def prefetch_points(actions: Sequence[Action], offloaded: Callable[[int], bool]) -> dict[int, list[Key]]:
    """{action index: the (stage, mb) pairs whose reload starts with it}: each backward (``B`` / ``I``) of an
    offloaded stage reloads at the action before it, or at itself where that action is its own forward."""
    forward_at: dict[Key, int] = {}
    points: dict[int, list[Key]] = {}
    for i, a in enumerate(actions):
        key = (a.stage, a.mb)
        if a.op == "F":
            forward_at[key] = i
        elif a.op in ("B", "I") and offloaded(a.stage):
            at = i - 1 if i - 1 > forward_at.get(key, -1) else i
            points.setdefault(at, []).append(key)
    return points


class _HostPool:
    """Host buffers by size: a buffer given back is handed to a later pack of the same size (as a caching
    allocator does), so one given back too early is overwritten (the mutation the tests name)."""

    def __init__(self, copies: CopyEngine) -> None:
        self.copies = copies
        self.free: dict[int, list[torch.Tensor]] = {}

    def take(self, nbytes: int) -> torch.Tensor:
        bucket = self.free.get(nbytes)
        return bucket.pop() if bucket else self.copies.host_buffer(nbytes)

    def give(self, buf: torch.Tensor) -> None:
        self.free.setdefault(buf.numel(), []).append(buf)


class OffloadSession:
    """One rank's offload in one step (module docstring); ``blocks``: schedule stage -> leading blocks."""

    def __init__(self, blocks: Mapping[int, int], copies: CopyEngine, observer: SavedObserver | None = None) -> None:
        self.blocks = {s: k for s, k in blocks.items() if k > 0}
        self.copies, self.observer = copies, observer
        self.pool = _HostPool(copies)
        self.stats = OffloadStats()
        self._forwards: dict[Key, _Forward] = {}
        self._reloaded: dict[Key, tuple[list[Any], _Forward]] = {}
        self._retiring: list[tuple[Any, list[torch.Tensor], list[torch.Tensor]]] = []
        self._outs: list[list[Any]] = []          # each offloading forward's copies out, in the rank's order

    @classmethod
    def for_plan(cls, plan: Plan, stages: Mapping[int, torch.nn.Module], lift: int, device: torch.device | str,
                 observer: SavedObserver | None = None) -> "OffloadSession | None":
        """The session of ``plan`` on the rank holding ``stages`` (schedule stage -> module; ``lift``: 1 with the
        embedding stage first); None when none of them offloads a block."""
        per_plan = offload_blocks_of(plan)
        blocks = {s: per_plan[s - lift] for s in stages if s >= lift and per_plan[s - lift] > 0}
        redone = [0] * plan.num_stages
        for s in blocks:
            redone[s - lift] = int(getattr(stages[s], "recomputed_blocks", 0))
        refuse_offload_with_recompute(per_plan, redone, "the plan")
        for s, k in blocks.items():
            mod = stages[s]
            held = len(getattr(mod, "blocks", ()))
            if not hasattr(mod, "block_scope"):
                raise ValueError(f"offload_blocks asks stage {s - lift} to offload {k} block(s), but its module "
                                 f"{type(mod).__name__} has no block_scope (dynmb's own families only)")
            if k > held:
                raise ValueError(f"offload_blocks[{s - lift}] = {k}, but stage {s - lift} holds {held} block(s)")
        return cls(blocks, device_ops(device).copies(), observer) if blocks else None

    def offloads(self, stage: int) -> bool:
        return stage in self.blocks

    # --- forward: pack, D2H ------------------------------------------------------
    @contextmanager
    def forward(self, key: Key, module: torch.nn.Module, keep: Callable[[], Sequence[torch.Tensor]],
                tape: Any = None) -> Iterator[None]:
        """Around the forward of ``key`` on ``module``: its leading blocks' saved tensors are offloaded;
        ``keep()``: tensors whose storages stay on the device; ``tape``: the split backward's weight tape."""
        k = self.blocks.get(key[0], 0)
        if k == 0:
            yield
            return
        self._cap_copies_out()
        fw = _Forward(key, keep, tape)
        self._forwards[key] = fw
        self._outs.append(fw.out_events)
        blocks = list(getattr(module, "blocks").values())        # checked in for_plan

        def scope(i: int) -> Any:
            return self._block(fw, blocks[i]) if i < k else nullcontext()
        setattr(module, "block_scope", scope)
        try:
            yield
        finally:
            setattr(module, "block_scope", None)

    @contextmanager
    def _block(self, fw: _Forward, block: torch.nn.Module) -> Iterator[None]:
        fw.params = frozenset(_ptrs(list(block.parameters())))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(fw, t), self._unpack):
            yield
        self._d2h(fw)

    def _movable(self, fw: _Forward, t: torch.Tensor) -> bool:
        """Whether saved tensor ``t`` may move to host memory (module docstring, 1)."""
        return (type(t) is torch.Tensor and t.layout == torch.strided and t.device.type == self.copies.device.type
                and not (t.is_leaf and t.requires_grad) and not t.is_conj() and not t.is_neg()
                and t.untyped_storage().nbytes() > 0 and t.untyped_storage().data_ptr() not in fw.params)

    def _pack(self, fw: _Forward, t: torch.Tensor) -> Any:
        if not self._movable(fw, t):
            if self.observer is not None:
                self.observer.track(t)
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        seen = fw.seen.get(ptr)
        if seen is None or seen[0].expired():
            flat = _bytes_of(t)
            rec = _Storage(key=fw.key, nbytes=storage.nbytes(), ptr=ptr, flat=flat)
            fw.seen[ptr] = (StorageWeakRef(storage), rec)
            fw.records.append(rec)
            fw.new.append(rec)
            if self.observer is not None:
                self.observer.track(flat)
            self.stats.events.append(("pack", fw.key))
        else:
            rec = seen[1]
        return _Saved.of(rec, t)

    def _d2h(self, fw: _Forward) -> None:
        """Right after a block: copy its new storages to host buffers; swap the tape's references."""
        keep = _ptrs(list(fw.keep()))
        calls = fw.tape.calls[fw.linked:] if fw.tape is not None else []
        on_tape = Counter(call.input.untyped_storage().data_ptr() for call in calls)
        moved = 0
        for rec in fw.new:
            assert rec.flat is not None
            if rec.ptr in keep or _users(rec.flat) - on_tape[rec.ptr] > 1:
                rec.kept = True                   # held elsewhere too: a copy would free nothing
                self.stats.kept_bytes += rec.nbytes
                self.stats.kept_storages += 1
                continue
            rec.host = self.pool.take(rec.nbytes)
            event = self.copies.to_host(rec.flat, rec.host)
            self._retiring.append((event, [rec.flat], []))
            fw.out_events.append(event)
            rec.flat, rec.offloaded = None, True
            moved += 1
            stage = fw.key[0]
            self.stats.bytes_by_stage[stage] = self.stats.bytes_by_stage.get(stage, 0) + rec.nbytes
            self.stats.storages += 1
        fw.new = []
        if moved:
            self.stats.events.append(("d2h", fw.key))
        self._unlink_tape(fw)
        self.poll()

    def _unlink_tape(self, fw: _Forward) -> None:
        """The tape's Linear inputs recorded since the last block: those on offloaded storages become records
        (the tape holds the storage, so its data pointer still names the record's)."""
        calls = fw.tape.calls if fw.tape is not None else []
        for call in calls[fw.linked:]:
            t = call.input
            seen = fw.seen.get(t.untyped_storage().data_ptr())
            rec = seen[1] if seen is not None and not seen[0].expired() and seen[1].offloaded else None
            if rec is not None:
                fw.tape_links.append((call, _Saved.of(rec, t)))
                call.input = t.new_empty(0)
        fw.linked = len(calls)

    # --- backward: reload, unpack ------------------------------------------------
    def reload(self, key: Key) -> None:
        """Issue the H2D copies of ``key``'s offloaded storages (its prefetch point, ``prefetch_points``)."""
        fw = self._forwards.pop(key, None)
        if fw is None:
            return
        events = [self._reload_storage(rec) for rec in fw.records if rec.offloaded and rec.flat is None]
        self._reloaded[key] = (events, fw)
        self.stats.reloads += 1
        self.stats.events.append(("reload", key))
        self.poll()

    def _reload_storage(self, rec: _Storage) -> Any:
        assert rec.host is not None, "a storage reloaded twice"
        rec.flat, event = self.copies.to_device(rec.host)
        if self.observer is not None:
            self.observer.track(rec.flat)
        self._retiring.append((event, [], [rec.host]))      # the host buffer returns to the pool once read
        rec.host = None
        return event

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved                                     # kept as it was
        rec = saved.storage
        if rec.flat is None:                                 # not reloaded in time: at once, and counted
            self.copies.wait(self._reload_storage(rec))
            self.stats.late += 1
            self.stats.events.append(("late", rec.key))
        assert rec.flat is not None
        self.stats.events.append(("unpack", rec.key))
        view = torch.empty(0, dtype=saved.dtype, device=rec.flat.device).set_(
            rec.flat.untyped_storage(), saved.offset, saved.size, saved.stride)
        if self.observer is not None:
            self.observer.track(view)
        return view

    def before_backward(self, key: Key) -> None:
        """At the start of ``key``'s backward (``B`` / ``I``): wait for its reload (issued now if it was not) and
        give the weight tape views of the reloaded storages."""
        if key in self._forwards:
            self.reload(key)
        entry = self._reloaded.pop(key, None)
        if entry is None:
            return
        events, fw = entry
        for event in events:
            self.copies.wait(event)
        for call, saved in fw.tape_links:
            call.input = self._unpack(saved)
        fw.tape_links.clear()
        self.stats.events.append(("backward", key))

    # --- bookkeeping -------------------------------------------------------------
    def _cap_copies_out(self) -> None:
        """Before an offloading forward: the compute stream waits for the copies out of the offloading forward
        ``COPY_OUT_DEPTH`` back, whose device storages are then dropped (module docstring, 5)."""
        if len(self._outs) < COPY_OUT_DEPTH:
            return
        events = self._outs[-COPY_OUT_DEPTH]
        for event in events:
            self.copies.wait(event)
        waited = {id(e) for e in events if e is not None}
        self._retiring = [r for r in self._retiring if id(r[0]) not in waited or r[2]]
        del self._outs[:-COPY_OUT_DEPTH]

    def poll(self) -> None:
        """Drop the device storages whose D2H is done; give back the host buffers whose H2D is done."""
        keep = []
        for event, device, host in self._retiring:
            if self.copies.done(event):
                for buf in host:
                    self.pool.give(buf)
            else:
                keep.append((event, device, host))
        self._retiring = keep

    def finish(self) -> OffloadStats:
        """End of the step: every copy done, nothing left offloaded; returns the step's statistics."""
        self.copies.synchronize()
        self.poll()
        left = sorted(set(self._forwards) | set(self._reloaded))
        if left:
            raise RuntimeError(f"offload: forwards never reloaded for their backward (stage, mb): {left[:6]}")
        if self.stats.late:
            log.warning("offload: %d storage(s) reloaded late (unpacked before their prefetch)", self.stats.late)
        log.debug("offload: %d bytes in %d storages to host memory (by stage %s), %d bytes left on the device",
                  sum(self.stats.bytes_by_stage.values()), self.stats.storages, self.stats.bytes_by_stage,
                  self.stats.kept_bytes)
        self.pool.free.clear()
        return self.stats
