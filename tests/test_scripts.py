"""The scripts users run (``experiments/``) and the speed benchmarks (``benchmarks/``) keep to dynmb's public names.

Every file under experiments/ and benchmarks/ is parsed: no import of a name (or module) starting with ``_``
from dynmb, no ``sys.path`` edit, no assignment to another module's attribute (monkeypatching). The studies
live in ``studies/`` with their own smoke tests (``python -m pytest -q studies``); nothing here imports them.
The user scripts themselves: ``api_example.py`` runs on public names, ``analyze.py`` reads a results folder.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXP = ROOT / "experiments"
SCRIPTS = sorted(p for d in ("experiments", "benchmarks") for p in (ROOT / d).glob("*.py"))


def dynmb_names(path: Path) -> tuple[set[str], list[str]]:
    """(attributes read from ``dynmb``, imports of dynmb submodules) in a script."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    submodules: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "dynmb":
            names.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dynmb"):
            submodules.append(node.module or "")
        elif isinstance(node, ast.Import):
            submodules += [a.name for a in node.names if a.name.startswith("dynmb.")]
    return names, submodules


def script_violations(path: Path) -> list[str]:
    """What keeps a script off the public names: private dynmb imports, ``sys.path`` edits, monkeypatching."""
    tree = ast.parse(path.read_text())
    modules = {a.asname or a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            base = node.module or "" if isinstance(node, ast.ImportFrom) else ""
            for a in node.names:
                full = f"{base}.{a.name}" if base else a.name
                if full.startswith("dynmb") and any(p.startswith("_") for p in full.split(".")):
                    found.append(f"line {node.lineno}: imports {full}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                (node.value.id, node.attr) == ("sys", "path"):
            found.append(f"line {node.lineno}: edits sys.path")
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in modules:
                    found.append(f"line {node.lineno}: assigns {t.value.id}.{t.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            found.append(f"line {node.lineno}: setattr")
    return sorted(found, key=lambda v: int(v.split()[1].rstrip(':')))


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_scripts_use_public_names_only(path):
    assert script_violations(path) == []


def test_the_check_catches_each_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nfrom dynmb.planning.stage_split import _stage_partition\nimport dynmb._x\n"
                   "from dynmb.planning import stage_split\nsys.path.insert(0, 'x')\nstage_split.CHUNK_GAIN = 2\n"
                   "setattr(stage_split, 'CHUNK_GAIN', 2)\n")
    assert [v.split(":")[0] for v in script_violations(bad)] == [f"line {k}" for k in (2, 3, 5, 6, 7)]


def test_the_package_suite_runs_no_study():
    tests = [p for p in (ROOT / "tests").glob("*.py") if p.name != "test_scripts.py"]
    for p in tests:
        tree = ast.parse(p.read_text())
        mods = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        mods += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in mods if m.split(".")[0] == "studies"], p.name


def _script(name: str):
    if str(EXP) not in sys.path:
        sys.path.insert(0, str(EXP))
    return importlib.import_module(name)


def _synthetic_results(d: Path) -> None:
    """Real-run tables of 4 runs: fixed mbs 1 and 2, token-budget, dynamic (100/150/120/200 tokens/s)."""
    runs = {"r1": ("fixed", 1, 150.0), "r2": ("fixed", 2, 100.0), "r3": ("token-budget", None, 120.0),
            "r4": ("dynamic", None, 200.0)}
    steps, mem, cfg = [], [], []
    for rid, (m, mbs, tps) in runs.items():
        for k in range(3):
            step_s = 1000.0 / tps
            steps.append(dict(run_id=rid, method=m, dataset="toy", step=k, warmup=k == 0,
                              step_s=step_s * (3 if k == 0 else 1), pred_step_s=step_s * 1.05, real_tokens=1000,
                              computed_tokens=1200, tokens_per_s=tps / (3 if k == 0 else 1), num_microbatches=4,
                              padding_fraction=1 / 6, mean_bubble=0.2, plan_s=0.01))
            mem += [dict(run_id=rid, step=k, stage=s, peak_bytes=500 + 100 * s, limit_bytes=1000) for s in (0, 1)]
        cfg.append(dict(dataset="toy", model="tiny", num_stages=2, dp=1, global_batch=8, memory_limit_bytes=1000,
                        method=m, mbs=mbs, schedule="1f1b", reorder="none", cost_model="analytic", seed=0,
                        oversize="error", steps=2, warmup=1, run_id=rid, status="ok", error=""))
    d.mkdir(parents=True, exist_ok=True)
    for name, rows in (("steps", steps), ("memory", mem), ("configs", cfg)):
        pd.DataFrame(rows).to_csv(d / f"{name}.csv", index=False)


def test_analyze_synthetic(tmp_path, capsys):
    _synthetic_results(tmp_path / "res")
    assert _script("analyze").main([str(tmp_path / "res"), "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| dataset | memory_limit | method |" in out
    lines = {ln.split("|")[3].strip(): ln for ln in out.splitlines() if ln.startswith("| toy")}
    assert {"fixed mbs=1", "fixed mbs=2", "token-budget", "dynamic"} <= set(lines)
    assert "| 200 |" in lines["dynamic"]                          # warm-up steps are excluded
    assert "| 0.6 |" in lines["dynamic"]                          # peak / limit = 600 / 1000
    best = [ln for ln in out.splitlines() if ln.startswith("| toy") and ln.count("|") == 8]
    assert len(best) == 1 and "| 1 |" in best[0] and "| 1.33 |" in best[0]   # best fixed mbs 1, 200/150


def test_api_example_uses_only_public_names(capsys):
    import dynmb
    names, submodules = dynmb_names(EXP / "api_example.py")
    assert submodules == [] and names and names <= set(dynmb.__all__), names - set(dynmb.__all__)
    assert _script("api_example").main(["--global-batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "dynamic" in out and "sampler, replica 0 of 2" in out and "e+" not in out


def test_run_interleave_is_for_cpu_and_checked_before_launch(tmp_path, monkeypatch):
    import dynmb
    from dynmb.runtime import api
    monkeypatch.setattr(api, "launch_job", lambda *a, **k: pytest.fail("launched"))
    cfg = dynmb.RunConfig(model=dynmb.model_config("tiny"), global_batch=8, steps=1, backend="nccl", device="cuda")
    with pytest.raises(ValueError, match="interleave is for CPU runs"):
        dynmb.run([cfg, cfg], out=tmp_path, interleave=True)
