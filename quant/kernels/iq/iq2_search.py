"""The grid searches of the IQ2 quantizers (:mod:`ggufkit.quant.kernels.iq.iq2`), CPU only, byte-identical to ggml.

ggml-quants.c (``quantize_row_iq2_xxs_impl``, ``quantize_row_iq2_xs_impl``, ``quantize_row_iq2_s_impl``)
tries ``2*n_try + 1`` scales per group of 16 or 32 weights; per scale each 8-weight sub-group is rounded to
levels 0..2 and, where that point is off the grid, ``iq2_find_best_neighbour`` picks the closest listed
grid point. Here:

* :func:`trials`: the trial scales side by side (roundings and both sums as vector lanes, each trial's
  float32 operations in ggml's order), the winner picked in ggml's trial order with ggml's comparison;
  :func:`trials_seq` is the same one trial after another with ``nearest_int`` over any input (taken where
  ``0.5*(iscale*xval - 1)`` is not below 2^22 in magnitude, where plain rounding is not ``nearest_int``);
* :func:`lane_search`: every neighbour search of a set of trials and sub-groups, each list's candidates
  side by side over ``neighbour_lanes``' layout (also ggml's final pass at the winning scale, which the
  block functions in :mod:`ggufkit.quant.kernels.iq.iq2` write out around it);
* :func:`qp_scale32`: ``make_qp_quants(32, 4, ...)``'s scale (IQ2_XXS) with its 8 step trials side by side.

Numba reference-counts the array arguments around calls (``inline="always"`` helpers too): an atomic
increment and decrement per array per call. The functions here (and the block functions of
:mod:`ggufkit.quant.kernels.iq.iq2`) allocate nothing and are compiled without the runtime's reference counting
(``_nrt=False``, as numba's own per-character string helpers in ``numba/cpython/unicode.py`` are); their
callers keep the arrays alive. That alone cut 17 % of IQ2_S's time and 12 % of IQ2_XXS's. :func:`trials` and
:func:`lane_search` are also inlined into their callers (no argument passing per group).
"""

from __future__ import annotations

import numba
import numpy as np

from ggufkit.quant.kernels.iq.common import FLT_MAX, NO_GRID_POINT
from ggufkit.quant.kernels.kquants.subroutines import GROUP_MAX_EPS, make_qp_quants, nearest_int_full

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_HALF = np.float32(0.5)
_FLT_MAX_BITS = 0x7F7FFFFF
#: Bound on the lanes of one neighbour list (the longest IQ2 list pads to 296 lanes, IQ2_XS); iq2 checks it.
MAX_PAD = 512
_MAGIC = np.float32(12582912.0)  # 1.5 * 2^23: v + _MAGIC - _MAGIC rounds half to even for |v| < 2^22
_ROUND_OK = np.float32(4194304.0)  # 2^22
#: Most trial lanes :func:`trials` takes (IQ2_XS/IQ2_S use 24 for their 19 trials, IQ2_XXS 16 for 13).
MAX_LANES = 32




