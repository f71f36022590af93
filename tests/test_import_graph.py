"""No import circle inside the package.

Shared vocabulary (params structs, prompts, wire messages) sits below the modules that use it
(docs/architecture.md). This test builds the package's import graph from the source with an AST
walk and asserts that it has no strongly connected component larger than one module.

Edges: ``import triollm.x`` and ``from triollm.x import y`` (``y`` counts as the module
``triollm.x.y`` when that file exists, else the edge goes to ``triollm.x``), relative imports
resolved, at module level and inside functions alike — a deferred import is still a dependency.
Imports under ``if TYPE_CHECKING:`` are left out (they never run). The implicit import of parent
packages is left out too (``triollm.engine.x`` does not depend on ``triollm/engine/__init__.py``
for this check), but a module that names a package ``__init__`` explicitly gets that edge.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "triollm"
SKIP = {"tests", "docs", ".venv", "build"}


def _modules() -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its ``__init__``)."""
    found: dict[str, Path] = {}
    for folder, subfolders, files in os.walk(ROOT):
        here = Path(folder)
        if here == ROOT:
            subfolders[:] = [name for name in subfolders if name not in SKIP]
        subfolders[:] = sorted(
            name for name in subfolders if not name.startswith(".") and name != "__pycache__"
        )
        for file in sorted(files):
            if not file.endswith(".py"):
                continue
            parts = [PACKAGE, *(here / file).relative_to(ROOT).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = here / file
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in the tree, at any depth, except those under TYPE_CHECKING."""
    out: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return out


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    targets.add(alias.name)
            continue
        if node.level:
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join([*base, node.module] if node.module else base)
        else:
            source = node.module or ""
        if source.split(".")[0] != PACKAGE:
            continue
        for alias in node.names:
            sub = f"{source}.{alias.name}"
            if sub in modules:
                targets.add(sub)
            elif source in modules:
                targets.add(source)
    targets.discard(name)
    return targets


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _edges(name, path, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; the components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    lines = [f"  {len(component)} modules:"]
    for name in component:
        inside = sorted(graph[name] & members)
        lines.append(f"    {name} -> {', '.join(inside)}")
    return "\n".join(lines)


def test_graph_sees_the_package() -> None:
    graph = import_graph()
    assert "triollm.engine.core" in graph
    assert "triollm.engine.request" in graph["triollm.engine.core"]
    assert not any(name.startswith(("triollm.tests", "triollm.docs")) for name in graph)


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert strongly_connected(graph) == [["a", "b", "c"]]


def test_edges_resolve_relative_and_deferred_imports(tmp_path: Path) -> None:
    (tmp_path / "x.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import y\n"
        "if TYPE_CHECKING:\n"
        "    from .z import Z\n"
        "def f():\n"
        "    from triollm.w import thing\n"
    )
    modules = {
        "triollm.p.x": tmp_path / "x.py",
        "triollm.p.y": tmp_path / "y.py",
        "triollm.p.z": tmp_path / "z.py",
        "triollm.w": tmp_path / "w.py",
    }
    assert _edges("triollm.p.x", modules["triollm.p.x"], modules) == {"triollm.p.y", "triollm.w"}


# The packages in import order: each imports only itself and those before it (docs/architecture.md:
# `api` -> `actors` -> `engine` -> `lora` -> `kernels`). Nothing below `api` imports the root modules (the
# facade `triollm/__init__.py` and vLLM's module paths sit above `actors`); `api` is the top.
LAYERS = ("kernels", "lora", "engine", "actors")


def test_packages_import_one_way() -> None:
    graph = import_graph()
    wrong = []
    for name, targets in graph.items():
        layer = name.split(".")[1] if name.count(".") else ""
        if layer not in LAYERS:
            continue
        allowed = LAYERS[: LAYERS.index(layer) + 1]
        for target in sorted(targets):
            if not target.count(".") or target.split(".")[1] not in allowed:
                wrong.append(f"{name} -> {target}")
    assert not wrong, "imports against the package order:\n  " + "\n  ".join(wrong)


def test_no_import_cycles() -> None:
    graph = import_graph()
    cycles = strongly_connected(graph)
    report = "\n".join(_describe(component, graph) for component in cycles)
    print(report)
    assert not cycles, f"import cycles inside the package:\n{report}"
