"""Numba CUDA kernels for Q2_K, Q3_K, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0, MXFP4 and Q1_0: the CPU block math, on the GPU.

The per-block functions of :mod:`ggufkit.quant.kernels.kquants.cpu_low`, :mod:`~ggufkit.quant.kernels.lowbit.iq4`,
:mod:`~ggufkit.quant.kernels.lowbit.ternary`, :mod:`~ggufkit.quant.kernels.lowbit.mxfp4` and :mod:`~ggufkit.quant.kernels.lowbit.q1_0` are compiled again
as CUDA device functions with :func:`ggufkit.quant.kernels.cuda_base.retarget`, on top of the device versions of
the shared k-quant subroutines (:mod:`ggufkit.quant.kernels.kquants.cuda`): ``fmul``/``fadd``/``fsub`` become
libdevice's ``*_rn`` intrinsics, which NVVM never contracts into a fused multiply-add, so every step rounds
once, as in ggml's reference build. Under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) the same code runs
as Python on NumPy float32 scalars.

Launch layout: one thread per block (``cuda.grid(1)``), scratch in ``cuda.local.array``, each thread writing
only its own output block. Host wrappers ``quantize_rows_<t>_cuda(x, qw, out)`` /
``dequantize_rows_<t>_cuda(blocks, out)`` take numpy arrays (the CPU kernels' signatures), copy in, launch
and copy out; :func:`quantize_device` works on device arrays.

Kernels are ``cache=False``: they close over the rebound device functions, which Numba's on-disk cache
cannot key.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import numba
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from numba import cuda

from ggufkit.quant.kernels import fp
from ggufkit.quant.kernels.cuda_base import primitives, retarget
from ggufkit.quant.kernels.kquants import cpu_low as kquants_low
from ggufkit.quant.kernels.kquants.cuda import device_funcs as kquant_device_funcs
from ggufkit.quant.kernels.lowbit import iq4 as iq_nonlinear
from ggufkit.quant.kernels.lowbit import mxfp4, q1_0, ternary

T = GGMLQuantizationType
_THREADS = 64  # a Q2_K/Q3_K thread holds ~0.5 KB of local scratch; small thread blocks keep occupancy up

_MODULE_FUNCS = (
    (kquants_low, ("_c_int8", "_store_f16", "_load_f16", "_pack_2bit", "_row_sigma2_sum", "_pack_q3_scale",
                   "_q3_scale", "_q2k_finish_block", "q2k_quantize_block", "q2k_dequantize_block",
                   "_q3k_finish_block", "q3k_quantize_block", "q3k_dequantize_block")),
    (iq_nonlinear, ("best_index_iq4", "_nearest_value", "_fit_all", "iq4_quantize_block", "iq4_dequantize_block")),
    (ternary, ("_trit", "_absmax_scale", "_store_d", "tq1_0_quantize_block", "tq1_0_dequantize_block",
               "tq2_0_quantize_block", "tq2_0_dequantize_block")),
    (mxfp4, ("e8m0_to_fp32_half", "_e8m0_of_amax", "mxfp4_quantize_block",
             "mxfp4_dequantize_block")),
    (q1_0, ("q1_0_quantize_block", "q1_0_dequantize_block")),
)

#: Types that ignore the imatrix (as ggml does); their block function is ``f(x_block, out_block)``, MXFP4's
#: ``f(x_block, out_block, scratch)``.
_SIMPLE = {T.TQ1_0: "tq1_0", T.TQ2_0: "tq2_0", T.MXFP4: "mxfp4", T.Q1_0: "q1_0"}


@cache
def _device_funcs() -> dict[str, Any]:
    base = {**primitives(), **kquant_device_funcs()}
    base.update(retarget(fp, ("roundf",), base))
    out: dict[str, Any] = {}
    for module, names in _MODULE_FUNCS:
        out.update(retarget(module, names, {**base, **out}))
    return out


def _simple_kernels(q_block: Any, dq_block: Any, block: int, size: int, scratch: bool) -> tuple[Any, Any]:
    i64 = numba.int64

    @cuda.jit(cache=False)
    def k_q(x, out, nb, total):
        t = cuda.grid(1)
        if t < total:
            r = t // nb
            b = t - r * nb
            q_block(x[r, b * block:(b + 1) * block], out[r, b * size:(b + 1) * size])

    @cuda.jit(cache=False)
    def k_q_scratch(x, out, nb, total):
        t = cuda.grid(1)
        if t < total:
            r = t // nb
            b = t - r * nb
            bi = cuda.local.array(32, i64)
            q_block(x[r, b * block:(b + 1) * block], out[r, b * size:(b + 1) * size], bi)

    @cuda.jit(cache=False)
    def k_dq(blocks, y, nb, total):
        t = cuda.grid(1)
        if t < total:
            r = t // nb
            b = t - r * nb
            dq_block(blocks[r, b * size:(b + 1) * size], y[r, b * block:(b + 1) * block])

    return (k_q_scratch if scratch else k_q), k_dq


@cache
def _kernels() -> dict[str, Any]:
    dev = _device_funcs()
    q2k_q, q2k_dq = dev["q2k_quantize_block"], dev["q2k_dequantize_block"]
    q3k_q, q3k_dq = dev["q3k_quantize_block"], dev["q3k_dequantize_block"]
    iq4_q, iq4_dq = dev["iq4_quantize_block"], dev["iq4_dequantize_block"]
    u8 = numba.uint8
    f32 = numba.float32
    q2_bytes = kquants_low.Q2_K_BYTES  # closure constants, frozen into the kernels
    q3_bytes = kquants_low.Q3_K_BYTES

    @cuda.jit(cache=False)
    def k_q2k(x, qw, use_qw, out, nb, total):
        t = cuda.grid(1)
        if t < total:
            r = t // nb
            b = t - r * nb
            L = cuda.local.array(256, u8)
            Laux = cuda.local.array(32, f32)
            w = cuda.local.array(16, f32)
            scales = cuda.local.array(16, f32)
            mins = cuda.local.array(16, f32)
            sw = cuda.local.array(16, f32)
            Ls = cuda.local.array(16, u8)
            Lm = cuda.local.array(16, u8)
            q2k_q(x[r, b * 256:(b + 1) * 256], qw[b * 256:(b + 1) * 256], use_qw,
                  out[r, b * q2_bytes:(b + 1) * q2_bytes], L, Laux, w, scales, mins, sw, Ls, Lm)

    @cuda.jit(cache=False)
    def k_q3k(x, qw, use_qw, out, nb, total):
        t = cuda.grid(1)
        if t < total:
            r = t // nb
            b = t - r * nb
            L = cuda.local.array(256, u8)
            w = cuda.local.array(16, f32)
            scales = cuda.local.array(16, f32)
            sw = cuda.local.array(16, f32)
            Ls = cuda.local.array(16, u8)
            buf = cuda.local.array(64, f32)
            q3k_q(x[r, b * 256:(b + 1) * 256], qw[b * 256:(b + 1) * 256], use_qw,
                  out[r, b * q3_bytes:(b + 1) * q3_bytes], L, w, scales, sw, Ls, buf)

    @cuda.jit(cache=False)
    def k_iq4(x, qw, use_qw, nsub, size, out, nb, total):
        t = cuda.grid(1)
        if t < total:
            r = t // nb
            b = t - r * nb
            n = 32 * nsub
            L = cuda.local.array(256, u8)
            w = cuda.local.array(32, f32)
            scales = cuda.local.array(8, f32)
            fit = cuda.local.array(48, f32)
            iq4_q(x[r, b * n:(b + 1) * n], qw[b * n:(b + 1) * n], use_qw, nsub, out[r, b * size:(b + 1) * size],
                  L, w, scales, fit)

    @cuda.jit(cache=False)
    def k_deq_q2k(blocks, y, nb, total):
        t = cuda.grid(1)
        if t < total:
            r = t // nb
            b = t - r * nb
            q2k_dq(blocks[r, b * q2_bytes:(b + 1) * q2_bytes], y[r, b * 256:(b + 1) * 256])

    @cuda.jit(cache=False)
    def k_deq_q3k(blocks, y, nb, total):
        t = cuda.grid(1)
        if t < total:
            r = t // nb
            b = t - r * nb
            q3k_dq(blocks[r, b * q3_bytes:(b + 1) * q3_bytes], y[r, b * 256:(b + 1) * 256])

    @cuda.jit(cache=False)
    def k_deq_iq4(blocks, nsub, size, y, nb, total):
        t = cuda.grid(1)
        if t < total:
            r = t // nb
            b = t - r * nb
            n = 32 * nsub
            iq4_dq(blocks[r, b * size:(b + 1) * size], nsub, y[r, b * n:(b + 1) * n])

    kernels = {"q2k": k_q2k, "q3k": k_q3k, "iq4": k_iq4, "deq_q2k": k_deq_q2k, "deq_q3k": k_deq_q3k,
               "deq_iq4": k_deq_iq4}
    for qtype, prefix in _SIMPLE.items():
        block, size = GGML_QUANT_SIZES[qtype]
        kernels[prefix], kernels[f"deq_{prefix}"] = _simple_kernels(
            dev[f"{prefix}_quantize_block"], dev[f"{prefix}_dequantize_block"], block, size, qtype == T.MXFP4)
    return kernels


def _grid(total: int) -> int:
    return max(1, (total + _THREADS - 1) // _THREADS)


def quantize_device(qtype: Any, d_x: Any, d_qw: Any, d_out: Any) -> None:
    """Quantize arrays already on the GPU (no copies).

    Args:
        qtype: GGMLQuantizationType Q2_K, Q3_K, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0, MXFP4 or Q1_0.
        d_x: device float32[n_rows, n_per_row]; d_qw: device float32[n_per_row] or None;
        d_out: device uint8[n_rows, row_bytes].
    """
    qtype = T(qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    n_rows, n_per_row = d_x.shape
    nb = n_per_row // block
    total = n_rows * nb
    if total == 0:
        return
    k = _kernels()
    grid = _grid(total)
    if qtype in _SIMPLE:  # ggml_quantize_chunk ignores the imatrix for these
        k[_SIMPLE[qtype]][grid, _THREADS](d_x, d_out, nb, total)
        return
    use_qw = d_qw is not None
    if not use_qw:
        d_qw = cuda.device_array(1, np.float32)  # the kernel still needs an array to slice; never read
    if qtype == T.Q2_K:
        k["q2k"][grid, _THREADS](d_x, d_qw, use_qw, d_out, nb, total)
    elif qtype == T.Q3_K:
        k["q3k"][grid, _THREADS](d_x, d_qw, use_qw, d_out, nb, total)
    else:
        k["iq4"][grid, _THREADS](d_x, d_qw, use_qw, block // 32, size, d_out, nb, total)


def _dequantize_device(qtype: Any, d_b: Any, d_y: Any) -> None:
    block, size = GGML_QUANT_SIZES[qtype]
    nb = d_y.shape[1] // block
    total = d_y.shape[0] * nb
    if total == 0:
        return
    k = _kernels()
    grid = _grid(total)
    if qtype in _SIMPLE:
        k[f"deq_{_SIMPLE[qtype]}"][grid, _THREADS](d_b, d_y, nb, total)
    elif qtype == T.Q2_K:
        k["deq_q2k"][grid, _THREADS](d_b, d_y, nb, total)
    elif qtype == T.Q3_K:
        k["deq_q3k"][grid, _THREADS](d_b, d_y, nb, total)
    else:
        k["deq_iq4"][grid, _THREADS](d_b, block // 32, size, d_y, nb, total)


def _wrappers(qtype: Any) -> tuple[Callable[..., None], Callable[..., None]]:
    block = GGML_QUANT_SIZES[qtype][0]
    prefix = qtype.name.lower() if qtype.name[-2:] != "_K" else qtype.name[:-2].lower() + "_K"

    def q(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
        if x.shape[0] * (x.shape[1] // block) == 0:
            return
        d_x = cuda.to_device(np.ascontiguousarray(x, dtype=np.float32))
        d_qw = cuda.to_device(np.ascontiguousarray(qw, dtype=np.float32)) if qw.shape[0] else None
        d_out = cuda.device_array(out.shape, np.uint8)
        quantize_device(qtype, d_x, d_qw, d_out)
        d_out.copy_to_host(out)

    def dq(blocks: np.ndarray, out: np.ndarray) -> None:
        if out.shape[0] * (out.shape[1] // block) == 0:
            return
        d_y = cuda.device_array(out.shape, np.float32)
        _dequantize_device(qtype, cuda.to_device(np.ascontiguousarray(blocks)), d_y)
        d_y.copy_to_host(out)

    q.__name__ = f"quantize_rows_{prefix}_cuda"
    q.__doc__ = (f"{qtype.name} rows on the GPU, same contract and bytes as the CPU kernel: x float32[n_rows, "
                 "n_per_row], qw float32[n_per_row] or [0], out uint8[n_rows, row_bytes].")
    dq.__name__ = f"dequantize_rows_{prefix}_cuda"
    dq.__doc__ = f"{qtype.name} blocks uint8[n_rows, row_bytes] -> out float32[n_rows, n_per_row] on the GPU."
    return q, dq


quantize_rows_q2_K_cuda, dequantize_rows_q2_K_cuda = _wrappers(T.Q2_K)
quantize_rows_q3_K_cuda, dequantize_rows_q3_K_cuda = _wrappers(T.Q3_K)
quantize_rows_iq4_nl_cuda, dequantize_rows_iq4_nl_cuda = _wrappers(T.IQ4_NL)
quantize_rows_iq4_xs_cuda, dequantize_rows_iq4_xs_cuda = _wrappers(T.IQ4_XS)
quantize_rows_tq1_0_cuda, dequantize_rows_tq1_0_cuda = _wrappers(T.TQ1_0)
quantize_rows_tq2_0_cuda, dequantize_rows_tq2_0_cuda = _wrappers(T.TQ2_0)
quantize_rows_mxfp4_cuda, dequantize_rows_mxfp4_cuda = _wrappers(T.MXFP4)
quantize_rows_q1_0_cuda, dequantize_rows_q1_0_cuda = _wrappers(T.Q1_0)
