"""CPU-only reference quantizers of the legacy types, laid out so that the compiler can vectorize them.

The block functions of :mod:`ggufkit.quant.kernels.legacy.cpu` (``q4_0_ref_block`` ...) are shared with the CUDA
kernels and keep ggml's loops as written (``quantize_row_q4_0_ref`` ... ``quantize_row_q8_0_ref``,
ggml-quants.c). On the CPU three things made them slow: the running ``amax``/``min``/``max`` is one chain
of dependent compares, the 16-iteration rounding loop is unrolled into scalar code, and the f16 store of
the scale goes through ``frexp``. Here the results are the same, computed differently:

* the extremes are an integer minimum and maximum of order-preserving keys of the float bits, which the
  loop vectorizer handles (ggml's choice among equal extremes only matters for a zero extreme of
  q4_1/q5_1, whose sign depends on the order, and for q4_0/q5_0 when +m and -m both hold the largest
  |v|: those blocks run ggml's loop in index order);
* Q4_0 ... Q5_1 work on a whole row: the per-block scales first (one call per row), then per block ggml's
  float32 operations in ggml's order with the scale broadcast, packed as they are computed. The loops
  over a block run to a block length the compiler cannot see as a constant (:func:`_block_len`), so they
  are vectorized rather than unrolled into scalar code, and the block loop calls no function taking an
  array (each such call costs Numba's reference counting);
* Q8_0 works on a whole row too; its |x| maximum is an integer maximum of the bits (same order as |x| for
  finite floats);
* the f16 scale is rounded on the bits (round to nearest even) in the normal range; outside it
  :func:`ggufkit.quant.kernels.fp.fp32_to_fp16` runs.

A block whose scale is degenerate (its reciprocal overflowed, the range overflowed) is flagged in ``bad``
and the caller runs the shared block function on it, which has C's
out-of-range conversion semantics. Inputs are finite (the dispatcher refuses inf/NaN first).

Arguments: ``xr`` float32[n] one row, ``u`` the same row viewed as uint32, ``o_r`` uint8[row_bytes] the
output row, ``bad`` uint8[n/32] zeros.
"""

from __future__ import annotations

import numba
import numpy as np

from ggufkit.quant.kernels.fp import fp32_to_fp16

QK = 32
_U = np.uintp  # unsigned indices: no negative-index wraparound, contiguous vector loads
_ABS = np.uint32(0x7FFFFFFF)
_SIGN = np.uint32(0x80000000)
_F32_MAX = np.float32(3.4028234663852886e38)

_jit = numba.njit(cache=True, fastmath=False, error_model="numpy")
_jit_inline = numba.njit(cache=True, fastmath=False, error_model="numpy", inline="always")


@_jit
def _block_len(n: int, nb: int) -> tuple[int, int]:
    """(32, 16) computed as ``n // nb``: a block length the compiler does not know, so that the loops over a
    block's 32 (or 16) values are vectorized rather than fully unrolled into scalar code (Numba runs LLVM's
    loop vectorizer, not the SLP vectorizer, and a constant trip count of 32 is fully unrolled first)."""
    qk = n // nb if nb > 0 else QK
    return qk, qk // 2


