"""A wheel of the repo, installed (not editable) in a fresh virtual environment, works from any folder.

Builds the wheel from a copy of the source (``pip wheel --no-deps --no-build-isolation``: nothing
is downloaded, and the checkout gets no ``build/`` folder). The shipped traces and cost models live
once, in the top-level ``data/``; ``setup.py`` maps them into the wheel as package data of
``dynmb.data``. The venv is a plain one (not ``--system-site-packages``, which would see the base
interpreter rather than the environment running the tests) whose site-packages gets a ``.pth``
naming the site-packages folders of the interpreter running the tests: torch, numpy, scipy,
pandas come from wherever pytest found them (a user's venv or the system), the wheel is installed
with ``--no-deps``, offline. Then, from an empty folder: ``dynmb datasets`` lists the shipped
traces (and ``DYNMB_DATA_DIR`` still overrides them), ``dynmb plan --dataset sharegpt`` packs a
batch with the shipped cost model, and the public API (``dynmb.Planner(...).plan(...)``) runs --
every import resolving to the venv's copy, not the checkout, so the traces and cost models must be
package data of the wheel. About 20 s; it runs with the rest of ``python -m pytest -q tests``. The venv is made
without pip (``ensurepip`` cost ~3 s of CPU); the host's pip installs the wheel into it (``pip --python``).
"""

from __future__ import annotations

import json
import os
import site
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRACES = ("alpaca_eval", "gsm8k", "humaneval", "longtail", "sharegpt", "wikitext2")


def _site_dirs() -> list[str]:
    """Where the interpreter running the tests finds its packages (venv or system, user site too)."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(map(str, cmd))} exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
    return p


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for name in ("dynmb", "data"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INDEX": "1", "PYTHONNOUSERSITE": "1"}
    env.pop("PYTHONPATH", None)
    env.pop("DYNMB_DATA_DIR", None)       # the traces must come from the installed package
    dist = root / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)],
         root, env, timeout=120)
    (wheel,) = dist.glob("dynmb-*.whl")
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], root, env)   # ensurepip: ~3 s of CPU
    py = str(venv / "bin" / "python")
    purelib = _run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], root, env).stdout.strip()
    # path lines of a .pth are appended after the venv's own site-packages (the wheel's dynmb wins);
    # .pth files inside those folders are not run, so an editable install of the checkout stays out
    (Path(purelib) / "_dynmb_test_host.pth").write_text("".join(f"{d}\n" for d in _site_dirs()))
    # the host's pip installs into the venv's interpreter (``--python``, pip >= 22.3), as the venv's own pip would
    _run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", str(wheel)], root, env, timeout=120)
    work = root / "elsewhere"
    work.mkdir()
    return {"wheel": wheel, "venv": venv, "work": work, "env": env}   # type: ignore[dict-item]


def test_wheel_ships_the_package_data(venv):
    wheel = zipfile.ZipFile(venv["wheel"])
    names = set(wheel.namelist())
    for t in TRACES:        # the checkout's data/ holds them once; the wheel carries them as package data
        assert wheel.read(f"dynmb/data/traces/{t}.csv") == (REPO / "data" / "traces" / f"{t}.csv").read_bytes()
    model = "dynmb/data/costmodels/small-p2-cpu.json"
    assert wheel.read(model) == (REPO / "data" / "costmodels" / "small-p2-cpu.json").read_bytes()
    assert not (REPO / "dynmb" / "data" / "traces").exists() and not (REPO / "dynmb" / "data" / "costmodels").exists()
    assert not any(n.startswith(("tests/", "experiments/", "data/")) for n in names)


def test_installed_command_runs_from_another_folder(venv):
    dynmb, work, env = venv["venv"] / "bin" / "dynmb", venv["work"], venv["env"]
    assert dynmb.is_file()
    out = _run([str(dynmb), "datasets"], work, env).stdout
    for t in TRACES:
        assert t in out
    mine = work / "mine"
    mine.mkdir()
    (mine / "mytrace.csv").write_text("length\n3\n5\n")
    out = _run([str(dynmb), "datasets"], work, {**env, "DYNMB_DATA_DIR": str(mine)}).stdout
    assert "mytrace" in out and "sharegpt" not in out
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
