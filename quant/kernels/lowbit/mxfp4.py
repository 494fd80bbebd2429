"""MXFP4 kernels (OCP microscaling FP4, used by ``MXFP4_MOE``): Numba CPU quantize/dequantize, byte-identical
to ggml.

Block (ggml-common.h ``block_mxfp4``), 32 weights in 17 bytes: ``e`` @0, an E8M0 exponent, and ``qs[16]`` @1
(byte j: E2M1 code of weight j in the low nibble, of weight j + 16 in the high nibble). ggml keeps the E2M1
values doubled (``kvalues_mxfp4``) and halves the scale instead (``GGML_E8M0_TO_FP32_HALF``).

``ggml_quantize_chunk`` ignores the imatrix (``quantize_mxfp4`` calls ``quantize_row_mxfp4_ref``,
ggml-quants.c).
"""

from __future__ import annotations

import math

import numba
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ggufkit.quant.kernels.fp import fmul, fsub

QK_MXFP4 = 32
MXFP4_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.MXFP4][1]  # 17

#: ggml-common.h: kvalues_mxfp4 (E2M1 values, doubled).
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)

@numba.njit(cache=True, fastmath=False, error_model="numpy")
def e8m0_to_fp32_half(e: int) -> np.float32:
    """``ggml_e8m0_to_fp32_half``: ``2^(e - 128)``, the bit patterns ggml builds (subnormal for e < 2)."""
    return np.float32(math.ldexp(1.0, int(e) - 128))


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _e8m0_of_amax(amax: np.float32) -> int:
    # (uint8_t)(floorf(log2f(amax)) - 2 + 127), 0 for amax == 0. log2f is evaluated in double and rounded
    # once to float (the correctly rounded result glibc's log2f returns: it matters where log2 of a value
    # just below a power of two rounds up to the integer). The C converts a negative float to uint8_t
    # through a 32-bit int (cvttss2si), i.e. modulo 256.
    # With amax = m * 2^E (m in [1, 2)), log2(amax) = E + log2(m) rounds up to E + 1 only for m within an
    # ulp-sized distance of 2; below m = 2 - 2^-10 the floor is E for every binade (|E| <= 149), so the
    # (slow) log2 is evaluated only near the top of a binade.
    if not amax > np.float32(0.0):
        return 0
    m, e = math.frexp(float(amax))  # amax = m * 2^e, m in [0.5, 1): E = e - 1
    if m < 0.99951171875:  # 1 - 2^-11
        fl = e - 1
    else:
        # int(): numba-cuda's math.floor returns a float (the CUDA kernel failed to compile without it)
        fl = int(math.floor(float(np.float32(math.log2(float(amax))))))  # noqa: RUF046
    return (fl - 2 + 127) & 0xFF


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def mxfp4_quantize_block(x: np.ndarray, out: np.ndarray, bi: np.ndarray) -> None:
    """``quantize_row_mxfp4_ref`` for one block: ``x`` float32[32] -> ``out`` uint8[17]; ``bi`` int64[32] scratch.

    Each weight gets ``best_index_mxfp4``: the first of the 16 codes with the least ``|kvalue*d - x|``.
    Half of them never win: for x >= 0 a code of value ``-k*d`` errs by ``RN(k*d + x) >= x``, the error of
    code 0, which comes first (strict ``<``); for x < 0 the same holds for the positive codes, and
    ``RN(-k*d - x) = -RN(k*d - |x|)``, so code ``8 + k`` errs exactly as code k does for ``|x|``. So the
    search runs over codes 1..7 for ``|x|`` (in the C's order, same roundings) and adds 8 for a negative x.
    """
    amax = np.float32(0.0)
    for j in range(QK_MXFP4):
        a = abs(x[j])
        amax = a if amax < a else amax
    e = _e8m0_of_amax(amax)
    d = e8m0_to_fp32_half(e)
    out[0] = e
    for j in range(QK_MXFP4):
        ax = abs(x[j])
        best_err = ax  # code 0: |0*d - x|
        best = 0
        for k in range(1, 8):
            err = abs(fsub(fmul(KVALUES_MXFP4[k], d), ax))
            take = err < best_err
            best = k if take else best
            best_err = err if take else best_err
        bi[j] = best + 8 if (x[j] < np.float32(0.0)) & (best > 0) else best
    for j in range(16):
        out[1 + j] = bi[j] | (bi[16 + j] << 4)


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def mxfp4_dequantize_block(blk: np.ndarray, y: np.ndarray) -> None:
    """``dequantize_row_mxfp4`` for one block: ``kvalue * 2^(e - 128)``."""
    d = e8m0_to_fp32_half(np.int64(blk[0]))
    for j in range(16):
        q = np.int64(blk[1 + j])
        y[j] = fmul(KVALUES_MXFP4[q & 0xF], d)
        y[16 + j] = fmul(KVALUES_MXFP4[q >> 4], d)


