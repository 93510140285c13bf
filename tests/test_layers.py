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
                 and any(t.startswith(("dynmb.timing", "dynmb.packing")) for t in graph[m])]
    assert offenders == []


LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("io", ("io",)),
    ("core", ("core",)),
    ("data", ("data",)),
    ("schedule", ("schedule",)),
    ("costmodel, memory", ("costmodel", "memory")),
    ("timing", ("timing",)),
    ("packing", ("packing",)),
    ("planning", ("planning",)),
    ("api", ("api",)),
    ("models", ("models",)),
    ("runtime", ("runtime",)),
    ("measure", ("measure",)),
    ("integrations", ("integrations",)),
    ("report", ("report",)),
    ("jobs", ("jobs",)),
    ("cli", ("cli",)),
    ("public API", ("",)),
]
"""docs/design.md's layer table, top (imported by all) to bottom, folder by folder (``""``: the
package's own ``__init__``): a module may import its own layer and the layers above it."""

_LAYER_OF = {folder: i for i, (_, folders) in enumerate(LAYERS) for folder in folders}


def _folder(module: str) -> str:
    """``dynmb.timing.simulate`` -> ``timing``; ``dynmb`` -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer(module: str) -> int | None:
    return _LAYER_OF.get(_folder(module))


def test_only_the_package_init_stands_at_the_top():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert top in (["__init__.py"], ["__init__.py", "__main__.py"]), f"move {top} into a layer's folder"


def test_every_module_has_a_documented_layer():
    graph = _graph()
    unlisted = sorted(m for m in graph if _layer(m) is None)
    assert unlisted == [], f"add the folders of {unlisted} to docs/design.md's layer table and LAYERS"
    gone = sorted(f for f in _LAYER_OF if f and not (ROOT / f / "__init__.py").exists())
    assert gone == [], f"LAYERS names folders that do not exist: {gone}"


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
    """The folders a layer row of docs/design.md names: `` `pkg/` `` gives ``pkg``; `` `__init__.py` `` the
    package's own ``__init__`` (``""``)."""
    out = set(re.findall(r"`(\w+)/`", row))
    if "`__init__.py`" in row:
        out.add("")
    return out


def test_layer_table_matches_docs():
    doc = (ROOT.parent / "docs" / "design.md").read_text()
    for name, folders in LAYERS:
        row = next((line for line in doc.splitlines() if line.startswith(f"| {name} |")), None)
        assert row is not None, f"docs/design.md has no layer row {name!r}"
        named = _documented(row.split("|")[2])
        assert named == set(folders), (f"docs/design.md's {name!r} row names {sorted(named - set(folders))} "
                                       f"beyond LAYERS and misses {sorted(set(folders) - named)}")
