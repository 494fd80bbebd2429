"""release/'s modules import one way (issue 31): each imports only the release modules listed before it,
imports inside functions included, so no two of them hold each other apart by a late import."""

from __future__ import annotations

import ast
from pathlib import Path

RELEASE = Path(__file__).resolve().parents[1] / "ggufkit" / "release"

#: Lowest first. mix parses ``MIX@`` entries (no release imports), plan checks the options and fixes the
#: names, manifest keeps the records, sizes predicts the files, steps runs them (MIX searches included),
#: evaluate/plot/push/card render and ship, the package assembles the release.
ORDER = ["mix", "plan", "manifest", "sizes", "steps", "evaluate", "plot", "push", "card", "__init__"]


def release_imports(path: Path) -> set[str]:
    """The ``ggufkit.release`` modules a file imports, at any depth (``__init__`` for the package itself)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] if node.module != "ggufkit.release" else \
                [f"ggufkit.release.{a.name}" if (RELEASE / f"{a.name}.py").is_file() else "ggufkit.release"
                 for a in node.names]
        for name in names:
            if name == "ggufkit.release":
                found.add("__init__")
            elif name.startswith("ggufkit.release."):
                found.add(name.removeprefix("ggufkit.release.").split(".")[0])
    return found


def upward_imports(folder: Path) -> list[str]:
    """``a -> b`` for every import of a release module listed at or after the importer in :data:`ORDER`."""
    problems = []
    for i, module in enumerate(ORDER):
        for name in sorted(release_imports(folder / f"{module}.py") - {module}):
            if ORDER.index(name) > i:
                problems.append(f"{module} -> {name}")
    return problems


def test_every_release_module_is_in_the_order() -> None:
    assert sorted(p.stem for p in RELEASE.glob("*.py")) == sorted(ORDER)


def test_release_modules_import_only_the_ones_below_them_function_level_imports_included() -> None:
    assert upward_imports(RELEASE) == []


def test_an_import_inside_a_function_counts(tmp_path: Path) -> None:
    for module in ORDER:
        (tmp_path / f"{module}.py").write_text("")
    (tmp_path / "mix.py").write_text("def f():\n    from ggufkit.release.steps import quant_inputs\n")
    assert upward_imports(tmp_path) == ["mix -> steps"]
