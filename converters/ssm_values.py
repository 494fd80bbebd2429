"""Values llama.cpp's converter computes with torch for state-space layers, computed the same way here.

Mamba2 and delta-net checkpoints store ``A_log``; llama.cpp's converter writes ``A = -torch.exp(A_log)``
(conversion/mamba.py Mamba2Model.modify_tensors, conversion/qwen.py Qwen3NextModel.modify_tensors). torch's CPU
exp (its SIMD kernel) rounds about 1 % of elements one unit in the last place away from numpy's, so torch is
used where it is installed (wherever llama.cpp's converter runs, and ggufkit's ``[torch]`` extra); without it
the exp is taken in float64 and rounded once, which differs from llama.cpp's file in those last bits only.
"""

from __future__ import annotations

import numpy as np

from ggufkit.converters.stream import to_float32


def neg_exp(arr: np.ndarray, src_dtype: str = "F32") -> np.ndarray:
    """``-exp(arr)`` as ``-torch.exp`` computes it (float32 in, float32 out). A ``BF16`` source (its bit
    patterns) is widened to float32 first, as llama.cpp's converter widens bf16 before ``modify_tensors``."""
    if src_dtype == "BF16":
        arr = to_float32(arr, "BF16")
    try:
        import torch
    except ImportError:  # pragma: no cover - the [torch] extra is not installed
        return (-np.exp(arr.astype(np.float64))).astype(arr.dtype)
    return (-torch.exp(torch.from_numpy(np.array(arr)))).numpy()
