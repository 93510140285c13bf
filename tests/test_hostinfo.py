"""``dynmb.io.hostinfo``: usable cores and the one-line warning when ranks outnumber them."""

from __future__ import annotations

import os

from dynmb.io import hostinfo
from dynmb.io.hostinfo import cores_warning, usable_cores


def test_usable_cores_is_the_affinity_mask_capped_by_the_quota(tmp_path, monkeypatch):
    n = usable_cores()
    assert 1 <= n <= (os.cpu_count() or 1)
    quota = tmp_path / "cpu.max"
    quota.write_text("100000 100000\n")
    monkeypatch.setattr(hostinfo, "CPU_MAX", quota)
    monkeypatch.setattr(hostinfo._quota_cores, "__defaults__", (quota,))
    assert usable_cores() == 1
    quota.write_text("max 100000\n")
    assert usable_cores() == n


def test_cores_warning_one_line_only_when_ranks_outnumber_cores():
    assert cores_warning(2, cores=2) is None and cores_warning(1, cores=1) is None
    msg = cores_warning(4, cores=2)
    assert msg is not None and "\n" not in msg and msg.startswith("4 ranks on 2 CPU cores")
    assert "at most 2 ranks" in msg
    msg = cores_warning(2, threads=2, cores=2)
    assert msg is not None and "2 ranks x 2 threads" in msg and "at most 1 rank " in msg
    assert cores_warning(os.cpu_count() * 64) is not None
