"""Q1_0 kernels (1-bit sign quantization): Numba CPU quantize/dequantize, byte-identical to ggml.

Block (ggml-common.h ``block_q1_0``), 128 weights in 18 bytes: ``d`` f16 @0, the mean absolute value of the
block, and ``qs[16]`` @2 (bit ``j % 8`` of byte ``j // 8`` set when weight j >= 0). A weight decodes to
``+d`` or ``-d``.

``ggml_quantize_chunk`` runs ``quantize_row_q1_0_ref`` with or without an imatrix (``quantize_q1_0``,
ggml-quants.c, ignores it).
"""

from __future__ import annotations

import numba
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ggufkit.quant.kernels.fp import fadd, fp16_to_fp32, fp32_to_fp16

QK1_0 = GGML_QUANT_SIZES[GGMLQuantizationType.Q1_0][0]  # 128
Q1_0_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.Q1_0][1]  # 18

_CHUNK = 64


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def q1_0_quantize_block(x: np.ndarray, out: np.ndarray) -> None:
    """``quantize_row_q1_0_ref`` for one block: ``x`` float32[128] -> ``out`` uint8[18]."""
    s = np.float32(0.0)
    for j in range(QK1_0):
        s = fadd(s, abs(x[j]))
    h = np.int64(fp32_to_fp16(s / np.float32(QK1_0)))
    out[0] = h & 0xFF
    out[1] = h >> 8
    for k in range(QK1_0 // 8):
        byte = 0
        for b in range(8):
            if x[8 * k + b] >= np.float32(0.0):
                byte |= 1 << b
        out[2 + k] = byte


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def q1_0_dequantize_block(blk: np.ndarray, y: np.ndarray) -> None:
    """``dequantize_row_q1_0`` for one block: ``bit ? d : -d``."""
    d = fp16_to_fp32(np.int64(blk[0]) | (np.int64(blk[1]) << 8))
    for j in range(QK1_0):
        y[j] = d if (np.int64(blk[2 + j // 8]) >> (j % 8)) & 1 else -d


@numba.njit(parallel=True, cache=True, fastmath=False, error_model="numpy")
def quantize_rows_q1_0(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """Q1_0 quantization of ``x`` float32[n_rows, n_per_row] into ``out`` uint8[n_rows, n_per_row/128*18].

    ``qw`` is ignored, as ``ggml_quantize_chunk(GGML_TYPE_Q1_0)`` ignores the imatrix.
    """
    n_rows, n_per_row = x.shape
    nb = n_per_row // QK1_0
    total = n_rows * nb
    for c in numba.prange((total + _CHUNK - 1) // _CHUNK):
        for t in range(c * _CHUNK, min(total, (c + 1) * _CHUNK)):
            r = t // nb
            b = t - r * nb
            q1_0_quantize_block(x[r, b * QK1_0:(b + 1) * QK1_0], out[r, b * Q1_0_BYTES:(b + 1) * Q1_0_BYTES])


@numba.njit(parallel=True, cache=True, fastmath=False, error_model="numpy")
def dequantize_rows_q1_0(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q1_0 dequantization: ``blocks`` uint8[n_rows, row_bytes] -> ``out`` float32[n_rows, n_per_row]."""
    n_rows, n_per_row = out.shape
    nb = n_per_row // QK1_0
    for t in numba.prange(n_rows * nb):
        r = t // nb
        b = t - r * nb
        q1_0_dequantize_block(blocks[r, b * Q1_0_BYTES:(b + 1) * Q1_0_BYTES], out[r, b * QK1_0:(b + 1) * QK1_0])
