"""ggufkit.quant: Numba CPU/CUDA quantization kernels byte-identical to ggml, and llama-quantize on top.

Public API:

* :func:`quantize` / :func:`dequantize` - one tensor (``ggufkit.quant.dispatch``).
* :data:`KERNELS`, :class:`TypeTraits`, :data:`SUPPORTED_TYPES` - the kernel registry.
* :func:`plan_quantization` and :func:`quantize_file` - llama-quantize's per-tensor plan and the file
  pipeline (``ggufkit.quant.llama_quantize.plan`` / ``ggufkit.quant.llama_quantize.pipeline``), imported on first access.

Importing this package imports neither Numba nor ``numba.cuda``; kernels load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from ggufkit.quant.dispatch import cuda_available, dequantize, quantize, resolve_device
from ggufkit.quant.registry import FLOAT_TYPES, KERNELS, SUPPORTED_TYPES, TypeTraits

__all__ = [
    "FLOAT_TYPES",
    "KERNELS",
    "SUPPORTED_TYPES",
    "TypeTraits",
    "cuda_available",
    "dequantize",
    "plan_quantization",
    "quantize",
    "quantize_file",
    "resolve_device",
]

# Later layers of this package, loaded lazily so `import ggufkit.quant` stays cheap.
_LAZY = {
    "plan_quantization": "ggufkit.quant.llama_quantize.plan",
    "quantize_file": "ggufkit.quant.llama_quantize.pipeline",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ggufkit.quant' has no attribute {name!r}")
