"""Q6_K quantization for the CPU kernels, many super-blocks at once (CPU only).

:func:`q6k_chunk` quantizes a run of super-blocks with the same bytes as ggml's ``quantize_row_q6_K_ref``
(no imatrix) or ``quantize_row_q6_K_impl`` (with one; ggml-quants.c): the 16 sub-block fits of every block
(``make_qx_quants(16, 32, x, L, 1, w)``) run side by side, one sub-block per "lane", each lane doing the
C's float32 operations in the C's order (:func:`ggufkit.quant.kernels.kquants.q3k_chunk.qx_lanes`), so LLVM vectorizes
across sub-blocks without changing a rounding. The requantization with the int8 scales and the f16
super-scale runs in the same lane layout (one division per weight, a select per lane); only the 8-bit
scales (16 per block), the transposition of the final quants back into block order and the bit packing
go block by block. :func:`ggufkit.quant.kernels.kquants.cpu.quantize_rows_q6_K` (float32 input) and
:func:`ggufkit.quant.kernels.kquants.cpu_f16.quantize_f16_rows_q6_K` (F16 input, widened a row at a time) call it;
the per-block functions of :mod:`ggufkit.quant.kernels.kquants.cpu` (also compiled for CUDA) stay the reference and
run on the blocks the lanes cannot do exactly (a quotient ``x / (d*scale)`` off round_clamp's range).

Layout: lane ``16*k + j`` is sub-block j of the chunk's k-th block; weight i of a lane sits at
``i*nl + lane`` (``nl`` lanes), so each loop over lanes reads and writes contiguous memory.
Written the way :mod:`ggufkit.quant.kernels.kquants.q3k_chunk` is (see its notes): lane loops over row slices, every store
in them unconditional and into another array than the one read, no per-block calls taking arrays.
"""

from __future__ import annotations

import numba
import numpy as np

from ggufkit.quant.kernels.fp import fmul, fp16_to_fp32, fp32_to_fp16
from ggufkit.quant.kernels.kquants.q3k_chunk import gather_lanes, qx_lanes
from ggufkit.quant.kernels.kquants.subroutines import GROUP_MAX_EPS, nearest_int_full, round_clamp

QK_K = 256
Q6_K_BYTES = 210
#: Blocks quantized together (``nl = 16 * CHUNK`` lanes); has no effect on the bytes.
CHUNK = 16
#: Rows of :func:`q6k_chunk`'s float32 scratch per lane (``SCRATCH_ROWS * nl`` floats).
SCRATCH_ROWS = 80

