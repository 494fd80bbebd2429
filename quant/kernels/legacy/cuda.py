"""Numba CUDA kernels for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0: the CPU block math, compiled for the GPU.

The per-block functions of :mod:`ggufkit.quant.kernels.legacy.cpu` are compiled again as CUDA device functions by
:func:`ggufkit.quant.kernels.cuda_base.retarget`: ``fmul``/``fadd``/``fsub`` become libdevice's
``fmul_rn``/``fadd_rn``/``fsub_rn`` (never contracted into a fused multiply-add; NVIDIA/numba-cuda issue 118)
and every other block function its own CUDA version. Under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``)
the same rebinding runs the block math as plain Python on NumPy float32 scalars.

Launch layout: one thread per 32-element block (``cuda.grid(1)``), each writing only its own output
block. With an imatrix, one thread per row first computes the row's sigma^2 (a sequential sum, like
ggml), then the block kernel runs with ``cuda.local.array`` scratch.

Host wrappers ``quantize_rows_<t>_cuda(x, qw, out)`` / ``dequantize_rows_<t>_cuda(blocks, out)`` take
numpy arrays, copy in, launch, copy out, with the CPU kernels' signatures.

This is the only legacy module that imports ``numba.cuda``; F16 input widened on the device is
:func:`ggufkit.quant.kernels.cuda_base.quantize_f16_rows`, for every family. Kernels are ``cache=False``: they are built
per type from rebound functions, which Numba's on-disk cache cannot key (no stable module-level source).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import numba
import numpy as np
from numba import cuda

from ggufkit.quant.kernels.cuda_base import grid, primitives, retarget
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


@cache
def _device_funcs() -> dict[str, Any]:
    return retarget(legacy, _BLOCK_FUNCS, primitives())


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
    return grid(n, _THREADS)


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
