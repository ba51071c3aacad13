"""Imports run one way (DESIGN.md, STYLE.md rule 10): between packages and inside each.

Type-only imports included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("common", "transfer", "prefill_node", "decode_node", "colocated_node", "bootstrap")
# `common` is four layers under one name, each a folder: the shared leaves (common/*.py,
# common/messages/), the model (common/model/), the node runtime both node roles share
# (common/node/) and the `pdserve` command with its launcher (common/launch/).
COMMON_LAYERS = ("model", "node", "launch")
# Which of our layers each layer may import.
ALLOWED = {
    "common": {"common"},
    "common.model": {"common", "common.model"},
    "common.node": {"common", "common.model", "common.node"},
    # Starts every role as a process (python -m ...): imports no role.
    "common.launch": {"common", "common.model", "common.node", "common.launch"},
    "transfer": {"common", "transfer"},
    "prefill_node": {"common", "common.model", "common.node", "transfer", "prefill_node"},
    "decode_node": {"common", "common.model", "common.node", "transfer", "decode_node"},
    # One process of both node roles: it composes them, nothing imports it.
    "colocated_node": {
        "common",
        "common.model",
        "common.node",
        "transfer",
        "prefill_node",
        "decode_node",
        "colocated_node",
    },
    # The gateway reads the model's files (tokenizer, spec) but runs no node code.
    "bootstrap": {"common", "common.model", "bootstrap"},
}


def _layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "common" and len(parts) > 1 and parts[1] in COMMON_LAYERS:
        return f"common.{parts[1]}"
    return parts[0]


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module of ours that `path` imports, anywhere in it (TYPE_CHECKING blocks too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from common import stages` imports the module common.stages (kept when it is one).
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            names = []
        found.update(n for n in names if n.split(".")[0] in PACKAGES)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        # Names that are not modules (`from common.x import Y`'s common.x.Y) drop out here.
        graph[name] = {m for m in _imports(path) if m in modules and m != name}
    return graph


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_a_layer_imports_only_the_layers_below_it(layer: str) -> None:
    bad = {
        (m, dep)
        for m, deps in _graph().items()
        if _layer(m) == layer
        for dep in deps
        if _layer(dep) not in ALLOWED[layer]
    }
    assert not bad, sorted(bad)


def test_every_module_has_a_layer() -> None:
    assert {_layer(m) for m in _graph()} == set(ALLOWED)


def test_no_module_import_circle() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                raise AssertionError(
                    "import circle: " + " -> ".join(path[path.index(dep) :] + [dep])
                )
            if dep not in state:
                visit(dep)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
