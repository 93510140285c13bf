"""The package's import graph: no cycles, and the schedule layer never imports the simulator.

Reads every module's top-level and nested ``import`` statements with ``ast`` (no import is
executed), resolves relative imports, and keeps the edges between dynmb modules."""

from __future__ import annotations

import ast
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


def test_schedule_layer_does_not_import_the_simulator():
    graph = _graph()
    offenders = [m for m in graph if m.startswith("dynmb.schedule") and "dynmb.simulate" in graph[m]]
    assert offenders == []


LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("io helpers", ("dynmb.atomic", "dynmb.results", "dynmb.hostinfo")),
    ("types, config", ("dynmb.types", "dynmb.config", "dynmb.model_sizes")),
    ("data", ("dynmb.data",)),
    ("models of the hardware", ("dynmb.memory", "dynmb.costmodel")),
    ("packing", ("dynmb.packing",)),
    ("schedules", ("dynmb.schedule",)),
    ("simulation", ("dynmb.simulate",)),
    ("planning", ("dynmb.planning",)),
    ("workload", ("dynmb.inputs", "dynmb.models", "dynmb.prefix")),
    ("runtime", ("dynmb.runtime",)),
    ("measurement", ("dynmb.profile", "dynmb.analysis", "dynmb.plots")),
    ("job and CLI", ("dynmb.compare", "dynmb.cli")),
    ("public API", ("dynmb",)),
]
"""docs/design.md's layer table, top (imported by all) to bottom: a module may import its own
layer and the layers above it. A module goes under its longest matching prefix."""


def _layer(module: str) -> int | None:
    best: tuple[int, int] | None = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return None if best is None else best[0]


def test_every_module_has_a_documented_layer():
    unlisted = [m for m in _graph() if _layer(m) is None]
    assert unlisted == [], f"add {unlisted} to docs/design.md's layer table and LAYERS"


def test_imports_go_only_to_the_same_or_a_higher_layer():
    bad = []
    for m, targets in _graph().items():
        for t in targets:
            if t != "dynmb" and _layer(t) > _layer(m):
                bad.append(f"{m} ({LAYERS[_layer(m)][0]}) imports {t} ({LAYERS[_layer(t)][0]})")
    assert bad == [], "\n".join(sorted(bad))


def test_layer_table_matches_docs():
    doc = (ROOT.parent / "docs" / "design.md").read_text()
    for name, prefixes in LAYERS[:-1]:
        row = next((line for line in doc.splitlines() if line.startswith(f"| {name} |")), None)
        assert row is not None, f"docs/design.md has no layer row {name!r}"
        for p in prefixes:
            if (ROOT.parent / (p.replace(".", "/") + ".py")).exists() or (ROOT.parent / p.replace(".", "/")).is_dir():
                leaf = p.rpartition(".")[2]
                assert f"`{leaf}.py`" in row or f"`{leaf}/" in row, f"{p} not in docs/design.md's {name!r} row"
