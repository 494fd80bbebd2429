"""Numba CUDA kernels for Q4_K, Q5_K and Q6_K: the CPU block math of :mod:`ggufkit.quant.kernels.kquants.cpu`, on the GPU.

The per-block functions of :mod:`ggufkit.quant.kernels.kquants.cpu` and the subroutines of
:mod:`ggufkit.quant.kernels.kquants.subroutines` are compiled again as CUDA device functions with
:func:`ggufkit.quant.kernels.cuda_base.retarget`: ``fmul``/``fadd``/``fsub`` become libdevice's ``*_rn``
intrinsics, which NVVM never contracts into a fused multiply-add (it does by default; NVIDIA/numba-cuda#118),
so every step rounds once, as in ggml's reference build (NVIDIA/numba-cuda issue 118). Under the CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``) the same code runs as Python on NumPy float32 scalars.

Launch layout: one thread per 256-weight super-block (``cuda.grid(1)``), scratch in ``cuda.local.array``,
each thread writing only its own output block. Host wrappers ``quantize_rows_<t>_cuda(x, qw, out)`` /
``dequantize_rows_<t>_cuda(blocks, out)`` take numpy arrays (same signatures as the CPU kernels), copy in,
launch and copy out.

Kernels are ``cache=False``: they close over the rebound device functions, which Numba's on-disk cache
cannot key.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numba
import numpy as np
from gguf import GGMLQuantizationType
from numba import cuda

from ggufkit.quant.kernels import fp
from ggufkit.quant.kernels.cuda_base import primitives, retarget
from ggufkit.quant.kernels.kquants import cpu as kquants
from ggufkit.quant.kernels.kquants import subroutines as kquants_math

_THREADS = 64  # each thread holds ~0.8 KB of local scratch; small thread blocks keep occupancy up

_FP_FUNCS = ("_rint_pos", "fp32_to_fp16", "fp32_to_fp16_x86", "fp16_to_fp32")
_MATH_FUNCS = ("_mantissa_bits", "nearest_int_full", "round_clamp", "_in_fast_range", "_qkx_round", "_qkx_sums",
               "_qkx_err", "make_qkx_quants", "make_qx_quants", "make_qp_quants", "make_q3_quants",
               "get_scale_min_k4")
_BLOCK_FUNCS = ("_q45k_finish_block", "q45k_quantize_block", "q45k_dequantize_block",
                "_q6k_finish_block", "q6k_quantize_block", "q6k_dequantize_block")


@cache
def device_funcs() -> dict[str, Any]:
    """The k-quant block math and its subroutines as CUDA device functions (the low-bit types build on them)."""
    # Bottom-up, so each layer's calls reach the CUDA versions of the layer below.
    prims = primitives()
    fp_dev = retarget(fp, _FP_FUNCS, prims)
    math_dev = retarget(kquants_math, _MATH_FUNCS, {**prims, **fp_dev})
    return {**fp_dev, **math_dev, **retarget(kquants, _BLOCK_FUNCS, {**prims, **fp_dev, **math_dev})}


@cache
def _kernels() -> dict[str, Any]:
    dev = device_funcs()
    q45k_quantize_block = dev["q45k_quantize_block"]
    q45k_dequantize_block = dev["q45k_dequantize_block"]
    q6k_quantize_block = dev["q6k_quantize_block"]
    q6k_dequantize_block = dev["q6k_dequantize_block"]
    u8 = numba.uint8
    f32 = numba.float32
    q6_bytes = kquants.Q6_K_BYTES  # closure constants, frozen into the kernels

    @cuda.jit(cache=False)
    def k_q45k(x, qw, use_qw, nmax, type_size, out, nb, total):
        t = cuda.grid(1)
        if t < total:
            r = t // nb
            b = t - r * nb
            L = cuda.local.array(256, u8)
            Laux = cuda.local.array(64, f32)
            w = cuda.local.array(32, f32)
            scales = cuda.local.array(8, f32)
            mins = cuda.local.array(8, f32)
            sw = cuda.local.array(8, f32)
            Ls = cuda.local.array(8, u8)
            Lm = cuda.local.array(8, u8)
            q45k_quantize_block(x[r, b * 256:(b + 1) * 256], qw[b * 256:(b + 1) * 256], use_qw, nmax,
                                out[r, b * type_size:(b + 1) * type_size], L, Laux, w, scales, mins, sw, Ls, Lm)

    @cuda.jit(cache=False)
    def k_q6k(x, qw, use_qw, out, nb, total):
        t = cuda.grid(1)
        if t < total:
            r = t // nb
            b = t - r * nb
            L = cuda.local.array(256, u8)
            scales = cuda.local.array(16, f32)
            buf = cuda.local.array(64, f32)
            q6k_quantize_block(x[r, b * 256:(b + 1) * 256], qw[b * 256:(b + 1) * 256], use_qw,
                               out[r, b * q6_bytes:(b + 1) * q6_bytes], L, scales, buf)

    @cuda.jit(cache=False)
    def k_deq_q45k(blocks, nmax, type_size, y, nb, total):
        t = cuda.grid(1)
        if t < total:
            r = t // nb
            b = t - r * nb
            q45k_dequantize_block(blocks[r, b * type_size:(b + 1) * type_size], nmax, y[r, b * 256:(b + 1) * 256])

    @cuda.jit(cache=False)
    def k_deq_q6k(blocks, y, nb, total):
        t = cuda.grid(1)
        if t < total:
            r = t // nb
            b = t - r * nb
            q6k_dequantize_block(blocks[r, b * q6_bytes:(b + 1) * q6_bytes], y[r, b * 256:(b + 1) * 256])

    return {"q45k": k_q45k, "q6k": k_q6k, "deq_q45k": k_deq_q45k, "deq_q6k": k_deq_q6k}


def _grid(total: int) -> int:
    return max(1, (total + _THREADS - 1) // _THREADS)


def _launch_quantize(qtype: Any, d_x: Any, d_qw: Any, d_out: Any) -> None:
    n_rows, n_per_row = d_x.shape
    nb = n_per_row // 256
    total = n_rows * nb
    if total == 0:
        return
    use_qw = d_qw is not None
    if not use_qw:
        d_qw = cuda.device_array(1, np.float32)  # the kernel still needs an array to slice; never read
    if qtype.name == "Q6_K":
        _kernels()["q6k"][_grid(total), _THREADS](d_x, d_qw, use_qw, d_out, nb, total)
    else:
        nmax, type_size = (15, kquants.Q4_K_BYTES) if qtype.name == "Q4_K" else (31, kquants.Q5_K_BYTES)
        _kernels()["q45k"][_grid(total), _THREADS](d_x, d_qw, use_qw, nmax, type_size, d_out, nb, total)


def quantize_device(qtype: Any, d_x: Any, d_qw: Any, d_out: Any) -> None:
    """Quantize arrays already on the GPU (no copies): the kernel-only path, used by the GPU benchmark.

    Args:
        qtype: GGMLQuantizationType Q4_K, Q5_K or Q6_K.
        d_x: device float32[n_rows, n_per_row]; d_qw: device float32[n_per_row] or None;
        d_out: device uint8[n_rows, row_bytes].
    """
    _launch_quantize(qtype, d_x, d_qw, d_out)


def _quantize(qtype: Any, x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    if x.shape[0] * (x.shape[1] // 256) == 0:
        return
    d_x = cuda.to_device(np.ascontiguousarray(x, dtype=np.float32))
    d_qw = cuda.to_device(np.ascontiguousarray(qw, dtype=np.float32)) if qw.shape[0] else None
    d_out = cuda.device_array(out.shape, np.uint8)
    _launch_quantize(qtype, d_x, d_qw, d_out)
    d_out.copy_to_host(out)


def quantize_rows_q4_K_cuda(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """CUDA twin of :func:`ggufkit.quant.kernels.kquants.cpu.quantize_rows_q4_K` (same arguments, same bytes)."""
    _quantize(GGMLQuantizationType.Q4_K, x, qw, out)


def quantize_rows_q5_K_cuda(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """CUDA twin of :func:`ggufkit.quant.kernels.kquants.cpu.quantize_rows_q5_K` (same arguments, same bytes)."""
    _quantize(GGMLQuantizationType.Q5_K, x, qw, out)


def quantize_rows_q6_K_cuda(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """CUDA twin of :func:`ggufkit.quant.kernels.kquants.cpu.quantize_rows_q6_K` (same arguments, same bytes)."""
    _quantize(GGMLQuantizationType.Q6_K, x, qw, out)


def _dequantize_q45k(blocks: np.ndarray, out: np.ndarray, nmax: int, type_size: int) -> None:
    nb = out.shape[1] // 256
    total = out.shape[0] * nb
    if total == 0:
        return
    d_y = cuda.device_array(out.shape, np.float32)
    _kernels()["deq_q45k"][_grid(total), _THREADS](cuda.to_device(blocks), nmax, type_size, d_y, nb, total)
    d_y.copy_to_host(out)


def dequantize_rows_q4_K_cuda(blocks: np.ndarray, out: np.ndarray) -> None:
    """CUDA twin of :func:`ggufkit.quant.kernels.kquants.cpu.dequantize_rows_q4_K`."""
    _dequantize_q45k(blocks, out, 15, kquants.Q4_K_BYTES)


def dequantize_rows_q5_K_cuda(blocks: np.ndarray, out: np.ndarray) -> None:
    """CUDA twin of :func:`ggufkit.quant.kernels.kquants.cpu.dequantize_rows_q5_K`."""
    _dequantize_q45k(blocks, out, 31, kquants.Q5_K_BYTES)


def dequantize_rows_q6_K_cuda(blocks: np.ndarray, out: np.ndarray) -> None:
    """CUDA twin of :func:`ggufkit.quant.kernels.kquants.cpu.dequantize_rows_q6_K`."""
    nb = out.shape[1] // 256
    total = out.shape[0] * nb
    if total == 0:
        return
    d_y = cuda.device_array(out.shape, np.float32)
    _kernels()["deq_q6k"][_grid(total), _THREADS](cuda.to_device(blocks), d_y, nb, total)
    d_y.copy_to_host(out)
