"""Shared pieces of the grid-type kernels (:mod:`ggufkit.quant.kernels.iq.iq2`, ``iq3``, ``iq1``).

* :func:`find_best_neighbour`: ggml-quants.c ``iq2_find_best_neighbour`` / ``iq3_find_best_neighbour``
  (the same loop over 8 or 4 elements);
* :func:`signs_with_parity`: the sign extraction of IQ2_XXS/IQ2_XS/IQ3_XXS (an odd number of negative
  weights flips the least important one, so 7 stored bits suffice);
* :func:`f16_bits`: ``GGML_FP32_TO_FP16`` with x86's negative default NaN;
* :func:`check_rows`: turns the per-row failure flags of a kernel into a :class:`QuantizationError` where
  ggml would have stopped with ``GGML_ASSERT``/``GGML_ABORT`` (only reachable with weights whose squares
  overflow float32, which make every distance NaN or inf).

Float discipline as in :mod:`ggufkit.quant.kernels.kquants.subroutines`: float32 everywhere, literals as ``np.float32``,
sums in ggml's index order; the CPU has no FMA contraction without fastmath.
"""

from __future__ import annotations

import numba
import numpy as np

from ggufkit.errors import QuantizationError
from ggufkit.quant.kernels.fp import fp32_to_fp16

QK_K = 256
FLT_MAX = np.float32(3.4028234663852886e38)
#: Failure codes a kernel stores per row (0 = fine).
NO_GRID_POINT = 1  # find_best_neighbour found nothing (GGML_ASSERT(grid_index >= 0))
NEGATIVE_SCALE = 2  # GGML_ASSERT(scale >= 0) failed (NaN scale)


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def f16_bits(v: np.float32) -> int:
    """``GGML_FP32_TO_FP16`` as the x86 build stores it (a NaN there is the default NaN, sign set)."""
    if v != v:
        return 0xFE00
    return np.int64(fp32_to_fp16(v))


@numba.njit(cache=True, fastmath=False, error_model="numpy", inline="always")
def put_u16(out: np.ndarray, off: int, v: int) -> None:
    """Store ``v`` little-endian at ``out[off:off+2]``."""
    out[off] = v & 0xFF
    out[off + 1] = (v >> 8) & 0xFF


@numba.njit(cache=True, fastmath=False, error_model="numpy", inline="always")
def find_best_neighbour(neighbours: np.ndarray, start: int, qgrid: np.ndarray, xval: np.ndarray, off: int,
                        waux: np.ndarray, scale: np.float32, L: np.ndarray, terms: np.ndarray) -> int:
    """``iq2_find_best_neighbour`` / ``iq3_find_best_neighbour``: the listed grid point closest to
    ``xval[off:off+E]`` in the ``waux``-weighted sense; writes its levels into ``L[off:off+E]``.

    For the 8-wide grids (3 levels per element) the terms ``waux*diff*diff`` of each element and level are
    computed once into ``terms`` (float32[32] scratch) and each neighbour's distance sums them in ggml's
    element order: the same float32 operations on the same operands as ggml's loop, so the same bits.

    Returns:
        The grid index, or -1 where ggml asserts (every distance NaN or >= FLT_MAX).
    """
    n_el = qgrid.shape[1]
    num = np.int64(neighbours[start])
    best_d2 = FLT_MAX
    grid_index = -1
    if n_el == 8:
        for i in range(8):
            for lv in range(3):
                diff = scale * np.float32(2 * lv + 1) - xval[off + i]
                terms[4 * i + lv] = waux[off + i] * diff * diff
        for j in range(1, num + 1):
            g = np.int64(neighbours[start + j])
            d2 = np.float32(0.0)
            for i in range(8):
                d2 += terms[4 * i + ((qgrid[g, i] - 1) >> 1)]
            if d2 < best_d2:
                best_d2 = d2
                grid_index = g
        if grid_index < 0:
            return -1
        for i in range(n_el):
            L[off + i] = (qgrid[grid_index, i] - 1) // 2
        return grid_index
    for j in range(1, num + 1):
        g = np.int64(neighbours[start + j])
        d2 = np.float32(0.0)
        for i in range(n_el):
            diff = scale * np.float32(qgrid[g, i]) - xval[off + i]
            d2 += waux[off + i] * diff * diff
        if d2 < best_d2:
            best_d2 = d2
            grid_index = g
    if grid_index < 0:
        return -1
    for i in range(n_el):
        L[off + i] = (qgrid[grid_index, i] - 1) // 2
    return grid_index


@numba.njit(cache=True, fastmath=False, error_model="numpy", inline="always")
def signs_with_parity(xb: np.ndarray, off: int, weight: np.ndarray, xval: np.ndarray) -> int:
    """|x| of 8 weights into ``xval[off:off+8]`` and their 7 sign bits; an odd count of negatives flips
    the element with the smallest ``weight*x*x`` (its xval becomes negative, its bit toggles)."""
    nflip = 0
    s = 0
    for i in range(8):
        v = xb[off + i]
        if v >= np.float32(0.0):
            xval[off + i] = v
        else:
            xval[off + i] = -v
            nflip += 1
            s |= 1 << i
    if nflip % 2:
        imin = 0
        mn = weight[off] * xb[off] * xb[off]
        for i in range(1, 8):
            ax = weight[off + i] * xb[off + i] * xb[off + i]
            if ax < mn:
                mn = ax
                imin = i
        xval[off + imin] = -xval[off + imin]
        s ^= 1 << imin
    return s & 127


@numba.njit(cache=True, fastmath=False, error_model="numpy", inline="always")
def fmax(a: np.float32, b: np.float32) -> np.float32:
    """ggml's ``MAX(a, b)``: ``a > b ? a : b`` (NaN in a gives b)."""
    return a if a > b else b


def check_rows(bad: np.ndarray, type_name: str) -> None:
    """Raise where a kernel flagged a row on which ggml stops with an assertion.

    Raises:
        QuantizationError: naming the first such row and why.
    """
    rows = np.flatnonzero(bad)
    if rows.size:
        why = "no grid point within reach" if bad[rows[0]] == NO_GRID_POINT else "a NaN sub-block scale"
        raise QuantizationError(f"{type_name}: row {int(rows[0])} cannot be quantized ({why}; ggml aborts here "
                                "too: weights whose squares overflow float32)")


def need_imatrix(qw: np.ndarray, type_name: str) -> None:
    """ggml_quantize_requires_imatrix: IQ2_XXS, IQ2_XS and IQ1_S have no quantizer without one.

    Raises:
        QuantizationError: when ``qw`` is empty.
    """
    if qw.size == 0:
        raise QuantizationError(f"{type_name} needs an importance matrix (ggml has no reference quantizer "
                                "for it)")
