"""Low-bit K-quant kernels (Q2_K, Q3_K): Numba CPU quantize/dequantize, byte-identical to ggml.

Block layouts (ggml-common.h: ``block_q2_K``, ``block_q3_K``; f16 fields little-endian):

* Q2_K, 256 weights in 84 bytes: ``scales[16]`` @0 (low nibble: 4-bit scale, high nibble: 4-bit min of
  each 16-weight sub-block), ``qs[64]`` @16 (2-bit quants: byte ``32h + l`` holds element ``128h + 32s + l``
  in bits ``2s..2s+1``), ``d`` f16 @80, ``dmin`` f16 @82.
* Q3_K, 256 weights in 110 bytes: ``hmask[32]`` @0 (bit ``j // 32`` of byte ``j % 32`` is bit 2 of quant
  j), ``qs[64]`` @32 (low 2 bits, packed as Q2_K), ``scales[12]`` @96 (16 six-bit scales: low nibbles in
  bytes 0..7, high 2 bits in bytes 8..11), ``d`` f16 @108.

Quantization follows ``ggml_quantize_chunk``: without an imatrix (``qw`` of length 0)
``quantize_row_q2_K_ref`` / ``quantize_row_q3_K_ref``; with one, ``quantize_row_q2_K_impl`` /
``quantize_row_q3_K_impl`` (ggml-quants.c). The per-block functions (``*_block``) are plain ``@numba.njit``
functions over one block, run by the ``prange`` kernels below and, recompiled, by
:mod:`ggufkit.quant.kernels.lowbit.cuda`; the CPU kernel of Q3_K quantizes most blocks with the CPU-only
:mod:`ggufkit.quant.kernels.kquants.q3k_chunk` (same bytes). A block's bytes depend only on its own weights and imatrix
slice, so the thread count cannot change the output.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ggufkit.quant.kernels.fp import fadd, fmul, fp16_to_fp32, fp32_to_fp16_x86, fsub
from ggufkit.quant.kernels.kquants.q3k_chunk import SCRATCH_ROWS, q3k_chunk
from ggufkit.quant.kernels.kquants.subroutines import (
    make_q3_quants,
    make_qkx_quants,
    make_qkx_quants_lanes,
    make_qp_quants,
    make_qx_quants,
    nearest_int_full,
    round_clamp,
)

QK_K = 256
Q2_K_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.Q2_K][1]  # 84
Q3_K_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.Q3_K][1]  # 110

#: Blocks per prange iteration: amortizes the scratch allocation; has no effect on the bytes.
_CHUNK = 16


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _c_int8(v: int) -> int:
    # A C store into int8_t: the low 8 bits, read back signed.
    return ((v + 128) & 0xFF) - 128


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _store_f16(out: np.ndarray, off: int, h: int) -> None:
    out[off] = h & 0xFF
    out[off + 1] = (h >> 8) & 0xFF


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _load_f16(blk: np.ndarray, off: int) -> np.float32:
    return fp16_to_fp32(np.int64(blk[off]) | (np.int64(blk[off + 1]) << 8))


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _pack_2bit(L: np.ndarray, qs: np.ndarray) -> None:
    # qs[j/4 + l] = L[j+l] | L[j+l+32] << 2 | L[j+l+64] << 4 | L[j+l+96] << 6, j = 0, 128 (Q2_K and Q3_K).
    for h in range(2):
        for i in range(32):
            e = 128 * h + i
            qs[32 * h + i] = (np.int64(L[e]) | (np.int64(L[e + 32]) << 2) | (np.int64(L[e + 64]) << 4)
                              | (np.int64(L[e + 96]) << 6)) & 0xFF


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _row_sigma2_sum(x: np.ndarray) -> np.float32:
    # sum of x^2 over the super-block, in index order.
    s = np.float32(0.0)
    for i in range(QK_K):
        s = fadd(s, fmul(x[i], x[i]))
    return s


# --- Q2_K -----------------------------------------------------------------------------------------------


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def q2k_quantize_block(x: np.ndarray, qw: np.ndarray, use_qw: bool, out: np.ndarray, L: np.ndarray,
                       Laux: np.ndarray, w: np.ndarray, scales: np.ndarray, mins: np.ndarray, sw: np.ndarray,
                       Ls: np.ndarray, Lm: np.ndarray) -> None:
    """Quantize one 256-weight super-block to Q2_K (``quantize_row_q2_K_ref`` / ``quantize_row_q2_K_impl``).

    Args:
        x: float32[256] weights.
        qw: float32[256] imatrix slice (read only when ``use_qw``).
        use_qw: True for the imatrix path.
        out: uint8[84], written in full.
        L, Laux, w, scales, mins, sw, Ls, Lm: scratch (uint8[256], float32[32], float32[16], float32[16] x3,
            uint8[16] x2).
    """
    if use_qw:
        sigma2 = _row_sigma2_sum(x) / np.float32(256.0)
        for j in range(16):
            xs = x[16 * j:16 * j + 16]
            sumw = np.float32(0.0)
            for i in range(16):
                w[i] = fmul(qw[16 * j + i], np.float32(math.sqrt(fadd(sigma2, fmul(xs[i], xs[i])))))
                sumw = fadd(sumw, w[i])
            sw[j] = sumw
            scales[j], mins[j] = make_qkx_quants(16, 3, xs, w, L[16 * j:16 * j + 16], Laux,
                                                 np.float32(-0.9), np.float32(0.05), 36, False)
    else:
        for j in range(16):
            xs = x[16 * j:16 * j + 16]
            for i in range(16):
                w[i] = abs(xs[i])
            scales[j], mins[j] = make_qkx_quants(16, 3, xs, w, L[16 * j:16 * j + 16], Laux,
                                                 np.float32(-0.5), np.float32(0.1), 15, True)
    _q2k_finish_block(use_qw, x, out, L, scales, mins, sw, Ls, Lm)


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _q2k_finish_block(use_qw: bool, x: np.ndarray, out: np.ndarray, L: np.ndarray, scales: np.ndarray,
                      mins: np.ndarray, sw: np.ndarray, Ls: np.ndarray, Lm: np.ndarray) -> None:
    # Everything after the 16 sub-block fits (in L, scales, mins, and for the imatrix path sw): super-scales,
    # requantization and packing. Shared by the scalar block function (CPU and CUDA) and the CPU kernel that
    # fits many sub-blocks side by side.
    if use_qw:
        dm = make_qp_quants(16, 15, scales, Ls, sw)
        mm = make_qp_quants(16, 15, mins, Lm, sw)
        d16 = fp32_to_fp16_x86(dm)
        m16 = fp32_to_fp16_x86(mm)
        for j in range(16):
            out[j] = (np.int64(Ls[j]) | (np.int64(Lm[j]) << 4)) & 0xFF
    else:
        max_scale = np.float32(0.0)
        max_min = np.float32(0.0)
        for j in range(16):
            if scales[j] > max_scale:
                max_scale = scales[j]
            if mins[j] > max_min:
                max_min = mins[j]
        if max_scale > np.float32(0.0):
            iscale = np.float32(15.0) / max_scale
            for j in range(16):
                out[j] = nearest_int_full(fmul(iscale, scales[j])) & 0xFF
            d16 = fp32_to_fp16_x86(max_scale / np.float32(15.0))
        else:
            for j in range(16):
                out[j] = 0
            d16 = 0
        if max_min > np.float32(0.0):
            iscale = np.float32(15.0) / max_min
            for j in range(16):
                out[j] = (np.int64(out[j]) | (nearest_int_full(fmul(iscale, mins[j])) << 4)) & 0xFF
            m16 = fp32_to_fp16_x86(max_min / np.float32(15.0))
        else:
            m16 = 0
    _store_f16(out, 80, d16)
    _store_f16(out, 82, m16)
    # Requantize with the f16-rounded super-scales; a sub-block whose scale decodes to 0 keeps its fit.
    d = fp16_to_fp32(d16)
    dmin = fp16_to_fp32(m16)
    for j in range(16):
        sc = np.int64(out[j])
        dj = fmul(d, np.float32(sc & 0xF))
        if dj == np.float32(0.0):
            continue
        dm_j = fmul(dmin, np.float32(sc >> 4))
        for i in range(16):
            L[16 * j + i] = max(0, min(3, nearest_int_full(fadd(x[16 * j + i], dm_j) / dj)))
    _pack_2bit(L, out[16:80])


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def q2k_dequantize_block(blk: np.ndarray, y: np.ndarray) -> None:
    """``dequantize_row_q2_K`` for one block: ``(d*sc) * q - dmin*m`` per 16-weight sub-block."""
    d = _load_f16(blk, 80)
    dmin = _load_f16(blk, 82)
    for h in range(2):
        for s in range(4):
            for half in range(2):
                sc = np.int64(blk[8 * h + 2 * s + half])
                dl = fmul(d, np.float32(sc & 0xF))
                ml = fmul(dmin, np.float32(sc >> 4))
                for i in range(16):
                    q = (np.int64(blk[16 + 32 * h + 16 * half + i]) >> (2 * s)) & 3
                    y[128 * h + 32 * s + 16 * half + i] = fsub(fmul(dl, np.float32(q)), ml)


# --- Q3_K -----------------------------------------------------------------------------------------------


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def q3k_quantize_block(x: np.ndarray, qw: np.ndarray, use_qw: bool, out: np.ndarray, L: np.ndarray,
                       w: np.ndarray, scales: np.ndarray, sw: np.ndarray, Ls: np.ndarray,
                       buf: np.ndarray) -> None:
    """Quantize one 256-weight super-block to Q3_K (``quantize_row_q3_K_ref`` / ``quantize_row_q3_K_impl``).

    Args:
        x: float32[256] weights.
        qw: float32[256] imatrix slice (read only when ``use_qw``).
        use_qw: True for the imatrix path.
        out: uint8[110], written in full.
        L, w, scales, sw, Ls, buf: scratch (uint8[256], float32[16] x3, uint8[16], float32[64]).
    """
    if use_qw:
        sigma2 = fmul(np.float32(2.0), _row_sigma2_sum(x)) / np.float32(256.0)
        for j in range(16):
            xs = x[16 * j:16 * j + 16]
            sumw = np.float32(0.0)
            for i in range(16):
                w[i] = fmul(qw[16 * j + i], np.float32(math.sqrt(fadd(sigma2, fmul(xs[i], xs[i])))))
                sumw = fadd(sumw, w[i])
            sw[j] = sumw
            scales[j] = make_qx_quants(16, 4, xs, w, True, L[16 * j:16 * j + 16], buf)
    else:
        for j in range(16):
            scales[j] = make_q3_quants(16, 4, x[16 * j:16 * j + 16], L[16 * j:16 * j + 16])
    _q3k_finish_block(use_qw, x, out, L, scales, sw, Ls, buf)


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _q3k_finish_block(use_qw: bool, x: np.ndarray, out: np.ndarray, L: np.ndarray, scales: np.ndarray,
                      sw: np.ndarray, Ls: np.ndarray, buf: np.ndarray) -> None:
    # Everything after the 16 sub-block fits (in L, scales, and for the imatrix path sw): the super-scale,
    # requantization, high-bit mask and packing. Shared by the scalar block function (CPU and CUDA) and the
    # CPU kernel that fits many sub-blocks side by side.
    sc_bytes = out[96:108]
    for j in range(12):
        sc_bytes[j] = 0
    if use_qw:
        d_block = make_qx_quants(16, 32, scales, sw, True, Ls, buf)
        for j in range(16):
            _pack_q3_scale(sc_bytes, j, np.int64(Ls[j]))
        d16 = fp32_to_fp16_x86(d_block)
    else:
        max_scale = np.float32(0.0)
        amax = np.float32(0.0)
        for j in range(16):
            a = abs(scales[j])
            if a > amax:
                amax = a
                max_scale = scales[j]
        if max_scale != np.float32(0.0):
            iscale = np.float32(-32.0) / max_scale
            for j in range(16):
                li = _c_int8(nearest_int_full(fmul(iscale, scales[j])))  # int8_t l = nearest_int(...)
                _pack_q3_scale(sc_bytes, j, max(-32, min(31, li)) + 32)
            d16 = fp32_to_fp16_x86(np.float32(1.0) / iscale)
        else:
            d16 = 0
    _store_f16(out, 108, d16)
    d = fp16_to_fp32(d16)
    v = buf[:16]  # free again after the fits
    for j in range(16):
        dj = fmul(d, np.float32(_q3_scale(sc_bytes, j)))
        if dj == np.float32(0.0):
            continue
        # nearest_int(x/dj) clamped to [-4, 3]: when every |x/dj| < 2^22 (not NaN), round_clamp gives the same
        # ints without a branch per element; otherwise the exact bit-trick path.
        ok = True
        for i in range(16):
            vi = x[16 * j + i] / dj
            v[i] = vi
            ok &= abs(vi) < np.float32(4e6)
        if ok:
            for i in range(16):
                L[16 * j + i] = np.int64(round_clamp(v[i], np.float32(-4.0), np.float32(3.0))) + 4
        else:
            for i in range(16):
                L[16 * j + i] = max(-4, min(3, nearest_int_full(v[i]))) + 4
    # The high bit of quant j goes to bit j // 32 of hmask[j % 32].
    for m in range(32):
        h = 0
        for bit in range(8):
            lj = np.int64(L[32 * bit + m])
            hi = 1 if lj > 3 else 0
            h |= hi << bit
            L[32 * bit + m] = lj - 4 * hi
        out[m] = h
    _pack_2bit(L, out[32:96])


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _pack_q3_scale(s: np.ndarray, j: int, v: int) -> None:
    # A 6-bit scale v (0..63) into Q3_K's 12 scale bytes, ORed in as the C does.
    if j < 8:
        s[j] = v & 0xF
    else:
        s[j - 8] = (np.int64(s[j - 8]) | ((v & 0xF) << 4)) & 0xFF
    s[j % 4 + 8] = (np.int64(s[j % 4 + 8]) | ((v >> 4) << (2 * (j // 4)))) & 0xFF


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _q3_scale(s: np.ndarray, j: int) -> int:
    # The signed scale of sub-block j (6 bits minus 32), as quantize_row_q3_K_ref reads it back.
    lo = np.int64(s[j]) & 0xF if j < 8 else np.int64(s[j - 8]) >> 4
    return (lo | (((np.int64(s[8 + j % 4]) >> (2 * (j // 4))) & 3) << 4)) - 32


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def q3k_dequantize_block(blk: np.ndarray, y: np.ndarray) -> None:
    """``dequantize_row_q3_K`` for one block: ``(d * (sc - 32)) * (q - (hbit ? 0 : 4))``."""
    d = _load_f16(blk, 108)
    s = blk[96:108]
    for h in range(2):
        for sh in range(4):
            for half in range(2):
                j = 8 * h + 2 * sh + half
                dl = fmul(d, np.float32(_q3_scale(s, j)))
                bit = 4 * h + sh
                for i in range(16):
                    m = 16 * half + i
                    q = (np.int64(blk[32 + 32 * h + m]) >> (2 * sh)) & 3
                    if not (np.int64(blk[m]) >> bit) & 1:
                        q -= 4
                    y[128 * h + 32 * sh + m] = fmul(dl, np.float32(q))


# --- CPU kernels (the registry's entry points) -------------------------------------------------------


@numba.njit(parallel=True, cache=True, fastmath=False, error_model="numpy")
def quantize_rows_q2_K(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """Q2_K quantization of ``x`` float32[n_rows, n_per_row] into ``out`` uint8[n_rows, n_per_row/256*84].

    ``qw`` float32[n_per_row] is the imatrix (``quantize_row_q2_K_impl``), or float32[0] for the reference
    path (``quantize_row_q2_K_ref``). Byte-identical to ``ggml_quantize_chunk(GGML_TYPE_Q2_K)``.

    The 16*_CHUNK sub-blocks of a chunk are fitted side by side
    (:func:`~ggufkit.quant.kernels.kquants.subroutines.make_qkx_quants_lanes`, same roundings); a block with a sub-block
    the lanes cannot do exactly (constant, or extreme weights) takes ``q2k_quantize_block``.
    """
    n_rows, n_per_row = x.shape
    nb = n_per_row // QK_K
    total = n_rows * nb
    use_qw = qw.shape[0] > 0
    if use_qw:
        rmin = np.float32(-0.9)
        rdelta = np.float32(0.05)
        nstep = 36
    else:
        rmin = np.float32(-0.5)
        rdelta = np.float32(0.1)
        nstep = 15
    for c in numba.prange((total + _CHUNK - 1) // _CHUNK):
        L = np.empty(QK_K, np.uint8)
        Laux = np.empty(32, np.float32)
        w = np.empty(16, np.float32)
        scales = np.empty(16, np.float32)
        mins = np.empty(16, np.float32)
        sw = np.empty(16, np.float32)
        Ls = np.empty(16, np.uint8)
        Lm = np.empty(16, np.uint8)
        # Lane 16*k + j is sub-block j of the chunk's k-th block; weight i of a lane at i*nl + lane.
        t0 = c * _CHUNK
        nblk = min(total, t0 + _CHUNK) - t0
        nl = 16 * nblk
        xt = np.empty(16 * nl, np.float32)
        wt = np.empty(16 * nl, np.float32)
        cur = np.empty(16 * nl, np.float32)
        lf = np.empty(16 * nl, np.float32)
        st = np.empty((16, nl), np.float32)
        bad = np.empty(nl, np.int64)
        swc = np.empty(nl, np.float32)
        for k in range(nblk):
            t = t0 + k
            r = t // nb
            b = t - r * nb
            xb = x[r, b * QK_K:(b + 1) * QK_K]
            if use_qw:
                sigma2 = _row_sigma2_sum(xb) / np.float32(256.0)
                for j in range(16):
                    sumw = np.float32(0.0)
                    for i in range(16):
                        xi = xb[16 * j + i]
                        wi = fmul(qw[b * QK_K + 16 * j + i], np.float32(math.sqrt(fadd(sigma2, fmul(xi, xi)))))
                        sumw = fadd(sumw, wi)
                        xt[i * nl + 16 * k + j] = xi
                        wt[i * nl + 16 * k + j] = wi
                    swc[16 * k + j] = sumw
            else:
                for j in range(16):
                    for i in range(16):
                        xi = xb[16 * j + i]
                        xt[i * nl + 16 * k + j] = xi
                        wt[i * nl + 16 * k + j] = abs(xi)
        make_qkx_quants_lanes(nl, 16, 3, xt, wt, rmin, rdelta, nstep, not use_qw, st, cur, lf, bad)
        for k in range(nblk):
            t = t0 + k
            r = t // nb
            b = t - r * nb
            xb = x[r, b * QK_K:(b + 1) * QK_K]
            ob = out[r, b * Q2_K_BYTES:(b + 1) * Q2_K_BYTES]
            n_bad = 0
            for j in range(16):
                n_bad += bad[16 * k + j]
            if n_bad > 0:
                q2k_quantize_block(xb, qw[b * QK_K:(b + 1) * QK_K] if use_qw else qw, use_qw, ob, L, Laux, w,
                                   scales, mins, sw, Ls, Lm)
                continue
            for j in range(16):
                scales[j] = st[0, 16 * k + j]
                mins[j] = st[1, 16 * k + j]
                sw[j] = swc[16 * k + j]
                for i in range(16):
                    L[16 * j + i] = np.int64(lf[i * nl + 16 * k + j])
            _q2k_finish_block(use_qw, xb, ob, L, scales, mins, sw, Ls, Lm)


@numba.njit(parallel=True, cache=True, fastmath=False, error_model="numpy")
def dequantize_rows_q2_K(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q2_K dequantization: ``blocks`` uint8[n_rows, row_bytes] -> ``out`` float32[n_rows, n_per_row]."""
    n_rows, n_per_row = out.shape
    nb = n_per_row // QK_K
    for t in numba.prange(n_rows * nb):
        r = t // nb
        b = t - r * nb
        q2k_dequantize_block(blocks[r, b * Q2_K_BYTES:(b + 1) * Q2_K_BYTES], out[r, b * QK_K:(b + 1) * QK_K])


