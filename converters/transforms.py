"""Tensor transforms named in registry.yaml: pure reshapes and reorderings of one tensor.

Each takes the source array (any dtype: BF16 arrives as uint16 bits, which reorder just as well) and a
:class:`Heads` with the head counts, and returns a C-contiguous array. Shapes are numpy order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ggufkit.converters.stream import to_float32
from ggufkit.errors import TensorMappingError


@dataclass(frozen=True)
class Heads:
    """Attention head counts a transform needs."""

    n_head: int
    n_head_kv: int


def _permute(arr: np.ndarray, n: int, what: str) -> np.ndarray:
    # HF's rotate-half rope pairs row i with i + d/2 inside each head; llama.cpp's NORM rope pairs
    # (2i, 2i+1). Row h*d + 2i + j takes old row h*d + j*d/2 + i (convert_hf_to_gguf.py: LlamaModel.permute).
    rows = arr.shape[0]
    if n <= 0 or rows % (2 * n):
        raise TensorMappingError(f"{what}: {rows} rows cannot be split into {n} heads of even size")
    rest = arr.shape[1:]
    return np.ascontiguousarray(arr.reshape(n, 2, rows // n // 2, *rest).swapaxes(1, 2).reshape(arr.shape))


def permute_q(arr: np.ndarray, heads: Heads) -> np.ndarray:
    """LLaMA Q (weight [n_head*d, n_embd] or bias [n_head*d]): rotate-half -> adjacent-pair row order."""
    return _permute(arr, heads.n_head, "permute_q")


def permute_k(arr: np.ndarray, heads: Heads) -> np.ndarray:
    """LLaMA K: as :func:`permute_q` with the KV head count (GQA)."""
    return _permute(arr, heads.n_head_kv, "permute_k")


def neox_qkv(arr: np.ndarray, heads: Heads) -> np.ndarray:
    """GPT-NeoX fused QKV: per-head interleaved [q_h, k_h, v_h, ...] -> [all Q | all K | all V].

    Weight ``[n_head*3*d, n_embd]`` viewed as ``(n_head, 3, d, n_embd)``; bias ``[n_head*3*d]`` as
    ``(n_head, 3, d)``; the q, k and v parts are concatenated along rows (convert_hf_to_gguf.py: GPTNeoXModel.modify_tensors).
    """
    n = heads.n_head
    rows = arr.shape[0]
    if n <= 0 or rows % (3 * n):
        raise TensorMappingError(f"neox_qkv: {rows} rows are not 3 x {n} heads")
    grouped = arr.reshape(n, 3, rows // (3 * n), *arr.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(0, 1).reshape(arr.shape))


def transpose(arr: np.ndarray, heads: Heads) -> np.ndarray:
    """2-D weights transposed (PowerInfer's ``ffn_down_t``: one FFN neuron per row); 1-D biases unchanged."""
    if arr.ndim != 2:
        return arr
    return np.ascontiguousarray(arr.T)


def add_one(arr: np.ndarray, heads: Heads) -> np.ndarray:
    """``w + 1`` (Gemma's RMSNorm multiplies by ``1 + w``; conversion/gemma.py ``modify_tensors``) after
    llama.cpp's converter has widened every dtype but f16/f32 to f32 (conversion/base.py
    ``ModelBase.prepare_tensors``, before ``modify_tensors``): a bf16 source gives float32 (its planned source
    dtype becomes F32, :func:`transformed_dtype`), f16 and f32 sources keep their precision."""
    if arr.dtype == np.uint16:  # bf16 bits
        return to_float32(arr, "BF16") + np.float32(1)
    if arr.dtype == np.float16:
        return (arr + np.float16(1)).astype(np.float16)
    return np.asarray(arr, dtype=np.float32) + np.float32(1)


#: Transforms whose output of a BF16 source is float32 (the planned source dtype becomes F32).
WIDENED = frozenset({"add_one"})


def transformed_dtype(transform: str | None, src_dtype: str) -> str:
    """The source dtype a tensor has after ``transform`` (F32 where the transform widens a BF16 source)."""
    return "F32" if transform in WIDENED and src_dtype == "BF16" else src_dtype

TRANSFORMS: dict[str, Callable[[np.ndarray, Heads], np.ndarray]] = {
    "add_one": add_one,
    "permute_q": permute_q,
    "permute_k": permute_k,
    "neox_qkv": neox_qkv,
    "transpose": transpose,
}


def transformed_shape(name: str | None, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape after transform ``name`` (only ``transpose`` changes it)."""
    if name == "transpose" and len(shape) == 2:
        return (shape[1], shape[0])
    return shape
