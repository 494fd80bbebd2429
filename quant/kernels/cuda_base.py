"""The CUDA base every CUDA kernel module builds on: the CPU block math, compiled again for the GPU.

:func:`retarget` compiles a module's ``@numba.njit`` block functions again as CUDA device functions: each
function's Python code is rebound to a namespace where ``fmul``/``fadd``/``fsub`` are libdevice's
``fmul_rn``/``fadd_rn``/``fsub_rn`` (:func:`primitives`) and every other rebound function is its own CUDA
version. Round-to-nearest intrinsics are never contracted into a fused multiply-add, which NVVM otherwise does
by default (NVIDIA/numba-cuda issue 118); with every product that feeds a sum (and every sum) going through
them, each step rounds exactly once, as ggml's reference. Under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``)
the same rebinding runs the block math as plain Python on NumPy float32 scalars, a second, independent
execution of the code.

Also here: :func:`is_available` (``--device auto``) and :func:`quantize_f16_rows`, F16 input widened on the
device for any type's ``quantize_device``. The family modules (``kernels/<family>/cuda.py``) import this one;
kernels built from rebound functions are ``cache=False`` (Numba's on-disk cache cannot key them).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from functools import cache
from typing import Any

import numba
import numpy as np
from numba import cuda

from ggufkit.quant.kernels import fp

#: Threads per block of the widening kernel.
_THREADS = 128


def grid(n: int, threads: int) -> int:
    """Blocks of ``threads`` threads that cover ``n`` threads (at least one)."""
    return max(1, (n + threads - 1) // threads)


def is_available() -> bool:
    """Whether Numba sees a usable CUDA GPU (always False under the simulator's absence of hardware)."""
    try:
        return bool(cuda.is_available())
    except Exception:  # a broken driver install must read as "no GPU", not crash "--device auto"
        return False


def primitives() -> dict[str, Any]:
    if numba.config.ENABLE_CUDASIM:
        # The simulator runs device code as Python; NumPy float32 scalars round once per operation.
        return {"fmul": fp.fmul.py_func, "fadd": fp.fadd.py_func, "fsub": fp.fsub.py_func}
    from numba.cuda import libdevice

    @cuda.jit(device=True, cache=False)  # tiny wrappers; inlined into each kernel
    def fmul(a, b):
        return libdevice.fmul_rn(np.float32(a), np.float32(b))

    @cuda.jit(device=True, cache=False)
    def fadd(a, b):
        return libdevice.fadd_rn(np.float32(a), np.float32(b))

    @cuda.jit(device=True, cache=False)
    def fsub(a, b):
        return libdevice.fsub_rn(np.float32(a), np.float32(b))

    return {"fmul": fmul, "fadd": fadd, "fsub": fsub}


def retarget(module: types.ModuleType, names: tuple[str, ...], overrides: dict[str, Any]) -> dict[str, Any]:
    """Compile ``module``'s ``@numba.njit`` functions ``names`` again as CUDA device functions.

    Each function's code object is rebound to a copy of the module's globals in which ``overrides`` and the
    other rebound functions replace the CPU versions; Numba resolves globals when it compiles, so calls
    between the functions reach their CUDA versions.

    Args:
        module: the module holding the CPU block math (its functions are Numba dispatchers).
        names: the functions to rebind.
        overrides: extra names to replace (here the fmul/fadd/fsub primitives).

    Returns:
        name -> CUDA device function (in the simulator: a Python function).
    """
    namespace = dict(vars(module))
    namespace.update(overrides)
    out: dict[str, Any] = {}
    for name in names:
        py = getattr(module, name).py_func
        fn = types.FunctionType(py.__code__, namespace, name, py.__defaults__, py.__closure__)
        out[name] = fn if numba.config.ENABLE_CUDASIM else cuda.jit(device=True, cache=False)(fn)
    namespace.update(out)
    return out


# --- F16 input widened on the device -------------------------------------------------------------------
# Uploading the F16 bits and widening them on the GPU moves half the bytes of a float32 upload, and the
# host-to-device copy, not the kernels, bounds the end-to-end rate. Widening is exact (ggml's
# GGML_FP16_TO_FP32), so the bytes are the same as for a host-side widening.

_NO_BAD = np.iinfo(np.int64).max


@cache
def _widen_kernel() -> Any:
    f16_to_f32 = retarget(fp, ("fp16_to_fp32",), primitives())["fp16_to_fp32"]

    @cuda.jit(cache=False)
    def k_widen(h, x, bad, n, total):
        t = cuda.grid(1)
        if t < total:
            r = t // n
            c = t - r * n
            bits = h[r, c]
            x[r, c] = f16_to_f32(bits)
            if (bits & 0x7C00) == 0x7C00:  # inf or NaN: remember the first flat index
                cuda.atomic.min(bad, 0, t)

    return k_widen


def quantize_f16_rows(quantize_device: Callable[..., Any], qtype: Any, h: np.ndarray, qw: np.ndarray,
                      out: np.ndarray) -> int:
    """Quantize F16 rows on the GPU: upload the bits, widen on the device, quantize, download the blocks.

    Args:
        quantize_device: the ``quantize_device(qtype, d_x, d_qw, d_out)`` of the type's CUDA module.
        qtype: the target GGMLQuantizationType.
        h: uint16[n_rows, n_per_row] F16 bit patterns.
        qw: float32[n_per_row] imatrix or float32[0].
        out: uint8[n_rows, row_bytes], filled unless the input holds inf/NaN.

    Returns:
        -1, or the flat index of the first inf/NaN (then nothing was quantized).
    """
    n_rows, n = h.shape
    total = n_rows * n
    if total == 0:
        return -1
    d_x = cuda.device_array((n_rows, n), dtype=np.float32)
    d_bad = cuda.to_device(np.array([_NO_BAD], dtype=np.int64))
    _widen_kernel()[grid(total, _THREADS), _THREADS](cuda.to_device(np.ascontiguousarray(h)), d_x, d_bad, n, total)
    bad = int(d_bad.copy_to_host()[0])
    if bad != _NO_BAD:
        return bad
    d_qw = cuda.to_device(np.ascontiguousarray(qw, dtype=np.float32)) if qw.shape[0] else None
    d_out = cuda.device_array(out.shape, dtype=np.uint8)
    quantize_device(qtype, d_x, d_qw, d_out)
    d_out.copy_to_host(out)
    return -1
