"""The families whose forward pass is their own module (:class:`ggufkit.eval.family_forward.FamilyForward`),
by GGUF architecture name. An architecture not listed here runs the transformer block of
:class:`ggufkit.eval.model.GGUFCausalLM`."""

from __future__ import annotations

from ggufkit.eval import (
    family_deepseek2,
    family_ernie,
    family_falcon_h1,
    family_gemma3n,
    family_glm4moe,
    family_gpt_oss,
    family_granite_hybrid,
    family_lfm2,
    family_llama4,
    family_nemotron_h,
    family_qwen3next,
    family_qwen35,
)
from ggufkit.eval.family_forward import FamilyForward

#: GGUF ``general.architecture`` -> its forward pass. One line per family, importing ``eval/family_<name>.py``.
FORWARDS: dict[str, FamilyForward] = {
    "lfm2": family_lfm2.FORWARD,
    "lfm2moe": family_lfm2.FORWARD,
    "qwen35": family_qwen35.FORWARD,
    "qwen35moe": family_qwen35.FORWARD,
    "qwen3next": family_qwen3next.FORWARD,
    "granitehybrid": family_granite_hybrid.FORWARD,
    "nemotron_h": family_nemotron_h.FORWARD,
    "nemotron_h_moe": family_nemotron_h.FORWARD,
    "falcon-h1": family_falcon_h1.FORWARD,
    "gemma3n": family_gemma3n.FORWARD,
    "ernie4_5-moe": family_ernie.FORWARD,
    "llama4": family_llama4.FORWARD,
    "glm4moe": family_glm4moe.FORWARD,
    "deepseek2": family_deepseek2.FORWARD,
    "gpt-oss": family_gpt_oss.FORWARD,
}
