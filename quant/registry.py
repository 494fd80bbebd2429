"""The kernel registry: one entry per quantized GGML type ggufkit can produce.

``KERNELS`` is the single source of truth for which block types have kernels, where they live and what
they are called. The dispatch layer (:mod:`ggufkit.quant.dispatch`), the CLI's ``--type`` choices and the
tests (parametrised over ``KERNELS``) all read it. Kernel modules are named, not imported, so reading the
registry costs nothing (``ggufkit --help`` must not import Numba); :meth:`QuantKernels.cpu` and
:meth:`QuantKernels.cuda` import on first use.

Kernel contract (every entry, both backends):

* ``quantize(x: float32[n_rows, n_per_row], qw: float32[k], out: uint8[n_rows, row_bytes]) -> None``;
  ``k == 0`` means no imatrix (ggml's reference quantizer), ``k == n_per_row`` the weighted variant.
* ``dequantize(blocks: uint8[n_rows, row_bytes], out: float32[n_rows, n_per_row]) -> None``.
* optional, CPU only: ``quantize_f16(h: uint16[n_rows, n_per_row], table: float32[65536], qw, out,
  bad_rows: uint8[n_rows]) -> None``, which widens F16 bits row by row inside the kernel (same bytes as
  ``quantize`` on the widened values) and flags rows holding inf/NaN.

The float targets F32/F16/BF16 are element-wise conversions, not block kernels; they are listed in
:data:`FLOAT_TYPES` and handled by :mod:`ggufkit.quant.dispatch` directly.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType

#: Element-wise targets: ``ggml_quantize_chunk`` copies F32 and converts with ``ggml_fp32_to_fp16_row`` /
#: ``ggml_fp32_to_bf16_row_ref``.
FLOAT_TYPES: frozenset[GGMLQuantizationType] = frozenset({T.F32, T.F16, T.BF16})


@dataclass(frozen=True)
class QuantKernels:
    """Where one type's kernels live. Sizes are read from ``gguf.GGML_QUANT_SIZES``, never restated.

    Attributes:
        qtype: the GGML type.
        cpu_module: module of the Numba CPU kernels.
        cpu_quantize, cpu_dequantize: their function names.
        cuda_module: module of the Numba CUDA kernels (host wrappers taking numpy arrays).
        cuda_quantize, cuda_dequantize: their function names.
        cpu_f16_module, cpu_quantize_f16: the fused F16-input CPU kernel, or "" where there is none.
    """

    qtype: GGMLQuantizationType
    cpu_module: str
    cpu_quantize: str
    cpu_dequantize: str
    cuda_module: str
    cuda_quantize: str
    cuda_dequantize: str
    cpu_f16_module: str = ""
    cpu_quantize_f16: str = ""

    @property
    def block_size(self) -> int:
        """Elements per block (``GGML_QUANT_SIZES[qtype][0]``)."""
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def type_size(self) -> int:
        """Bytes per block (``GGML_QUANT_SIZES[qtype][1]``)."""
        return GGML_QUANT_SIZES[self.qtype][1]

    def row_bytes(self, n_per_row: int) -> int:
        """Bytes of one row of ``n_per_row`` elements (a multiple of :attr:`block_size`)."""
        return n_per_row // self.block_size * self.type_size

    def cpu(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """Import and return the CPU ``(quantize, dequantize)`` kernels."""
        module = importlib.import_module(self.cpu_module)
        return getattr(module, self.cpu_quantize), getattr(module, self.cpu_dequantize)

    def cpu_f16(self) -> Callable[..., Any] | None:
        """Import and return the fused F16-input CPU quantize kernel, or None where the type has none."""
        if not self.cpu_quantize_f16:
            return None
        return getattr(importlib.import_module(self.cpu_f16_module), self.cpu_quantize_f16)

    def cuda(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """Import and return the CUDA ``(quantize, dequantize)`` host wrappers (imports ``numba.cuda``)."""
        module = importlib.import_module(self.cuda_module)
        return getattr(module, self.cuda_quantize), getattr(module, self.cuda_dequantize)


def _entry(qtype: GGMLQuantizationType, family: str) -> QuantKernels:
    # Function names follow ggml's type names: quantize_rows_q4_0, quantize_rows_q4_K, ..._cuda.
    t = qtype.name.lower() if family == "legacy" else qtype.name[:-2].lower() + "_K"
    return QuantKernels(
        qtype=qtype,
        cpu_module=f"ggufkit.quant.{family}",
        cpu_quantize=f"quantize_rows_{t}",
        cpu_dequantize=f"dequantize_rows_{t}",
        cuda_module=f"ggufkit.quant.cuda_{family}",
        cuda_quantize=f"quantize_rows_{t}_cuda",
        cuda_dequantize=f"dequantize_rows_{t}_cuda",
        cpu_f16_module=f"ggufkit.quant.{family}_f16" if family == "legacy" else "",
        cpu_quantize_f16=f"quantize_f16_rows_{t}" if family == "legacy" else "",
    )


def _grid_entry(qtype: GGMLQuantizationType, module: str) -> QuantKernels:
    # The grid types (IQ1/IQ2/IQ3) have CPU kernels only: cuda_module "" marks "no CUDA kernel; runs on the
    # CPU under --device cuda" (the issue allows it, if the plan says so).
    t = qtype.name.lower()
    return QuantKernels(qtype=qtype, cpu_module=f"ggufkit.quant.{module}", cpu_quantize=f"quantize_rows_{t}",
                        cpu_dequantize=f"dequantize_rows_{t}", cuda_module="", cuda_quantize="", cuda_dequantize="")


#: Every quantized type with kernels, in ggml type-id order.
KERNELS: dict[GGMLQuantizationType, QuantKernels] = {
    **{t: _entry(t, "legacy") for t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)},
    **{t: _entry(t, "kquants") for t in (T.Q4_K, T.Q5_K, T.Q6_K)},
    T.IQ2_XXS: _grid_entry(T.IQ2_XXS, "iq2"),
    T.IQ2_XS: _grid_entry(T.IQ2_XS, "iq2"),
    T.IQ3_XXS: _grid_entry(T.IQ3_XXS, "iq3"),
    T.IQ1_S: _grid_entry(T.IQ1_S, "iq1"),
    T.IQ3_S: _grid_entry(T.IQ3_S, "iq3"),
    T.IQ2_S: _grid_entry(T.IQ2_S, "iq2"),
    T.IQ1_M: _grid_entry(T.IQ1_M, "iq1"),
}

#: Every type :func:`ggufkit.quant.quantize` can produce.
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(KERNELS) | FLOAT_TYPES
