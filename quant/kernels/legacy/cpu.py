"""Numba CPU kernels for ggml's legacy 32-element block types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

Byte-identical to ``ggml_quantize_chunk`` (``ggml-quants.c``): the ``quantize_row_*_ref`` routines when
no importance matrix is given, the per-row ``quantize_row_*_impl`` routines with one (Q8_0 ignores it,
as ggml does). ggml-quants.c (quantize_row_q4_0_ref ... quantize_q8_0) holds the algorithms; the code follows its evaluation order.

Layout of the block math (numba-cuda's "write once, run on both targets" pattern):

* ``*_ref_block(x, r, b, out)`` / ``*_imat_block(x, r, b, qw, sigma2, w, L, Laux, out)`` /
  ``*_deq_block(blocks, r, b, y)`` quantize or dequantize block ``b`` of row ``r`` in place. They are plain
  ``@numba.njit`` functions over 2-D arrays with scalar arithmetic only (scratch arrays come from the
  caller), so ``quant/kernels/legacy/cuda.py`` compiles the *same Python functions* as CUDA device functions.
* Every product whose result is then added to or subtracted from goes through :func:`fp.fmul`. On the
  CPU that is a plain float32 multiply (Numba with ``fastmath=False`` never contracts); on CUDA the same
  name is bound to ``libdevice.fmul_rn``, which NVVM cannot fuse into an FMA (NVIDIA/numba-cuda issue 118: NVVM contracts a*b+c by default).
* ``quantize_rows_<t>`` / ``dequantize_rows_<t>`` are the CPU entry points: ``prange`` over blocks (or
  rows, with an imatrix, because ggml's weights depend on a whole-row statistic); each iteration writes
  only its own output block, so the thread count cannot change the bytes.

Every kernel is ``cache=True`` and ``fastmath=False``; ``error_model="numpy"`` gives C semantics for a
division by zero (inf/NaN instead of a Python exception) in the few divisions ggml does not guard.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from ggufkit.quant.kernels.fp import (
    fadd,
    fmul,
    fp16_to_fp32,
    fp32_to_fp16,
    fp32_to_fp16_x86,
    fsub,
    nearest_int,  # noqa: F401  (a global of make_qx_quants, which legacy/cuda.py retargets in this namespace)
    roundf,
)
from ggufkit.quant.kernels.legacy.fit import (
    NL,
    NL3,
    make_qkx3_quants,
    make_qkx3_quants_lanes,
    make_qx_quants,
    make_qx_quants_lanes,
)
from ggufkit.quant.kernels.legacy.ref import (
    q4_0_ref_row,
    q4_1_ref_row,
    q5_0_ref_row,
    q5_1_ref_row,
    q8_0_ref_row,
)

QK = 32  # elements per block for every type in this module
_F32_MAX = np.float32(3.4028234663852886e38)
_GROUP_MAX_EPS = np.float32(1e-15)  # ggml-quants.c GROUP_MAX_EPS
# Unsigned indices in the hot loops: Numba then skips negative-index wraparound, which otherwise turns the
# contiguous block loads into gathers (measured ~12 % faster for Q4_0; bytes unchanged).
_U = np.uintp

_jit = numba.njit(cache=True, fastmath=False, error_model="numpy")
_jit_par = numba.njit(cache=True, fastmath=False, error_model="numpy", parallel=True)


# --- C conversion semantics ---------------------------------------------------------------------------


@_jit
def c_float_to_i32(v: np.float32) -> int:
    """``(int)v`` as x86-64 compiles it (``cvttss2si``): truncation; NaN/out of range -> INT32_MIN.

    ggml narrows that int to ``int8_t``/``uint8_t``, which keeps the low byte. Only degenerate blocks
    (a subnormal scale whose reciprocal overflows to inf) ever reach the out-of-range case.
    """
    f = float(v)
    if f != f or f >= 2147483648.0 or f <= -2147483649.0:
        return -2147483648
    return int(f)


@_jit
def c_int8(i: int) -> int:
    """Wrap an int to ``int8_t`` (two's complement, keeps the low byte)."""
    return ((i + 128) & 0xFF) - 128


@_jit
def c_float_to_int8(v: np.float32) -> int:
    """``(int8_t)v``: the common in-range case directly, anything else through the x86 conversion."""
    if v > np.float32(-129.0) and v < np.float32(128.0):
        return int(v)
    return c_int8(c_float_to_i32(v))


@_jit
def c_float_to_uint8(v: np.float32) -> int:
    """``(uint8_t)v`` (via a 32-bit conversion, keeping the low byte, as x86-64 code does)."""
    if v >= np.float32(0.0) and v < np.float32(256.0):
        return int(v)
    return c_float_to_i32(v) & 0xFF


@_jit
def store_f16(out: np.ndarray, r: int, off: int, h: int) -> None:
    """Store f16 bits little-endian at ``out[r, off:off+2]``."""
    out[r, off] = h & 0xFF
    out[r, off + 1] = (h >> 8) & 0xFF


@_jit
def load_f16(blocks: np.ndarray, r: int, off: int) -> np.float32:
    """Read little-endian f16 bits at ``blocks[r, off:off+2]`` as float32."""
    return fp16_to_fp32(int(blocks[r, off]) | (int(blocks[r, off + 1]) << 8))





@_jit
def row_sigma2(x: np.ndarray, r: int) -> np.float32:
    """``(sum of x^2 over the whole row) / n_per_row``, summed sequentially (the legacy ``*_impl``)."""
    s = np.float32(0.0)
    for j in range(x.shape[1]):
        s = fadd(s, fmul(x[r, j], x[r, j]))
    return np.float32(s / np.float32(x.shape[1]))


@_jit
def legacy_weights(x: np.ndarray, r: int, b: int, qw: np.ndarray, sigma2: np.float32, w: np.ndarray) -> None:
    """``w[j] = qw[32b+j] * sqrtf(sigma2 + x_j*x_j)`` for block b of row r."""
    for j in range(QK):
        xj = x[r, b * QK + j]
        w[j] = np.float32(qw[b * QK + j] * np.float32(math.sqrt(fadd(sigma2, fmul(xj, xj)))))


# --- Q4_0: d f16 @0, qs[16] @2 ----------------------------------------------------------------------------


@_jit
def q4_0_ref_block(x: np.ndarray, r: int, b: int, out: np.ndarray) -> None:
    """Block b of row r as ``quantize_row_q4_0_ref``: 18 bytes at ``out[r, 18b:]``."""
    base = b * QK
    amax = np.float32(0.0)
    mx = np.float32(0.0)
    for j in range(QK):
        v = x[r, _U(base + j)]
        if amax < abs(v):
            amax = abs(v)
            mx = v
    d = np.float32(mx / np.float32(-8.0))
    idv = np.float32(np.float32(1.0) / d) if d != np.float32(0.0) else np.float32(0.0)
    o = b * 18
    store_f16(out, r, o, int(fp32_to_fp16(d)))
    if abs(idv) < np.float32(np.inf):
        # |x*id| <= 8(1+eps): x*id + 8.5 lies in (0, 17), so the C conversion is a plain truncation
        # (this branch-free loop is what the compiler can vectorize)
        for j in range(16):
            q0 = min(15, int(fadd(fmul(x[r, _U(base + j)], idv), np.float32(8.5))))
            q1 = min(15, int(fadd(fmul(x[r, _U(base + 16 + j)], idv), np.float32(8.5))))
            out[r, _U(o + 2 + j)] = (q0 & 0x0F) | ((q1 & 0x0F) << 4)
        return
    for j in range(16):  # id overflowed to inf (subnormal d): C's out-of-range conversion semantics
        q0 = min(15, c_float_to_int8(fadd(fmul(x[r, _U(base + j)], idv), np.float32(8.5)))) & 0xFF
        q1 = min(15, c_float_to_int8(fadd(fmul(x[r, _U(base + 16 + j)], idv), np.float32(8.5)))) & 0xFF
        out[r, _U(o + 2 + j)] = (q0 | (q1 << 4)) & 0xFF


@_jit
def q4_0_imat_block(x: np.ndarray, r: int, b: int, qw: np.ndarray, sigma2: np.float32, w: np.ndarray,
                    L: np.ndarray, Laux: np.ndarray, out: np.ndarray) -> None:
    """Block b of row r as ``quantize_row_q4_0_impl`` (weighted ``make_qx_quants(32, 8)``)."""
    legacy_weights(x, r, b, qw, sigma2, w)
    d = make_qx_quants(x, r, b * QK, QK, 8, w, True, L)
    o = b * 18
    store_f16(out, r, o, fp32_to_fp16_x86(d))
    for j in range(16):
        out[r, o + 2 + j] = (L[j] | (L[j + 16] << 4)) & 0xFF


@_jit
def q4_0_imat_block_cpu(x: np.ndarray, r: int, b: int, qw: np.ndarray, sigma2: np.float32, w: np.ndarray,
                        L: np.ndarray, lanes: np.ndarray, out: np.ndarray) -> None:
    """:func:`q4_0_imat_block` with the trial scales as lanes (``lanes``: float32 [3, NL] scratch)."""
    legacy_weights(x, r, b, qw, sigma2, w)
    d = make_qx_quants_lanes(x, r, b * QK, QK, 8, w, L, lanes[0], lanes[1], lanes[2])
    o = b * 18
    store_f16(out, r, o, fp32_to_fp16_x86(d))
    for j in range(16):
        out[r, o + 2 + j] = (L[j] | (L[j + 16] << 4)) & 0xFF


@_jit
def q4_0_deq_block(blocks: np.ndarray, r: int, b: int, y: np.ndarray) -> None:
    """``dequantize_row_q4_0`` for one block: ``f32(q - 8) * d``."""
    o = b * 18
    d = load_f16(blocks, r, o)
    for j in range(16):
        q = int(blocks[r, o + 2 + j])
        y[r, b * QK + j] = np.float32(np.float32((q & 0xF) - 8) * d)
        y[r, b * QK + 16 + j] = np.float32(np.float32((q >> 4) - 8) * d)


# --- Q4_1: d f16 @0, m f16 @2, qs[16] @4 --------------------------------------------------------------


@_jit
def q4_1_ref_block(x: np.ndarray, r: int, b: int, out: np.ndarray) -> None:
    """Block b of row r as ``quantize_row_q4_1_ref``: 20 bytes at ``out[r, 20b:]``."""
    base = b * QK
    mn = _F32_MAX
    mx = -_F32_MAX
    for j in range(QK):
        v = x[r, _U(base + j)]
        if v < mn:
            mn = v
        if v > mx:
            mx = v
    d = np.float32(np.float32(mx - mn) / np.float32(15.0))
    idv = np.float32(np.float32(1.0) / d) if d != np.float32(0.0) else np.float32(0.0)
    o = b * 20
    store_f16(out, r, o, int(fp32_to_fp16(d)))
    store_f16(out, r, o + 2, int(fp32_to_fp16(mn)))
    if abs(d) < np.float32(np.inf) and abs(idv) < np.float32(np.inf):
        # (x-min)*id + 0.5 lies in [0.5, 15.5+eps]: a plain truncation (vectorizable)
        for j in range(16):
            q0 = min(15, int(fadd(fmul(fsub(x[r, _U(base + j)], mn), idv), np.float32(0.5))))
            q1 = min(15, int(fadd(fmul(fsub(x[r, _U(base + 16 + j)], mn), idv), np.float32(0.5))))
            out[r, _U(o + 4 + j)] = (q0 & 0x0F) | ((q1 & 0x0F) << 4)
        return
    for j in range(16):  # degenerate scales: C's out-of-range conversion semantics
        v0 = fadd(fmul(fsub(x[r, _U(base + j)], mn), idv), np.float32(0.5))
        v1 = fadd(fmul(fsub(x[r, _U(base + 16 + j)], mn), idv), np.float32(0.5))
        q0 = min(15, c_float_to_int8(v0)) & 0xFF
        q1 = min(15, c_float_to_int8(v1)) & 0xFF
        out[r, _U(o + 4 + j)] = (q0 | (q1 << 4)) & 0xFF


@_jit
def q4_1_imat_block(x: np.ndarray, r: int, b: int, qw: np.ndarray, sigma2: np.float32, w: np.ndarray,
                    L: np.ndarray, Laux: np.ndarray, out: np.ndarray) -> None:
    """Block b of row r as ``quantize_row_q4_1_impl`` (``make_qkx3_quants(32, 15, -0.9, 0.05, 36)``)."""
    legacy_weights(x, r, b, qw, sigma2, w)
    d, the_min = make_qkx3_quants(x, r, b * QK, QK, 15, w, L, Laux, np.float32(-0.9), np.float32(0.05), 36)
    o = b * 20
    store_f16(out, r, o, int(fp32_to_fp16(d)))
    store_f16(out, r, o + 2, int(fp32_to_fp16(np.float32(-the_min))))
    for j in range(16):
        out[r, o + 4 + j] = (L[j] | (L[j + 16] << 4)) & 0xFF


@_jit
def q4_1_imat_block_cpu(x: np.ndarray, r: int, b: int, qw: np.ndarray, sigma2: np.float32, w: np.ndarray,
                        L: np.ndarray, Laux: np.ndarray, lanes: np.ndarray, out: np.ndarray) -> None:
    """:func:`q4_1_imat_block` with the trial scales as lanes (``lanes``: float32 [7, NL3] scratch)."""
    legacy_weights(x, r, b, qw, sigma2, w)
    d, the_min = make_qkx3_quants_lanes(x, r, b * QK, QK, 15, w, L, Laux, np.float32(-0.9), np.float32(0.05), 36,
                                        lanes)
    o = b * 20
    store_f16(out, r, o, int(fp32_to_fp16(d)))
    store_f16(out, r, o + 2, int(fp32_to_fp16(np.float32(-the_min))))
    for j in range(16):
        out[r, o + 4 + j] = (L[j] | (L[j + 16] << 4)) & 0xFF


@_jit
def q4_1_deq_block(blocks: np.ndarray, r: int, b: int, y: np.ndarray) -> None:
    """``dequantize_row_q4_1`` for one block: ``(f32(q) * d) + m``."""
    o = b * 20
    d = load_f16(blocks, r, o)
    m = load_f16(blocks, r, o + 2)
    for j in range(16):
        q = int(blocks[r, o + 4 + j])
        y[r, b * QK + j] = fadd(fmul(np.float32(q & 0xF), d), m)
        y[r, b * QK + 16 + j] = fadd(fmul(np.float32(q >> 4), d), m)


# --- Q5_0: d f16 @0, qh u32 @2, qs[16] @6 -----------------------------------------------------------------


@_jit
def store_q5(out: np.ndarray, r: int, o: int, L: np.ndarray) -> None:
    """Pack 32 five-bit quants: low nibbles into qs (@o+4), bit 4 of element j into bit j of qh (@o)."""
    qh = 0
    for j in range(16):
        q0 = L[j] & 0xFF
        q1 = L[j + 16] & 0xFF
        out[r, o + 4 + j] = ((q0 & 0x0F) | ((q1 & 0x0F) << 4)) & 0xFF
        qh |= ((q0 & 0x10) >> 4) << j
        qh |= ((q1 & 0x10) >> 4) << (j + 16)
    out[r, o] = qh & 0xFF
    out[r, o + 1] = (qh >> 8) & 0xFF
    out[r, o + 2] = (qh >> 16) & 0xFF
    out[r, o + 3] = (qh >> 24) & 0xFF


@_jit
def q5_0_ref_block(x: np.ndarray, r: int, b: int, out: np.ndarray) -> None:
    """Block b of row r as ``quantize_row_q5_0_ref``: 22 bytes at ``out[r, 22b:]``."""
    base = b * QK
    amax = np.float32(0.0)
    mx = np.float32(0.0)
    for j in range(QK):
        v = x[r, _U(base + j)]
        if amax < abs(v):
            amax = abs(v)
            mx = v
    d = np.float32(mx / np.float32(-16.0))
    idv = np.float32(np.float32(1.0) / d) if d != np.float32(0.0) else np.float32(0.0)
    o = b * 22
    store_f16(out, r, o, int(fp32_to_fp16(d)))
    qh = 0
    if abs(idv) < np.float32(np.inf):
        # |x*id| <= 16(1+eps): x*id + 16.5 lies in (0, 33), a plain truncation (vectorizable)
        for j in range(16):
            q0 = min(31, int(fadd(fmul(x[r, _U(base + j)], idv), np.float32(16.5))))
            q1 = min(31, int(fadd(fmul(x[r, _U(base + 16 + j)], idv), np.float32(16.5))))
            out[r, _U(o + 6 + j)] = (q0 & 0x0F) | ((q1 & 0x0F) << 4)
            qh |= ((q0 >> 4) << j) | ((q1 >> 4) << (j + 16))
    else:  # id overflowed to inf (subnormal d): C's out-of-range conversion semantics
        for j in range(16):
            q0 = min(31, c_float_to_int8(fadd(fmul(x[r, _U(base + j)], idv), np.float32(16.5)))) & 0xFF
            q1 = min(31, c_float_to_int8(fadd(fmul(x[r, _U(base + 16 + j)], idv), np.float32(16.5)))) & 0xFF
            out[r, _U(o + 6 + j)] = ((q0 & 0x0F) | ((q1 & 0x0F) << 4)) & 0xFF
            qh |= ((q0 & 0x10) >> 4) << j
            qh |= ((q1 & 0x10) >> 4) << (j + 16)
    out[r, o + 2] = qh & 0xFF
    out[r, o + 3] = (qh >> 8) & 0xFF
    out[r, o + 4] = (qh >> 16) & 0xFF
    out[r, o + 5] = (qh >> 24) & 0xFF


@_jit
def q5_0_imat_block(x: np.ndarray, r: int, b: int, qw: np.ndarray, sigma2: np.float32, w: np.ndarray,
                    L: np.ndarray, Laux: np.ndarray, out: np.ndarray) -> None:
    """Block b of row r as ``quantize_row_q5_0_impl`` (weighted ``make_qx_quants(32, 16)``)."""
    legacy_weights(x, r, b, qw, sigma2, w)
    d = make_qx_quants(x, r, b * QK, QK, 16, w, True, L)
    o = b * 22
    store_f16(out, r, o, fp32_to_fp16_x86(d))
    store_q5(out, r, o + 2, L)


@_jit
def q5_0_imat_block_cpu(x: np.ndarray, r: int, b: int, qw: np.ndarray, sigma2: np.float32, w: np.ndarray,
                        L: np.ndarray, lanes: np.ndarray, out: np.ndarray) -> None:
    """:func:`q5_0_imat_block` with the trial scales as lanes (``lanes``: float32 [3, NL] scratch)."""
    legacy_weights(x, r, b, qw, sigma2, w)
    d = make_qx_quants_lanes(x, r, b * QK, QK, 16, w, L, lanes[0], lanes[1], lanes[2])
    o = b * 22
    store_f16(out, r, o, fp32_to_fp16_x86(d))
    store_q5(out, r, o + 2, L)


@_jit
def load_qh(blocks: np.ndarray, r: int, o: int) -> int:
    """Read the little-endian u32 qh at ``blocks[r, o:o+4]``."""
    return (int(blocks[r, o]) | (int(blocks[r, o + 1]) << 8) | (int(blocks[r, o + 2]) << 16)
            | (int(blocks[r, o + 3]) << 24))


@_jit
def q5_0_deq_block(blocks: np.ndarray, r: int, b: int, y: np.ndarray) -> None:
    """``dequantize_row_q5_0`` for one block: ``f32(q5 - 16) * d``."""
    o = b * 22
    d = load_f16(blocks, r, o)
    qh = load_qh(blocks, r, o + 2)
    for j in range(16):
        q = int(blocks[r, o + 6 + j])
        q0 = (q & 0xF) | (((qh >> j) & 1) << 4)
        q1 = (q >> 4) | (((qh >> (j + 16)) & 1) << 4)
        y[r, b * QK + j] = np.float32(np.float32(q0 - 16) * d)
        y[r, b * QK + 16 + j] = np.float32(np.float32(q1 - 16) * d)


# --- Q5_1: d f16 @0, m f16 @2, qh u32 @4, qs[16] @8 ------------------------------------------------------


@_jit
def q5_1_ref_block(x: np.ndarray, r: int, b: int, out: np.ndarray) -> None:
    """Block b of row r as ``quantize_row_q5_1_ref``: 24 bytes at ``out[r, 24b:]``."""
    base = b * QK
    mn = _F32_MAX
    mx = -_F32_MAX
    for j in range(QK):
        v = x[r, _U(base + j)]
        if v < mn:
            mn = v
        if v > mx:
            mx = v
    d = np.float32(np.float32(mx - mn) / np.float32(31.0))
    idv = np.float32(np.float32(1.0) / d) if d != np.float32(0.0) else np.float32(0.0)
    o = b * 24
    store_f16(out, r, o, int(fp32_to_fp16(d)))
    store_f16(out, r, o + 2, int(fp32_to_fp16(mn)))
    qh = 0
    for j in range(16):
        # (uint8_t)(v + 0.5f): no clamp in ggml, the low byte of the int conversion is kept
        q0 = c_float_to_uint8(fadd(fmul(fsub(x[r, _U(base + j)], mn), idv), np.float32(0.5)))
        q1 = c_float_to_uint8(fadd(fmul(fsub(x[r, _U(base + 16 + j)], mn), idv), np.float32(0.5)))
        out[r, _U(o + 8 + j)] = ((q0 & 0x0F) | ((q1 & 0x0F) << 4)) & 0xFF
        qh |= ((q0 & 0x10) >> 4) << j
        qh |= ((q1 & 0x10) >> 4) << (j + 16)
    out[r, o + 4] = qh & 0xFF
    out[r, o + 5] = (qh >> 8) & 0xFF
    out[r, o + 6] = (qh >> 16) & 0xFF
    out[r, o + 7] = (qh >> 24) & 0xFF


@_jit
def q5_1_imat_block(x: np.ndarray, r: int, b: int, qw: np.ndarray, sigma2: np.float32, w: np.ndarray,
                    L: np.ndarray, Laux: np.ndarray, out: np.ndarray) -> None:
    """Block b of row r as ``quantize_row_q5_1_impl`` (``make_qkx3_quants(32, 31, -0.9, 0.05, 36)``)."""
    legacy_weights(x, r, b, qw, sigma2, w)
    d, the_min = make_qkx3_quants(x, r, b * QK, QK, 31, w, L, Laux, np.float32(-0.9), np.float32(0.05), 36)
    o = b * 24
    store_f16(out, r, o, int(fp32_to_fp16(d)))
    store_f16(out, r, o + 2, int(fp32_to_fp16(np.float32(-the_min))))
    store_q5(out, r, o + 4, L)


@_jit
def q5_1_imat_block_cpu(x: np.ndarray, r: int, b: int, qw: np.ndarray, sigma2: np.float32, w: np.ndarray,
                        L: np.ndarray, Laux: np.ndarray, lanes: np.ndarray, out: np.ndarray) -> None:
    """:func:`q5_1_imat_block` with the trial scales as lanes (``lanes``: float32 [7, NL3] scratch)."""
    legacy_weights(x, r, b, qw, sigma2, w)
    d, the_min = make_qkx3_quants_lanes(x, r, b * QK, QK, 31, w, L, Laux, np.float32(-0.9), np.float32(0.05), 36,
                                        lanes)
    o = b * 24
    store_f16(out, r, o, int(fp32_to_fp16(d)))
    store_f16(out, r, o + 2, int(fp32_to_fp16(np.float32(-the_min))))
    store_q5(out, r, o + 4, L)


@_jit
def q5_1_deq_block(blocks: np.ndarray, r: int, b: int, y: np.ndarray) -> None:
    """``dequantize_row_q5_1`` for one block: ``(f32(q5) * d) + m``."""
    o = b * 24
    d = load_f16(blocks, r, o)
    m = load_f16(blocks, r, o + 2)
    qh = load_qh(blocks, r, o + 4)
    for j in range(16):
        q = int(blocks[r, o + 8 + j])
        q0 = (q & 0xF) | (((qh >> j) & 1) << 4)
        q1 = (q >> 4) | (((qh >> (j + 16)) & 1) << 4)
        y[r, b * QK + j] = fadd(fmul(np.float32(q0), d), m)
        y[r, b * QK + 16 + j] = fadd(fmul(np.float32(q1), d), m)


# --- Q8_0: d f16 @0, qs int8[32] @2 -------------------------------------------------------------------


@_jit
def q8_0_ref_block(x: np.ndarray, r: int, b: int, out: np.ndarray) -> None:
    """Block b of row r as ``quantize_row_q8_0_ref``: 34 bytes at ``out[r, 34b:]``."""
    base = b * QK
    amax = np.float32(0.0)
    for j in range(QK):
        v = abs(x[r, _U(base + j)])
        amax = amax if amax > v else v
    d = np.float32(amax / np.float32(127.0))
    idv = np.float32(np.float32(1.0) / d) if d != np.float32(0.0) else np.float32(0.0)
    o = b * 34
    store_f16(out, r, o, int(fp32_to_fp16(d)))
    if fmul(amax, idv) <= np.float32(128.0):
        # Every |x * idv| is at most amax * idv (rounding is monotonic): no NaN, no int overflow, so the
        # branch-free roundf below is exact and the loop vectorises.
        for j in range(QK):
            f = float(np.float32(x[r, _U(base + j)] * idv))
            out[r, _U(o + 2 + j)] = int(math.copysign(math.floor(abs(f) + 0.5), f)) & 0xFF
        return
    for j in range(QK):
        v = fmul(x[r, _U(base + j)], idv)
        f = float(v)
        if f != f or abs(f) >= 2147483648.0:
            q = 0  # cvttss2si gives INT32_MIN, whose low byte is 0
        else:
            q = roundf(v)
        out[r, _U(o + 2 + j)] = q & 0xFF


@_jit
def q8_0_imat_block(x: np.ndarray, r: int, b: int, qw: np.ndarray, sigma2: np.float32, w: np.ndarray,
                    L: np.ndarray, Laux: np.ndarray, out: np.ndarray) -> None:
    """``quantize_q8_0`` ignores the imatrix: the reference path."""
    q8_0_ref_block(x, r, b, out)


@_jit
def q8_0_deq_block(blocks: np.ndarray, r: int, b: int, y: np.ndarray) -> None:
    """``dequantize_row_q8_0`` for one block: ``f32(qs) * d``."""
    o = b * 34
    d = load_f16(blocks, r, o)
    for j in range(QK):
        y[r, b * QK + j] = np.float32(np.float32(c_int8(int(blocks[r, o + 2 + j]))) * d)


# --- CPU entry points ---------------------------------------------------------------------------------
# One pair per type (not a generic kernel taking the block function) so each is a cacheable top-level
# function with no function-typed arguments.


@_jit_par
def quantize_rows_q4_0(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """Q4_0 rows. x: float32[n_rows, n_per_row]; qw: float32[n_per_row] or [0]; out: uint8[n_rows, n/32*18]."""
    n_rows = x.shape[0]
    nb = x.shape[1] // QK
    if qw.shape[0] == 0:
        for r in prange(n_rows):
            bad = np.zeros(nb, np.uint8)
            if q4_0_ref_row(x[r], out[r], bad):
                for b in range(nb):
                    if bad[b]:
                        q4_0_ref_block(x, r, b, out)
    else:
        for r in prange(n_rows):
            w = np.empty(QK, np.float32)
            L = np.empty(QK, np.int32)
            lanes = np.empty((3, NL), np.float32)
            s2 = row_sigma2(x, r)
            for b in range(nb):
                q4_0_imat_block_cpu(x, r, b, qw, s2, w, L, lanes, out)


@_jit_par
def quantize_rows_q4_1(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """Q4_1 rows. x: float32[n_rows, n_per_row]; qw: float32[n_per_row] or [0]; out: uint8[n_rows, n/32*20]."""
    n_rows = x.shape[0]
    nb = x.shape[1] // QK
    if qw.shape[0] == 0:
        for r in prange(n_rows):
            bad = np.zeros(nb, np.uint8)
            if q4_1_ref_row(x[r], out[r], bad):
                for b in range(nb):
                    if bad[b]:
                        q4_1_ref_block(x, r, b, out)
    else:
        for r in prange(n_rows):
            w = np.empty(QK, np.float32)
            L = np.empty(QK, np.int32)
            Laux = np.empty(QK, np.int32)
            lanes = np.empty((7, NL3), np.float32)
            s2 = row_sigma2(x, r)
            for b in range(nb):
                q4_1_imat_block_cpu(x, r, b, qw, s2, w, L, Laux, lanes, out)


@_jit_par
def quantize_rows_q5_0(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """Q5_0 rows. x: float32[n_rows, n_per_row]; qw: float32[n_per_row] or [0]; out: uint8[n_rows, n/32*22]."""
    n_rows = x.shape[0]
    nb = x.shape[1] // QK
    if qw.shape[0] == 0:
        for r in prange(n_rows):
            bad = np.zeros(nb, np.uint8)
            if q5_0_ref_row(x[r], out[r], bad):
                for b in range(nb):
                    if bad[b]:
                        q5_0_ref_block(x, r, b, out)
    else:
        for r in prange(n_rows):
            w = np.empty(QK, np.float32)
            L = np.empty(QK, np.int32)
            lanes = np.empty((3, NL), np.float32)
            s2 = row_sigma2(x, r)
            for b in range(nb):
                q5_0_imat_block_cpu(x, r, b, qw, s2, w, L, lanes, out)


@_jit_par
def quantize_rows_q5_1(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """Q5_1 rows. x: float32[n_rows, n_per_row]; qw: float32[n_per_row] or [0]; out: uint8[n_rows, n/32*24]."""
    n_rows = x.shape[0]
    nb = x.shape[1] // QK
    if qw.shape[0] == 0:
        for r in prange(n_rows):
            bad = np.zeros(nb, np.uint8)
            if q5_1_ref_row(x[r], out[r], bad):
                for b in range(nb):
                    if bad[b]:
                        q5_1_ref_block(x, r, b, out)
    else:
        for r in prange(n_rows):
            w = np.empty(QK, np.float32)
            L = np.empty(QK, np.int32)
            Laux = np.empty(QK, np.int32)
            lanes = np.empty((7, NL3), np.float32)
            s2 = row_sigma2(x, r)
            for b in range(nb):
                q5_1_imat_block_cpu(x, r, b, qw, s2, w, L, Laux, lanes, out)


@_jit_par
def quantize_rows_q8_0(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """Q8_0 rows (qw ignored, as ggml). x: float32[n_rows, n_per_row]; out: uint8[n_rows, n/32*34]."""
    n_rows = x.shape[0]
    nb = x.shape[1] // QK
    for r in prange(n_rows):
        bad = np.zeros(nb, np.uint8)
        if q8_0_ref_row(x[r], out[r], bad):
            for b in range(nb):
                if bad[b]:
                    q8_0_ref_block(x, r, b, out)


@_jit_par
def dequantize_rows_q4_0(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q4_0 -> float32. blocks: uint8[n_rows, nb*18]; out: float32[n_rows, nb*32]."""
    nb = out.shape[1] // QK
    for t in prange(out.shape[0] * nb):
        q4_0_deq_block(blocks, t // nb, t % nb, out)


@_jit_par
def dequantize_rows_q4_1(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q4_1 -> float32. blocks: uint8[n_rows, nb*20]; out: float32[n_rows, nb*32]."""
    nb = out.shape[1] // QK
    for t in prange(out.shape[0] * nb):
        q4_1_deq_block(blocks, t // nb, t % nb, out)


@_jit_par
def dequantize_rows_q5_0(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q5_0 -> float32. blocks: uint8[n_rows, nb*22]; out: float32[n_rows, nb*32]."""
    nb = out.shape[1] // QK
    for t in prange(out.shape[0] * nb):
        q5_0_deq_block(blocks, t // nb, t % nb, out)


@_jit_par
def dequantize_rows_q5_1(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q5_1 -> float32. blocks: uint8[n_rows, nb*24]; out: float32[n_rows, nb*32]."""
    nb = out.shape[1] // QK
    for t in prange(out.shape[0] * nb):
        q5_1_deq_block(blocks, t // nb, t % nb, out)


@_jit_par
def dequantize_rows_q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q8_0 -> float32. blocks: uint8[n_rows, nb*34]; out: float32[n_rows, nb*32]."""
    nb = out.shape[1] // QK
    for t in prange(out.shape[0] * nb):
        q8_0_deq_block(blocks, t // nb, t % nb, out)
