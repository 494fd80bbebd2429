"""IQ3_XXS / IQ3_S kernels: Numba CPU quantize/dequantize, byte-identical to ggml.

Block layouts (ggml-common.h; 256 weights, f16 ``d`` at byte 0, little-endian):

* IQ3_XXS, 98 bytes: ``qs`` @2: 64 indices into ``iq3xxs_grid`` (4 weights each), then uint32[8]
  ``scales_and_signs`` @66 (per 32 weights: four 7-bit sign indices into ``ksigns_iq2xs`` and the 4-bit
  scale in the top bits).
* IQ3_S, 110 bytes: ``qs`` uint8[64] @2 (low 8 bits of 9-bit indices into ``iq3s_grid``), ``qh`` uint8[8]
  @66 (the 9th bits), ``signs`` uint8[32] @74 (one bit per weight), ``scales`` uint8[4] @106 (4-bit, one
  per 32 weights, stored as ``1 + 2*s``).

Quantization follows ``ggml_quantize_chunk`` (ggml-quants.c: ``quantize_row_iq3_xxs_impl`` with grid 256,
``quantize_row_iq3_s_impl`` with block size 32); both accept no imatrix, weighting each value by ``x*x``
then. Dequantization: ``dequantize_row_iq3_xxs`` / ``dequantize_row_iq3_s``.

IQ3_S quirk kept for byte identity: ``quantize_row_iq3_s_impl`` skips an all-zero 32-weight sub-block with
``continue`` before advancing its ``qs``/``signs`` pointers, so the following sub-blocks' indices and signs
move up into its slots (its ``qh`` bits and scale stay positional); the dequantizer reads them positionally.
"""

from __future__ import annotations

import numba
import numpy as np
from gguf import GGMLQuantizationType

from ggufkit.quant.fp import fp16_to_fp32
from ggufkit.quant.iq_common import (
    NEGATIVE_SCALE,
    NO_GRID_POINT,
    QK_K,
    check_rows,
    f16_bits,
    find_best_neighbour,
    fmax,
    put_u16,
    signs_with_parity,
)
from ggufkit.quant.iq_grids import iq_tables, ksigns_iq2xs
from ggufkit.quant.kquants_math import nearest_int_full

T = GGMLQuantizationType
GROUP_MAX_EPS_IQ3_XXS = np.float32(1e-8)
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_HALF = np.float32(0.5)


@numba.njit(cache=True, fastmath=False, error_model="numpy", inline="always")
def _round_levels3(xval: np.ndarray, off: int, iscale: np.float32, Lout: np.ndarray) -> int:
    """``l = clamp(nearest_int(0.5*(id*x - 1)), 0, 7)`` for 4 values; returns their packed 3-bit index."""
    u = 0
    for i in range(4):
        lv = nearest_int_full(_HALF * (iscale * xval[off + i] - _F1))
        lv = max(0, min(7, lv))
        Lout[off + i] = lv
        u |= lv << (3 * i)
    return u


