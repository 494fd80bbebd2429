"""MXFP4 checkpoints as released (gpt-oss: ``quantization_config.quant_method == "mxfp4"``), written as GGUF
``MXFP4`` tensors without dequantizing.

A released checkpoint stores each stacked expert weight ``[n_expert, rows, cols]`` as ``<name>_blocks`` (uint8
``[n_expert, rows, cols / 32, 16]``: 32 E2M1 codes per block, element ``2j`` in the low nibble of byte ``j``,
``2j + 1`` in the high one) and ``<name>_scales`` (uint8 ``[n_expert, rows, cols / 32]``: the E8M0 exponent,
biased by 127). ggml's ``block_mxfp4`` (ggml-common.h) is the exponent byte and 16 bytes holding element ``j`` in
the low nibble of byte ``j`` and element ``j + 16`` in the high one; its values are the same E2M1 codes doubled,
scaled by ``2^(e - 128)`` (ggml_e8m0_to_fp32_half), so only the bits move: llama.cpp's converter does exactly that
(conversion/gpt_oss.py ``GptOssModel.transform_nibble_layout`` / ``repack_mxfp4``), and so does
:func:`repack_mxfp4`.

The dispatch on ``quant_method`` (converters' quantized-source handling) calls :func:`check_source` for
``"mxfp4"``: only gpt-oss has MXFP4 tensors llama.cpp's converter repacks; for any other class it stops
("Quant method is not yet supported", conversion/base.py ``dequant_model``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ggufkit.errors import UnsupportedArchitectureError

#: bytes of one ggml block_mxfp4 (ggml-common.h: uint8 e, uint8 qs[16]) and the values it holds
BLOCK_BYTES, BLOCK_VALUES = 17, 32
#: HF classes whose MXFP4 tensors llama.cpp's converter repacks (conversion/gpt_oss.py)
MXFP4_CLASSES = frozenset({"GptOssForCausalLM"})


def check_source(config: Mapping[str, Any], hf_class: str) -> None:
    """Accept an MXFP4 checkpoint of a class whose converter repacks it; refuse any other in one line."""
    if hf_class not in MXFP4_CLASSES:
        raise UnsupportedArchitectureError(
            f"{hf_class}: quantization_config.quant_method 'mxfp4' is not supported for this class (llama.cpp's "
            "converter repacks MXFP4 experts only for gpt-oss); dequantize the checkpoint first")


def repack_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """HF MXFP4 ``blocks`` ``[..., n_block, 16]`` and ``scales`` ``[..., n_block]`` -> ggml ``block_mxfp4`` bytes
    ``[..., n_block * 17]`` (llama.cpp: GptOssModel.repack_mxfp4). Lossless: nibbles and exponents are copied."""
    blocks = np.asarray(blocks, dtype=np.uint8)
    scales = np.asarray(scales, dtype=np.uint8)
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not pair")
    # codes in element order: byte j holds elements 2j (low nibble) and 2j + 1 (high nibble)
    codes = np.empty((*blocks.shape[:-1], BLOCK_VALUES), dtype=np.uint8)
    codes[..., 0::2] = blocks & 0x0F
    codes[..., 1::2] = blocks >> 4
    out = np.empty((*blocks.shape[:-1], BLOCK_BYTES), dtype=np.uint8)
    out[..., 0] = scales
    out[..., 1:] = codes[..., :16] | (codes[..., 16:] << 4)
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK_BYTES)

