"""Ternary kernels (TQ1_0, TQ2_0; BitNet b1.58 / TriLM weights): Numba CPU quantize/dequantize, byte-identical
to ggml.

Every weight becomes -1, 0 or 1 times the block's absolute maximum ``d`` (ggml-common.h):

* TQ1_0, 256 weights in 54 bytes: ``qs[48]`` @0 (five trits per byte, base 3, scaled to a byte by a
  ceiling division: bytes 0..31 hold weights ``m + 32n``, bytes 32..47 weights ``160 + m + 16n``),
  ``qh[4]`` @48 (four trits per byte, weights ``240 + j + 4m``), ``d`` f16 @52.
* TQ2_0, 256 weights in 66 bytes: ``qs[64]`` @0 (2 bits per trit + 1: byte ``32h + m`` holds weights
  ``128h + m + 32n`` in bits ``2n..2n+1``), ``d`` f16 @64.

``ggml_quantize_chunk`` ignores the imatrix for both (``quantize_tq1_0`` / ``quantize_tq2_0`` call the
reference quantizers ``quantize_row_tq1_0_ref`` / ``quantize_row_tq2_0_ref``, ggml-quants.c).
"""

from __future__ import annotations

import numba
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ggufkit.quant.kernels.fp import fmul, fp16_to_fp32, fp32_to_fp16, roundf

