"""A GGUF tensor kept as its raw bytes on the device and dequantized on demand, the evaluator's weight type
(:mod:`ggufkit.eval.model` holds its tensors as these; :mod:`ggufkit.eval.moe` slices experts out of them)."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from ggufkit.eval.dequant import dequantize
from ggufkit.format.tensor_shape import n_elements


class QTensor:
    """One tensor kept as raw GGUF bytes on the device.

    Attributes:
        name: tensor name.
        qtype: GGML type.
        shape: numpy-order shape in elements (rows first).
        raw: ``uint8[n_rows, row_bytes]`` on the device.
    """

    def __init__(self, name: str, qtype: GGMLQuantizationType, shape: tuple[int, ...], raw: torch.Tensor) -> None:
        self.name = name
        self.qtype = qtype
        self.shape = shape
        n_rows = n_elements(shape[:-1])
        self.raw = raw.reshape(n_rows, -1)

    def float(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole tensor dequantized, in numpy-order ``shape``."""
        return dequantize(self.raw, self.qtype, self.shape[-1]).reshape(self.shape).to(dtype)

    def row_range(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``start:stop`` of a 2-D tensor, dequantized (a slice: no copy of the raw bytes)."""
        return dequantize(self.raw[start:stop], self.qtype, self.shape[-1]).to(dtype)

    def permute_rows(self, order: torch.Tensor) -> None:
        """Reorder the rows in place (quantization blocks never span rows, so raw rows move intact)."""
        self.raw = self.raw[order.to(self.raw.device)].contiguous()

    def block_mins(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Q4_1/Q5_1: each 32-block's minimum ``m`` (the F16 after ``d``) of rows ``start:stop``,
        float32 ``[rows, n/32]``."""
        raw = self.raw[start:stop]
        blocks = raw.reshape(raw.shape[0], -1, raw.shape[1] * 32 // self.shape[-1])
        return blocks[:, :, 2:4].contiguous().view(torch.float16).squeeze(-1).to(torch.float32)

    def rows(self, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``index`` (any shape) of a 2-D tensor, dequantized: ``[*index.shape, shape[-1]]``."""
        flat = index.reshape(-1)
        out = dequantize(self.raw[flat], self.qtype, self.shape[-1]).to(dtype)
        return out.reshape(*index.shape, self.shape[-1])
