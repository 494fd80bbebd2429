"""K-quant kernels (Q4_K, Q5_K, Q6_K): Numba CPU quantize/dequantize, byte-identical to ggml.

Block layouts (ggml-common.h block_q4_K, block_q5_K, block_q6_K; all f16 fields little-endian):

* Q4_K, 256 weights in 144 bytes: ``d`` f16 @0, ``dmin`` f16 @2, ``scales[12]`` @4 (8 six-bit scales and
  8 six-bit mins, packed as ``get_scale_min_k4`` reads them), ``qs[128]`` @16 (4-bit quants: byte
  ``32c + l`` holds element ``64c + l`` in its low and ``64c + 32 + l`` in its high nibble).
* Q5_K, 256 weights in 176 bytes: as Q4_K, plus ``qh[32]`` @16 (bit ``2c`` / ``2c+1`` of byte l is bit 4
  of element ``64c + l`` / ``64c + 32 + l``) and ``qs[128]`` @48.
* Q6_K, 256 weights in 210 bytes: ``ql[128]`` @0 (low 4 bits), ``qh[64]`` @128 (high 2 bits),
  ``scales`` int8[16] @192 (one per 16 weights), ``d`` f16 @208.

The per-block functions (``*_block``) are plain ``@numba.njit`` functions over one block; the
``quantize_rows_*``/``dequantize_rows_*`` kernels run them in a ``prange`` loop over chunks of blocks and
:mod:`ggufkit.quant.kernels.kquants.cuda` runs the same functions from ``@cuda.jit`` kernels. A block's bytes depend
only on its own weights (and its imatrix slice), so the thread count cannot change the output.
On the CPU, Q4_K/Q5_K fit the 8*_CHUNK sub-blocks of a chunk side by side
(:func:`~ggufkit.quant.kernels.kquants.subroutines.make_qkx_quants_lanes`, vectorized across sub-blocks, same roundings)
and fall back to ``q45k_quantize_block`` for a block with a constant sub-block or extreme weights; Q6_K
runs :func:`ggufkit.quant.kernels.kquants.q6k_chunk.q6k_chunk` (fits, requantization and packing of many blocks, the
lane layout throughout) and falls back to ``q6k_quantize_block`` for a block whose requantization leaves
round_clamp's range (F16 input: :mod:`ggufkit.quant.kernels.kquants.cpu_f16`).

Quantization follows ``ggml_quantize_chunk``: without an imatrix (``qw`` of length 0) the reference
quantizers ``quantize_row_q{4,5,6}_K_ref``; with one (``qw`` float32[n_per_row]) the weighted
``quantize_row_q{4,5,6}_K_impl`` paths (ggml-quants.c quantize_row_q4_K_ref ... quantize_q6_K). Inputs must be finite and the row
length a multiple of 256; the dispatch layer (:func:`ggufkit.quant.quantize`) checks both.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ggufkit.quant.kernels.fp import fadd, fmul, fp16_to_fp32, fp32_to_fp16, fp32_to_fp16_x86, fsub
from ggufkit.quant.kernels.kquants.q6k_chunk import CHUNK as Q6K_CHUNK
from ggufkit.quant.kernels.kquants.q6k_chunk import SCRATCH_ROWS as Q6K_SCRATCH_ROWS
from ggufkit.quant.kernels.kquants.q6k_chunk import q6k_chunk
from ggufkit.quant.kernels.kquants.subroutines import (
    GROUP_MAX_EPS,
    get_scale_min_k4,
    make_qkx_quants,
    make_qkx_quants_lanes,
    make_qp_quants,
    make_qx_quants,
    nearest_int_full,
    round_clamp,
)

QK_K = GGML_QUANT_SIZES[GGMLQuantizationType.Q4_K][0]
Q4_K_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.Q4_K][1]  # 144
Q5_K_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.Q5_K][1]  # 176
Q6_K_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.Q6_K][1]  # 210

#: Blocks per prange iteration: amortizes the scratch allocation; has no effect on the bytes.
_CHUNK = 16


# --- Q4_K / Q5_K --------------------------------------------------------------------------------


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def q45k_quantize_block(x: np.ndarray, qw: np.ndarray, use_qw: bool, nmax: int, out: np.ndarray,
                        L: np.ndarray, Laux: np.ndarray, w: np.ndarray, scales: np.ndarray,
                        mins: np.ndarray, sw: np.ndarray, Ls: np.ndarray, Lm: np.ndarray) -> None:
    """Quantize one 256-weight super-block to Q4_K (``nmax == 15``) or Q5_K (``nmax == 31``).

    Args:
        x: float32[256] weights.
        qw: float32[256] imatrix slice (read only when ``use_qw``).
        use_qw: True for ``quantize_row_q*_K_impl`` (imatrix), False for ``quantize_row_q*_K_ref``.
        nmax: 15 (Q4_K) or 31 (Q5_K).
        out: uint8[144] (Q4_K) or uint8[176] (Q5_K), written in full.
        L, Laux, w, scales, mins, sw, Ls, Lm: scratch (uint8[256], float32[64], float32[32], float32[8] x3,
            uint8[8] x2).
    """
    if use_qw:
        sum_x2 = np.float32(0.0)
        for i in range(QK_K):
            sum_x2 = fadd(sum_x2, fmul(x[i], x[i]))
        sigma2 = fmul(np.float32(2.0), sum_x2) / np.float32(256.0)
        for j in range(8):
            xs = x[32 * j:32 * j + 32]
            for i in range(32):
                w[i] = fmul(qw[32 * j + i], np.float32(math.sqrt(fadd(sigma2, fmul(xs[i], xs[i])))))
            sumw = np.float32(0.0)
            for i in range(32):
                sumw = fadd(sumw, w[i])
            sw[j] = sumw
            scales[j], mins[j] = make_qkx_quants(32, nmax, xs, w, L[32 * j:32 * j + 32], Laux,
                                                 np.float32(-0.9), np.float32(0.05), 36, False)
    else:
        rmin = np.float32(-1.0) if nmax == 15 else np.float32(-0.5)
        nstep = 20 if nmax == 15 else 15
        for j in range(8):
            xs = x[32 * j:32 * j + 32]
            sum_x2 = np.float32(0.0)
            for i in range(32):
                sum_x2 = fadd(sum_x2, fmul(xs[i], xs[i]))
            av_x = np.float32(math.sqrt(sum_x2 / np.float32(32.0)))
            for i in range(32):
                w[i] = fadd(av_x, abs(xs[i]))
            scales[j], mins[j] = make_qkx_quants(32, nmax, xs, w, L[32 * j:32 * j + 32], Laux,
                                                 rmin, np.float32(0.1), nstep, False)
    _q45k_finish_block(use_qw, nmax, x, out, L, scales, mins, sw, Ls, Lm)


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _q45k_finish_block(use_qw: bool, nmax: int, x: np.ndarray, out: np.ndarray, L: np.ndarray,
                       scales: np.ndarray, mins: np.ndarray, sw: np.ndarray, Ls: np.ndarray,
                       Lm: np.ndarray) -> None:
    # Everything after the 8 make_qkx_quants fits (given in L, scales, mins, and for the imatrix path sw):
    # super-scales, packing and the second pass. Shared by the scalar block function (CPU and CUDA) and the
    # CPU kernel that fits many sub-blocks side by side.
    if use_qw:
        d_block = make_qp_quants(8, 63, scales, Ls, sw)
        m_block = make_qp_quants(8, 63, mins, Lm, sw)
        for j in range(8):
            # Q4_K's impl stores Ls as is; Q5_K's clamps with MIN(63, .) (both uint8).
            Ls[j] = Ls[j] if nmax == 15 else min(63, np.int64(Ls[j]))
            Lm[j] = Lm[j] if nmax == 15 else min(63, np.int64(Lm[j]))
    else:
        max_scale = np.float32(0.0)
        max_min = np.float32(0.0)
        for j in range(8):
            if scales[j] > max_scale:
                max_scale = scales[j]
            if mins[j] > max_min:
                max_min = mins[j]
        inv_scale = np.float32(63.0) / max_scale if max_scale > np.float32(0.0) else np.float32(0.0)
        inv_min = np.float32(63.0) / max_min if max_min > np.float32(0.0) else np.float32(0.0)
        for j in range(8):
            # uint8_t ls = nearest_int(...); ls = MIN(63, ls): wraps before the clamp.
            Ls[j] = min(63, nearest_int_full(fmul(inv_scale, scales[j])) & 0xFF)
            Lm[j] = min(63, nearest_int_full(fmul(inv_min, mins[j])) & 0xFF)
        d_block = max_scale / np.float32(63.0)
        m_block = max_min / np.float32(63.0)

    # Pack the 6-bit scales/mins; the C ORs into uint8_t bytes, so every store is modulo 256.
    s = out[4:16]
    for j in range(8):
        ls = np.int64(Ls[j])
        lm = np.int64(Lm[j])
        if j < 4:
            s[j] = ls
            s[j + 4] = lm
        else:
            s[j + 4] = ((ls & 0xF) | ((lm & 0xF) << 4)) & 0xFF
            s[j - 4] = (np.int64(s[j - 4]) | ((ls >> 4) << 6)) & 0xFF
            s[j] = (np.int64(s[j]) | ((lm >> 4) << 6)) & 0xFF
    d16 = fp32_to_fp16_x86(d_block)
    dmin16 = fp32_to_fp16_x86(m_block)
    out[0] = d16 & 0xFF
    out[1] = d16 >> 8
    out[2] = dmin16 & 0xFF
    out[3] = dmin16 >> 8

    # Second pass with the f16-rounded super-scales; a sub-block whose scale decodes to 0 keeps the
    # quants of the fit above.
    d = fp16_to_fp32(d16)
    dmin = fp16_to_fp32(dmin16)
    for j in range(8):
        sc, m = get_scale_min_k4(j, s)
        dj = fmul(d, np.float32(sc))
        if dj == np.float32(0.0):
            continue
        dm = fmul(dmin, np.float32(m))
        for i in range(32):
            li = nearest_int_full(fadd(x[32 * j + i], dm) / dj)
            L[32 * j + i] = max(0, min(nmax, li))

    if nmax == 15:
        for c in range(4):
            for i in range(32):
                out[16 + 32 * c + i] = np.int64(L[64 * c + i]) | (np.int64(L[64 * c + 32 + i]) << 4)
    else:
        for i in range(32):
            out[16 + i] = 0
        for c in range(4):
            for i in range(32):
                l1 = np.int64(L[64 * c + i])
                l2 = np.int64(L[64 * c + 32 + i])
                h = np.int64(out[16 + i])
                if l1 > 15:
                    l1 -= 16
                    h |= 1 << (2 * c)
                if l2 > 15:
                    l2 -= 16
                    h |= 2 << (2 * c)
                out[16 + i] = h
                out[48 + 32 * c + i] = l1 | (l2 << 4)


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def q45k_dequantize_block(blk: np.ndarray, nmax: int, y: np.ndarray) -> None:
    """``dequantize_row_q4_K`` / ``_q5_K`` for one block: ``(d*sc) * q - dmin*m`` per sub-block.

    Args:
        blk: uint8[144] (Q4_K, ``nmax == 15``) or uint8[176] (Q5_K, ``nmax == 31``).
        nmax: 15 or 31.
        y: float32[256] out.
    """
    d = fp16_to_fp32(np.int64(blk[0]) | (np.int64(blk[1]) << 8))
    dmin = fp16_to_fp32(np.int64(blk[2]) | (np.int64(blk[3]) << 8))
    s = blk[4:16]
    qs_off = 16 if nmax == 15 else 48
    for c in range(4):
        sc1, m1 = get_scale_min_k4(2 * c, s)
        sc2, m2 = get_scale_min_k4(2 * c + 1, s)
        d1 = fmul(d, np.float32(sc1))
        dm1 = fmul(dmin, np.float32(m1))
        d2 = fmul(d, np.float32(sc2))
        dm2 = fmul(dmin, np.float32(m2))
        for i in range(32):
            q = np.int64(blk[qs_off + 32 * c + i])
            q1 = q & 0xF
            q2 = q >> 4
            if nmax == 31:
                h = np.int64(blk[16 + i])
                q1 += 16 * ((h >> (2 * c)) & 1)
                q2 += 16 * ((h >> (2 * c + 1)) & 1)
            y[64 * c + i] = fsub(fmul(d1, np.float32(q1)), dm1)
            y[64 * c + 32 + i] = fsub(fmul(d2, np.float32(q2)), dm2)


# --- Q6_K ---------------------------------------------------------------------------------------


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def q6k_quantize_block(x: np.ndarray, qw: np.ndarray, use_qw: bool, out: np.ndarray, L: np.ndarray,
                       scales: np.ndarray, buf: np.ndarray) -> None:
    """Quantize one 256-weight super-block to Q6_K (``quantize_row_q6_K_ref`` / ``_impl``).

    Args:
        x: float32[256] weights.
        qw: float32[256] imatrix slice, used raw as the weight of ``make_qx_quants`` when ``use_qw``
            (no sigma^2 factor, unlike Q4_K/Q5_K); else the weight is x^2.
        use_qw: whether an imatrix is given.
        out: uint8[210], written in full.
        L, scales, buf: scratch (uint8[256], float32[16], float32[64]).
    """
    for ib in range(16):
        scales[ib] = make_qx_quants(16, 32, x[16 * ib:16 * ib + 16], qw[16 * ib:16 * ib + 16], use_qw,
                                    L[16 * ib:16 * ib + 16], buf)
    _q6k_finish_block(x, out, L, scales, buf)  # buf is free again after the fits


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _q6k_finish_block(x: np.ndarray, out: np.ndarray, L: np.ndarray, scales: np.ndarray, v: np.ndarray) -> None:
    # The tail of Q6_K (super-scale, final quants, packing) once the 16 sub-block fits are in ``scales``/``L``;
    # ``v`` is float32 scratch of at least 16. Part of the scalar block function (CPU fallback and CUDA); the
    # CPU kernel does the same in lane layout (q6k_cpu.q6k_chunk).
    max_scale = np.float32(0.0)
    max_abs_scale = np.float32(0.0)
    for ib in range(16):
        abs_scale = abs(scales[ib])
        if abs_scale > max_abs_scale:
            max_abs_scale = abs_scale
            max_scale = scales[ib]
    if max_abs_scale < GROUP_MAX_EPS:
        for i in range(Q6_K_BYTES):
            out[i] = 0
        return
    iscale = np.float32(-128.0) / max_scale
    d16 = np.int64(fp32_to_fp16(np.float32(1.0) / iscale))
    out[208] = d16 & 0xFF
    out[209] = d16 >> 8
    for ib in range(16):
        out[192 + ib] = min(127, nearest_int_full(fmul(iscale, scales[ib]))) & 0xFF  # int8_t store
    d = fp16_to_fp32(d16)
    for j in range(16):
        sc = np.int64(out[192 + j])
        if sc > 127:
            sc -= 256
        dj = fmul(d, np.float32(sc))
        if dj == np.float32(0.0):
            continue
        # nearest_int(x/dj) clamped to [-32, 31]: when every |x/dj| < 2^22 (not NaN), round_clamp gives the
        # same ints without a branch per element (it vectorizes); otherwise the exact bit-trick path.
        ok = True
        for i in range(16):
            vi = x[16 * j + i] / dj
            v[i] = vi
            ok &= abs(vi) < np.float32(4e6)
        if ok:
            for i in range(16):
                L[16 * j + i] = np.int64(round_clamp(v[i], np.float32(-32.0), np.float32(31.0))) + 32
        else:
            for i in range(16):
                L[16 * j + i] = max(-32, min(31, nearest_int_full(v[i]))) + 32
    for h in range(2):
        for i in range(32):
            a = np.int64(L[128 * h + i])
            b = np.int64(L[128 * h + 32 + i])
            c = np.int64(L[128 * h + 64 + i])
            e = np.int64(L[128 * h + 96 + i])
            out[64 * h + i] = (a & 0xF) | ((c & 0xF) << 4)
            out[64 * h + 32 + i] = (b & 0xF) | ((e & 0xF) << 4)
            out[128 + 32 * h + i] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6)


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def q6k_dequantize_block(blk: np.ndarray, y: np.ndarray) -> None:
    """``dequantize_row_q6_K`` for one block: ``(d * sc[e // 16]) * (L - 32)``.

    Args:
        blk: uint8[210].
        y: float32[256] out.
    """
    d = fp16_to_fp32(np.int64(blk[208]) | (np.int64(blk[209]) << 8))
    for h in range(2):
        for i in range(32):
            lo_a = np.int64(blk[64 * h + i])
            lo_b = np.int64(blk[64 * h + 32 + i])
            hi = np.int64(blk[128 + 32 * h + i])
            q = ((lo_a & 0xF) | ((hi & 3) << 4),
                 (lo_b & 0xF) | (((hi >> 2) & 3) << 4),
                 (lo_a >> 4) | (((hi >> 4) & 3) << 4),
                 (lo_b >> 4) | (((hi >> 6) & 3) << 4))
            for k in range(4):
                e = 128 * h + 32 * k + i
                sc = np.int64(blk[192 + e // 16])
                if sc > 127:
                    sc -= 256
                y[e] = fmul(fmul(d, np.float32(sc)), np.float32(q[k] - 32))


# --- CPU kernels (the registry's entry points) ---------------------------------------------------


@numba.njit(parallel=True, cache=True, fastmath=False, error_model="numpy")
def _quantize_rows_q45k(x: np.ndarray, qw: np.ndarray, out: np.ndarray, nmax: int, type_size: int) -> None:
    n_rows, n_per_row = x.shape
    nb = n_per_row // QK_K
    total = n_rows * nb
    n_chunks = (total + _CHUNK - 1) // _CHUNK
    use_qw = qw.shape[0] > 0
    if use_qw:
        rmin = np.float32(-0.9)
        rdelta = np.float32(0.05)
        nstep = 36
    else:
        rmin = np.float32(-1.0) if nmax == 15 else np.float32(-0.5)
        rdelta = np.float32(0.1)
        nstep = 20 if nmax == 15 else 15
    for c in numba.prange(n_chunks):
        L = np.empty(QK_K, np.uint8)
        Laux = np.empty(64, np.float32)
        w = np.empty(32, np.float32)
        scales = np.empty(8, np.float32)
        mins = np.empty(8, np.float32)
        sw = np.empty(8, np.float32)
        Ls = np.empty(8, np.uint8)
        Lm = np.empty(8, np.uint8)
        # The chunk's 8*nblk sub-blocks are fitted side by side (make_qkx_quants_lanes): lane 8*k + j is
        # sub-block j of the chunk's k-th block, weight i of a lane at i*nl + lane.
        t0 = c * _CHUNK
        nblk = min(total, t0 + _CHUNK) - t0
        nl = 8 * nblk
        xt = np.empty(32 * nl, np.float32)
        wt = np.empty(32 * nl, np.float32)
        cur = np.empty(32 * nl, np.float32)
        lf = np.empty(32 * nl, np.float32)
        st = np.empty((16, nl), np.float32)
        bad = np.empty(nl, np.int64)
        swc = np.empty(nl, np.float32)
        for k in range(nblk):
            t = t0 + k
            r = t // nb
            b = t - r * nb
            xb = x[r, b * QK_K:(b + 1) * QK_K]
            if use_qw:
                # As in q45k_quantize_block: w = qw * sqrt(sigma2 + x^2), sums in index order.
                sum_x2 = np.float32(0.0)
                for i in range(QK_K):
                    sum_x2 = fadd(sum_x2, fmul(xb[i], xb[i]))
                sigma2 = fmul(np.float32(2.0), sum_x2) / np.float32(256.0)
                for j in range(8):
                    sumw = np.float32(0.0)
                    for i in range(32):
                        xi = xb[32 * j + i]
                        wi = fmul(qw[b * QK_K + 32 * j + i], np.float32(math.sqrt(fadd(sigma2, fmul(xi, xi)))))
                        sumw = fadd(sumw, wi)
                        xt[i * nl + 8 * k + j] = xi
                        wt[i * nl + 8 * k + j] = wi
                    swc[8 * k + j] = sumw
            else:
                for j in range(8):
                    sum_x2 = np.float32(0.0)
                    for i in range(32):
                        sum_x2 = fadd(sum_x2, fmul(xb[32 * j + i], xb[32 * j + i]))
                    av_x = np.float32(math.sqrt(sum_x2 / np.float32(32.0)))
                    for i in range(32):
                        xi = xb[32 * j + i]
                        xt[i * nl + 8 * k + j] = xi
                        wt[i * nl + 8 * k + j] = fadd(av_x, abs(xi))
        make_qkx_quants_lanes(nl, 32, nmax, xt, wt, rmin, rdelta, nstep, False, st, cur, lf, bad)
        for k in range(nblk):
            t = t0 + k
            r = t // nb
            b = t - r * nb
            xb = x[r, b * QK_K:(b + 1) * QK_K]
            ob = out[r, b * type_size:(b + 1) * type_size]
            n_bad = 0
            for j in range(8):
                n_bad += bad[8 * k + j]
            if n_bad > 0:
                # Constant sub-block or extreme weights: the scalar path, with its exact nearest_int.
                q45k_quantize_block(xb, qw[b * QK_K:(b + 1) * QK_K], use_qw, nmax, ob, L, Laux, w, scales,
                                    mins, sw, Ls, Lm)
                continue
            for j in range(8):
                scales[j] = st[0, 8 * k + j]
                mins[j] = st[1, 8 * k + j]
                sw[j] = swc[8 * k + j]
                for i in range(32):
                    L[32 * j + i] = np.int64(lf[i * nl + 8 * k + j])
            _q45k_finish_block(use_qw, nmax, xb, ob, L, scales, mins, sw, Ls, Lm)


@numba.njit(parallel=True, cache=True, fastmath=False, error_model="numpy")
def _dequantize_rows_q45k(blocks: np.ndarray, out: np.ndarray, nmax: int, type_size: int) -> None:
    n_rows, n_per_row = out.shape
    nb = n_per_row // QK_K
    for t in numba.prange(n_rows * nb):
        r = t // nb
        b = t - r * nb
        q45k_dequantize_block(blocks[r, b * type_size:(b + 1) * type_size], nmax,
                              out[r, b * QK_K:(b + 1) * QK_K])


@numba.njit(parallel=True, cache=True, fastmath=False, error_model="numpy")
def quantize_rows_q6_K(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """Q6_K quantization of ``x`` float32[n_rows, n_per_row] into ``out`` uint8[n_rows, n_per_row/256*210].

    ``qw`` float32[n_per_row] is the imatrix (``quantize_row_q6_K_impl``), or float32[0] for the
    reference path (``quantize_row_q6_K_ref``). Byte-identical to ``ggml_quantize_chunk(GGML_TYPE_Q6_K)``.

    The ``q6k_cpu.CHUNK`` blocks of a prange step are quantized together by
    :func:`ggufkit.quant.kernels.kquants.q6k_chunk.q6k_chunk` (their sub-block fits side by side, same roundings); a block
    whose requantization leaves round_clamp's range takes :func:`q6k_quantize_block`.
    """
    n_rows, n_per_row = x.shape
    nb = n_per_row // QK_K
    total = n_rows * nb
    for c in numba.prange((total + Q6K_CHUNK - 1) // Q6K_CHUNK):
        t0 = c * Q6K_CHUNK
        nblk = min(total, t0 + Q6K_CHUNK) - t0
        bad = np.empty(nblk, np.int64)
        q6k_chunk(x, qw, out, t0, nblk, np.empty(Q6K_SCRATCH_ROWS * 16 * nblk, np.float32),
                  np.empty(QK_K * nblk, np.uint8), bad)
        for k in range(nblk):
            if bad[k] != 0:  # the scalar block, with ggml's exact nearest_int
                t = t0 + k
                r = t // nb
                b = t - r * nb
                q6k_quantize_block(x[r, b * QK_K:(b + 1) * QK_K], qw[b * QK_K:(b + 1) * QK_K], qw.shape[0] > 0,
                                   out[r, b * Q6_K_BYTES:(b + 1) * Q6_K_BYTES], np.empty(QK_K, np.uint8),
                                   np.empty(16, np.float32), np.empty(64, np.float32))


@numba.njit(parallel=True, cache=True, fastmath=False, error_model="numpy")
def dequantize_rows_q6_K(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q6_K dequantization: ``blocks`` uint8[n_rows, row_bytes] -> ``out`` float32[n_rows, n_per_row]."""
    n_rows, n_per_row = out.shape
    nb = n_per_row // QK_K
    for t in numba.prange(n_rows * nb):
        r = t // nb
        b = t - r * nb
        q6k_dequantize_block(blocks[r, b * Q6_K_BYTES:(b + 1) * Q6_K_BYTES], out[r, b * QK_K:(b + 1) * QK_K])


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def quantize_rows_q4_K(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """Q4_K quantization of ``x`` float32[n_rows, n_per_row] into ``out`` uint8[n_rows, n_per_row/256*144].

    ``qw`` float32[n_per_row] is the imatrix (``quantize_row_q4_K_impl``), or float32[0] for the
    reference path (``quantize_row_q4_K_ref``). Byte-identical to ``ggml_quantize_chunk(GGML_TYPE_Q4_K)``.
    """
    _quantize_rows_q45k(x, qw, out, 15, Q4_K_BYTES)


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def quantize_rows_q5_K(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """Q5_K quantization; as :func:`quantize_rows_q4_K` with 176-byte blocks (``quantize_row_q5_K_*``)."""
    _quantize_rows_q45k(x, qw, out, 31, Q5_K_BYTES)


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def dequantize_rows_q4_K(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q4_K dequantization: ``blocks`` uint8[n_rows, row_bytes] -> ``out`` float32[n_rows, n_per_row]."""
    _dequantize_rows_q45k(blocks, out, 15, Q4_K_BYTES)


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def dequantize_rows_q5_K(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q5_K dequantization: ``blocks`` uint8[n_rows, row_bytes] -> ``out`` float32[n_rows, n_per_row]."""
    _dequantize_rows_q45k(blocks, out, 31, Q5_K_BYTES)

