"""The package's import graph, read from the source (module-level and function-level imports):
edge/ and cloud/ never import each other, runtime/ and engine/ import neither, quant/ is never
imported by the engine, and no import cycle exists anywhere."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import edgecloud

ROOT = Path(edgecloud.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ["edgecloud", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    if node.level:
        base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    for alias in node.names:
        yield f"{target}.{alias.name}" if f"{target}.{alias.name}" in MODULES else target


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):  # every scope, functions too
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(module, path, node):
                    while target not in MODULES and "." in target:
                        target = target.rsplit(".", 1)[0]
                    if target.startswith("edgecloud") and target != module:
                        deps.add(target)
        graph[module] = deps
    return graph


GRAPH = _graph()


def _in(module: str, package: str) -> bool:
    return module == f"edgecloud.{package}" or module.startswith(f"edgecloud.{package}.")


def test_the_graph_sees_function_level_imports() -> None:
    # hybrid imports the cloud client inside a function only: the walk must see it
    assert "edgecloud.remote.client" in GRAPH["edgecloud.hybrid"]
    assert len(GRAPH) > 50


def test_edge_and_cloud_never_import_each_other() -> None:
    crossing = [(m, d) for m, deps in GRAPH.items() for d in deps
                if (_in(m, "edge") and _in(d, "cloud")) or (_in(m, "cloud") and _in(d, "edge"))]
    assert crossing == []


def test_shared_layers_stay_below_both_sides() -> None:
    below = [(m, d) for m, deps in GRAPH.items() for d in deps
             if (_in(m, "runtime") or _in(m, "engine")) and any(_in(d, p) for p in ("edge", "cloud", "quant"))]
    assert below == []
    assert not [(m, d) for m, deps in GRAPH.items() if _in(m, "runtime") for d in deps if _in(d, "engine")]


def test_no_import_cycles() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    assert cycles == []
