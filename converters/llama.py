"""LLaMA family hooks: llama3 rope frequency factors (a tensor computed from the config)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ggufkit.converters.hparams import DERIVE, first_of, rope_scaling


def extra_tensors(config: Mapping[str, Any]) -> list[tuple[str, np.ndarray]]:
    """``rope_freqs.weight`` for ``rope_type == "llama3"``: one correction factor per inverse frequency
    (convert_hf_to_gguf.py: LlamaModel.generate_extra_tensors, which Llama 4 inherits; llama.cpp writes no
    rope.scaling key for it). llama.cpp computes the frequencies and the factors between the low and high
    frequency wavelengths in torch float32; torch is used where it is installed (wherever llama.cpp's converter
    runs, and ggufkit's ``[torch]`` extra), else float64 rounded once, which can differ from llama.cpp's file in
    the last bit of a factor in that band (Llama 3.1/3.2's; Llama 4's low and high factors are equal)."""
    scaling = rope_scaling(config)
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "llama3":
        return []
    base = float(first_of(config, ["rope_parameters.rope_theta", "rope_theta"]) or 10000.0)
    dim = int(DERIVE["head_dim"](config))
    factor = float(scaling.get("factor", 8.0))
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    try:
        import torch
    except ImportError:  # pragma: no cover - the [torch] extra is not installed
        freqs: Any = [1.0 / base ** (i / dim) for i in range(0, dim, 2)]
    else:
        freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factors = [_llama3_factor(f, factor, low, high, old_ctx) for f in freqs]
    return [("rope_freqs.weight", np.asarray([float(f) for f in factors], dtype=np.float32))]


def _llama3_factor(freq: Any, factor: float, low: float, high: float, old_ctx: float) -> Any:
    """One frequency's factor, in ``freq``'s arithmetic (a torch float32 scalar, or a Python float)."""
    wavelen = 2 * math.pi / freq
    if wavelen < old_ctx / high:
        return 1.0
    if wavelen > old_ctx / low:
        return factor
    smooth = (old_ctx / wavelen - low) / (high - low)
    return 1 / ((1 - smooth) / factor + smooth)
