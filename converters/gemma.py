"""Gemma 2 / Gemma 3 hooks: refuse checkpoints llama.cpp's Gemma loaders and graphs would silently compute
differently (src/models/gemma2.cpp, src/models/gemma3.cpp; conversion/gemma.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ggufkit.errors import UnsupportedArchitectureError

#: llama.cpp's Gemma "27B" types (by layer count), whose query scale is 1/sqrt(n_embd / n_head).
_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62, "gemma3": 62}


def check_config(config: Mapping[str, Any]) -> None:
    """Tied head, and a query scale, sliding-window layout and rope base llama.cpp reproduces."""
    model_type = str(config.get("model_type", "gemma"))
    problems = []
    if config.get("tie_word_embeddings", True) is False:
        problems.append("an lm_head not tied to the embeddings (llama.cpp's converter drops it and its loader "
                        "uses token_embd as the head)")
    head_dim = config.get("head_dim")
    scalar = config.get("query_pre_attn_scalar")
    if isinstance(head_dim, int) and scalar is not None:
        n_layer, hidden, heads = (config.get(k) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads"))
        want = head_dim
        if n_layer == _27B_LAYERS.get(model_type) and isinstance(hidden, int) and isinstance(heads, int):
            want = hidden // heads
        if not math.isclose(float(scalar), float(want)):
            problems.append(f"query_pre_attn_scalar {scalar} (llama.cpp scales queries by 1/sqrt({want}))")
    pattern = 2 if model_type == "gemma2" else 6
    types = config.get("layer_types")
    if isinstance(types, list) and config.get("sliding_window"):
        want_types = ["sliding_attention" if i % pattern < pattern - 1 else "full_attention"
                      for i in range(len(types))]
        if types != want_types:
            problems.append(f"layer_types other than llama.cpp's fixed pattern (every {pattern}th layer global)")
    if model_type == "gemma2":
        params = config.get("rope_parameters") or {}
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        if float(theta) != 10000.0:
            problems.append(f"rope_theta {theta} (llama.cpp's converter writes no rope base for Gemma 2: 10000)")
    if problems:
        raise UnsupportedArchitectureError(f"{model_type}: llama.cpp would compute another model: "
                                           + "; ".join(problems))


def mmproj_metadata(config: Mapping[str, Any], preprocessor: Mapping[str, Any]) -> dict[str, Any]:
    """clip.vision.projector.scale_factor where it is not libmtmd's default 4 (conversion/gemma.py
    ``Gemma3VisionModel.set_gguf_parameters``): patches per side over tokens per side, the token count from the
    processor's ``image_seq_length`` (256 when absent)."""
    from gguf import Keys

    from ggufkit.format.values import VT

    vision = config.get("vision_config") or {}
    n_per_side = int(int(preprocessor.get("image_seq_length", 256)) ** 0.5)
    factor = (int(vision["image_size"]) // int(vision["patch_size"])) // n_per_side if n_per_side else 0
    if factor > 0 and factor != 4:
        return {Keys.ClipVision.Projector.SCALE_FACTOR: (VT.UINT32, factor, None)}
    return {}
