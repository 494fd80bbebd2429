"""``ggufkit convert --outtype`` choices, read from llama-quantize's preset table
(:data:`ggufkit.quant.llama_quantize.presets.CONVERT_OUTTYPES` and ``ADAPTER_OUTTYPES``, its ``outtype`` column).

``auto`` comes first: the checkpoint's own precision decides (llama.cpp's ``LlamaFileType.GUESSED``).
This module is light (no numba, no torch): the CLI builds ``--help`` from it.
"""

from __future__ import annotations

from ggufkit.quant.llama_quantize.presets import ADAPTER_OUTTYPES, CONVERT_OUTTYPES

#: Model conversions: the float types, q8_0, then ggufkit's quantized outtypes.
OUTTYPES: tuple[str, ...] = ("auto", *CONVERT_OUTTYPES)

#: LoRA adapters (llama.cpp's convert_lora_to_gguf.py offers f32, f16, bf16, q8_0).
LORA_OUTTYPES: tuple[str, ...] = ("auto", *ADAPTER_OUTTYPES)

__all__ = ["LORA_OUTTYPES", "OUTTYPES"]