@_jit
def _f16_bits(v: np.float32) -> int:
    """``GGML_FP32_TO_FP16(v)`` as an int: RNE on the bits for |v| in [2^-14, 65520), else fp32_to_fp16. A
    scalar bit cast, no scratch array: a call taking arrays costs Numba's reference counting, once per block."""
    bits = np.float32(v).view(np.uint32)
    a = bits & _ABS
    if a >= np.uint32(0x38800000) and a < np.uint32(0x477FF000):
        r = a - np.uint32(0x38000000)
        r = (r + np.uint32(0xFFF) + ((r >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13)
        return int(((bits >> np.uint32(16)) & np.uint32(0x8000)) | r)
    return int(fp32_to_fp16(v))


@_jit
def _key(v: np.uint32) -> np.int32:
    """Float bits to an int32 of the same order for finite floats (-0.0 maps to -1, +0.0 to 0); its own
    inverse on the bits."""
    s = np.int32(v)
    return s ^ ((s >> np.int32(31)) & np.int32(0x7FFFFFFF))


@_jit
def _scales_absmax(u: np.ndarray, div: np.float32, dv: np.ndarray, idv: np.ndarray) -> None:
    """q4_0/q5_0, every block of the row: ``d = max / div``, ``id = d ? 1/d : 0`` into ``dv``/``idv``.

    ggml's ``max`` is the first element (index order) of largest |v|, or +0.0 when all are zero
    (``if (amax < fabsf(v))`` never fires). It is the block's largest or its smallest value, whichever has
    the larger |v|: both come from an integer minimum and maximum of order-preserving keys (vectorizable).
    Only when they are opposite (|min| = |max| > 0, both signs hold the largest |v|) does the first of
    them need a loop in index order.
    """
    nb = dv.shape[0]
    qk = _block_len(u.shape[0], nb)[0]
    for b in range(nb):
        base = b * QK
        kn = np.int32(0x7FFFFFFF)
        kx = np.int32(-0x7FFFFFFF - 1)
        for j in range(qk):
            s = np.int32(u[_U(base + j)])
            k = s ^ ((s >> np.int32(31)) & np.int32(0x7FFFFFFF))
            kn = min(kn, k)
            kx = max(kx, k)
        mnb = np.uint32(_key(np.uint32(kn)))
        mxb = np.uint32(_key(np.uint32(kx)))
        an = mnb & _ABS
        ax = mxb & _ABS
        mb = mxb if ax > an else mnb
        if ax == an and mnb != mxb:  # +m and -m (or +0 and -0) both in the block
            mb = np.uint32(0)
            if ax != np.uint32(0):
                for j in range(qk):
                    v = u[_U(base + j)]
                    if v & _ABS == ax:
                        mb = v
                        break
        mb = mb if ax | an != np.uint32(0) else np.uint32(0)  # all zeros: max stays +0.0
        d = np.float32(np.uint32(mb).view(np.float32) / div)
        dv[b] = d
        idv[b] = np.float32(np.float32(1.0) / d) if d != np.float32(0.0) else np.float32(0.0)


@_jit
def _scales_min_max(xr: np.ndarray, u: np.ndarray, div: np.float32, dv: np.ndarray, idv: np.ndarray,
                    mnv: np.ndarray) -> None:
    """q4_1/q5_1, every block: ``d = (max - min) / div``, ``id = d ? 1/d : 0``, ``min`` into the arrays.

    ggml's ``if (v < min) min = v; if (v > max) max = v;`` from (FLT_MAX, -FLT_MAX) in index order, as an
    integer minimum and maximum of order-preserving keys (vectorizable): equal nonzero floats have equal
    bits, so only a zero extreme (whose sign is that of the first zero) needs the loop in index order.
    """
    nb = dv.shape[0]
    qk = _block_len(u.shape[0], nb)[0]
    for b in range(nb):
        base = b * QK
        kn = np.int32(0x7FFFFFFF)
        kx = np.int32(-0x7FFFFFFF - 1)
        for j in range(qk):
            s = np.int32(u[_U(base + j)])
            k = s ^ ((s >> np.int32(31)) & np.int32(0x7FFFFFFF))
            kn = min(kn, k)
            kx = max(kx, k)
        if kn != np.int32(0) and kn != np.int32(-1) and kx != np.int32(0) and kx != np.int32(-1):
            mn = np.uint32(_key(np.uint32(kn))).view(np.float32)
            mx = np.uint32(_key(np.uint32(kx))).view(np.float32)
        else:
            mn = _F32_MAX
            mx = -_F32_MAX
            for j in range(qk):
                v = xr[_U(base + j)]
                if v < mn:
                    mn = v
                if v > mx:
                    mx = v
        d = np.float32(np.float32(mx - mn) / div)
        dv[b] = d
        idv[b] = np.float32(np.float32(1.0) / d) if d != np.float32(0.0) else np.float32(0.0)
        mnv[b] = mn


# --- whole rows: the per-block scales first (one call), then per block ggml's float32 operations in ggml's
# --- order with the scale broadcast, packed as they are computed (vectorized loops over the block) ------


@_jit_inline
def q4_0_ref_row(xr: np.ndarray, o_r: np.ndarray, bad: np.ndarray) -> bool:
    """``quantize_row_q4_0_ref`` of one row; True if some block (flagged in ``bad``) still needs the scalar
    block function (its id overflowed)."""
    nb = xr.shape[0] // QK
    half = _block_len(xr.shape[0], nb)[1]
    dv = np.empty(nb, np.float32)
    idv = np.empty(nb, np.float32)
    _scales_absmax(xr.view(np.uint32), np.float32(-8.0), dv, idv)
    any_bad = False
    for b in range(nb):
        base = b * QK
        idb = idv[b]
        if not abs(idb) < np.float32(np.inf):
            bad[b] = 1
            any_bad = True
            continue
        o = b * 18
        h = _f16_bits(dv[b])
        o_r[_U(o)] = h & 0xFF
        o_r[_U(o + 1)] = (h >> 8) & 0xFF
        for j in range(half):  # x*id + 8.5 lies in (0, 17): (int8_t) is a plain truncation
            q0 = min(np.int32(15), np.int32(np.float32(np.float32(xr[_U(base + j)] * idb) + np.float32(8.5))))
            q1 = min(np.int32(15), np.int32(np.float32(np.float32(xr[_U(base + half + j)] * idb)
                                                       + np.float32(8.5))))
            o_r[_U(o + 2 + j)] = np.uint8(q0 | (q1 << np.int32(4)))
    return any_bad


@_jit_inline
def q5_0_ref_row(xr: np.ndarray, o_r: np.ndarray, bad: np.ndarray) -> bool:
    """``quantize_row_q5_0_ref`` of one row (see :func:`q4_0_ref_row`)."""
    nb = xr.shape[0] // QK
    half = _block_len(xr.shape[0], nb)[1]
    dv = np.empty(nb, np.float32)
    idv = np.empty(nb, np.float32)
    _scales_absmax(xr.view(np.uint32), np.float32(-16.0), dv, idv)
    any_bad = False
    for b in range(nb):
        base = b * QK
        idb = idv[b]
        if not abs(idb) < np.float32(np.inf):
            bad[b] = 1
            any_bad = True
            continue
        o = b * 22
        h = _f16_bits(dv[b])
        o_r[_U(o)] = h & 0xFF
        o_r[_U(o + 1)] = (h >> 8) & 0xFF
        qh = np.uint32(0)
        for j in range(half):  # x*id + 16.5 lies in (0, 33)
            q0 = min(np.int32(31), np.int32(np.float32(np.float32(xr[_U(base + j)] * idb) + np.float32(16.5))))
            q1 = min(np.int32(31), np.int32(np.float32(np.float32(xr[_U(base + half + j)] * idb)
                                                       + np.float32(16.5))))
            o_r[_U(o + 6 + j)] = np.uint8((q0 & np.int32(0x0F)) | ((q1 & np.int32(0x0F)) << np.int32(4)))
            qh |= (np.uint32(q0 >> np.int32(4)) << np.uint32(j)) | (np.uint32(q1 >> np.int32(4)) << np.uint32(j + half))
        for k in range(4):
            o_r[_U(o + 2 + k)] = np.uint8((qh >> np.uint32(8 * k)) & np.uint32(0xFF))
    return any_bad


@_jit_inline
def q4_1_ref_row(xr: np.ndarray, o_r: np.ndarray, bad: np.ndarray) -> bool:
    """``quantize_row_q4_1_ref`` of one row (see :func:`q4_0_ref_row`; flagged: d or id not finite)."""
    nb = xr.shape[0] // QK
    half = _block_len(xr.shape[0], nb)[1]
    dv = np.empty(nb, np.float32)
    idv = np.empty(nb, np.float32)
    mnv = np.empty(nb, np.float32)
    _scales_min_max(xr, xr.view(np.uint32), np.float32(15.0), dv, idv, mnv)
    any_bad = False
    for b in range(nb):
        base = b * QK
        d = dv[b]
        idb = idv[b]
        mn = mnv[b]
        if not (abs(d) < np.float32(np.inf) and abs(idb) < np.float32(np.inf)):
            bad[b] = 1
            any_bad = True
            continue
        o = b * 20
        h = _f16_bits(d)
        o_r[_U(o)] = h & 0xFF
        o_r[_U(o + 1)] = (h >> 8) & 0xFF
        h = _f16_bits(mn)
        o_r[_U(o + 2)] = h & 0xFF
        o_r[_U(o + 3)] = (h >> 8) & 0xFF
        for j in range(half):  # (x-min)*id + 0.5 lies in [0.5, 15.5+eps]
            q0 = min(np.int32(15), np.int32(np.float32(np.float32(np.float32(xr[_U(base + j)] - mn) * idb)
                                                       + np.float32(0.5))))
            q1 = min(np.int32(15), np.int32(np.float32(np.float32(np.float32(xr[_U(base + half + j)] - mn) * idb)
                                                       + np.float32(0.5))))
            o_r[_U(o + 4 + j)] = np.uint8(q0 | (q1 << np.int32(4)))
    return any_bad


@_jit_inline
def q5_1_ref_row(xr: np.ndarray, o_r: np.ndarray, bad: np.ndarray) -> bool:
    """``quantize_row_q5_1_ref`` of one row (see :func:`q4_1_ref_row`)."""
    nb = xr.shape[0] // QK
    half = _block_len(xr.shape[0], nb)[1]
    dv = np.empty(nb, np.float32)
    idv = np.empty(nb, np.float32)
    mnv = np.empty(nb, np.float32)
    _scales_min_max(xr, xr.view(np.uint32), np.float32(31.0), dv, idv, mnv)
    any_bad = False
    for b in range(nb):
        base = b * QK
        d = dv[b]
        idb = idv[b]
        mn = mnv[b]
        if not (abs(d) < np.float32(np.inf) and abs(idb) < np.float32(np.inf)):
            bad[b] = 1
            any_bad = True
            continue
        o = b * 24
        h = _f16_bits(d)
        o_r[_U(o)] = h & 0xFF
        o_r[_U(o + 1)] = (h >> 8) & 0xFF
        h = _f16_bits(mn)
        o_r[_U(o + 2)] = h & 0xFF
        o_r[_U(o + 3)] = (h >> 8) & 0xFF
        qh = np.uint32(0)
        for j in range(half):  # (x-min)*id + 0.5 lies in [0.5, 31.5+eps]: (uint8_t) is a plain truncation
            q0 = np.int32(np.float32(np.float32(np.float32(xr[_U(base + j)] - mn) * idb) + np.float32(0.5)))
            q1 = np.int32(np.float32(np.float32(np.float32(xr[_U(base + half + j)] - mn) * idb) + np.float32(0.5)))
            o_r[_U(o + 8 + j)] = np.uint8((q0 & np.int32(0x0F)) | ((q1 & np.int32(0x0F)) << np.int32(4)))
            qh |= (np.uint32((q0 >> np.int32(4)) & np.int32(1)) << np.uint32(j)) | (
                np.uint32((q1 >> np.int32(4)) & np.int32(1)) << np.uint32(j + half))
        for k in range(4):
            o_r[_U(o + 4 + k)] = np.uint8((qh >> np.uint32(8 * k)) & np.uint32(0xFF))
    return any_bad


# --- Q8_0: the block's |x| maximum and the rounding loop over a run-time block length (vectorized) ---------
@_jit_inline
def q8_0_ref_row(xr: np.ndarray, o_r: np.ndarray, bad: np.ndarray) -> bool:
    """``quantize_row_q8_0_ref`` of one row; True if some block (flagged in ``bad``) still needs the scalar
    block function (``amax * id`` above 128: ``roundf`` would leave the int8 range, C's conversion decides)."""
    nb = xr.shape[0] // QK
    qk = _block_len(xr.shape[0], nb)[0]
    u = xr.view(np.uint32)
    any_bad = False
    for b in range(nb):
        base = b * QK
        m = np.uint32(0)
        for j in range(qk):
            m = max(m, u[_U(base + j)] & _ABS)
        amax = np.uint32(m).view(np.float32)
        d = np.float32(amax / np.float32(127.0))
        idb = np.float32(np.float32(1.0) / d) if d != np.float32(0.0) else np.float32(0.0)
        if not np.float32(amax * idb) <= np.float32(128.0):
            bad[b] = 1
            any_bad = True
            continue
        o = b * 34
        h = _f16_bits(d)
        o_r[_U(o)] = h & 0xFF
        o_r[_U(o + 1)] = (h >> 8) & 0xFF
        for j in range(qk):
            # roundf(x*id) for |x*id| <= 128: truncate, then away from zero when the fraction is >= 1/2 (exact)
            v = np.float32(xr[_U(base + j)] * idb)
            a = abs(v)
            q = np.int32(a)
            q = q + np.int32(np.float32(a - np.float32(q)) >= np.float32(0.5))
            q = -q if v < np.float32(0.0) else q
            o_r[_U(o + 2 + j)] = np.uint8(q & np.int32(0xFF))
    return any_bad
