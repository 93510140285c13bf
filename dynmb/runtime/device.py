"""The device seam: every device-specific call of the runtime and the measurements goes through here.

``device_ops(device)`` chooses, once per device, one of two implementations of ``DeviceOps``:

- ``CpuOps``: clock marks are ``time.perf_counter`` (and ``time.thread_time`` for the thread's CPU
  seconds); synchronising, resetting peaks and emptying caches do nothing; there are no allocator
  statistics (``allocator_stats`` False: the memory meter counts storages itself).
- ``CudaOps``: clock marks are CUDA events (``seconds`` reads them after a synchronisation);
  ``synchronize``, ``empty_cache`` and the allocator's counters (``memory_allocated``,
  ``max_memory_allocated``, ``max_memory_reserved``, ``reset_peak_memory_stats``) of that
  device.

``DeviceOps.copies()`` is the copy engine of activation offload (``dynmb.runtime.offload``): ``HostCopies``
(synchronous copies into separate host tensors) or ``CudaCopies`` (pinned host buffers, one copy stream, events).

A clock (``Clock``: ``mark``, ``seconds``, ``cpu``) is what the action interpreter times with;
every ``DeviceOps`` is one. ``timer(clock)`` times one call for the profiler: ``(out, seconds by
the clock, wall seconds)``, where the clock is ``"event"`` (CUDA events), ``"thread"`` (the
calling thread's CPU time) or ``"wall"``. ``bind_device(kind, local_rank)`` is a worker's device
(CUDA: checks the GPU count and makes it the current device); ``cuda_available()`` answers
without a device. Communication code takes its device as an argument and calls none of this.

Adding a device kind: one ``DeviceOps`` subclass (its clock, allocator counters and ``bind``) and
one entry in ``_KINDS``; ``tests/test_device.py`` shows what each must do.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol, TypeVar

import torch

__all__ = ["Clock", "DeviceOps", "CpuOps", "CudaOps", "HostCopies", "CudaCopies", "CopyEngine", "device_ops",
           "bind_device", "cuda_available"]

T = TypeVar("T")


class Clock(Protocol):
    """Marks in time and the seconds between two of them (what the interpreter times with)."""

    def mark(self) -> Any: ...

    def seconds(self, a: Any, b: Any) -> float: ...

    def cpu(self) -> float | None: ...


class DeviceOps:
    """Device-specific operations on one ``torch.device`` (see the module doc)."""

    allocator_stats = False
    """Whether the device's allocator reports allocated and peak bytes (else they are None)."""
    default_clock = "thread"
    """The clock ``dynmb profile`` times with by default (single-threaded)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def copies(self) -> "CopyEngine":
        """The copy engine of activation offload (``dynmb.runtime.offload``): synchronous copies by default."""
        return HostCopies(self.device)

    # --- clock ------------------------------------------------------------
    def mark(self) -> Any:
        return time.perf_counter()

    def seconds(self, a: Any, b: Any) -> float:
        """Seconds from mark ``a`` to mark ``b`` (after ``synchronize`` on an asynchronous device)."""
        return b - a

    def cpu(self) -> float | None:
        """This thread's CPU seconds (``time.thread_time``); None where the thread only queues work."""
        return time.thread_time()

    def timer(self, clock: str) -> Callable[[Callable[[], T]], tuple[T, float, float]]:
        """``run(fn) -> (fn(), seconds by clock, wall seconds)``; ``clock`` "thread" or "wall"."""
        cpu = time.thread_time if clock == "thread" else time.perf_counter

        def run(fn: Callable[[], T]) -> tuple[T, float, float]:
            w, c = time.perf_counter(), cpu()
            out = fn()
            c1, w1 = cpu(), time.perf_counter()
            return out, c1 - c, w1 - w
        return run

    # --- memory and queues ------------------------------------------------
    def synchronize(self) -> None:
        """Wait for the device's queued work."""

    def allocated_bytes(self) -> int | None:
        """Bytes the allocator holds for tensors now (None without allocator statistics)."""
        return None

    def peak_allocated_bytes(self) -> int | None:
        """The allocator's highest ``allocated_bytes`` since the last ``reset_peak``."""
        return None

    def peak_reserved_bytes(self) -> int | None:
        """The allocator's highest reserved (cached) bytes since the last ``reset_peak``."""
        return None

    def reset_peak(self) -> None:
        """Restart the allocator's peak counters."""

    def empty_cache(self) -> None:
        """Give the allocator's cached free blocks back."""

    # --- identity ---------------------------------------------------------
    def available(self) -> bool:
        """Whether this host has the device."""
        return True

    def name(self) -> str:
        """What a samples table records as the device (``cpu`` or the GPU's name)."""
        return self.device.type

    def group_device(self) -> torch.device | None:
        """The ``device_id`` a process group binds to (None: not bound)."""
        return None

    @classmethod
    def bind(cls, local_rank: int) -> torch.device:
        """The device of the worker with this local rank, made current where that means something."""
        return torch.device("cpu")


