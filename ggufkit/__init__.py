"""ggufkit: Hugging Face checkpoints to GGUF, byte-exact quantization, metadata editing, perplexity.

The public API is re-exported here lazily, so ``import ggufkit`` (and ``ggufkit --help``) stays fast:

- format I/O: :func:`open_gguf`, :func:`write_gguf`, :class:`Metadata`, :class:`TensorSpec`
- :func:`edit_metadata` (set-meta); structural validation is :func:`ggufkit.verify.verify`
- :mod:`ggufkit.quant` (quantize), :mod:`ggufkit.converters` (convert), :mod:`ggufkit.eval` (perplexity)
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "open_gguf": "ggufkit.format",
    "write_gguf": "ggufkit.format",
    "GGUFFile": "ggufkit.format",
    "GGUFModel": "ggufkit.format",
    "Metadata": "ggufkit.format",
    "TensorSpec": "ggufkit.format",
    "TypedValue": "ggufkit.format",
    "edit_metadata": "ggufkit.metadata_edit",
    "GGUFKitError": "ggufkit.errors",
    "GGUFFormatError": "ggufkit.errors",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ggufkit' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