_LO = np.float32(-32.0)  # quantize_row_q6_K_*: l = nearest_int(x/d) clamped to [-32, 31]
_HI = np.float32(31.0)
_BIG = np.float32(4e6)  # below 2^22: round_clamp equals nearest_int there


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def q6k_chunk(x: np.ndarray, qw: np.ndarray, out: np.ndarray, t0: int, nblk: int, buf: np.ndarray,
              lq: np.ndarray, bad: np.ndarray) -> None:
    """Q6_K quantization of blocks ``t0 .. t0+nblk-1`` of ``x``, as ``quantize_row_q6_K_ref`` (``qw`` of
    length 0) or ``quantize_row_q6_K_impl`` (``qw`` the imatrix row) quantize them.

    Block t is ``x[t // nb, 256*(t % nb):][:256]`` with ``nb = x.shape[1] // 256``; its 210 bytes go to
    the same place of ``out``.

    Args:
        x: float32[n_rows, n_per_row] weights.
        qw: float32[n_per_row] imatrix, or float32[0].
        out: uint8[n_rows, n_per_row / 256 * 210].
        t0: first block.
        nblk: number of blocks (lanes: ``nl = 16 * nblk``).
        buf: float32[>= SCRATCH_ROWS * nl] scratch.
        lq: uint8[>= 256 * nblk] scratch (the final quants in block order).
        bad: int64[>= nblk] out: 1 for a block the lanes cannot do exactly (its bytes are not written: the
            caller runs ``kquants.q6k_quantize_block`` on it), else 0.
    """
    nb = x.shape[1] // QK_K
    nl = 16 * nblk
    use_qw = qw.shape[0] > 0
    xt = buf[:16 * nl]
    wt = buf[16 * nl:32 * nl]
    wxt = buf[32 * nl:48 * nl]
    lf = buf[48 * nl:64 * nl]
    st = buf[64 * nl:76 * nl].reshape((12, nl))
    dl = buf[76 * nl:77 * nl]  # d * scale of each sub-block (0: the C keeps the fit's quants)
    nok = buf[77 * nl:78 * nl]  # per lane: quotients off round_clamp's range
    lr2 = buf[16 * nl:32 * nl]  # the requantized quants, where the weights were (read by the fit only)
    gather_lanes(x, t0, nblk, xt)
    if use_qw:
        # make_qx_quants with quant_weights: w is the imatrix itself (quantize_row_q6_K_impl passes qw raw).
        for k in range(nblk):
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
                wxr[j] = fmul(wr[j], xr[j])
    else:
        for i in range(16):  # make_qx_quants without weights: w = x*x
            xr = xt[i * nl:]
            wr = wt[i * nl:]
            wxr = wxt[i * nl:]
            for j in range(nl):
                xi = xr[j]
                w = fmul(xi, xi)
                wr[j] = w
                wxr[j] = fmul(w, xi)
    qx_lanes(nl, 32, xt, wt, wxt, st, lf)  # lf: L = l + 32 (0 for an all-zero lane); st[0] the scales
    sc = st[0]
    # The 8-bit scales against the scale of largest |scale| (first of equals), and the f16 super-scale.
    for k in range(nblk):
        t = t0 + k
        r = t // nb
        b = t - r * nb
        ob = out[r, b * Q6_K_BYTES:(b + 1) * Q6_K_BYTES]
        max_scale = np.float32(0.0)
        max_abs = np.float32(0.0)
        for j in range(16):
            a = abs(sc[16 * k + j])
            if a > max_abs:
                max_abs = a
                max_scale = sc[16 * k + j]
        if max_abs < GROUP_MAX_EPS:  # the C writes an all-zero block
            bad[k] = -1
            for j in range(16):
                dl[16 * k + j] = np.float32(0.0)
            continue
        bad[k] = 0
        iscale = np.float32(-128.0) / max_scale
        d16 = np.int64(fp32_to_fp16(np.float32(1.0) / iscale))
        ob[208] = d16 & 0xFF
        ob[209] = d16 >> 8
        d = fp16_to_fp32(d16)
        for j in range(16):
            q = min(127, nearest_int_full(fmul(iscale, sc[16 * k + j]))) & 0xFF  # int8_t store
            ob[192 + j] = q
            dl[16 * k + j] = fmul(d, np.float32(q - 256 if q > 127 else q))
    # l = nearest_int(x / (d*scale)) clamped to [-32, 31], plus 32; a sub-block whose d*scale is 0 keeps the
    # fit's quants.
    for j in range(nl):
        nok[j] = np.float32(0.0)
    for i in range(16):
        xr = xt[i * nl:]
        fr = lf[i * nl:]
        orow = lr2[i * nl:]
        for j in range(nl):
            dj = dl[j]
            z = dj == np.float32(0.0)
            v = xr[j] / dj
            q = round_clamp(v, _LO, _HI) + np.float32(32.0)
            orow[j] = fr[j] if z else q
            nok[j] = nok[j] + (np.float32(0.0) if (abs(v) < _BIG) | z else np.float32(1.0))
    for k in range(nblk):
        for j in range(16):
            if nok[16 * k + j] != np.float32(0.0):
                bad[k] = 1
    # Back into block order (a 16-wide read per weight index, as the gather), then the packing of
    # quantize_row_q6_K_ref: ql[64h + l] low nibbles of quants 128h + l and 128h + l + 64, ql[64h + 32 + l]
    # of 128h + l + 32 and 128h + l + 96, qh[32h + l] their high 2 bits in bits 0-1, 2-3, 4-5, 6-7.
    for k in range(nblk):
        lk = lq[256 * k:256 * k + 256]
        for i in range(16):
            src = lr2[i * nl + 16 * k:i * nl + 16 * k + 16]
            for j in range(16):
                lk[16 * j + i] = np.uint8(src[j])
    for k in range(nblk):
        t = t0 + k
        r = t // nb
        b = t - r * nb
        ob = out[r, b * Q6_K_BYTES:(b + 1) * Q6_K_BYTES]
        if bad[k] != 0:
            if bad[k] < 0:
                for m in range(Q6_K_BYTES):
                    ob[m] = 0
                bad[k] = 0
            continue
        lk = lq[256 * k:256 * k + 256]
        for h in range(2):
            la = lk[128 * h:128 * h + 32]
            lb = lk[128 * h + 32:128 * h + 64]
            lc = lk[128 * h + 64:128 * h + 96]
            le = lk[128 * h + 96:128 * h + 128]
            o1 = ob[64 * h:64 * h + 32]
            o2 = ob[64 * h + 32:64 * h + 64]
            o3 = ob[128 + 32 * h:128 + 32 * h + 32]
            for m in range(32):
                a = la[m]
                bb = lb[m]
                c = lc[m]
                e = le[m]
                o1[m] = (a & np.uint8(0xF)) | ((c & np.uint8(0xF)) << np.uint8(4))
                o2[m] = (bb & np.uint8(0xF)) | ((e & np.uint8(0xF)) << np.uint8(4))
                o3[m] = ((a >> np.uint8(4)) | ((bb >> np.uint8(4)) << np.uint8(2)) | ((c >> np.uint8(4)) << np.uint8(4))
                         | ((e >> np.uint8(4)) << np.uint8(6)))
