"""The package's shape, read from the source (module-level and function-level imports, and the AST).

* No arrow runs back up between packages: each package imports only packages ranked below it
  (:data:`RANKS`, lowest first), and no import cycle exists anywhere.
* edge/ and serving/ never import each other; runtime/ and engine/ import neither (nor remote/ or
  quant/); edge never imports quant; config imports nothing but types, errors and store;
  collaboration talks to a Backend, never to serving or remote code.
* The request path (everything ``edgecloud.client`` reaches) never imports router training.
* No module but the answer recorder writes a route field; nothing in ``src/`` finds a capability
  with ``hasattr``, ``getattr`` or ``except AttributeError`` (capabilities are Protocols and class
  attributes).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import edgecloud

ROOT = Path(edgecloud.__file__).resolve().parent

#: Packages (and top-level modules) from the bottom up; a package may import only those before it.
RANKS: list[set[str]] = [
    {"_version", "errors"},
    {"tools"},
    {"completion"},
    {"types"},
    {"store"},
    {"config"},
    {"runtime", "observability", "capabilities"},
    {"engine"},
    {"backend"},
    {"edge", "remote"},
    {"registry", "quant"},
    {"serving"},
    {"router"},
    {"answer"},
    {"fallback"},
    {"redaction"},
    {"collab"},
    {"hybrid"},
    {"client"},
    {"router.training", "bridge", "testing"},
    {"cli"},
    {"__main__", ""},
]


def _modules() -> dict[str, Path]:
    """edgecloud's modules: .py files in its packages (a folder without ``__init__.py`` is data the
    package ships, such as the vLLM plugin, which runs in vLLM's Python and probes vLLM's classes)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        if any(not (folder / "__init__.py").exists() for folder in path.parents if folder.is_relative_to(ROOT)):
            continue
        parts = ["edgecloud", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()
TREES = {module: ast.parse(path.read_text(encoding="utf-8")) for module, path in MODULES.items()}


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
        for node in ast.walk(TREES[module]):  # every scope, functions too
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


def _package(module: str) -> str:
    parts = module.split(".")[1:]
    if parts[:2] == ["router", "training"]:
        return "router.training"
    return parts[0] if parts else ""


def _rank(package: str) -> int:
    return next(i for i, level in enumerate(RANKS) if package in level)


def test_the_graph_sees_function_level_imports() -> None:
    # hybrid imports the cloud client inside a function only: the walk must see it
    assert "edgecloud.remote.client" in GRAPH["edgecloud.hybrid"]
    assert len(GRAPH) > 50


def test_every_package_has_a_rank() -> None:
    assert {_package(m) for m in MODULES} <= set().union(*RANKS)


def test_no_arrow_runs_back_up() -> None:
    upward = [(m, d) for m, deps in GRAPH.items() for d in deps if _rank(_package(d)) > _rank(_package(m))]
    assert upward == []


def test_edge_and_serving_never_import_each_other() -> None:
    crossing = [(m, d) for m, deps in GRAPH.items() for d in deps
                if (_in(m, "edge") and _in(d, "serving")) or (_in(m, "serving") and _in(d, "edge"))]
    assert crossing == []


def test_shared_layers_stay_below_both_sides() -> None:
    below = [(m, d) for m, deps in GRAPH.items() for d in deps
             if (_in(m, "runtime") or _in(m, "engine")) and any(_in(d, p) for p in ("edge", "serving", "remote", "quant"))]
    assert below == []
    assert not [(m, d) for m, deps in GRAPH.items() if _in(m, "runtime") for d in deps if _in(d, "engine")]


def test_edge_never_imports_quant_and_collab_talks_to_backends() -> None:
    assert [(m, d) for m, deps in GRAPH.items() if _in(m, "edge") for d in deps if _in(d, "quant")] == []
    assert [(m, d) for m, deps in GRAPH.items() if _in(m, "collab") for d in deps
            if _in(d, "serving") or _in(d, "remote")] == []


def test_config_imports_only_types_errors_and_store() -> None:
    allowed = ("types", "errors", "store", "tools", "_version")
    assert [d for d in GRAPH["edgecloud.config"] if not any(_in(d, p) for p in allowed)] == []


def test_the_request_path_never_imports_router_training() -> None:
    reached, todo = set(), ["edgecloud.client"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += GRAPH.get(module, ())
    assert "edgecloud.hybrid" in reached and "edgecloud.remote.client" in reached
    assert sorted(m for m in reached if _in(m, "router.training")) == []


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


# ------------------------------------------------------------------ the route record and capabilities

ROUTE_FIELDS = {"target", "backend", "reason", "score", "fallbacks", "notes", "tokens", "cloud_calls", "collab"}


def _through_route(node: ast.AST) -> bool:
    """Whether an attribute chain reaches a route field through something called ``route``
    (``route.reason``, ``self.route.fallbacks[-1]``, ``chunk.route.tokens``)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if not (isinstance(node, ast.Attribute) and node.attr in ROUTE_FIELDS):
        return False
    owner = node.value
    return (isinstance(owner, ast.Name) and owner.id == "route") or (
        isinstance(owner, ast.Attribute) and owner.attr == "route")


def _route_writes(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "append", "extend", "insert", "clear", "pop", "remove", "update"):
            targets = [node.func.value]
        for target in targets:
            parts = target.elts if isinstance(target, ast.Tuple) else [target]
            if any(_through_route(p) for p in parts):
                lines.append(node.lineno)
    return lines


def test_the_check_finds_the_writes_it_is_about() -> None:
    tree = ast.parse("route.reason += 'x'\nself.route.target = 'cloud'\nowner.route.fallbacks.append({})\n"
                     "owner.route.fallbacks[-1]['resume_s'] = 1\nchunk.route.tokens, n = {}, 1\nslot.tokens.append(1)\n")
    assert sorted(_route_writes(tree)) == [1, 2, 3, 4, 5]


def test_only_the_recorder_writes_route_fields() -> None:
    writes = {m: lines for m, tree in TREES.items() if m != "edgecloud.answer" and (lines := _route_writes(tree))}
    assert writes == {}
    assert _route_writes(TREES["edgecloud.answer"])  # the recorder does


def test_capabilities_are_not_found_by_attribute_probing() -> None:
    found = []
    for module, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr"):
                found.append((module, node.lineno, node.func.id))
            if isinstance(node, ast.ExceptHandler) and node.type is not None and "AttributeError" in ast.unparse(node.type):
                found.append((module, node.lineno, "except AttributeError"))
    assert found == []
