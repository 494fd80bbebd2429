"""ggml's CPU backend through ctypes: the oracle for ggufkit.eval.ggml_cpu (what llama.cpp's matmuls round).

The library is ``libggml-cpu.so`` bundled in the installed ``llama-cpp-python==0.3.36`` wheel
(``llama_cpp/lib``), built with the x86 SIMD paths (``ggml_cpu_has_avx2()`` is 1), so its activation
quantizers are the ``ggml-cpu/arch/x86/quants.c`` ones llama-perplexity runs on this machine. Functions used
(ggml-cpu.h): ``ggml_cpu_init``, ``ggml_get_type_traits_cpu(type)`` -> ``{from_float, vec_dot, vec_dot_type,
nrows}``: ``from_float`` converts a float32 row to the type, ``vec_dot(n, &s, 0, x, 0, y, 0, 1)`` is one
dot product of a weight row ``x`` with a converted activation row ``y``; and (ggml.h, ggml-cpu.h) ``ggml_init``,
``ggml_new_tensor_4d``, ``ggml_flash_attn_ext``, ``ggml_new_graph``, ``ggml_build_forward_expand``,
``ggml_graph_compute_with_ctx`` to run one flash-attention op as llama.cpp's graph does.
"""

from __future__ import annotations

import ctypes
from functools import cache

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType

_FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
_VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t, ctypes.c_void_p,
                            ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

#: Bytes per block of the activation types (ggml-common.h): Q8_K is float d, 256 int8, 16 int16 sums.
_ACT_BLOCK = {Q.Q8_0: (32, 34), Q.Q8_1: (32, 36), Q.Q8_K: (256, 292), Q.F16: (1, 2), Q.BF16: (1, 2)}


class _CpuTraits(ctypes.Structure):
    # struct ggml_type_traits_cpu in ggml-cpu.h (llama.cpp tree of llama-cpp-python 0.3.36).
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


@cache
def libggml_cpu() -> ctypes.CDLL:
    """Load ``libggml-cpu.so`` once (its base library first, globally), initialised."""
    from llama_cpp_sources import ggml_lib_dir

    ctypes.CDLL(str(ggml_lib_dir() / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(ggml_lib_dir() / "libggml-cpu.so"))
    lib.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_CpuTraits)
    lib.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    lib.ggml_cpu_has_avx2.restype = ctypes.c_int
    lib.ggml_cpu_init()
    return lib


def _traits(qtype: GGMLQuantizationType) -> _CpuTraits:
    return libggml_cpu().ggml_get_type_traits_cpu(int(qtype)).contents


def vec_dot_type(qtype: GGMLQuantizationType) -> GGMLQuantizationType:
    """``type_traits_cpu[qtype].vec_dot_type``."""
    return Q(_traits(qtype).vec_dot_type)


