"""Float32-exact subroutines of ggml's k-quants, written once for the CPU and the CUDA target.

Each function mirrors one static routine of ``ggml-quants.c`` (make_qkx2_quants, make_qkx3_quants, make_qx_quants, nearest_int):
``make_qkx2_quants``/``make_qkx3_quants`` (:func:`make_qkx_quants`), ``make_qx_quants``,
``make_qp_quants`` and ``nearest_int`` over its whole input range (:func:`nearest_int_full`).

Conventions that keep the bytes identical to the stock x86-64 build of ggml (ggml-impl.h, ggml-quants.c; compiled without FMA contraction):

* every value is float32 and every literal is ``np.float32`` (Numba widens ``f32 * 3`` to float64);
* sums run sequentially in index order, exactly as the C loops;
* every product that feeds an addition goes through :func:`ggufkit.quant.kernels.fp.fmul` / ``fadd`` / ``fsub``,
  so the CUDA build can pin them to separately rounded operations (NVVM would contract them into FMAs;
  the reference build has no FMA);
* integers the C code stores into ``uint8_t`` are stored into uint8 arrays here, which wraps modulo 256
  in the same way.

The functions are plain ``@numba.njit`` (no ``parallel``): the CPU kernels in :mod:`ggufkit.quant.kernels.kquants.cpu`
call them from a ``prange`` loop and :mod:`ggufkit.quant.kernels.kquants.cuda` calls them from ``@cuda.jit``
kernels, with scratch arrays passed in (``np.empty`` on the CPU, ``cuda.local.array`` on the GPU).
"""

from __future__ import annotations

import math

import numba
import numpy as np

from ggufkit.quant.kernels.fp import fadd, fmul, fsub

#: ggml's GROUP_MAX_EPS: below it a group counts as all zero.
GROUP_MAX_EPS = np.float32(1e-15)

