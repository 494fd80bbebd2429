"""format/'s own layering (issue 31): the gguf-split set sits above the single-file reader, and every
element count of the reader and the writer comes from the one ``tensor_shape.n_elements``."""

from __future__ import annotations

import ast
from pathlib import Path

from test_layout import MODULES, ROOT, import_cycles, runtime_imports

FORMAT = ROOT / "ggufkit" / "format"


def subpackage_graph(prefix: str) -> dict[str, set[str]]:
    """The runtime import graph (function-level imports included) among the modules under ``prefix``."""
    known = {module for module, _ in MODULES}
    return {m: {n for n in runtime_imports(p) if n in known and n != m and n.startswith(prefix)}
            for m, p in MODULES if m.startswith(prefix)}


def test_format_has_no_import_circle_function_level_imports_included() -> None:
    assert import_cycles(subpackage_graph("ggufkit.format")) == []


def test_the_single_file_reader_knows_nothing_of_shard_sets() -> None:
    assert "ggufkit.format.shards" not in runtime_imports(FORMAT / "reader.py")
    assert "ggufkit.format.reader" in runtime_imports(FORMAT / "shards.py")


def _n_elements_properties(path: Path) -> list[ast.FunctionDef]:
    tree = ast.parse(path.read_text())
    return [f for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
            for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "n_elements"]


def test_reader_and_writer_count_elements_with_the_one_n_elements() -> None:
    for name in ("reader.py", "writer.py"):
        path = FORMAT / name
        tree = ast.parse(path.read_text())
        imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    and node.module == "ggufkit.format.tensor_shape" for a in node.names}
        assert "n_elements" in imported, name
        props = _n_elements_properties(path)
        assert props, name
        for prop in props:
            ret = prop.body[-1]
            assert isinstance(ret, ast.Return) and isinstance(ret.value, ast.Call), name
            assert isinstance(ret.value.func, ast.Name) and ret.value.func.id == "n_elements", name
        products = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "prod"]
        assert not products, f"{name} multiplies dimensions itself"
