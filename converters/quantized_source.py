"""Checkpoints released quantized: one dispatch on ``quantization_config.quant_method``.

- ``fp8`` (:mod:`ggufkit.converters.source_fp8`) and ``compressed-tensors``
  (:mod:`ggufkit.converters.source_compressed`) are dequantized one tensor at a time inside
  :meth:`Checkpoint.read`, exactly as llama.cpp's converter dequantizes them (conversion/base.py:
  ``ModelBase.dequant_model``), so every outtype, quantized ones included, follows in the same single pass.
- ``mxfp4`` (gpt-oss) is left to its family's hooks, which repack the blocks without dequantizing them.
- Anything else (GPTQ, AWQ, bitsandbytes, an unknown method) is refused in one line naming the method, before
  anything is written: its packed integers read as weights would make a file of garbage.

Memory stays bounded by one tensor: a dequantized weight exists only while the stream converts it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from ggufkit.converters.checkpoint import Checkpoint, SourceTensor
from ggufkit.converters.mxfp4_source import check_source as check_mxfp4_source
from ggufkit.converters.plan_types import PlanEntry
from ggufkit.converters.registry import ArchEntry
from ggufkit.converters.source_compressed import install_compressed
from ggufkit.converters.source_fp8 import FP8_DTYPES, install_fp8, widen
from ggufkit.errors import CheckpointError, UsageError

__all__ = ["KEPT_METHODS", "QUANT_METHODS", "fp8_as_q8", "open_checkpoint", "quantization_method"]

Q = GGMLQuantizationType

#: quant_method -> installer of the dequantizing loaders (returns the weights dequantized from FP8).
QUANT_METHODS: dict[str, Callable[[Checkpoint, dict[str, Any]], set[str]]] = {
    "fp8": install_fp8,
    "compressed-tensors": install_compressed,
}
#: quant_method -> a check of the class, where the family's hooks read the stored tensors themselves:
#: gpt-oss's hooks repack ``*_blocks`` / ``*_scales`` into ggml MXFP4 without dequantizing them.
KEPT_METHODS: dict[str, Callable[[dict[str, Any], str], None]] = {
    "mxfp4": check_mxfp4_source,
}


def quantization_method(config: dict[str, Any], model_dir: Path) -> tuple[str | None, dict[str, Any]]:
    """(quant_method, quantization_config) of a checkpoint, (None, {}) when it is not quantized.

    As llama.cpp's converter reads it (conversion/base.py: ``prepare_tensors``): ``config.json``'s
    ``quantization_config``, else ModelOpt's ``hf_quant_config.json`` (its producer's name). A bitsandbytes
    config written before transformers named the method (``load_in_4bit`` / ``load_in_8bit`` only) is
    ``bitsandbytes``.
    """
    quant = config.get("quantization_config")
    if isinstance(quant, dict) and quant:
        method = quant.get("quant_method")
        if method is None and (quant.get("load_in_4bit") or quant.get("load_in_8bit")):
            method = "bitsandbytes"
        return (str(method) if method is not None else "unnamed"), quant
    side = model_dir / "hf_quant_config.json"
    if side.is_file():
        try:
            data = json.loads(side.read_text(encoding="utf-8"))
            producer = str((data.get("producer") or {}).get("name") or "modelopt").lower()
        except (OSError, ValueError, AttributeError):
            producer = "modelopt"
        return producer, {}
    return None, {}


def _describe(method: str, quant: dict[str, Any]) -> str:
    if method == "bitsandbytes":
        bits = "4-bit" if quant.get("load_in_4bit") else "8-bit" if quant.get("load_in_8bit") else ""
        kind = quant.get("bnb_4bit_quant_type") if quant.get("load_in_4bit") else None
        return "bitsandbytes" + (f" {bits}" if bits else "") + (f" {kind}" if kind else "")
    n_bits = quant.get("bits") or quant.get("w_bit")  # GPTQ's and AWQ's spellings
    return method + (f" {n_bits}-bit" if isinstance(n_bits, int) else "")


def open_checkpoint(model_dir: Path, config: dict[str, Any], entry: ArchEntry) -> Checkpoint:
    """The checkpoint's weights, those of a quantized source read dequantized (one tensor at a time).

    Raises:
        CheckpointError: a quantization method ggufkit does not convert (named), or a malformed quantized
            source; an FP8 tensor that no scale dequantizes is read as its float values (as llama.cpp's
            converter widens it).
    """
    method, quant = quantization_method(config, model_dir)
    if method is not None and method in KEPT_METHODS:
        KEPT_METHODS[method](config, entry.hf_class)
    elif method is not None and method not in QUANT_METHODS:
        raise CheckpointError(f"the checkpoint is quantized with {_describe(method, quant)} "
                              f"(quant_method {method!r}), which ggufkit does not convert (it converts fp8, "
                              "compressed-tensors and gpt-oss's mxfp4 sources); convert the unquantized "
                              f"{entry.hf_class} checkpoint instead", path=model_dir)
    ckpt = Checkpoint(model_dir)
    install = QUANT_METHODS.get(method) if method is not None else None  # None: not quantized, or kept
    if install is not None:
        ckpt.fp8_sources = install(ckpt, quant)
    for name, t in list(ckpt.tensors.items()):
        if t.dtype in FP8_DTYPES and name not in ckpt.derived:  # no scale: llama.cpp's .to(torch.float32)
            ckpt.tensors[name] = SourceTensor(t.name, t.shape, "F32", t.file, t.offset)
            ckpt.derived[name] = _widened(ckpt, name, t.dtype)
    return ckpt


def _widened(ckpt: Checkpoint, name: str, dtype: str) -> Callable[[], np.ndarray]:
    return lambda: widen(ckpt.read_stored(name), dtype)


def fp8_as_q8(entries: list[PlanEntry], ckpt: Checkpoint | None, outtype: str) -> list[PlanEntry]:
    """llama.cpp's ``--fp8-as-q8`` (conversion/base.py: ``tensor_force_quant``): every tensor of two or more
    dimensions dequantized from FP8 is written Q8_0, the rest in the outtype; norms and 1-D tensors stay F32,
    and a row length Q8_0 cannot hold falls back to F16 as the converter's ``QuantError`` handler does."""
    if outtype not in ("f32", "f16", "bf16", "q8_0"):
        raise UsageError(f"--fp8-as-q8 combines with the outtypes f32, f16, bf16 and q8_0 (llama.cpp's "
                         f"converter's), not {outtype}")
    fp8 = ckpt.fp8_sources if ckpt is not None else set()
    out = []
    for e in entries:
        last = e.source.removesuffix(" (stacked)").split(" .. ")[-1].split("[")[0]
        if last in fp8 and len(e.shape) >= 2 and not e.name.endswith("_norm.weight"):
            if e.shape[-1] % 32:
                e = dataclasses.replace(e, ggml_type=Q.F16, reason="FP8 source, rows not a multiple of Q8_0's "
                                        "32: F16 (llama.cpp's fallback)")
            else:
                e = dataclasses.replace(e, ggml_type=Q.Q8_0, reason="FP8 source: Q8_0 (--fp8-as-q8)")
        out.append(e)
    return out