@numba.njit(cache=True, fastmath=False, error_model="numpy", _nrt=False, inline="always")
def lane_search(nt: int, k0: int, k1: int, u: np.ndarray, ts: np.ndarray, xval: np.ndarray, waux: np.ndarray,
                q: np.ndarray, on_grid: np.ndarray, d2: np.ndarray, linfo: np.ndarray, qgrid: np.ndarray,
                lindex: np.ndarray, lvalues: np.ndarray) -> int:
    """``iq2_find_best_neighbour`` for trial ``t < nt`` (multiplier ``ts[t]``) and sub-group ``k0 <= k < k1``
    where ``u[k, t]`` is off the grid: the winner's grid values go to ``q[8k:8k+8, t]``; ``on_grid[t, k]``
    says whether ``u[k, t]`` was on it (``q`` untouched then). Returns a failure code.

    ``linfo[u]`` is -1 on the grid, else ``start * 512 + pad`` of the list's lanes. Each candidate's
    distance is ggml's float32 operations in element order (from +0, so >= +0; NaN and anything not below
    FLT_MAX, which never wins in ggml, become FLT_MAX); the first lane holding the smallest distance bits
    (int32 minima: the distances are >= +0, so their bits order as the floats) is ggml's first
    strictly-smallest candidate (padding lanes repeat the last). Two consecutive trials with the same
    off-grid point (most are: the trial scales differ by 2 %) share one pass over the list; a trial alone
    (and every search at one scale: ggml's final pass, :func:`trials_seq`) takes a one-scale pass.
    """
    d2bits = d2.view(np.int32)
    for k in range(k0, k1):
        o = 8 * k
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
        t = 0
        while t < nt:
            uu = u[k, t]
            info = np.int64(linfo[uu])
            on_grid[t, k] = info < 0
            if info < 0:
                t += 1
                continue
            p = np.uint64(info & 511)
            s0 = np.uint64(info >> 9)
            bb = np.uint64(8) * s0
            nb = 2 if t + 1 < nt and u[k, t + 1] == uu else 1
            sa = ts[t]
            if nb == 1:
                for j in range(p):
                    e0 = sa * np.float32(lvalues[bb + j]) - x0
                    e1 = sa * np.float32(lvalues[bb + p + j]) - x1
                    e2 = sa * np.float32(lvalues[bb + np.uint64(2) * p + j]) - x2
                    e3 = sa * np.float32(lvalues[bb + np.uint64(3) * p + j]) - x3
                    e4 = sa * np.float32(lvalues[bb + np.uint64(4) * p + j]) - x4
                    e5 = sa * np.float32(lvalues[bb + np.uint64(5) * p + j]) - x5
                    e6 = sa * np.float32(lvalues[bb + np.uint64(6) * p + j]) - x6
                    e7 = sa * np.float32(lvalues[bb + np.uint64(7) * p + j]) - x7
                    dd = (((((((_F0 + w0 * e0 * e0) + w1 * e1 * e1) + w2 * e2 * e2) + w3 * e3 * e3)
                            + w4 * e4 * e4) + w5 * e5 * e5) + w6 * e6 * e6) + w7 * e7 * e7
                    d2[j] = dd if dd < FLT_MAX else FLT_MAX
                m1 = np.int32(_FLT_MAX_BITS)
                for j in range(p):
                    m1 = min(m1, d2bits[j])
                if m1 >= _FLT_MAX_BITS:
                    return NO_GRID_POINT
                j1 = np.int32(MAX_PAD)
                for j in range(p):
                    j1 = min(j1, np.int32(j) if d2bits[j] == m1 else np.int32(MAX_PAD))
                gi = np.int64(lindex[s0 + np.uint64(j1)])
                for i in range(8):
                    q[o + i, t] = np.float32(qgrid[gi, i])
                t += 1
                continue
            sb = ts[t + 1]
            for j in range(p):
                g0 = np.float32(lvalues[bb + j])
                g1 = np.float32(lvalues[bb + p + j])
                g2 = np.float32(lvalues[bb + np.uint64(2) * p + j])
                g3 = np.float32(lvalues[bb + np.uint64(3) * p + j])
                g4 = np.float32(lvalues[bb + np.uint64(4) * p + j])
                g5 = np.float32(lvalues[bb + np.uint64(5) * p + j])
                g6 = np.float32(lvalues[bb + np.uint64(6) * p + j])
                g7 = np.float32(lvalues[bb + np.uint64(7) * p + j])
                e0 = sa * g0 - x0
                e1 = sa * g1 - x1
                e2 = sa * g2 - x2
                e3 = sa * g3 - x3
                e4 = sa * g4 - x4
                e5 = sa * g5 - x5
                e6 = sa * g6 - x6
                e7 = sa * g7 - x7
                dd = (((((((_F0 + w0 * e0 * e0) + w1 * e1 * e1) + w2 * e2 * e2) + w3 * e3 * e3)
                        + w4 * e4 * e4) + w5 * e5 * e5) + w6 * e6 * e6) + w7 * e7 * e7
                d2[j] = dd if dd < FLT_MAX else FLT_MAX
                e0 = sb * g0 - x0
                e1 = sb * g1 - x1
                e2 = sb * g2 - x2
                e3 = sb * g3 - x3
                e4 = sb * g4 - x4
                e5 = sb * g5 - x5
                e6 = sb * g6 - x6
                e7 = sb * g7 - x7
                dd = (((((((_F0 + w0 * e0 * e0) + w1 * e1 * e1) + w2 * e2 * e2) + w3 * e3 * e3)
                        + w4 * e4 * e4) + w5 * e5 * e5) + w6 * e6 * e6) + w7 * e7 * e7
                d2[p + j] = dd if dd < FLT_MAX else FLT_MAX
            # the smallest distance as int32 bits (all >= +0, so ordered as the floats), then its first lane:
            # 32-bit minima, 8 lanes a vector on AVX2 (a 64-bit ``bits << 32 | lane`` key needs AVX-512's
            # vpminsq, else compare-and-blend)
            m1 = np.int32(_FLT_MAX_BITS)
            m2 = np.int32(_FLT_MAX_BITS)
            for j in range(p):
                m1 = min(m1, d2bits[j])
                m2 = min(m2, d2bits[p + j])
            if m1 >= _FLT_MAX_BITS or m2 >= _FLT_MAX_BITS:
                return NO_GRID_POINT
            j1 = np.int32(MAX_PAD)
            j2 = np.int32(MAX_PAD)
            for j in range(p):
                jj = np.int32(j)
                j1 = min(j1, jj if d2bits[j] == m1 else np.int32(MAX_PAD))
                j2 = min(j2, jj if d2bits[p + j] == m2 else np.int32(MAX_PAD))
            gi = np.int64(lindex[s0 + np.uint64(j1)])
            for i in range(8):
                q[o + i, t] = np.float32(qgrid[gi, i])
            on_grid[t + 1, k] = False
            gi = np.int64(lindex[s0 + np.uint64(j2)])
            for i in range(8):
                q[o + i, t + 1] = np.float32(qgrid[gi, i])
            t += 2
    return 0


