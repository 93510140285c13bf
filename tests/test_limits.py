"""Limits on functions: at most 60 lines and 8 parameters (``self`` / ``cls`` not counted).

``python tests/test_limits.py [dynmb]`` prints every function over either limit (the count docs/design.md quotes,
"Limits on functions"); the test fails on one that is not listed below, so a new long or wide function is
split (or documented here) before it lands. Public constructors (``__init__`` and ``create``) taking their
settings as keywords are the documented exceptions; the other entries are waiting to be split.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES, MAX_PARAMS = 60, 8

CONSTRUCTORS = {"__init__", "create"}
"""Public constructors: their keywords are the record they build (``Planner(**spec fields)``)."""

KNOWN_LONG: set[str] = set()
"""Functions over 60 lines allowed (none now: issue 36 split the last ones)."""

KNOWN_WIDE = {
    "dynmb/runtime/api.py:run",   # the public ``dynmb.run(config(s), out, **keywords)``: its keywords are the API
}
"""Non-constructor functions over 8 parameters allowed: the public entry point whose keywords are the API."""


def over_limits(root: Path) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """((lines, "path:name") of functions over ``MAX_LINES``, (params, "path:name") over ``MAX_PARAMS``)."""
    long, wide = [], []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root.parent).as_posix()
        for n in ast.walk(ast.parse(p.read_text())):
            if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = n.args
            params = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + \
                (a.kwarg is not None) - bool(a.args and a.args[0].arg in ("self", "cls"))
            lines = (n.end_lineno or n.lineno) - n.lineno + 1
            if lines > MAX_LINES:
                long.append((lines, f"{rel}:{n.name}"))
            if params > MAX_PARAMS:
                wide.append((params, f"{rel}:{n.name}"))
    return sorted(long, reverse=True), sorted(wide, reverse=True)


def test_no_new_function_over_the_limits():
    long, wide = over_limits(ROOT / "dynmb")
    new_long = [f"{name} ({n} lines)" for n, name in long if name not in KNOWN_LONG]
    new_wide = [f"{name} ({n} parameters)" for n, name in wide
                if name not in KNOWN_WIDE and name.rsplit(":", 1)[1] not in CONSTRUCTORS]
    assert new_long + new_wide == [], "split these functions (or pass a settings record whole): " + ", ".join(
        new_long + new_wide)


def test_the_count_sees_lines_and_parameters(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    (pkg / "m.py").write_text(f"def long():\n{body}\n\n\nclass C:\n    def wide(self, a, b, c, d, e, f, g, h, *i):\n"
                              f"        pass\n\n    def fine(self, a, b, c, d, e, f, g, h):\n        pass\n")
    long, wide = over_limits(pkg)
    assert long == [(62, "pkg/m.py:long")] and wide == [(9, "pkg/m.py:wide")]


if __name__ == "__main__":
    long, wide = over_limits(ROOT / (sys.argv[1] if len(sys.argv) > 1 else "dynmb"))
    print(len(long), f"over {MAX_LINES} lines")
    print("\n".join(f"  {n} {name}" for n, name in long))
    print(len(wide), f"over {MAX_PARAMS} parameters ({sum(1 for _, x in wide if x.rsplit(':', 1)[1] in CONSTRUCTORS)}"
          f" constructors)")
    print("\n".join(f"  {n} {name}" for n, name in wide))
