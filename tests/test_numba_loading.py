"""Cached kernels load without Numba's compiler set-up, and compiling still works (ggufkit.quant.kernels.numba_loading)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from ggml_oracle import ggml_quantize
from gguf import GGMLQuantizationType as T

# Quantizes a fixed array, then compiles a new function that needs Numba's NumPy lowering and BLAS
# (np.sort, np.dot): the context refresh a cache load skipped must happen for that compile.
_PROBE = """
import sys, numpy as np, numba
from ggufkit.quant import quantize
x = np.linspace(-3, 5, 8 * 512, dtype=np.float32).reshape(8, 512)
out = quantize(x, {qtype}, threads=2)
lowering = "numba.np.arraymath" in sys.modules
@numba.njit
def fresh(a):
    return np.sort(a)[0] + np.dot(a, a)
print(out.tobytes().hex(), lowering, fresh(np.arange(5.0)))
"""


def _run_probe(qtype: T, cache_dir: Path) -> list[str]:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir)}
    result = subprocess.run([sys.executable, "-c", _PROBE.format(qtype=int(qtype))], env=env,
                            capture_output=True, text=True, check=True)
    return result.stdout.split()


def test_a_cache_miss_compiles_and_a_cache_hit_loads_without_the_lowering_modules(tmp_path: Path) -> None:
    qtype = T.Q8_0
    expected = ggml_quantize(np.linspace(-3, 5, 8 * 512, dtype=np.float32).reshape(8, 512), qtype)
    compiled = _run_probe(qtype, tmp_path)  # empty cache: the kernel is compiled (and cached)
    loaded = _run_probe(qtype, tmp_path)  # the same kernel, now from the cache
    assert any(tmp_path.rglob("*.nbi")), "the first run must have written Numba's cache"
    for hex_bytes, _, fresh in (compiled, loaded):
        assert bytes.fromhex(hex_bytes) == expected.tobytes()
        assert float(fresh) == 30.0  # 0 + (0 + 1 + 4 + 9 + 16)
    assert compiled[1] == "True"  # compiling needed (and imported) Numba's lowering modules
    assert loaded[1] == "False"  # loading from the cache did not
