"""Q3_K quantization for the CPU kernel, many super-blocks at once (CPU only).

:func:`q3k_chunk` quantizes a run of super-blocks with the same bytes as ggml's ``quantize_row_q3_K_ref``
(no imatrix) or ``quantize_row_q3_K_impl`` (with one; ggml-quants.c). The 16 sub-block fits of every
block (``make_q3_quants``: :func:`_q3_lanes`; ``make_qx_quants``: :func:`qx_lanes`) run side by side, one
sub-block per "lane", each lane doing the C's float32 operations in the C's order, so LLVM vectorizes
across sub-blocks without changing a rounding; the imatrix path fits the 16 scales of all blocks side by
side the same way. The scale bytes, requantization and packing follow block by block.
:func:`ggufkit.quant.kernels.kquants.cpu_low.quantize_rows_q3_K` calls it; the per-block functions there (also
compiled for CUDA) stay the reference, and run on blocks the lanes cannot do exactly (reference path,
extreme weights; see ``bad``).

Layout: lane ``16*k + j`` is sub-block j of the chunk's k-th block; weight i of a lane sits at
``i*nl + lane`` (``nl`` lanes), so each loop over lanes reads and writes contiguous memory.

Written for LLVM's loop vectorizer (measured on a Xeon with AVX-512): no store in a lane loop keeps an old
value (it becomes a masked store, and loading it back in the next row stalls: running values go back and
forth between two arrays instead); lane loops index row slices (an index from ``range`` is known not to be
negative, so there is no wraparound branch); no function taking arrays is called per block (each call
counts references).
"""

from __future__ import annotations

import numba
import numpy as np

from ggufkit.quant.kernels.fp import fadd, fmul, fp16_to_fp32, fp32_to_fp16_x86, fsub
from ggufkit.quant.kernels.kquants.subroutines import GROUP_MAX_EPS, nearest_int_full, round_clamp

QK_K = 256
Q3_K_BYTES = 110
#: Rows of :func:`q3k_chunk`'s float32 scratch per lane (``SCRATCH_ROWS * nl`` floats).
SCRATCH_ROWS = 81

