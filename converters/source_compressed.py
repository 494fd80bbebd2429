"""compressed-tensors checkpoints (``quant_method = "compressed-tensors"``): weights dequantized one tensor at a
time, as llama.cpp's converter does (conversion/base.py: ``ModelBase.dequant_model``).

- ``float-quantized`` / ``int-quantized`` / ``naive-quantized`` (FP8 or INT8 weights, ``strategy`` channel or
  block): ``weight * weight_scale``, the scale repeated over ``block_structure`` (``dequant_simple``).
- ``pack-quantized`` (INT4 as Kimi K2 ships it, ``strategy`` group): eight 4-bit values per int32 along the row
  (``weight_packed``), ``weight_shape`` the unpacked shape, ``weight_scale`` one scale per group, an optional
  ``weight_zero_point`` packed along the rows; ``(q - offset) * scale`` (``dequant_packed``).

Both loaders also give their float32 values in row pieces (``pieces()``, as FP8's
:class:`ggufkit.converters.source_fp8.Dequantized` does), each a group of rows whose scales and zero points are
whole, so the conversion stream never holds one whole dequantized tensor: the same products, row for row.

What llama.cpp's converter refuses (several config groups, other formats and strategies) is refused here in one
line; NVFP4 (``nvfp4-pack-quantized``) is not among the formats this module converts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ggufkit.converters import source_fp8
from ggufkit.converters.checkpoint import Checkpoint, SourceTensor
from ggufkit.converters.source_fp8 import install_scaled, widen
from ggufkit.converters.stream import page_releaser
from ggufkit.errors import CheckpointError

__all__ = ["Unpacked", "dequant_packed", "install_compressed"]


def _refuse(ckpt: Checkpoint, what: str) -> CheckpointError:
    return CheckpointError(f"compressed-tensors checkpoint with {what}: not supported (llama.cpp's converter does "
                           "not convert it either); convert the unquantized checkpoint", path=ckpt.model_dir)


def install_compressed(ckpt: Checkpoint, quant: dict[str, Any]) -> set[str]:
    """Install the dequantizing loaders of a compressed-tensors checkpoint.

    Returns:
        The names of the weights dequantized from FP8 (llama.cpp's ``_fp8_dequantized``, for ``--fp8-as-q8``).

    Raises:
        CheckpointError: a format, strategy or group layout llama.cpp's converter does not convert.
    """
    fmt = quant.get("format")
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse(ckpt, "no config_groups")
    if len(groups) > 1:
        raise _refuse(ckpt, f"{len(groups)} config groups")
    group = next(iter(groups.values()))
    weights = group.get("weights") if isinstance(group, dict) else None
    if not isinstance(weights, dict):
        raise _refuse(ckpt, "a config group without a 'weights' scheme")
    if fmt in ("float-quantized", "int-quantized", "naive-quantized"):
        strategy = weights.get("strategy")
        if strategy not in ("channel", "block") or weights.get("group_size") is not None:
            raise _refuse(ckpt, f"format {fmt!r} and strategy {strategy!r}")
        block = weights.get("block_structure")
        is_fp8 = fmt == "float-quantized" and weights.get("type") == "float" and weights.get("num_bits") == 8
        done: set[str] = set()
        for name in list(ckpt.stored):
            if name.endswith(".weight_scale"):
                weight = name.removesuffix("_scale")
                install_scaled(ckpt, weight, name, block)
                done.add(weight)
        return done if is_fp8 else set()
    if fmt == "pack-quantized":
        num_bits, group_size = weights.get("num_bits"), weights.get("group_size")
        if weights.get("strategy") != "group" or weights.get("type", "int") != "int" or \
                not isinstance(num_bits, int) or not isinstance(group_size, int) or not 1 <= num_bits <= 8:
            raise _refuse(ckpt, f"format 'pack-quantized', strategy {weights.get('strategy')!r}, type "
                          f"{weights.get('type', 'int')!r}, {num_bits!r} bits, group size {group_size!r}")
        for name in list(ckpt.stored):
            if name.endswith(".weight_packed"):
                _install_packed(ckpt, name.removesuffix("_packed"), num_bits, group_size)
        return set()
    raise _refuse(ckpt, f"format {fmt!r}")


def _install_packed(ckpt: Checkpoint, base: str, num_bits: int, group_size: int) -> None:
    parts = {n: base + n for n in ("_packed", "_scale", "_shape", "_zero_point")}
    for suffix in ("_scale", "_shape"):
        if parts[suffix] not in ckpt.stored:
            raise CheckpointError(f"packed weight {parts['_packed']!r} has no {parts[suffix]!r} beside it",
                                  path=ckpt.model_dir)
    shape = tuple(int(d) for d in np.asarray(ckpt.read_stored(parts["_shape"])).reshape(-1))
    if len(shape) != 2:
        raise CheckpointError(f"{parts['_shape']!r} gives shape {list(shape)}, expected 2 dimensions",
                              path=ckpt.model_dir)
    packed = ckpt.stored[parts["_packed"]]
    if packed.dtype != "I32":
        raise CheckpointError(f"{parts['_packed']!r} is {packed.dtype}, expected I32", path=ckpt.model_dir)
    for suffix in ("_packed", "_scale", "_shape", "_zero_point"):
        ckpt.tensors.pop(parts[suffix], None)
    zero = ckpt.stored.get(parts["_zero_point"])
    ckpt.tensors[base] = SourceTensor(base, shape, "F32", packed.file, packed.offset)
    ckpt.derived[base] = Unpacked(ckpt, parts, shape, zero is not None, num_bits, group_size)


class Unpacked:
    """A ``pack-quantized`` weight's loader: called, its float32 values (:func:`dequant_packed`); :meth:`pieces`
    gives them in row pieces (a multiple of the rows one int32 of the zero point packs), so a stream need not
    hold the whole dequantized tensor."""

    def __init__(self, ckpt: Checkpoint, parts: dict[str, str], shape: tuple[int, ...], has_zero: bool,
                 num_bits: int, group_size: int) -> None:
        self.ckpt, self.parts, self.shape, self.has_zero = ckpt, parts, shape, has_zero
        self.num_bits, self.group_size = num_bits, group_size

    def _read(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        zero = self.ckpt.read_stored(self.parts["_zero_point"]) if self.has_zero else None
        return self.ckpt.read_stored(self.parts["_packed"]), self.ckpt.read_stored(self.parts["_scale"]), zero

    def __call__(self) -> np.ndarray:
        w, scale, zero = self._read()
        return dequant_packed(w, scale, self.ckpt.stored[self.parts["_scale"]].dtype, self.shape, zero,
                              self.num_bits, self.group_size)

    def pieces(self) -> Iterator[np.ndarray]:
        """The float32 values in row pieces, in order: the same values as :meth:`__call__`, row for row."""
        w, scale, zero = self._read()
        rows, cols = self.shape
        per = 32 // self.num_bits  # rows of zero points in one int32 (the fields dequant_packed unpacks)
        step = per * max(1, source_fp8.PIECE_WEIGHTS // max(1, per * cols))
        s_dtype = self.ckpt.stored[self.parts["_scale"]].dtype
        release = page_releaser(w)
        for r in range(0, rows, step):
            n = min(step, rows - r)
            part = w[r:r + n]
            z = None if zero is None else zero[r // per:(r + n + per - 1) // per]
            yield dequant_packed(part, scale[r:r + n], s_dtype, (n, cols), z, self.num_bits, self.group_size)
            if release is not None:
                release(part)


def dequant_packed(w: np.ndarray, scale: np.ndarray, s_dtype: str, shape: tuple[int, ...], zero: np.ndarray | None,
                   num_bits: int, group_size: int) -> np.ndarray:
    """Unpack and dequantize one ``pack-quantized`` weight (llama.cpp conversion/base.py: ``dequant_packed``).

    ``num_bits``-wide fields are taken from the low bits of each int32 up (arithmetic shifts, as torch's
    ``>>`` on int32), ``(q - offset) * scale`` in float32, where the offset is ``2**(num_bits-1)`` without a
    zero point, else the zero point's field (packed along dim 0).
    """
    rows, cols = shape
    mask = (1 << num_bits) - 1
    shifts = np.arange(0, 32 - (num_bits - 1), num_bits, dtype=np.int32)
    per = len(shifts)
    w = np.asarray(w)
    if w.ndim != 2 or w.shape[0] != rows or w.shape[1] * per < cols:
        raise CheckpointError(f"packed weight of shape {list(w.shape)} does not hold {rows}x{cols} "
                              f"{num_bits}-bit values")
    if cols % group_size:
        raise CheckpointError(f"{cols} columns are not a multiple of the group size {group_size}")
    n_groups = cols // group_size
    s = widen(scale, s_dtype)
    if s.shape != (rows, n_groups):
        raise CheckpointError(f"scale of shape {list(s.shape)}, expected {[rows, n_groups]}")
    offset: np.ndarray | int
    if zero is None:
        offset = 1 << (num_bits - 1)
    else:
        z = np.asarray(zero).astype(np.int32)
        zf = (z[:, None, :] >> shifts.reshape(1, -1, 1)) & mask
        offset = zf.reshape(-1, z.shape[1])[:rows, :, None]
    out = np.empty((rows, cols), dtype=np.float32)
    step = max(1, (1 << 20) // max(cols, 1))
    for r in range(0, rows, step):
        q = (w[r:r + step, :, None] >> shifts.reshape(1, 1, -1)) & mask
        q = q.reshape(q.shape[0], -1)[:, :cols].reshape(q.shape[0], n_groups, group_size)
        q = q - (offset if isinstance(offset, int) else offset[r:r + step])
        # torch promotes int32 * float32 to float32 (numpy would take float64): widen first, then one multiply
        out[r:r + step] = (q.astype(np.float32) * s[r:r + step, :, None]).reshape(q.shape[0], cols)
    return out
