"""The one dispatch point: validate input, pick the device, set the thread count, run a kernel.

:func:`quantize` and :func:`dequantize` (re-exported as ``ggufkit.quant.quantize`` / ``dequantize``) are
the only callers of the kernels in :mod:`ggufkit.quant.registry`. Numba, and ``numba.cuda`` (only through
the ``cuda_*`` modules), are imported lazily inside them.

F16 input on the CPU goes, for the types with one (the legacy types, Q6_K and MXFP4), to a fused kernel that
widens each row inside the parallel loop (:mod:`ggufkit.quant.kernels.legacy.cpu_f16`, :mod:`ggufkit.quant.kernels.kquants.cpu_f16`,
:mod:`ggufkit.quant.kernels.lowbit.mxfp4_f16`);
other types widen the whole array first, in one parallel pass that also looks for inf/NaN.

Devices: ``"cpu"``; ``"cuda"`` (an error if Numba sees no GPU); ``"auto"`` (CUDA when Numba sees a GPU,
else CPU). Output bytes are the same on every device and for every thread count: each kernel iteration
writes one output block and all arithmetic is float32 with ggml's evaluation order.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ggufkit.errors import DeviceUnavailableError, QuantizationError, UsageError
from ggufkit.quant.registry import FLOAT_TYPES, KERNELS, SUPPORTED_TYPES

DEVICES = ("auto", "cpu", "cuda")
#: F16 input with at least this many rows goes to the fused widen-and-quantize CPU kernels, which run
#: one row per parallel iteration; fewer rows would leave threads idle, so they take the two-pass path.
_FUSED_MIN_ROWS = 64


def _no_nvidia_driver() -> bool:
    """True when this Linux machine certainly has no NVIDIA driver loaded.

    Importing ``numba.cuda`` (and the SciPy it pulls in) costs about a second; without a driver the
    answer is "no GPU" anyway, so ``--device auto`` skips the import. Only Linux is judged (the driver
    creates /proc/driver/nvidia and /dev/nvidiactl; WSL exposes /dev/dxg); elsewhere, and under Numba's
    CUDA simulator, Numba is asked.
    """
    if not sys.platform.startswith("linux") or os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        return False
    numba = sys.modules.get("numba")
    if numba is not None and getattr(numba.config, "ENABLE_CUDASIM", False):
        return False
    return not any(os.path.exists(p) for p in ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/dxg"))


def cuda_available() -> bool:
    """Whether Numba sees a usable CUDA GPU (imports ``numba.cuda`` through the CUDA kernel module, unless
    the machine has no NVIDIA driver at all)."""
    if _no_nvidia_driver():
        return False
    from ggufkit.quant.kernels.cuda_base import is_available

    return is_available()


def resolve_device(device: str) -> str:
    """Map ``"auto"``/``"cpu"``/``"cuda"`` to the backend that will run.

    Args:
        device: the requested device.

    Returns:
        ``"cpu"`` or ``"cuda"``.

    Raises:
        UsageError: an unknown device name.
        DeviceUnavailableError: ``"cuda"`` was asked for and Numba sees no GPU.
    """
    if device not in DEVICES:
        raise UsageError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if device == "cpu":
        return "cpu"
    if cuda_available():
        return "cuda"
    if device == "cuda":
        raise DeviceUnavailableError("device 'cuda' requested but Numba finds no CUDA GPU; use --device cpu or auto")
    return "cpu"


#: OpenMP settings a user may have chosen for Numba's OpenMP thread pool; :func:`start_numba_threads` sets
#: its wait policy only where none of them is in the environment.
_OMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
_threads_started = False


def start_numba_threads() -> None:
    """Start Numba's thread pool, with OpenMP's passive wait policy unless the environment chose one.

    With the OpenMP threading layer (Numba's default on Linux, GNU libgomp) a thread that has finished its
    share of a parallel loop spins at the closing barrier for ``GOMP_SPINCOUNT`` (300000 by default) pause
    instructions before it sleeps: about 10 ms on this project's Xeon. On a machine whose other cores are
    busy the spinning thread keeps its core while the late thread waits for one, so a 4M-weight TQ1_0 call
    took 24 ms at 2 threads against 14 ms at 1 (F16 widening: 12 ms against 2 ms), at a load average of
    4 on 2 cores. llama-quantize's workers (``std::thread`` joins) sleep instead. ``OMP_WAIT_POLICY=PASSIVE``
    makes libgomp sleep at once (measured: 12-16 ms at 2 threads). libgomp reads its environment once,
    when it is loaded, and Numba loads it when the pool starts (``numba.get_num_threads`` starts it), so
    the variable is set only around that start and removed again: child processes (llama.cpp's tools
    built with OpenMP) keep the caller's environment. The bytes do not depend on it.
    """
    global _threads_started
    if _threads_started:
        return
    import numba

    set_here = not any(v in os.environ for v in _OMP_WAIT_VARS)
    if set_here:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        numba.get_num_threads()  # launches the threading layer (loads libgomp for the "omp" layer)
    finally:
        if set_here:
            os.environ.pop("OMP_WAIT_POLICY", None)
    _threads_started = True


@contextmanager
def numba_threads(threads: int | None) -> Iterator[None]:
    """Run the body with ``numba.set_num_threads(threads)``, restoring the previous count afterwards.

    Args:
        threads: 1 .. ``numba.config.NUMBA_NUM_THREADS``, or None to leave the count alone.

    Raises:
        UsageError: a thread count outside that range.
    """
    start_numba_threads()
    if threads is None:
        yield
        return
    import numba

    limit = numba.config.NUMBA_NUM_THREADS
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= limit:
        raise UsageError(f"threads must be an integer from 1 to {limit} (NUMBA_NUM_THREADS), got {threads!r}")
    previous = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        yield
    finally:
        numba.set_num_threads(previous)


def _as_type(qtype: GGMLQuantizationType | int) -> GGMLQuantizationType:
    try:
        t = GGMLQuantizationType(qtype)
    except ValueError:
        raise UsageError(f"unknown GGML type {qtype!r}") from None
    if t not in SUPPORTED_TYPES:
        names = ", ".join(sorted(s.name for s in SUPPORTED_TYPES))
        raise UsageError(f"ggufkit cannot quantize to {t.name}; supported: {names}")
    return t


#: Weights per kernel call in the file pipeline (64 MiB of f32): bounds memory for huge tensors while keeping
#: every call large enough to use all threads.
SLAB_ELEMENTS = 16 * 1024 * 1024

# F16 rows widened for a kernel that only reads them go into one float32 buffer per thread, reused: a fresh
# 64 MB array costs a page fault per 4 KiB, which took longer than the widening itself (1.1B F16 to TQ2_0:
# 0.27-0.6 ns per weight in fresh arrays against 0.18 reused). Arrays above one slab get a fresh buffer, so
# what stays allocated is bounded.
_widen_buffers = threading.local()


def _widening_buffer(shape: tuple[int, int]) -> np.ndarray:
    n = shape[0] * shape[1]
    if n > SLAB_ELEMENTS:
        return np.empty(shape, dtype=np.float32)
    buf: np.ndarray | None = getattr(_widen_buffers, "f32", None)
    if buf is None or buf.size < n:
        buf = np.empty(n, dtype=np.float32)
        _widen_buffers.f32 = buf
    return buf[:n].reshape(shape)


def _to_f32_rows(x: np.ndarray, reuse: bool = False) -> tuple[np.ndarray, int | None]:
    """float32/float16 [rows, n] -> C-contiguous float32, plus the flat index of the first inf/NaN.

    Both passes run as one parallel Numba loop (numpy's float16 cast and isfinite are single-threaded
    and, for F16 input, slower than the quantizers themselves). With ``reuse``, F16 input is widened into
    this thread's reused buffer: the result is valid only until this thread's next call.
    """
    from ggufkit.quant.kernels.fp import f16_bits_to_f32_rows, f32_non_finite_rows

    bad_rows = np.zeros(x.shape[0], dtype=np.uint8)
    if x.dtype == np.float16:
        out = _widening_buffer(x.shape) if reuse else np.empty(x.shape, dtype=np.float32)
        f16_bits_to_f32_rows(np.ascontiguousarray(x).view(np.uint16), out, bad_rows)
    else:
        out = np.ascontiguousarray(x, dtype=np.float32)
        f32_non_finite_rows(out, bad_rows)
    if not bad_rows.any():
        return out, None
    r = int(np.argmax(bad_rows))
    if x.dtype == np.float16:
        out[r] = x[r]  # the fast widening leaves the places of inf/NaN unspecified; numpy's cast keeps them
    return out, r * x.shape[1] + int(np.argmax(~np.isfinite(out[r])))


def quantize(data: np.ndarray, qtype: GGMLQuantizationType, *, imatrix: np.ndarray | None = None,
             device: str = "cpu", threads: int | None = None, name: str | None = None) -> np.ndarray:
    """Quantize float weights exactly as ggml's ``ggml_quantize_chunk`` does.

    Without an imatrix the reference quantizers (``quantize_row_*_ref``) run, as llama-quantize uses them;
    with one, the weighted ``quantize_row_*_impl`` variants (Q8_0 ignores the imatrix, like ggml).
    F16 rounds to nearest even, BF16 uses ggml's rounding (NaN kept quiet), F32 is a copy.

    NaN/inf policy: any non-finite input raises :class:`QuantizationError` (llama-quantize also refuses
    such tensors: "tensor ... has invalid data"), for every target type.

    Args:
        data: float32 (or float16, converted exactly) array of shape ``[..., n_per_row]``.
        qtype: the target type: a key of ``KERNELS`` or F32/F16/BF16.
        imatrix: optional float32 importance weights of length ``n_per_row``.
        device: ``"cpu"``, ``"cuda"`` or ``"auto"``; the bytes do not depend on it.
        threads: Numba CPU threads for this call (restored afterwards); None keeps the current count.
        name: tensor name used in error messages.

    Returns:
        uint8 array ``[..., row_bytes]`` in ggml's block layout (for F16/BF16/F32: the raw element bytes).

    Raises:
        QuantizationError: non-finite input, a row length that is not a multiple of the block size, an
            imatrix of the wrong length or with non-finite values.
        UsageError: an unsupported type, device or thread count; a non-float input.
        DeviceUnavailableError: ``device="cuda"`` without a GPU.

    Example:
        >>> q = quantize(np.ones((2, 64), np.float32), GGMLQuantizationType.Q8_0)
        >>> q.shape
        (2, 68)
    """
    t = _as_type(qtype)
    dev = resolve_device(device)  # before any work: a missing GPU fails fast
    if dev == "cuda" and t in KERNELS and not KERNELS[t].has_cuda:
        dev = "cpu"  # a CPU-only type (the grid types); the plan and summary report it
    x = np.asarray(data)
    if x.dtype not in (np.float32, np.float16):
        raise UsageError(f"quantize expects float32 or float16 data, got {x.dtype}")
    if x.ndim == 0:
        raise UsageError("quantize expects an array with at least one dimension")
    n_per_row = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    block, size = GGML_QUANT_SIZES[t]
    if n_per_row % block:
        raise QuantizationError(f"row length {n_per_row} is not a multiple of {t.name}'s block size {block}",
                                tensor=name)
    shape = x.shape
    qw = np.zeros(0, dtype=np.float32)
    if imatrix is not None and t not in FLOAT_TYPES:
        qw = np.ascontiguousarray(imatrix, dtype=np.float32).reshape(-1)
        if qw.size != n_per_row:
            raise QuantizationError(f"imatrix has {qw.size} values, the rows have {n_per_row}", tensor=name)
        if not np.isfinite(qw).all():
            raise QuantizationError("imatrix contains NaN/inf", tensor=name)
    out_shape = (*shape[:-1], n_per_row // block * size)
    fused = KERNELS[t].cpu_f16() if (t in KERNELS and dev == "cpu" and x.dtype == np.float16
                                     and rows >= _FUSED_MIN_ROWS and n_per_row > 0) else None
    if fused is not None:
        h = np.ascontiguousarray(x).view(np.uint16).reshape(rows, n_per_row)
        out = np.empty((rows, out_shape[-1]), dtype=np.uint8)
        bad_rows = np.zeros(rows, dtype=np.uint8)
        with numba_threads(threads), _parallel_chunksize(KERNELS[t].chunksize):
            fused(h, qw, out, bad_rows)
        if bad_rows.any():
            r = int(np.argmax(bad_rows))
            row = h[r].view(np.float16).astype(np.float32)
            _raise_non_finite(row, r * n_per_row, name)
        return out.reshape(out_shape)
    if dev == "cuda" and not (t in KERNELS and KERNELS[t].cuda_module):
        dev = "cpu"  # the grid types (IQ1/IQ2/IQ3) have CPU kernels only; the planner reports it
    if dev == "cuda" and x.dtype == np.float16 and t not in FLOAT_TYPES and rows and n_per_row:
        return _quantize_f16_on_gpu(t, x.reshape(rows, n_per_row), qw, name).reshape(out_shape)
    with numba_threads(threads):
        # only a block type's kernel reads the widened rows; F32 output returns them
        x, bad = _to_f32_rows(x.reshape(rows, n_per_row), reuse=t not in FLOAT_TYPES)
    if bad is not None:
        _raise_non_finite(x.reshape(-1)[bad:bad + 1], bad, name)
    x = x.reshape(shape)
    if t in FLOAT_TYPES:
        with numba_threads(threads):  # F16 input was widened into a new array: F32 output needs no copy
            return _convert_float(x, t, owned=np.asarray(data).dtype == np.float16).reshape(out_shape)
    out = np.empty((rows, out_shape[-1]), dtype=np.uint8)
    if rows == 0 or n_per_row == 0:
        return out.reshape(out_shape)
    x2 = x.reshape(rows, n_per_row)
    kernels = KERNELS[t]
    if dev == "cuda":
        kernel = kernels.cuda()[0]
        kernel(x2, qw, out)
    else:
        kernel = kernels.cpu()[0]
        with numba_threads(threads), _parallel_chunksize(kernels.chunksize):
            kernel(x2, qw, out)
    return out.reshape(out_shape)


def _quantize_f16_on_gpu(t: GGMLQuantizationType, x: np.ndarray, qw: np.ndarray, name: str | None) -> np.ndarray:
    """F16 rows to ``t`` on the GPU, widened there (half the upload of float32; same bytes)."""
    import importlib

    from ggufkit.quant.kernels.cuda_base import quantize_f16_rows

    kernels = KERNELS[t]
    h = np.ascontiguousarray(x).view(np.uint16)
    out = np.empty((x.shape[0], x.shape[1] // kernels.block_size * kernels.type_size), dtype=np.uint8)
    bad = quantize_f16_rows(importlib.import_module(kernels.cuda_module).quantize_device, t, h, qw, out)
    if bad >= 0:
        _raise_non_finite(h.reshape(-1)[bad:bad + 1].view(np.float16).astype(np.float32), bad, name)
    return out


@contextmanager
def _parallel_chunksize(n: int) -> Iterator[None]:
    """Run the body with ``numba.set_parallel_chunksize(n)`` (0: Numba's static split), then restore it."""
    if n == 0:
        yield
        return
    import numba

    previous = numba.set_parallel_chunksize(n)
    try:
        yield
    finally:
        numba.set_parallel_chunksize(previous)


def _raise_non_finite(values: np.ndarray, base: int, name: str | None) -> None:
    """Raise for the first inf/NaN of ``values`` (float32), which starts at flat index ``base``."""
    j = int(np.argmax(~np.isfinite(values)))
    raise QuantizationError(f"non-finite value {values[j]} at flat index {base + j}; "
                            "NaN/inf weights cannot be quantized", tensor=name)


def _convert_float(x: np.ndarray, t: GGMLQuantizationType, owned: bool) -> np.ndarray:
    from ggufkit.quant.kernels.fp import f32_to_bf16_array, f32_to_f16_array

    if t == GGMLQuantizationType.F32:
        return x.view(np.uint8) if owned else x.view(np.uint8).copy()
    if t == GGMLQuantizationType.F16:
        return f32_to_f16_array(x).view(np.uint8)
    return f32_to_bf16_array(x).view(np.uint8)


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """Decode ggml blocks to float32, exactly as ggml's ``dequantize_row_*`` and ``gguf.quants.dequantize``.

    Args:
        raw: uint8 bytes in ggml's layout (any shape; only the total size matters).
        qtype: their type (a key of ``KERNELS`` or F32/F16/BF16).
        shape: numpy-order shape of the result; its last axis is the row.

    Returns:
        float32 array of ``shape``.

    Raises:
        QuantizationError: the byte count does not match ``shape`` and ``qtype``, or the row length is
            not a multiple of the block size.
        UsageError: an unsupported type.
    """
    t = _as_type(qtype)
    shape = tuple(int(s) for s in shape)
    if not shape or any(s < 0 for s in shape):
        raise UsageError(f"bad shape {shape}")
    block, size = GGML_QUANT_SIZES[t]
    n_per_row = shape[-1]
    if n_per_row % block:
        raise QuantizationError(f"row length {n_per_row} is not a multiple of {t.name}'s block size {block}")
    rows = math.prod(shape[:-1])
    row_bytes = n_per_row // block * size
    b = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if b.size != rows * row_bytes:
        raise QuantizationError(f"{b.size} bytes of {t.name} data do not hold a tensor of shape {shape} "
                                f"({rows * row_bytes} bytes expected)")
    if t == GGMLQuantizationType.F32:
        return b.view(np.float32).reshape(shape).copy()
    if t == GGMLQuantizationType.F16:
        return b.view(np.float16).astype(np.float32).reshape(shape)
    if t == GGMLQuantizationType.BF16:
        return (b.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    out = np.empty((rows, n_per_row), dtype=np.float32)
    if out.size:
        start_numba_threads()
        KERNELS[t].cpu()[1](b.reshape(rows, row_bytes), out)
    return out.reshape(shape)
