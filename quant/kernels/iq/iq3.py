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

from ggufkit.quant.kernels.fp import fp16_to_fp32
from ggufkit.quant.kernels.iq.common import (
    FLT_MAX,
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
from ggufkit.quant.kernels.iq.grids import iq_tables, ksigns_iq2xs, neighbour_lanes
from ggufkit.quant.kernels.kquants.subroutines import nearest_int_full
from ggufkit.quant.kernels.worksharing import claim, work_counter, workers

T = GGMLQuantizationType
GROUP_MAX_EPS_IQ3_XXS = np.float32(1e-8)
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_HALF = np.float32(0.5)
_MAGIC = np.float32(12582912.0)  # 1.5 * 2^23: v + _MAGIC - _MAGIC rounds half to even for |v| < 2^22
_LANES = 32  # trial scales side by side (31 for IQ3_XXS, 19 for IQ3_S; the extra lanes repeat the last)
# the side-by-side trials need every 0.5*(iscale*xval - 1) finite and below 2^22 in magnitude (there
# nearest_int rounds half to even): mx in this range and every |xval| <= 65536*mx (|iscale| <= 18.6/mx)
_FAST_MIN = np.float32(1e-30)
_FAST_MAX = np.float32(1e30)
_FLT_MAX_BITS = 0x7F7FFFFF
_NO_KEY = _FLT_MAX_BITS << 32


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
def _lane_neighbour(uu: int, scale: np.float32, xval: np.ndarray, waux: np.ndarray, k: int, lstart: np.ndarray,
                    lpad: np.ndarray, lindex: np.ndarray, lvalues: np.ndarray, d2: np.ndarray,
                    d2bits: np.ndarray) -> int:
    """``iq3_find_best_neighbour`` for group ``k`` (packed index ``uu``, off the grid) at ``scale``, over the
    lane-laid-out list: the same distances in the same float32 order as the search in :func:`_trials`
    (and as ``find_best_neighbour``), the first of the smallest; -1 where ggml asserts."""
    p = np.uint64(lpad[uu])
    s0 = np.uint64(lstart[uu])
    b = np.uint64(4) * s0
    x0 = xval[4 * k]
    x1 = xval[4 * k + 1]
    x2 = xval[4 * k + 2]
    x3 = xval[4 * k + 3]
    w0 = waux[4 * k]
    w1 = waux[4 * k + 1]
    w2 = waux[4 * k + 2]
    w3 = waux[4 * k + 3]
    for j in range(p):
        e0 = scale * lvalues[b + j] - x0
        e1 = scale * lvalues[b + p + j] - x1
        e2 = scale * lvalues[b + np.uint64(2) * p + j] - x2
        e3 = scale * lvalues[b + np.uint64(3) * p + j] - x3
        d = (((_F0 + w0 * e0 * e0) + w1 * e1 * e1) + w2 * e2 * e2) + w3 * e3 * e3
        d2[j] = d if d < FLT_MAX else FLT_MAX
    key = np.int64(_NO_KEY)
    for j in range(p):
        key = min(key, (np.int64(d2bits[j]) << 32) | np.int64(j))
    if (key >> 32) >= _FLT_MAX_BITS:
        return -1
    return np.int64(lindex[s0 + np.uint64(key & 0xFFFFFFFF)])


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _trials(xval: np.ndarray, weight: np.ndarray, waux: np.ndarray, mx: np.float32, n_try: int,
            kmap: np.ndarray, qgrid: np.ndarray, lstart: np.ndarray, lpad: np.ndarray,
            lindex: np.ndarray, lvalues: np.ndarray, L: np.ndarray, on_grid: np.ndarray, q: np.ndarray,
            u: np.ndarray, on_aux: np.ndarray, d2: np.ndarray, d2bits: np.ndarray) -> tuple[np.float32, int]:
    """The trial-scale loop of quantize_row_iq3_xxs_impl / _iq3_s_impl with the trials side by side:
    the roundings and the two sums of all ``2*n_try + 1`` trials are vector lanes (each trial's float32
    operations as ggml orders them), the neighbour searches run per trial and group, and the winner is
    picked in ggml's trial order with ggml's comparison. Valid where every ``iscale*xval`` is finite and
    small (the caller checks): ``nearest_int`` is then plain round-half-even.

    Returns:
        (scale, failure code); the winning levels in ``L`` and its groups' on-grid flags in ``on_grid``.
    """
    nt = 2 * n_try + 1
    iscale = np.empty(_LANES, np.float32)
    for t in range(_LANES):
        iscale[t] = (np.float32(15.0) + np.float32(min(t, nt - 1) - n_try) * np.float32(0.2)) / mx
    # q[i, t] = 2*l + 1 of element i in trial t; u[k, t] the packed index of group k
    for k in range(8):
        for t in range(_LANES):
            u[k, t] = 0
    for i in range(32):
        xi = xval[i]
        sh = 3 * (i % 4)
        k = i // 4
        for t in range(_LANES):
            r = ((_HALF * (iscale[t] * xi - _F1)) + _MAGIC) - _MAGIC
            r = min(max(r, _F0), np.float32(7.0))
            q[i, t] = np.float32(2.0) * r + _F1
            u[k, t] |= np.int32(r) << sh
    # The neighbour searches (iq3_find_best_neighbour; ggml runs them inside each trial, they do not depend
    # on each other), written out here: an array passed to an inlined helper costs reference counting.
    # Each candidate's distance is computed with ggml's float32 operations in ggml's element order, the
    # candidates of a list side by side (vector lanes; unsigned indices spare the negative-index checks).
    # ggml keeps the first candidate below the best distance so far: the smallest distance, first index
    # among equals. The distances are >= +0 (sums of w*e*e, w = sqrt(weight), from +0; NaN and anything
    # not below FLT_MAX, which never wins, is set to FLT_MAX), so their bit patterns order as the floats
    # do and (bits << 32 | lane) is smallest at ggml's winner; padding lanes repeat the last candidate.
    for t in range(nt):
        this_scale = _F1 / iscale[t]
        for k in range(8):
            uu = u[k, t]
            on_aux[t, k] = kmap[uu] >= 0
            if on_aux[t, k]:
                continue
            p = np.uint64(lpad[uu])
            s0 = np.uint64(lstart[uu])
            b = np.uint64(4) * s0
            x0 = xval[4 * k]
            x1 = xval[4 * k + 1]
            x2 = xval[4 * k + 2]
            x3 = xval[4 * k + 3]
            w0 = waux[4 * k]
            w1 = waux[4 * k + 1]
            w2 = waux[4 * k + 2]
            w3 = waux[4 * k + 3]
            for j in range(p):
                e0 = this_scale * lvalues[b + j] - x0
                e1 = this_scale * lvalues[b + p + j] - x1
                e2 = this_scale * lvalues[b + np.uint64(2) * p + j] - x2
                e3 = this_scale * lvalues[b + np.uint64(3) * p + j] - x3
                d = (((_F0 + w0 * e0 * e0) + w1 * e1 * e1) + w2 * e2 * e2) + w3 * e3 * e3
                d2[j] = d if d < FLT_MAX else FLT_MAX
            key = np.int64(_NO_KEY)
            for j in range(p):
                key = min(key, (np.int64(d2bits[j]) << 32) | np.int64(j))
            if (key >> 32) >= _FLT_MAX_BITS:
                return _F0, NO_GRID_POINT
            g = np.int64(lindex[s0 + np.uint64(key & 0xFFFFFFFF)])
            for i in range(4):
                q[4 * k + i, t] = np.float32(qgrid[g, i])
    sumqx = np.zeros(_LANES, np.float32)
    sumq2 = np.zeros(_LANES, np.float32)
    for i in range(32):
        wx = weight[i] * xval[i]
        w = weight[i]
        for t in range(_LANES):
            qi = q[i, t]
            sumqx[t] += wx * qi
            sumq2[t] += w * qi * qi
    best = _F0
    scale = mx / np.float32(15.0)
    bt = -1
    for t in range(nt):
        if sumq2[t] > _F0 and sumqx[t] * sumqx[t] > best * sumq2[t]:
            scale = sumqx[t] / sumq2[t]
            best = scale * sumqx[t]
            bt = t
    if bt >= 0:
        for i in range(32):
            L[i] = np.int8((np.int64(q[i, bt]) - 1) // 2)
        for k in range(8):
            on_grid[k] = on_aux[bt, k]
    return scale, 0


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _iq3_block(xbl: np.ndarray, qw: np.ndarray, use_qw: bool, is_s: bool, y: np.ndarray, qgrid: np.ndarray,
               kmap: np.ndarray, neigh: np.ndarray, lstart: np.ndarray, lpad: np.ndarray,
               lindex: np.ndarray, lvalues: np.ndarray) -> int:
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
    q = np.empty((32, _LANES), np.float32)
    packed = np.empty((8, _LANES), np.int32)
    on_trial = np.empty((_LANES, 8), np.bool_)
    d2 = np.empty(64, np.float32)  # >= the longest padded neighbour list (40)
    d2bits = d2.view(np.int32)
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
        fast = mx >= _FAST_MIN and mx <= _FAST_MAX  # False for NaN
        if fast:
            lim = mx * np.float32(65536.0)
            for i in range(32):
                fast = fast and abs(xval[i]) <= lim
        if (mx == _F0) if is_s else (mx < GROUP_MAX_EPS_IQ3_XXS):
            scales[ib] = _F0
            continue
        for k in range(8):
            on_grid[k] = not is_s
        if fast:
            scale, code = _trials(xval, weight, waux, mx, n_try, kmap, qgrid, lstart, lpad, lindex,
                                  lvalues, L, on_grid, q, packed, on_trial, d2, d2bits)
            if code:
                return code
        else:
            # subnormal, huge or NaN magnitudes: ggml's loop as written (nearest_int's full behaviour)
            best = _F0
            scale = mx / np.float32(15.0)
            for is_ in range(-n_try, n_try + 1):
                iscale = (np.float32(15.0) + np.float32(is_) * np.float32(0.2)) / mx
                this_scale = _F1 / iscale
                for k in range(8):
                    uu = _round_levels3(xval, 4 * k, iscale, Laux)
                    on_aux[k] = True
                    if kmap[uu] < 0:
                        on_aux[k] = False
                        if find_best_neighbour(neigh, -kmap[uu] - 1, qgrid, xval, 4 * k, waux, this_scale, Laux,
                                               terms) < 0:
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
                uu = _round_levels3(xval, 4 * k, iscale, Laux)
                g = kmap[uu]
                if g < 0:
                    g = _lane_neighbour(uu, scale, xval, waux, k, lstart, lpad, lindex, lvalues, d2, d2bits)
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
              neigh: np.ndarray, lstart: np.ndarray, lpad: np.ndarray, lindex: np.ndarray,
              lvalues: np.ndarray, bad: np.ndarray, n_workers: int) -> None:
    nb = x.shape[1] // QK_K
    bs = 110 if is_s else 98
    use_qw = qw.size > 0
    todo = work_counter(x.shape[0] * nb)  # blocks handed out from a shared counter (quant.worksharing)
    for _w in numba.prange(n_workers):
        lo, hi = claim(todo)
        while lo < hi:
            for t in range(lo, hi):
                r = t // nb
                b = t % nb
                qwb = qw[QK_K * b:QK_K * (b + 1)] if use_qw else qw
                code = _iq3_block(x[r, QK_K * b:QK_K * (b + 1)], qwb, use_qw, is_s, out[r, bs * b:bs * (b + 1)],
                                  qgrid, kmap, neigh, lstart, lpad, lindex, lvalues)
                if code:
                    bad[r] = code
            lo, hi = claim(todo)


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
    n = neighbour_lanes(T.IQ3_XXS)
    bad = np.zeros(x.shape[0], np.uint8)
    _iq3_rows(x, qw, out, False, t.qgrid, t.kmap, t.neighbours, n.start, n.pad, n.grid_index, n.values, bad,
              workers())
    check_rows(bad, "IQ3_XXS")


def quantize_rows_iq3_s(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """Quantize float32 rows to IQ3_S (``quantize_iq3_s``; ``qw`` of length 0 = no imatrix).

    Raises:
        QuantizationError: a row on which ggml aborts.
    """
    t = iq_tables(T.IQ3_S)
    n = neighbour_lanes(T.IQ3_S)
    bad = np.zeros(x.shape[0], np.uint8)
    _iq3_rows(x, qw, out, True, t.qgrid, t.kmap, t.neighbours, n.start, n.pad, n.grid_index, n.values, bad,
              workers())
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
