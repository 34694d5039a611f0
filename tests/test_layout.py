"""The folders are the architecture: model (tensors), engine (scheduling, KV memory), server
(HTTP), bench (measurements); each imports only what is below it, and no module imports itself
back through others."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).parent.parent / "src"
# What each layer may not import, at any depth of a module's body (lazy imports count too).
FORBIDDEN = {
    "pagedserve.model": ("pagedserve.engine", "pagedserve.server", "pagedserve.bench"),
    "pagedserve.engine": ("pagedserve.server", "pagedserve.bench"),
    "pagedserve.server": ("pagedserve.bench",),
}


def _imports() -> dict[str, set[str]]:
    modules: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        modules[name] = {m for m in found if m.startswith("pagedserve")} - {name}
    return modules


MODULES = _imports()


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_each_layer_imports_only_what_is_below_it(layer):
    wrong = {
        module: sorted(m for m in imported if m.startswith(FORBIDDEN[layer]))
        for module, imported in MODULES.items()
        if module.startswith(layer)
    }
    assert {module: found for module, found in wrong.items() if found} == {}


def test_no_import_cycles():
    graph = {name: {m for m in imported if m in MODULES} for name, imported in MODULES.items()}
    cycles: set[tuple[str, ...]] = set()

    def visit(name: str, path: list[str]) -> None:
        for target in graph[name]:
            if target in path:
                cycles.add(tuple(sorted(path[path.index(target) :])))
            else:
                visit(target, [*path, target])

    for name in graph:
        visit(name, [name])
    assert cycles == set()
