"""docs/DESIGN.md's module table is the tree's, and the layers it states hold."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import module_table  # noqa: E402


def test_the_module_table_is_generated_from_the_tree():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "module_table.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr


def layer_imports() -> list[tuple[str, str, str]]:
    """(importing layer, imported layer, file) for every import of another layer."""
    edges = []
    package = ROOT / "vllm_kvdisk"
    for path in package.rglob("*.py"):
        src = path.parent.name if path.parent != package else ""
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "vllm_kvdisk" and len(parts) > 1 and parts[1] != src:
                    edges.append((src, parts[1], str(path.relative_to(ROOT))))
    return edges


def test_each_layer_imports_only_the_layers_above_it():
    order = [layer for layer, _ in module_table.LAYERS]
    wrong = [
        (src, dst, f)
        for src, dst, f in layer_imports()
        if src and (dst not in order or order.index(dst) > order.index(src))
    ]
    assert not wrong, wrong
    # The check sees real imports: the connector does import the core and storage.
    assert ("connector", "storage", "vllm_kvdisk/connector/worker.py") in layer_imports()


def test_the_tests_the_docs_cite_exist():
    """README and docs cite tests as `test_file::test_name` (a trailing … abbreviates) or
    `test_file`: each must name a test that exists."""
    import re

    tests = ROOT / "tests"
    cited = []
    for doc in [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "deploy" / "README.md",
    ]:
        for m in re.finditer(
            r"`(test_\w+)(?:::(\w+)(…)?)?`|\[(test_\w+)::(\w+)(…)?", doc.read_text()
        ):
            module, name, short = (
                (m.group(1), m.group(2), m.group(3))
                if m.group(1)
                else (m.group(4), m.group(5), m.group(6))
            )
            cited.append((doc.name, module, name, short))
    assert len(cited) > 10
    missing = []
    for doc, module, name, short in cited:
        path = tests / f"{module}.py"
        if not path.exists():
            missing.append((doc, module))
            continue
        if name:
            defs = re.findall(r"^def (test_\w+)", path.read_text(), re.M)
            if not any(d == name or (short and d.startswith(name)) for d in defs):
                missing.append((doc, f"{module}::{name}"))
    assert not missing, missing