@numba.njit(cache=True, fastmath=False, error_model="numpy", inline="always")
def _fit32(weight: np.ndarray, xval: np.ndarray, L: np.ndarray) -> tuple[np.float32, np.float32]:
    sumqx = _F0
    sumq2 = _F0
    for i in range(32):
        w = weight[i]
        q = np.float32(2 * L[i] + 1)
        sumqx += w * xval[i] * q
        sumq2 += w * q * q
    return sumqx, sumq2


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _iq3_block(xbl: np.ndarray, qw: np.ndarray, use_qw: bool, is_s: bool, y: np.ndarray, qgrid: np.ndarray,
               kmap: np.ndarray, neigh: np.ndarray) -> int:
    """quantize_row_iq3_xxs_impl (``is_s`` False, 98 bytes) or quantize_row_iq3_s_impl (``is_s``, 110 bytes)
    for one super-block; returns a failure code."""
    scales = np.zeros(8, np.float32)
    weight = np.empty(32, np.float32)
    waux = np.empty(32, np.float32)
    xval = np.empty(32, np.float32)
    L = np.zeros(32, np.int8)
    Laux = np.zeros(32, np.int8)
    bsigns = np.zeros(4, np.int64)
    on_grid = np.zeros(8, np.bool_)
    on_aux = np.zeros(8, np.bool_)
    sas = np.zeros(8, np.int64)  # IQ3_XXS scales_and_signs
    terms = np.empty(32, np.float32)  # unused by the 4-wide grids (find_best_neighbour's 8-wide path)
    y[:] = 0
    sumx2 = _F0
    for i in range(QK_K):
        sumx2 += xbl[i] * xbl[i]
    sigma2 = np.float32(2.0) * sumx2 / np.float32(QK_K)
    n_try = 9 if is_s else 15
    max_scale = _F0
    n_done = 0  # IQ3_S: ggml advances its qs/signs pointers only past sub-blocks that are not all zero
    for ib in range(8):
        xb = xbl[32 * ib:32 * ib + 32]
        if use_qw:
            for i in range(32):
                weight[i] = qw[32 * ib + i] * np.sqrt(sigma2 + xb[i] * xb[i])
        else:
            for i in range(32):
                weight[i] = xb[i] * xb[i]
        for i in range(32):
            waux[i] = np.sqrt(weight[i])
        for k in range(4):
            if is_s:
                s = 0
                for i in range(8):
                    v = xb[8 * k + i]
                    if v >= _F0:
                        xval[8 * k + i] = v
                    else:
                        xval[8 * k + i] = -v
                        s |= 1 << i
                bsigns[k] = s
            else:
                bsigns[k] = signs_with_parity(xb, 8 * k, weight, xval)
        mx = xval[0]
        for i in range(1, 32):
            mx = fmax(mx, xval[i])
        for i in range(32):
            L[i] = 0
        if (mx == _F0) if is_s else (mx < GROUP_MAX_EPS_IQ3_XXS):
            scales[ib] = _F0
            continue
        best = _F0
        scale = mx / np.float32(15.0)
        for k in range(8):
            on_grid[k] = not is_s
        for is_ in range(-n_try, n_try + 1):
            iscale = (np.float32(15.0) + np.float32(is_) * np.float32(0.2)) / mx
            this_scale = _F1 / iscale
            for k in range(8):
                u = _round_levels3(xval, 4 * k, iscale, Laux)
                on_aux[k] = True
                if kmap[u] < 0:
                    on_aux[k] = False
                    if find_best_neighbour(neigh, -kmap[u] - 1, qgrid, xval, 4 * k, waux, this_scale, Laux, terms) < 0:
                        return NO_GRID_POINT
            sumqx, sumq2 = _fit32(weight, xval, Laux)
            if sumq2 > _F0 and sumqx * sumqx > best * sumq2:
                scale = sumqx / sumq2
                best = scale * sumqx
                for i in range(32):
                    L[i] = Laux[i]
                for k in range(8):
                    on_grid[k] = on_aux[k]
        n_not = 0
        for k in range(8):
            if not on_grid[k]:
                n_not += 1
        if n_not > 0 and scale > _F0:
            iscale = _F1 / scale
            for k in range(8):
                if on_grid[k] and not is_s:  # IQ3_S refits every group (the skip is commented out there)
                    continue
                u = _round_levels3(xval, 4 * k, iscale, Laux)
                g = kmap[u]
                if g < 0:
                    g = find_best_neighbour(neigh, -kmap[u] - 1, qgrid, xval, 4 * k, waux, scale, L, terms)
                    if g < 0:
                        return NO_GRID_POINT
                for i in range(4):
                    L[4 * k + i] = (qgrid[g, i] - 1) // 2
            sumqx, sumq2 = _fit32(weight, xval, L)
            if sumq2 > _F0:
                scale = sumqx / sumq2
        if scale < _F0:
            scale = -scale
            for k in range(4):
                bsigns[k] = (~bsigns[k]) & (0xFF if is_s else 127)
        for k in range(8):
            u = 0
            for i in range(4):
                u |= np.int64(L[4 * k + i]) << (3 * i)
            g = np.int64(kmap[u])
            if g < 0:
                return NO_GRID_POINT
            if is_s:
                y[2 + 8 * n_done + k] = g & 255
                y[66 + ib] |= (g >> 8) << k
            else:
                y[2 + 8 * ib + k] = g
        if is_s:
            for k in range(4):
                y[74 + 4 * n_done + k] = bsigns[k]
            n_done += 1
        else:
            sas[ib] = bsigns[0] | (bsigns[1] << 7) | (bsigns[2] << 14) | (bsigns[3] << 21)
        if not scale >= _F0:
            return NEGATIVE_SCALE
        scales[ib] = scale
        max_scale = fmax(max_scale, scale)
    if max_scale == _F0:
        if not is_s:
            y[:] = 0
        return 0
    d = max_scale / np.float32(31.0)
    put_u16(y, 0, f16_bits(d * (np.float32(1.033) if is_s else np.float32(1.0125))))
    iscale = _F1 / d
    for ib in range(8):
        lv = max(0, min(15, nearest_int_full(_HALF * (iscale * scales[ib] - _F1))))
        if is_s:
            if ib % 2 == 0:
                y[106 + ib // 2] = lv
            else:
                y[106 + ib // 2] |= lv << 4
        else:
            v = sas[ib] | (np.int64(lv) << 28)
            for b in range(4):
                y[66 + 4 * ib + b] = (v >> (8 * b)) & 0xFF
    return 0


@numba.njit(cache=True, fastmath=False, error_model="numpy", parallel=True)
def _iq3_rows(x: np.ndarray, qw: np.ndarray, out: np.ndarray, is_s: bool, qgrid: np.ndarray, kmap: np.ndarray,
              neigh: np.ndarray, bad: np.ndarray) -> None:
    nb = x.shape[1] // QK_K
    bs = 110 if is_s else 98
    use_qw = qw.size > 0
    for t in numba.prange(x.shape[0] * nb):
        r = t // nb
        b = t % nb
        qwb = qw[QK_K * b:QK_K * (b + 1)] if use_qw else qw
        code = _iq3_block(x[r, QK_K * b:QK_K * (b + 1)], qwb, use_qw, is_s, out[r, bs * b:bs * (b + 1)],
                          qgrid, kmap, neigh)
        if code:
            bad[r] = code


def quantize_rows_iq3_xxs(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """Quantize float32 rows to IQ3_XXS (``quantize_iq3_xxs``; ``qw`` of length 0 = no imatrix).

    Args:
        x: float32[n_rows, n_per_row], n_per_row a multiple of 256.
        qw: float32[n_per_row] importance weights, or float32[0].
        out: uint8[n_rows, n_per_row // 256 * 98].

    Raises:
        QuantizationError: a row on which ggml aborts.
    """
    t = iq_tables(T.IQ3_XXS)
    bad = np.zeros(x.shape[0], np.uint8)
    _iq3_rows(x, qw, out, False, t.qgrid, t.kmap, t.neighbours, bad)
    check_rows(bad, "IQ3_XXS")


def quantize_rows_iq3_s(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """Quantize float32 rows to IQ3_S (``quantize_iq3_s``; ``qw`` of length 0 = no imatrix).

    Raises:
        QuantizationError: a row on which ggml aborts.
    """
    t = iq_tables(T.IQ3_S)
    bad = np.zeros(x.shape[0], np.uint8)
    _iq3_rows(x, qw, out, True, t.qgrid, t.kmap, t.neighbours, bad)
    check_rows(bad, "IQ3_S")


@numba.njit(cache=True, fastmath=False, error_model="numpy", parallel=True)
def _iq3_dequant(blocks: np.ndarray, out: np.ndarray, is_s: bool, dgrid: np.ndarray, ksigns: np.ndarray) -> None:
    nb = out.shape[1] // QK_K
    bs = 110 if is_s else 98
    for t in numba.prange(blocks.shape[0] * nb):
        r = t // nb
        b = t % nb
        blk = blocks[r, bs * b:bs * (b + 1)]
        y = out[r, QK_K * b:QK_K * (b + 1)]
        d = fp16_to_fp32(np.uint16(blk[0] | (np.int64(blk[1]) << 8)))
        for ib in range(8):
            if is_s:
                db = d * np.float32(1 + 2 * ((np.int64(blk[106 + ib // 2]) >> (4 * (ib % 2))) & 0xF))
                qh = np.int64(blk[66 + ib])
            else:
                o = 66 + 4 * ib
                aux = (np.int64(blk[o]) | (np.int64(blk[o + 1]) << 8) | (np.int64(blk[o + 2]) << 16)
                       | (np.int64(blk[o + 3]) << 24))
                db = d * (_HALF + np.float32(aux >> 28)) * _HALF
            for gl in range(4):
                g1 = np.int64(blk[2 + 8 * ib + 2 * gl])
                g2 = np.int64(blk[3 + 8 * ib + 2 * gl])
                if is_s:
                    g1 |= (qh << (8 - 2 * gl)) & 256
                    g2 |= (qh << (7 - 2 * gl)) & 256
                    signs = np.int64(blk[74 + 4 * ib + gl])
                else:
                    signs = np.int64(ksigns[(aux >> (7 * gl)) & 127])
                for j in range(4):
                    v1 = db * dgrid[g1, j]
                    v2 = db * dgrid[g2, j]
                    y[32 * ib + 8 * gl + j] = -v1 if signs & (1 << j) else v1
                    y[32 * ib + 8 * gl + j + 4] = -v2 if signs & (1 << (j + 4)) else v2


def dequantize_rows_iq3_xxs(blocks: np.ndarray, out: np.ndarray) -> None:
    """``dequantize_row_iq3_xxs`` over uint8[n_rows, row_bytes] into float32[n_rows, n_per_row]."""
    _iq3_dequant(blocks, out, False, iq_tables(T.IQ3_XXS).dgrid, ksigns_iq2xs())


def dequantize_rows_iq3_s(blocks: np.ndarray, out: np.ndarray) -> None:
    """``dequantize_row_iq3_s`` over uint8[n_rows, row_bytes] into float32[n_rows, n_per_row]."""
    _iq3_dequant(blocks, out, True, iq_tables(T.IQ3_S).dgrid, ksigns_iq2xs())