def to_vec_dot(x: np.ndarray, vdt: GGMLQuantizationType) -> np.ndarray:
    """float32 rows ``[r, n]`` converted by ggml's ``from_float`` of ``vdt``: raw bytes ``[r, row_bytes]``."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    block, size = _ACT_BLOCK[vdt]
    out = np.zeros((x.shape[0], x.shape[1] // block * size), dtype=np.uint8)
    fn = _FROM_FLOAT(_traits(vdt).from_float)
    for i in range(x.shape[0]):
        fn(x[i].ctypes.data, out[i].ctypes.data, x.shape[1])
    return out


def decode_activations(raw: np.ndarray, vdt: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray | None]:
    """The values a converted row holds (``d * q`` in float32, as ggml's dot products scale them), and for
    Q8_1 its stored block sums ``s`` (else None)."""
    size = _ACT_BLOCK[vdt][1]
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, size)
    if vdt in (Q.F16, Q.BF16):
        dt = np.float16 if vdt == Q.F16 else None
        if dt is None:  # bf16: the top half of a float32
            return (b.reshape(rows, -1).view(np.uint16).astype(np.uint32) << 16).view(np.float32), None
        return b.reshape(rows, -1).view(dt).astype(np.float32), None
    if vdt == Q.Q8_K:
        d = b[:, :, 0:4].copy().view(np.float32)
        q = b[:, :, 4:260].view(np.int8).astype(np.float32)
        return (d * q).reshape(rows, -1), None
    d = b[:, :, 0:2].copy().view(np.float16).astype(np.float32)
    start = 4 if vdt == Q.Q8_1 else 2
    q = b[:, :, start:start + 32].view(np.int8).astype(np.float32)
    s = b[:, :, 2:4].copy().view(np.float16).astype(np.float32)[:, :, 0] if vdt == Q.Q8_1 else None
    return (d * q).reshape(rows, -1), s


def matmul(w_raw: np.ndarray, qtype: GGMLQuantizationType, n: int, x: np.ndarray) -> np.ndarray:
    """``x @ W.T`` as ggml's CPU backend computes it without llamafile: each activation row converted to
    ``vec_dot_type``, then one ``vec_dot`` per weight row. ``w_raw`` ``[rows, row_bytes]`` of ``qtype``."""
    vdt = vec_dot_type(qtype)
    xq = to_vec_dot(x, vdt)
    block, size = GGML_QUANT_SIZES[qtype]
    assert w_raw.shape[1] == n // block * size
    w_raw = np.ascontiguousarray(w_raw)
    fn = _VEC_DOT(_traits(qtype).vec_dot)
    out = np.zeros((x.shape[0], w_raw.shape[0]), dtype=np.float32)
    s = ctypes.c_float()
    for t in range(x.shape[0]):
        for r in range(w_raw.shape[0]):
            fn(n, ctypes.byref(s), 0, w_raw[r].ctypes.data, 0, xq[t].ctypes.data, 0, 1)
            out[t, r] = s.value
    return out


class _InitParams(ctypes.Structure):
    # struct ggml_init_params in ggml.h.
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


@cache
def _libggml_base() -> ctypes.CDLL:
    from llama_cpp_sources import ggml_lib_dir

    libggml_cpu()
    lib = ctypes.CDLL(str(ggml_lib_dir() / "libggml-base.so"))
    lib.ggml_init.restype = ctypes.c_void_p
    lib.ggml_init.argtypes = [_InitParams]
    lib.ggml_free.argtypes = [ctypes.c_void_p]
    lib.ggml_new_tensor_4d.restype = ctypes.c_void_p
    lib.ggml_new_tensor_4d.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_int64] * 4
    lib.ggml_get_data.restype = ctypes.c_void_p
    lib.ggml_get_data.argtypes = [ctypes.c_void_p]
    lib.ggml_flash_attn_ext.restype = ctypes.c_void_p
    lib.ggml_flash_attn_ext.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_float] * 3
    lib.ggml_new_graph.restype = ctypes.c_void_p
    lib.ggml_new_graph.argtypes = [ctypes.c_void_p]
    lib.ggml_build_forward_expand.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return lib


def flash_attn_ext(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, *, kv_type: GGMLQuantizationType,
                   window: int = 0, softcap: float = 0.0, n_threads: int = 1) -> np.ndarray:
    """ggml's CPU ``ggml_flash_attn_ext`` (ggml-cpu/ops.cpp) on causal attention, as llama.cpp's build_attn_mha
    calls it: ``q`` float32 ``[H, T, d]``, ``k``/``v`` ``[H_kv, T, d]`` stored as ``kv_type`` (F16 or F32, the
    K/V cache type), an F16 mask of 0/-inf (causal; keys ``i - j >= window`` hidden when ``window``).
    Returns float32 ``[H, T, d]``."""
    base = _libggml_base()
    cpu = libggml_cpu()
    cpu.ggml_graph_compute_with_ctx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    n_head, t, _ = q.shape
    dv = v.shape[2]
    kv_np = np.float16 if kv_type == Q.F16 else np.float32
    work = 64 * 1024 * 1024 + 4 * (q.size + k.size + v.size + q.size) + 2 * t * t * 4
    ctx = base.ggml_init(_InitParams(work, None, False))
    try:
        def tensor(arr: np.ndarray, ggml_type: GGMLQuantizationType) -> int:
            h, rows, cols = arr.shape
            tt = base.ggml_new_tensor_4d(ctx, int(ggml_type), cols, rows, h, 1)
            ctypes.memmove(base.ggml_get_data(tt), np.ascontiguousarray(arr).ctypes.data, arr.nbytes)
            return tt
        i = np.arange(t)
        visible = i[None, :] <= i[:, None]
        if window:
            visible &= i[:, None] - i[None, :] < window
        mask = np.where(visible, 0.0, -np.inf).astype(np.float16)[None]
        tq = tensor(q.astype(np.float32), Q.F32)
        tk = tensor(k.astype(kv_np), kv_type)
        tv = tensor(v.astype(kv_np), kv_type)
        tm = tensor(mask, Q.F16)
        out = base.ggml_flash_attn_ext(ctx, tq, tk, tv, tm, scale, 0.0, softcap)
        graph = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(graph, out)
        assert cpu.ggml_graph_compute_with_ctx(ctx, graph, n_threads) == 0
        res = np.empty((t, n_head, dv), dtype=np.float32)  # [n_embd_v, n_head, n_batch] in ggml order
        ctypes.memmove(res.ctypes.data, base.ggml_get_data(out), res.nbytes)
        return res.transpose(1, 0, 2).copy()
    finally:
        base.ggml_free(ctx)
