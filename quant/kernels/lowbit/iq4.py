"""Non-linear 4-bit kernels (IQ4_NL, IQ4_XS): Numba CPU quantize/dequantize, byte-identical to ggml.

Both map each weight to one of the 16 values of ggml's ``kvalues_iq4nl`` table times a scale
(ggml-common.h):

* IQ4_NL, 32 weights in 18 bytes: ``d`` f16 @0, ``qs[16]`` @2 (byte j: index of weight j in the low
  nibble, of weight j + 16 in the high nibble).
* IQ4_XS, 256 weights in 136 bytes: ``d`` f16 @0, ``scales_h`` u16 @2 (bits ``2ib..2ib+1``: high 2 bits of
  the 6-bit scale of 32-weight sub-block ib), ``scales_l[4]`` @4 (low nibbles of the scales, two per byte),
  ``qs[128]`` @8 (16 bytes per sub-block, packed as IQ4_NL).

Quantization follows ``ggml_quantize_chunk``, which calls ``quantize_iq4_nl`` / ``quantize_iq4_xs`` with or
without an imatrix: both run ``quantize_row_iq4_nl_impl`` with ``ntry = 7`` (ggml-quants.c); without an
imatrix the weights are ``x^2``, with one ``qw * sqrt(sigma2 + x^2)``. (``quantize_row_iq4_nl_ref`` uses
``ntry = -1``, but ``ggml_quantize_chunk`` and so llama-quantize never call it.)
"""

from __future__ import annotations

import math

import numba
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ggufkit.quant.kernels.fp import fadd, fmul, fp16_to_fp32, fp32_to_fp16_x86
from ggufkit.quant.kernels.kquants.subroutines import GROUP_MAX_EPS, nearest_int_full

IQ4_NL_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.IQ4_NL][1]  # 18
IQ4_XS_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.IQ4_XS][1]  # 136

#: ggml-common.h: kvalues_iq4nl.
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)

_NTRY = 7
#: IQ4_NL blocks (of 32) or IQ4_XS super-blocks per prange iteration; no effect on the bytes.
_CHUNK = 64


