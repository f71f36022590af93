"""No import circle inside the package.

Shared vocabulary (params structs, prompts, wire messages) sits below the modules that use it
(docs/architecture.md). This test builds the package's import graph from the source with an AST
walk and asserts that it has no strongly connected component larger than one module.

Edges: ``import triollm.x`` and ``from triollm.x import y`` (``y`` counts as the module
``triollm.x.y`` when that file exists, else the edge goes to ``triollm.x``), relative imports
resolved, wherever the statement is:

- under ``if TYPE_CHECKING:`` too (issue 38: "no import circle, counting type-checking
  imports"). Such an import never runs, but it is a dependency all the same: the module cannot
  be read, type-checked or moved without the other, and a circle of them is the sign of a type
  that sits above its users. The cure is the one for any circle: move the shared type below
  both, or name what is needed with a Protocol (``actors/beam_search.py``: ``BeamEngine``).
  A cycle's report marks the edges that exist only for the type checker.
- inside functions too: a deferred import is still a dependency, usually deferred for load
  time (torch, an optional package) rather than to hide a circle, and the package has none.

Package ``__init__`` files. The implicit import of parent packages is left out (importing
``triollm.engine.x`` runs ``triollm/engine/__init__.py`` first, but that is no edge here), so a
package whose ``__init__`` re-exports its submodules is no circle by itself. A module that names
the package explicitly, ``from triollm.pkg import Name``, does get the edge to the ``__init__``
even when ``Name`` is defined in a submodule: it reads the package's namespace, which holds
``Name`` only once the ``__init__`` has reached the line that imports it. So a submodule of
``pkg`` (or anything the ``__init__`` imports) that imports ``Name`` from ``pkg`` rather than
from the submodule that defines it is reported as the circle it is: it works or fails with the
order of the ``__init__``'s imports. Import from the defining module inside a package.

Not seen: ``importlib.import_module`` with a computed name (the lazy names of
``triollm/__init__.py``, an ``EngineCoreFactory``'s "module:function").
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


def _imports(tree: ast.AST, type_checking: bool) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in the tree, at any depth; those under ``if TYPE_CHECKING:`` only
    with `type_checking`."""
    out: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append(node)
        if not type_checking and isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return out


def _edges(
    name: str, path: Path, modules: dict[str, Path], *, type_checking: bool = True
) -> set[str]:
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in _imports(ast.parse(path.read_text(), str(path)), type_checking):
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


def import_graph(*, type_checking: bool = True) -> dict[str, set[str]]:
    """Each module's imports of package modules; those only the type checker reads too, unless
    `type_checking` is false (then: what runs)."""
    modules = _modules()
    return {
        name: _edges(name, path, modules, type_checking=type_checking)
        for name, path in modules.items()
    }


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


def _describe(component: list[str], graph: dict[str, set[str]], runs: dict[str, set[str]]) -> str:
    """The component's edges, each module's on one line; `runs` (the graph without the
    type-checking imports) tells which edges only the type checker sees."""
    members = set(component)
    lines = [f"  {len(component)} modules:"]
    for name in component:
        inside = [
            target if target in runs.get(name, ()) else f"{target} (TYPE_CHECKING only)"
            for target in sorted(graph[name] & members)
        ]
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
    runs = _edges("triollm.p.x", modules["triollm.p.x"], modules, type_checking=False)
    assert runs == {"triollm.p.y", "triollm.w"}
    every = _edges("triollm.p.x", modules["triollm.p.x"], modules)
    assert every == {"triollm.p.y", "triollm.p.z", "triollm.w"}


def test_a_name_imported_from_a_package_is_an_edge_to_its_init(tmp_path: Path) -> None:
    # p/__init__.py re-exports A (from p.a) and B (from p.b); p.b takes A from the package rather
    # than from p.a: a real circle (it fails if the __init__ imports .b first), reported.
    files = {
        "__init__.py": "from .a import A\nfrom .b import B\n",
        "a.py": "A = 1\n",
        "b.py": "from triollm.p import A\nB = A\n",
        "c.py": "from triollm.p.a import A\n",  # from the defining module: no circle
    }
    for file, text in files.items():
        (tmp_path / file).write_text(text)
    modules = {
        "triollm.p": tmp_path / "__init__.py",
        "triollm.p.a": tmp_path / "a.py",
        "triollm.p.b": tmp_path / "b.py",
        "triollm.p.c": tmp_path / "c.py",
    }
    graph = {name: _edges(name, path, modules) for name, path in modules.items()}
    assert graph == {
        "triollm.p": {"triollm.p.a", "triollm.p.b"},
        "triollm.p.a": set(),
        "triollm.p.b": {"triollm.p"},
        "triollm.p.c": {"triollm.p.a"},
    }
    assert strongly_connected(graph) == [["triollm.p", "triollm.p.b"]]


def test_a_cycle_through_a_type_checking_import_is_reported_as_such() -> None:
    graph = {"a": {"b"}, "b": {"a"}}
    runs: dict[str, set[str]] = {"a": {"b"}, "b": set()}
    (component,) = strongly_connected(graph)
    assert _describe(component, graph, runs).splitlines()[1:] == [
        "    a -> b",
        "    b -> a (TYPE_CHECKING only)",
    ]


# The packages in import order: each imports only itself and those before it (docs/architecture.md:
# `api` -> `actors` -> `engine` -> `lora` -> `kernels`). Nothing below `api` imports the root modules (the
# facade `triollm/__init__.py` and vLLM's module paths sit above `actors`); `api` is the top.
LAYERS = ("kernels", "lora", "engine", "actors")


# Imports against that order that only the type checker reads, known and to be removed (a type
# below its users, or a Protocol). None today: lora/ names the engine's model with a Protocol
# (`LoRAModel`) and owns `LoRAConfig`.
KNOWN_TYPE_ONLY_UPWARD: set[str] = set()


def test_packages_import_one_way() -> None:
    graph = import_graph()
    runs = import_graph(type_checking=False)
    wrong = []
    type_only = set()
    for name, targets in graph.items():
        layer = name.split(".")[1] if name.count(".") else ""
        if layer not in LAYERS:
            continue
        allowed = LAYERS[: LAYERS.index(layer) + 1]
        for target in sorted(targets):
            if not target.count(".") or target.split(".")[1] not in allowed:
                edge = f"{name} -> {target}"
                if target in runs[name] or edge not in KNOWN_TYPE_ONLY_UPWARD:
                    wrong.append(edge)
                else:
                    type_only.add(edge)
    assert not wrong, "imports against the package order:\n  " + "\n  ".join(wrong)
    gone = sorted(KNOWN_TYPE_ONLY_UPWARD - type_only)
    assert not gone, "fixed (remove from KNOWN_TYPE_ONLY_UPWARD):\n  " + "\n  ".join(gone)


def test_no_import_cycles() -> None:
    """No circle, counting the imports under TYPE_CHECKING and those inside functions."""
    graph = import_graph()
    cycles = strongly_connected(graph)
    runs = import_graph(type_checking=False)
    report = "\n".join(_describe(component, graph, runs) for component in cycles)
    print(report)
    assert not cycles, f"import cycles inside the package:\n{report}"