@numba.njit(cache=True, fastmath=False, error_model="numpy", _nrt=False)
def _round_groups(k0: int, k1: int, xval: np.ndarray, iscale: np.float32, u: np.ndarray, q: np.ndarray) -> None:
    """``l = clamp(nearest_int(0.5*(id*x - 1)), 0, 2)`` over sub-groups ``k0..k1-1`` into column 0 of ``q``
    (as ``2*l + 1``) and ``u`` (packed 2-bit indices), over any input."""
    for k in range(k0, k1):
        uu = 0
        for i in range(8):
            lv = max(0, min(2, nearest_int_full(_HALF * (iscale * xval[8 * k + i] - _F1))))
            q[8 * k + i, 0] = np.float32(2 * lv + 1)
            uu |= lv << (2 * i)
        u[k, 0] = uu


@numba.njit(cache=True, fastmath=False, error_model="numpy", _nrt=False, inline="always")
def trials(n: int, n_try: int, nl: int, xval: np.ndarray, weight: np.ndarray, waux: np.ndarray, mx: np.float32,
           scale0: np.float32, L: np.ndarray, isv: np.ndarray, ts: np.ndarray, q: np.ndarray, u: np.ndarray,
           on_grid: np.ndarray, sx: np.ndarray, s2: np.ndarray, uf: np.ndarray, badv: np.ndarray, d2: np.ndarray,
           linfo: np.ndarray, qgrid: np.ndarray, lindex: np.ndarray, lvalues: np.ndarray) -> tuple[np.float32, int, bool, bool, bool]:
    """The ``2*n_try + 1`` trial scales ``(5 + 0.1*is)/mx`` over ``n`` weights (IQ2_XS/IQ2_S: 16 and 9,
    IQ2_XXS: 32 and 6) in ``nl`` lanes (at least ``2*n_try + 1``, a multiple of 8; the extra lanes repeat
    the last trial). Only where every ``0.5*(iscale*xval - 1)`` is below 2^22 in magnitude (``nearest_int``
    is then plain round-half-even): otherwise returns ok=False and the caller runs :func:`trials_seq`.

    Returns:
        (scale, failure code, ok, on-grid flag of the winner's group 0, of its group 1); the winning
        levels in ``L`` (no winner: ``scale0``, ``L`` untouched).
    """
    nt = 2 * n_try + 1
    ng = n // 8
    for t in range(nl):
        isv[t] = (np.float32(5.0) + np.float32(min(t, nt - 1) - n_try) * np.float32(0.1)) / mx
    for t in range(nl):
        ts[t] = _F1 / isv[t]
    # all in float32 so that the loop runs 8 lanes wide: the packed index as sum(l_i * 4^i) (exact below
    # 2^24) and a per-lane count of values not below 2^22
    for k in range(ng):
        for t in range(nl):
            uf[k, t] = _F0
    for t in range(nl):
        badv[t] = _F0
    for i in range(n):
        xi = xval[i]
        p4 = np.float32(1 << (2 * (i % 8)))
        k = i // 8
        for t in range(nl):
            v = _HALF * (isv[t] * xi - _F1)
            badv[t] += _F0 if abs(v) < _ROUND_OK else _F1
            r = (v + _MAGIC) - _MAGIC
            r = min(max(r, _F0), np.float32(2.0))
            q[i, t] = np.float32(2.0) * r + _F1
            uf[k, t] += r * p4
    for t in range(nl):
        if badv[t] != _F0:
            return scale0, 0, False, True, True
    for k in range(ng):
        for t in range(nl):
            u[k, t] = np.int32(uf[k, t])
    fail = lane_search(nt, 0, ng, u, ts, xval, waux, q, on_grid, d2, linfo, qgrid, lindex, lvalues)
    if fail:
        return _F0, fail, True, True, True
    for t in range(nl):
        sx[t] = _F0
        s2[t] = _F0
    for i in range(n):
        wx = weight[i] * xval[i]
        w = weight[i]
        for t in range(nl):
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
    return scale, 0, True, on_grid[bt, 0], on_grid[bt, 1]