@numba.njit(parallel=True, cache=True, fastmath=False, error_model="numpy")
def quantize_rows_q3_K(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """Q3_K quantization of ``x`` float32[n_rows, n_per_row] into ``out`` uint8[n_rows, n_per_row/256*110].

    ``qw`` float32[n_per_row] is the imatrix (``quantize_row_q3_K_impl``), or float32[0] for the reference
    path (``quantize_row_q3_K_ref``). Byte-identical to ``ggml_quantize_chunk(GGML_TYPE_Q3_K)``.

    The _CHUNK blocks of a prange step are quantized together by :func:`ggufkit.quant.kernels.kquants.q3k_chunk.q3k_chunk`
    (their sub-block fits side by side, same roundings); a block with a sub-block the lanes cannot do
    exactly (reference path, extreme weights) takes ``q3k_quantize_block``.
    """
    n_rows, n_per_row = x.shape
    nb = n_per_row // QK_K
    total = n_rows * nb
    for c in numba.prange((total + _CHUNK - 1) // _CHUNK):
        t0 = c * _CHUNK
        nblk = min(total, t0 + _CHUNK) - t0
        bad = np.empty(nblk, np.int64)
        q3k_chunk(x, qw, out, t0, nblk, np.empty(SCRATCH_ROWS * 16 * nblk, np.float32), bad)
        for k in range(nblk):
            if bad[k] != 0:  # the scalar fits, with ggml's exact nearest_int
                t = t0 + k
                r = t // nb
                b = t - r * nb
                w = np.empty(16, np.float32)
                scales = np.empty(16, np.float32)
                sw = np.empty(16, np.float32)
                q3k_quantize_block(x[r, b * QK_K:(b + 1) * QK_K], qw, False,
                                   out[r, b * Q3_K_BYTES:(b + 1) * Q3_K_BYTES], np.empty(QK_K, np.uint8),
                                   w, scales, sw, np.empty(16, np.uint8), np.empty(64, np.float32))


@numba.njit(parallel=True, cache=True, fastmath=False, error_model="numpy")
def dequantize_rows_q3_K(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q3_K dequantization: ``blocks`` uint8[n_rows, row_bytes] -> ``out`` float32[n_rows, n_per_row]."""
    n_rows, n_per_row = out.shape
    nb = n_per_row // QK_K
    for t in numba.prange(n_rows * nb):
        r = t // nb
        b = t - r * nb
        q3k_dequantize_block(blocks[r, b * Q3_K_BYTES:(b + 1) * Q3_K_BYTES], out[r, b * QK_K:(b + 1) * QK_K])