class HostCopies:
    """CPU: host == device; copies are synchronous into separate tensors, events are None."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> Any:
        dst.copy_(src)
        return None

    def to_device(self, src: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return torch.empty(src.numel(), dtype=torch.uint8, device=self.device).copy_(src), None

    def wait(self, event: Any) -> None:
        return None

    def done(self, event: Any) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CudaCopies:
    """CUDA: pinned host buffers and one copy stream per device and process; events order the copies after the
    compute stream's work (``to_host`` / ``to_device``) and the compute stream after a copy (``wait``)."""

    _streams: dict[int, Any] = {}

    def __init__(self, device: torch.device) -> None:
        self.device = device
        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
        if index not in CudaCopies._streams:
            CudaCopies._streams[index] = torch.cuda.Stream(device=device)
        self.stream = CudaCopies._streams[index]

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _after_compute(self) -> None:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(ready)

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> Any:
        return self._copy(src, dst)

    def to_device(self, src: torch.Tensor) -> tuple[torch.Tensor, Any]:
        dst = torch.empty(src.numel(), dtype=torch.uint8, device=self.device)   # on the compute stream's pool
        return dst, self._copy(src, dst)

    def _copy(self, src: torch.Tensor, dst: torch.Tensor) -> Any:
        """``dst <- src`` on the copy stream after the compute stream's work so far; the copy's done event."""
        self._after_compute()
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def wait(self, event: Any) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def done(self, event: Any) -> bool:
        return event is None or bool(event.query())

    def synchronize(self) -> None:
        self.stream.synchronize()


CopyEngine = HostCopies | CudaCopies
"""A device's copies to host memory and back (``DeviceOps.copies``; ``dynmb.runtime.offload``)."""


class CpuOps(DeviceOps):
    """The host CPU: wall and thread clocks, no allocator statistics."""


class CudaOps(DeviceOps):
    """A CUDA device: event clock, the caching allocator's statistics."""

    def copies(self) -> CopyEngine:
        return CudaCopies(self.device)

    allocator_stats = True
    default_clock = "event"

    def mark(self) -> Any:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3

    def cpu(self) -> float | None:
        return None

    def timer(self, clock: str) -> Callable[[Callable[[], T]], tuple[T, float, float]]:
        """CUDA events around the call whatever ``clock`` says (the host thread only queues kernels)."""
        def run(fn: Callable[[], T]) -> tuple[T, float, float]:
            w = time.perf_counter()
            a = self.mark()
            out = fn()
            b = self.mark()
            b.synchronize()
            return out, self.seconds(a, b), time.perf_counter() - w
        return run

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def allocated_bytes(self) -> int | None:
        return int(torch.cuda.memory_allocated(self.device))

    def peak_allocated_bytes(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self.device))

    def peak_reserved_bytes(self) -> int | None:
        return int(torch.cuda.max_memory_reserved(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def available(self) -> bool:
        return torch.cuda.is_available()

    def name(self) -> str:
        return torch.cuda.get_device_name(self.device)

    def group_device(self) -> torch.device | None:
        return self.device

    @classmethod
    def bind(cls, local_rank: int) -> torch.device:
        if not torch.cuda.is_available():
            raise RuntimeError("device cuda asked for, but torch sees no CUDA GPU on this host")
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"local rank {local_rank} needs GPU {local_rank}, but only "
                               f"{torch.cuda.device_count()} visible on this host: use fewer ranks per node (e.g. "
                               "--virtual to put several stages on one rank) or set CUDA_VISIBLE_DEVICES")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)


_KINDS: dict[str, type[DeviceOps]] = {"cpu": CpuOps, "cuda": CudaOps}


def _kind(name: str) -> type[DeviceOps]:
    kind = _KINDS.get(name)
    if kind is None:
        raise ValueError(f"device {name!r} is not supported (devices: {', '.join(_KINDS)})")
    return kind


def device_ops(device: torch.device | str) -> DeviceOps:
    """The ``DeviceOps`` of ``device`` (``ValueError`` naming the kinds for another device type)."""
    dev = torch.device(device)
    return _kind(dev.type)(dev)


def cuda_available() -> bool:
    """Whether torch sees a CUDA GPU on this host."""
    return CudaOps(torch.device("cuda")).available()


def bind_device(kind: str, local_rank: int = 0) -> torch.device:
    """A worker's device: ``cpu``, or CUDA GPU ``local_rank`` made the current device (one-line
    ``RuntimeError`` when torch sees no GPU, or fewer than the local ranks)."""
    return _kind(kind).bind(local_rank)
