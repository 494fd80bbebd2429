"""The architecture rules of ../shared/style.md, checked mechanically over the source tree."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]

#: Source folder -> the dotted package it installs as (pyproject's package-dir).
PACKAGE_DIRS = {"ggufkit": "ggufkit", "quant": "ggufkit.quant", "converters": "ggufkit.converters",
                "eval": "ggufkit.eval"}

#: Layers, lowest first: a module may import only from its own layer or a lower one.
LAYERS = ["format", "quant", "converters", "eval", "app"]

MAX_MODULE_LINES = 800

#: Layers inside quant/, lowest first (``core``: quant/__init__.py, registry.py and dispatch.py). A module
#: imports from its own layer or a lower one: the kernels never reach up to the table or llama-quantize's
#: rules, llama_quantize/ reads the kernels only through the registry and dispatch, target/ drives
#: llama_quantize/. Every module of quant/ other than the core lives in one of these sub-packages.
QUANT_LAYERS = ["kernels", "core", "imatrix", "llama_quantize", "target"]

#: Kernel families (sub-packages of quant/kernels/), lowest first; "" is the shared pieces at the top of
#: kernels/ (fp, worksharing, numba_loading, cuda_base: the retargeting every CUDA module builds on). A family
#: imports the shared pieces, itself and lower-ranked families (the k-quant subroutines serve the grid and
#: low-bit types), never a family of its own rank.
KERNEL_FAMILIES = {"": 0, "legacy": 1, "kquants": 2, "iq": 3, "lowbit": 3}


def layer_of(module: str) -> str:
    if module.startswith("ggufkit.quant"):
        return "quant"
    if module.startswith("ggufkit.converters"):
        return "converters"
    if module.startswith("ggufkit.eval"):
        return "eval"
    if module.startswith(("ggufkit.cli", "ggufkit.demo", "ggufkit.release")) or module in ("ggufkit.__main__",):
        return "app"
    return "format"


def source_modules() -> list[tuple[str, Path]]:
    out = []
    for folder, package in PACKAGE_DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out.append((".".join([package, *parts]), path))
    return out


def imported_modules(path: Path) -> list[tuple[str, bool]]:
    """(module, at_top_level) for every ggufkit/torch/numba/click import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        found.extend((n, id(node) in top_level) for n in names)
    return found


MODULES = source_modules()


@pytest.mark.parametrize(("module", "path"), MODULES, ids=[m for m, _ in MODULES])
def test_module_imports_only_its_own_layer_or_lower_ones(module: str, path: Path) -> None:
    mine = LAYERS.index(layer_of(module))
    for name, _ in imported_modules(path):
        if name.startswith("ggufkit"):
            assert LAYERS.index(layer_of(name)) <= mine, f"{module} imports {name} from a higher layer"


def quant_layer(module: str) -> str:
    parts = module.split(".")[2:]
    return "core" if not parts or parts[0] in ("registry", "dispatch") else parts[0]


def kernel_family(module: str) -> str:
    parts = module.split(".")[3:]
    return parts[0] if len(parts) > 1 or (parts and parts[0] in KERNEL_FAMILIES) else ""


def imported_package_modules(path: Path) -> list[str]:
    """Every ggufkit module the file imports, ``from package import module`` resolved to the module."""
    known = {module for module, _ in MODULES}
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("ggufkit")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.startswith("ggufkit"):
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known]
            found += subs or [node.module]
            if subs and len(subs) < len(node.names):
                found.append(node.module)
    return found


