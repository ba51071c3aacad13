"""Imports run one way (DESIGN.md, STYLE.md rule 10): between packages and inside each, type-only imports included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "transfer", "prefill_node", "decode_node", "colocated_node", "bootstrap")
# Which of our packages each package may import.
ALLOWED = {
    "common": {"common"},
    "transfer": {"common", "transfer"},
    "prefill_node": {"common", "transfer", "prefill_node"},
    "decode_node": {"common", "transfer", "decode_node"},
    # One process of both node roles: it composes them, nothing imports it.
    "colocated_node": {"common", "transfer", "prefill_node", "decode_node", "colocated_node"},
    "bootstrap": {"common", "bootstrap"},
}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module of ours that `path` imports, anywhere in it (TYPE_CHECKING blocks too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.module
                 and node.level == 0 else [])
        found.update(n for n in names if n.split(".")[0] in PACKAGES)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        # `from common import messages` names a module; `from common.x import Y` names x.
        graph[name] = {m for m in _imports(path) if m in modules and m != name}
    return graph


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_imports_only_the_packages_below_it(package: str) -> None:
    bad = {(m, dep) for m, deps in _graph().items() if m.split(".")[0] == package
           for dep in deps if dep.split(".")[0] not in ALLOWED[package]}
    assert not bad, sorted(bad)


def test_no_module_import_circle() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
