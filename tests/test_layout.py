"""Imports flow one way: no module of the package reaches back to one that imports it.

Every import of a ``vllm_kvdisk`` module counts, wherever it is written: at the top, inside
a function (a late import only hides a cycle from the interpreter, not from a reader), or
under ``TYPE_CHECKING``. The graph is read from the source with ``ast``; nothing is
imported.
"""

from __future__ import annotations

import ast
import pathlib

import vllm_kvdisk

PACKAGE = "vllm_kvdisk"
ROOT = pathlib.Path(vllm_kvdisk.__file__).parent


def module_files() -> dict[str, pathlib.Path]:
    """Dotted module name -> its file, for every module of the package."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = (PACKAGE, *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imported_modules(name: str, path: pathlib.Path, modules: set[str]) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in its source. ``from P import
    x`` names module ``P.x`` when there is one, else ``P`` itself."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package this module is in
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    found.add(f"{source}.{alias.name}")
                elif source in modules:
                    found.add(source)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imported_modules(name, path, set(files)) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_every_kind_of_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    real = import_graph()
    assert "vllm_kvdisk.core.format" in real["vllm_kvdisk.storage.fileread"]
    # A function-level import counts: the wiring builds the scheduler half late.
    assert "vllm_kvdisk.connector.scheduler" in real["vllm_kvdisk.connector.wiring"]


def test_the_package_has_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)
