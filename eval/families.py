"""The families whose forward pass is their own module (:class:`ggufkit.eval.family_forward.FamilyForward`),
by GGUF architecture name. An architecture not listed here runs the transformer block of
:class:`ggufkit.eval.model.GGUFCausalLM`."""

from __future__ import annotations

from ggufkit.eval import family_falcon_h1, family_qwen35
from ggufkit.eval.family_forward import FamilyForward

#: GGUF ``general.architecture`` -> its forward pass. One line per family, importing ``eval/family_<name>.py``.
FORWARDS: dict[str, FamilyForward] = {
    "falcon-h1": family_falcon_h1.FORWARD,
    "qwen35": family_qwen35.FORWARD,
}