TQ1_0_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.TQ1_0][1]  # 54
TQ2_0_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.TQ2_0][1]  # 66
QK_K = 256
_POW3 = np.array([1, 3, 9, 27, 81, 243], np.int64)


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _trit(v: np.float32) -> int:
    # lroundf(v) + 1, stored in an int. A non-finite v (1/d overflowed for a subnormal block maximum) makes
    # lroundf return LONG_MIN on x86-64, whose low 32 bits plus one are 1.
    if v - v != np.float32(0.0):
        return 1
    return roundf(v) + 1


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _absmax_scale(x: np.ndarray) -> tuple[np.float32, np.float32]:
    # d = max |x| (MAX(amax, fabsf(v)), in index order) and id = d ? 1/d : 0.
    amax = np.float32(0.0)
    for j in range(QK_K):
        a = abs(x[j])
        amax = amax if amax > a else a
    return amax, (np.float32(1.0) / amax if amax != np.float32(0.0) else np.float32(0.0))


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _store_d(out: np.ndarray, off: int, d: np.float32) -> None:
    h = np.int64(fp32_to_fp16(d))
    out[off] = h & 0xFF
    out[off + 1] = h >> 8


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def tq1_0_quantize_block(x: np.ndarray, out: np.ndarray) -> None:
    """``quantize_row_tq1_0_ref`` for one 256-weight block: ``x`` float32[256] -> ``out`` uint8[54]."""
    d, idv = _absmax_scale(x)
    _store_d(out, 52, d)
    for m in range(32):  # five trits per byte along 32 bytes
        q = 0
        for n in range(5):
            q = (q * 3 + _trit(fmul(x[m + 32 * n], idv))) & 0xFF
        out[m] = ((q * 256 + 242) // 243) & 0xFF  # ceiling division, uint8_t store
    for m in range(16):  # then along 16 bytes
        q = 0
        for n in range(5):
            q = (q * 3 + _trit(fmul(x[160 + m + 16 * n], idv))) & 0xFF
        out[32 + m] = ((q * 256 + 242) // 243) & 0xFF
    for j in range(4):  # four trits per byte, the first shifted to the most significant trit
        q = 0
        for m in range(4):
            q = (q * 3 + _trit(fmul(x[240 + j + 4 * m], idv))) & 0xFF
        q = (q * 3) & 0xFF
        out[48 + j] = ((q * 256 + 242) // 243) & 0xFF


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def tq1_0_dequantize_block(blk: np.ndarray, y: np.ndarray) -> None:
    """``dequantize_row_tq1_0`` for one block: ``(trit - 1) * d``."""
    d = fp16_to_fp32(np.int64(blk[52]) | (np.int64(blk[53]) << 8))
    for n in range(5):
        for m in range(32):
            q = (np.int64(blk[m]) * _POW3[n]) & 0xFF
            y[32 * n + m] = fmul(np.float32(((q * 3) >> 8) - 1), d)
    for n in range(5):
        for m in range(16):
            q = (np.int64(blk[32 + m]) * _POW3[n]) & 0xFF
            y[160 + 16 * n + m] = fmul(np.float32(((q * 3) >> 8) - 1), d)
    for n in range(4):
        for j in range(4):
            q = (np.int64(blk[48 + j]) * _POW3[n]) & 0xFF
            y[240 + 4 * n + j] = fmul(np.float32(((q * 3) >> 8) - 1), d)


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def tq2_0_quantize_block(x: np.ndarray, out: np.ndarray) -> None:
    """``quantize_row_tq2_0_ref`` for one 256-weight block: ``x`` float32[256] -> ``out`` uint8[66]."""
    d, idv = _absmax_scale(x)
    _store_d(out, 64, d)
    for h in range(2):
        for m in range(32):
            q = 0
            for n in range(4):
                q += (_trit(fmul(x[128 * h + m + 32 * n], idv)) & 3) << (2 * n)
            out[32 * h + m] = q & 0xFF


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def tq2_0_dequantize_block(blk: np.ndarray, y: np.ndarray) -> None:
    """``dequantize_row_tq2_0`` for one block: ``(q - 1) * d``."""
    d = fp16_to_fp32(np.int64(blk[64]) | (np.int64(blk[65]) << 8))
    for h in range(2):
        for n in range(4):
            for m in range(32):
                q = (np.int64(blk[32 * h + m]) >> (2 * n)) & 3
                y[128 * h + 32 * n + m] = fmul(np.float32(q - 1), d)


# --- CPU kernels (the registry's entry points) -------------------------------------------------------
#
# The block functions above are the reference transcription, and what the CUDA kernels run
# (ggufkit.quant.kernels.lowbit.cuda re-jits them). The CPU kernels compute the same bytes with loops the compiler
# vectorizes: the block maximum over the float bits as integers (for the finite floats the dispatcher passes,
# |x|'s bit pattern orders as |x| does), each trit from the product ``x * id`` by two comparisons
# (``lroundf`` of a value within [-1 - 2^-22, 1 + 2^-22] is 1 exactly when it is >= 0.5, -1 when <= -0.5),
# and the ceiling division by 243 as a multiply and shift (exact for every numerator here, 0 .. 62194).
# A non-finite ``id`` (subnormal maximum) gives every weight the trit 1, as the C's lroundf does (see
# _trit); it is handled by a zero ``id`` instead, which makes every product +-0.


@numba.njit(cache=True, fastmath=False, error_model="numpy", inline="always")
def _block_inv(xi: np.ndarray, base: int) -> tuple[np.float32, np.float32]:
    # (d, id): the block maximum of |x| from the bit patterns xi[base:base+256], and 1/d (0 for d == 0),
    # replaced by 0 where 1/d overflows.
    m = np.int32(0)
    for j in range(QK_K):
        a = xi[base + j] & np.int32(0x7FFFFFFF)
        m = a if a > m else m
    d = np.int32(m).view(np.float32)
    if d == np.float32(0.0):
        return d, np.float32(0.0)
    idv = np.float32(1.0) / d
    if idv == np.float32(np.inf):
        idv = np.float32(0.0)
    return d, idv


@numba.njit(cache=True, fastmath=False, error_model="numpy", inline="always")
def _trit_cmp(v: np.float32) -> int:
    return 1 + (1 if v >= np.float32(0.5) else 0) - (1 if v <= np.float32(-0.5) else 0)


@numba.njit(parallel=True, cache=True, fastmath=False, error_model="numpy")
def quantize_rows_tq1_0(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """TQ1_0 quantization of ``x`` float32[n_rows, n_per_row] into ``out`` uint8[n_rows, n_per_row/256*54].

    ``qw`` is ignored, as ``ggml_quantize_chunk(GGML_TYPE_TQ1_0)`` ignores the imatrix. Same bytes as
    :func:`tq1_0_quantize_block` on every block.
    """
    n_rows, n_per_row = x.shape
    nb = n_per_row // QK_K
    for r in numba.prange(n_rows):
        xr = x[r].view(np.int32)
        fr = x[r]
        o = out[r]
        for b in range(nb):
            base = b * QK_K
            ob = b * TQ1_0_BYTES
            d, idv = _block_inv(xr, base)
            _store_d(o, ob + 52, d)
            for m in range(32):  # five trits per byte along 32 bytes
                q = 0
                for n in range(5):
                    q = q * 3 + _trit_cmp(fr[base + m + 32 * n] * idv)
                o[ob + m] = ((q * 256 + 242) * 69043) >> 24  # == (q*256 + 242) // 243
            for m in range(16):  # then along 16 bytes
                q = 0
                for n in range(5):
                    q = q * 3 + _trit_cmp(fr[base + 160 + m + 16 * n] * idv)
                o[ob + 32 + m] = ((q * 256 + 242) * 69043) >> 24
            for j in range(4):  # four trits per byte, the first shifted to the most significant trit
                q = 0
                for m in range(4):
                    q = q * 3 + _trit_cmp(fr[base + 240 + j + 4 * m] * idv)
                o[ob + 48 + j] = ((q * 768 + 242) * 69043) >> 24


@numba.njit(parallel=True, cache=True, fastmath=False, error_model="numpy")
def dequantize_rows_tq1_0(blocks: np.ndarray, out: np.ndarray) -> None:
    """TQ1_0 dequantization: ``blocks`` uint8[n_rows, row_bytes] -> ``out`` float32[n_rows, n_per_row]."""
    n_rows, n_per_row = out.shape
    nb = n_per_row // QK_K
    for t in numba.prange(n_rows * nb):
        r = t // nb
        b = t - r * nb
        tq1_0_dequantize_block(blocks[r, b * TQ1_0_BYTES:(b + 1) * TQ1_0_BYTES], out[r, b * QK_K:(b + 1) * QK_K])


@numba.njit(parallel=True, cache=True, fastmath=False, error_model="numpy")
def quantize_rows_tq2_0(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """TQ2_0 quantization of ``x`` float32[n_rows, n_per_row] into ``out`` uint8[n_rows, n_per_row/256*66].

    ``qw`` is ignored, as ``ggml_quantize_chunk(GGML_TYPE_TQ2_0)`` ignores the imatrix. Same bytes as
    :func:`tq2_0_quantize_block` on every block.
    """
    n_rows, n_per_row = x.shape
    nb = n_per_row // QK_K
    for r in numba.prange(n_rows):
        xr = x[r].view(np.int32)
        fr = x[r]
        o = out[r]
        for b in range(nb):
            base = b * QK_K
            ob = b * TQ2_0_BYTES
            d, idv = _block_inv(xr, base)
            _store_d(o, ob + 64, d)
            for h in range(2):
                for m in range(32):
                    q = 0
                    for n in range(4):
                        q += _trit_cmp(fr[base + 128 * h + m + 32 * n] * idv) << (2 * n)
                    o[ob + 32 * h + m] = q


@numba.njit(parallel=True, cache=True, fastmath=False, error_model="numpy")
def dequantize_rows_tq2_0(blocks: np.ndarray, out: np.ndarray) -> None:
    """TQ2_0 dequantization: ``blocks`` uint8[n_rows, row_bytes] -> ``out`` float32[n_rows, n_per_row]."""
    n_rows, n_per_row = out.shape
    nb = n_per_row // QK_K
    for t in numba.prange(n_rows * nb):
        r = t // nb
        b = t - r * nb
        tq2_0_dequantize_block(blocks[r, b * TQ2_0_BYTES:(b + 1) * TQ2_0_BYTES], out[r, b * QK_K:(b + 1) * QK_K])
