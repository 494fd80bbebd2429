"""What an installed ggufkit needs: declared dependencies only, package data from the wheel, no psutil.

The README's first command installs ``.[torch]`` without the test extra, and ``pip install .`` installs a
wheel, not the source tree; these tests check both from inside the test run (``.ci/run`` also runs them
for real in fresh virtual environments).
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"ggufkit": "ggufkit", "converters": "ggufkit/converters", "quant": "ggufkit/quant",
                "eval": "ggufkit/eval"}

#: Extras and the source files allowed to import their modules (besides the core dependencies).
EXTRA_SCOPES = {
    # The evaluator, the .bin/.pt checkpoint loader, and the demo (which builds a checkpoint and scores it).
    "torch": ("eval/", "converters/checkpoint.py", "converters/ssm_values.py", "converters/llama.py", "ggufkit/demo.py"),
}
#: Core dependencies nothing imports directly, each with the reason it is still needed at run time.
INDIRECT = {
    "protobuf": "transformers needs it to read a sentencepiece tokenizer.model (convert, --check)",
}


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, requirement
    return _norm(match.group(1))


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_requirement_name(r) for r in project["dependencies"]}
    extras = {name: {_requirement_name(r) for r in reqs} for name, reqs in project["optional-dependencies"].items()}
    return core, extras


def _modules_of(dists: set[str]) -> set[str]:
    """Top-level import names the installed distributions ``dists`` provide (pyyaml -> yaml, protobuf -> google)."""
    return {module for module, owners in importlib.metadata.packages_distributions().items()
            if any(_norm(d) in dists for d in owners)}


def _third_party_imports() -> dict[str, set[str]]:
    """Source file (relative to the repository) -> top-level names of every non-stdlib, non-ggufkit import."""
    found: dict[str, set[str]] = {}
    for folder in PACKAGE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            names: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Import):
                    names.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
            found[path.relative_to(ROOT).as_posix()] = {
                n for n in names if n not in sys.stdlib_module_names and n not in ("ggufkit", "__future__")}
    return found


def test_every_third_party_import_comes_from_the_dependencies_of_the_extra_that_reaches_it() -> None:
    core, extras = _declared()
    core_modules = _modules_of(core)
    missing = sorted(d for d in core | set().union(*(extras[e] for e in EXTRA_SCOPES))
                     if not _modules_of({d}))
    assert not missing, f"declared but not installed, cannot map to modules: {missing}"
    bad = []
    for source, names in _third_party_imports().items():
        allowed = set(core_modules)
        for extra, scope in EXTRA_SCOPES.items():
            if source.startswith(scope):
                allowed |= _modules_of(extras[extra])
        bad.extend(f"{source} imports {n}" for n in sorted(names - allowed))
    assert not bad, "undeclared run-time imports:\n" + "\n".join(bad)


def test_every_core_dependency_is_imported_by_the_package() -> None:
    core, _ = _declared()
    imported = set().union(*_third_party_imports().values())
    unused = sorted(d for d in core if d not in INDIRECT and not (_modules_of({d}) & imported))
    assert not unused, f"runtime dependencies nothing imports (move them to an extra or drop them): {unused}"
    assert not {"pytest", "pytest-benchmark", "psutil", "hypothesis", "mypy", "ruff"} & core


def test_psutil_is_not_needed_at_run_time() -> None:
    """The default ``--kld-mode auto`` path reads the available memory; with psutil unimportable it must work."""
    code = ("import sys\nsys.modules['psutil'] = None\n"
            "import torch\nfrom ggufkit.eval.kld_store import free_memory\n"
            "print(free_memory(torch.device('cpu')))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(result.stdout) > 0


def test_ppl_with_a_baseline_in_auto_mode_runs_without_psutil(tmp_path: Path) -> None:
    from eval_models import N_VOCAB, make_hf_model, write_model_gguf
    from gguf import GGMLQuantizationType as Q

    base = write_model_gguf(make_hf_model("llama", seed=5), "llama", tmp_path / "f32.gguf")
    quant = write_model_gguf(make_hf_model("llama", seed=5), "llama", tmp_path / "q8_0.gguf", Q.Q8_0)
    tokens = tmp_path / "t.txt"
    tokens.write_text(" ".join(map(str, np.random.default_rng(3).integers(3, N_VOCAB, 128).tolist())))
    code = ("import sys\nsys.modules['psutil'] = None\nfrom ggufkit.cli import main\n"
            f"main(['ppl', {str(quant)!r}, '--baseline', {str(base)!r}, '--tokens', {str(tokens)!r}, "
            "'--ctx', '64', '--device', 'cpu', '--json'])\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["kld"]["mode"] == "side-by-side"


def test_available_memory_is_linux_memavailable_not_free_pages() -> None:
    import psutil

    from ggufkit.sysmem import available_memory_bytes, parse_meminfo_available

    # psutil (test-only) is the oracle; memory moves between the two reads on a busy machine.
    assert available_memory_bytes() == pytest.approx(psutil.virtual_memory().available, rel=0.1, abs=512 << 20)
    text = "MemTotal:       16000000 kB\nMemFree:          100000 kB\nMemAvailable:    9000000 kB\n"
    assert parse_meminfo_available(text) == 9000000 * 1024
    assert parse_meminfo_available("MemTotal: 1 kB\nMemFree: 1 kB\n") is None  # kernels before 3.14


def _copy_sources(dest: Path) -> Path:
    """The files a wheel is built from, copied with symbolic links kept (ggufkit/registry.yaml is one)."""
    dest.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc", "*.pyc")
    for name in ("pyproject.toml", "README.md", "registry.yaml"):
        shutil.copy2(ROOT / name, dest / name)
    for folder in PACKAGE_DIRS:
        shutil.copytree(ROOT / folder, dest / folder, symlinks=True, ignore=ignore)
    return dest


@pytest.fixture(scope="module", params=["from-tree", "from-sdist"])
def wheel(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from the source tree (pip wheel .), or from an sdist of it (as from PyPI)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = _copy_sources(tmp / "src")
    if request.param == "from-sdist":
        code = "import sys\nfrom setuptools import build_meta\nprint(build_meta.build_sdist(sys.argv[1]))\n"
        result = subprocess.run([sys.executable, "-c", code, str(tmp / "sdist")], capture_output=True, text=True,
                                cwd=src)
        assert result.returncode == 0, result.stderr[-2000:]
        with tarfile.open(tmp / "sdist" / result.stdout.split()[-1]) as tar:
            tar.extractall(tmp / "unpacked", filter="data")
        (src,) = (tmp / "unpacked").iterdir()
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                             "-q", "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (found,) = (tmp / "dist").glob("ggufkit-*.whl")
    return found


def test_the_wheel_carries_every_module_and_the_package_data(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert z.read("ggufkit/registry.yaml") == (ROOT / "registry.yaml").read_bytes()  # the file, not a link
        assert z.read("ggufkit/eval/data/sample.txt") == (ROOT / "eval/data/sample.txt").read_bytes()
    modules = {f"{PACKAGE_DIRS[folder]}/{p.relative_to(ROOT / folder).as_posix()}"
               for folder in PACKAGE_DIRS for p in (ROOT / folder).rglob("*.py")}
    assert {n for n in names if n.endswith(".py")} == modules
    assert {"ggufkit/py.typed", "ggufkit/eval/data/README"} <= names
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    with zipfile.ZipFile(wheel) as z:
        requires = [line for line in z.read(metadata).decode().splitlines() if line.startswith("Requires-Dist:")]
    assert not any(re.search(r"pytest|psutil", r) and "extra ==" not in r for r in requires), requires


def test_the_installed_wheel_finds_its_registry_and_sample_text(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                             str(site), str(wheel)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    # Run from elsewhere, the installed copy first on the path (ahead of this checkout's editable install).
    code = (f"import sys\nsys.path.insert(0, {str(site)!r})\n"
            "import ggufkit.converters, ggufkit.eval\n"
            f"assert ggufkit.converters.__file__.startswith({str(site)!r}), ggufkit.converters.__file__\n"
            "from ggufkit.converters.registry import load_registry\n"
            "from ggufkit.eval.perplexity import sample_text\n"
            "print(len(load_registry().entries), len(sample_text()))\n"
            "from ggufkit.cli import main\nmain(['convert', '--list'])\n")
    run = tmp_path / "elsewhere"
    run.mkdir()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=run)
    assert result.returncode == 0, result.stderr[-2000:]
    from ggufkit.converters.registry import load_registry
    from ggufkit.eval.perplexity import sample_text

    assert result.stdout.splitlines()[0] == f"{len(load_registry().entries)} {len(sample_text())}"
    assert "LlamaForCausalLM" in result.stdout and "GPTNeoXForCausalLM" in result.stdout


def test_ci_runs_both_readme_set_up_commands_verbatim_and_the_wheel_check() -> None:
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", setup, re.S)
    assert len(commands) == 2 and "ggufkit demo" in commands[0] and "pytest" in commands[1]
    ci = (ROOT / ".ci" / "run").read_text()
    lines = [line.strip() for line in ci.splitlines()]
    for command in commands:
        assert command.strip() in lines, f".ci/run does not run the README's {command!r} verbatim"
    assert lines.index(commands[0].strip()) < lines.index(commands[1].strip())
    assert "pip\" wheel --no-deps" in ci and "convert --list" in ci and "-m venv" in ci
    assert ci.rstrip().splitlines()[-1] == "done"  # nothing runs after the loop whose last stage is pytest
