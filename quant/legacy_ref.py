"""CPU-only reference quantizers of the legacy types, laid out so that the compiler can vectorize them.

The block functions of :mod:`ggufkit.quant.legacy` (``q4_0_ref_block`` ...) are shared with the CUDA
kernels and keep ggml's loops as written (``quantize_row_q4_0_ref`` ... ``quantize_row_q8_0_ref``,
ggml-quants.c). On the CPU three things made them slow: the running ``amax``/``min``/``max`` is one chain
of dependent compares, the 16-iteration rounding loop is unrolled into scalar code, and the f16 store of
the scale goes through ``frexp``. Here the results are the same, computed differently:

* the extremes come from four interleaved chains merged in a way that keeps ggml's choice (strict
  compares keep the *first* element reaching the extreme: by index for q4_0/q5_0's signed maximum, by
  the exact loop for a zero minimum or maximum of q4_1/q5_1, whose sign depends on the order);
* Q4_0 ... Q5_1 work on a whole row: per-block scales first (their reciprocal spread over the block's 32
  lanes), then one loop over the row doing ggml's float32 operations in ggml's order, then the packing;
* Q8_0's |x| maximum is an integer maximum of the bits (same order as |x| for finite floats);
* the f16 scale is rounded on the bits (round to nearest even) in the normal range; outside it
  :func:`ggufkit.quant.fp.fp32_to_fp16` runs.

A block whose scale is degenerate (its reciprocal overflowed, the range overflowed) is flagged (``bad``
for the rows, False for Q8_0's block) and the caller runs the shared block function on it, which has C's
out-of-range conversion semantics. Inputs are finite (the dispatcher refuses inf/NaN first).

Arguments: ``xr`` float32[n] one row, ``u`` the same row viewed as uint32, ``b`` a block index, ``o_r``
uint8[row_bytes] the output row, ``bad`` uint8[n/32] zeros, ``s`` uint32[2] scratch with ``sf`` its
float32 view (a bit cast through memory).
"""

from __future__ import annotations

import numba
import numpy as np

from ggufkit.quant.fp import fp32_to_fp16

QK = 32
_U = np.uintp  # unsigned indices: no negative-index wraparound, contiguous vector loads
_ABS = np.uint32(0x7FFFFFFF)
_F32_MAX = np.float32(3.4028234663852886e38)

_jit = numba.njit(cache=True, fastmath=False, error_model="numpy")
_jit_inline = numba.njit(cache=True, fastmath=False, error_model="numpy", inline="always")


