"""FP8 checkpoints (``quantization_config.quant_method = "fp8"``): weights dequantized one tensor at a time.

DeepSeek V3/R1, Qwen3-FP8 and GLM FP8 releases store ``float8_e4m3fn`` weights with ``weight_scale_inv`` block
scales (``weight_block_size``, usually 128 x 128); other FP8 checkpoints store one scale per tensor or per output
channel. llama.cpp's converter (conversion/base.py: ``ModelBase.dequant_model``, ``dequant_simple``) multiplies
the float32 weight by the float32 scale, the scale repeated over its block and trimmed to the weight's shape;
:func:`dequant_simple` computes the same products (one float32 multiply per weight, so the same bits) block row
by block row, without a weight-sized expanded scale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ggufkit.converters.checkpoint import Checkpoint, SourceTensor
from ggufkit.converters.stream import page_releaser
from ggufkit.errors import CheckpointError

__all__ = ["FP8_DTYPES", "Dequantized", "dequant_simple", "install_fp8", "install_scaled", "widen"]


def _fp8_table(exp_bits: int, man_bits: int, finite: bool) -> np.ndarray:
    """float32 value of each of the 256 bytes of an FP8 format (torch's float8_e4m3fn / float8_e5m2)."""
    b = np.arange(256, dtype=np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp = (b >> man_bits) & ((1 << exp_bits) - 1)
    man = b & ((1 << man_bits) - 1)
    bias = (1 << (exp_bits - 1)) - 1
    normal = (1.0 + man / (1 << man_bits)) * np.exp2(exp - bias)
    sub = (man / (1 << man_bits)) * np.exp2(1 - bias)
    value = sign * np.where(exp == 0, sub, normal)
    top = exp == (1 << exp_bits) - 1
    nan = top & (man == (1 << man_bits) - 1) if finite else top & (man != 0)  # e4m3fn has no infinities
    if not finite:
        value = np.where(top & (man == 0), sign * np.inf, value)
    out = value.astype(np.float32)
    # NaNs as torch widens them: quiet, sign and payload kept (payload bits at the top of the mantissa)
    bits = (b & 0x80) << 24 | 0x7FC00000 | man << (23 - man_bits)
    out.view(np.uint32)[nan] = bits[nan].astype(np.uint32)
    return out


#: safetensors FP8 dtype -> float32 of each byte
FP8_DTYPES: dict[str, np.ndarray] = {"F8_E4M3": _fp8_table(4, 3, True), "F8_E5M2": _fp8_table(5, 2, False)}


def widen(arr: np.ndarray, dtype: str) -> np.ndarray:
    """Stored data as float32, as torch's ``tensor.float()`` gives it (FP8 by table, bf16 bits exactly)."""
    table = FP8_DTYPES.get(dtype)
    if table is not None:
        return table[np.asarray(arr)]
    if dtype == "BF16":
        wide = np.asarray(arr).astype(np.uint32)
        wide <<= 16
        return wide.view(np.float32)
    return np.asarray(arr).astype(np.float32)


def dequant_simple(weight: np.ndarray, w_dtype: str, scale: np.ndarray, s_dtype: str,
                   block_size: Sequence[int] | None) -> np.ndarray:
    """``weight.float() * scale`` with the scale repeated over ``block_size`` and trimmed to the weight
    (llama.cpp conversion/base.py: ``dequant_simple``), as float32.

    A 2-D weight with a 2-D block scale (the released layout) is done block row by block row; anything else
    (per-tensor, per-channel, 3-D) expands the scale as llama.cpp does and broadcasts.
    """
    s = widen(scale, s_dtype)
    if block_size is not None and weight.ndim == 2 and s.ndim == 2 and len(block_size) == 2:
        rows, cols = weight.shape
        b0, b1 = int(block_size[0]), int(block_size[1])
        if s.shape[0] * b0 < rows or s.shape[1] * b1 < cols:
            raise CheckpointError(f"FP8 block scales of shape {list(s.shape)} do not cover a weight of shape "
                                  f"{list(weight.shape)} in blocks of {b0}x{b1}")
        out = np.empty((rows, cols), dtype=np.float32)
        for i in range(0, rows, b0):
            part = out[i:i + b0]
            part[...] = widen(weight[i:i + b0], w_dtype)
            part *= np.repeat(s[i // b0], b1)[:cols]
        return out
    if block_size is not None:
        offset = s.ndim - len(block_size)
        for i, size in enumerate(block_size):
            s = np.repeat(s, int(size), axis=offset + i)
        s = s[tuple(slice(0, size) for size in weight.shape)]
    while s.ndim < weight.ndim:
        s = s[..., None]
    w = widen(weight, w_dtype)
    if np.broadcast_shapes(w.shape, s.shape) == w.shape:
        w *= s
        return w
    return np.multiply(w, s)


def install_scaled(ckpt: Checkpoint, weight_name: str, scale_name: str, block_size: Sequence[int] | None) -> None:
    """Make ``weight_name`` read as its dequantized float32 values and hide ``scale_name`` from the conversion."""
    if weight_name not in ckpt.stored:
        raise CheckpointError(f"scale tensor {scale_name!r} has no weight {weight_name!r} beside it",
                              path=ckpt.model_dir)
    w = ckpt.stored[weight_name]
    ckpt.tensors[weight_name] = SourceTensor(w.name, w.shape, "F32", w.file, w.offset)
    ckpt.tensors.pop(scale_name, None)
    ckpt.derived[weight_name] = _loader(ckpt, w, ckpt.stored[scale_name], block_size)


def _loader(ckpt: Checkpoint, w: SourceTensor, s: SourceTensor,
            block_size: Sequence[int] | None) -> Callable[[], np.ndarray]:
    return Dequantized(ckpt, w, s, block_size)


#: Rows of a scaled weight are dequantized in pieces of about this many weights (16 MiB as float32).
PIECE_WEIGHTS = 1 << 22


class Dequantized:
    """A scaled weight's loader: called, its float32 values (:func:`dequant_simple`); :meth:`pieces` gives them
    block row by block row, for a stream that converts and writes rows as they come (an FP8 ``o_proj`` of
    DeepSeek-V3, 7168 x 16384, is 470 MB as float32: the pieces are 16 MB)."""

    def __init__(self, ckpt: Checkpoint, w: SourceTensor, s: SourceTensor,
                 block_size: Sequence[int] | None) -> None:
        self.ckpt, self.w, self.s, self.block_size = ckpt, w, s, block_size

    def __call__(self) -> np.ndarray:
        return dequant_simple(self.ckpt.read_stored(self.w.name), self.w.dtype, self.ckpt.read_stored(self.s.name),
                              self.s.dtype, self.block_size)

    def pieces(self) -> Iterator[np.ndarray]:
        """The float32 values in row pieces, in order: the same products as :meth:`__call__`, row for row.

        A 2-D block scale gives pieces of whole block rows; a per-channel scale (one per row) or a per-tensor
        one, pieces of any rows; any other layout, the whole tensor."""
        weight, scale = self.ckpt.read_stored(self.w.name), self.ckpt.read_stored(self.s.name)
        block, rows = self.block_size, weight.shape[0] if weight.ndim == 2 else 0
        if block is not None and weight.ndim == 2 and scale.ndim == 2 and len(block) == 2:
            b0 = int(block[0])
            step = b0 * max(1, PIECE_WEIGHTS // max(1, b0 * weight.shape[1]))

            def scale_of(i: int) -> np.ndarray:
                return scale[i // b0:(i + step) // b0]
        elif block is None and weight.ndim == 2 and (scale.size == 1 or scale.shape in ((rows, 1), (rows,))):
            step = max(1, PIECE_WEIGHTS // max(1, weight.shape[1]))

            def scale_of(i: int) -> np.ndarray:
                return scale if scale.size == 1 else scale[i:i + step]
        else:
            yield self()
            return
        release = page_releaser(weight)  # the FP8 pages of a piece leave this process once it is dequantized
        for i in range(0, rows, step):
            part = weight[i:i + step]
            yield dequant_simple(part, self.w.dtype, scale_of(i), self.s.dtype, block)
            if release is not None:
                release(part)


def install_fp8(ckpt: Checkpoint, quant: dict[str, Any]) -> set[str]:
    """quant_method ``fp8`` as llama.cpp's ``dequant_model`` reads it: ``*_scale_inv`` scales (and the Mistral
    format's ``.qscale_weight``) dequantize their weights; activation scales are dropped.

    Returns:
        The names of the weights dequantized (llama.cpp's ``_fp8_dequantized``, for ``--fp8-as-q8``).
    """
    block_size = quant.get("weight_block_size")
    if block_size is not None and (not isinstance(block_size, list) or
                                   not all(isinstance(b, int) and b > 0 for b in block_size)):
        raise CheckpointError(f"quantization_config.weight_block_size {block_size!r} is not a list of positive "
                              "integers", path=ckpt.model_dir)
    done: set[str] = set()
    for name in list(ckpt.stored):
        if name.endswith("_scale_inv"):
            weight = name.removesuffix("_scale_inv")
            install_scaled(ckpt, weight, name, block_size)
            done.add(weight)
        elif name.endswith(".qscale_weight"):  # mistral format
            weight = name.removesuffix("qscale_weight") + "weight"
            install_scaled(ckpt, weight, name, block_size)
            done.add(weight)
        elif name.endswith((".activation_scale", "_activation_scale", ".qscale_act")):  # unused
            ckpt.tensors.pop(name, None)
    return done
