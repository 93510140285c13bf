"""The package's import graph: no cycles, the schedule layer imports neither the simulator nor the
packers, every module sits in docs/design.md's layer table and imports only its own layer and the
layers above, and no private name is imported across modules.

Reads every module's top-level and nested ``import`` statements with ``ast`` (no import is
executed), resolves relative imports, and keeps the edges between dynmb modules."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import dynmb

ROOT = Path(dynmb.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name and t.startswith("dynmb"):
                    graph[name].add(t)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    graph = _graph()
    # a package __init__ that re-exports its submodules is not a cycle of design; drop those edges
    pruned = {m: {t for t in ts if not (m.startswith(t + ".") and graph.get(t) and m in graph[t])}
              for m, ts in graph.items()}
    assert _cycles(pruned) == []


def test_schedule_layer_imports_neither_the_simulator_nor_the_packers():
    graph = _graph()
    offenders = [m for m in graph if m.startswith("dynmb.schedule")
                 and any(t.startswith(("dynmb.simulate", "dynmb.makespan", "dynmb.packing")) for t in graph[m])]
    assert offenders == []


def _modules(package: str, *leaves: str) -> tuple[str, ...]:
    """``package`` (its ``__init__``) and its submodules ``leaves``."""
    return (package, *(f"{package}.{leaf}" for leaf in leaves))


LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("io helpers", ("dynmb.atomic", "dynmb.results", "dynmb.outdir", "dynmb.hostinfo")),
    ("types, config", ("dynmb.types", "dynmb.microbatch", "dynmb.actions", "dynmb.predictions", "dynmb.planspec",
                       "dynmb.features", "dynmb.config", "dynmb.model_sizes", "dynmb.units", "dynmb.contract")),
    ("data", _modules("dynmb.data", "lengths", "corpus", "tokens")),
    ("schedules", _modules("dynmb.schedule", "kinds", "builders", "order", "zerobubble", "validate", "io")),
    ("models of the hardware", ("dynmb.memory", "dynmb.memory_peak", "dynmb.memory_fit", "dynmb.memory_coef",
                                *_modules("dynmb.costmodel", "base", "analytic", "poly", "grid", "nnls", "samples",
                                          "split", "p2pfit", "calibration", "registry", "validate", "gpu"))),
    ("simulation", ("dynmb.simulate", "dynmb.makespan", "dynmb.makespan_zb", "dynmb.makespan_interleaved",
                    "dynmb.makespan_levels", "dynmb.bounds", "dynmb.gap_terms")),
    ("packing", _modules("dynmb.packing", "dispatch", "context", "rows", "fixed", "packed", "token_budget", "dynapipe",
                         "dynamic", "dynamic_setup", "dynamic_space", "dynamic_rank", "orders", "recompute",
                         "balanced", "methods")),
    ("planning", _modules("dynmb.planning", "planner", "replicas", "reorder", "batchsim", "zerobubble", "slicing", "slice_fitting", "defaults", "api",
                          "sampler", "partition", "split_units", "stage_split", "head_split", "gpu_split", "split_work", "split_search", "virtual_search",
                          "spec_check")),
    ("workload", ("dynmb.inputs", "dynmb.prefix", "dynmb.collate", *_modules("dynmb.models", "contract", "families", "gpt2", "llama", "stage", "attention", "recompute", "seeding", "reference", "hf", "head", "pieces"))),
    ("runtime", (*_modules("dynmb.runtime", "spec", "topology", "state", "planahead", "planshare", "step", "interpreter", "splitbackward", "comm",
                           "checks", "records", "device", "meter", "hostmem", "hooks", "trace", "launch", "processes",
                           "worker", "api"), *_modules("dynmb.integrations", "torch_pipelining"))),
    ("measurement", (*_modules("dynmb.measure", "profiler", "grid", "timing", "eta", "samples", "memory", "pingpong"),
                     "dynmb.analysis", "dynmb.plots")),
    ("job and CLI", ("dynmb.compare", "dynmb.compare_table", *_modules("dynmb.cli", "main", "__main__", "flags", "datasets", "lengths", "plan",
                                                "schedule", "simulate", "profile", "fit", "memory", "run", "compare", "planfile"))),
    ("public API", ("dynmb",)),
]
"""docs/design.md's layer table, top (imported by all) to bottom, module by module: a module may
import its own layer and the layers above it."""

_LAYER_OF = {m: i for i, (_, mods) in enumerate(LAYERS) for m in mods}


def _layer(module: str) -> int | None:
    return _LAYER_OF.get(module)


def test_every_module_has_a_documented_layer():
    graph = _graph()
    unlisted = sorted(m for m in graph if _layer(m) is None)
    assert unlisted == [], f"add {unlisted} to docs/design.md's layer table and LAYERS"
    gone = sorted(m for m in _LAYER_OF if m not in graph)
    assert gone == [], f"LAYERS names modules that do not exist: {gone}"


def test_imports_go_only_to_the_same_or_a_higher_layer():
    bad = []
    for m, targets in _graph().items():
        for t in targets:
            if t != "dynmb" and _layer(t) > _layer(m):
                bad.append(f"{m} ({LAYERS[_layer(m)][0]}) imports {t} ({LAYERS[_layer(t)][0]})")
    assert bad == [], "\n".join(sorted(bad))


def test_no_private_name_is_imported_across_modules():
    """``from x import _name`` between two dynmb modules: a private name is its module's own."""
    bad = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("dynmb")):
                bad += [f"{path.relative_to(ROOT.parent)}: {a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert bad == [], "\n".join(bad)


def _documented(row: str) -> set[str]:
    """The modules a layer row of docs/design.md names: `` `pkg/` (`a`, `b`) `` gives the package
    and its modules a, b; `` `pkg/leaf.py` `` and `` `leaf.py` `` one module each."""
    out: set[str] = set()
    for pkg, inner in re.findall(r"`(\w+)/`(?: \(([^)]*)\))?", row):
        out.add(f"dynmb.{pkg}")
        out.update(f"dynmb.{pkg}.{leaf}" for leaf in re.findall(r"`(\w+)`", inner or ""))
    for path in re.findall(r"`([\w/]+)\.py`", row):
        out.add("dynmb" if path == "__init__" else "dynmb." + path.replace("/", "."))
    return out


def test_layer_table_matches_docs():
    doc = (ROOT.parent / "docs" / "design.md").read_text()
    for name, modules in LAYERS:
        row = next((line for line in doc.splitlines() if line.startswith(f"| {name} |")), None)
        assert row is not None, f"docs/design.md has no layer row {name!r}"
        named = _documented(row.split("|")[2])
        assert named == set(modules), (f"docs/design.md's {name!r} row names {sorted(named - set(modules))} "
                                       f"beyond LAYERS and misses {sorted(set(modules) - named)}")