_LO = np.float32(-4.0)  # make_q3_quants(16, 4, ...): quants l in [-4, 3]
_HI = np.float32(3.0)
_FLAG = np.float32(1000.0)  # added to a lane's change count when it leaves round_clamp's exact range


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _lane_absmax(xt: np.ndarray, nl: int, amax: np.ndarray, mx: np.ndarray, ta: np.ndarray,
                 tb: np.ndarray) -> None:
    """Per lane, the largest |x| of its 16 weights into ``amax`` and that x into ``mx`` (the C keeps the first
    of equal ones: strict >). A select per lane, going back and forth between (amax, mx) and the scratch
    pair (ta, tb) as in _q3_pass: the last of the 16 rows writes amax, mx."""
    zero = np.float32(0.0)
    for j in range(nl):
        amax[j] = zero
        mx[j] = zero
    for i in range(16):
        xr = xt[i * nl:]
        if i % 2 == 0:
            ai, mi, ao, mo = amax, mx, ta, tb
        else:
            ai, mi, ao, mo = ta, tb, amax, mx
        for j in range(nl):
            xi = xr[j]
            ax = abs(xi)
            a0 = ai[j]
            take = ax > a0
            ao[j] = ax if take else a0
            mo[j] = xi if take else mi[j]


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _q3_pass(nl: int, stride: int, xt: np.ndarray, lf: np.ndarray, sumlx: np.ndarray, suml2: np.ndarray,
             tx: np.ndarray, t2: np.ndarray, alive: np.ndarray, nch: np.ndarray, bad: np.ndarray) -> int:
    # One refinement pass of make_q3_quants (its ``for itry`` loop body) over lanes 0..nl-1, rows ``stride``
    # apart. A lane with ``alive`` 0 has stopped (the C's break) and is left as it is. Returns how many
    # lanes changed a quant, which stay alive. tx, t2: scratch like sumlx, suml2.
    zero = np.float32(0.0)
    one = np.float32(1.0)
    for j in range(nl):
        nch[j] = zero
    for i in range(16):
        # (Row slices: an index j from range(nl) is known not to be negative, so there is no wraparound
        # branch and LLVM vectorizes the loop; so does its keeping to few written arrays.)
        xr = xt[i * stride:]
        lr = lf[i * stride:]
        # The sums go back and forth between two pairs of arrays, every store unconditional: a store that
        # keeps the old value becomes a masked store, and a load from a masked store (the next row's) stalls.
        # 16 rows: the last row writes sumlx, suml2.
        if i % 2 == 0:
            sxi, s2i, sxo, s2o = sumlx, suml2, tx, t2
        else:
            sxi, s2i, sxo, s2o = tx, t2, sumlx, suml2
        for j in range(nl):
            xi = xr[j]
            fl = lr[j]
            sx0 = sxi[j]
            s20 = s2i[j]
            w = fmul(xi, xi)
            wx = fmul(w, xi)
            slx = fsub(sx0, fmul(wx, fl))
            sl2 = fsub(s20, fmul(fmul(w, fl), fl))
            v = fmul(xi, sl2) / slx
            act = (alive[j] > zero) & (slx > zero)
            ok = abs(v) < np.float32(4e6)
            new = round_clamp(v if ok else zero, _LO, _HI)
            slx2 = fadd(slx, fmul(wx, new))
            sl22 = fadd(sl2, fmul(fmul(w, new), new))
            acc = (act & ok & (new != fl) & (sl22 > zero)
                   & (fmul(fmul(slx2, slx2), s20) > fmul(fmul(sx0, sx0), sl22)))
            lr[j] = new if acc else fl
            sxo[j] = slx2 if acc else sx0
            s2o[j] = sl22 if acc else s20
            nch[j] = fadd(nch[j], one if acc else (_FLAG if act & (not ok) else zero))
    n_alive = 0
    for j in range(nl):
        bad[j] = one if nch[j] >= _FLAG else bad[j]
        a = (alive[j] > zero) & (nch[j] > zero)
        alive[j] = one if a else zero
        n_alive += a
    return n_alive


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _q3_lanes(nl: int, xt: np.ndarray, lf: np.ndarray, ls: np.ndarray, sc: np.ndarray) -> None:
    # make_q3_quants(16, 4, x, L, true) on nl lanes (ggml-quants.c): on return lf holds each lane's quants
    # l in [-4, 3] (as floats, before the C's final ``L[i] += nmax``; an all-zero lane's are meaningless),
    # sc[j] its scale, ls row 0 its largest |x| and row 7 its ``bad`` flag: 1 where a candidate
    # ``x*sl2/slx`` left round_clamp's exact range (|v| >= 4e6, NaN), whose outputs are then meaningless
    # (the caller takes the scalar function instead). ls: float32[>=16, >=nl] scratch; xt, lf: float32[32*nl],
    # the second halves for the compacted lanes of the later passes.
    zero = np.float32(0.0)
    one = np.float32(1.0)
    amax = ls[0]
    mx = ls[1]
    sumlx = ls[2]
    suml2 = ls[3]
    alive = ls[4]
    nch = ls[5]
    isc = ls[6]
    bad = ls[7]
    tx = ls[8]
    t2 = ls[9]
    for j in range(nl):
        bad[j] = zero
    _lane_absmax(xt, nl, amax, mx, tx, t2)
    for j in range(nl):
        isc[j] = _LO / mx[j] if amax[j] >= GROUP_MAX_EPS else zero  # an all-zero lane then stops at once
        sumlx[j] = zero
        suml2[j] = zero
        alive[j] = one
    for i in range(16):
        xr = xt[i * nl:]
        lr = lf[i * nl:]
        for j in range(nl):
            xi = xr[j]
            li = round_clamp(fmul(isc[j], xi), _LO, _HI)  # |iscale*x| <= nmax: the exact range
            lr[j] = li
            w = fmul(xi, xi)
            sumlx[j] = fadd(sumlx[j], fmul(fmul(w, xi), li))
            suml2[j] = fadd(suml2[j], fmul(fmul(w, li), li))
    # The first pass runs over every lane; after it about 80 % of the lanes of random weights have stopped
    # (14 % stop after the second pass, 4 % after the third). The later passes run on the lanes still
    # changing, copied side by side and squeezed together again after each pass; a lane that stops is copied
    # back when it is squeezed out or at the end.
    na = _q3_pass(nl, nl, xt, lf, sumlx, suml2, tx, t2, alive, nch, bad)
    if na > 0:
        stride = na
        xc = xt[16 * nl:]
        lc = lf[16 * nl:]
        csx = ls[10]
        cs2 = ls[11]
        cal = ls[12]
        cnch = ls[13]
        cbad = ls[14]
        idx = ls[15]  # lane numbers, exact as float32 (nl < 2^24)
        k = 0
        for j in range(nl):
            if alive[j] > zero:
                idx[k] = np.float32(j)
                k += 1
        for i in range(16):
            for k in range(na):
                xc[i * stride + k] = xt[i * nl + np.int64(idx[k])]
                lc[i * stride + k] = lf[i * nl + np.int64(idx[k])]
        for k in range(na):
            j = np.int64(idx[k])
            csx[k] = sumlx[j]
            cs2[k] = suml2[j]
            cal[k] = one
            cbad[k] = zero
        n_pass = 1
        while True:
            n_alive = _q3_pass(na, stride, xc, lc, csx, cs2, tx, t2, cal, cnch, cbad)
            n_pass += 1
            last = n_alive == 0 or n_pass == 5
            if n_alive == na and not last:
                continue
            # Copy the lanes that stopped back (all of them after the last pass), squeeze the others.
            m = 0
            for k in range(na):
                j = np.int64(idx[k])
                if last or cal[k] == zero:
                    for i in range(16):
                        lf[i * nl + j] = lc[i * stride + k]
                    sumlx[j] = csx[k]
                    suml2[j] = cs2[k]
                    bad[j] = cbad[k]
                else:
                    if m != k:
                        for i in range(16):
                            xc[i * stride + m] = xc[i * stride + k]
                            lc[i * stride + m] = lc[i * stride + k]
                        csx[m] = csx[k]
                        cs2[m] = cs2[k]
                        cbad[m] = cbad[k]
                        idx[m] = idx[k]
                    cal[m] = one
                    m += 1
            if last:
                break
            na = m
    for j in range(nl):
        s = sumlx[j] / suml2[j] if suml2[j] > zero else zero
        sc[j] = zero if amax[j] < GROUP_MAX_EPS else s


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def gather_lanes(x: np.ndarray, t0: int, nblk: int, xt: np.ndarray) -> None:
    """Blocks ``t0 .. t0+nblk-1`` of ``x`` (float32[n_rows, n_per_row], block t at row ``t // nb``, column
    ``256*(t % nb)``) in lane order: weight i of sub-block j of the k-th block at ``xt[i*nl + 16*k + j]``,
    ``nl = 16*nblk`` (Q3_K's and Q6_K's 16-weight sub-blocks fitted side by side)."""
    nb = x.shape[1] // QK_K
    nl = 16 * nblk
    for k in range(nblk):
        t = t0 + k
        r = t // nb
        b = t - r * nb
        xb = x[r, b * QK_K:(b + 1) * QK_K]
        for i in range(16):  # (a 16-wide write per weight index: the fastest form of this transposition)
            o = xt[i * nl + 16 * k:i * nl + 16 * k + 16]
            for j in range(16):
                o[j] = xb[16 * j + i]


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def q3k_chunk(x: np.ndarray, qw: np.ndarray, out: np.ndarray, t0: int, nblk: int, buf: np.ndarray,
              bad: np.ndarray) -> None:
    """Q3_K quantization of blocks ``t0 .. t0+nblk-1`` of ``x``, as ``quantize_row_q3_K_ref`` (``qw`` of
    length 0) or ``quantize_row_q3_K_impl`` (``qw`` the imatrix row) quantize them.

    Block t is ``x[t // nb, 256*(t % nb):][:256]`` with ``nb = x.shape[1] // 256``; its 110 bytes go to
    the same place of ``out``.

    Args:
        x: float32[n_rows, n_per_row] weights.
        qw: float32[n_per_row] imatrix, or float32[0].
        out: uint8[n_rows, n_per_row / 256 * 110].
        t0: first block.
        nblk: number of blocks (lanes: ``nl = 16 * nblk``).
        buf: float32[>= SCRATCH_ROWS * nl] scratch.
        bad: int64[>= nblk] out: 1 for a block the lanes cannot do exactly (reference path only; its bytes
            are not written: the caller runs the scalar block function on it), else 0.
    """
    nb = x.shape[1] // QK_K
    nl = 16 * nblk
    use_qw = qw.shape[0] > 0
    xt = buf[:32 * nl]  # weights (and, reference path, the compacted lanes' weights from 16*nl on)
    lf = buf[32 * nl:64 * nl]
    ls2 = buf[64 * nl:81 * nl].reshape((17, nl))  # per-lane values of the fit
    gather_lanes(x, t0, nblk, xt)
    ls = np.empty((nblk, 16), np.int64)  # the 6-bit scales (0..63) of each block
    d16s = np.empty(nblk, np.int64)
    if use_qw:
        _imatrix_fits(nl, nblk, t0, nb, qw, buf, ls, d16s)
        off = 0  # qx_lanes' quants are L already (0 for an all-zero lane)
    else:
        sc = ls2[16]
        _q3_lanes(nl, xt, lf, ls2, sc)
        off = 4
        for k in range(nblk):
            # quantize_row_q3_K_ref: the 16 scales to 6 bits against the one of largest |scale| (first of
            # equals), and the f16 super-scale.
            max_scale = np.float32(0.0)
            amx = np.float32(0.0)
            for j in range(16):
                a = abs(sc[16 * k + j])
                if a > amx:
                    amx = a
                    max_scale = sc[16 * k + j]
            if max_scale != np.float32(0.0):
                iscale = np.float32(-32.0) / max_scale
                for j in range(16):
                    # int8_t l = nearest_int(iscale*scales[j]), clamped to [-32, 31]
                    li = ((nearest_int_full(fmul(iscale, sc[16 * k + j])) + 128) & 0xFF) - 128
                    ls[k, j] = max(-32, min(31, li)) + 32
                d16s[k] = fp32_to_fp16_x86(np.float32(1.0) / iscale)
            else:
                for j in range(16):
                    ls[k, j] = 0
                d16s[k] = 0
    amax = ls2[0]
    badl = ls2[7]
    L = np.empty(QK_K, np.uint8)
    # The rest, block by block (in this loop, not a function taking arrays: each call would count
    # references to them): the scale bytes, the requantization with the 6-bit scales and the f16
    # super-scale, the high-bit mask and the 2-bit packing (the same code in both of ggml's functions).
    for k in range(nblk):
        n_bad = 0
        if not use_qw:
            for j in range(16):
                n_bad += badl[16 * k + j] > np.float32(0.0)
        bad[k] = 1 if n_bad > 0 else 0
        if n_bad > 0:
            continue
        t = t0 + k
        r = t // nb
        b = t - r * nb
        xb = x[r, b * QK_K:(b + 1) * QK_K]
        ob = out[r, b * Q3_K_BYTES:(b + 1) * Q3_K_BYTES]
        lsk = ls[k]
        d16 = d16s[k]
        for j in range(8):  # the 12 scale bytes, ORed together from zero as the C does
            ob[96 + j] = (lsk[j] & 0xF) | ((lsk[8 + j] & 0xF) << 4)
        for j in range(4):
            ob[104 + j] = ((lsk[j] >> 4) | ((lsk[4 + j] >> 4) << 2) | ((lsk[8 + j] >> 4) << 4)
                           | ((lsk[12 + j] >> 4) << 6))
        ob[108] = d16 & 0xFF
        ob[109] = (d16 >> 8) & 0xFF
        d = fp16_to_fp32(d16)
        for j in range(16):
            dj = fmul(d, np.float32(lsk[j] - 32))
            if dj == np.float32(0.0):  # the C skips the sub-block: it keeps the fit's L (0 if all zero)
                z = (not use_qw) and amax[16 * k + j] < GROUP_MAX_EPS
                for i in range(16):
                    L[16 * j + i] = 0 if z else np.int64(lf[i * nl + 16 * k + j]) + off
                continue
            # round_clamp is nearest_int clamped to [-4, 3] where |x/dj| < 2^22 (NaN clamps to -4: no
            # poison); a sub-block with any quotient outside takes the exact bit-trick path instead.
            n_ok = 0
            for i in range(16):
                vi = xb[16 * j + i] / dj
                n_ok += 1 if abs(vi) < np.float32(4e6) else 0
                L[16 * j + i] = np.int64(round_clamp(vi, _LO, _HI)) + 4
            if n_ok != 16:
                for i in range(16):
                    L[16 * j + i] = max(-4, min(3, nearest_int_full(xb[16 * j + i] / dj))) + 4
        for m in range(32):  # the high bit of quant e goes to bit e // 32 of hmask[e % 32]
            ob[m] = ((L[m] >> 2) | ((L[32 + m] >> 2) << 1) | ((L[64 + m] >> 2) << 2) | ((L[96 + m] >> 2) << 3)
                     | ((L[128 + m] >> 2) << 4) | ((L[160 + m] >> 2) << 5) | ((L[192 + m] >> 2) << 6)
                     | ((L[224 + m] >> 2) << 7))
        for h in range(2):  # qs[32h + l]: the low 2 bits of quants 128h + l + 32s in bits 2s
            for m in range(32):
                e = 128 * h + m
                ob[32 + 32 * h + m] = ((L[e] & 3) | ((L[e + 32] & 3) << 2) | ((L[e + 64] & 3) << 4)
                                       | ((L[e + 96] & 3) << 6))


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _imatrix_fits(nl: int, nblk: int, t0: int, nb: int, qw: np.ndarray, buf: np.ndarray, ls: np.ndarray,
                  d16s: np.ndarray) -> None:
    # quantize_row_q3_K_impl up to the packing: the weights qw*sqrt(sigma2 + x^2) and their sums per
    # sub-block, make_qx_quants(16, 4, ...) on every sub-block (lanes, into lf: L already shifted), then
    # make_qx_quants(16, 32, scales, Ls, 1, sw) on the 16 scales of every block, the blocks side by side
    # (lane k is block k, its "weight" j sub-block j): ls[k] gets Ls, d16s[k] the f16 of d_block.
    # buf as q3k_chunk lays it out: x in lane order at 0, lf at 32*nl.
    xt = buf[:16 * nl]
    wt = buf[16 * nl:32 * nl]
    lf = buf[32 * nl:48 * nl]
    wxt = buf[48 * nl:64 * nl]
    st = buf[64 * nl:76 * nl].reshape((12, nl))
    sw = buf[76 * nl:77 * nl]
    sig = buf[77 * nl:78 * nl]
    s2 = buf[78 * nl:78 * nl + nblk]
    # The second fit's 16 values of nblk lanes (nl = 16*nblk each), where wt was.
    xs = buf[16 * nl:17 * nl]
    ws = buf[17 * nl:18 * nl]
    wxs = buf[18 * nl:19 * nl]
    lfs = buf[19 * nl:20 * nl]
    st2 = buf[20 * nl:20 * nl + 12 * nblk].reshape((12, nblk))
    # sigma2 = 2*sum(x^2)/256 per block, each sum in index order; the blocks as independent chains.
    for k in range(nblk):
        s2[k] = np.float32(0.0)
    for j in range(16):
        for i in range(16):
            xr = xt[i * nl + j:]
            for k in range(nblk):
                xi = xr[16 * k]
                s2[k] = fadd(s2[k], fmul(xi, xi))
    for k in range(nblk):
        sg = fmul(np.float32(2.0), s2[k]) / np.float32(256.0)
        for j in range(16):
            sig[16 * k + j] = sg
            sw[16 * k + j] = np.float32(0.0)
    for k in range(nblk):  # the imatrix slice of each block into lane order, like x
        b = (t0 + k) % nb
        qb = qw[b * QK_K:(b + 1) * QK_K]
        for i in range(16):
            o = wt[i * nl + 16 * k:i * nl + 16 * k + 16]
            for j in range(16):
                o[j] = qb[16 * j + i]
    for i in range(16):
        xr = xt[i * nl:]
        wr = wt[i * nl:]
        wxr = wxt[i * nl:]
        for j in range(nl):
            xi = xr[j]
            w = fmul(wr[j], np.sqrt(fadd(sig[j], fmul(xi, xi))))  # sqrtf: correctly rounded either way
            wr[j] = w
            wxr[j] = fmul(w, xi)
            sw[j] = fadd(sw[j], w)
    qx_lanes(nl, 4, xt, wt, wxt, st, lf)
    # The second fit: 16 "weights" (the scales) per block, lanes = blocks.
    for j in range(16):
        for k in range(nblk):
            v = st[0, 16 * k + j]
            w = sw[16 * k + j]
            xs[j * nblk + k] = v
            ws[j * nblk + k] = w
            wxs[j * nblk + k] = fmul(w, v)
    qx_lanes(nblk, 32, xs, ws, wxs, st2, lfs)
    for k in range(nblk):
        d16s[k] = fp32_to_fp16_x86(st2[0, k])
        for j in range(16):
            ls[k, j] = np.int64(lfs[j * nblk + k])


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def qx_lanes(nl: int, nmax: int, xt: np.ndarray, wt: np.ndarray, wxt: np.ndarray, st: np.ndarray,
              lf: np.ndarray) -> None:
    # make_qx_quants(16, nmax, x, L, 1, w) (kquants_math.make_qx_quants, ggml-quants.c) on nl lanes:
    # xt/wt/wxt hold x, w and w*x of weight i of lane j at i*nl + j; on return st[0] holds the scales (0 for
    # an all-zero lane) and lf the quants L = l + nmax (0 for an all-zero lane), as floats. Each lane does
    # the scalar function's float32 operations in its order (every sum in index order; the C's branches
    # become selects; the winning trial's iscale is kept and the quants rounded once more at the end), so
    # LLVM vectorizes across lanes without changing a rounding. The 18 trial scales go two to a pass over
    # the weights, which then loads each weight once for both, and the maxima take no masked stores (as
    # _q3_lanes). round_clamp's range always holds (|iscale*x| <= nmax + 1). st: float32[>=12, >=nl] scratch.
    zero = np.float32(0.0)
    lo = np.float32(-nmax)
    hi = np.float32(nmax - 1)
    fnmax = np.float32(nmax)
    sc = st[0]
    amax = st[1]
    mx = st[2]
    be = st[3]
    bis = st[4]
    sxa = st[5]
    s2a = st[6]
    isa = st[7]
    sxb = st[8]
    s2b = st[9]
    isb = st[10]
    ta = st[11]
    _lane_absmax(xt, nl, amax, mx, ta, sxa)
    for j in range(nl):
        isa[j] = lo / mx[j]
        sxa[j] = zero
        s2a[j] = zero
    for i in range(16):
        xr = xt[i * nl:]
        wr = wt[i * nl:]
        wxr = wxt[i * nl:]
        for j in range(nl):
            lv = round_clamp(fmul(isa[j], xr[j]), lo, hi)
            sxa[j] = fadd(sxa[j], fmul(wxr[j], lv))
            s2a[j] = fadd(s2a[j], fmul(fmul(wr[j], lv), lv))
    for j in range(nl):
        s = sxa[j] / s2a[j] if s2a[j] != zero else zero
        sc[j] = s
        be[j] = fmul(s, sxa[j])
        bis[j] = isa[j]
    for p in range(9):  # the C's is = -9..-1, 1..9, judged in that order
        va = 2 * p - 9 if 2 * p < 9 else 2 * p - 8
        vb = 2 * p - 8 if 2 * p + 1 < 9 else 2 * p - 7
        na = -fadd(fnmax, fmul(np.float32(0.1), np.float32(va)))
        nb_ = -fadd(fnmax, fmul(np.float32(0.1), np.float32(vb)))
        for j in range(nl):
            isa[j] = na / mx[j]
            isb[j] = nb_ / mx[j]
            sxa[j] = zero
            s2a[j] = zero
            sxb[j] = zero
            s2b[j] = zero
        for i in range(16):
            xr = xt[i * nl:]
            wr = wt[i * nl:]
            wxr = wxt[i * nl:]
            for j in range(nl):
                xi = xr[j]
                wi = wr[j]
                wxi = wxr[j]
                la = round_clamp(fmul(isa[j], xi), lo, hi)
                lb = round_clamp(fmul(isb[j], xi), lo, hi)
                sxa[j] = fadd(sxa[j], fmul(wxi, la))
                s2a[j] = fadd(s2a[j], fmul(fmul(wi, la), la))
                sxb[j] = fadd(sxb[j], fmul(wxi, lb))
                s2b[j] = fadd(s2b[j], fmul(fmul(wi, lb), lb))
        for j in range(nl):
            take = (s2a[j] > zero) & (fmul(sxa[j], sxa[j]) > fmul(be[j], s2a[j]))
            s = sxa[j] / s2a[j]
            sc[j] = s if take else sc[j]
            be[j] = fmul(s, sxa[j]) if take else be[j]
            bis[j] = isa[j] if take else bis[j]
            take = (s2b[j] > zero) & (fmul(sxb[j], sxb[j]) > fmul(be[j], s2b[j]))
            s = sxb[j] / s2b[j]
            sc[j] = s if take else sc[j]
            be[j] = fmul(s, sxb[j]) if take else be[j]
            bis[j] = isb[j] if take else bis[j]
    for j in range(nl):
        sc[j] = zero if amax[j] < GROUP_MAX_EPS else sc[j]
    for i in range(16):
        xr = xt[i * nl:]
        lr = lf[i * nl:]
        for j in range(nl):
            lv = fadd(round_clamp(fmul(bis[j], xr[j]), lo, hi), fnmax)
            lr[j] = zero if amax[j] < GROUP_MAX_EPS else lv