@_jit
def f16_of(s: np.ndarray, sf: np.ndarray, v: np.float32) -> int:
    """``GGML_FP32_TO_FP16(v)`` as an int: RNE on the bits for |v| in [2^-14, 65520), else fp32_to_fp16."""
    sf[1] = v
    bits = s[1]
    a = bits & _ABS
    if a >= np.uint32(0x38800000) and a < np.uint32(0x477FF000):
        r = a - np.uint32(0x38000000)  # exponent rebiased from 127 to 15
        r = (r + np.uint32(0xFFF) + ((r >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13)
        return int(((bits >> np.uint32(16)) & np.uint32(0x8000)) | r)
    return int(fp32_to_fp16(v))


@_jit
def _store_f16(o_r: np.ndarray, o: int, h: int) -> None:
    o_r[_U(o)] = h & 0xFF
    o_r[_U(o + 1)] = (h >> 8) & 0xFF


@_jit
def _first_absmax(xr: np.ndarray, base: int) -> np.float32:
    """The first element of largest |v| (``if (amax < fabsf(v))`` in index order), or +0.0 if all are zero.

    Four interleaved chains (indices j = c mod 4), each keeping its own first maximum and its index, so the
    compares do not wait on one another; the merge takes the largest |v| and, among equal ones, the
    smallest index: the element the single loop keeps.
    """
    a0 = a1 = a2 = a3 = np.float32(0.0)
    m0 = m1 = m2 = m3 = np.float32(0.0)
    i0 = i1 = i2 = i3 = 0
    for j in range(0, QK, 4):
        v0 = xr[_U(base + j)]
        v1 = xr[_U(base + j + 1)]
        v2 = xr[_U(base + j + 2)]
        v3 = xr[_U(base + j + 3)]
        t0 = a0 < abs(v0)
        t1 = a1 < abs(v1)
        t2 = a2 < abs(v2)
        t3 = a3 < abs(v3)
        a0, m0, i0 = (abs(v0), v0, j) if t0 else (a0, m0, i0)
        a1, m1, i1 = (abs(v1), v1, j + 1) if t1 else (a1, m1, i1)
        a2, m2, i2 = (abs(v2), v2, j + 2) if t2 else (a2, m2, i2)
        a3, m3, i3 = (abs(v3), v3, j + 3) if t3 else (a3, m3, i3)
    if a1 > a0 or (a1 == a0 and i1 < i0):
        a0, m0, i0 = a1, m1, i1
    if a2 > a0 or (a2 == a0 and i2 < i0):
        a0, m0, i0 = a2, m2, i2
    if a3 > a0 or (a3 == a0 and i3 < i0):
        m0 = m3
    return m0


@_jit
def _min_max(xr: np.ndarray, base: int) -> tuple[np.float32, np.float32]:
    """ggml's ``if (v < min) min = v; if (v > max) max = v;`` from (FLT_MAX, -FLT_MAX), in index order.

    Four interleaved chains, merged by value: equal nonzero floats have equal bits, so only a zero
    extreme (whose sign is that of the first zero) needs the loop in index order.
    """
    n0 = n1 = n2 = n3 = _F32_MAX
    x0 = x1 = x2 = x3 = -_F32_MAX
    for j in range(0, QK, 4):
        v0 = xr[_U(base + j)]
        v1 = xr[_U(base + j + 1)]
        v2 = xr[_U(base + j + 2)]
        v3 = xr[_U(base + j + 3)]
        n0 = v0 if v0 < n0 else n0
        n1 = v1 if v1 < n1 else n1
        n2 = v2 if v2 < n2 else n2
        n3 = v3 if v3 < n3 else n3
        x0 = v0 if v0 > x0 else x0
        x1 = v1 if v1 > x1 else x1
        x2 = v2 if v2 > x2 else x2
        x3 = v3 if v3 > x3 else x3
    n0 = min(min(n0, n1), min(n2, n3))
    x0 = max(max(x0, x1), max(x2, x3))
    if n0 != np.float32(0.0) and x0 != np.float32(0.0):
        return n0, x0
    mn = _F32_MAX
    mx = -_F32_MAX
    for j in range(QK):
        v = xr[_U(base + j)]
        if v < mn:
            mn = v
        if v > mx:
            mx = v
    return mn, mx


# --- whole rows: per-block scales (scalar), then one vectorizable loop over the row, then the packing ---


@_jit
def _scales_absmax(xr: np.ndarray, o_r: np.ndarray, bytes_per_block: int, div: np.float32, ide: np.ndarray,
                   bad: np.ndarray, s: np.ndarray, sf: np.ndarray) -> bool:
    """q4_0/q5_0: ``d = max / div`` (max: first element of largest |v|), ``id = d ? 1/d : 0``; f16(d) stored at
    each block's offset 0 and ``id`` spread over the block's 32 lanes of ``ide``. A block whose ``id`` is
    infinite is flagged in ``bad`` (its lanes get 0, so the vector loop stays finite)."""
    any_bad = False
    for b in range(xr.shape[0] // QK):
        base = b * QK
        mx = _first_absmax(xr, base)
        d = np.float32(mx / div)
        idv = np.float32(np.float32(1.0) / d) if d != np.float32(0.0) else np.float32(0.0)
        if not abs(idv) < np.float32(np.inf):
            bad[b] = 1
            any_bad = True
            idv = np.float32(0.0)
        _store_f16(o_r, b * bytes_per_block, f16_of(s, sf, d))
        for j in range(QK):
            ide[_U(base + j)] = idv
    return any_bad


@_jit
def _scales_min_max(xr: np.ndarray, u: np.ndarray, o_r: np.ndarray, bytes_per_block: int, div: np.float32,
                    ide: np.ndarray, mne: np.ndarray, bad: np.ndarray, s: np.ndarray, sf: np.ndarray) -> bool:
    """q4_1/q5_1: ``d = (max - min) / div``, ``id = d ? 1/d : 0``; f16(d), f16(min) stored at offsets 0 and 2;
    ``id`` and ``min`` spread over the block's lanes. Non-finite ``d`` or ``id``: flagged, lanes 0."""
    any_bad = False
    for b in range(xr.shape[0] // QK):
        base = b * QK
        mn, mx = _min_max(xr, base)
        d = np.float32(np.float32(mx - mn) / div)
        idv = np.float32(np.float32(1.0) / d) if d != np.float32(0.0) else np.float32(0.0)
        m = mn
        if not (abs(d) < np.float32(np.inf) and abs(idv) < np.float32(np.inf)):
            bad[b] = 1
            any_bad = True
            idv = np.float32(0.0)
            m = np.float32(0.0)
        o = b * bytes_per_block
        _store_f16(o_r, o, f16_of(s, sf, d))
        _store_f16(o_r, o + 2, f16_of(s, sf, mn))
        for j in range(QK):
            ide[_U(base + j)] = idv
            mne[_U(base + j)] = m
    return any_bad


@_jit
def _pack_nibbles(q: np.ndarray, o_r: np.ndarray, bytes_per_block: int, qs_off: int) -> None:
    """``qs[j] = (q[j] & 15) | (q[j + 16] & 15) << 4`` for every block."""
    for b in range(q.shape[0] // QK):
        o = b * bytes_per_block + qs_off
        base = b * QK
        for j in range(16):
            o_r[_U(o + j)] = (q[_U(base + j)] & np.uint8(0x0F)) | ((q[_U(base + 16 + j)] & np.uint8(0x0F)) << np.uint8(4))


@_jit
def _pack_qh(q: np.ndarray, o_r: np.ndarray, bytes_per_block: int, qh_off: int) -> None:
    """Bit 4 of the 32 quants of each block into the little-endian uint32 ``qh``."""
    for b in range(q.shape[0] // QK):
        base = b * QK
        qh = np.uint32(0)
        for j in range(QK):
            qh |= np.uint32((q[_U(base + j)] >> np.uint8(4)) & np.uint8(1)) << np.uint32(j)
        o = b * bytes_per_block + qh_off
        for k in range(4):
            o_r[_U(o + k)] = np.uint8((qh >> np.uint32(8 * k)) & np.uint32(0xFF))


@_jit_inline
def q4_0_ref_row(xr: np.ndarray, o_r: np.ndarray, bad: np.ndarray) -> bool:
    """``quantize_row_q4_0_ref`` of one row; True if some block (flagged in ``bad``) still needs the scalar
    block function (its id overflowed)."""
    n = xr.shape[0]
    s = np.empty(2, np.uint32)
    sf = s.view(np.float32)
    ide = np.empty(n, np.float32)
    q = np.empty(n, np.uint8)
    any_bad = _scales_absmax(xr, o_r, 18, np.float32(-8.0), ide, bad, s, sf)
    for j in range(n):  # x*id + 8.5 lies in (0, 17): (int8_t) is a plain truncation
        q[_U(j)] = np.uint8(min(np.int32(15), np.int32(np.float32(np.float32(xr[_U(j)] * ide[_U(j)])
                                                                  + np.float32(8.5)))))
    _pack_nibbles(q, o_r, 18, 2)
    return any_bad


@_jit_inline
def q5_0_ref_row(xr: np.ndarray, o_r: np.ndarray, bad: np.ndarray) -> bool:
    """``quantize_row_q5_0_ref`` of one row (see :func:`q4_0_ref_row`)."""
    n = xr.shape[0]
    s = np.empty(2, np.uint32)
    sf = s.view(np.float32)
    ide = np.empty(n, np.float32)
    q = np.empty(n, np.uint8)
    any_bad = _scales_absmax(xr, o_r, 22, np.float32(-16.0), ide, bad, s, sf)
    for j in range(n):  # x*id + 16.5 lies in (0, 33)
        q[_U(j)] = np.uint8(min(np.int32(31), np.int32(np.float32(np.float32(xr[_U(j)] * ide[_U(j)])
                                                                  + np.float32(16.5)))))
    _pack_qh(q, o_r, 22, 2)
    _pack_nibbles(q, o_r, 22, 6)
    return any_bad


@_jit_inline
def q4_1_ref_row(xr: np.ndarray, o_r: np.ndarray, bad: np.ndarray) -> bool:
    """``quantize_row_q4_1_ref`` of one row (see :func:`q4_0_ref_row`; flagged: d or id not finite)."""
    n = xr.shape[0]
    s = np.empty(2, np.uint32)
    sf = s.view(np.float32)
    ide = np.empty(n, np.float32)
    mne = np.empty(n, np.float32)
    q = np.empty(n, np.uint8)
    any_bad = _scales_min_max(xr, xr.view(np.uint32), o_r, 20, np.float32(15.0), ide, mne, bad, s, sf)
    for j in range(n):  # (x-min)*id + 0.5 lies in [0.5, 15.5+eps]
        q[_U(j)] = np.uint8(min(np.int32(15), np.int32(np.float32(
            np.float32(np.float32(xr[_U(j)] - mne[_U(j)]) * ide[_U(j)]) + np.float32(0.5)))))
    _pack_nibbles(q, o_r, 20, 4)
    return any_bad


@_jit_inline
def q5_1_ref_row(xr: np.ndarray, o_r: np.ndarray, bad: np.ndarray) -> bool:
    """``quantize_row_q5_1_ref`` of one row (see :func:`q4_1_ref_row`)."""
    n = xr.shape[0]
    s = np.empty(2, np.uint32)
    sf = s.view(np.float32)
    ide = np.empty(n, np.float32)
    mne = np.empty(n, np.float32)
    q = np.empty(n, np.uint8)
    any_bad = _scales_min_max(xr, xr.view(np.uint32), o_r, 24, np.float32(31.0), ide, mne, bad, s, sf)
    for j in range(n):  # (x-min)*id + 0.5 lies in [0.5, 31.5+eps]: (uint8_t) is a plain truncation
        q[_U(j)] = np.uint8(np.int32(np.float32(np.float32(np.float32(xr[_U(j)] - mne[_U(j)]) * ide[_U(j)])
                                                + np.float32(0.5))))
    _pack_qh(q, o_r, 24, 4)
    _pack_nibbles(q, o_r, 24, 8)
    return any_bad


# --- Q8_0: one block at a time (its rounding loop vectorizes as it is) ------------------------------------
@_jit_inline
def q8_0_ref_fast(xr: np.ndarray, u: np.ndarray, b: int, o_r: np.ndarray, s: np.ndarray, sf: np.ndarray) -> bool:
    """``quantize_row_q8_0_ref`` for block b (34 bytes at ``o_r[34b:]``)."""
    base = b * QK
    m = np.uint32(0)
    for j in range(QK):
        m = max(m, u[_U(base + j)] & _ABS)
    s[0] = m
    amax = sf[0]
    d = np.float32(amax / np.float32(127.0))
    idv = np.float32(np.float32(1.0) / d) if d != np.float32(0.0) else np.float32(0.0)
    if not np.float32(amax * idv) <= np.float32(128.0):
        return False
    o = b * 34
    _store_f16(o_r, o, f16_of(s, sf, d))
    for j in range(QK):
        # roundf(x*id) for |x*id| <= 128: truncate, then away from zero when the fraction is >= 1/2 (exact)
        v = np.float32(xr[_U(base + j)] * idv)
        a = abs(v)
        q = np.int32(a)
        q = q + np.int32(np.float32(a - np.float32(q)) >= np.float32(0.5))
        q = -q if v < np.float32(0.0) else q
        o_r[_U(o + 2 + j)] = np.uint8(q & np.int32(0xFF))
    return True
