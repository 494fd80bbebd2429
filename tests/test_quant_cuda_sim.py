"""CUDA kernels == CPU kernels, byte for byte, under Numba's CUDA simulator (CI has no GPU).

``NUMBA_ENABLE_CUDASIM=1`` must be set before Numba is imported, so the CUDA side runs in one
subprocess (module-scoped fixture) over every type in ``ggufkit.quant.KERNELS``; the tests, parametrised
from the same registry, read its results. Inputs are tiny: the simulator runs device code as Python.

The simulator cannot show NVVM's FMA contraction; benchmarks/gpu_quant_check.py repeats this comparison
on a real GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ggufkit.quant import KERNELS

_WORKER = r"""
import json, sys, warnings
import numpy as np
warnings.simplefilter("ignore")  # overflow warnings of the simulated float32 scalars on the edge rows
np.seterr(all="ignore")
from ggufkit.errors import QuantizationError
from ggufkit.quant import KERNELS, quantize

results = {}
rng = np.random.default_rng(0)
for qtype, k in KERNELS.items():
    if not k.cuda_module:  # CPU-only (grid) types
        continue
    rec = {}
    try:
        gq, gdq = k.cuda()
        cq, cdq = k.cpu()
        n = 2 * k.block_size if k.block_size == 32 else k.block_size
        x = (rng.standard_normal((5, n)) * 0.05).astype(np.float32)
        x[1, : n // 2] = 0.0                        # an all-zero block
        x[2] = rng.integers(-8, 9, n).astype(np.float32) / 4   # .5 ties
        x[3] *= np.float32(1e-39)                   # subnormals: 1/d overflows to inf
        x[4] *= np.float32(1e38)                    # huge: sums of squares overflow
        qw = rng.uniform(0.0, 2.0, n).astype(np.float32)
        for label, w in (("ref", np.zeros(0, np.float32)), ("imatrix", qw)):
            a = np.zeros((5, k.row_bytes(n)), np.uint8)
            b = np.full_like(a, 0xAB)
            cq(x, w, a)
            gq(x, w, b)
            rec[label] = bool(np.array_equal(a, b))
        ya = np.zeros(x.shape, np.float32)
        yb = np.full_like(ya, 7.0)
        cdq(a, ya)
        gdq(a, yb)
        same = (ya.view(np.uint32) == yb.view(np.uint32)) | (np.isnan(ya) & np.isnan(yb))
        rec["dequantize"] = bool(same.all())
        # F16 input through the public API: on the GPU it is uploaded as bits and widened there.
        x16 = (rng.standard_normal((3, n)) * 0.05).astype(np.float16)
        rec["f16_device"] = all(
            np.array_equal(quantize(x16, qtype, imatrix=w, device="cpu"),
                           quantize(x16, qtype, imatrix=w, device="cuda"))
            for w in (None, qw))
        x16[1, 3] = np.inf
        messages = []
        for device in ("cpu", "cuda"):
            try:
                quantize(x16, qtype, device=device, name="t")
                messages.append(None)
            except QuantizationError as exc:
                messages.append(str(exc))
        rec["f16_non_finite"] = messages[0] is not None and messages[0] == messages[1]
    except Exception as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
    results[qtype.name] = rec
print("RESULTS" + json.dumps(results))
"""


@pytest.fixture(scope="module")
def sim_results() -> dict[str, dict]:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run([sys.executable, "-c", _WORKER], capture_output=True, text=True, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS")), None)
    assert line is not None, f"simulator worker failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(line[len("RESULTS"):])


@pytest.mark.cudasim
@pytest.mark.parametrize("path", ["ref", "imatrix", "dequantize", "f16_device", "f16_non_finite"])
@pytest.mark.parametrize("qtype", [t for t, k in KERNELS.items() if k.cuda_module], ids=lambda t: t.name)
def test_cuda_kernel_matches_cpu_kernel_under_simulator(sim_results: dict[str, dict], qtype, path: str) -> None:
    rec = sim_results[qtype.name]
    assert "error" not in rec, rec.get("error")
    assert rec[path] is True


def test_every_cuda_module_builds_on_the_shared_cuda_base() -> None:
    """The retargeting, the libdevice primitives and the device-side F16 widening live in one module at the top
    of quant/kernels/ (issue 31); the families' CUDA modules import it, never legacy/cuda.py."""
    import ast
    import importlib.util

    from ggufkit.quant.kernels import cuda_base

    assert all(callable(getattr(cuda_base, n)) for n in ("retarget", "primitives", "quantize_f16_rows", "is_available"))
    modules = sorted({row.cuda_module for row in KERNELS.values() if row.has_cuda})
    assert modules == [f"ggufkit.quant.kernels.{f}.cuda" for f in ("kquants", "legacy", "lowbit")]
    for module in modules:
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin is not None
        with open(spec.origin) as f:
            tree = ast.parse(f.read())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "ggufkit.quant.kernels.cuda_base" in imported and "ggufkit.quant.kernels.legacy.cuda" not in imported
