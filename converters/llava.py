"""LLaVA-style projectors with a Pixtral tower (LlavaForConditionalGeneration, Mistral3ForConditionalGeneration):
the activation flag YAML cannot say (conversion/llava.py ``LlavaVisionModel.set_gguf_parameters``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ggufkit.errors import UnsupportedArchitectureError


def mmproj_metadata(config: Mapping[str, Any], preprocessor: Mapping[str, Any]) -> dict[str, Any]:
    """clip.use_silu or clip.use_gelu from the Pixtral tower's hidden_act; other towers are refused."""
    from gguf import Keys

    from ggufkit.format.values import VT

    vision = config.get("vision_config") or {}
    if vision.get("model_type") != "pixtral":
        raise UnsupportedArchitectureError(f"--mmproj: {config.get('architectures', ['?'])[0]} with a "
                                           f"{vision.get('model_type')!r} vision tower (llama.cpp's converter "
                                           "writes only Pixtral towers for this class)")
    act = vision.get("hidden_act", "gelu")
    if act == "silu":
        return {Keys.ClipVision.USE_SILU: (VT.BOOL, True, None)}
    if act == "gelu":
        return {Keys.ClipVision.USE_GELU: (VT.BOOL, True, None)}
    raise UnsupportedArchitectureError(f"--mmproj: Pixtral hidden_act {act!r} (libmtmd runs silu or gelu)")
