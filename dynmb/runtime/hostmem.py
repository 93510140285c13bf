"""Keep freed host memory in the process, so a CPU stage does not page-fault on every microbatch.

glibc's malloc serves big blocks (over 128 KiB, rising to at most 32 MiB) with a fresh
``mmap`` and gives them back to the kernel on ``free``; the top of the heap is trimmed the
same way. A CPU pipeline stage allocates activations of tens of MiB per microbatch, so every
forward and backward touches fresh pages: the kernel faults and zeroes each 4 KiB page. On
the development machine that was up to 137k minor faults and +1.2 s on a 0.9 s forward of
22 x 575 tokens, so big microbatches ran up to 3x the cost model's prediction and the
simulator's step time was 20-30% short (``studies/prediction/pred_error.py`` measures it per action).

``retain_freed_memory()`` sets, through ``mallopt``: no ``mmap`` for allocations
(``M_MMAP_MAX = 0``) and no trimming (``M_TRIM_THRESHOLD`` at its maximum), so freed blocks
stay in the heap and the next microbatch reuses pages that are already mapped: after the
first (warm-up) step a stage stops faulting, as a GPU caching allocator stops calling
``cudaMalloc``. The process' resident memory then stays at its high-water mark, as a
caching allocator's reserved memory does; the memory meter's accounting is unchanged.

It is a no-op off glibc (macOS, musl) and when ``DYNMB_HOST_MALLOC=system`` is set (to
measure the difference). The runtime workers and ``dynmb profile`` call it at start, so the
cost model is measured under the same allocator behaviour it predicts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

import torch

__all__ = ["ENV", "retain_freed_memory", "host_malloc_mode", "prefault"]

ENV = "DYNMB_HOST_MALLOC"
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_INT_MAX = 2**31 - 1
_applied: bool | None = None


def host_malloc_mode() -> str:
    """``retain`` (the default) or ``system`` (leave glibc's defaults), from ``$DYNMB_HOST_MALLOC``."""
    mode = os.environ.get(ENV, "retain").strip().lower() or "retain"
    if mode not in ("retain", "system"):
        raise ValueError(f"{ENV}={mode!r}: expected 'retain' or 'system'")
    return mode


def retain_freed_memory() -> bool:
    """Apply the ``retain`` policy to this process once; True if glibc accepted it."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if host_malloc_mode() == "system" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _ = libc.gnu_get_libc_version  # glibc only: musl's mallopt accepts and ignores everything
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _INT_MAX))
    return _applied


def prefault(limit_bytes: int | None, *, local_ranks: int = 1, headroom: float = 2.0) -> int:
    """Map and touch ``headroom x limit_bytes`` of heap once, then free it into the (untrimmed) heap.

    Under ``retain`` the heap's high-water mark would otherwise grow over the first steps,
    each new page faulting inside some forward or backward; touching the rank's memory budget
    up front moves that cost to set-up, as reserving device memory does. The heap needs more
    than the budget: its free blocks fragment, and the accounting leaves out short-lived
    buffers such as the loss' log-softmax. With the budget alone, fixed-size microbatches
    still faulted 50k pages in the step after warm-up; with 2x none did. Capped at half the
    host's memory shared by ``local_ranks``; returns the bytes touched (0 when the policy is
    off or there is no limit)."""
    if not limit_bytes or limit_bytes <= 0 or not retain_freed_memory():
        return 0
    try:
        phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0
    n = int(min(headroom * limit_bytes, phys // (2 * max(1, local_ranks))))
    buf = torch.empty(n, dtype=torch.uint8)
    buf.fill_(0)          # fault every page in
    del buf
    return n