_MAGIC = np.float32(12582912.0)  # 1.5 * 2^23
_TWO_23 = np.float32(8388608.0)
_TWO_24 = np.float32(16777216.0)
_F32_MIN_NORMAL = 1.1754943508222875e-38  # 2^-126
_TWO_149 = 7.1362384635297994e44  # 2^149: f32 subnormal value -> its mantissa bits


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _mantissa_bits(s: np.float32) -> int:
    """The 23 mantissa bits of an f32 as ggml's bit trick reads them, for values off the fast path."""
    if s != s:
        # x86 produces the default quiet NaN (0xFFC00000) for inf-inf, 0*inf, 0/0: mantissa 0x400000.
        return 0x400000
    a = abs(float(s))
    if a == math.inf or a == 0.0:
        return 0
    if a < _F32_MIN_NORMAL:
        return int(a * _TWO_149)
    m, _ = math.frexp(a)  # a = m * 2^e, m in [0.5, 1): the mantissa field is (2m - 1) * 2^23
    return int((m * 2.0 - 1.0) * 8388608.0)


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def nearest_int_full(v: np.float32) -> int:
    """ggml's ``nearest_int`` over every f32 input, including the ones its (disabled) assert forbids.

    ``(bits(v + 1.5*2^23) & 0x7FFFFF) - 0x400000``: round half to even for |v| < 2^22, and the same
    "garbage" as the C code beyond that (inf -> -4194304, NaN -> 0). Off-range inputs do occur with
    subnormal or huge weights (``nmax / (max - min)`` overflows to inf), and the clamp that follows
    turns the garbage into real quant values, so it must be reproduced, not just avoided.
    :func:`ggufkit.quant.kernels.fp.nearest_int` covers the fast path only.

    Args:
        v: a float32 scalar.

    Returns:
        The int the C function returns.
    """
    s = fadd(np.float32(v), _MAGIC)
    if s >= _TWO_23 and s < _TWO_24:
        # In [2^23, 2^24) the ulp is 1, so the mantissa field is s - 2^23 exactly.
        return int(s) - 12582912
    return _mantissa_bits(s) - 0x400000


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def round_clamp(v: np.float32, lo: np.float32, hi: np.float32) -> np.float32:
    """``clamp(nearest_int(v), lo, hi)`` as a float32, for |v| < 2^22 only (callers prove the bound).

    ``(v + 1.5*2^23) - 1.5*2^23`` rounds half to even exactly like ``nearest_int`` in that range and stays
    in the float domain: the hot loops then need no float->int->float round trip (1.4x faster).
    """
    r = fsub(fadd(v, _MAGIC), _MAGIC)
    return min(max(r, lo), hi)


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _in_fast_range(iscale: np.float32, x_lo: np.float32, x_hi: np.float32, mn: np.float32) -> bool:
    # Every x in [x_lo, x_hi] gives iscale*(x - mn) between iscale*(x_lo - mn) and iscale*(x_hi - mn)
    # (f32 rounding is monotonic and iscale > 0), so checking the two ends bounds the whole group.
    # Subnormal or overflowing groups (iscale = inf, 0*inf = NaN) fail the test and take the exact path.
    return (iscale > np.float32(0.0) and fmul(iscale, x_hi - mn) < np.float32(1e6)
            and fmul(iscale, x_lo - mn) > np.float32(-1e6))


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _qkx_round(n: int, nmax: int, x: np.ndarray, x_lo: np.float32, x_hi: np.float32, mn: np.float32,
               iscale: np.float32, out: np.ndarray) -> None:
    # out[i] = clamp(nearest_int(iscale*(x[i] - mn)), 0, nmax), as float32. Two loops rather than a test
    # per element, so the common one is branch-free (and vectorizes).
    zero = np.float32(0.0)
    fnmax = np.float32(nmax)
    if _in_fast_range(iscale, x_lo, x_hi, mn):
        for i in range(n):
            out[i] = round_clamp(fmul(iscale, x[i] - mn), zero, fnmax)
    else:
        for i in range(n):
            out[i] = np.float32(max(0, min(nmax, nearest_int_full(fmul(iscale, x[i] - mn)))))


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _qkx_sums(n: int, x: np.ndarray, w: np.ndarray, lf: np.ndarray) -> tuple[np.float32, np.float32, np.float32]:
    # sum_l, sum_l2, sum_xl of make_qkx2_quants for quants lf: sequential, (w*l)*l and (w*l)*x as in C.
    sum_l = np.float32(0.0)
    sum_l2 = np.float32(0.0)
    sum_xl = np.float32(0.0)
    for i in range(n):
        wl = fmul(w[i], lf[i])
        sum_l = fadd(sum_l, wl)
        sum_l2 = fadd(sum_l2, fmul(wl, lf[i]))
        sum_xl = fadd(sum_xl, fmul(wl, x[i]))
    return sum_l, sum_l2, sum_xl


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _qkx_err(diff: np.float32, use_mad: bool) -> np.float32:
    # The error term of one weight: |diff| (use_mad) or diff^2.
    return abs(diff) if use_mad else fmul(diff, diff)


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def make_qkx_quants(n: int, nmax: int, x: np.ndarray, w: np.ndarray, L: np.ndarray, Laux: np.ndarray,
                    rmin: np.float32, rdelta: np.float32, nstep: int, use_mad: bool) -> tuple[np.float32, np.float32]:
    """``make_qkx2_quants`` / ``make_qkx3_quants``: asymmetric fit x ~ scale*L + min.

    The two C functions differ only in the degenerate test (``max == min`` vs ``max <= min``), which
    agree because ``max >= min`` always holds once ``min`` is clamped to <= 0; callers pass explicit
    weights, so qkx3's NULL-weights branch is not needed.

    Args:
        n: group size (32 for Q4_K/Q5_K).
        nmax: largest quant (15 or 31).
        x: float32[n] weights of the group.
        w: float32[n] importance of each weight.
        L: uint8[n] out: quants in [0, nmax].
        Laux: float32[2n] scratch (candidate quants of two steps, as floats).
        rmin, rdelta, nstep: the search grid ``iscale = (rmin + rdelta*is + nmax) / (max - min)``.
        use_mad: the error is ``w*|diff|`` (Q2_K's reference quantizer) instead of ``w*diff^2``.

    Returns:
        ``(scale, the_min)`` with ``the_min = -min >= 0`` (possibly -0.0).
    """
    mn = x[0]
    mx = x[0]
    sum_w = w[0]
    sum_x = fmul(sum_w, x[0])
    for i in range(1, n):
        xi = x[i]
        if xi < mn:
            mn = xi
        if xi > mx:
            mx = xi
        sum_w = fadd(sum_w, w[i])
        sum_x = fadd(sum_x, fmul(w[i], xi))
    x_lo = mn
    if mn > np.float32(0.0):
        mn = np.float32(0.0)
    if mx == mn:
        for i in range(n):
            L[i] = 0
        return np.float32(0.0), -mn
    fnmax = np.float32(nmax)
    iscale = fnmax / (mx - mn)
    scale = np.float32(1.0) / iscale
    cur = Laux[:n]
    nxt = Laux[n:2 * n]
    _qkx_round(n, nmax, x, x_lo, mx, mn, iscale, cur)
    best = np.float32(0.0)
    for i in range(n):
        fl = cur[i]
        L[i] = np.int64(fl)
        diff = fsub(fadd(fmul(scale, fl), mn), x[i])
        best = fadd(best, fmul(w[i], _qkx_err(diff, use_mad)))
    # Candidate steps. The C runs them one after the other: sums, then (if det > 0) the error, then maybe
    # a new min that the next steps use. Each error loop here also accumulates the next step's sums,
    # computed with the current min, so two chains of dependent additions overlap; when the step wins
    # and the min changes, those sums are thrown away and recomputed. Every sum still runs in index
    # order over exactly the C's terms, so the result is the same to the bit.
    iscale = fadd(fadd(rmin, np.float32(0.0)), fnmax) / (mx - mn)
    _qkx_round(n, nmax, x, x_lo, mx, mn, iscale, cur)
    sum_l, sum_l2, sum_xl = _qkx_sums(n, x, w, cur)
    for step in range(nstep + 1):
        have_next = False
        nl = np.float32(0.0)
        nl2 = np.float32(0.0)
        nxl = np.float32(0.0)
        det = fsub(fmul(sum_w, sum_l2), fmul(sum_l, sum_l))
        if det > np.float32(0.0):
            this_scale = fsub(fmul(sum_w, sum_xl), fmul(sum_x, sum_l)) / det
            this_min = fsub(fmul(sum_l2, sum_x), fmul(sum_l, sum_xl)) / det
            if this_min > np.float32(0.0):
                this_min = np.float32(0.0)
                this_scale = sum_xl / sum_l2
            err = np.float32(0.0)
            if step < nstep:
                iscale = fadd(fadd(rmin, fmul(rdelta, np.float32(step + 1))), fnmax) / (mx - mn)
                _qkx_round(n, nmax, x, x_lo, mx, mn, iscale, nxt)
                for i in range(n):
                    diff = fsub(fadd(fmul(this_scale, cur[i]), this_min), x[i])
                    err = fadd(err, fmul(w[i], _qkx_err(diff, use_mad)))
                    wl = fmul(w[i], nxt[i])
                    nl = fadd(nl, wl)
                    nl2 = fadd(nl2, fmul(wl, nxt[i]))
                    nxl = fadd(nxl, fmul(wl, x[i]))
                have_next = True
            else:
                for i in range(n):
                    diff = fsub(fadd(fmul(this_scale, cur[i]), this_min), x[i])
                    err = fadd(err, fmul(w[i], _qkx_err(diff, use_mad)))
            if err < best:
                for i in range(n):
                    L[i] = np.int64(cur[i])
                best = err
                scale = this_scale
                mn = this_min
                have_next = False  # computed with the previous min
        if step < nstep:
            if not have_next:
                iscale = fadd(fadd(rmin, fmul(rdelta, np.float32(step + 1))), fnmax) / (mx - mn)
                _qkx_round(n, nmax, x, x_lo, mx, mn, iscale, nxt)
                nl, nl2, nxl = _qkx_sums(n, x, w, nxt)
            sum_l = nl
            sum_l2 = nl2
            sum_xl = nxl
            cur, nxt = nxt, cur
    return scale, -mn


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def make_qx_quants(n: int, nmax: int, x: np.ndarray, qw: np.ndarray, use_qw: bool, L: np.ndarray,
                   buf: np.ndarray) -> np.float32:
    """``make_qx_quants(n, nmax, x, L, rmse_type=1, qw)``: symmetric fit, used by Q6_K.

    Args:
        n: group size (16 for Q6_K).
        nmax: 32 for Q6_K; quants are ``l + nmax`` with l in [-nmax, nmax-1].
        x: float32[n] weights.
        qw: float32[n] imatrix weights (read only when ``use_qw``; else the weight is x^2).
        use_qw: whether qw is given.
        L: uint8[n] out: quants in [0, 2*nmax).
        buf: float32[4n] scratch.

    Returns:
        The scale (its sign is opposite to the largest-magnitude weight), or 0 for an all-zero group.
    """
    amax = np.float32(0.0)
    mx = np.float32(0.0)
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            mx = x[i]
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return np.float32(0.0)
    # w and w*x do not depend on the candidate scale, and the C's w*x[i]*l is (w*x)*l: computing them
    # once instead of in each of the 19 passes changes no rounding.
    w = buf[:n]
    wx = buf[n:2 * n]
    for i in range(n):
        w[i] = qw[i] if use_qw else fmul(x[i], x[i])
        wx[i] = fmul(w[i], x[i])
    # |iscale*x| <= nmax*(1 + 2^-22) for every candidate scale (|x| <= |mx| and amax >= 1e-15 keeps
    # iscale finite), so round_clamp's range condition always holds here.
    lo = np.float32(-nmax)
    hi = np.float32(nmax - 1)
    fnmax = np.float32(nmax)
    la = buf[2 * n:3 * n]
    lb = buf[3 * n:4 * n]
    # The initial fit (iscale = -nmax/max).
    iscale = np.float32(-nmax) / mx
    for i in range(n):
        la[i] = round_clamp(fmul(iscale, x[i]), lo, hi)
    sumlx = np.float32(0.0)
    suml2 = np.float32(0.0)
    for i in range(n):
        sumlx = fadd(sumlx, fmul(wx[i], la[i]))
        suml2 = fadd(suml2, fmul(fmul(w[i], la[i]), la[i]))
    for i in range(n):
        L[i] = np.int64(la[i]) + nmax
    scale = sumlx / suml2 if suml2 != np.float32(0.0) else np.float32(0.0)
    best = fmul(scale, sumlx)
    # The 18 candidates is = -9..-1, 1..9 do not depend on each other (only the comparison with best is
    # sequential), so their sums are computed two at a time, four independent sequential chains in one
    # loop, and then judged one after the other in the C's order.
    for p in range(9):
        sa = 2 * p - 9 if 2 * p < 9 else 2 * p - 8  # the 2p-th and (2p+1)-th of -9..-1, 1..9
        sb = 2 * p - 8 if 2 * p + 1 < 9 else 2 * p - 7
        isa = -fadd(fnmax, fmul(np.float32(0.1), np.float32(sa))) / mx
        isb = -fadd(fnmax, fmul(np.float32(0.1), np.float32(sb))) / mx
        for i in range(n):
            la[i] = round_clamp(fmul(isa, x[i]), lo, hi)
            lb[i] = round_clamp(fmul(isb, x[i]), lo, hi)
        sxa = np.float32(0.0)
        s2a = np.float32(0.0)
        sxb = np.float32(0.0)
        s2b = np.float32(0.0)
        for i in range(n):
            sxa = fadd(sxa, fmul(wx[i], la[i]))
            s2a = fadd(s2a, fmul(fmul(w[i], la[i]), la[i]))
            sxb = fadd(sxb, fmul(wx[i], lb[i]))
            s2b = fadd(s2b, fmul(fmul(w[i], lb[i]), lb[i]))
        if s2a > np.float32(0.0) and fmul(sxa, sxa) > fmul(best, s2a):
            for i in range(n):
                L[i] = np.int64(la[i]) + nmax
            scale = sxa / s2a
            best = fmul(scale, sxa)
        if s2b > np.float32(0.0) and fmul(sxb, sxb) > fmul(best, s2b):
            for i in range(n):
                L[i] = np.int64(lb[i]) + nmax
            scale = sxb / s2b
            best = fmul(scale, sxb)
    return scale


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def make_qp_quants(n: int, nmax: int, x: np.ndarray, L: np.ndarray, qw: np.ndarray) -> np.float32:
    """``make_qp_quants``: quantize the 8 sub-block scales (or mins) of a super-block, imatrix path only.

    Args:
        n: number of values (8).
        nmax: largest quant (63).
        x: float32[n] values (>= 0 in practice).
        L: uint8[n] out: quants (the C array is ``uint8_t``; stores wrap modulo 256 alike).
        qw: float32[n] weights (the per-sub-block weight sums).

    Returns:
        The fitted scale ``sumlx / suml2``, or 0.
    """
    mx = np.float32(0.0)
    for i in range(n):
        mx = mx if mx > x[i] else x[i]
    if mx < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return np.float32(0.0)
    fnmax = np.float32(nmax)
    iscale = fnmax / mx
    for i in range(n):
        L[i] = nearest_int_full(fmul(iscale, x[i])) & 0xFF  # uint8_t store
    scale = np.float32(1.0) / iscale
    best_mse = np.float32(0.0)
    for i in range(n):
        diff = fsub(x[i], fmul(scale, np.float32(L[i])))
        best_mse = fadd(best_mse, fmul(fmul(qw[i], diff), diff))
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = fadd(fmul(np.float32(0.1), np.float32(step)), fnmax) / mx
        scale_is = np.float32(1.0) / iscale_is
        mse = np.float32(0.0)
        for i in range(n):
            li = min(nmax, nearest_int_full(fmul(iscale_is, x[i])))
            diff = fsub(x[i], fmul(scale_is, np.float32(li)))
            mse = fadd(mse, fmul(fmul(qw[i], diff), diff))
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_is
    sumlx = np.float32(0.0)
    suml2 = np.float32(0.0)
    for i in range(n):
        li = min(nmax, nearest_int_full(fmul(iscale, x[i])))
        L[i] = li & 0xFF
        fl = np.float32(li)
        sumlx = fadd(sumlx, fmul(fmul(qw[i], x[i]), fl))
        suml2 = fadd(suml2, fmul(fmul(qw[i], fl), fl))
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            w = qw[i]
            fli = np.float32(L[i])  # read back through uint8, as the C reads its uint8_t array
            slx = fsub(sumlx, fmul(fmul(w, x[i]), fli))
            sl2 = fsub(suml2, fmul(fmul(w, fli), fli))
            if slx > np.float32(0.0) and sl2 > np.float32(0.0):
                new_l = min(nmax, nearest_int_full(fmul(x[i], sl2) / slx))
                if new_l != np.int64(L[i]):
                    fnl = np.float32(new_l)
                    slx = fadd(slx, fmul(fmul(w, x[i]), fnl))
                    sl2 = fadd(sl2, fmul(fmul(w, fnl), fnl))
                    if fmul(fmul(slx, slx), suml2) > fmul(fmul(sumlx, sumlx), sl2):
                        L[i] = new_l & 0xFF
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2 if suml2 > np.float32(0.0) else np.float32(0.0)


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def make_q3_quants(n: int, nmax: int, x: np.ndarray, L: np.ndarray) -> np.float32:
    """``make_q3_quants(n, nmax, x, L, do_rmse=true)``: symmetric fit with weights x^2, then up to five
    passes that move one quant at a time while the weighted fit improves (Q3_K's reference quantizer).

    Args:
        n: group size (16).
        nmax: 4; quants are ``l + nmax`` with l in [-nmax, nmax-1].
        x: float32[n] weights.
        L: uint8[n] out: quants in [0, 2*nmax) (kept as ``l + nmax`` throughout; the C shifts at the end).

    Returns:
        ``sumlx / suml2``, or 0 (all-zero group, or no positive ``suml2``).
    """
    amax = np.float32(0.0)
    mx = np.float32(0.0)
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            mx = x[i]
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return np.float32(0.0)
    iscale = np.float32(-nmax) / mx
    sumlx = np.float32(0.0)
    suml2 = np.float32(0.0)
    for i in range(n):
        li = max(-nmax, min(nmax - 1, nearest_int_full(fmul(iscale, x[i]))))
        L[i] = li + nmax
        fl = np.float32(li)
        w = fmul(x[i], x[i])
        sumlx = fadd(sumlx, fmul(fmul(w, x[i]), fl))
        suml2 = fadd(suml2, fmul(fmul(w, fl), fl))
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            w = fmul(x[i], x[i])
            li = np.int64(L[i]) - nmax
            fl = np.float32(li)
            slx = fsub(sumlx, fmul(fmul(w, x[i]), fl))
            if slx > np.float32(0.0):
                sl2 = fsub(suml2, fmul(fmul(w, fl), fl))
                new_l = max(-nmax, min(nmax - 1, nearest_int_full(fmul(x[i], sl2) / slx)))
                if new_l != li:
                    fnl = np.float32(new_l)
                    slx = fadd(slx, fmul(fmul(w, x[i]), fnl))
                    sl2 = fadd(sl2, fmul(fmul(w, fnl), fnl))
                    if sl2 > np.float32(0.0) and fmul(fmul(slx, slx), suml2) > fmul(fmul(sumlx, sumlx), sl2):
                        L[i] = new_l + nmax
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2 if suml2 > np.float32(0.0) else np.float32(0.0)


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def get_scale_min_k4(j: int, s: np.ndarray) -> tuple[int, int]:
    """``get_scale_min_k4``: the 6-bit scale and min of sub-block j from the 12 packed bytes ``s``."""
    if j < 4:
        return np.int64(s[j]) & 63, np.int64(s[j + 4]) & 63
    sc = (np.int64(s[j + 4]) & 0xF) | ((np.int64(s[j - 4]) >> 6) << 4)
    m = (np.int64(s[j + 4]) >> 4) | ((np.int64(s[j]) >> 6) << 4)
    return sc, m