def _is_type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None) if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def runtime_imports(path: Path) -> set[str]:
    """Every ggufkit module the file imports when it runs, at any depth (inside functions too), as
    :func:`imported_package_modules` resolves them; imports under ``if TYPE_CHECKING:`` are left out."""
    known = {module for module, _ in MODULES}
    found: set[str] = set()
    stack: list[ast.AST] = [ast.parse(path.read_text(), filename=str(path))]
    while stack:
        node = stack.pop()
        if _is_type_checking_block(node):
            stack.extend(getattr(node, "orelse", []))
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("ggufkit"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.startswith("ggufkit"):
            subs = {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known}
            found.update(subs)
            if len(subs) < len(node.names):
                found.add(node.module)
        stack.extend(ast.iter_child_nodes(node))
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles: list[list[str]] = []
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
                    work.append((child, iter(sorted(graph[child]))))
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
                    cycles.append(sorted(component))
    return cycles


def test_cycle_finder_finds_a_circle_through_a_function_level_import(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("from ggufkit.format import writer\n")
    (tmp_path / "b.py").write_text("def f():\n    from ggufkit.format.reader import GGUFFile\n"
                                   "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                   "    from ggufkit.cli import cli\n")
    assert runtime_imports(tmp_path / "a.py") == {"ggufkit.format.writer"}
    assert runtime_imports(tmp_path / "b.py") == {"ggufkit.format.reader"}
    assert import_cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [["x", "y", "z"]]
    assert import_cycles({"x": {"y"}, "y": set()}) == []


def test_no_import_circles_between_modules_function_level_imports_included() -> None:
    known = {module for module, _ in MODULES}
    graph = {module: {m for m in runtime_imports(path) if m in known and m != module} for module, path in MODULES}
    cycles = import_cycles(graph)
    assert not cycles, "import circles (imports inside functions count; move the shared code lower): " + \
        "; ".join(" <-> ".join(c) for c in cycles)


QUANT_MODULES = [(m, p) for m, p in MODULES if layer_of(m) == "quant"]


@pytest.mark.parametrize(("module", "path"), QUANT_MODULES, ids=[m for m, _ in QUANT_MODULES])
def test_quant_modules_import_only_their_own_layer_or_lower_ones(module: str, path: Path) -> None:
    assert quant_layer(module) in QUANT_LAYERS, \
        f"{module}: quant/ keeps only __init__, registry and dispatch at the top; put it in {QUANT_LAYERS}"
    mine = QUANT_LAYERS.index(quant_layer(module))
    for name in imported_package_modules(path):
        if layer_of(name) == "quant":
            assert QUANT_LAYERS.index(quant_layer(name)) <= mine, f"{module} imports {name} from a higher layer"
            if quant_layer(module) == "kernels":
                own, other = kernel_family(module), kernel_family(name)
                assert other in (own, "") or KERNEL_FAMILIES[other] < KERNEL_FAMILIES[own], \
                    f"{module} imports {name}: kernel families import only shared pieces and lower families"


@pytest.mark.parametrize(("module", "path"), MODULES, ids=[m for m, _ in MODULES])
def test_click_only_in_cli_and_heavy_imports_never_at_module_level_outside_kernels(module: str, path: Path) -> None:
    for name, top in imported_modules(path):
        root = name.split(".")[0]
        if root == "click":
            assert module.startswith("ggufkit.cli"), f"{module} imports click"
        if root == "torch":
            assert module.startswith(("ggufkit.eval", "ggufkit.converters", "ggufkit.demo")), \
                f"{module} imports torch"
            assert module.startswith("ggufkit.eval") or not top, f"{module} imports torch at module level"


@pytest.mark.parametrize(("module", "path"), MODULES, ids=[m for m, _ in MODULES])
def test_modules_stay_under_the_line_budget(module: str, path: Path) -> None:
    assert len(path.read_text().splitlines()) <= MAX_MODULE_LINES


def test_help_imports_neither_numba_nor_torch() -> None:
    code = ("import sys\nfrom ggufkit.cli import cli\n"
            "try:\n    cli.main(['--help'], standalone_mode=False)\nexcept SystemExit:\n    pass\n"
            "bad = [m for m in ('numba', 'torch', 'transformers') if m in sys.modules]\n"
            "print('HEAVY', bad)\nassert not bad, bad\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_console_script_and_python_m_print_the_version() -> None:
    from ggufkit import __version__

    result = subprocess.run([sys.executable, "-m", "ggufkit", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and __version__ in result.stdout


def test_pyproject_lists_every_package() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = set(config["packages"])
    on_disk = {module for module, path in MODULES if path.name == "__init__.py"}
    assert on_disk == declared


def test_library_code_never_exits_prints_or_prompts() -> None:
    for module, path in MODULES:
        if layer_of(module) == "app":
            continue
        text = path.read_text()
        for pattern in (r"\bsys\.exit\(", r"\binput\(", r"click\.(prompt|confirm)"):
            assert not re.search(pattern, text), f"{module}: {pattern}"


def test_kernels_state_cache_and_never_use_fastmath() -> None:
    for path in sorted((ROOT / "quant").rglob("*.py")):
        text = path.read_text()
        assert "fastmath=True" not in text, path.name
        for match in re.finditer(r"@(?:numba\.)?(?:njit|jit|cuda\.jit)\(([^)]*)\)", text):
            assert "cache=" in match.group(1), f"{path.name}: {match.group(0)} does not state cache="
        assert not re.search(r"@(?:numba\.)?(?:njit|cuda\.jit)\s*$", text, re.M), f"{path.name}: bare decorator"


def test_ruff_is_clean() -> None:
    result = subprocess.run([sys.executable, "-m", "ruff", "check", str(ROOT)], capture_output=True, text=True,
                            cwd=ROOT)
    assert result.returncode == 0, result.stdout[-4000:]


def test_mypy_is_clean_on_every_package() -> None:
    files = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    assert set(files) == set(PACKAGE_DIRS), "mypy must check ggufkit/, converters/, quant/ and eval/"
    result = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental"], capture_output=True, text=True,
                            cwd=ROOT)
    assert result.returncode == 0, result.stdout[-4000:]


def test_numba_cuda_is_imported_only_by_the_cuda_kernel_modules() -> None:
    for module, path in MODULES:
        tree = ast.parse(path.read_text())
        cuda_imports = [n for n in ast.walk(tree)
                        if (isinstance(n, ast.Import) and any(a.name.startswith("numba.cuda") for a in n.names))
                        or (isinstance(n, ast.ImportFrom) and (n.module or "").startswith("numba")
                            and (n.module.startswith("numba.cuda") or any(a.name == "cuda" for a in n.names)))]
        if cuda_imports:
            assert re.fullmatch(r"ggufkit\.quant\.kernels\.(\w+\.cuda|cuda_base)", module), module


def test_no_package_module_shadows_a_standard_library_module() -> None:
    shadowing = [module for module, path in MODULES if path.stem in sys.stdlib_module_names]
    assert not shadowing, f"rename (inside the package they hide the standard library's): {shadowing}"


def _used_names() -> set[str]:
    """Every name, attribute and identifier-like string used anywhere in the packages, tests and benchmarks."""
    used: set[str] = set()
    for folder in (*PACKAGE_DIRS, "tests", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Name):
                    used.add(node.id)
                elif isinstance(node, ast.Attribute):
                    used.add(node.attr)
                elif isinstance(node, ast.alias):
                    used.add(node.name.rsplit(".", 1)[-1])
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                    used.add(node.value)
    return used


def test_the_format_layer_has_no_dead_functions() -> None:
    """Functions, classes and methods of ggufkit/*.py, ggufkit/format/ and quant/kernels/fp.py that nothing uses."""
    paths = [*sorted((ROOT / "ggufkit").glob("*.py")), *sorted((ROOT / "ggufkit" / "format").glob("*.py")),
             ROOT / "quant" / "kernels" / "fp.py"]
    used = _used_names()
    dead = []
    for path in paths:
        for node in ast.parse(path.read_text()).body:
            defs = [node] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else []
            if isinstance(node, ast.ClassDef):
                defs += [m for m in node.body if isinstance(m, ast.FunctionDef)]
            dead += [f"{path.relative_to(ROOT)}: {d.name}" for d in defs
                     if not d.name.startswith("__") and d.name not in used]
    assert not dead, "unused (remove them):\n" + "\n".join(dead)


#: A citation of notes that are not in this repository; cite upstream (file and function) instead.
NOTES_CITATION = re.compile(r"reference/|shared/|\breference §|\b(?:convert|quant|powerinfer|perplexity)\.md\b")
@pytest.mark.parametrize("folder", ["ggufkit", "converters", "quant", "eval", "registry.yaml"])
def test_package_code_cites_upstream_sources_not_notes_outside_the_repository(folder: str) -> None:
    target = ROOT / folder
    paths = [target] if target.is_file() else sorted(target.rglob("*.py"))
    found = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}" for path in paths
             for i, line in enumerate(path.read_text().splitlines(), 1) if NOTES_CITATION.search(line)]
    assert not found, "\n".join(found)


def test_architecture_md_names_every_package() -> None:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    packages = {path.parent.relative_to(ROOT).as_posix() for module, path in MODULES if path.name == "__init__.py"}
    for folder in sorted(packages):
        leaf = folder.rsplit("/", 1)[-1]
        assert f"`{folder}/`" in text or f"`{leaf}/`" in text or f"`{leaf}`" in text, \
            f"ARCHITECTURE.md does not say where {folder}/ sits"
