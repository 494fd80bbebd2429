"""Numba CUDA kernels for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0: the CPU block math, compiled for the GPU.

The per-block functions of :mod:`ggufkit.quant.kernels.legacy.cpu` are compiled again as CUDA device functions by
:func:`retarget`: each function's Python code is rebound to a namespace where ``fmul``/``fadd``/``fsub``
are libdevice's ``fmul_rn``/``fadd_rn``/``fsub_rn`` and every other block function is its own CUDA
version. Round-to-nearest intrinsics are never contracted into a fused multiply-add, which NVVM otherwise
does by default (NVIDIA/numba-cuda#118); with every product that feeds a sum (and every sum) going through
them, each step rounds exactly once, as ggml's reference (NVIDIA/numba-cuda issue 118). Under the CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``) the same rebinding runs the block math as plain Python on NumPy float32
scalars, a second, independent execution of the code.

Launch layout: one thread per 32-element block (``cuda.grid(1)``), each writing only its own output
block. With an imatrix, one thread per row first computes the row's sigma^2 (a sequential sum, like
ggml), then the block kernel runs with ``cuda.local.array`` scratch.

Host wrappers ``quantize_rows_<t>_cuda(x, qw, out)`` / ``dequantize_rows_<t>_cuda(blocks, out)`` take
numpy arrays, copy in, launch, copy out, with the CPU kernels' signatures.

This is the only legacy module that imports ``numba.cuda``. Kernels are ``cache=False``: they are built
per type from rebound functions, which Numba's on-disk cache cannot key (no stable module-level source).
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
from ggufkit.quant.kernels.legacy import cpu as legacy

_THREADS = 128

#: The block math of legacy.py, in dependency-free order (rebinding is lazy, so order is cosmetic).
_BLOCK_FUNCS = (
    "c_float_to_i32", "c_int8", "c_float_to_int8", "c_float_to_uint8", "store_f16", "load_f16", "make_qx_quants", "make_qkx3_quants", "row_sigma2",
    "legacy_weights", "store_q5", "load_qh",
    "q4_0_ref_block", "q4_0_imat_block", "q4_0_deq_block",
    "q4_1_ref_block", "q4_1_imat_block", "q4_1_deq_block",
    "q5_0_ref_block", "q5_0_imat_block", "q5_0_deq_block",
    "q5_1_ref_block", "q5_1_imat_block", "q5_1_deq_block",
    "q8_0_ref_block", "q8_0_imat_block", "q8_0_deq_block",
)


def is_available() -> bool:
    """Whether Numba sees a usable CUDA GPU (always False under the simulator's absence of hardware)."""
    try:
        return bool(cuda.is_available())
    except Exception:  # a broken driver install must read as "no GPU", not crash "--device auto"
        return False


def _primitives() -> dict[str, Any]:
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


@cache
def _device_funcs() -> dict[str, Any]:
    return retarget(legacy, _BLOCK_FUNCS, _primitives())


def _make_kernels(prefix: str) -> tuple[Any, Any, Any, Any]:
    """Build the four kernels of one type around its rebound block functions (closures, so cache=False)."""
    dev = _device_funcs()
    ref_block = dev[f"{prefix}_ref_block"]
    imat_block = dev[f"{prefix}_imat_block"]
    deq_block = dev[f"{prefix}_deq_block"]
    row_sigma2 = dev["row_sigma2"]
    f32 = numba.float32
    i32 = numba.int32

    @cuda.jit(cache=False)
    def k_ref(x, out, nb, total):
        t = cuda.grid(1)
        if t < total:
            ref_block(x, t // nb, t % nb, out)

    @cuda.jit(cache=False)
    def k_sigma2(x, s2):
        r = cuda.grid(1)
        if r < x.shape[0]:
            s2[r] = row_sigma2(x, r)

    @cuda.jit(cache=False)
    def k_imat(x, qw, s2, out, nb, total):
        t = cuda.grid(1)
        if t < total:
            w = cuda.local.array(32, f32)
            L = cuda.local.array(32, i32)
            Laux = cuda.local.array(32, i32)
            r = t // nb
            imat_block(x, r, t % nb, qw, s2[r], w, L, Laux, out)

    @cuda.jit(cache=False)
    def k_deq(blocks, y, nb, total):
        t = cuda.grid(1)
        if t < total:
            deq_block(blocks, t // nb, t % nb, y)

    return k_ref, k_sigma2, k_imat, k_deq


@cache
def _kernels(prefix: str) -> tuple[Any, Any, Any, Any]:
    return _make_kernels(prefix)


def _grid(n: int) -> int:
    return max(1, (n + _THREADS - 1) // _THREADS)


def _launch_quantize(prefix: str, d_x: Any, d_qw: Any, d_out: Any) -> None:
    k_ref, k_sigma2, k_imat, _ = _kernels(prefix)
    n_rows, n = d_x.shape
    nb = n // 32
    total = n_rows * nb
    if total == 0:
        return
    if d_qw is None or prefix == "q8_0":  # ggml's quantize_q8_0 ignores the imatrix
        k_ref[_grid(total), _THREADS](d_x, d_out, nb, total)
    else:
        d_s2 = cuda.device_array(n_rows, dtype=np.float32)
        k_sigma2[_grid(n_rows), _THREADS](d_x, d_s2)
        k_imat[_grid(total), _THREADS](d_x, d_qw, d_s2, d_out, nb, total)


def quantize_device(qtype: Any, d_x: Any, d_qw: Any, d_out: Any) -> None:
    """Quantize arrays already on the GPU (no copies): the kernel-only path, used by the GPU benchmark.

    Args:
        qtype: a legacy GGMLQuantizationType.
        d_x: device float32[n_rows, n_per_row]; d_qw: device float32[n_per_row] or None;
        d_out: device uint8[n_rows, row_bytes].
    """
    _launch_quantize(qtype.name.lower(), d_x, d_qw, d_out)


def _quantize(prefix: str, x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    if x.shape[0] * (x.shape[1] // 32) == 0:
        return
    d_x = cuda.to_device(np.ascontiguousarray(x, dtype=np.float32))
    d_out = cuda.device_array(out.shape, dtype=np.uint8)
    d_qw = cuda.to_device(np.ascontiguousarray(qw, dtype=np.float32)) if qw.shape[0] else None
    _launch_quantize(prefix, d_x, d_qw, d_out)
    d_out.copy_to_host(out)


def _dequantize(prefix: str, blocks: np.ndarray, out: np.ndarray) -> None:
    k_deq = _kernels(prefix)[3]
    nb = out.shape[1] // 32
    total = out.shape[0] * nb
    if total == 0:
        return
    d_b = cuda.to_device(np.ascontiguousarray(blocks))
    d_y = cuda.device_array(out.shape, dtype=np.float32)
    k_deq[_grid(total), _THREADS](d_b, d_y, nb, total)
    d_y.copy_to_host(out)


def _wrappers(prefix: str) -> tuple[Callable[..., None], Callable[..., None]]:
    def q(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
        _quantize(prefix, x, qw, out)

    def dq(blocks: np.ndarray, out: np.ndarray) -> None:
        _dequantize(prefix, blocks, out)

    q.__name__ = f"quantize_rows_{prefix}_cuda"
    q.__doc__ = (f"{prefix.upper()} rows on the GPU, same contract as ``legacy.quantize_rows_{prefix}``: "
                 "x float32[n_rows, n_per_row], qw float32[n_per_row] or [0], out uint8[n_rows, row_bytes].")
    dq.__name__ = f"dequantize_rows_{prefix}_cuda"
    dq.__doc__ = f"{prefix.upper()} blocks uint8[n_rows, row_bytes] -> out float32[n_rows, n_per_row] on the GPU."
    return q, dq


quantize_rows_q4_0_cuda, dequantize_rows_q4_0_cuda = _wrappers("q4_0")
quantize_rows_q4_1_cuda, dequantize_rows_q4_1_cuda = _wrappers("q4_1")
quantize_rows_q5_0_cuda, dequantize_rows_q5_0_cuda = _wrappers("q5_0")
quantize_rows_q5_1_cuda, dequantize_rows_q5_1_cuda = _wrappers("q5_1")
quantize_rows_q8_0_cuda, dequantize_rows_q8_0_cuda = _wrappers("q8_0")


# --- F16 input widened on the device -------------------------------------------------------------------
# Uploading the F16 bits and widening them on the GPU moves half the bytes of a float32 upload, and the
# host-to-device copy, not the kernels, bounds the end-to-end rate. Widening is exact (ggml's
# GGML_FP16_TO_FP32), so the bytes are the same as for a host-side widening.

_NO_BAD = np.iinfo(np.int64).max


@cache
def _widen_kernel() -> Any:
    f16_to_f32 = retarget(fp, ("fp16_to_fp32",), _primitives())["fp16_to_fp32"]

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
    _widen_kernel()[_grid(total), _THREADS](cuda.to_device(np.ascontiguousarray(h)), d_x, d_bad, n, total)
    bad = int(d_bad.copy_to_host()[0])
    if bad != _NO_BAD:
        return bad
    d_qw = cuda.to_device(np.ascontiguousarray(qw, dtype=np.float32)) if qw.shape[0] else None
    d_out = cuda.device_array(out.shape, dtype=np.uint8)
    quantize_device(qtype, d_x, d_qw, d_out)
    d_out.copy_to_host(out)
    return -1
