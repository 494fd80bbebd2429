"""Float32-exact scalar helpers shared by every quantization kernel (CPU prange loops and CUDA kernels).

Everything here mirrors one routine of ggml (ggml-impl.h, ggml.c):

* :func:`fp32_to_fp16` - ``GGML_FP32_TO_FP16`` (software path of ``ggml-impl.h``): IEEE binary16,
  round-to-nearest-even, subnormals rounded too, ``|x| >= 65520`` -> inf, sign of zero kept, NaN ->
  ``sign | 0x7E00``.
* :func:`fp32_to_fp16_x86` - the same for a computed scale, NaN stored as x86 makes it (0xFE00).
* :func:`fp16_to_fp32` - ``GGML_FP16_TO_FP32``, exact.
* :func:`nearest_int` - ggml's ``nearest_int`` magic-number trick (round half to even for |v| < 2^22).
* :func:`roundf` - C ``roundf`` (round half away from zero), returned as an int.
* :func:`fmul`, :func:`fadd`, :func:`fsub` - one IEEE float32 operation each. Block math calls them
  wherever the reference rounds a product before adding to it, so a target that would contract
  ``a*b+c`` into a fused multiply-add (NVVM does by default) can be pinned to separate roundings.

All functions are ``@numba.njit(cache=True)`` with ``fastmath=False`` (fastmath permits FMA contraction)
and use only scalar float64/int arithmetic plus ``math.frexp``/``math.ldexp``/``math.floor``/
``math.copysign``, which Numba supports on both the CPU and the CUDA target. float64 is used only where it
is exact (widening an f32, scaling by powers of two, rint of values below 2^51).

The whole-array helpers at the end convert tensors for the F16/BF16 targets: :func:`f32_to_f16_array` with
NumPy, whose float16 cast is the same RNE as ggml-impl.h ggml_compute_fp32_to_fp16 for every non-NaN input
(verified exhaustively), and :func:`f32_to_bf16_array` in one parallel Numba pass.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from ggufkit.quant.kernels.numba_loading import install_lazy_cache_loads

install_lazy_cache_loads()  # every kernel module imports this one, so this runs before any kernel

# 2^52: adding then subtracting it rounds a float64 in [0, 2^51) to an integer, half to even.
_RINT_MAGIC = 4503599627370496.0
_TWO_M24 = 5.9604644775390625e-08  # 2^-24, the f16 subnormal step
_F16_MIN_NORMAL = 6.103515625e-05  # 2^-14


@numba.njit(cache=True, fastmath=False)
def _rint_pos(v: float) -> int:
    """Round a float64 in [0, 2^51) to the nearest integer, ties to even (exact; no library call)."""
    return int((v + _RINT_MAGIC) - _RINT_MAGIC)


@numba.njit(cache=True, fastmath=False)
def fp32_to_fp16(x: np.float32) -> np.uint16:
    """f32 -> f16 bits, exactly as ``GGML_FP32_TO_FP16`` (IEEE round-to-nearest-even).

    Args:
        x: a float32 scalar.

    Returns:
        The binary16 bit pattern as uint16 (``-0.0`` -> ``0x8000``; NaN -> ``sign | 0x7E00``).
    """
    f = float(x)  # widening f32 -> f64 is exact
    sign = 0x8000 if math.copysign(1.0, f) < 0.0 else 0
    if f != f:
        return np.uint16(sign | 0x7E00)
    a = abs(f)
    if a >= 65520.0:  # rounds up to 2^16 or more: overflow to inf (also catches inf)
        return np.uint16(sign | 0x7C00)
    if a < _F16_MIN_NORMAL:
        # Subnormal range: the result is a multiple of 2^-24; a rounding up to 1024 is exactly the
        # bit pattern of the smallest normal, so no special case is needed.
        return np.uint16(sign | _rint_pos(a / _TWO_M24))
    m, e = math.frexp(a)  # a = m * 2^e, m in [0.5, 1)
    q = _rint_pos(m * 2048.0)  # 11 significant bits, in [1024, 2048]
    exp = e - 1
    if q == 2048:
        exp += 1
        q = 1024
    return np.uint16(sign | ((exp + 15) << 10) | (q - 1024))


@numba.njit(cache=True, fastmath=False)
def fp32_to_fp16_x86(v: np.float32) -> int:
    """:func:`fp32_to_fp16` of a computed scale, with the NaN sign x86 gives it.

    With an imatrix and overflowing weights (|x| ~ 1e19 and up, x*x = inf) a scale fit returns NaN. x86
    creates every NaN as 0xFFC00000 (sign set) and arithmetic passes it on unchanged, so ggml stores 0xFE00;
    CUDA's canonical NaN is positive, so the sign is fixed here rather than taken from the value.
    """
    if v != v:
        return 0xFE00
    return np.int64(fp32_to_fp16(v))


@numba.njit(cache=True, fastmath=False)
def fp16_to_fp32(h: np.uint16) -> np.float32:
    """f16 bits -> f32 value, exactly as ``GGML_FP16_TO_FP32``.

    Args:
        h: a binary16 bit pattern (any integer type; only the low 16 bits are used).

    Returns:
        The float32 value (exact: every binary16 value is representable).
    """
    b = int(h) & 0xFFFF
    e = (b >> 10) & 0x1F
    m = b & 0x3FF
    if e == 0:
        v = float(m) * _TWO_M24
    elif e == 31:
        v = math.inf if m == 0 else math.nan
    else:
        v = math.ldexp(float(m + 1024), e - 25)
    if b & 0x8000:
        v = -v
    return np.float32(v)


@numba.njit(cache=True, fastmath=False)
def nearest_int(v: np.float32) -> int:
    """ggml's ``nearest_int``: ``v + 1.5*2^23`` in f32 (rounds half to even), minus the magic.

    Exact for |v| < 2^22 (the C code asserts that range, compiled out in release builds).

    Args:
        v: a float32 scalar.

    Returns:
        The rounded value as an int.
    """
    s = np.float32(v) + np.float32(12582912.0)
    f = float(s)
    a = abs(f)
    if 8388608.0 <= a < 16777216.0:  # |v| < 2^22: the mantissa bits are s - 2^23 (the common case)
        return int(a) - 12582912
    # Degenerate inputs (NaN/inf from an overflowed scale, |v| >= 2^22): ggml reads the *bits* of s, so
    # reproduce its mantissa field exactly instead of relying on a float->int conversion, whose
    # out-of-range result differs between x86 and CUDA.
    if f != f:
        mant = 0x400000  # x86's default NaN (0xFFC00000), the only NaN float arithmetic creates there
    elif a == math.inf:
        mant = 0
    elif a < 1.1754943508222875e-38:  # subnormal: the mantissa field is a / 2^-149
        mant = int(a * 7.1362384635297994e44)
    else:
        m, _ = math.frexp(a)
        mant = int((m * 2.0 - 1.0) * 8388608.0)
    return mant - 0x400000


@numba.njit(cache=True, fastmath=False)
def roundf(v: np.float32) -> int:
    """C ``roundf`` (half away from zero) of a float32, as an int.

    ``floor(|v| + 0.5)`` is evaluated in float64, where the addition is exact for every f32 below 2^52
    (in f32 it would round 0.49999997 up to 1).

    Args:
        v: a float32 scalar (finite).

    Returns:
        The rounded value.
    """
    f = float(v)
    r = math.floor(abs(f) + 0.5)
    return int(-r) if f < 0.0 else int(r)


@numba.njit(cache=True, fastmath=False)
def fmul(a: np.float32, b: np.float32) -> np.float32:
    """One rounded float32 product; a separately rounded step that must not fuse with a later add."""
    return np.float32(np.float32(a) * np.float32(b))


@numba.njit(cache=True, fastmath=False)
def fadd(a: np.float32, b: np.float32) -> np.float32:
    """One rounded float32 sum."""
    return np.float32(np.float32(a) + np.float32(b))


@numba.njit(cache=True, fastmath=False)
def fsub(a: np.float32, b: np.float32) -> np.float32:
    """One rounded float32 difference."""
    return np.float32(np.float32(a) - np.float32(b))


def f32_to_f16_array(x: np.ndarray) -> np.ndarray:
    """Convert float32 values to f16 bits (uint16, same shape), as ``ggml_fp32_to_fp16_row``.

    Args:
        x: float32 array.

    Returns:
        uint16 array of binary16 bit patterns; NaN becomes ``sign | 0x7E00`` like ggml.
    """
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(over="ignore"):
        out = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out = out.copy()
        out[nan] = (x[nan].view(np.uint32) >> 16).astype(np.uint16) & 0x8000 | 0x7E00
    return out


def f32_to_bf16_array(x: np.ndarray) -> np.ndarray:
    """Convert float32 values to bf16 bits (uint16, same shape), as ``ggml_fp32_to_bf16_row_ref``.

    Args:
        x: float32 array.

    Returns:
        uint16 array: round-to-nearest-even on the bits; NaN -> ``(bits >> 16) | 0x40``.
    """
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    out = np.empty(bits.shape, dtype=np.uint16)
    _bf16_bits(bits.reshape(-1), out.reshape(-1))
    return out


_BF16_CHUNK = 1 << 16


@numba.njit(parallel=True, cache=True)
def _bf16_bits(bits: np.ndarray, out: np.ndarray) -> None:
    # ggml-impl.h ggml_compute_fp32_to_bf16 over a flat array, in parallel chunks (one pass, where NumPy
    # needed several over uint64 temporaries). Below NaN the rounded sum stays under 2^32.
    n = bits.shape[0]
    for c in numba.prange((n + _BF16_CHUNK - 1) // _BF16_CHUNK):
        for i in range(c * _BF16_CHUNK, min(n, (c + 1) * _BF16_CHUNK)):
            b = np.uint32(bits[i])
            rounded = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            quiet = (b >> np.uint32(16)) | np.uint32(0x40)
            out[i] = quiet if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else rounded


#: 2^112: f16 bits moved into a float32's place read as the value times 2^-112 (see widen_f16_row).
_F16_RESCALE = np.float32(5.192296858534828e33)


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def widen_f16_row(h: np.ndarray, x: np.ndarray) -> bool:
    """``x[:]`` = the values of the binary16 bit patterns ``h`` (uint16[n] -> float32[n]), exactly; True when
    ``h`` holds an inf or NaN (exponent field all ones), whose places in ``x`` then hold no meaningful value.

    Arithmetic, not a 65536-entry table (a gather per element, slow on some AVX2 CPUs): the sign moved to
    bit 31 and the other 15 bits shifted into float32 position (<< 13) read as the value times 2^-112 --
    a normal half's exponent then lacks the 127 - 15 = 112 of rebiasing, a subnormal half m * 2^-24 becomes
    the float32 subnormal m * 2^-136 -- so one multiplication by 2^112, exact for both, gives the value
    (as ``GGML_FP16_TO_FP32``, ggml-impl.h). Float32 subnormals must not be read as zero (the x86 DAZ
    flag, which nothing here sets). Two vectorized passes over the row.
    """
    u = x.view(np.uint32)
    flag = np.uint32(0)
    for j in range(h.shape[0]):
        v = np.uint32(h[np.uintp(j)])
        u[np.uintp(j)] = ((v & np.uint32(0x7FFF)) << np.uint32(13)) | ((v & np.uint32(0x8000)) << np.uint32(16))
        flag |= (v & np.uint32(0x7C00)) + np.uint32(0x0400)  # bit 15 set only by an all-ones exponent
    for j in range(x.shape[0]):
        x[np.uintp(j)] = x[np.uintp(j)] * _F16_RESCALE
    return (flag >> np.uint32(15)) != np.uint32(0)


@numba.njit(cache=True, fastmath=False, parallel=True)
def f16_bits_to_f32_rows(src: np.ndarray, dst: np.ndarray, bad_rows: np.ndarray) -> None:
    """Widen f16 bits to float32 (exact, :func:`widen_f16_row`), flagging rows with inf/NaN.

    Args:
        src: uint16[n_rows, n] binary16 bit patterns (C-contiguous).
        dst: float32[n_rows, n] output (C-contiguous).
        bad_rows: uint8[n_rows], set to 1 where a row holds an inf or NaN (exponent field all ones).
    """
    for r in numba.prange(src.shape[0]):
        bad_rows[r] = widen_f16_row(src[r], dst[r])


@numba.njit(cache=True, fastmath=False)
def f32_non_finite_rows(x: np.ndarray, bad_rows: np.ndarray) -> None:
    """Flag rows of C-contiguous float32[n_rows, n] holding an inf or NaN (``bad_rows`` uint8[n_rows]).

    On the bits: an all-ones exponent plus one exponent step carries into bit 31, and an OR over the row
    keeps it. Integer OR vectorises (a float reduction does not without fastmath), so one thread runs at
    memory speed (~1.5 G values/s), faster than a parallel float loop and immune to busy cores.
    """
    bits = x.view(np.uint32)
    for r in range(bits.shape[0]):
        m = np.uint32(0)
        row = bits[r]
        for j in range(row.shape[0]):
            m |= (row[j] & np.uint32(0x7F800000)) + np.uint32(0x00800000)
        bad_rows[r] = (m >> np.uint32(31)) & np.uint32(1)