# --- CPU kernel ---------------------------------------------------------------------------------------
#
# The block functions above are the reference transcription, and what the CUDA kernel runs
# (ggufkit.quant.kernels.lowbit.cuda re-jits them). The CPU kernel computes the same bytes with less work: the block
# maxima of a row over the float bits as integers (for finite floats |x|'s bit pattern orders as |x| does),
# the exponent from those bits where _e8m0_of_amax takes its frexp branch (a normal maximum whose mantissa
# is below 2 - 2^-10) and by _e8m0_of_amax itself elsewhere, the scale's bits as ggml_e8m0_to_fp32_half
# builds them, and each code as the number of midpoints of the code values 0, 1, 2, 3, 4, 6, 8, 12 times d
# that lie strictly below |x|. That is best_index_mxfp4's choice: the code values and their midpoints are
# exact (small integers and halves times a power of two, subnormal ones included); for |x| between two
# neighbouring code values c < c' both differences |x| - c and c' - |x| are exact (Sterbenz: c' <= 2c,
# or c = 0), so the strict "<" of the C keeps c up to and at the midpoint and takes c' past it; every other
# code errs by at least d more, far beyond a rounding of these differences (an ulp of |x| <= 2^-19 d, or
# |x| below half of d when the exponent wrapped). tests/test_quant_lowbit.py checks weights on and beside
# every midpoint in every binade against ggml.


@numba.njit(cache=True, fastmath=False, error_model="numpy", inline="always")
def _code(v: np.float32, m0: np.float32, m1: np.float32, m2: np.float32, m3: np.float32, m4: np.float32,
          m5: np.float32, m6: np.float32) -> int:
    # mxfp4_quantize_block's search for one weight, as the number of midpoints below |v| (+ 8 when v < 0).
    ax = abs(v)
    c = ((1 if ax > m0 else 0) + (1 if ax > m1 else 0) + (1 if ax > m2 else 0) + (1 if ax > m3 else 0)
         + (1 if ax > m4 else 0) + (1 if ax > m5 else 0) + (1 if ax > m6 else 0))
    return c + 8 if (v < np.float32(0.0)) & (c > 0) else c


@numba.njit(cache=True, fastmath=False, error_model="numpy", inline="always")
def _exponent_of_bits(m: int) -> int:
    # The E8M0 exponent _e8m0_of_amax gives the block maximum whose float bits are m.
    if m == 0:
        return 0
    if (m >> 23) != 0 and (m & 0x7FFFFF) < 0x7FE000:
        return ((m >> 23) - 127 - 2 + 127) & 0xFF
    return _e8m0_of_amax(np.int32(m).view(np.float32))


@numba.njit(cache=True, fastmath=False, error_model="numpy", inline="always")
def quantize_row_mxfp4(fr: np.ndarray, o: np.ndarray, amax_bits: np.ndarray) -> None:
    """One row: ``fr`` float32[n] -> ``o`` uint8[n/32*17]; ``amax_bits`` int32[n/32] scratch. Same bytes as
    :func:`mxfp4_quantize_block` on each block (the CPU entry points of this module and of
    :mod:`ggufkit.quant.kernels.lowbit.mxfp4_f16` run it)."""
    xr = fr.view(np.int32)
    nb = fr.shape[0] // QK_MXFP4
    for b in range(nb):
        m = np.int32(0)
        for j in range(b * QK_MXFP4, (b + 1) * QK_MXFP4):
            a = xr[j] & np.int32(0x7FFFFFFF)
            m = a if a > m else m
        amax_bits[b] = m
    for b in range(nb):
        base = b * QK_MXFP4
        ob = b * MXFP4_BYTES
        e = _exponent_of_bits(amax_bits[b])
        d = np.int32((0x00200000 << e) if e < 2 else ((e - 1) << 23)).view(np.float32)
        o[ob] = e
        m0 = d * np.float32(0.5)  # midpoints of 0, 1, 2, 3, 4, 6, 8, 12 times d (exact)
        m1 = d * np.float32(1.5)
        m2 = d * np.float32(2.5)
        m3 = d * np.float32(3.5)
        m4 = d * np.float32(5.0)
        m5 = d * np.float32(7.0)
        m6 = d * np.float32(10.0)
        for j in range(16):
            lo = _code(fr[base + j], m0, m1, m2, m3, m4, m5, m6)
            hi = _code(fr[base + 16 + j], m0, m1, m2, m3, m4, m5, m6)
            o[ob + 1 + j] = lo | (hi << 4)


@numba.njit(parallel=True, cache=True, fastmath=False, error_model="numpy")
def quantize_rows_mxfp4(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """MXFP4 quantization of ``x`` float32[n_rows, n_per_row] into ``out`` uint8[n_rows, n_per_row/32*17].

    ``qw`` is ignored, as ``ggml_quantize_chunk(GGML_TYPE_MXFP4)`` ignores the imatrix. Same bytes as
    :func:`mxfp4_quantize_block` on every block.
    """
    n_rows, n_per_row = x.shape
    for r in numba.prange(n_rows):
        quantize_row_mxfp4(x[r], out[r], np.empty(n_per_row // QK_MXFP4, np.int32))


@numba.njit(parallel=True, cache=True, fastmath=False, error_model="numpy")
def dequantize_rows_mxfp4(blocks: np.ndarray, out: np.ndarray) -> None:
    """MXFP4 dequantization: ``blocks`` uint8[n_rows, row_bytes] -> ``out`` float32[n_rows, n_per_row]."""
    n_rows, n_per_row = out.shape
    nb = n_per_row // QK_MXFP4
    for t in numba.prange(n_rows * nb):
        r = t // nb
        b = t - r * nb
        mxfp4_dequantize_block(blocks[r, b * MXFP4_BYTES:(b + 1) * MXFP4_BYTES],
                               out[r, b * QK_MXFP4:(b + 1) * QK_MXFP4])
