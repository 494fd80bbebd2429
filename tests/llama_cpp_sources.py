"""Where the tests find llama.cpp: its sources (tokenizer test vectors, the reference converter) and ggml.

The sources come from the llama-cpp-python 0.3.36 source distribution on PyPI. They are fetched at
*install* time by the README's test command (``python tests/llama_cpp_sources.py``), never during a test
run. The same command fetches the published GGUF files of :mod:`real_models` and the released tokenizers of
:mod:`real_tokenizers`. ``GGUFKIT_LLAMA_CPP_SRC`` overrides the location.

ggml's shared libraries come from the installed ``llama-cpp-python`` wheel (``llama_cpp/lib``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
_DEFAULT_ROOT = Path.home() / ".cache" / "ggufkit" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"


def sdist_root() -> Path:
    """The unpacked llama-cpp-python sdist (contains ``vendor/llama.cpp``)."""
    return Path(os.environ.get("GGUFKIT_LLAMA_CPP_SRC", _DEFAULT_ROOT))


def llama_cpp_dir() -> Path:
    """``vendor/llama.cpp`` of the sdist; fails loudly (not a skip) when it was not fetched."""
    path = sdist_root() / "vendor" / "llama.cpp"
    if not (path / "models").is_dir():
        raise FileNotFoundError(
            f"llama.cpp sources not found at {path}; run `python tests/llama_cpp_sources.py` "
            "(the README's test command does this)")
    return path


def vocab_dir() -> Path:
    """``models/`` with ``ggml-vocab-*.gguf`` and their ``.inp``/``.out`` test vectors."""
    return llama_cpp_dir() / "models"


def ggml_lib_dir() -> Path:
    """Directory holding ``libggml-base.so`` and ``libllama.so`` from the installed llama-cpp-python."""
    import llama_cpp

    return Path(llama_cpp.__file__).parent / "lib"


def fetch(root: Path | None = None) -> Path:
    """Download and unpack the sdist into ``root`` (idempotent). Returns ``root``."""
    root = root or sdist_root()
    if (root / "vendor" / "llama.cpp" / "models").is_dir():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", tmp], check=True)
        archive = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        os.replace(Path(tmp) / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}", root)
    return root


#: llama.cpp's own tools, the oracles where llama-cpp-python's bindings cannot serve (an imatrix given to
#: whole-file quantization, llama-imatrix, llama-perplexity, llama-export-lora).
TOOLS = ("llama-quantize", "llama-imatrix", "llama-perplexity", "llama-export-lora")


def tools_dir() -> Path:
    """Where :func:`build_tools` puts the tool binaries (``GGUFKIT_LLAMA_CPP_TOOLS`` overrides)."""
    default = sdist_root().parent / f"llama_cpp_tools-{LLAMA_CPP_PYTHON_VERSION}"
    return Path(os.environ.get("GGUFKIT_LLAMA_CPP_TOOLS", default)) / "bin"


def tool_path(name: str) -> Path:
    """Path of one built tool (e.g. ``llama-quantize``); fails loudly (not a skip) when it was not built."""
    path = tools_dir() / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; run `python tests/llama_cpp_sources.py` "
                                "(the README's test command builds llama.cpp's tools once)")
    return path


def build_tools() -> Path:
    """Build :data:`TOOLS` from the vendored llama.cpp with cmake (idempotent; ~10 min on 2 cores).

    Static libraries so the binaries stand alone; CPU backend only; default (native) CPU flags, as the
    llama-cpp-python wheel built on this machine has them, so ggml's quantizers round the same way.
    """
    bin_dir = tools_dir()
    if all((bin_dir / t).is_file() for t in TOOLS):
        return bin_dir
    src = llama_cpp_dir()
    build = bin_dir.parent / "build"
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF",
                    "-DLLAMA_BUILD_TOOLS=ON"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "--config", "Release", "-j", str(os.cpu_count() or 2),
                    "--target", *TOOLS], check=True, stdout=subprocess.DEVNULL)
    bin_dir.mkdir(parents=True, exist_ok=True)
    for t in TOOLS:
        os.replace(build / "bin" / t, bin_dir / t)
    return bin_dir


if __name__ == "__main__":
    import real_models
    import real_tokenizers

    print(fetch())
    print(build_tools())
    for path in real_models.fetch_all():
        print(path)
    for path in real_tokenizers.fetch_all():
        print(path)