#: The midpoints between neighbouring table values (half-integers, exact in float32): ``_MID_IQ4NL[k]`` lies
#: between ``KVALUES_IQ4NL[k]`` and ``KVALUES_IQ4NL[k + 1]``.
_MID_IQ4NL = ((KVALUES_IQ4NL[:-1] + KVALUES_IQ4NL[1:]) / np.float32(2.0)).astype(np.float32)


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def best_index_iq4(x: np.float32) -> int:
    """``best_index_int8(16, kvalues_iq4nl, x)`` (ggml-quants.c): the index of the nearest table value.

    The C bisects to the neighbours ``lo <= x < hi`` and takes ``lo`` only when ``fl(x - lo) < fl(hi - x)``.
    Both differences are monotone in ``x``, so between two neighbours the choice flips at one point, and that
    point is their midpoint (``tests/test_quant_lowbit.py`` checks the float below each midpoint picks ``lo``
    and the midpoint itself ``hi``). So the index is the number of midpoints ``x`` reaches: compares only, no
    table lookups, which lets loops over it vectorize without gathers (slow on AVX2). NaN gets 15, as the
    C's bisection gives it.
    """
    idx = 0
    for k in range(15):
        idx += x >= _MID_IQ4NL[k]
    return 15 if x != x else idx


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _nearest_value(al: np.float32) -> np.float32:
    # KVALUES_IQ4NL[best_index_iq4(al)] as a chain of selects (see best_index_iq4 for why the midpoints decide).
    val = KVALUES_IQ4NL
    q = val[0]
    for k in range(15):
        q = val[k + 1] if al >= _MID_IQ4NL[k] else q
    return val[15] if al != al else q


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _fit_all(xb: np.ndarray, w: np.ndarray, idv: np.ndarray, sx: np.ndarray, s2: np.ndarray) -> None:
    # For each of the 16 candidate inverse scales idv[c]: sx[c] = sum (w*q)*x, s2[c] = sum (w*q)*q over the 32
    # weights in index order, q the table value nearest idv[c]*x. The candidates are independent, so they
    # run side by side (the inner loop vectorizes), each sum still in the C's order.
    for c in range(16):
        sx[c] = np.float32(0.0)
        s2[c] = np.float32(0.0)
    for j in range(32):
        xj = xb[j]
        wj = w[j]
        for c in range(16):
            q = _nearest_value(fmul(idv[c], xj))
            wq = fmul(wj, q)
            sx[c] = fadd(sx[c], fmul(wq, xj))
            s2[c] = fadd(s2[c], fmul(wq, q))


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def iq4_quantize_block(x: np.ndarray, qw: np.ndarray, use_qw: bool, nsub: int, out: np.ndarray,
                       L: np.ndarray, w: np.ndarray, scales: np.ndarray, fit: np.ndarray) -> None:
    """``quantize_row_iq4_nl_impl(32 * nsub, 32, ..., kvalues_iq4nl, qw, ntry=7)`` for one block.

    Args:
        x: float32[32 * nsub] weights.
        qw: float32[32 * nsub] imatrix slice (read only when ``use_qw``).
        use_qw: whether an imatrix is given.
        nsub: 1 (IQ4_NL: one 32-weight block) or 8 (IQ4_XS: a 256-weight super-block).
        out: uint8[18] (IQ4_NL) or uint8[136] (IQ4_XS), written in full.
        L, w, scales, fit: scratch (uint8[32 * nsub], float32[32], float32[nsub], float32[48]).
    """
    n = 32 * nsub
    sigma2 = np.float32(0.0)
    for j in range(n):
        sigma2 = fadd(sigma2, fmul(x[j], x[j]))
    sigma2 = fmul(sigma2, np.float32(2.0) / np.float32(n))
    max_scale = np.float32(0.0)
    amax_scale = np.float32(0.0)
    for ib in range(nsub):
        xb = x[32 * ib:32 * ib + 32]
        if use_qw:
            for j in range(32):
                w[j] = fmul(qw[32 * ib + j], np.float32(math.sqrt(fadd(sigma2, fmul(xb[j], xb[j])))))
        else:
            for j in range(32):
                w[j] = fmul(xb[j], xb[j])
        amax = np.float32(0.0)
        mx = np.float32(0.0)
        for j in range(32):
            ax = abs(xb[j])
            if ax > amax:
                amax = ax
                mx = xb[j]
        if amax < GROUP_MAX_EPS:
            scales[ib] = np.float32(0.0)
            continue
        # Candidate 0 is the first fit (d = -max/values[0]), candidates 1..15 the tries -7..7; their sums are
        # computed together, then judged one after the other in the C's order.
        idv = fit[0:16]
        sx = fit[16:32]
        s2 = fit[32:48]
        idv[0] = np.float32(1.0) / (-mx / KVALUES_IQ4NL[0])
        for itry in range(-_NTRY, _NTRY + 1):
            idv[itry + _NTRY + 1] = np.float32(itry - 127) / mx
        _fit_all(xb, w, idv, sx, s2)
        d = sx[0] / s2[0] if s2[0] > np.float32(0.0) else np.float32(0.0)
        best = fmul(d, sx[0])
        for c in range(1, 2 * _NTRY + 2):
            if s2[c] > np.float32(0.0) and fmul(sx[c], sx[c]) > fmul(best, s2[c]):
                d = sx[c] / s2[c]
                best = fmul(d, sx[c])
        scales[ib] = d
        if abs(d) > amax_scale:
            amax_scale = abs(d)
            max_scale = d
    if nsub > 1:
        d = -max_scale / np.float32(32.0)
        dh = fp32_to_fp16_x86(d)
        idv = np.float32(1.0) / d if d != np.float32(0.0) else np.float32(0.0)
        sh = 0
        for ib in range(nsub):
            li = max(-32, min(31, nearest_int_full(fmul(idv, scales[ib]))))
            dl = fmul(d, np.float32(li))
            idl = np.float32(1.0) / dl if dl != np.float32(0.0) else np.float32(0.0)
            for j in range(32):
                L[32 * ib + j] = best_index_iq4(fmul(idl, x[32 * ib + j]))
            li += 32
            if ib % 2 == 0:
                out[4 + ib // 2] = li & 0xF
            else:
                out[4 + ib // 2] = np.int64(out[4 + ib // 2]) | ((li & 0xF) << 4)
            sh |= (li >> 4) << (2 * ib)
        out[2] = sh & 0xFF
        out[3] = (sh >> 8) & 0xFF
        q0 = 8
    else:
        dh = fp32_to_fp16_x86(scales[0])
        idv = np.float32(1.0) / scales[0] if scales[0] != np.float32(0.0) else np.float32(0.0)
        for j in range(32):
            L[j] = best_index_iq4(fmul(idv, x[j]))
        q0 = 2
    out[0] = dh & 0xFF
    out[1] = dh >> 8
    for i in range(nsub):
        for j in range(16):
            out[q0 + 16 * i + j] = np.int64(L[32 * i + j]) | (np.int64(L[32 * i + 16 + j]) << 4)


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def iq4_dequantize_block(blk: np.ndarray, nsub: int, y: np.ndarray) -> None:
    """``dequantize_row_iq4_nl`` (nsub 1) / ``dequantize_row_iq4_xs`` (nsub 8) for one block."""
    d = fp16_to_fp32(np.int64(blk[0]) | (np.int64(blk[1]) << 8))
    if nsub == 1:
        for j in range(16):
            q = np.int64(blk[2 + j])
            y[j] = fmul(d, KVALUES_IQ4NL[q & 0xF])
            y[j + 16] = fmul(d, KVALUES_IQ4NL[q >> 4])
        return
    sh = np.int64(blk[2]) | (np.int64(blk[3]) << 8)
    for ib in range(8):
        ls = ((np.int64(blk[4 + ib // 2]) >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4)
        dl = fmul(d, np.float32(ls - 32))
        for j in range(16):
            q = np.int64(blk[8 + 16 * ib + j])
            y[32 * ib + j] = fmul(dl, KVALUES_IQ4NL[q & 0xF])
            y[32 * ib + 16 + j] = fmul(dl, KVALUES_IQ4NL[q >> 4])


# --- CPU kernels (the registry's entry points) -------------------------------------------------------


@numba.njit(parallel=True, cache=True, fastmath=False, error_model="numpy")
def _quantize_rows_iq4(x: np.ndarray, qw: np.ndarray, out: np.ndarray, nsub: int, type_size: int) -> None:
    n_rows, n_per_row = x.shape
    bs = 32 * nsub
    nb = n_per_row // bs
    total = n_rows * nb
    use_qw = qw.shape[0] > 0
    for c in numba.prange((total + _CHUNK - 1) // _CHUNK):
        L = np.empty(bs, np.uint8)
        w = np.empty(32, np.float32)
        scales = np.empty(nsub, np.float32)
        fit = np.empty(48, np.float32)
        for t in range(c * _CHUNK, min(total, (c + 1) * _CHUNK)):
            r = t // nb
            b = t - r * nb
            iq4_quantize_block(x[r, b * bs:(b + 1) * bs], qw[b * bs:(b + 1) * bs] if use_qw else qw, use_qw, nsub,
                               out[r, b * type_size:(b + 1) * type_size], L, w, scales, fit)


@numba.njit(parallel=True, cache=True, fastmath=False, error_model="numpy")
def _dequantize_rows_iq4(blocks: np.ndarray, out: np.ndarray, nsub: int, type_size: int) -> None:
    n_rows, n_per_row = out.shape
    bs = 32 * nsub
    nb = n_per_row // bs
    for t in numba.prange(n_rows * nb):
        r = t // nb
        b = t - r * nb
        iq4_dequantize_block(blocks[r, b * type_size:(b + 1) * type_size], nsub, out[r, b * bs:(b + 1) * bs])


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def quantize_rows_iq4_nl(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """IQ4_NL quantization of ``x`` float32[n_rows, n_per_row] into ``out`` uint8[n_rows, n_per_row/32*18].

    ``qw`` float32[n_per_row] is the imatrix, or float32[0]. Byte-identical to
    ``ggml_quantize_chunk(GGML_TYPE_IQ4_NL)``.
    """
    _quantize_rows_iq4(x, qw, out, 1, IQ4_NL_BYTES)


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def quantize_rows_iq4_xs(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """IQ4_XS quantization of ``x`` float32[n_rows, n_per_row] into ``out`` uint8[n_rows, n_per_row/256*136].

    ``qw`` float32[n_per_row] is the imatrix, or float32[0]. Byte-identical to
    ``ggml_quantize_chunk(GGML_TYPE_IQ4_XS)``.
    """
    _quantize_rows_iq4(x, qw, out, 8, IQ4_XS_BYTES)


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def dequantize_rows_iq4_nl(blocks: np.ndarray, out: np.ndarray) -> None:
    """IQ4_NL dequantization: ``blocks`` uint8[n_rows, row_bytes] -> ``out`` float32[n_rows, n_per_row]."""
    _dequantize_rows_iq4(blocks, out, 1, IQ4_NL_BYTES)


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def dequantize_rows_iq4_xs(blocks: np.ndarray, out: np.ndarray) -> None:
    """IQ4_XS dequantization: ``blocks`` uint8[n_rows, row_bytes] -> ``out`` float32[n_rows, n_per_row]."""
    _dequantize_rows_iq4(blocks, out, 8, IQ4_XS_BYTES)
