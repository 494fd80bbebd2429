"""IQ1_S's and IQ1_M's exhaustive three-level split searches: ggml's winner, found without ggml's scan.

ggml (ggml-quants.c: ``quantize_row_iq1_s_impl``) sorts a group's 32 weights and tries every split
``i1 <= i2`` of the sorted order into the levels (-1, 0, +1) + shift, for both shift signs (33*34/2 splits,
2 signs). A candidate replaces the best one when ``sumq2 > 0 && sumqx*sumqx > best*sumq2`` (``best =
scale*sumqx``, ``scale = sumqx/sumq2``), in the order (i1, i2, sign): a chain of dependent comparisons.

Here every candidate's ``sumqx`` and ``sumq2`` are computed side by side (vector lanes over pairs of split
points, ``iq1_s_search``'s layout, each with ggml's float32 operations in ggml's order, so the same bits), and with them the ratio
``r = sumqx*sumqx/sumq2`` (within a few float32 roundings of what ggml's comparisons compare). Only the
*contenders* — candidates with ``r >= T = M*(1 - 2**-16)``, ``M`` the largest ratio — are then replayed with
ggml's exact comparison, in ggml's order, starting from ggml's initial state. This gives ggml's winner:

* once a contender has won, ``best`` is within a few roundings of a ratio >= T, so a candidate with
  ``r < T*(1 - 2**-18)`` cannot win after it (the rounding errors are ~2**-22 relative);
* before any contender has won, ``best`` belongs to such a non-contender or is ``-FLT_MAX``; either way the
  next contender wins, as it does in the replay, where ``best`` is still ``-FLT_MAX``;
* the last winner of ggml's scan is therefore a contender (the candidate with ratio ``M`` is one), and the
  replay meets the contenders with the same ``best`` as ggml's scan did.

The argument holds for any threshold ``T <= M`` with no ratio in the gap ``[T*(1 - 2**-18), T)`` below
it: where a ratio falls in that gap, IQ1_S's search lowers ``T`` to the gap's lower end (up to 4 times;
splits across a near-zero weight give near-equal ratios, which put a ratio in the first gap in ~4% of
random groups with a gamma-distributed imatrix). It needs no overflow or underflow in the compared
products either: when the group's sums leave ``[2**-50, 2**50]`` (``sumq2`` lies within [W/64, 1.27 W] of
the total weight W, ``|sumqx|`` below 1.125 W max|x|), when every gap tried holds a ratio, or there is no
valid candidate, the search falls back to ggml's scan (``iq1_s_scan``; about 1 group in 8000 on random
data; IQ1_M's search falls back at the first gap that holds a ratio, ~1% of groups).

IQ1_M (``quantize_row_iq1_m_impl``) has 17*18/2 splits of 16 sorted weights and four sign pairs ``k``
(the shift sign of each half) per split, scanned in the order (i1, i2, k); its sums come from prefix sums
kept per half, collapsed to ``sumqx = txs*v2 - px[i1] - px[i2]`` and ``sumq2 = tws*v2*v2 + pw[i1]*c1 +
pw[i2]*c2`` per half. ``iq1_m_search`` replays its contenders the same way, with ggml's operations for
``sumqx``/``sumq2``. The collapsed ``sumq2`` cancels, but with weights >= 0 the prefix sums never decrease
(``pw[i1] <= pw[i2] <= tws``), so it is ``pw[i1]*v0^2 + (pw[i2]-pw[i1])*v1^2 + (tws-pw[i2])*v2^2 >= W/64``
up to ~2**-21 W of rounding, and ``|sumqx| <= 3.3 W max|x|``: the same range checks bound the products.
The kernel sends groups with a negative (or NaN) weight to ggml's scan (``iq1_m_scan``).
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from ggufkit.quant.kernels.iq.common import FLT_MAX

_F0 = np.float32(0.0)
_NO_RATIO = np.float32(-1.0)
_CONTENDER = np.float32(1.0 - 2.0**-16)
_GAP = np.float32(1.0 - 2.0**-18)
_LO = np.float32(2.0**-50)
_HI = np.float32(2.0**50)
_INF_BITS = 0x7F800000
_STEPS = 4  # thresholds tried by _contenders
_N_KEYS = 64  # ratios collected by _contenders (the contenders and the gaps below them)
#: IQ1_S's layout (iq1_s_search): 17 rows (circular distances 0..16) x 2 signs x 40 lanes (33 used).
_S_N = 33
_S_ROWS = 17
_S_LANES = 40
_S_COLS = 2 * _S_LANES
#: Lane numbers as int32: the searches' lane tests compare these, not the loop's int64 counter (AVX2 has
#: no 8-wide int64 compare: two 4-wide ones and packing per vector).
_LANE_IDS = np.arange(_S_LANES, dtype=np.int32)
DELTA = np.float32(0.125)  # IQ1S_DELTA == IQ1M_DELTA
_F1 = np.float32(1.0)
X_P = np.array([-_F1 + DELTA, DELTA, _F1 + DELTA], np.float32)
X_M = np.array([-_F1 - DELTA, -DELTA, _F1 - DELTA], np.float32)


class SplitScratch(NamedTuple):
    """Per-thread scratch of the split searches (``split_scratch``)."""

    ratios: np.ndarray  # float32: every candidate's sumqx**2/sumq2, -1 where invalid
    ratio_bits: np.ndarray  # its int32 view
    col_max: np.ndarray  # float32: per (sign, i2) column, the largest ratio over i1
    col_bits: np.ndarray  # its int32 view
    ext_x: np.ndarray  # float32[2*_S_LANES]: sumx extended circularly (iq1_s_search)
    ext_w: np.ndarray  # float32[2*_S_LANES]: sumw extended circularly
    keys: np.ndarray  # int64[_N_KEYS]: the contenders' order keys
    key_bits: np.ndarray  # int32[_N_KEYS]: their ratios' bits
    cvt: np.ndarray  # float32[1]
    cvt_bits: np.ndarray  # its int32 view


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def split_scratch() -> SplitScratch:
    """Scratch of ``iq1_s_search``."""
    ratios = np.empty(_S_ROWS * _S_COLS, np.float32)
    col_max = np.empty(_S_COLS, np.float32)
    cvt = np.empty(1, np.float32)
    return SplitScratch(ratios, ratios.view(np.int32), col_max, col_max.view(np.int32),
                        np.zeros(2 * _S_LANES, np.float32), np.zeros(2 * _S_LANES, np.float32),
                        np.empty(_N_KEYS, np.int64), np.empty(_N_KEYS, np.int32), cvt, cvt.view(np.int32))


@numba.njit(cache=True, fastmath=False, error_model="numpy", _nrt=False, inline="always")
def _bits_of(sc: SplitScratch, v: np.float32) -> np.int32:
    sc.cvt[0] = v
    return sc.cvt_bits[0]


@numba.njit(cache=True, fastmath=False, error_model="numpy", _nrt=False)
def _column_maxima(bits: np.ndarray, col_bits: np.ndarray, n_rows: np.uint64, n_cols: np.uint64) -> None:
    """``col_bits[c]``: the largest of ``bits[n_cols*r + c]`` over the rows ``r``, as int32 (the ratios are
    -1 or >= +0, never NaN: on them the bits order as the floats do). A pass of its own after the search,
    not a running float maximum in the search loop: that compiles to a select between the new ratio and
    the stored maximum, which LLVM turns into a masked store (``vmaskmovps`` on AVX2, microcoded and slow
    on AMD Zen), and it keeps fewer values live in the loop (AVX2 has 16 vector registers, not 32)."""
    for c in range(n_cols):
        col_bits[c] = bits[c]
    for r in range(np.uint64(1), n_rows):
        o = n_cols * r
        for c in range(n_cols):
            col_bits[c] = max(col_bits[c], bits[o + c])


@numba.njit(cache=True, fastmath=False, error_model="numpy", _nrt=False)
def _contenders(sc: SplitScratch) -> int:
    """The contenders among ``sc.ratios`` (``iq1_s_search``'s layout) as order keys ``(i1*33 + i2)*2 +
    sign`` sorted into ``sc.keys``; returns their count, or -1 where the gap argument does not hold (fall
    back to the scan). ``sc.col_max`` holds each column's largest ratio.

    The threshold starts at ``T = M*(1 - 2**-16)``; where a ratio falls in the gap ``[T*(1 - 2**-18), T)``
    below it, the gap's lower end becomes the threshold (that ratio a contender), up to ``_STEPS`` times:
    the argument of the module docstring holds for any threshold with an empty gap below it. Near-equal
    ratios (splits across a near-zero weight) put a ratio in the first gap in ~4% of random groups."""
    bits = sc.ratio_bits
    col_bits = sc.col_bits
    keys = sc.keys
    kb = sc.key_bits
    m_bits = np.int32(-1)
    for c in range(np.uint64(_S_COLS)):
        m_bits = max(m_bits, col_bits[c])
    if m_bits < 0 or m_bits >= _INF_BITS:
        return -1
    sc.cvt_bits[0] = m_bits
    top = sc.cvt[0]
    if not (_LO <= top <= _HI):
        return -1
    lo = top * _CONTENDER  # the lowest gap's lower end: every ratio at or above it is collected
    for _ in range(_STEPS):
        lo = lo * _GAP
    lo_bits = _bits_of(sc, lo)
    nk = 0
    for c in range(_S_COLS):
        rb = col_bits[c]
        if rb < lo_bits:
            continue
        for d in range(_S_ROWS):
            rb = bits[_S_COLS * d + c]
            if rb < lo_bits:
                continue
            if nk == keys.size:
                return -1
            a = c % _S_LANES
            b = a + d
            i1, i2 = (a, b) if b < _S_N else (b - _S_N, a)
            keys[nk] = (i1 * _S_N + i2) * 2 + c // _S_LANES  # ggml's order: i1, then i2, then sign
            kb[nk] = rb
            nk += 1
    t = top * _CONTENDER
    for step in range(_STEPS + 1):
        if step == _STEPS:
            return -1
        g = t * _GAP
        t_bits = _bits_of(sc, t)
        g_bits = _bits_of(sc, g)
        in_gap = False
        for j in range(nk):
            in_gap |= (kb[j] >= g_bits) & (kb[j] < t_bits)
        if not in_gap:
            break
        t = g
    m = 0
    for j in range(nk):
        if kb[j] >= t_bits:
            keys[m] = keys[j]
            m += 1
    for j in range(1, m):  # sort the few keys
        v = keys[j]
        i = j - 1
        while i >= 0 and keys[i] > v:
            keys[i + 1] = keys[i]
            i -= 1
        keys[i + 1] = v
    return m


@numba.njit(cache=True, fastmath=False, error_model="numpy", _nrt=False)
def _s_pair(sumx: np.ndarray, sumw: np.ndarray, i1: int, i2: int, sg: int) -> tuple[np.float32, np.float32]:
    """(sumqx, sumq2) of split (i1, i2) with shift sign sg (0: +delta, 1: -delta), as
    quantize_row_iq1_s_impl computes them."""
    xx = X_P if sg == 0 else X_M
    n = sumx.size - 1
    sumqx = (sumx[i1] - sumx[0]) * xx[0] + (sumx[i2] - sumx[i1]) * xx[1] + (sumx[n] - sumx[i2]) * xx[2]
    sumq2 = ((sumw[i1] - sumw[0]) * xx[0] * xx[0] + (sumw[i2] - sumw[i1]) * xx[1] * xx[1]
             + (sumw[n] - sumw[i2]) * xx[2] * xx[2])
    return sumqx, sumq2


@numba.njit(cache=True, fastmath=False, error_model="numpy", _nrt=False)
def _replay(sumx: np.ndarray, sumw: np.ndarray, keys: np.ndarray, nk: int,
            scale: np.float32) -> tuple[np.float32, int, int, int]:
    """ggml's comparison over the candidates ``keys[:nk]`` (order keys ``(i1*33 + i2)*2 + sign``, in
    ggml's order), from ggml's initial state: (scale, besti1, besti2, best_shift), best_shift 0 when none
    is valid."""
    n = sumx.size
    best = -FLT_MAX
    besti1 = -1
    besti2 = -1
    best_shift = 0
    for j in range(nk):
        sg = keys[j] % 2
        i2 = (keys[j] // 2) % n
        i1 = keys[j] // (2 * n)
        sumqx, sumq2 = _s_pair(sumx, sumw, i1, i2, sg)
        if sumq2 > _F0 and sumqx * sumqx > best * sumq2:
            scale = sumqx / sumq2
            best = scale * sumqx
            besti1 = i1
            besti2 = i2
            best_shift = 1 if sg == 0 else -1
    return scale, besti1, besti2, best_shift


#: Every IQ1_S candidate key ``(i1*33 + i2)*2 + sign``, i2 >= i1, in ggml's scan order.
_SCAN_KEYS = np.array([(i1 * 33 + i2) * 2 + sg for i1 in range(33) for i2 in range(i1, 33) for sg in range(2)],
                      np.int64)


@numba.njit(cache=True, fastmath=False, error_model="numpy", _nrt=False)
def iq1_s_scan(sumx: np.ndarray, sumw: np.ndarray, scale: np.float32) -> tuple[np.float32, int, int, int]:
    """ggml's scan: ggml's comparison (``_replay``) over every candidate, in ggml's order."""
    return _replay(sumx, sumw, _SCAN_KEYS, _SCAN_KEYS.size, scale)


@numba.njit(cache=True, fastmath=False, error_model="numpy", _nrt=False)
def iq1_s_search(sumx: np.ndarray, sumw: np.ndarray, amax: np.float32,
                 sc: SplitScratch) -> tuple[np.float32, int, int, int]:
    """``iq1_s_scan``'s result through the contender replay (module docstring).

    ``sumx``/``sumw``: float32[33] prefix sums of ``w*x`` / ``w`` over the sorted weights. Layout (as
    ``iq1_m_search``'s): the 561 splits i1 <= i2 as pairs of the 33 split points at circular distance d:
    row d = 0..16, lane a = 0..32 holds the pair {a, (a + d) mod 33}; lanes 33..39 hold nothing. Each lane
    loads ``p[a]`` and ``p[a + d]`` from the sums extended circularly (``sc.ext_x``/``sc.ext_w``), so a row
    is two contiguous loads per array, and 17 rows of 40 lanes replace 33 rows over i2 >= i1 (a row's
    set-up, its loops' overlap tests among them, cost about as much as its lanes). The ratio of row d, sign
    s, lane a goes to ``sc.ratios[80*d + 40*s + a]``, the column maxima over the rows to
    ``sc.col_max[40*s + a]``.
    """
    n = sumx.size  # 33 split points
    nl = n - 1
    p0, p1, p2 = X_P[0], X_P[1], X_P[2]
    m0, m1, m2 = X_M[0], X_M[1], X_M[2]
    tx = sumx[nl]
    tw = sumw[nl]
    if not (_LO <= tw <= _HI and tw * amax <= _HI):
        return iq1_s_scan(sumx, sumw, amax)
    ex_ = sc.ext_x
    ew_ = sc.ext_w
    for t in range(_S_N):
        ex_[t] = sumx[t]
        ew_[t] = sumw[t]
        ex_[t + _S_N] = sumx[t]
        ew_[t + _S_N] = sumw[t]
    x0 = sumx[0]
    w0 = sumw[0]
    ratios = sc.ratios
    # lanes per row, a count LLVM cannot see (with a known count it unrolls the loop and leaves it scalar)
    n_lanes = np.uint64(ex_.size // 2)
    n_pts = np.int32(n)
    for row in range(_S_ROWS):
        d = np.uint64(row)
        lim = np.int32(_S_N - row)  # lanes below: i1 = a, i2 = a + d; from there on: i1 = a + d - 33, i2 = a
        o = np.uint64(_S_COLS * row)
        for a in range(n_lanes):
            xa = ex_[a]
            xb = ex_[a + d]
            wa = ew_[a]
            wb = ew_[a + d]
            lane = _LANE_IDS[a]
            lo = lane < lim
            x1 = xa if lo else xb  # sumx[i1], sumx[i2]
            x2 = xb if lo else xa
            w1 = wa if lo else wb
            w2 = wb if lo else wa
            ax = x1 - x0
            dx = x2 - x1
            ex = tx - x2
            aw = w1 - w0
            dw = w2 - w1
            ew = tw - w2
            valid = lane < n_pts  # a bound LLVM cannot see: with the constant it compares the int64 counter
            s = ax * p0 + dx * p1 + ex * p2
            t = aw * p0 * p0 + dw * p1 * p1 + ew * p2 * p2
            r = s * s / t
            r = r if valid & (t > _F0) else _NO_RATIO
            ratios[o + a] = r
            s = ax * m0 + dx * m1 + ex * m2
            t = aw * m0 * m0 + dw * m1 * m1 + ew * m2 * m2
            r = s * s / t
            r = r if valid & (t > _F0) else _NO_RATIO
            ratios[o + n_lanes + a] = r
    _column_maxima(sc.ratio_bits, sc.col_bits, np.uint64(_S_ROWS), n_lanes + n_lanes)
    nk = _contenders(sc)
    if nk < 0:
        return iq1_s_scan(sumx, sumw, amax)
    return _replay(sumx, sumw, sc.keys, nk, amax)


# --- IQ1_M ---------------------------------------------------------------------------------------

#: Offsets of IQ1_M's four prefix-sum arrays in one float32 scratch (``M_PRE`` long): px[0], px[1], pw[0],
#: pw[1] of quantize_row_iq1_m_impl, 17 entries each (``iq1_m_search`` fills the 64 slots of each array past
#: them: ``p[t - 17]`` at 17 <= t < 32, ``p[16]`` from 32 on).
PX0, PX1, PW0, PW1 = 0, 64, 128, 192
M_PRE = 256
#: IQ1_M's split scratch: 10 rows x 4 sign pairs k x 16 lanes of ratios (``iq1_m_search``), then the column
#: maxima (4 x 16, and the split (16, 16) per k), one float for bit conversions.
_M_ROWS = 10 * 64
_M_COLS = _M_ROWS
_M_CVT = _M_ROWS + 68
M_SCRATCH = _M_CVT + 4
M_KEYS = 32  # twice the lanes of a row (iq1_m_search takes its lane count from it)
_P2 = X_P[2]
_M2 = X_M[2]
_CP1 = X_P[0] * X_P[0] - X_P[1] * X_P[1]
_CP2 = X_P[1] * X_P[1] - X_P[2] * X_P[2]
_CM1 = X_M[0] * X_M[0] - X_M[1] * X_M[1]
_CM2 = X_M[1] * X_M[1] - X_M[2] * X_M[2]


@numba.njit(cache=True, fastmath=False, error_model="numpy", _nrt=False)
def _m_pair(pre: np.ndarray, i1: int, i2: int, k: int) -> tuple[np.float32, np.float32]:
    """(sumqx[k], sumq2[k]) of split (i1, i2) as quantize_row_iq1_m_impl computes them (k: bit 1 the sign
    of the first half's shift, bit 0 the second's; 0 = +delta)."""
    tx0 = pre[PX0 + 16]
    tx1 = pre[PX1 + 16]
    tw0 = pre[PW0 + 16]
    tw1 = pre[PW1 + 16]
    sx0 = pre[PX0 + i1] + pre[PX0 + i2]
    sx1 = pre[PX1 + i1] + pre[PX1 + i2]
    if k < 2:
        qx0 = tx0 * _P2 - sx0
        q20 = tw0 * _P2 * _P2 + pre[PW0 + i1] * _CP1 + pre[PW0 + i2] * _CP2
    else:
        qx0 = tx0 * _M2 - sx0
        q20 = tw0 * _M2 * _M2 + pre[PW0 + i1] * _CM1 + pre[PW0 + i2] * _CM2
    if k % 2 == 0:
        qx1 = tx1 * _P2 - sx1
        q21 = tw1 * _P2 * _P2 + pre[PW1 + i1] * _CP1 + pre[PW1 + i2] * _CP2
    else:
        qx1 = tx1 * _M2 - sx1
        q21 = tw1 * _M2 * _M2 + pre[PW1 + i1] * _CM1 + pre[PW1 + i2] * _CM2
    return qx0 + qx1, q20 + q21


@numba.njit(cache=True, fastmath=False, error_model="numpy", _nrt=False)
def _m_replay(pre: np.ndarray, keys: np.ndarray, nk: int, scale: np.float32) -> tuple[np.float32, int, int, int]:
    """ggml's comparison over the IQ1_M candidates ``keys[:nk]`` (order keys ``(i1*17 + i2)*4 + k``, in
    ggml's order) from ggml's initial state: (scale, besti1, besti2, best_k), -1s when none is valid."""
    best = -FLT_MAX
    besti1 = -1
    besti2 = -1
    best_k = -1
    for j in range(nk):
        k = keys[j] % 4
        i2 = (keys[j] // 4) % 17
        i1 = keys[j] // 68
        sumqx, sumq2 = _m_pair(pre, i1, i2, k)
        if sumq2 > _F0 and sumqx * sumqx > best * sumq2:
            scale = sumqx / sumq2
            best = scale * sumqx
            besti1 = i1
            besti2 = i2
            best_k = k
    return scale, besti1, besti2, best_k


@numba.njit(cache=True, fastmath=False, error_model="numpy", _nrt=False)
def iq1_m_scan(pre: np.ndarray, scale: np.float32) -> tuple[np.float32, int, int, int]:
    """ggml's scan of quantize_row_iq1_m_impl: every candidate, in ggml's order (i1, i2 >= i1, k), with
    ggml's operations (``_m_pair``'s, written out per split)."""
    tx0 = pre[PX0 + 16]
    tx1 = pre[PX1 + 16]
    tw0 = pre[PW0 + 16]
    tw1 = pre[PW1 + 16]
    best = -FLT_MAX
    besti1 = -1
    besti2 = -1
    best_k = -1
    for i1 in range(17):
        for i2 in range(i1, 17):
            sx0 = pre[PX0 + i1] + pre[PX0 + i2]
            sx1 = pre[PX1 + i1] + pre[PX1 + i2]
            qp0 = tx0 * _P2 - sx0
            qm0 = tx0 * _M2 - sx0
            qp1 = tx1 * _P2 - sx1
            qm1 = tx1 * _M2 - sx1
            tp0 = tw0 * _P2 * _P2 + pre[PW0 + i1] * _CP1 + pre[PW0 + i2] * _CP2
            tm0 = tw0 * _M2 * _M2 + pre[PW0 + i1] * _CM1 + pre[PW0 + i2] * _CM2
            tp1 = tw1 * _P2 * _P2 + pre[PW1 + i1] * _CP1 + pre[PW1 + i2] * _CP2
            tm1 = tw1 * _M2 * _M2 + pre[PW1 + i1] * _CM1 + pre[PW1 + i2] * _CM2
            for k in range(4):
                sumqx = (qp0 if k < 2 else qm0) + (qp1 if k % 2 == 0 else qm1)
                sumq2 = (tp0 if k < 2 else tm0) + (tp1 if k % 2 == 0 else tm1)
                if sumq2 > _F0 and sumqx * sumqx > best * sumq2:
                    scale = sumqx / sumq2
                    best = scale * sumqx
                    besti1 = i1
                    besti2 = i2
                    best_k = k
    return scale, besti1, besti2, best_k


@numba.njit(cache=True, fastmath=False, error_model="numpy", _nrt=False)
def _m_split_of(row: int, i: int) -> tuple[int, int]:
    """The split (i1, i2) of lane ``i`` of row ``row`` of ``iq1_m_search``'s layout."""
    if row == 9:
        return i, 16
    if i + row <= 16:
        return i, i + row
    return i + row - 17, i


@numba.njit(cache=True, fastmath=False, error_model="numpy", _nrt=False)
def iq1_m_search(pre: np.ndarray, amax: np.float32, sc: np.ndarray, sc_bits: np.ndarray,
                 keys: np.ndarray) -> tuple[np.float32, int, int, int]:
    """``iq1_m_scan``'s result through the contender replay (module docstring, IQ1_M part).

    ``pre``: float32[M_PRE], the prefix sums (``PX0`` ... ``PW1``) over the sorted weights, all weights >= 0
    (the slots past each array's 17 entries are scratch); ``sc``: float32[M_SCRATCH] and ``sc_bits`` its
    int32 view; ``keys``: int64[M_KEYS].

    Layout (the 153 splits i1 <= i2 as pairs of the 17 split points at circular distance d): row d = 0..8,
    lane i = 0..15 holds the pair {i, (i + d) mod 17} (``_m_split_of``); row 9 lanes 0..7 hold (i, 16), the
    other pairs with 16 (lanes 8..15 none); the split (16, 16) stands apart. Each lane loads ``p[i]`` and
    ``p[i + d]`` from the arrays extended circularly (row 9: ``p[16]``), so every row is two contiguous loads
    per array. The ratio of row r, lane i, sign pair k goes to ``sc[64*r + 16*k + i]``, the column maxima
    over the rows to ``sc[_M_COLS + 16*k + i]``, those of (16, 16) to ``sc[_M_COLS + 64 + k]``.
    """
    tx0 = pre[PX0 + 16]
    tx1 = pre[PX1 + 16]
    tw0 = pre[PW0 + 16]
    tw1 = pre[PW1 + 16]
    tw = tw0 + tw1
    if not (_LO <= tw <= _HI and tw * amax <= _HI):
        return iq1_m_scan(pre, amax)
    for a in (PX0, PX1, PW0, PW1):
        for t in range(15):
            pre[a + 17 + t] = pre[a + t]
        for t in range(16):
            pre[a + 32 + t] = pre[a + 16]
    ax0p = tx0 * _P2
    ax0m = tx0 * _M2
    ax1p = tx1 * _P2
    ax1m = tx1 * _M2
    bw0p = tw0 * _P2 * _P2
    bw0m = tw0 * _M2 * _M2
    bw1p = tw1 * _P2 * _P2
    bw1m = tw1 * _M2 * _M2
    cols = np.uint64(_M_COLS)
    # 16 lanes per row, a count LLVM cannot see (with a known count it unrolls the loop and leaves it scalar)
    n_lanes = np.uint64(keys.size // 2)
    for row in range(10):
        d = np.uint64(32 if row == 9 else row)
        lim = np.int32(16 if row == 9 else 17 - row)  # lanes below: i1 = i, i2 = the other
        n_valid = np.int32(8 if row == 9 else 16)
        o = np.uint64(64 * row)
        for i in range(n_lanes):
            xa0 = pre[np.uint64(PX0) + i]
            xb0 = pre[np.uint64(PX0) + i + d]
            xa1 = pre[np.uint64(PX1) + i]
            xb1 = pre[np.uint64(PX1) + i + d]
            wa0 = pre[np.uint64(PW0) + i]
            wb0 = pre[np.uint64(PW0) + i + d]
            wa1 = pre[np.uint64(PW1) + i]
            wb1 = pre[np.uint64(PW1) + i + d]
            lane = _LANE_IDS[i]
            lo = lane < lim
            w10 = wa0 if lo else wb0  # pw[i1], pw[i2] of each half
            w20 = wb0 if lo else wa0
            w11 = wa1 if lo else wb1
            w21 = wb1 if lo else wa1
            sx0 = xa0 + xb0
            sx1 = xa1 + xb1
            qp0 = ax0p - sx0
            qm0 = ax0m - sx0
            qp1 = ax1p - sx1
            qm1 = ax1m - sx1
            tp0 = bw0p + w10 * _CP1 + w20 * _CP2
            tm0 = bw0m + w10 * _CM1 + w20 * _CM2
            tp1 = bw1p + w11 * _CP1 + w21 * _CP2
            tm1 = bw1m + w11 * _CM1 + w21 * _CM2
            valid = lane < n_valid
            s = qp0 + qp1
            t = tp0 + tp1
            r = s * s / t
            r = r if valid & (t > _F0) else _NO_RATIO
            sc[o + i] = r
            s = qp0 + qm1
            t = tp0 + tm1
            r = s * s / t
            r = r if valid & (t > _F0) else _NO_RATIO
            sc[o + np.uint64(16) + i] = r
            s = qm0 + qp1
            t = tm0 + tp1
            r = s * s / t
            r = r if valid & (t > _F0) else _NO_RATIO
            sc[o + np.uint64(32) + i] = r
            s = qm0 + qm1
            t = tm0 + tm1
            r = s * s / t
            r = r if valid & (t > _F0) else _NO_RATIO
            sc[o + np.uint64(48) + i] = r
    _column_maxima(sc_bits, sc_bits[_M_COLS:_M_COLS + 64], np.uint64(10), np.uint64(64))
    # the split (16, 16), _m_pair's operations written out (a call here costs as much as a row)
    x0 = tx0 + tx0
    x1 = tx1 + tx1
    qp0 = ax0p - x0
    qm0 = ax0m - x0
    qp1 = ax1p - x1
    qm1 = ax1m - x1
    tp0 = bw0p + tw0 * _CP1 + tw0 * _CP2
    tm0 = bw0m + tw0 * _CM1 + tw0 * _CM2
    tp1 = bw1p + tw1 * _CP1 + tw1 * _CP2
    tm1 = bw1m + tw1 * _CM1 + tw1 * _CM2
    for k in range(4):
        s = (qp0 if k < 2 else qm0) + (qp1 if k % 2 == 0 else qm1)
        t = (tp0 if k < 2 else tm0) + (tp1 if k % 2 == 0 else tm1)
        sc[_M_COLS + 64 + k] = s * s / t if t > _F0 else _NO_RATIO
    m_bits = np.int32(-1)
    for c in range(np.uint64(68)):
        m_bits = max(m_bits, sc_bits[cols + c])
    if m_bits < 0 or m_bits >= _INF_BITS:
        return iq1_m_scan(pre, amax)
    sc_bits[_M_CVT] = m_bits
    top = sc[_M_CVT]
    if not (_LO <= top <= _HI):
        return iq1_m_scan(pre, amax)
    sc[_M_CVT] = top * _CONTENDER
    t_bits = sc_bits[_M_CVT]
    sc[_M_CVT] = top * _CONTENDER * _GAP
    g_bits = sc_bits[_M_CVT]
    nk = 0
    for c in range(68):
        rb = sc_bits[_M_COLS + c]
        if rb < g_bits:
            continue
        if c >= 64:  # the split (16, 16)
            if rb < t_bits or nk == keys.size:
                return iq1_m_scan(pre, amax)
            keys[nk] = (16 * 17 + 16) * 4 + c - 64
            nk += 1
            continue
        for row in range(10):
            rb = sc_bits[64 * row + c]
            if rb < g_bits:
                continue
            if rb < t_bits or nk == keys.size:
                return iq1_m_scan(pre, amax)
            i1, i2 = _m_split_of(row, c % 16)
            keys[nk] = (i1 * 17 + i2) * 4 + c // 16  # ggml's order: i1, then i2, then k
            nk += 1
    for j in range(1, nk):  # sort the few keys
        v = keys[j]
        i = j - 1
        while i >= 0 and keys[i] > v:
            keys[i + 1] = keys[i]
            i -= 1
        keys[i + 1] = v
    return _m_replay(pre, keys, nk, amax)
