"""LLaMA family hooks: llama3 rope frequency factors (a tensor computed from the config)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ggufkit.converters.hparams import DERIVE, first_of, rope_scaling


def extra_tensors(config: Mapping[str, Any]) -> list[tuple[str, np.ndarray]]:
    """``rope_freqs.weight`` for ``rope_type == "llama3"``: one correction factor per inverse frequency
    (convert_hf_to_gguf.py: LlamaModel.generate_extra_tensors; llama.cpp writes no rope.scaling key for it)."""
    scaling = rope_scaling(config)
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "llama3":
        return []
    base = float(first_of(config, ["rope_parameters.rope_theta", "rope_theta"]) or 10000.0)
    dim = int(DERIVE["head_dim"](config))
    factor = float(scaling.get("factor", 8.0))
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    factors = []
    for i in range(0, dim, 2):
        freq = 1.0 / base ** (i / dim)
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return [("rope_freqs.weight", np.asarray(factors, dtype=np.float32))]
