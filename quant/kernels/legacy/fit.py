"""The fitting routines of the legacy imatrix quantizers (ggml-quants.c make_qx_quants / make_qkx3_quants).

:func:`make_qx_quants` and :func:`make_qkx3_quants` are the scalar routines, shared by the CPU kernels (as
fallbacks) and, through :mod:`ggufkit.quant.kernels.legacy.cuda` (which retargets
:mod:`ggufkit.quant.kernels.legacy.cpu` with :func:`ggufkit.quant.kernels.cuda_base.retarget`), the CUDA kernels. :func:`make_qx_quants_lanes` and :func:`make_qkx3_quants_lanes` are CPU-only versions that
evaluate ggml's trial scales side by side (same float32 operations per trial, same order of decisions, so
the same bytes), which the compiler vectorizes across trials.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from ggufkit.quant.kernels.fp import fadd, fmul, fsub, nearest_int

_GROUP_MAX_EPS = np.float32(1e-15)  # ggml-quants.c GROUP_MAX_EPS

_jit = numba.njit(cache=True, fastmath=False, error_model="numpy")


# --- shared fitting routines (ggml-quants.c make_qx_quants / make_qkx3_quants) ----------------------------


@_jit
def make_qx_quants(x: np.ndarray, r: int, off: int, n: int, nmax: int, w: np.ndarray, use_w: bool,
                   L: np.ndarray) -> np.float32:
    """Symmetric fit ``x ~ scale * (L - nmax)`` of ``x[r, off:off+n]`` (``make_qx_quants``, rmse_type 1).

    Args:
        x: float32 [rows, n_per_row] source.
        r: row; off: first column; n: element count.
        nmax: L - nmax lies in [-nmax, nmax-1].
        w: float32 weights (only ``w[0:n]`` read) when ``use_w``; otherwise the weights are ``x*x``.
        L: int32 scratch of at least n, receives the quants (0 .. 2*nmax-1).

    Returns:
        The float32 scale (sign opposite to the element of largest magnitude), 0 for an all-zero group.
    """
    amax = np.float32(0.0)
    mx = np.float32(0.0)
    for i in range(n):
        ax = abs(x[r, off + i])
        if ax > amax:
            amax = ax
            mx = x[r, off + i]
    if amax < _GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return np.float32(0.0)
    fnmax = np.float32(nmax)
    iscale = np.float32(-fnmax / mx)
    sumlx = np.float32(0.0)
    suml2 = np.float32(0.0)
    for i in range(n):
        xi = x[r, off + i]
        li = min(max(nearest_int(fmul(iscale, xi)), -nmax), nmax - 1)
        L[i] = li + nmax
        wi = w[i] if use_w else np.float32(xi * xi)
        fl = np.float32(li)
        sumlx = fadd(sumlx, fmul(np.float32(wi * xi), fl))
        suml2 = fadd(suml2, fmul(np.float32(wi * fl), fl))
    scale = np.float32(sumlx / suml2) if suml2 != np.float32(0.0) else np.float32(0.0)
    best = np.float32(scale * sumlx)
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = np.float32(-fadd(fnmax, fmul(np.float32(0.1), np.float32(step))) / mx)
        sumlx = np.float32(0.0)
        suml2 = np.float32(0.0)
        for i in range(n):
            xi = x[r, off + i]
            li = min(max(nearest_int(fmul(iscale, xi)), -nmax), nmax - 1)
            wi = w[i] if use_w else np.float32(xi * xi)
            fl = np.float32(li)
            sumlx = fadd(sumlx, fmul(np.float32(wi * xi), fl))
            suml2 = fadd(suml2, fmul(np.float32(wi * fl), fl))
        if suml2 > np.float32(0.0) and np.float32(sumlx * sumlx) > np.float32(best * suml2):
            for i in range(n):
                li = min(max(nearest_int(fmul(iscale, x[r, off + i])), -nmax), nmax - 1)
                L[i] = li + nmax
            scale = np.float32(sumlx / suml2)
            best = np.float32(scale * sumlx)
    return scale


@_jit
def make_qkx3_quants(x: np.ndarray, r: int, off: int, n: int, nmax: int, w: np.ndarray, L: np.ndarray,
                     Laux: np.ndarray, rmin: np.float32, rdelta: np.float32, nstep: int) -> tuple:
    """Weighted asymmetric fit ``x ~ scale * L + min`` (``make_qkx3_quants`` with weights, no MAD).

    Args:
        x: float32 [rows, n_per_row]; r, off, n: the group ``x[r, off:off+n]``.
        nmax: L lies in [0, nmax].
        w: float32 weights ``w[0:n]``.
        L, Laux: int32 scratch of at least n; L receives the quants.
        rmin, rdelta, nstep: the scale search grid (ggml passes -0.9f, 0.05f, 36 for legacy types).

    Returns:
        ``(scale, the_min)`` as float32, where ``the_min = -min >= 0`` (may be -0.0).
    """
    mn = x[r, off]
    mx = x[r, off]
    sum_w = w[0]
    sum_x = np.float32(sum_w * x[r, off])
    for i in range(1, n):
        xi = x[r, off + i]
        if xi < mn:
            mn = xi
        if xi > mx:
            mx = xi
        sum_w = fadd(sum_w, w[i])
        sum_x = fadd(sum_x, fmul(w[i], xi))
    if mn > np.float32(0.0):
        mn = np.float32(0.0)
    if mx <= mn:
        for i in range(n):
            L[i] = 0
        return np.float32(0.0), np.float32(-mn)
    fnmax = np.float32(nmax)
    iscale = np.float32(fnmax / np.float32(mx - mn))
    scale = np.float32(np.float32(1.0) / iscale)
    best_mad = np.float32(0.0)
    for i in range(n):
        xi = x[r, off + i]
        li = min(max(nearest_int(fmul(iscale, fsub(xi, mn))), 0), nmax)
        L[i] = li
        diff = fsub(fadd(fmul(scale, np.float32(li)), mn), xi)
        best_mad = fadd(best_mad, fmul(w[i], np.float32(diff * diff)))
    for step in range(nstep + 1):
        # ggml updates `min` in place when a step improves the fit, so later steps see the new range
        iscale = np.float32(fadd(fadd(rmin, fmul(rdelta, np.float32(step))), fnmax) / np.float32(mx - mn))
        sum_l = np.float32(0.0)
        sum_l2 = np.float32(0.0)
        sum_xl = np.float32(0.0)
        for i in range(n):
            xi = x[r, off + i]
            li = min(max(nearest_int(fmul(iscale, fsub(xi, mn))), 0), nmax)
            Laux[i] = li
            fl = np.float32(li)
            wl = np.float32(w[i] * fl)
            sum_l = fadd(sum_l, wl)
            sum_l2 = fadd(sum_l2, fmul(wl, fl))
            sum_xl = fadd(sum_xl, fmul(wl, xi))
        D = fsub(fmul(sum_w, sum_l2), fmul(sum_l, sum_l))
        if D > 0.0:
            this_scale = np.float32(fsub(fmul(sum_w, sum_xl), fmul(sum_x, sum_l)) / D)
            this_min = np.float32(fsub(fmul(sum_l2, sum_x), fmul(sum_l, sum_xl)) / D)
            if this_min > np.float32(0.0):
                this_min = np.float32(0.0)
                this_scale = np.float32(sum_xl / sum_l2)
            mad = np.float32(0.0)
            for i in range(n):
                diff = fsub(fadd(fmul(this_scale, np.float32(Laux[i])), this_min), x[r, off + i])
                mad = fadd(mad, fmul(w[i], np.float32(diff * diff)))
            if mad < best_mad:
                for i in range(n):
                    L[i] = Laux[i]
                best_mad = mad
                scale = this_scale
                mn = this_min
    return scale, np.float32(-mn)


# --- CPU-only: make_qx_quants with its 19 trial scales side by side ----------------------------------------
# ggml's make_qx_quants (rmse_type 1) tries iscale = -(nmax + 0.1*is)/max for is = -9..9 (is = 0 first) and
# keeps the best by a sequential comparison. The 19 trials are independent until that comparison, so the
# CPU kernels run them as 19 lanes of one loop over the block (each lane's sums in ggml's order, so every
# lane's float32 result is ggml's), then compare the lanes in ggml's order. The CUDA kernels keep the scalar
# make_qx_quants above.

NL = 24  # trial lanes: step -9..9 in lanes 0..18; lanes 19..23 idle (a multiple of the vector width)
_MAGIC = np.float32(12582912.0)  # 1.5 * 2^23, ggml's nearest_int constant


@_jit
def make_qx_quants_lanes(x: np.ndarray, r: int, off: int, n: int, nmax: int, w: np.ndarray, L: np.ndarray,
                         isc: np.ndarray, slx: np.ndarray, sl2: np.ndarray) -> np.float32:
    """:func:`make_qx_quants` with weights ``w`` (same result, bit for bit), trials evaluated as lanes.

    ``isc``, ``slx``, ``sl2``: float32 scratch of ``NL``. For a finite block with ``amax >= GROUP_MAX_EPS``
    every ``|iscale * x|`` is below nmax + 1, where ggml's ``nearest_int`` is ``(v + 1.5*2^23) - 1.5*2^23``
    in float32 (exact); other blocks take the scalar routine.
    """
    amax = np.float32(0.0)
    mx = np.float32(0.0)
    for i in range(n):
        ax = abs(x[r, off + i])
        if ax > amax:
            amax = ax
            mx = x[r, off + i]
    if amax < _GROUP_MAX_EPS or not amax < np.float32(np.inf) or n % 4:
        return make_qx_quants(x, r, off, n, nmax, w, True, L)
    fnmax = np.float32(nmax)
    lo = np.float32(-nmax)
    hi = np.float32(nmax - 1)
    for k in range(NL):
        step = k - 9 if k < 19 else 0
        isc[k] = np.float32(-fadd(fnmax, fmul(np.float32(0.1), np.float32(step))) / mx)
        slx[k] = np.float32(0.0)
        sl2[k] = np.float32(0.0)
    # Four elements per pass over the lanes: each lane's sums still add them one by one in ggml's order, but
    # load and store the running sum once per four elements (the store-to-load latency otherwise dominates).
    for i in range(0, n, 4):
        x0 = x[r, off + i]
        x1 = x[r, off + i + 1]
        x2 = x[r, off + i + 2]
        x3 = x[r, off + i + 3]
        w0 = w[i]
        w1 = w[i + 1]
        w2 = w[i + 2]
        w3 = w[i + 3]
        wx0 = np.float32(w0 * x0)
        wx1 = np.float32(w1 * x1)
        wx2 = np.float32(w2 * x2)
        wx3 = np.float32(w3 * x3)
        for k in range(NL):
            s = isc[k]
            f0 = min(max(fsub(fadd(fmul(s, x0), _MAGIC), _MAGIC), lo), hi)
            f1 = min(max(fsub(fadd(fmul(s, x1), _MAGIC), _MAGIC), lo), hi)
            f2 = min(max(fsub(fadd(fmul(s, x2), _MAGIC), _MAGIC), lo), hi)
            f3 = min(max(fsub(fadd(fmul(s, x3), _MAGIC), _MAGIC), lo), hi)
            a = fadd(slx[k], fmul(wx0, f0))
            a = fadd(a, fmul(wx1, f1))
            a = fadd(a, fmul(wx2, f2))
            slx[k] = fadd(a, fmul(wx3, f3))
            b = fadd(sl2[k], fmul(np.float32(w0 * f0), f0))
            b = fadd(b, fmul(np.float32(w1 * f1), f1))
            b = fadd(b, fmul(np.float32(w2 * f2), f2))
            sl2[k] = fadd(b, fmul(np.float32(w3 * f3), f3))
    sumlx = slx[9]
    suml2 = sl2[9]
    scale = np.float32(sumlx / suml2) if suml2 != np.float32(0.0) else np.float32(0.0)
    best = np.float32(scale * sumlx)
    kb = 9
    for k in range(19):
        if k == 9:
            continue
        sumlx = slx[k]
        suml2 = sl2[k]
        if suml2 > np.float32(0.0) and np.float32(sumlx * sumlx) > np.float32(best * suml2):
            scale = np.float32(sumlx / suml2)
            best = np.float32(scale * sumlx)
            kb = k
    iscale = isc[kb]
    for i in range(n):
        fl = fsub(fadd(fmul(iscale, x[r, off + i]), _MAGIC), _MAGIC)
        L[i] = int(min(max(fl, lo), hi)) + nmax
    return scale


# --- CPU-only: make_qkx3_quants with its trial scales side by side -------------------------------------------
# ggml's make_qkx3_quants tries iscale = (rmin + rdelta*is + nmax)/(max - min) for is = 0..nstep, and a trial
# that improves the fit replaces `min`, which the later trials then use. The CPU kernels evaluate the trials
# from `start` on as lanes with the current min (each lane's sums in ggml's order), accept them in ggml's
# order, and when an accepted trial changes min re-evaluate the trials after it: the same sequence of
# decisions, so the same float32 results.

NL3 = 16  # lanes per pass: trials start .. start+15
_NEAREST_LIMIT = np.float32(2097152.0)  # 2^21: below 2^22 nearest_int is the float32 magic-number round


@_jit
def make_qkx3_quants_lanes(x: np.ndarray, r: int, off: int, n: int, nmax: int, w: np.ndarray, L: np.ndarray,
                           Laux: np.ndarray, rmin: np.float32, rdelta: np.float32, nstep: int,
                           lanes: np.ndarray) -> tuple:
    """:func:`make_qkx3_quants` (same result, bit for bit), trials as lanes; ``lanes``: float32 [7, NL3]."""
    mn = x[r, off]
    mx = x[r, off]
    sum_w = w[0]
    sum_x = np.float32(sum_w * x[r, off])
    for i in range(1, n):
        xi = x[r, off + i]
        if xi < mn:
            mn = xi
        if xi > mx:
            mx = xi
        sum_w = fadd(sum_w, w[i])
        sum_x = fadd(sum_x, fmul(w[i], xi))
    if mn > np.float32(0.0):
        mn = np.float32(0.0)
    if mx <= mn or n % 4:
        return make_qkx3_quants(x, r, off, n, nmax, w, L, Laux, rmin, rdelta, nstep)
    xlo = mn  # at most the smallest element
    fnmax = np.float32(nmax)
    iscale = np.float32(fnmax / np.float32(mx - mn))
    scale = np.float32(np.float32(1.0) / iscale)
    best_mad = np.float32(0.0)
    for i in range(n):
        xi = x[r, off + i]
        li = min(max(nearest_int(fmul(iscale, fsub(xi, mn))), 0), nmax)
        L[i] = li
        diff = fsub(fadd(fmul(scale, np.float32(li)), mn), xi)
        best_mad = fadd(best_mad, fmul(w[i], np.float32(diff * diff)))
    isc = lanes[0]
    s_l = lanes[1]
    s_l2 = lanes[2]
    s_xl = lanes[3]
    t_sc = lanes[4]
    t_mn = lanes[5]
    mad = lanes[6]
    zero = np.float32(0.0)
    hi = np.float32(nmax)
    best_is = np.float32(-1.0)  # iscale of the accepted trial (-1: none, L is the first fit)
    best_mn = mn  # the min that trial was evaluated with
    start = 0
    while start <= nstep:
        span = np.float32(mx - mn)
        # |iscale * (x - min)| of every element is at most top * reach (monotone roundings), so below 2^22
        # the float32 magic-number round is ggml's nearest_int exactly; otherwise the scalar routine runs
        reach = max(abs(fsub(mx, mn)), abs(fsub(xlo, mn)))
        top = np.float32(fadd(fadd(rmin, fmul(rdelta, np.float32(start + NL3))), fnmax) / span)
        if not (abs(top) * reach < _NEAREST_LIMIT):
            return make_qkx3_quants(x, r, off, n, nmax, w, L, Laux, rmin, rdelta, nstep)
        for j in range(NL3):
            isc[j] = np.float32(fadd(fadd(rmin, fmul(rdelta, np.float32(start + j))), fnmax) / span)
            s_l[j] = zero
            s_l2[j] = zero
            s_xl[j] = zero
            mad[j] = zero
        for i in range(0, n, 4):  # four elements per pass over the lanes, added in order (see above)
            x0 = x[r, off + i]
            x1 = x[r, off + i + 1]
            x2 = x[r, off + i + 2]
            x3 = x[r, off + i + 3]
            w0 = w[i]
            w1 = w[i + 1]
            w2 = w[i + 2]
            w3 = w[i + 3]
            d0 = fsub(x0, mn)
            d1 = fsub(x1, mn)
            d2 = fsub(x2, mn)
            d3 = fsub(x3, mn)
            for j in range(NL3):
                s = isc[j]
                f0 = min(max(fsub(fadd(fmul(s, d0), _MAGIC), _MAGIC), zero), hi)
                f1 = min(max(fsub(fadd(fmul(s, d1), _MAGIC), _MAGIC), zero), hi)
                f2 = min(max(fsub(fadd(fmul(s, d2), _MAGIC), _MAGIC), zero), hi)
                f3 = min(max(fsub(fadd(fmul(s, d3), _MAGIC), _MAGIC), zero), hi)
                wl0 = np.float32(w0 * f0)
                wl1 = np.float32(w1 * f1)
                wl2 = np.float32(w2 * f2)
                wl3 = np.float32(w3 * f3)
                s_l[j] = fadd(fadd(fadd(fadd(s_l[j], wl0), wl1), wl2), wl3)
                a = fadd(s_l2[j], fmul(wl0, f0))
                a = fadd(a, fmul(wl1, f1))
                a = fadd(a, fmul(wl2, f2))
                s_l2[j] = fadd(a, fmul(wl3, f3))
                b = fadd(s_xl[j], fmul(wl0, x0))
                b = fadd(b, fmul(wl1, x1))
                b = fadd(b, fmul(wl2, x2))
                s_xl[j] = fadd(b, fmul(wl3, x3))
        for j in range(NL3):
            den = fsub(fmul(sum_w, s_l2[j]), fmul(s_l[j], s_l[j]))
            this_scale = np.float32(fsub(fmul(sum_w, s_xl[j]), fmul(sum_x, s_l[j])) / den)
            this_min = np.float32(fsub(fmul(s_l2[j], sum_x), fmul(s_l[j], s_xl[j])) / den)
            if this_min > zero:
                this_min = zero
                this_scale = np.float32(s_xl[j] / s_l2[j])
            t_sc[j] = this_scale
            t_mn[j] = this_min if den > zero else np.float32(np.nan)  # NaN: ggml skips the trial
        for i in range(0, n, 4):
            x0 = x[r, off + i]
            x1 = x[r, off + i + 1]
            x2 = x[r, off + i + 2]
            x3 = x[r, off + i + 3]
            w0 = w[i]
            w1 = w[i + 1]
            w2 = w[i + 2]
            w3 = w[i + 3]
            d0 = fsub(x0, mn)
            d1 = fsub(x1, mn)
            d2 = fsub(x2, mn)
            d3 = fsub(x3, mn)
            for j in range(NL3):
                s = isc[j]
                sc = t_sc[j]
                m = t_mn[j]
                e0 = fsub(fadd(fmul(sc, min(max(fsub(fadd(fmul(s, d0), _MAGIC), _MAGIC), zero), hi)), m), x0)
                e1 = fsub(fadd(fmul(sc, min(max(fsub(fadd(fmul(s, d1), _MAGIC), _MAGIC), zero), hi)), m), x1)
                e2 = fsub(fadd(fmul(sc, min(max(fsub(fadd(fmul(s, d2), _MAGIC), _MAGIC), zero), hi)), m), x2)
                e3 = fsub(fadd(fmul(sc, min(max(fsub(fadd(fmul(s, d3), _MAGIC), _MAGIC), zero), hi)), m), x3)
                a = fadd(mad[j], fmul(w0, np.float32(e0 * e0)))
                a = fadd(a, fmul(w1, np.float32(e1 * e1)))
                a = fadd(a, fmul(w2, np.float32(e2 * e2)))
                mad[j] = fadd(a, fmul(w3, np.float32(e3 * e3)))
        nxt = start + NL3
        for j in range(min(NL3, nstep + 1 - start)):
            if t_mn[j] != t_mn[j]:  # D <= 0 (or a NaN fit, which cannot win either)
                continue
            if mad[j] < best_mad:
                best_mad = mad[j]
                scale = t_sc[j]
                best_is = isc[j]
                best_mn = mn
                new_mn = t_mn[j]
                if new_mn != mn or math.copysign(1.0, new_mn) != math.copysign(1.0, mn):
                    mn = new_mn  # later trials see the new min: evaluate them again
                    nxt = start + j + 1
                    break
        start = nxt
    if best_is >= zero:
        for i in range(n):
            fl = fsub(fadd(fmul(best_is, fsub(x[r, off + i], best_mn)), _MAGIC), _MAGIC)
            L[i] = int(min(max(fl, zero), hi))
    return scale, np.float32(-mn)
