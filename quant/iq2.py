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
by ``0.25*sigma2 + x*x``. Dequantization: ``dequantize_row_iq2_xxs`` / ``_xs`` / ``_s``.
"""

from __future__ import annotations

from functools import cache

import numba
import numpy as np
from gguf import GGMLQuantizationType

from ggufkit.quant.fp import fp16_to_fp32
from ggufkit.quant.iq_common import (
    FLT_MAX,
    NEGATIVE_SCALE,
    NO_GRID_POINT,
    QK_K,
    check_rows,
    f16_bits,
    find_best_neighbour,
    fmax,
    need_imatrix,
    put_u16,
    signs_with_parity,
)
from ggufkit.quant.iq_grids import NeighbourLanes, iq_tables, ksigns_iq2xs, neighbour_lanes
from ggufkit.quant.kquants_math import GROUP_MAX_EPS, make_qp_quants, nearest_int_full

T = GGMLQuantizationType
GROUP_MAX_EPS_IQ2_S = np.float32(1e-8)
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_HALF = np.float32(0.5)
_FLT_MAX_BITS = 0x7F7FFFFF
_NO_KEY = _FLT_MAX_BITS << 32
#: Scratch lanes for one neighbour list (the longest IQ2 list pads to 296 lanes, IQ2_XS).
_MAX_PAD = 512


@numba.njit(cache=True, fastmath=False, error_model="numpy", inline="always")
def _round_levels(xval: np.ndarray, off: int, iscale: np.float32, Lout: np.ndarray) -> int:
    """``l = clamp(nearest_int(0.5*(id*x - 1)), 0, 2)`` for 8 values; returns their packed 2-bit index."""
    u = 0
    for i in range(8):
        lv = nearest_int_full(_HALF * (iscale * xval[off + i] - _F1))
        lv = max(0, min(2, lv))
        Lout[off + i] = lv
        u |= lv << (2 * i)
    return u


@numba.njit(cache=True, fastmath=False, error_model="numpy", inline="always")
def _packed(L: np.ndarray, off: int) -> int:
    u = 0
    for i in range(8):
        u |= np.int64(L[off + i]) << (2 * i)
    return u


@numba.njit(cache=True, fastmath=False, error_model="numpy", inline="always")
def _fit(n: int, weight: np.ndarray, xval: np.ndarray, L: np.ndarray) -> tuple[np.float32, np.float32]:
    sumqx = _F0
    sumq2 = _F0
    for i in range(n):
        w = weight[i]
        q = np.float32(2 * L[i] + 1)
        sumqx += w * xval[i] * q
        sumq2 += w * q * q
    return sumqx, sumq2


_LANES = 32  # trial scales side by side in _trials (19 or 13 used; the extra lanes repeat the last)
_MAGIC = np.float32(12582912.0)  # 1.5 * 2^23: v + _MAGIC - _MAGIC rounds half to even for |v| < 2^22
_ROUND_OK = np.float32(4194304.0)  # 2^22


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _trials(n: int, n_try: int, xval: np.ndarray, weight: np.ndarray, waux: np.ndarray, mx: np.float32,
            scale0: np.float32, qgrid: np.ndarray, kmap: np.ndarray, L: np.ndarray, lstart: np.ndarray, lpad: np.ndarray, lindex: np.ndarray,
               lvalues: np.ndarray, d2: np.ndarray, d2bits: np.ndarray, isv: np.ndarray, q: np.ndarray,
               u: np.ndarray, on_aux: np.ndarray, sx: np.ndarray, s2: np.ndarray
               ) -> tuple[np.float32, int, bool, bool, bool]:
    """The ``2*n_try + 1`` trial scales ``(5 + 0.1*is)/mx`` over ``n`` weights (IQ2_XS/IQ2_S: 16 and 9,
    IQ2_XXS: 32 and 6) side by side (as iq3.py's _trials does for IQ3): the roundings
    and the two sums of every trial are vector lanes, each trial's float32 operations in ggml's order; the
    neighbour searches run per trial and group, the winner is picked in ggml's trial order with ggml's
    comparison. Only where every ``0.5*(iscale*xval - 1)`` is below 2^22 in magnitude (``nearest_int`` is
    then plain round-half-even): otherwise returns ok=False and the caller runs the sequential loop.

    Returns:
        (scale, failure code, ok, on-grid flag of group 0, of group 1); the winning levels in ``L`` (no
        winner: ``scale0``, ``L`` untouched).
    """
    nt = 2 * n_try + 1
    for t in range(_LANES):
        isv[t] = (np.float32(5.0) + np.float32(min(t, nt - 1) - n_try) * np.float32(0.1)) / mx
    for k in range(n // 8):
        for t in range(_LANES):
            u[k, t] = 0
    bad = 0
    for i in range(n):
        xi = xval[i]
        sh = 2 * (i % 8)
        k = i // 8
        for t in range(_LANES):
            v = _HALF * (isv[t] * xi - _F1)
            bad |= np.int32(not (abs(v) < _ROUND_OK))
            r = (v + _MAGIC) - _MAGIC
            r = min(max(r, _F0), np.float32(2.0))
            q[i, t] = np.float32(2.0) * r + _F1
            u[k, t] |= np.int32(r) << sh
    if bad:
        return scale0, 0, False, True, True
    for t in range(nt):
        this_scale = _F1 / isv[t]
        for k in range(n // 8):
            uu = u[k, t]
            on_aux[t, k] = kmap[uu] >= 0
            if on_aux[t, k]:
                continue
            o = 8 * k
            # iq2_find_best_neighbour over neighbour_lanes' layout, as in _search_16
            p = np.uint64(lpad[uu])
            s0 = np.uint64(lstart[uu])
            bb = np.uint64(8) * s0
            x0 = xval[o]
            x1 = xval[o + 1]
            x2 = xval[o + 2]
            x3 = xval[o + 3]
            x4 = xval[o + 4]
            x5 = xval[o + 5]
            x6 = xval[o + 6]
            x7 = xval[o + 7]
            w0 = waux[o]
            w1 = waux[o + 1]
            w2 = waux[o + 2]
            w3 = waux[o + 3]
            w4 = waux[o + 4]
            w5 = waux[o + 5]
            w6 = waux[o + 6]
            w7 = waux[o + 7]
            for j in range(p):
                e0 = this_scale * np.float32(lvalues[bb + j]) - x0
                e1 = this_scale * np.float32(lvalues[bb + p + j]) - x1
                e2 = this_scale * np.float32(lvalues[bb + np.uint64(2) * p + j]) - x2
                e3 = this_scale * np.float32(lvalues[bb + np.uint64(3) * p + j]) - x3
                e4 = this_scale * np.float32(lvalues[bb + np.uint64(4) * p + j]) - x4
                e5 = this_scale * np.float32(lvalues[bb + np.uint64(5) * p + j]) - x5
                e6 = this_scale * np.float32(lvalues[bb + np.uint64(6) * p + j]) - x6
                e7 = this_scale * np.float32(lvalues[bb + np.uint64(7) * p + j]) - x7
                dd = (((((((_F0 + w0 * e0 * e0) + w1 * e1 * e1) + w2 * e2 * e2) + w3 * e3 * e3)
                        + w4 * e4 * e4) + w5 * e5 * e5) + w6 * e6 * e6) + w7 * e7 * e7
                d2[j] = dd if dd < FLT_MAX else FLT_MAX
            key = np.int64(_NO_KEY)
            for j in range(p):
                key = min(key, (np.int64(d2bits[j]) << 32) | np.int64(j))
            if (key >> 32) >= _FLT_MAX_BITS:
                return _F0, NO_GRID_POINT, True, True, True
            gi = np.int64(lindex[s0 + np.uint64(key & 0xFFFFFFFF)])
            for i in range(8):
                q[o + i, t] = np.float32(qgrid[gi, i])
    for t in range(_LANES):
        sx[t] = _F0
        s2[t] = _F0
    for i in range(n):
        wx = weight[i] * xval[i]
        w = weight[i]
        for t in range(_LANES):
            qi = q[i, t]
            sx[t] += wx * qi
            s2[t] += w * qi * qi
    best = _F0
    scale = scale0
    bt = -1
    for t in range(nt):
        if s2[t] > _F0 and sx[t] * sx[t] > best * s2[t]:
            scale = sx[t] / s2[t]
            best = scale * sx[t]
            bt = t
    if bt < 0:
        return scale, 0, True, True, True
    for i in range(n):
        L[i] = np.int8((np.int64(q[i, bt]) - 1) // 2)
    return scale, 0, True, on_aux[bt, 0], on_aux[bt, 1]


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _trials_16_seq(xval: np.ndarray, weight: np.ndarray, waux: np.ndarray, mx: np.float32, qgrid: np.ndarray,
                   kmap: np.ndarray, L: np.ndarray, Laux: np.ndarray, lstart: np.ndarray, lpad: np.ndarray,
                   lindex: np.ndarray, lvalues: np.ndarray, d2: np.ndarray,
                   d2bits: np.ndarray) -> tuple[np.float32, int, bool, bool]:
    """_trials one trial after another with ggml's ``nearest_int`` over every input (huge or NaN
    ``iscale*xval``): (scale, failure code, on-grid flags of the winner's two groups)."""
    best = _F0
    scale = mx / np.float32(5.0)
    on0 = True
    on1 = True
    # _round_levels, find_best_neighbour and _fit written out (Numba reference-counts every array passed
    # to an inlined helper on each call); measured alone this gained little, the lane search most.
    for is_ in range(-9, 10):
        iscale = (np.float32(5.0) + np.float32(is_) * np.float32(0.1)) / mx
        this_scale = _F1 / iscale
        aux0 = True
        aux1 = True
        for k in range(2):
            o = 8 * k
            u = 0
            for i in range(8):
                lv = nearest_int_full(_HALF * (iscale * xval[o + i] - _F1))
                lv = max(0, min(2, lv))
                Laux[o + i] = lv
                u |= lv << (2 * i)
            gk = np.int64(kmap[u])
            if gk < 0:
                if k == 0:
                    aux0 = False
                else:
                    aux1 = False
                # iq2_find_best_neighbour (ggml-quants.c) with the candidates of the list side by side over
                # neighbour_lanes' layout, as iq3.py's _trials does it: each candidate's distance with
                # ggml's float32 operations in element order (from +0, so >= +0; NaN and anything not below
                # FLT_MAX, which never wins in ggml, become FLT_MAX), and the smallest (bits << 32 | lane)
                # key is ggml's first strictly-smallest candidate (padding lanes repeat the last one).
                p = np.uint64(lpad[u])
                s0 = np.uint64(lstart[u])
                bb = np.uint64(8) * s0
                x0 = xval[o]
                x1 = xval[o + 1]
                x2 = xval[o + 2]
                x3 = xval[o + 3]
                x4 = xval[o + 4]
                x5 = xval[o + 5]
                x6 = xval[o + 6]
                x7 = xval[o + 7]
                w0 = waux[o]
                w1 = waux[o + 1]
                w2 = waux[o + 2]
                w3 = waux[o + 3]
                w4 = waux[o + 4]
                w5 = waux[o + 5]
                w6 = waux[o + 6]
                w7 = waux[o + 7]
                for j in range(p):
                    e0 = this_scale * np.float32(lvalues[bb + j]) - x0
                    e1 = this_scale * np.float32(lvalues[bb + p + j]) - x1
                    e2 = this_scale * np.float32(lvalues[bb + np.uint64(2) * p + j]) - x2
                    e3 = this_scale * np.float32(lvalues[bb + np.uint64(3) * p + j]) - x3
                    e4 = this_scale * np.float32(lvalues[bb + np.uint64(4) * p + j]) - x4
                    e5 = this_scale * np.float32(lvalues[bb + np.uint64(5) * p + j]) - x5
                    e6 = this_scale * np.float32(lvalues[bb + np.uint64(6) * p + j]) - x6
                    e7 = this_scale * np.float32(lvalues[bb + np.uint64(7) * p + j]) - x7
                    dd = (((((((_F0 + w0 * e0 * e0) + w1 * e1 * e1) + w2 * e2 * e2) + w3 * e3 * e3)
                            + w4 * e4 * e4) + w5 * e5 * e5) + w6 * e6 * e6) + w7 * e7 * e7
                    d2[j] = dd if dd < FLT_MAX else FLT_MAX
                key = np.int64(_NO_KEY)
                for j in range(p):
                    key = min(key, (np.int64(d2bits[j]) << 32) | np.int64(j))
                if (key >> 32) >= _FLT_MAX_BITS:
                    return scale, NO_GRID_POINT, True, True
                gi = np.int64(lindex[s0 + np.uint64(key & 0xFFFFFFFF)])
                for i in range(8):
                    Laux[o + i] = (qgrid[gi, i] - 1) // 2
        sumqx = _F0
        sumq2 = _F0
        for i in range(16):
            w = weight[i]
            q = np.float32(2 * Laux[i] + 1)
            sumqx += w * xval[i] * q
            sumq2 += w * q * q
        if sumq2 > _F0 and sumqx * sumqx > best * sumq2:
            scale = sumqx / sumq2
            best = scale * sumqx
            for i in range(16):
                L[i] = Laux[i]
            on0 = aux0
            on1 = aux1
    return scale, 0, on0, on1


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _search_16(xval: np.ndarray, weight: np.ndarray, waux: np.ndarray, mx: np.float32, qgrid: np.ndarray,
               kmap: np.ndarray, neigh: np.ndarray, L: np.ndarray, Laux: np.ndarray, terms: np.ndarray,
               lstart: np.ndarray, lpad: np.ndarray, lindex: np.ndarray, lvalues: np.ndarray, d2: np.ndarray,
               d2bits: np.ndarray, isv: np.ndarray, q: np.ndarray, uk: np.ndarray, on_aux: np.ndarray,
               sx: np.ndarray, s2: np.ndarray) -> tuple[np.float32, int]:
    """The scale search of IQ2_XS / IQ2_S over 16 weights (two groups of 8): returns (scale, fail)."""
    scale, fail, ok, on0, on1 = _trials(16, 9, xval, weight, waux, mx, mx / np.float32(5.0), qgrid, kmap, L, lstart,
                                        lpad, lindex, lvalues, d2, d2bits, isv, q, uk, on_aux, sx, s2)
    if fail:
        return scale, fail
    if not ok:
        scale, fail, on0, on1 = _trials_16_seq(xval, weight, waux, mx, qgrid, kmap, L, Laux, lstart, lpad,
                                               lindex, lvalues, d2, d2bits)
        if fail:
            return scale, fail
    if (not on0 or not on1) and scale > _F0:
        iscale = _F1 / scale
        for k in range(2):
            if (on0 if k == 0 else on1):
                continue
            u = _round_levels(xval, 8 * k, iscale, L)
            if kmap[u] < 0 and find_best_neighbour(neigh, -kmap[u] - 1, qgrid, xval, 8 * k, waux, scale, L, terms) < 0:
                return scale, NO_GRID_POINT
        sumqx, sumq2 = _fit(16, weight, xval, L)
        if sumq2 > _F0:
            scale = sumqx / sumq2
    return scale, 0


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _sumx2(xbl: np.ndarray) -> np.float32:
    s = _F0
    for i in range(QK_K):
        s += xbl[i] * xbl[i]
    return s


@cache
def _lanes(qtype: GGMLQuantizationType) -> NeighbourLanes:
    """``neighbour_lanes(qtype)``, checked to fit the kernels' ``_MAX_PAD`` scratch lanes, its values (the
    grid levels 1, 3, 5) as uint8: a quarter of the memory the searches stream through (12-21 MB as
    float32), converted back exactly in the kernels."""
    n = neighbour_lanes(qtype)
    if int(n.pad.max()) > _MAX_PAD:
        raise AssertionError(f"{qtype.name}: a neighbour list of {int(n.pad.max())} lanes exceeds {_MAX_PAD}")
    values = n.values.astype(np.uint8)
    if not np.array_equal(values.astype(np.float32), n.values):
        raise AssertionError(f"{qtype.name}: grid levels that are not small integers")
    return n._replace(values=values)


# --- IQ2_XXS ---------------------------------------------------------------------------------------


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _iq2_xxs_block(xbl: np.ndarray, qw: np.ndarray, y: np.ndarray, qgrid: np.ndarray, kmap: np.ndarray,
                   neigh: np.ndarray, lstart: np.ndarray, lpad: np.ndarray, lindex: np.ndarray,
                   lvalues: np.ndarray) -> int:
    """quantize_row_iq2_xxs_impl for one super-block: writes ``y`` (66 bytes); returns a failure code."""
    scales = np.zeros(8, np.float32)
    weight = np.empty(32, np.float32)
    waux = np.empty(32, np.float32)
    xval = np.empty(32, np.float32)
    L = np.zeros(32, np.int8)
    Laux = np.zeros(32, np.int8)
    Lq = np.zeros(32, np.uint8)
    terms = np.empty(32, np.float32)
    bsigns = np.zeros(4, np.int64)
    q2 = np.zeros(16, np.int64)
    d2 = np.empty(_MAX_PAD, np.float32)
    d2bits = d2.view(np.int32)
    isv = np.empty(_LANES, np.float32)
    qv = np.empty((32, _LANES), np.float32)
    uk = np.empty((4, _LANES), np.int32)
    on_aux = np.zeros((_LANES, 4), np.bool_)
    sx = np.empty(_LANES, np.float32)
    s2 = np.empty(_LANES, np.float32)
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
        if mx < GROUP_MAX_EPS:
            scales[ib] = _F0
            continue
        scale = make_qp_quants(32, 4, xval, Lq, weight)
        eff_max = scale * np.float32(3.0)
        if eff_max <= _F0:
            scales[ib] = _F0
            continue
        scale, fail, ok, _, _ = _trials(32, 6, xval, weight, waux, eff_max, scale, qgrid, kmap, L, lstart, lpad,
                                        lindex, lvalues, d2, d2bits, isv, qv, uk, on_aux, sx, s2)
        if fail:
            return fail
        if not ok:  # ggml's nearest_int beyond plain rounding: the trials one after another
            best = _F0
            for is_ in range(-6, 7):
                iscale = (np.float32(5.0) + np.float32(is_) * np.float32(0.1)) / eff_max
                this_scale = _F1 / iscale
                # _round_levels, iq2_find_best_neighbour and _fit written out, as in _search_16
                for k in range(4):
                    o = 8 * k
                    u = 0
                    for i in range(8):
                        lv = nearest_int_full(_HALF * (iscale * xval[o + i] - _F1))
                        lv = max(0, min(2, lv))
                        Laux[o + i] = lv
                        u |= lv << (2 * i)
                    if kmap[u] >= 0:
                        continue
                    p = np.uint64(lpad[u])
                    s0 = np.uint64(lstart[u])
                    bb = np.uint64(8) * s0
                    x0 = xval[o]
                    x1 = xval[o + 1]
                    x2 = xval[o + 2]
                    x3 = xval[o + 3]
                    x4 = xval[o + 4]
                    x5 = xval[o + 5]
                    x6 = xval[o + 6]
                    x7 = xval[o + 7]
                    w0 = waux[o]
                    w1 = waux[o + 1]
                    w2 = waux[o + 2]
                    w3 = waux[o + 3]
                    w4 = waux[o + 4]
                    w5 = waux[o + 5]
                    w6 = waux[o + 6]
                    w7 = waux[o + 7]
                    for j in range(p):
                        e0 = this_scale * np.float32(lvalues[bb + j]) - x0
                        e1 = this_scale * np.float32(lvalues[bb + p + j]) - x1
                        e2 = this_scale * np.float32(lvalues[bb + np.uint64(2) * p + j]) - x2
                        e3 = this_scale * np.float32(lvalues[bb + np.uint64(3) * p + j]) - x3
                        e4 = this_scale * np.float32(lvalues[bb + np.uint64(4) * p + j]) - x4
                        e5 = this_scale * np.float32(lvalues[bb + np.uint64(5) * p + j]) - x5
                        e6 = this_scale * np.float32(lvalues[bb + np.uint64(6) * p + j]) - x6
                        e7 = this_scale * np.float32(lvalues[bb + np.uint64(7) * p + j]) - x7
                        dd = (((((((_F0 + w0 * e0 * e0) + w1 * e1 * e1) + w2 * e2 * e2) + w3 * e3 * e3)
                                + w4 * e4 * e4) + w5 * e5 * e5) + w6 * e6 * e6) + w7 * e7 * e7
                        d2[j] = dd if dd < FLT_MAX else FLT_MAX
                    key = np.int64(_NO_KEY)
                    for j in range(p):
                        key = min(key, (np.int64(d2bits[j]) << 32) | np.int64(j))
                    if (key >> 32) >= _FLT_MAX_BITS:
                        return NO_GRID_POINT
                    gi = np.int64(lindex[s0 + np.uint64(key & 0xFFFFFFFF)])
                    for i in range(8):
                        Laux[o + i] = (qgrid[gi, i] - 1) // 2
                sumqx = _F0
                sumq2 = _F0
                for i in range(32):
                    w = weight[i]
                    q = np.float32(2 * Laux[i] + 1)
                    sumqx += w * xval[i] * q
                    sumq2 += w * q * q
                if sumq2 > _F0 and sumqx * sumqx > best * sumq2:
                    scale = sumqx / sumq2
                    best = scale * sumqx
                    for i in range(32):
                        L[i] = Laux[i]
        if scale > _F0:
            iscale = _F1 / scale
            for k in range(4):
                u = _round_levels(xval, 8 * k, iscale, L)
                g = kmap[u]
                if g < 0:
                    g = find_best_neighbour(neigh, -kmap[u] - 1, qgrid, xval, 8 * k, waux, scale, L, terms)
                    if g < 0:
                        return NO_GRID_POINT
                for i in range(8):
                    L[8 * k + i] = (qgrid[g, i] - 1) // 2
            sumqx, sumq2 = _fit(32, weight, xval, L)
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
def _iq2_xxs_rows(x: np.ndarray, qw: np.ndarray, out: np.ndarray, qgrid: np.ndarray, kmap: np.ndarray,
                  neigh: np.ndarray, lstart: np.ndarray, lpad: np.ndarray, lindex: np.ndarray, lvalues: np.ndarray,
                  bad: np.ndarray) -> None:
    nb = x.shape[1] // QK_K
    for t in numba.prange(x.shape[0] * nb):
        r = t // nb
        b = t % nb
        code = _iq2_xxs_block(x[r, QK_K * b:QK_K * (b + 1)], qw[QK_K * b:QK_K * (b + 1)],
                              out[r, 66 * b:66 * (b + 1)], qgrid, kmap, neigh, lstart, lpad, lindex, lvalues)
        if code:
            bad[r] = code


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
    _iq2_xxs_rows(x, qw, out, t.qgrid, t.kmap, t.neighbours, n.start, n.pad, n.grid_index, n.values, bad)
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


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _iq2_16_block(xbl: np.ndarray, qw: np.ndarray, use_qw: bool, is_s: bool, y: np.ndarray, qgrid: np.ndarray,
                  kmap: np.ndarray, neigh: np.ndarray, lstart: np.ndarray, lpad: np.ndarray, lindex: np.ndarray,
                  lvalues: np.ndarray) -> int:
    """quantize_row_iq2_xs_impl (``is_s`` False, 74 bytes) or quantize_row_iq2_s_impl (``is_s``, 82 bytes)
    for one super-block; returns a failure code."""
    scales = np.zeros(16, np.float32)
    weight = np.empty(16, np.float32)
    waux = np.empty(16, np.float32)
    xval = np.empty(16, np.float32)
    L = np.zeros(16, np.int8)
    Laux = np.zeros(16, np.int8)
    bsigns = np.zeros(2, np.int64)
    terms = np.empty(32, np.float32)
    d2 = np.empty(_MAX_PAD, np.float32)
    d2bits = d2.view(np.int32)
    isv = np.empty(_LANES, np.float32)
    q = np.empty((16, _LANES), np.float32)
    uk = np.empty((2, _LANES), np.int32)
    on_aux = np.zeros((_LANES, 4), np.bool_)
    sx = np.empty(_LANES, np.float32)
    s2 = np.empty(_LANES, np.float32)
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
        scale, fail = _search_16(xval, weight, waux, mx, qgrid, kmap, neigh, L, Laux, terms, lstart, lpad, lindex,
                                 lvalues, d2, d2bits, isv, q, uk, on_aux, sx, s2)
        if fail:
            return fail
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
def _iq2_16_rows(x: np.ndarray, qw: np.ndarray, out: np.ndarray, is_s: bool, qgrid: np.ndarray, kmap: np.ndarray,
                 neigh: np.ndarray, lstart: np.ndarray, lpad: np.ndarray, lindex: np.ndarray, lvalues: np.ndarray,
                 bad: np.ndarray) -> None:
    nb = x.shape[1] // QK_K
    bs = 82 if is_s else 74
    use_qw = qw.size > 0
    for t in numba.prange(x.shape[0] * nb):
        r = t // nb
        b = t % nb
        qwb = qw[QK_K * b:QK_K * (b + 1)] if use_qw else qw
        code = _iq2_16_block(x[r, QK_K * b:QK_K * (b + 1)], qwb, use_qw, is_s, out[r, bs * b:bs * (b + 1)],
                             qgrid, kmap, neigh, lstart, lpad, lindex, lvalues)
        if code:
            bad[r] = code


def quantize_rows_iq2_xs(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """Quantize float32 rows to IQ2_XS (``quantize_iq2_xs``; an imatrix is required).

    Raises:
        QuantizationError: no imatrix, or a row on which ggml aborts.
    """
    need_imatrix(qw, "IQ2_XS")
    t = iq_tables(T.IQ2_XS)
    n = _lanes(T.IQ2_XS)
    bad = np.zeros(x.shape[0], np.uint8)
    _iq2_16_rows(x, qw, out, False, t.qgrid, t.kmap, t.neighbours, n.start, n.pad, n.grid_index, n.values, bad)
    check_rows(bad, "IQ2_XS")


def quantize_rows_iq2_s(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """Quantize float32 rows to IQ2_S (``quantize_iq2_s``; ``qw`` of length 0 = no imatrix).

    Raises:
        QuantizationError: a row on which ggml aborts.
    """
    t = iq_tables(T.IQ2_S)
    n = _lanes(T.IQ2_S)
    bad = np.zeros(x.shape[0], np.uint8)
    _iq2_16_rows(x, qw, out, True, t.qgrid, t.kmap, t.neighbours, n.start, n.pad, n.grid_index, n.values, bad)
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
