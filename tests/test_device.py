"""The device seam (``dynmb.runtime.device``): its CPU implementation here, its CUDA one where a GPU is.

Also a static check: no module of the runtime or of ``dynmb.measure`` other than the seam calls
``torch.cuda`` (DESIGN style rule 5: communication code makes no CUDA call)."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest
import torch

import dynmb
from dynmb.core.config import model_config
from dynmb.measure.grid import synthetic_microbatch
from dynmb.measure.profiler import ProfileSettings, profile
from dynmb.models import build_stage, make_inputs, synthetic_tokens
from dynmb.runtime.device import CpuOps, CudaOps, bind_device, device_ops
from dynmb.runtime.meter import MemoryMeter

ROOT = Path(dynmb.__file__).resolve().parent
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _spin(seconds: float) -> int:
    """Busy work until this thread has used ``seconds`` of CPU time (however loaded the host)."""
    end, n = time.thread_time() + seconds, 0
    while time.thread_time() < end:
        n += 1
    return n


def test_cpu_ops_are_chosen_once_from_the_device():
    ops = device_ops("cpu")
    assert isinstance(ops, CpuOps) and ops.device == torch.device("cpu")
    assert type(device_ops(torch.device("cuda", 0))) is CudaOps       # chosen without touching a GPU
    with pytest.raises(ValueError, match="device 'meta' is not supported"):
        device_ops("meta")


def test_cpu_clock_marks_and_thread_time():
    ops = device_ops("cpu")
    a, cpu0 = ops.mark(), ops.cpu()
    _spin(0.05)
    b, cpu1 = ops.mark(), ops.cpu()
    assert 0.05 <= ops.seconds(a, b) < 5.0
    assert cpu0 is not None and cpu1 is not None and cpu1 > cpu0


def test_cpu_timer_thread_clock_ignores_sleep_but_wall_does_not():
    ops = device_ops("cpu")
    out, thread_s, wall_s = ops.timer("thread")(lambda: time.sleep(0.1) or 7)
    assert out == 7 and wall_s >= 0.1 and thread_s < 0.05 < wall_s
    _, wall_clock_s, wall2_s = ops.timer("wall")(lambda: time.sleep(0.1))
    assert wall_clock_s >= 0.1 and wall2_s >= 0.1
    _, busy_s, busy_wall_s = ops.timer("thread")(lambda: _spin(0.05))
    assert 0.05 <= busy_s <= busy_wall_s + 1e-3


def test_cpu_has_no_allocator_statistics_and_noop_queue_calls():
    ops = device_ops("cpu")
    assert not ops.allocator_stats and ops.default_clock == "thread" and ops.name() == "cpu" and ops.available()
    assert (ops.allocated_bytes(), ops.peak_allocated_bytes(), ops.peak_reserved_bytes()) == (None, None, None)
    ops.synchronize()
    ops.reset_peak()
    ops.empty_cache()
    assert ops.group_device() is None and bind_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device 'tpu' is not supported"):
        bind_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")
def test_cuda_without_a_gpu_is_one_line_error():
    assert not device_ops("cuda").available()
    with pytest.raises(RuntimeError, match="torch sees no CUDA GPU on this host"):
        bind_device("cuda", 0)
    with pytest.raises(ValueError, match="device cuda requested but torch sees none on this host"):
        profile(model_config("tiny"), 2, device="cuda", grid=[(1, 32, 1)], repeats=1)
    with pytest.raises(ValueError, match="device 'meta' is not supported"):
        ProfileSettings(device="meta")


def test_meter_accounts_on_cpu_through_the_seam():
    """Without allocator statistics the meter counts storages: a forward raises its current bytes
    above the states, and the saved activations are released by the backward."""
    cfg = model_config("tiny")
    mod = build_stage(cfg, 1, 2)
    meter = MemoryMeter("cpu", [mod])
    assert meter.accounting and meter.current_bytes == meter.state_bytes
    x = torch.randn(2, 16, cfg.d_model, requires_grad=True)
    mb = synthetic_microbatch(2, 16)
    inputs = make_inputs(mb, synthetic_tokens(mb.lengths, cfg.vocab_size, 0), cfg=cfg)
    with meter.saving(1):
        loss = mod(x, inputs)
    held = meter.current_bytes - meter.state_bytes
    assert held > 0
    loss.backward()
    del loss
    meter.sample(1)
    assert meter.current_bytes - meter.state_bytes < held
    assert meter.peaks()[1] >= meter.state_bytes + held
    meter.close()


def _torch_cuda_calls(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and node.attr == "cuda" and isinstance(node.value, ast.Name)
                and node.value.id == "torch"):
            lines.append(node.lineno)
    return lines


def test_only_the_seam_calls_torch_cuda():
    paths = [*sorted((ROOT / "runtime").glob("*.py")), *sorted((ROOT / "measure").glob("*.py"))]
    offenders = {str(p.relative_to(ROOT)): _torch_cuda_calls(p) for p in paths if p.name != "device.py"}
    assert {k: v for k, v in offenders.items() if v} == {}
    assert _torch_cuda_calls(ROOT / "runtime" / "device.py")       # the check sees what it looks for


@cuda
def test_cuda_ops_allocator_peaks_and_events():
    ops = device_ops("cuda")
    assert ops.allocator_stats and ops.default_clock == "event" and ops.name()
    ops.synchronize()
    ops.reset_peak()
    base = ops.allocated_bytes()
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    assert ops.allocated_bytes() - base >= 64 * 2**20
    del x
    assert ops.peak_allocated_bytes() - base >= 64 * 2**20
    assert ops.peak_reserved_bytes() >= ops.peak_allocated_bytes()
    ops.reset_peak()
    assert ops.peak_allocated_bytes() - base < 64 * 2**20
    ops.empty_cache()
    y = torch.randn(2048, 2048, device="cuda")
    out, event_s, wall_s = ops.timer("event")(lambda: y @ y)
    assert out.shape == (2048, 2048) and 0 < event_s and 0 < wall_s
    a = ops.mark()
    y @ y
    b = ops.mark()
    ops.synchronize()
    assert ops.seconds(a, b) > 0 and ops.cpu() is None


@cuda
def test_bind_cuda_sets_the_current_device():
    dev = bind_device("cuda", 0)
    assert dev == torch.device("cuda", 0) and torch.cuda.current_device() == 0
    assert device_ops(dev).group_device() == dev
    with pytest.raises(RuntimeError, match="use fewer ranks per node"):
        bind_device("cuda", torch.cuda.device_count())


@cuda
def test_meter_reads_the_allocator_on_cuda():
    cfg = model_config("tiny")
    mod = build_stage(cfg, 1, 2, device="cuda")
    meter = MemoryMeter("cuda", [mod])
    assert not meter.accounting and not meter._hooks
    meter.reset_peak()
    x = torch.randn(4, 64, cfg.d_model, device="cuda", requires_grad=True)
    mb = synthetic_microbatch(4, 64)
    inputs = make_inputs(mb, synthetic_tokens(mb.lengths, cfg.vocab_size, 0), cfg=cfg, device="cuda")
    with meter.saving(1):
        loss = mod(x, inputs)
    loss.backward()
    meter.sample(1)
    assert meter.peaks()[1] == torch.cuda.max_memory_allocated() > 0
    meter.close()
