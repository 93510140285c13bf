"""A wheel of the repo, installed (not editable) in a fresh virtual environment, works from any folder.

Builds the wheel from a copy of the source (``pip wheel --no-deps --no-build-isolation``: nothing
is downloaded, and the checkout gets no ``build/`` folder), creates a venv with
``--system-site-packages`` (torch, numpy, scipy, pandas come from this environment) and installs
the wheel there with ``--no-deps``. Then, from an empty folder: ``dynmb datasets`` lists the
shipped traces, ``dynmb plan --dataset sharegpt`` packs a batch with the shipped cost model, and
the public API (``dynmb.Planner(...).plan(...)``) runs -- every import resolving to the venv's
copy, not the checkout, so the traces and cost models must be package data of the wheel.
About 15 s; it runs with the rest of ``python -m pytest -q tests`` (``.ci/run``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRACES = ("alpaca_eval", "gsm8k", "humaneval", "sharegpt", "wikitext2")


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(map(str, cmd))} exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
    return p


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "dynmb", src / "dynmb", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INDEX": "1", "PYTHONNOUSERSITE": "1"}
    env.pop("PYTHONPATH", None)
    env.pop("DYNMB_DATA_DIR", None)       # the traces must come from the installed package
    dist = root / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)],
         root, env, timeout=120)
    (wheel,) = dist.glob("dynmb-*.whl")
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], root, env)
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], root, env, timeout=120)
    work = root / "elsewhere"
    work.mkdir()
    return {"wheel": wheel, "venv": venv, "work": work, "env": env}   # type: ignore[dict-item]


def test_wheel_ships_the_package_data(venv):
    names = set(zipfile.ZipFile(venv["wheel"]).namelist())
    for t in TRACES:
        assert f"dynmb/data/traces/{t}.csv" in names
    assert "dynmb/data/costmodels/small-p2-cpu.json" in names
    assert not any(n.startswith(("tests/", "experiments/")) for n in names)


def test_installed_command_runs_from_another_folder(venv):
    dynmb, work, env = venv["venv"] / "bin" / "dynmb", venv["work"], venv["env"]
    assert dynmb.is_file()
    out = _run([str(dynmb), "datasets"], work, env).stdout
    for t in TRACES:
        assert t in out
    p = _run([str(dynmb), "plan", "--dataset", "sharegpt", "--global-batch", "32", "--stages", "2",
              "--memory-limit", "1GiB", "--method", "dynamic", "--json", "-o", "plan.json"], work, env)
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["method"] == "dynamic" and summary["num_sequences"] == 32 and summary["num_microbatches"] >= 1
    assert 0 < summary["pred_step_s"] and max(summary["pred_peak_bytes"]) <= summary["memory_limit_bytes"]
    plan = json.loads((work / "plan.json").read_text())
    assert sorted(i for mb in plan["microbatches"] for i in mb["seq_ids"]) == list(range(32))


def test_installed_python_api_runs_from_another_folder(venv):
    python, work, env = venv["venv"] / "bin" / "python", venv["work"], venv["env"]
    script = textwrap.dedent("""
        import json
        import dynmb
        from dynmb.data import load_trace, sample_batch
        from dynmb.planning import default_cost_model_path

        lengths = sample_batch(load_trace("sharegpt"), 32, 0)
        planner = dynmb.Planner(model="small", num_stages=2, memory_limit="1GiB")
        step = planner.plan(lengths, method="dynamic")
        print(json.dumps({"file": dynmb.__file__, "cost_model": type(planner.cost_model).__name__,
                          "shipped": default_cost_model_path("small", 2),
                          "sequences": sorted(int(i) for mb in step.plan.microbatches for i in mb.seq_ids),
                          "makespan_s": float(step.sim.makespan_s)}))
    """)
    out = json.loads(_run([str(python), "-c", script], work, env).stdout.strip().splitlines()[-1])
    venv_root = str(venv["venv"].resolve())
    assert out["file"].startswith(venv_root), out["file"]
    assert not out["file"].startswith(str(REPO))
    assert out["shipped"] and out["shipped"].startswith(venv_root)     # the fitted model, as package data
    assert out["cost_model"] == "FittedCostModel"
    assert out["sequences"] == list(range(32)) and out["makespan_s"] > 0
