"""ggml's own quantizer, called through ctypes: the oracle every quantization test compares bytes with.

The library is ``libggml-base.so`` bundled in the installed ``llama-cpp-python==0.3.36`` wheel
(``llama_cpp/lib``). It is built without ``-march`` (reference/quant.md §8), so its quantizers are the
plain float32 reference that llama-quantize runs. Functions used (ggml.h):

* ``size_t ggml_quantize_chunk(enum ggml_type, const float * src, void * dst, int64_t start,
  int64_t nrows, int64_t n_per_row, const float * imatrix)`` - reference quantizers when ``imatrix`` is
  NULL, the weighted ``*_impl`` variants otherwise; also F16/BF16/F32 targets.
* ``bool ggml_quantize_requires_imatrix(enum ggml_type)``.
* ``const struct ggml_type_traits * ggml_get_type_traits(enum ggml_type)`` whose ``to_float`` member is
  ``dequantize_row_*``.

``ggml_quantize_chunk`` calls ``ggml_quantize_init`` itself, so nothing else has to be set up.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)


class _TypeTraits(ctypes.Structure):
    # Layout of struct ggml_type_traits in ggml.h (llama.cpp tree of llama-cpp-python 0.3.36).
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


@cache
def libggml() -> ctypes.CDLL:
    """Load ``libggml-base.so`` once and declare the signatures used here."""
    # GGUFKIT_GGML_LIB_DIR points at a copy of the library where llama-cpp-python is not installed (the
    # GPU machine that runs benchmarks/bench_quant_kernels.py).
    from llama_cpp_sources import ggml_lib_dir

    lib_dir = os.environ.get("GGUFKIT_GGML_LIB_DIR")
    lib = ctypes.CDLL(str((Path(lib_dir) if lib_dir else ggml_lib_dir()) / "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    return lib


def row_bytes(qtype: GGMLQuantizationType, n_per_row: int) -> int:
    """Bytes of one row of ``n_per_row`` elements in ``qtype``."""
    block, size = GGML_QUANT_SIZES[qtype]
    return n_per_row // block * size


def ggml_requires_imatrix(qtype: GGMLQuantizationType) -> bool:
    """``ggml_quantize_requires_imatrix``."""
    return bool(libggml().ggml_quantize_requires_imatrix(int(qtype)))


def ggml_quantize(x: np.ndarray, qtype: GGMLQuantizationType, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Quantize with ``ggml_quantize_chunk``.

    Args:
        x: float32 [rows, n_per_row] (or any shape whose last axis is the row).
        qtype: the target type.
        imatrix: float32 [n_per_row] importance weights, or None for the reference path.

    Returns:
        uint8 [rows, row_bytes] in ggml's block layout.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    n_per_row = x.shape[-1]
    rows = x.size // n_per_row
    out = np.zeros((rows, row_bytes(qtype, n_per_row)), dtype=np.uint8)
    qw = None
    if imatrix is not None:
        qw = np.ascontiguousarray(imatrix, dtype=np.float32)
        if qw.shape != (n_per_row,):
            raise ValueError(f"imatrix shape {qw.shape} != ({n_per_row},)")
    written = libggml().ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data, 0, rows, n_per_row,
                                            None if qw is None else qw.ctypes.data)
    if written != out.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes, expected {out.nbytes}")
    return out


def ggml_dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """Dequantize with ggml's ``type_traits[qtype].to_float`` (``dequantize_row_*``).

    Args:
        raw: uint8 bytes in ggml's layout.
        qtype: their type.
        shape: numpy-order shape of the result.

    Returns:
        float32 array of ``shape``.
    """
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if qtype == GGMLQuantizationType.F32:  # ggml has no to_float for F32: the bytes are the values
        return raw.view(np.float32).reshape(shape).copy()
    traits = libggml().ggml_get_type_traits(int(qtype)).contents
    if not traits.to_float:
        raise ValueError(f"ggml has no to_float for {qtype.name}")
    out = np.empty(shape, dtype=np.float32)
    _TO_FLOAT(traits.to_float)(raw.ctypes.data, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.size)
    return out
