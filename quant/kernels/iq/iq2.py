"""IQ2_XXS / IQ2_XS / IQ2_S kernels: Numba CPU quantize/dequantize, byte-identical to ggml.

Block layouts (ggml-common.h; 256 weights, f16 ``d`` at byte 0, little-endian):

* IQ2_XXS, 66 bytes: ``qs`` uint16[32] @2, read as 8 pairs of uint32 per 32 weights: the first holds four
  8-bit indices into ``iq2xxs_grid`` (8 weights each), the second four 7-bit sign indices into
  ``ksigns_iq2xs`` and the 4-bit sub-block scale in its top bits.
* IQ2_XS, 74 bytes: ``qs`` uint16[32] @2 (9-bit index into ``iq2xs_grid`` | 7-bit signs << 9, per 8
  weights), ``scales`` uint8[8] @66 (two 4-bit scales, one per 16 weights).
* IQ2_S, 82 bytes: ``qs`` uint8[64] @2 (32 low index bytes, then 32 sign bytes), ``qh`` uint8[8] @66
  (2 high index bits per 8 weights), ``scales`` uint8[8] @74.

Quantization follows ``ggml_quantize_chunk`` (ggml-quants.c: ``quantize_row_iq2_xxs_impl``,
``quantize_row_iq2_xs_impl``, ``quantize_row_iq2_s_impl``). IQ2_XXS and IQ2_XS have no reference path
(``ggml_quantize_requires_imatrix``): without an imatrix they raise. IQ2_S without one weights each value
by ``0.25*sigma2 + x*x``. Dequantization: ``dequantize_row_iq2_xxs`` / ``_xs`` / ``_s``. The scale
trials, neighbour searches and IQ2_XXS's ``make_qp_quants`` are in :mod:`ggufkit.quant.kernels.iq.iq2_search`.
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

import numba
import numpy as np
from gguf import GGMLQuantizationType

from ggufkit.quant.kernels.fp import fp16_to_fp32
from ggufkit.quant.kernels.iq.common import (
    NEGATIVE_SCALE,
    NO_GRID_POINT,
    QK_K,
    check_rows,
    f16_bits,
    fmax,
    need_imatrix,
    put_u16,
    signs_with_parity,
)
from ggufkit.quant.kernels.iq.grids import iq_tables, ksigns_iq2xs, neighbour_lanes
from ggufkit.quant.kernels.iq.iq2_search import (
    MAX_LANES,
    MAX_PAD,
    lane_search,
    qp_scale32,
    trials,
    trials_seq,
)
from ggufkit.quant.kernels.kquants.subroutines import GROUP_MAX_EPS, nearest_int_full
from ggufkit.quant.kernels.worksharing import claim, work_counter, workers

T = GGMLQuantizationType
GROUP_MAX_EPS_IQ2_S = np.float32(1e-8)
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_HALF = np.float32(0.5)


@numba.njit(cache=True, fastmath=False, error_model="numpy", inline="always")
def _packed(L: np.ndarray, off: int) -> int:
    u = 0
    for i in range(8):
        u |= np.int64(L[off + i]) << (2 * i)
    return u


@numba.njit(cache=True, fastmath=False, error_model="numpy", _nrt=False)
def _sumx2(xbl: np.ndarray) -> np.float32:
    s = _F0
    for i in range(QK_K):
        s += xbl[i] * xbl[i]
    return s


class _Lanes(NamedTuple):
    """The searches' view of :class:`~ggufkit.quant.kernels.iq.grids.NeighbourLanes`: ``info[u]`` -1 for a point on
    the grid, else ``start * 512 + pad`` of its list (one load per search instead of three), the lanes'
    grid indices, and their values (the grid levels 1, 3, 5) as uint8: a quarter of the memory the
    searches stream through (12-21 MB as float32), converted back exactly in the kernels."""

    info: np.ndarray  # int32[kmap_size]
    grid_index: np.ndarray  # int32[lanes]
    values: np.ndarray  # uint8[E * lanes]


@cache
def _lanes(qtype: GGMLQuantizationType) -> _Lanes:
    """:class:`_Lanes` of ``neighbour_lanes(qtype)``, checked to fit the kernels' scratch (two lists of
    ``MAX_PAD`` lanes) and the ``info`` encoding."""
    n = neighbour_lanes(qtype)
    if int(n.pad.max()) >= MAX_PAD:
        raise AssertionError(f"{qtype.name}: a neighbour list of {int(n.pad.max())} lanes, not below {MAX_PAD}")
    values = n.values.astype(np.uint8)
    if not np.array_equal(values.astype(np.float32), n.values):
        raise AssertionError(f"{qtype.name}: grid levels that are not small integers")
    info = np.where(n.start >= 0, n.start.astype(np.int64) * MAX_PAD + n.pad, -1)
    if int(info.max()) >= 2**31:
        raise AssertionError(f"{qtype.name}: too many lanes for int32 list info")
    return _Lanes(info.astype(np.int32), n.grid_index, values)


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _scratch(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                              np.ndarray]:
    """Per-work-item scratch of the block functions: float32[12 + n, MAX_LANES] (rows: trial iscales,
    trial scales, the two sums, 4 for the packed indices (and make_qp_quants' lanes before), one for the
    out-of-range counts, 3 spare, then the candidate values ``q``), int32[4, MAX_LANES] packed
    indices, bool[MAX_LANES, 4] on-grid flags, float32[4, 32] (weight, waux, xval, scales), int8[2, 32]
    (L, Laux), uint8[32], float32[2 * MAX_PAD] (the distances of one list at two scales), int64[20] (IQ2_XXS's 16 words of
    ``qs``, then the sign bits of the sub-groups)."""
    return (np.empty((12 + n, MAX_LANES), np.float32), np.zeros((4, MAX_LANES), np.int32),
            np.zeros((MAX_LANES, 4), np.bool_), np.zeros((4, 32), np.float32), np.zeros((2, 32), np.int8),
            np.zeros(32, np.uint8), np.zeros(2 * MAX_PAD, np.float32), np.zeros(20, np.int64))


# --- IQ2_XXS ---------------------------------------------------------------------------------------


@numba.njit(cache=True, fastmath=False, error_model="numpy", _nrt=False)
def _iq2_xxs_block(xbl: np.ndarray, qw: np.ndarray, y: np.ndarray, fs: np.ndarray, u: np.ndarray,
                   on_grid: np.ndarray, fv: np.ndarray, ls: np.ndarray, Lq: np.ndarray, d2: np.ndarray, iw: np.ndarray,
                   kmap: np.ndarray,
                   qgrid: np.ndarray, linfo: np.ndarray, lindex: np.ndarray,
                   lvalues: np.ndarray) -> int:
    """quantize_row_iq2_xxs_impl for one super-block: writes ``y`` (66 bytes); returns a failure code."""
    isv = fs[0]
    ts = fs[1]
    sx = fs[2]
    s2 = fs[3]
    q = fs[12:]
    weight = fv[0]
    waux = fv[1]
    xval = fv[2]
    scales = fv[3]
    L = ls[0]
    q2 = iw[:16]
    bsigns = iw[16:]
    q2[:] = 0
    sigma2 = _sumx2(xbl) / np.float32(QK_K)
    max_scale = _F0
    for ib in range(8):
        xb = xbl[32 * ib:32 * ib + 32]
        for i in range(32):
            weight[i] = qw[32 * ib + i] * np.sqrt(sigma2 + xb[i] * xb[i])
        for i in range(32):
            waux[i] = np.sqrt(weight[i])
        for k in range(4):
            bsigns[k] = signs_with_parity(xb, 8 * k, weight, xval)
        mx = xval[0]
        for i in range(1, 32):
            mx = fmax(mx, xval[i])
        for i in range(32):
            L[i] = 0
        if mx < GROUP_MAX_EPS:
            scales[ib] = _F0
            continue
        scale = qp_scale32(16, xval, weight, Lq, fs[4:9])
        eff_max = scale * np.float32(3.0)
        if eff_max <= _F0:
            scales[ib] = _F0
            continue
        scale, fail, ok, _, _ = trials(32, 6, 16, xval, weight, waux, eff_max, scale, L, isv, ts, q, u, on_grid,
                                       sx, s2, fs[4:8], fs[8], d2, linfo, qgrid, lindex, lvalues)
        if not ok:  # ggml's nearest_int beyond plain rounding: the trials one after another
            scale, fail, _, _ = trials_seq(32, 6, xval, weight, waux, eff_max, scale, L, ts, q, u, on_grid, d2,
                                           linfo, qgrid, lindex, lvalues)
        if fail:
            return fail
        if scale > _F0:  # ggml's final pass, written out as in _iq2_16_block
            iscale = _F1 / scale
            ts[0] = scale
            for k in range(4):
                uu = 0
                for i in range(8):
                    lv = max(0, min(2, nearest_int_full(_HALF * (iscale * xval[8 * k + i] - _F1))))
                    q[8 * k + i, 0] = np.float32(2 * lv + 1)
                    uu |= lv << (2 * i)
                u[k, 0] = uu
            fail = lane_search(1, 0, 4, u, ts, xval, waux, q, on_grid, d2, linfo, qgrid, lindex, lvalues)
            if fail:
                return fail
            sumqx = _F0
            sumq2 = _F0
            for i in range(32):
                L[i] = np.int8((np.int64(q[i, 0]) - 1) // 2)
                w = weight[i]
                qi = q[i, 0]
                sumqx += w * xval[i] * qi
                sumq2 += w * qi * qi
            if sumq2 > _F0:
                scale = sumqx / sumq2
        if scale < _F0:
            scale = -scale
            for k in range(4):
                bsigns[k] = (~bsigns[k]) & 127
        for k in range(4):
            g = kmap[_packed(L, 8 * k)]
            if g < 0:
                return NO_GRID_POINT
            q2[2 * ib] |= np.int64(g) << (8 * k)
            q2[2 * ib + 1] |= bsigns[k] << (7 * k)
        if not scale >= _F0:
            return NEGATIVE_SCALE
        scales[ib] = scale
        max_scale = fmax(max_scale, scale)
    y[:] = 0
    if max_scale == _F0:
        return 0
    d = max_scale / np.float32(31.0)
    put_u16(y, 0, f16_bits(d))
    iscale = _F1 / d
    for ib in range(8):
        lv = max(0, min(15, nearest_int_full(_HALF * (iscale * scales[ib] - _F1))))
        q2[2 * ib + 1] |= np.int64(lv) << 28
    for j in range(16):
        for b in range(4):
            y[2 + 4 * j + b] = (q2[j] >> (8 * b)) & 0xFF
    return 0


@numba.njit(cache=True, fastmath=False, error_model="numpy", parallel=True)
def _iq2_xxs_rows(x: np.ndarray, qw: np.ndarray, out: np.ndarray, kmap: np.ndarray, qgrid: np.ndarray,
                  linfo: np.ndarray, lindex: np.ndarray, lvalues: np.ndarray,
                  bad: np.ndarray, n_workers: int) -> None:
    nb = x.shape[1] // QK_K
    todo = work_counter(x.shape[0] * nb)
    for _w in numba.prange(n_workers):
        fs, u, on_grid, fv, ls, Lq, d2, iw = _scratch(32)
        lo, hi = claim(todo)
        while lo < hi:
            for t in range(lo, hi):
                r = t // nb
                b = t % nb
                code = _iq2_xxs_block(x[r, QK_K * b:QK_K * (b + 1)], qw[QK_K * b:QK_K * (b + 1)],
                                      out[r, 66 * b:66 * (b + 1)], fs, u, on_grid, fv, ls, Lq, d2, iw, kmap, qgrid,
                                      linfo, lindex, lvalues)
                if code:
                    bad[r] = code
            lo, hi = claim(todo)


def quantize_rows_iq2_xxs(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """Quantize float32 rows to IQ2_XXS (``quantize_iq2_xxs``; an imatrix is required).

    Args:
        x: float32[n_rows, n_per_row], n_per_row a multiple of 256.
        qw: float32[n_per_row] importance weights.
        out: uint8[n_rows, n_per_row // 256 * 66].

    Raises:
        QuantizationError: no imatrix, or a row on which ggml aborts.
    """
    need_imatrix(qw, "IQ2_XXS")
    t = iq_tables(T.IQ2_XXS)
    n = _lanes(T.IQ2_XXS)
    bad = np.zeros(x.shape[0], np.uint8)
    _iq2_xxs_rows(x, qw, out, t.kmap, t.qgrid, n.info, n.grid_index, n.values, bad, workers())
    check_rows(bad, "IQ2_XXS")


@numba.njit(cache=True, fastmath=False, error_model="numpy", parallel=True)
def _iq2_xxs_dequant(blocks: np.ndarray, out: np.ndarray, dgrid: np.ndarray, ksigns: np.ndarray) -> None:
    nb = out.shape[1] // QK_K
    for t in numba.prange(blocks.shape[0] * nb):
        r = t // nb
        b = t % nb
        blk = blocks[r, 66 * b:66 * (b + 1)]
        y = out[r, QK_K * b:QK_K * (b + 1)]
        d = fp16_to_fp32(np.uint16(blk[0] | (np.int64(blk[1]) << 8)))
        for ib in range(8):
            o = 2 + 8 * ib
            aux1 = (np.int64(blk[o + 4]) | (np.int64(blk[o + 5]) << 8) | (np.int64(blk[o + 6]) << 16)
                    | (np.int64(blk[o + 7]) << 24))
            db = d * (_HALF + np.float32(aux1 >> 28)) * np.float32(0.25)
            for gl in range(4):
                g = np.int64(blk[o + gl])
                signs = ksigns[(aux1 >> (7 * gl)) & 127]
                for j in range(8):
                    v = db * dgrid[g, j]
                    y[32 * ib + 8 * gl + j] = -v if signs & (1 << j) else v


def dequantize_rows_iq2_xxs(blocks: np.ndarray, out: np.ndarray) -> None:
    """``dequantize_row_iq2_xxs`` over uint8[n_rows, row_bytes] into float32[n_rows, n_per_row]."""
    _iq2_xxs_dequant(blocks, out, iq_tables(T.IQ2_XXS).dgrid, ksigns_iq2xs())


# --- IQ2_XS / IQ2_S -----------------------------------------------------------------------------


@numba.njit(cache=True, fastmath=False, error_model="numpy", _nrt=False)
def _iq2_16_block(xbl: np.ndarray, qw: np.ndarray, use_qw: bool, is_s: bool, y: np.ndarray, fs: np.ndarray,
                  u: np.ndarray, on_grid: np.ndarray, fv: np.ndarray, ls: np.ndarray, d2: np.ndarray, iw: np.ndarray,
                  kmap: np.ndarray,
                  qgrid: np.ndarray, linfo: np.ndarray, lindex: np.ndarray,
                  lvalues: np.ndarray) -> int:
    """quantize_row_iq2_xs_impl (``is_s`` False, 74 bytes) or quantize_row_iq2_s_impl (``is_s``, 82 bytes)
    for one super-block; returns a failure code."""
    isv = fs[0]
    ts = fs[1]
    sx = fs[2]
    s2 = fs[3]
    q = fs[12:]
    weight = fv[0]
    waux = fv[1]
    xval = fv[2]
    scales = fv[3]
    L = ls[0]
    bsigns = iw[16:18]
    y[:] = 0
    sumx2 = _sumx2(xbl)
    sigma2 = np.float32(2.0) * sumx2 / np.float32(QK_K) if is_s else sumx2 / np.float32(QK_K)
    eps = GROUP_MAX_EPS_IQ2_S if is_s else GROUP_MAX_EPS
    max_scale = _F0
    for ib in range(16):
        xb = xbl[16 * ib:16 * ib + 16]
        if use_qw:
            for i in range(16):
                weight[i] = qw[16 * ib + i] * np.sqrt(sigma2 + xb[i] * xb[i])
        else:
            for i in range(16):
                weight[i] = np.float32(0.25) * sigma2 + xb[i] * xb[i]
        for i in range(16):
            waux[i] = np.sqrt(weight[i])
        for k in range(2):
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
        for i in range(1, 16):
            mx = fmax(mx, xval[i])
        for i in range(16):
            L[i] = 0
        if mx < eps:
            scales[ib] = _F0
            continue
        scale0 = mx / np.float32(5.0)
        scale, fail, ok, on0, on1 = trials(16, 9, 24, xval, weight, waux, mx, scale0, L, isv, ts, q, u, on_grid, sx,
                                           s2, fs[4:8], fs[8], d2, linfo, qgrid, lindex, lvalues)
        if not ok:  # ggml's nearest_int beyond plain rounding: the trials one after another
            scale, fail, on0, on1 = trials_seq(16, 9, xval, weight, waux, mx, scale0, L, ts, q, u, on_grid, d2,
                                               linfo, qgrid, lindex, lvalues)
        if fail:
            return fail
        if (not on0 or not on1) and scale > _F0:
            # ggml's final pass, written out (a helper's calls cost more than its work here): the sub-groups
            # off the grid at the winning trial re-rounded at 1/scale and, off the grid, searched at scale;
            # then the refit
            k0 = 1 if on0 else 0
            k1 = 1 if on1 else 2
            iscale = _F1 / scale
            ts[0] = scale
            for k in range(k0, k1):
                uu = 0
                for i in range(8):
                    lv = max(0, min(2, nearest_int_full(_HALF * (iscale * xval[8 * k + i] - _F1))))
                    q[8 * k + i, 0] = np.float32(2 * lv + 1)
                    uu |= lv << (2 * i)
                u[k, 0] = uu
            fail = lane_search(1, k0, k1, u, ts, xval, waux, q, on_grid, d2, linfo, qgrid, lindex, lvalues)
            if fail:
                return fail
            for i in range(8 * k0, 8 * k1):
                L[i] = np.int8((np.int64(q[i, 0]) - 1) // 2)
            sumqx = _F0
            sumq2 = _F0
            for i in range(16):
                w = weight[i]
                qi = np.float32(2 * L[i] + 1)
                sumqx += w * xval[i] * qi
                sumq2 += w * qi * qi
            if sumq2 > _F0:
                scale = sumqx / sumq2
        if scale < _F0:
            scale = -scale
            for k in range(2):
                bsigns[k] = (~bsigns[k]) & (0xFF if is_s else 127)
        for k in range(2):
            g = np.int64(kmap[_packed(L, 8 * k)])
            if g < 0:
                return NO_GRID_POINT
            if is_s:
                i8 = 2 * ib + k
                y[2 + i8] = g & 255
                y[66 + i8 // 4] |= (g >> 8) << (2 * (i8 % 4))
                y[2 + 32 + i8] = bsigns[k]
            else:
                put_u16(y, 2 + 2 * (2 * ib + k), g | (bsigns[k] << 9))
        if not scale >= _F0:
            return NEGATIVE_SCALE
        scales[ib] = scale
        max_scale = fmax(max_scale, scale)
    if max_scale == _F0:
        if not is_s:  # IQ2_XS clears qs; IQ2_S keeps what it wrote (its d stays 0)
            y[:] = 0
        return 0
    d = max_scale / np.float32(31.0)
    put_u16(y, 0, f16_bits(d * np.float32(0.9875)) if is_s else f16_bits(d))
    iscale = _F1 / d
    so = 74 if is_s else 66
    for ib in range(16):
        lv = max(0, min(15, nearest_int_full(_HALF * (iscale * scales[ib] - _F1))))
        if ib % 2 == 0:
            y[so + ib // 2] = lv
        else:
            y[so + ib // 2] |= lv << 4
    return 0


@numba.njit(cache=True, fastmath=False, error_model="numpy", parallel=True)
def _iq2_16_rows(x: np.ndarray, qw: np.ndarray, out: np.ndarray, is_s: bool, kmap: np.ndarray, qgrid: np.ndarray,
                 linfo: np.ndarray, lindex: np.ndarray, lvalues: np.ndarray,
                 bad: np.ndarray, n_workers: int) -> None:
    nb = x.shape[1] // QK_K
    bs = 82 if is_s else 74
    use_qw = qw.size > 0
    todo = work_counter(x.shape[0] * nb)
    for _w in numba.prange(n_workers):
        fs, u, on_grid, fv, ls, _, d2, iw = _scratch(16)
        lo, hi = claim(todo)
        while lo < hi:
            for t in range(lo, hi):
                r = t // nb
                b = t % nb
                qwb = qw[QK_K * b:QK_K * (b + 1)] if use_qw else qw
                code = _iq2_16_block(x[r, QK_K * b:QK_K * (b + 1)], qwb, use_qw, is_s, out[r, bs * b:bs * (b + 1)],
                                     fs, u, on_grid, fv, ls, d2, iw, kmap, qgrid, linfo, lindex, lvalues)
                if code:
                    bad[r] = code
            lo, hi = claim(todo)


def quantize_rows_iq2_xs(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """Quantize float32 rows to IQ2_XS (``quantize_iq2_xs``; an imatrix is required).

    Raises:
        QuantizationError: no imatrix, or a row on which ggml aborts.
    """
    need_imatrix(qw, "IQ2_XS")
    t = iq_tables(T.IQ2_XS)
    n = _lanes(T.IQ2_XS)
    bad = np.zeros(x.shape[0], np.uint8)
    _iq2_16_rows(x, qw, out, False, t.kmap, t.qgrid, n.info, n.grid_index, n.values, bad, workers())
    check_rows(bad, "IQ2_XS")


def quantize_rows_iq2_s(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """Quantize float32 rows to IQ2_S (``quantize_iq2_s``; ``qw`` of length 0 = no imatrix).

    Raises:
        QuantizationError: a row on which ggml aborts.
    """
    t = iq_tables(T.IQ2_S)
    n = _lanes(T.IQ2_S)
    bad = np.zeros(x.shape[0], np.uint8)
    _iq2_16_rows(x, qw, out, True, t.kmap, t.qgrid, n.info, n.grid_index, n.values, bad, workers())
    check_rows(bad, "IQ2_S")


@numba.njit(cache=True, fastmath=False, error_model="numpy", parallel=True)
def _iq2_16_dequant(blocks: np.ndarray, out: np.ndarray, is_s: bool, dgrid: np.ndarray, ksigns: np.ndarray) -> None:
    nb = out.shape[1] // QK_K
    bs = 82 if is_s else 74
    so = 74 if is_s else 66
    for t in numba.prange(blocks.shape[0] * nb):
        r = t // nb
        b = t % nb
        blk = blocks[r, bs * b:bs * (b + 1)]
        y = out[r, QK_K * b:QK_K * (b + 1)]
        d = fp16_to_fp32(np.uint16(blk[0] | (np.int64(blk[1]) << 8)))
        for ib in range(8):
            sc = np.int64(blk[so + ib])
            db0 = d * (_HALF + np.float32(sc & 0xF)) * np.float32(0.25)
            db1 = d * (_HALF + np.float32(sc >> 4)) * np.float32(0.25)
            for gl in range(4):
                i8 = 4 * ib + gl
                if is_s:
                    g = np.int64(blk[2 + i8]) | ((np.int64(blk[66 + ib]) << (8 - 2 * gl)) & 0x300)
                    signs = np.int64(blk[2 + 32 + i8])
                else:
                    q = np.int64(blk[2 + 2 * i8]) | (np.int64(blk[3 + 2 * i8]) << 8)
                    g = q & 511
                    signs = np.int64(ksigns[q >> 9])
                dl = db0 if gl < 2 else db1
                for j in range(8):
                    v = dl * dgrid[g, j]
                    y[32 * ib + 8 * gl + j] = -v if signs & (1 << j) else v


def dequantize_rows_iq2_xs(blocks: np.ndarray, out: np.ndarray) -> None:
    """``dequantize_row_iq2_xs`` over uint8[n_rows, row_bytes] into float32[n_rows, n_per_row]."""
    _iq2_16_dequant(blocks, out, False, iq_tables(T.IQ2_XS).dgrid, ksigns_iq2xs())


def dequantize_rows_iq2_s(blocks: np.ndarray, out: np.ndarray) -> None:
    """``dequantize_row_iq2_s`` over uint8[n_rows, row_bytes] into float32[n_rows, n_per_row]."""
    _iq2_16_dequant(blocks, out, True, iq_tables(T.IQ2_S).dgrid, ksigns_iq2xs())
