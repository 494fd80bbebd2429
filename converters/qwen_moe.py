"""Qwen2-MoE / Qwen3-MoE hooks: refuse router settings that llama.cpp's graphs would silently compute
differently from the checkpoint (src/models/qwen2moe.cpp, src/models/qwen3moe.cpp)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ggufkit.errors import UnsupportedArchitectureError

#: model_type -> what llama.cpp's graph does with the top-k weights (build_moe_ffn's norm_w).
_RENORMALISES = {"qwen2_moe": False, "qwen3_moe": True}


def check_config(config: Mapping[str, Any]) -> None:
    """Every layer sparse, and ``norm_topk_prob`` as llama.cpp's graph computes it."""
    model_type = str(config.get("model_type", ""))
    renorm = _RENORMALISES.get(model_type, model_type != "qwen2_moe")
    wanted = bool(config.get("norm_topk_prob", False))
    if wanted != renorm:
        raise UnsupportedArchitectureError(
            f"{model_type}: norm_topk_prob is {str(wanted).lower()}, but llama.cpp's graph "
            f"{'always' if renorm else 'never'} renormalises the top-k expert weights; the GGUF would compute "
            "another model")
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1) or 1) != 1:
        raise UnsupportedArchitectureError(f"{model_type}: dense layers between the MoE layers (mlp_only_layers / "
                                           "decoder_sparse_step) are not supported by llama.cpp's graph")
