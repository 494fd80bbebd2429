"""Gemma 2 / Gemma 3 hooks: refuse checkpoints llama.cpp's Gemma loaders and graphs would silently compute
differently (src/models/gemma2.cpp, src/models/gemma3.cpp; conversion/gemma.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ggufkit.errors import UnsupportedArchitectureError

#: llama.cpp's Gemma "27B" types, told apart by their layer count, per GGUF architecture (src/models/gemma2.cpp,
#: gemma3.cpp: load_arch_hparams, LLM_TYPE_27B); their queries are scaled by 1/sqrt(n_embd / n_head).
LAYERS_27B = {"gemma2": 46, "gemma3": 62}
#: Every ``SWA_PATTERN[arch]``-th layer attends globally, the others through the sliding window
#: (load_arch_hparams: ``hparams.set_swa_pattern(2)`` for gemma2, ``(6)`` for gemma3).
SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
#: Hugging Face ``model_type`` -> the GGUF architecture llama.cpp's converter writes (conversion/gemma.py).
_ARCH_OF_MODEL_TYPE = {"gemma2": "gemma2", "gemma3_text": "gemma3", "gemma3": "gemma3"}
_27B_LAYERS = {model_type: LAYERS_27B[arch] for model_type, arch in _ARCH_OF_MODEL_TYPE.items()}


def is_sliding(il: int, period: int) -> bool:
    """Whether layer ``il`` attends through the sliding window when every ``period``-th layer is global
    (llama_hparams::set_swa_pattern in src/llama-hparams.cpp: ``il % period < period - 1``)."""
    return il % period < period - 1


def query_scale_dim(n_layer: int | None, layers_27b: int | None, n_embd: int, n_head: int, head_dim: int) -> int:
    """``d`` of llama.cpp's Gemma query scale ``1/sqrt(d)``: ``n_embd / n_head`` for its "27B" type (``n_layer``
    equal to ``layers_27b``), else ``head_dim`` (load_arch_hparams: ``f_attention_scale``)."""
    return n_embd // n_head if n_layer == layers_27b else head_dim


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
        if isinstance(hidden, int) and isinstance(heads, int):
            want = query_scale_dim(n_layer, _27B_LAYERS.get(model_type), hidden, heads, head_dim)
        if not math.isclose(float(scalar), float(want)):
            problems.append(f"query_pre_attn_scalar {scalar} (llama.cpp scales queries by 1/sqrt({want}))")
    pattern = SWA_PATTERN["gemma2" if model_type == "gemma2" else "gemma3"]
    types = config.get("layer_types")
    if isinstance(types, list) and config.get("sliding_window"):
        want_types = ["sliding_attention" if is_sliding(i, pattern) else "full_attention" for i in range(len(types))]
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
