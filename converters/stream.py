"""Tensor stream: source data -> output bytes, one tensor at a time, in row chunks.

F16/BF16/F32 conversion lives here (llama.cpp's NaN and rounding rules: ggml_compute_fp32_to_bf16, numpy's
round-to-nearest-even float16), quantized outtypes go through :func:`ggufkit.quant.quantize`.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from gguf import GGMLQuantizationType

from ggufkit.converters.plan_types import ConvertPlan

Q = GGMLQuantizationType


def to_float32(arr: np.ndarray, src_dtype: str) -> np.ndarray:
    """Source data as float32 (bf16 bits widened exactly)."""
    if src_dtype == "BF16":
        wide = np.asarray(arr).astype(np.uint32)
        wide <<= 16  # in place: one float32-sized buffer, not two
        return wide.view(np.float32)
    return np.asarray(arr).astype(np.float32, copy=False)


def bf16_from_float32(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even to bf16 bits, NaN kept quiet: ggml_compute_fp32_to_bf16."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 64).astype(np.uint16)
    return rounded


def bf16_to_f16(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns -> float16, bit-identical to widening to float32 and ``astype(np.float16)``.

    bf16 values whose exponent lies in f16's normal range convert exactly by moving bit fields
    (``((bits & 0x7FFF) - (112 << 7)) << 3``, sign kept); the few others (zero, f16 subnormals, overflow,
    inf/NaN) take the float path. About three times faster than the float path for weights; an exhaustive
    test over all 65536 patterns keeps them equal.
    """
    bits = np.ascontiguousarray(bits, dtype=np.uint16)
    out = bits & np.uint16(0x7FFF)
    # Exponents 113..142 are f16 normals: magnitude bits 0x3880..0x477F (one unsigned compare, wrapping).
    odd = np.flatnonzero((out - np.uint16(0x3880)) >= np.uint16(0x0F00))
    out -= np.uint16(0x3800)  # exponent bias 127 -> 15
    out <<= np.uint16(3)  # 7 -> 10 mantissa bits
    out |= bits & np.uint16(0x8000)
    if odd.size:
        with np.errstate(over="ignore"):
            out.reshape(-1)[odd] = to_float32(bits.reshape(-1)[odd], "BF16").astype(np.float16).view(np.uint16)
    return out.view(np.float16)


#: Rows are converted in chunks of about this many elements (4 MiB as float32), so temporaries stay small
#: whatever the tensor. Quantized types too: the quantizer's per-call cost is well under a millisecond now,
#: and a chunk that fits in cache quantizes faster per weight than a whole 16M-element tensor.
CHUNK_ELEMENTS = 1 << 20


def _encode_rows(rows: np.ndarray, src_dtype: str, ggml_type: GGMLQuantizationType) -> np.ndarray:
    if ggml_type == Q.BF16:
        return bf16_from_float32(to_float32(rows, src_dtype))
    if ggml_type == Q.F16:
        if src_dtype == "BF16":
            return bf16_to_f16(rows)
        with np.errstate(over="ignore"):  # reported by the caller, which knows the tensor's name
            return to_float32(rows, src_dtype).astype(np.float16)
    f32 = np.ascontiguousarray(to_float32(rows, src_dtype))
    if ggml_type == Q.F32:
        return f32
    from ggufkit.quant import quantize

    return quantize(f32, ggml_type)