# --- CPU only: many groups side by side -------------------------------------------------------------


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def make_qkx_quants_lanes(nl: int, n: int, nmax: int, xt: np.ndarray, wt: np.ndarray, rmin: np.float32,
                          rdelta: np.float32, nstep: int, use_mad: bool, st: np.ndarray, cur: np.ndarray,
                          lf: np.ndarray, bad: np.ndarray) -> None:
    """:func:`make_qkx_quants` on ``nl`` groups of ``n`` at once (CPU only), each group one "lane".

    A single group is a chain of dependent float32 additions (each sum runs in index order), so it is
    bound by add latency. Here the innermost loops run over the lanes, and every lane does exactly the
    scalar function's operations in the same order: LLVM vectorizes those loops across groups without
    changing any rounding. The C's branches become per-lane selects. Instead of copying the quants of
    each winning step, the lane keeps that step's ``iscale`` and min and rounds once more at the end
    (the same values, as round_clamp is a pure function of them).

    Args:
        nl: number of groups.
        n: group size (32 for Q4_K/Q5_K, 16 for Q2_K).
        nmax: largest quant (3, 15 or 31).
        xt: float32[n*nl], weight i of group j at ``i*nl + j``.
        wt: float32[n*nl] importances, same layout.
        rmin, rdelta, nstep, use_mad: the search grid and error, as for :func:`make_qkx_quants`.
        st: float32[>=16, >=nl] scratch; on return row 0 holds the scales and row 1 the mins (``-min``).
        cur: float32[n*nl] scratch.
        lf: float32[n*nl] out: the quants (as floats), same layout.
        bad: int64[>=nl] out: nonzero for a group this function cannot do exactly (constant group, or
            subnormal/huge weights that leave round_clamp's range); its outputs are then meaningless and
            the caller must run :func:`make_qkx_quants` on it.
    """
    zero = np.float32(0.0)
    big = np.float32(1e6)
    fnmax = np.float32(nmax)
    sc = st[0]
    mn = st[1]
    mx = st[2]
    lo = st[3]
    sw = st[4]
    sx = st[5]
    be = st[6]
    isc = st[7]
    sl = st[8]
    sl2 = st[9]
    sxl = st[10]
    ts = st[11]
    tm = st[12]
    err = st[13]
    bis = st[14]
    bmn = st[15]
    for j in range(nl):
        mn[j] = xt[j]
        mx[j] = xt[j]
        sw[j] = wt[j]
        sx[j] = fmul(wt[j], xt[j])
    for i in range(1, n):
        b = i * nl
        for j in range(nl):
            xi = xt[b + j]
            wi = wt[b + j]
            mn[j] = xi if xi < mn[j] else mn[j]
            mx[j] = xi if xi > mx[j] else mx[j]
            sw[j] = fadd(sw[j], wi)
            sx[j] = fadd(sx[j], fmul(wi, xi))
    for j in range(nl):
        lo[j] = mn[j]
        m = zero if mn[j] > zero else mn[j]
        mn[j] = m
        s = fnmax / (mx[j] - m)
        isc[j] = s
        sc[j] = np.float32(1.0) / s
        be[j] = zero
        bis[j] = s
        bmn[j] = m
        # _in_fast_range, without short-circuits so the loop stays branch-free.
        ok = (s > zero) & (fmul(s, mx[j] - m) < big) & (fmul(s, lo[j] - m) > -big) & (mx[j] != m)
        bad[j] = 0 if ok else 1
    for i in range(n):
        b = i * nl
        for j in range(nl):
            xi = xt[b + j]
            lv = round_clamp(fmul(isc[j], xi - mn[j]), zero, fnmax)
            d = fsub(fadd(fmul(sc[j], lv), mn[j]), xi)
            be[j] = fadd(be[j], fmul(wt[b + j], _qkx_err(d, use_mad)))
    for step in range(nstep + 1):
        num = fadd(fadd(rmin, fmul(rdelta, np.float32(step))), fnmax)
        for j in range(nl):
            s = num / (mx[j] - mn[j])
            isc[j] = s
            ok = (s > zero) & (fmul(s, mx[j] - mn[j]) < big) & (fmul(s, lo[j] - mn[j]) > -big)
            bad[j] = bad[j] if ok else 1
            sl[j] = zero
            sl2[j] = zero
            sxl[j] = zero
            err[j] = zero
        for i in range(n):
            b = i * nl
            for j in range(nl):
                xi = xt[b + j]
                lv = round_clamp(fmul(isc[j], xi - mn[j]), zero, fnmax)
                cur[b + j] = lv
                wl = fmul(wt[b + j], lv)
                sl[j] = fadd(sl[j], wl)
                sl2[j] = fadd(sl2[j], fmul(wl, lv))
                sxl[j] = fadd(sxl[j], fmul(wl, xi))
        for j in range(nl):
            det = fsub(fmul(sw[j], sl2[j]), fmul(sl[j], sl[j]))
            t_s = fsub(fmul(sw[j], sxl[j]), fmul(sx[j], sl[j])) / det
            t_m = fsub(fmul(sl2[j], sx[j]), fmul(sl[j], sxl[j])) / det
            pos = t_m > zero
            ts[j] = sxl[j] / sl2[j] if pos else t_s
            tm[j] = zero if pos else t_m
            # The C skips the step when det <= 0: an infinite error never wins.
            err[j] = zero if det > zero else np.float32(np.inf)
        for i in range(n):
            b = i * nl
            for j in range(nl):
                d = fsub(fadd(fmul(ts[j], cur[b + j]), tm[j]), xt[b + j])
                err[j] = fadd(err[j], fmul(wt[b + j], _qkx_err(d, use_mad)))
        for j in range(nl):
            take = err[j] < be[j]
            be[j] = err[j] if take else be[j]
            sc[j] = ts[j] if take else sc[j]
            bis[j] = isc[j] if take else bis[j]
            bmn[j] = mn[j] if take else bmn[j]
            mn[j] = tm[j] if take else mn[j]
    for i in range(n):
        b = i * nl
        for j in range(nl):
            lf[b + j] = round_clamp(fmul(bis[j], xt[b + j] - bmn[j]), zero, fnmax)
    for j in range(nl):
        mn[j] = -mn[j]
