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

from ggufkit.quant.fp import fmul, fsub

QK_MXFP4 = 32
MXFP4_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.MXFP4][1]  # 17

#: ggml-common.h: kvalues_mxfp4 (E2M1 values, doubled).
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)

_CHUNK = 64


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


@numba.njit(parallel=True, cache=True, fastmath=False, error_model="numpy")
def quantize_rows_mxfp4(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """MXFP4 quantization of ``x`` float32[n_rows, n_per_row] into ``out`` uint8[n_rows, n_per_row/32*17].

    ``qw`` is ignored, as ``ggml_quantize_chunk(GGML_TYPE_MXFP4)`` ignores the imatrix.
    """
    n_rows, n_per_row = x.shape
    nb = n_per_row // QK_MXFP4
    total = n_rows * nb
    for c in numba.prange((total + _CHUNK - 1) // _CHUNK):
        bi = np.empty(QK_MXFP4, np.int64)
        for t in range(c * _CHUNK, min(total, (c + 1) * _CHUNK)):
            r = t // nb
            b = t - r * nb
            mxfp4_quantize_block(x[r, b * QK_MXFP4:(b + 1) * QK_MXFP4], out[r, b * MXFP4_BYTES:(b + 1) * MXFP4_BYTES],
                                 bi)


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