@numba.njit(cache=True, fastmath=False, error_model="numpy", _nrt=False)
def trials_seq(n: int, n_try: int, xval: np.ndarray, weight: np.ndarray, waux: np.ndarray, mx: np.float32,
               scale0: np.float32, L: np.ndarray, ts: np.ndarray, q: np.ndarray, u: np.ndarray, on_grid: np.ndarray,
               d2: np.ndarray, linfo: np.ndarray, qgrid: np.ndarray, lindex: np.ndarray,
               lvalues: np.ndarray) -> tuple[np.float32, int, bool, bool]:
    """:func:`trials` one trial after another with ggml's ``nearest_int`` over every input (huge or NaN
    ``iscale*xval``): (scale, failure code, on-grid flags of the winner's groups 0 and 1)."""
    ng = n // 8
    best = _F0
    scale = scale0
    on0 = True
    on1 = True
    for is_ in range(-n_try, n_try + 1):
        iscale = (np.float32(5.0) + np.float32(is_) * np.float32(0.1)) / mx
        ts[0] = _F1 / iscale
        _round_groups(0, ng, xval, iscale, u, q)
        fail = lane_search(1, 0, ng, u, ts, xval, waux, q, on_grid, d2, linfo, qgrid, lindex, lvalues)
        if fail:
            return scale, fail, True, True
        sumqx = _F0
        sumq2 = _F0
        for i in range(n):
            w = weight[i]
            qi = q[i, 0]
            sumqx += w * xval[i] * qi
            sumq2 += w * qi * qi
        if sumq2 > _F0 and sumqx * sumqx > best * sumq2:
            scale = sumqx / sumq2
            best = scale * sumqx
            for i in range(n):
                L[i] = np.int8((np.int64(q[i, 0]) - 1) // 2)
            on0 = on_grid[0, 0]
            on1 = on_grid[0, 1]
    return scale, 0, on0, on1


@numba.njit(cache=True, fastmath=False, error_model="numpy", _nrt=False)
def qp_scale32(nl: int, x: np.ndarray, w: np.ndarray, L: np.ndarray, lanes: np.ndarray) -> np.float32:
    """``make_qp_quants(32, 4, x, L, w)`` (ggml-quants.c) as IQ2_XXS calls it: the first fit and the 8 step
    trials side by side in ``nl`` (>= 9) lanes of ``lanes`` (float32[5, nl] scratch), each with ggml's float32
    operations in element order; then ggml's refinement passes. Where some ``iscale*x`` is not below 2^22 in
    magnitude (``nearest_int`` is then not plain rounding) or would wrap the uint8 store by more than 256:
    :func:`~ggufkit.quant.kernels.kquants.subroutines.make_qp_quants` itself."""
    n = 32
    nmax = 4
    mx = _F0
    for i in range(n):
        mx = mx if mx > x[i] else x[i]
    if mx < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return _F0
    fnmax = np.float32(nmax)
    isc = lanes[0]
    scl = lanes[1]
    mse = lanes[2]
    wrap = lanes[3]
    badv = lanes[4]
    # lane 0: iscale = nmax/mx with the uint8 store of L (negative quants wrap); lanes 1..8: steps -4..4 but 0
    isc[0] = fnmax / mx
    wrap[0] = np.float32(256.0)
    for t in range(1, nl):
        step = min(t, 8) - 5 if min(t, 8) <= 4 else min(t, 8) - 4
        isc[t] = (np.float32(0.1) * np.float32(step) + fnmax) / mx
        wrap[t] = _F0
    for t in range(nl):
        scl[t] = _F1 / isc[t]
        mse[t] = _F0
        badv[t] = _F0
    for i in range(n):
        xi = x[i]
        wi = w[i]
        for t in range(nl):
            v = isc[t] * xi
            badv[t] += _F0 if abs(v) < _ROUND_OK else _F1
            r = min((v + _MAGIC) - _MAGIC, fnmax)
            r = r + wrap[t] if r < _F0 else r
            badv[t] += _F1 if r < wrap[t] - np.float32(256.0) else _F0  # lane 0 wrapping below -256
            diff = xi - scl[t] * r
            mse[t] += wi * diff * diff
    for t in range(nl):
        if badv[t] != _F0:
            return make_qp_quants(n, nmax, x, L, w)
    best_mse = mse[0]
    iscale = isc[0]
    for t in range(1, 9):
        if mse[t] < best_mse:
            best_mse = mse[t]
            iscale = isc[t]
    # the rest of make_qp_quants as in kquants_math (ggml's order)
    sumlx = _F0
    suml2 = _F0
    for i in range(n):
        li = min(nmax, nearest_int_full(iscale * x[i]))
        L[i] = li & 0xFF
        fl = np.float32(li)
        sumlx = sumlx + w[i] * x[i] * fl
        suml2 = suml2 + w[i] * fl * fl
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            wi = w[i]
            fli = np.float32(L[i])  # read back through uint8, as the C reads its uint8_t array
            slx = sumlx - wi * x[i] * fli
            sl2 = suml2 - wi * fli * fli
            if slx > _F0 and sl2 > _F0:
                new_l = min(nmax, nearest_int_full(x[i] * sl2 / slx))
                if new_l != np.int64(L[i]):
                    fnl = np.float32(new_l)
                    slx = slx + wi * x[i] * fnl
                    sl2 = sl2 + wi * fnl * fnl
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l & 0xFF
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2 if suml2 > _F0 else _F0
