"""Where the tests find PowerInfer's own ``main`` and ``quantize``, the oracles for PowerInfer (PWRI) files.

They are built once, at *install* time, by the README's test command (``python tests/powerinfer_build.py``),
never during a test run: ``build()`` runs ``../shared/tools/build-powerinfer.sh DEST`` (PowerInfer commit
d3ebd7c from ``../shared/third_party/``, CPU only, about 5 minutes on 2 cores; a second call returns at
once). It also compiles PowerInfer's ggml (``ggml.c``, ``ggml-quants.c``, ...) into one shared library with
``-ffp-contract=off`` (``reference_lib()``): PowerInfer's ``quantize`` is built with ``-march=native``, where GCC
fuses ``a*b+c`` into FMA instructions, which moves a few rounding ties; the same C without contraction is
ggml's reference arithmetic, the oracle for ggufkit's bytes. ``GGUFKIT_POWERINFER`` overrides DEST (default ``~/.cache/ggufkit/powerinfer-d3ebd7c``) and
``GGUFKIT_POWERINFER_SCRIPT`` the build script.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

POWERINFER_COMMIT = "d3ebd7c"
TOOLS = ("main", "quantize")
_REPO = Path(__file__).resolve().parent.parent


def dest_dir() -> Path:
    """The build directory (``GGUFKIT_POWERINFER`` or ``~/.cache/ggufkit/powerinfer-d3ebd7c``)."""
    default = Path.home() / ".cache" / "ggufkit" / f"powerinfer-{POWERINFER_COMMIT}"
    return Path(os.environ.get("GGUFKIT_POWERINFER", default))


def bin_dir() -> Path:
    """Directory holding ``main`` and ``quantize``."""
    return dest_dir() / "bin"


def tool_path(name: str) -> Path:
    """Path of ``main`` or ``quantize``; fails loudly (not a skip) when they were not built."""
    path = bin_dir() / name
    if not path.is_file():
        raise FileNotFoundError(f"PowerInfer's {name} not found at {path}; run `python tests/powerinfer_build.py` "
                                "(the README's test command builds PowerInfer once)")
    return path


def build_script() -> Path:
    """``../shared/tools/build-powerinfer.sh`` beside the repository (``GGUFKIT_POWERINFER_SCRIPT`` overrides)."""
    script = Path(os.environ.get("GGUFKIT_POWERINFER_SCRIPT", _REPO.parent / "shared" / "tools"
                                 / "build-powerinfer.sh"))
    if not script.is_file():
        raise FileNotFoundError(f"{script} not found: PowerInfer's build script lives in ../shared/tools/ beside "
                                "the repository (set GGUFKIT_POWERINFER_SCRIPT to its path)")
    return script


#: PowerInfer's ggml sources that make up the reference library (all of ggml, none of llama).
_GGML_SOURCES = ("ggml.c", "ggml-quants.c", "ggml-alloc.c", "ggml-backend.c")
_LIB_NAME = "libggml-powerinfer-nocontract.so"


def reference_lib() -> Path:
    """PowerInfer's ggml compiled without FMA contraction; fails loudly (not a skip) when it was not built."""
    path = dest_dir() / "lib" / _LIB_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; run `python tests/powerinfer_build.py`")
    return path


def build() -> Path:
    """Build ``main``, ``quantize`` and the reference library (idempotent). Returns :func:`bin_dir`."""
    if not all((bin_dir() / t).is_file() for t in TOOLS):
        subprocess.run(["bash", str(build_script()), str(dest_dir())], check=True, stdout=subprocess.DEVNULL)
    for t in TOOLS:
        tool_path(t)
    lib = dest_dir() / "lib" / _LIB_NAME
    if not lib.is_file():
        src = dest_dir() / "src"  # build-powerinfer.sh leaves PowerInfer's sources there
        lib.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(".tmp")
        subprocess.run(["cc", "-O3", "-march=native", "-ffp-contract=off", "-std=gnu11", "-fPIC", "-shared",
                        "-DNDEBUG", "-D_GNU_SOURCE", "-w", *(str(src / f) for f in _GGML_SOURCES), "-o", str(tmp),
                        "-lm", "-lpthread"], check=True)
        os.replace(tmp, lib)
    return bin_dir()


if __name__ == "__main__":
    print(build())
