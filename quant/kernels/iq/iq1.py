"""IQ1_S / IQ1_M kernels: Numba CPU quantize/dequantize, byte-identical to ggml.

Block layouts (ggml-common.h; 256 weights, little-endian):

* IQ1_S, 50 bytes: f16 ``d`` @0, ``qs`` uint8[32] @2 (low 8 bits of 11-bit indices into ``iq1s_grid``,
  one per 8 weights), ``qh`` uint16[8] @34 (per 32 weights: 3 high bits of each of its 4 indices, the
  3-bit scale in bits 12-14 and the sign of the shift ``IQ1S_DELTA`` in bit 15).
* IQ1_M, 56 bytes: ``qs`` uint8[32] @0, ``qh`` uint8[16] @32 (per 16 weights: two 3-bit high index parts,
  each with a shift-sign bit 0x08 / 0x80), ``scales`` uint8[8] @48 (sixteen 3-bit scales, and the f16
  super-scale spread over the top nibbles of the four uint16 words).

Quantization follows ``ggml_quantize_chunk`` (ggml-quants.c: ``quantize_row_iq1_s_impl``,
``quantize_row_iq1_m_impl``). IQ1_S requires an imatrix (``ggml_quantize_requires_imatrix``); IQ1_M
weights each value by ``x*x`` without one. The exhaustive split search sorts a sub-block's weights with
``qsort``: glibc up to 2.36 sorts these small arrays with a stable merge sort, so ties keep their index
order, as the sort by rank here does (the split searches themselves: :mod:`ggufkit.quant.kernels.iq.iq1_split`).
Dequantization: ``dequantize_row_iq1_s`` / ``_iq1_m``.
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

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
    fmax,
    need_imatrix,
    put_u16,
)
from ggufkit.quant.kernels.iq.grids import NeighbourLanes, iq_tables, lay_out_lists
from ggufkit.quant.kernels.iq.iq1_split import (
    DELTA,
    M_KEYS,
    M_PRE,
    M_SCRATCH,
    PW0,
    PW1,
    PX0,
    PX1,
    SplitScratch,
    iq1_m_scan,
    iq1_m_search,
    iq1_s_search,
    split_scratch,
)
from ggufkit.quant.kernels.iq.iq1_split import X_M as _X_M
from ggufkit.quant.kernels.iq.iq1_split import X_P as _X_P
from ggufkit.quant.kernels.kquants.subroutines import nearest_int_full
from ggufkit.quant.kernels.worksharing import claim, work_counter, workers

T = GGMLQuantizationType
GROUP_MAX_EPS_IQ1_S = np.float32(1e-12)
GROUP_MAX_EPS_IQ1_M = np.float32(1e-7)
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_HALF = np.float32(0.5)
#: Scratch lanes for one neighbour list (the longest reachable IQ1 list pads to 208 lanes).
_MAX_LANES = 256
_MASKS = np.array([0x00, 0x80, 0x08, 0x88], np.int64)
_FLT_MAX_BITS = np.int32(0x7F7FFFFF)
#: Lane numbers as int32 (``_stable_order``'s tie test).
_LANE_IDS = np.arange(32, dtype=np.int32)


@numba.njit(cache=True, fastmath=False, error_model="numpy", _nrt=False)
def _stable_order(xb: np.ndarray, idx: np.ndarray, rank: np.ndarray) -> None:
    """Indices of ``xb`` sorted ascending by value, ties in index order (glibc's merge-sort ``qsort``).

    By rank: ``xb[i]`` goes to the number of values below it plus the equal ones before it. The counts
    are accumulated for all ``i`` at once, one ``j`` at a time (``rank``: int32 scratch as long as ``xb``):
    branch-free vector loops without a horizontal sum per ``i`` (328 -> 221 ns per 32 values); an insertion
    sort mispredicts most of its comparisons. The tie test ``j < i`` compares int32 lane numbers (a constant
    array): on the loop's int64 counter AVX2 needs two 4-wide compares and packing per 8 lanes."""
    n = np.uint64(xb.size)
    for i in range(n):
        rank[i] = 0
    for j in range(n):
        xj = xb[j]
        jj = np.int32(j)
        for i in range(n):
            rank[i] += np.int32((xj < xb[i]) | ((xj == xb[i]) & (jj < _LANE_IDS[i])))
    for i in range(n):
        idx[rank[i]] = i


@cache
def _iq1_lanes() -> NeighbourLanes:
    """The IQ1 neighbour lists in :func:`~ggufkit.quant.kernels.iq.grids.lay_out_lists`' layout, each element stored
    as its level 0/1/2 (uint8), and only for the packed indices a split can produce (every 2-bit field <= 2:
    4513 of the 41644 lists, ~2.7 MB instead of ~48 MB as float32 grid values for all)."""
    t = iq_tables(T.IQ1_S)  # IQ1_M shares IQ1_S's grid
    fields = (np.arange(t.kmap.size)[:, None] >> (2 * np.arange(8))) & 3
    lanes = lay_out_lists(t, np.flatnonzero((t.kmap < 0) & (fields.max(axis=1) <= 2)))
    if int(lanes.pad.max()) > _MAX_LANES:
        raise AssertionError(f"IQ1: a neighbour list of {int(lanes.pad.max())} lanes exceeds {_MAX_LANES}")
    return lanes._replace(values=((lanes.values.astype(np.int64) - 1) // 2).astype(np.uint8))


@numba.njit(cache=True, fastmath=False, error_model="numpy", _nrt=False)
def _find_best_neighbour2(lanes: NeighbourLanes, u: int, xb: np.ndarray, off: int, weight: np.ndarray,
                          scale: np.float32, xx: np.ndarray, L: np.ndarray, terms: np.ndarray,
                          d2: np.ndarray) -> int:
    """``iq1_find_best_neighbour2``: closest grid point listed for the off-grid packed index ``u`` to
    ``xb[off:off+8]`` with levels mapped through ``xx``; writes its levels into ``L[off:off+8]``. Returns
    -1 where ggml would fall back to a (buggy, out-of-bounds) full search and then assert.

    Each element's term ``w*diff*diff`` for each of the 3 levels once (ggml's operands and operations),
    then every candidate's sum in ggml's element order, candidates side by side (``d2``: float32 scratch
    of at least the longest list's lanes; ``terms``: float32[32])."""
    for i in range(8):
        for lv in range(3):
            diff = scale * xx[lv] - xb[off + i]
            terms[4 * i + lv] = weight[off + i] * diff * diff
    p = np.uint64(lanes.pad[u])
    base = np.uint64(8) * np.uint64(lanes.start[u])  # unsigned: no wrap-around test per element
    lv_of = lanes.values
    t0 = terms[0]
    t1 = terms[1]
    t2 = terms[2]
    for j in range(p):
        lv = lv_of[base + j]
        d2[j] = t0 if lv == 0 else (t1 if lv == 1 else t2)
    for i in range(1, 8):
        t0 = terms[4 * i]
        t1 = terms[4 * i + 1]
        t2 = terms[4 * i + 2]
        b = base + np.uint64(i) * p
        for j in range(p):
            lv = lv_of[b + j]
            d2[j] += t0 if lv == 0 else (t1 if lv == 1 else t2)
    # ggml's first strict minimum below FLT_MAX: on [+0, FLT_MAX) the int32 bits order as the floats do, so
    # the smallest bits (a vector reduction) and the first lane holding them; a negative value (-0 included)
    # makes the bits negative: then ggml's comparisons one by one
    n = np.uint64(lanes.n_cand[u])
    d2_bits = d2.view(np.int32)
    m_bits = _FLT_MAX_BITS
    for j in range(n):
        m_bits = min(m_bits, d2_bits[j])
    bj = -1
    if m_bits < 0:
        best = FLT_MAX
        for j in range(lanes.n_cand[u]):
            if d2[j] < best:
                best = d2[j]
                bj = j
    elif m_bits < _FLT_MAX_BITS:
        bj = 0
        while d2_bits[bj] != m_bits:
            bj += 1
    if bj < 0:
        return -1
    for i in range(8):
        L[off + i] = lv_of[base + np.uint64(i) * p + np.uint64(bj)]
    return np.int64(lanes.grid_index[lanes.start[u] + bj])


@numba.njit(cache=True, fastmath=False, error_model="numpy", inline="always")
def _weights(xb: np.ndarray, qw: np.ndarray, off: int, use_qw: bool, sigma2: np.float32, weight: np.ndarray) -> None:
    for i in range(xb.size):
        if use_qw:
            weight[i] = qw[off + i] * np.sqrt(sigma2 + xb[i] * xb[i])
        else:
            weight[i] = xb[i] * xb[i]


@numba.njit(cache=True, fastmath=False, error_model="numpy", inline="always")
def _amax(xb: np.ndarray) -> np.float32:
    mx = abs(xb[0])
    for i in range(1, xb.size):
        mx = fmax(mx, abs(xb[i]))
    return mx


@numba.njit(cache=True, fastmath=False, error_model="numpy", _nrt=False)
def _sigma2(xbl: np.ndarray) -> np.float32:
    s = _F0
    for i in range(QK_K):
        s += xbl[i] * xbl[i]
    return np.float32(2.0) * s / np.float32(QK_K)


# --- IQ1_S ---------------------------------------------------------------------------------------


class _SScratch(NamedTuple):
    """Per-worker scratch of ``_iq1_s_block`` (``_s_scratch``)."""

    scales: np.ndarray  # float32[8]
    shifts: np.ndarray  # int64[8]
    weight: np.ndarray  # float32[32]
    sumx: np.ndarray  # float32[33]
    sumw: np.ndarray  # float32[33]
    idx: np.ndarray  # int64[32]
    rank: np.ndarray  # int32[32]
    terms: np.ndarray  # float32[32]
    d2: np.ndarray  # float32[_MAX_LANES]
    L: np.ndarray  # int8[32]
    grid_idx: np.ndarray  # int64[4]
    qh: np.ndarray  # int64[8]
    split: SplitScratch


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _s_scratch() -> _SScratch:
    return _SScratch(np.zeros(8, np.float32), np.ones(8, np.int64), np.empty(32, np.float32),
                     np.zeros(33, np.float32), np.zeros(33, np.float32), np.empty(32, np.int64),
                     np.empty(32, np.int32), np.empty(32, np.float32), np.empty(_MAX_LANES, np.float32), np.zeros(32, np.int8),
                     np.zeros(4, np.int64), np.zeros(8, np.int64), split_scratch())


@numba.njit(cache=True, fastmath=False, error_model="numpy", _nrt=False)
def _iq1_s_block(xbl: np.ndarray, qw: np.ndarray, y: np.ndarray, qgrid: np.ndarray, kmap: np.ndarray,
                 lanes: NeighbourLanes, sc: _SScratch) -> int:
    """quantize_row_iq1_s_impl for one super-block (50 bytes); returns a failure code. Allocates nothing:
    compiled without reference counting (Numba's runtime otherwise increfs and decrefs every array argument
    and scratch field on every call, an atomic each), as are the helpers it calls."""
    scales = sc.scales
    shifts = sc.shifts
    weight = sc.weight
    sumx = sc.sumx
    sumw = sc.sumw
    idx = sc.idx
    rank = sc.rank
    terms = sc.terms
    d2 = sc.d2
    scratch = sc.split
    L = sc.L
    index = sc.grid_idx
    qh = sc.qh
    sumx[0] = _F0
    sumw[0] = _F0
    for ib in range(8):
        qh[ib] = 0
    y[:] = 0
    sigma2 = _sigma2(xbl)
    max_scale = _F0
    for ib in range(8):
        xb = xbl[32 * ib:32 * ib + 32]
        _weights(xb, qw, 32 * ib, True, sigma2, weight)
        if _amax(xb) < GROUP_MAX_EPS_IQ1_S:
            scales[ib] = _F0
            shifts[ib] = 1
            continue
        _stable_order(xb, idx, rank)
        for j in range(32):
            i = idx[j]
            sumx[j + 1] = sumx[j] + weight[i] * xb[i]
            sumw[j + 1] = sumw[j] + weight[i]
        scale, besti1, besti2, best_shift = iq1_s_search(sumx, sumw, _amax(xb), scratch)
        if besti1 < 0 or besti2 < 0 or best_shift == 0:
            scales[ib] = _F0
            shifts[ib] = 1
            continue
        for j in range(32):
            L[idx[j]] = 0 if j < besti1 else (1 if j < besti2 else 2)
        if scale < _F0:
            for j in range(32):
                L[j] = 2 - L[j]
            scale = -scale
            best_shift = -best_shift
        xx = _X_P if best_shift == 1 else _X_M
        all_on_grid = True
        for k in range(4):
            u = 0
            for j in range(8):
                u |= np.int64(L[8 * k + j]) << (2 * j)
            g = np.int64(kmap[u])
            if g < 0:
                all_on_grid = False
                g = _find_best_neighbour2(lanes, u, xb, 8 * k, weight, scale, xx, L, terms, d2)
                if g < 0:
                    return NO_GRID_POINT
            index[k] = g
        if not all_on_grid:
            sumqx = _F0
            sumq2 = _F0
            for k in range(4):
                for j in range(8):
                    w = weight[8 * k + j]
                    q = xx[(qgrid[index[k], j] - 1) // 2]
                    sumqx += w * q * xb[8 * k + j]
                    sumq2 += w * q * q
            if sumqx > _F0 and sumq2 > _F0:
                scale = sumqx / sumq2
        h = 0
        for k in range(4):
            y[2 + 4 * ib + k] = index[k] & 255
            h |= (index[k] >> 8) << (3 * k)
        qh[ib] = h
        if not scale >= _F0:
            return NEGATIVE_SCALE
        scales[ib] = scale
        shifts[ib] = best_shift
        max_scale = fmax(max_scale, scale)
    if max_scale != _F0:
        d = max_scale / np.float32(15.0)
        put_u16(y, 0, f16_bits(d * np.float32(1.125)))
        iscale = _F1 / d
        for ib in range(8):
            lv = max(0, min(7, nearest_int_full(_HALF * (iscale * scales[ib] - _F1))))
            if shifts[ib] == -1:
                lv |= 8
            qh[ib] |= lv << 12
    for ib in range(8):
        put_u16(y, 34 + 2 * ib, qh[ib])
    return 0


@numba.njit(cache=True, fastmath=False, error_model="numpy", parallel=True)
def _iq1_s_rows(x: np.ndarray, qw: np.ndarray, out: np.ndarray, qgrid: np.ndarray, kmap: np.ndarray,
                lanes: NeighbourLanes, bad: np.ndarray, n_workers: int) -> None:
    nb = x.shape[1] // QK_K
    todo = work_counter(x.shape[0] * nb)
    for _w in numba.prange(n_workers):
        sc = _s_scratch()
        lo, hi = claim(todo)
        while lo < hi:
            for t in range(lo, hi):
                r = t // nb
                b = t % nb
                code = _iq1_s_block(x[r, QK_K * b:QK_K * (b + 1)], qw[QK_K * b:QK_K * (b + 1)],
                                    out[r, 50 * b:50 * (b + 1)], qgrid, kmap, lanes, sc)
                if code:
                    bad[r] = code
            lo, hi = claim(todo)


def quantize_rows_iq1_s(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """Quantize float32 rows to IQ1_S (``quantize_iq1_s``; an imatrix is required).

    Args:
        x: float32[n_rows, n_per_row], n_per_row a multiple of 256.
        qw: float32[n_per_row] importance weights.
        out: uint8[n_rows, n_per_row // 256 * 50].

    Raises:
        QuantizationError: no imatrix, or a row on which ggml aborts.
    """
    need_imatrix(qw, "IQ1_S")
    t = iq_tables(T.IQ1_S)
    bad = np.zeros(x.shape[0], np.uint8)
    _iq1_s_rows(x, qw, out, t.qgrid, t.kmap, _iq1_lanes(), bad, workers())
    check_rows(bad, "IQ1_S")


# --- IQ1_M ---------------------------------------------------------------------------------------


@numba.njit(cache=True, fastmath=False, error_model="numpy", inline="always")
def _half_xx(best_k: int, k: int) -> np.ndarray:
    """The shifted levels of half ``k`` of a 16-weight sub-block: bit 1 of ``best_k`` for the first half,
    bit 0 for the second (0: +delta, 1: -delta)."""
    if k == 0:
        return _X_P if best_k < 2 else _X_M
    return _X_P if best_k % 2 == 0 else _X_M


class _MScratch(NamedTuple):
    """Per-worker scratch of ``_iq1_m_block`` (``_m_scratch``)."""

    scales: np.ndarray  # float32[16]
    shifts: np.ndarray  # int64[16]
    weight: np.ndarray  # float32[16]
    idx: np.ndarray  # int64[16]
    rank: np.ndarray  # int32[16]
    terms: np.ndarray  # float32[32]
    pre: np.ndarray  # float32[M_PRE]
    sc_ratios: np.ndarray  # float32[M_SCRATCH]
    sc_bits: np.ndarray  # its int32 view
    keys: np.ndarray  # int64[M_KEYS]
    L: np.ndarray  # int8[16]
    grid_idx: np.ndarray  # int64[2]
    sc: np.ndarray  # int64[4]
    d2: np.ndarray  # float32[_MAX_LANES]


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _m_scratch() -> _MScratch:
    sc_ratios = np.empty(M_SCRATCH, np.float32)
    return _MScratch(np.zeros(16, np.float32), np.zeros(16, np.int64), np.empty(16, np.float32),
                     np.empty(16, np.int64), np.empty(16, np.int32), np.empty(32, np.float32),
                     np.zeros(M_PRE, np.float32), sc_ratios, sc_ratios.view(np.int32), np.empty(M_KEYS, np.int64),
                     np.zeros(16, np.int8), np.zeros(2, np.int64), np.zeros(4, np.int64),
                     np.empty(_MAX_LANES, np.float32))


@numba.njit(cache=True, fastmath=False, error_model="numpy", _nrt=False)
def _iq1_m_block(xbl: np.ndarray, qw: np.ndarray, use_qw: bool, y: np.ndarray, qgrid: np.ndarray,
                 kmap: np.ndarray, lanes: NeighbourLanes, scr: _MScratch) -> int:
    """quantize_row_iq1_m_impl for one super-block (56 bytes); returns a failure code. Allocates nothing
    and is compiled without reference counting, as ``_iq1_s_block`` is (and so are the searches)."""
    scales = scr.scales
    shifts = scr.shifts
    weight = scr.weight
    idx = scr.idx
    rank = scr.rank
    terms = scr.terms
    pre = scr.pre
    sc_ratios = scr.sc_ratios
    sc_bits = scr.sc_bits
    keys = scr.keys
    L = scr.L
    index = scr.grid_idx
    sc = scr.sc
    d2 = scr.d2
    for i in range(4):
        sc[i] = 0
    for a in (PX0, PX1, PW0, PW1):  # the prefix sums' leading zeros (the search uses the slots past 16)
        pre[a] = _F0
    y[:] = 0
    sigma2 = _sigma2(xbl)
    max_scale = _F0
    for ib in range(16):
        xb = xbl[16 * ib:16 * ib + 16]
        _weights(xb, qw, 16 * ib, use_qw, sigma2, weight)
        amax = _amax(xb)
        if amax < GROUP_MAX_EPS_IQ1_M:
            scales[ib] = _F0
            shifts[ib] = 0
            continue
        _stable_order(xb, idx, rank)
        w_neg = False
        sx0 = _F0
        sx1 = _F0
        sw0 = _F0
        sw1 = _F0
        for j in range(16):  # the prefix sums per half, branch-free, running sums in registers
            i = idx[j]
            w = weight[i]
            wx = w * xb[i]
            h0 = i < 8
            # adding +0 to the other half's sums leaves them as they are (they start at +0, so never -0)
            sx0 += wx if h0 else _F0
            sx1 += _F0 if h0 else wx
            sw0 += w if h0 else _F0
            sw1 += _F0 if h0 else w
            pre[PX0 + j + 1] = sx0
            pre[PX1 + j + 1] = sx1
            pre[PW0 + j + 1] = sw0
            pre[PW1 + j + 1] = sw1
            w_neg |= not w >= _F0
        if w_neg:  # the contender argument needs non-decreasing weight sums
            scale, besti1, besti2, best_k = iq1_m_scan(pre, amax)
        else:
            scale, besti1, besti2, best_k = iq1_m_search(pre, amax, sc_ratios, sc_bits, keys)
        if besti1 < 0 or besti2 < 0 or best_k < 0:
            scales[ib] = _F0
            shifts[ib] = 0
            continue
        for j in range(16):
            L[idx[j]] = 0 if j < besti1 else (1 if j < besti2 else 2)
        if scale < _F0:
            for j in range(16):
                L[j] = 2 - L[j]
            scale = -scale
            best_k = 3 - best_k
        all_on_grid = True
        for k in range(2):
            xx = _half_xx(best_k, k)
            u = 0
            for j in range(8):
                u |= np.int64(L[8 * k + j]) << (2 * j)
            g = np.int64(kmap[u])
            if g < 0:
                all_on_grid = False
                g = _find_best_neighbour2(lanes, u, xb, 8 * k, weight, scale, xx, L, terms, d2)
                if g < 0:
                    return NO_GRID_POINT
            index[k] = g
        if not all_on_grid:
            sumqx = _F0
            sumq2 = _F0
            for k in range(2):
                xx = _half_xx(best_k, k)
                for j in range(8):
                    w = weight[8 * k + j]
                    q = xx[(qgrid[index[k], j] - 1) // 2]
                    sumqx += w * q * xb[8 * k + j]
                    sumq2 += w * q * q
            if sumqx > _F0 and sumq2 > _F0:
                scale = sumqx / sumq2
        y[2 * ib] = index[0] & 255
        y[2 * ib + 1] = index[1] & 255
        y[32 + ib] = (index[0] >> 8) | ((index[1] >> 8) << 4)
        if not scale >= _F0:
            return NEGATIVE_SCALE
        scales[ib] = scale
        shifts[ib] = best_k
        max_scale = fmax(max_scale, scale)
    if max_scale == _F0:
        return 0
    d = max_scale / np.float32(15.0)
    iscale = _F1 / d
    sumqx = _F0
    sumq2 = _F0
    for ib in range(16):
        lv = max(0, min(7, nearest_int_full(_HALF * (iscale * scales[ib] - _F1))))
        sc[ib // 4] |= lv << (3 * (ib % 4))
        y[32 + ib] |= _MASKS[shifts[ib]]
        xb = xbl[16 * ib:16 * ib + 16]
        _weights(xb, qw, 16 * ib, use_qw, sigma2, weight)
        qh = np.int64(y[32 + ib])
        for k in range(2):
            xx = _half_xx(shifts[ib], k)
            g = np.int64(y[2 * ib + k]) + ((qh << (8 - 4 * k)) & 0x700)
            for j in range(8):
                w = weight[8 * k + j]
                q = xx[(qgrid[g, j] - 1) // 2] * np.float32(2 * lv + 1)
                sumqx += w * q * xb[8 * k + j]
                sumq2 += w * q * q
    if sumq2 > _F0:
        d = sumqx / sumq2
    s = f16_bits(d * np.float32(1.1125))
    sc[0] |= (s & 0x000F) << 12
    sc[1] |= (s & 0x00F0) << 8
    sc[2] |= (s & 0x0F00) << 4
    sc[3] |= s & 0xF000
    for i in range(4):
        put_u16(y, 48 + 2 * i, sc[i])
    return 0


@numba.njit(cache=True, fastmath=False, error_model="numpy", parallel=True)
def _iq1_m_rows(x: np.ndarray, qw: np.ndarray, out: np.ndarray, qgrid: np.ndarray, kmap: np.ndarray,
                lanes: NeighbourLanes, bad: np.ndarray, n_workers: int) -> None:
    nb = x.shape[1] // QK_K
    use_qw = qw.size > 0
    todo = work_counter(x.shape[0] * nb)
    for _w in numba.prange(n_workers):
        scr = _m_scratch()
        lo, hi = claim(todo)
        while lo < hi:
            for t in range(lo, hi):
                r = t // nb
                b = t % nb
                qwb = qw[QK_K * b:QK_K * (b + 1)] if use_qw else qw
                code = _iq1_m_block(x[r, QK_K * b:QK_K * (b + 1)], qwb, use_qw, out[r, 56 * b:56 * (b + 1)],
                                    qgrid, kmap, lanes, scr)
                if code:
                    bad[r] = code
            lo, hi = claim(todo)


def quantize_rows_iq1_m(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """Quantize float32 rows to IQ1_M (``quantize_iq1_m``; ``qw`` of length 0 = no imatrix).

    Raises:
        QuantizationError: a row on which ggml aborts.
    """
    t = iq_tables(T.IQ1_M)
    bad = np.zeros(x.shape[0], np.uint8)
    _iq1_m_rows(x, qw, out, t.qgrid, t.kmap, _iq1_lanes(), bad, workers())
    check_rows(bad, "IQ1_M")


# --- dequantization ------------------------------------------------------------------------------


@numba.njit(cache=True, fastmath=False, error_model="numpy", parallel=True)
def _iq1_dequant(blocks: np.ndarray, out: np.ndarray, is_m: bool, dgrid: np.ndarray) -> None:
    nb = out.shape[1] // QK_K
    bs = 56 if is_m else 50
    for t in numba.prange(blocks.shape[0] * nb):
        r = t // nb
        b = t % nb
        blk = blocks[r, bs * b:bs * (b + 1)]
        y = out[r, QK_K * b:QK_K * (b + 1)]
        if is_m:
            sc0 = np.int64(blk[48]) | (np.int64(blk[49]) << 8)
            sc1 = np.int64(blk[50]) | (np.int64(blk[51]) << 8)
            sc2 = np.int64(blk[52]) | (np.int64(blk[53]) << 8)
            sc3 = np.int64(blk[54]) | (np.int64(blk[55]) << 8)
            d = fp16_to_fp32(np.uint16((sc0 >> 12) | ((sc1 >> 8) & 0x00F0) | ((sc2 >> 4) & 0x0F00)
                                       | (sc3 & 0xF000)))
            for ib in range(8):
                w = np.int64(blk[48 + 2 * (ib // 2)]) | (np.int64(blk[49 + 2 * (ib // 2)]) << 8)
                dl1 = d * np.float32(2 * ((w >> (6 * (ib % 2))) & 0x7) + 1)
                dl2 = d * np.float32(2 * ((w >> (6 * (ib % 2) + 3)) & 0x7) + 1)
                for gl in range(4):
                    qh = np.int64(blk[32 + 2 * ib + gl // 2])
                    g = np.int64(blk[4 * ib + gl]) | ((qh << (8 if gl % 2 == 0 else 4)) & 0x700)
                    bit = 0x08 if gl % 2 == 0 else 0x80
                    delta = -DELTA if qh & bit else DELTA
                    dl = dl1 if gl < 2 else dl2
                    for j in range(8):
                        y[32 * ib + 8 * gl + j] = dl * (dgrid[g, j] + delta)
        else:
            d = fp16_to_fp32(np.uint16(blk[0] | (np.int64(blk[1]) << 8)))
            for ib in range(8):
                qh = np.int64(blk[34 + 2 * ib]) | (np.int64(blk[35 + 2 * ib]) << 8)
                dl = d * np.float32(2 * ((qh >> 12) & 7) + 1)
                delta = -DELTA if qh & 0x8000 else DELTA
                for gl in range(4):
                    g = np.int64(blk[2 + 4 * ib + gl]) | (((qh >> (3 * gl)) & 7) << 8)
                    for j in range(8):
                        y[32 * ib + 8 * gl + j] = dl * (dgrid[g, j] + delta)


def dequantize_rows_iq1_s(blocks: np.ndarray, out: np.ndarray) -> None:
    """``dequantize_row_iq1_s`` over uint8[n_rows, row_bytes] into float32[n_rows, n_per_row]."""
    _iq1_dequant(blocks, out, False, iq_tables(T.IQ1_S).dgrid)


def dequantize_rows_iq1_m(blocks: np.ndarray, out: np.ndarray) -> None:
    """``dequantize_row_iq1_m`` over uint8[n_rows, row_bytes] into float32[n_rows, n_per_row]."""
    _iq1_dequant(blocks, out, True, iq_tables(T.IQ1_M).dgrid)
