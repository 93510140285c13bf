"""The runtime on NCCL + CUDA: gradients equal the reference and the measured CUDA peak
(``max_memory_allocated``) stays under the limit. Skipped without a GPU.

With one GPU the pipeline runs on one rank (interleaved, two chunks: local handoffs,
CUDA events, the CUDA meter); with two or more it runs 1F1B on two NCCL ranks.
"""

from __future__ import annotations

import pytest
import torch

from dynmb.core.config import ModelConfig, PipelineConfig, RunConfig
from dynmb.io.results import load_results
from dynmb.runtime.launch import launch_job
from dynmb.runtime.spec import JobSpec, RunSpec

pytestmark = [pytest.mark.cuda, pytest.mark.dist,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _cfg(stages: int, virtual: int, kind: str) -> RunConfig:
    return RunConfig(model=ModelConfig.preset("tiny"),
                     pipeline=PipelineConfig(num_stages=stages, virtual=virtual, schedule=kind,
                                             memory_limit_bytes=512 * 2**20),
                     dataset="gsm8k", global_batch=8, method="dynamic", steps=2, warmup=1,
                     backend="nccl", device="cuda", timeout_s=60)


def test_nccl_pipeline_matches_reference(tmp_path):
    two = torch.cuda.device_count() >= 2
    cfg = _cfg(2, 1, "1f1b") if two else _cfg(2, 2, "interleaved")
    job = JobSpec.single(RunSpec.create(cfg, tmp_path, verify=True, run_id="cuda"))
    rc = launch_job(job, 2 if two else 1, quiet=True).returncode
    errs = list((tmp_path / "errors").glob("*.txt")) if (tmp_path / "errors").exists() else []
    assert rc == 0, "\n".join(e.read_text() for e in errs)
    t = load_results(tmp_path)
    assert len(t["steps"]) == 3 and t["steps"]["verified"].all()
    mem = t["memory"]
    assert (mem["peak_bytes"] > 0).all() and (mem["peak_bytes"] <= mem["limit_bytes"]).all()
