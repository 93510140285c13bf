"""The host allocator policy of CPU stages (dynmb.runtime.hostmem), checked in fresh processes."""

import json
import os
import subprocess
import sys

import pytest

from dynmb.runtime import hostmem

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc policy")

_PROBE = r"""
import json, resource, sys
import torch
torch.set_num_threads(1)
from dynmb.runtime.hostmem import prefault, retain_freed_memory
applied = retain_freed_memory()
touched = prefault(int(sys.argv[1]))
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
sizes = [(8 + 5 * i) << 20 for i in range(8)]      # 8..43 MiB blocks, like one step's activations
out = []
for _ in range(8):                                 # 8 "steps": allocate and touch all, free all
    f0 = faults()
    held = []
    for n in sizes:
        t = torch.empty(n, dtype=torch.uint8); t.fill_(1); held.append(t)
    del held, t
    out.append(faults() - f0)
print(json.dumps({"applied": applied, "touched": touched, "faults": out}))
"""


def _probe(prefault_bytes: int, mode: str) -> dict:
    env = {**os.environ, hostmem.ENV: mode}
    r = subprocess.run([sys.executable, "-c", _PROBE, str(prefault_bytes)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_retain_reuses_freed_pages():
    res = _probe(0, "retain")
    if not res["applied"]:
        pytest.skip("not glibc: mallopt policy not available")
    f = res["faults"]
    # the first round faults its 200 MiB in (~52k pages of 4 KiB); freed blocks stay in the
    # heap and, once they have coalesced, later rounds reuse them (glibc's default policy
    # faults 20-50k pages every round on the same pattern)
    assert f[0] > 40000, res
    assert sum(f[3:]) / len(f[3:]) < 0.1 * f[0], res


def test_prefault_moves_the_faults_to_set_up():
    res = _probe(256 << 20, "retain")
    if not res["applied"]:
        pytest.skip("not glibc: mallopt policy not available")
    assert res["touched"] == 512 << 20            # headroom 2 x the limit
    assert sum(res["faults"]) < 5000, res         # vs > 40k in the first round without it


def test_system_mode_turns_it_off():
    res = _probe(64 << 20, "system")
    assert res == {**res, "applied": False, "touched": 0}


def test_bad_mode_is_an_error(monkeypatch):
    monkeypatch.setenv(hostmem.ENV, "jemalloc")
    with pytest.raises(ValueError, match="DYNMB_HOST_MALLOC"):
        hostmem.host_malloc_mode()