def page_releaser(arr: np.ndarray) -> Callable[[np.ndarray], None] | None:
    """For an array backed by a read-only ``np.memmap``: a function that drops the pages under a
    C-contiguous slice of it from this process (``madvise(MADV_DONTNEED)``); None for other arrays.

    Pages of a file mapping count in the process's RSS once read, until the mapping is closed; a 16M-element
    bf16 tensor would keep 32 MB resident while it is converted. Dropped pages of a read-only file mapping
    come back from the page cache if read again, so releasing is always safe.
    """
    mm = getattr(arr, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED") or len(mm) == 0:
        return None
    base = np.frombuffer(mm, dtype=np.uint8).ctypes.data
    size = len(mm)

    def release(part: np.ndarray) -> None:
        start = part.ctypes.data - base
        if part.nbytes == 0 or not 0 <= start < size:
            return
        lo = start - start % mmap.PAGESIZE  # the mapping starts on a page; madvise wants a page-aligned start
        # Only a memory optimisation: never fail a conversion for it.
        with contextlib.suppress(OSError, ValueError):
            mm.madvise(mmap.MADV_DONTNEED, lo, min(size, start + part.nbytes) - lo)

    return release


def encode(arr: np.ndarray, src_dtype: str, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """Convert one (transformed) tensor to its output type: numpy order, rows of ``ggml_type``'s bytes.

    Same-type data is passed through (a memmap view, no copy); otherwise rows are converted in chunks of
    :data:`CHUNK_ELEMENTS` into one preallocated output buffer (quantized types give
    ``uint8[n_rows, row_bytes]``), and the source pages of each chunk of a memory-mapped tensor are released
    once converted, so peak memory is the output plus one chunk's temporaries.
    """
    if src_dtype == ggml_type.name:  # BF16, F16, F32; MXFP4 as released (converters/mxfp4_source.py)
        return np.ascontiguousarray(arr)
    row_len = arr.shape[-1] if arr.ndim else 1
    release = page_releaser(arr) if arr.flags.c_contiguous else None
    rows = np.asarray(arr).reshape(-1, row_len)
    step = max(1, CHUNK_ELEMENTS // max(row_len, 1))
    if rows.shape[0] <= step:
        whole = _encode_rows(rows, src_dtype, ggml_type)
        if release is not None:
            release(rows)
        return whole.reshape(*arr.shape[:-1], -1)
    first = _encode_rows(rows[:step], src_dtype, ggml_type)
    out = np.empty((rows.shape[0], first.shape[1]), dtype=first.dtype)
    out[:step] = first
    del first
    if release is not None:
        release(rows[:step])

    def convert(start: int) -> None:
        part = rows[start:start + step]
        out[start:start + step] = _encode_rows(part, src_dtype, ggml_type)
        if release is not None:
            release(part)

    starts = range(step, rows.shape[0], step)
    if ggml_type in (Q.F16, Q.BF16, Q.F32) and len(starts) > 1:
        # NumPy releases the GIL in these loops: chunks convert on every core (each into its own rows, so
        # the bytes do not depend on the scheduling). Quantizers are parallel inside already.
        list(_pool().map(convert, starts))
    else:
        for start in starts:
            convert(start)
    return out.reshape(*arr.shape[:-1], -1)


_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        _POOL = ThreadPoolExecutor(max(1, min(cores, 8)), thread_name_prefix="encode")
    return _POOL



#: A tensor of more source elements than this is converted and handed to the writer in row blocks of about
#: this many (32 MB of bf16, 64 MB of float32), each written before the next but one is made: the memory a
#: tensor costs is two blocks, not the tensor (an embedding of 50k x 7168, a stacked expert tensor).
PIECE_ELEMENTS = 1 << 24


def tensor_stream(plan: ConvertPlan, warnings: list[str]) -> Iterator[np.ndarray | Iterator[np.ndarray]]:
    """The plan's tensors in order, each loaded, transformed and encoded; f16 overflow noted in ``warnings``.

    A tensor is one array, or (more than :data:`PIECE_ELEMENTS`, or a loader with ``pieces()``: a stacked
    expert tensor, :class:`ggufkit.converters.rewrite.StackLoader`) an iterator of its row blocks in order, for
    :func:`ggufkit.format.write_gguf`. Rows convert independently in every type, so the bytes are the same.
    """
    for e in plan.entries:
        load = plan.loaders[e.name]
        src_dtype = "F32" if e.source == "generated" or e.kind in ("FC1", "FC2") else e.src_dtype
        pieces = getattr(load, "pieces", None)
        if pieces is not None:
            yield _blocks(e.name, pieces(), src_dtype, e.ggml_type, warnings)
            continue
        arr = load()
        if arr.size > PIECE_ELEMENTS:
            yield _blocks(e.name, iter([arr]), src_dtype, e.ggml_type, warnings)
            del arr
            continue
        out = encode(arr, src_dtype, e.ggml_type)
        n_inf = _new_infs(out, arr, src_dtype, e.ggml_type)
        if n_inf > 0:
            warnings.append(_overflow(e.name, n_inf))
        # A passed-through memmap view is written after this yield: release its pages only then.
        release = page_releaser(arr) if arr.flags.c_contiguous else None
        del arr
        yield out
        if release is not None:
            release(out)
        del out


def _blocks(name: str, parts: Iterator[np.ndarray], src_dtype: str, ggml_type: GGMLQuantizationType,
            warnings: list[str]) -> Iterator[np.ndarray]:
    """``parts`` (a tensor's outermost slices, in order) encoded in row blocks of about :data:`PIECE_ELEMENTS`.

    Holds one part and the block being made; the writer holds the block before it. Pages of a memory-mapped
    part are released once its block is written (asked past), as :func:`tensor_stream` does for a tensor.
    """
    n_inf = 0
    written: tuple[Callable[[np.ndarray], None], np.ndarray] | None = None
    while (part := next(parts, None)) is not None:
        row_len = part.shape[-1] if part.ndim else 1
        rows = part.reshape(-1, row_len)
        del part
        step = max(1, PIECE_ELEMENTS // max(row_len, 1))
        for start in range(0, rows.shape[0], step):
            block = rows[start:start + step]
            out = encode(block, src_dtype, ggml_type)
            n_inf += _new_infs(out, block, src_dtype, ggml_type)
            release = page_releaser(block) if block.flags.c_contiguous else None
            del block
            yield out
            # Asked for the next block, the writer has finished the one before this (a block released while
            # it is being written would be read back in and stay resident): release that one.
            if written is not None:
                written[0](written[1])
            written = (release, out) if release is not None else None
            del out
        del rows
    if written is not None:
        written[0](written[1])
    if n_inf > 0:
        warnings.append(_overflow(name, n_inf))


def _new_infs(out: np.ndarray, src: np.ndarray, src_dtype: str, ggml_type: GGMLQuantizationType) -> int:
    """Values an f16 encode made infinite (llama.cpp's converter overflows silently; beyond +-65504 is inf)."""
    if ggml_type != Q.F16 or src_dtype == "F16":
        return 0
    # Cheap test on the f16 bits first (exponent all ones means inf or NaN); count only when needed.
    if out.size and int((out.view(np.uint16) & np.uint16(0x7FFF)).max()) >= 0x7C00:
        return int(np.isinf(out).sum()) - int(np.isinf(to_float32(src, src_dtype)).sum())
    return 0


def _overflow(name: str, n_inf: int) -> str:
    return f"{name}: {n_inf} values exceed f16's range and became inf; use --outtype bf16 or f32"
