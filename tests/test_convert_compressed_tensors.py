"""compressed-tensors checkpoints as released (issue 32): ``quantization_config.quant_method =
"compressed-tensors"``.

Tiny random checkpoints of transformers' own classes stored the way llm-compressor writes them:

* ``pack-quantized`` INT4 as Kimi K2 ships it (``strategy: group``, ``group_size: 32``, symmetric: eight 4-bit
  values biased by 8 per int32 in ``weight_packed``, ``weight_shape``, bf16 ``weight_scale`` per group), and
  the asymmetric form with a ``weight_zero_point`` packed along the rows;
* ``float-quantized`` FP8 per output channel (``weight_scale`` ``[rows, 1]``) and ``int-quantized`` INT8 per
  channel.

Oracles: llama.cpp's converter on the same files (conversion/base.py ``dequant_model``: every tensor
byte-identical, every key equal) and transformers running the dequantized weights against llama.cpp running
our file. Before issue 32 these checkpoints were refused (``weight_packed`` / ``weight_scale`` had no rule).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixtures_models import llama_cpp_logits, make_checkpoint, transformers_logits
from test_convert_archs import llama_cpp_convert
from test_convert_fp8 import assert_same_file, quantized_linear

from ggufkit.converters import convert


def pack_int4(w: Any, group: int, zero_point: bool) -> tuple[dict[str, Any], Any]:
    """compressed-tensors ``pack-quantized`` tensors of a float32 matrix (``weight_packed``, ``weight_scale``,
    ``weight_shape``, optionally ``weight_zero_point``) and its dequantized values."""
    import torch

    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group)
    if zero_point:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-8).to(torch.bfloat16)
        zero = torch.clamp(torch.round(-lo / scale.float()), 0, 15).to(torch.int32)
        q = torch.clamp(torch.round(g / scale.float()[..., None]) + zero[..., None], 0, 15).to(torch.int32)
        value = (q - zero[..., None]).float() * scale.float()[..., None]
    else:
        scale = (g.abs().amax(-1) / 7).clamp(min=1e-8).to(torch.bfloat16)
        q = torch.clamp(torch.round(g / scale.float()[..., None]), -8, 7).to(torch.int32) + 8
        value = (q - 8).float() * scale.float()[..., None]
    q = q.reshape(rows, cols)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    packed = (q.reshape(rows, cols // 8, 8).to(torch.int64) << shifts).sum(-1)
    out = {"weight_packed": packed.to(torch.uint32).view(torch.int32) if hasattr(torch, "uint32")
           else packed.to(torch.int32), "weight_scale": scale,
           "weight_shape": torch.tensor([rows, cols], dtype=torch.int32)}
    if zero_point:  # packed along the rows (dim 0), eight per int32
        zr = -(-rows // 8)
        z = torch.zeros(zr * 8, cols // group, dtype=torch.int64)
        z[:rows] = zero
        out["weight_zero_point"] = (z.reshape(zr, 8, -1) << shifts[None, :, None]).sum(1).to(torch.uint32).view(
            torch.int32)
    return out, value.reshape(rows, cols)


def channel_quantized(w: Any, kind: str) -> tuple[dict[str, Any], Any]:
    """``float-quantized`` FP8 or ``int-quantized`` INT8 per output channel: (``weight``, ``weight_scale``)."""
    import torch

    amax = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8)
    if kind == "float":
        scale = (amax / 448.0).to(torch.bfloat16)
        q = (w / scale.float()).to(torch.float8_e4m3fn)
    else:
        scale = (amax / 127.0).to(torch.bfloat16)
        q = torch.clamp(torch.round(w / scale.float()), -128, 127).to(torch.int8)
    return {"weight": q, "weight_scale": scale}, q.float() * scale.float()


def store_compressed(d: Path, fmt: str, *, group: int = 32, zero_point: bool = False,
                     dequantized: Path | None = None) -> Path:
    """Rewrite checkpoint ``d`` as llm-compressor stores ``fmt`` (``pack-quantized``, ``float-quantized``,
    ``int-quantized``); with ``dequantized``, the same model with the dequantized float32 weights there."""
    from safetensors.torch import load_file, save_file

    files = sorted(d.glob("*.safetensors"))
    state: dict[str, Any] = {}
    for f in files:
        state.update(load_file(f))
    out: dict[str, Any] = {}
    plain: dict[str, Any] = {}
    for name, t in state.items():
        if quantized_linear(name, tuple(t.shape)):
            base = name.removesuffix(".weight")
            if fmt == "pack-quantized":
                parts, value = pack_int4(t.float(), group, zero_point)
            else:
                parts, value = channel_quantized(t.float(), "float" if fmt == "float-quantized" else "int")
            out.update({f"{base}.{k}": v.contiguous() for k, v in parts.items()})
            plain[name] = value
        else:
            out[name] = plain[name] = t
    for f in files:
        f.unlink()
    save_file(out, d / "model.safetensors", metadata={"format": "pt"})
    if dequantized is not None:
        shutil.copytree(d, dequantized)
        (dequantized / "model.safetensors").unlink()
        save_file({k: v.float().contiguous() for k, v in plain.items()}, dequantized / "model.safetensors",
                  metadata={"format": "pt"})
    if fmt == "pack-quantized":  # Kimi K2's weights scheme (zero point: the asymmetric variant)
        weights = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": group,
                   "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "strategy": "group",
                   "symmetric": not zero_point, "type": "int"}
    else:
        weights = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None,
                   "num_bits": 8, "observer": "minmax", "observer_kwargs": {}, "strategy": "channel",
                   "symmetric": True, "type": "float" if fmt == "float-quantized" else "int"}
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"] = {
        "config_groups": {"group_0": {"input_activations": None, "output_activations": None,
                                      "targets": ["Linear"], "weights": weights}},
        "format": fmt, "ignore": ["lm_head"], "kv_cache_scheme": None, "quant_method": "compressed-tensors",
        "quantization_status": "compressed"}
    (d / "config.json").write_text(json.dumps(config, indent=2))
    return d


#: (case, HF class, stored dtype, format, zero point)
CASES = [
    ("qwen3moe-int4", "Qwen3MoeForCausalLM", "bfloat16", "pack-quantized", False),  # Kimi K2's layout
    ("llama-int4-zero-point", "LlamaForCausalLM", "float32", "pack-quantized", True),
    ("llama-fp8-channel", "LlamaForCausalLM", "bfloat16", "float-quantized", False),
    ("llama-int8-channel", "LlamaForCausalLM", "float32", "int-quantized", False),
]


class Cases:
    """The checkpoints of :data:`CASES`, each built and converted (F32, by both converters) once per module."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.built: dict[str, dict[str, Any]] = {}

    def __getitem__(self, name: str) -> dict[str, Any]:
        if name not in self.built:
            _, hf_class, dtype, fmt, zero_point = next(c for c in CASES if c[0] == name)
            root = self.factory.mktemp(name)
            # llama.cpp's converter needs a BPE it knows by hash: GPT-2's for the Qwen classes (Llama: SPM)
            vocab = {"vocab": "real:gpt-2"} if hf_class.startswith("Qwen") else {}
            d = make_checkpoint(root / "m", hf_class, dtype=dtype, **vocab)
            store_compressed(d, fmt, zero_point=zero_point, dequantized=root / "dequantized")
            self.built[name] = {"dir": d, "dequantized": root / "dequantized",
                                "ours": convert(d, root / "ours.gguf", outtype="f32").outputs[0],
                                "theirs": llama_cpp_convert(d, root / "theirs.gguf", "f32")}
        return self.built[name]


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> Cases:
    return Cases(tmp_path_factory)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_compressed_tensors_equal_llama_cpp_converter(cases: Cases, name: str) -> None:
    """Every tensor byte-identical to llama.cpp's converter on the same files (F32: the dequantized values)."""
    assert_same_file(cases[name]["theirs"], cases[name]["ours"])


@pytest.mark.parametrize("name", ["qwen3moe-int4", "llama-int4-zero-point"])
def test_compressed_tensors_logits(cases: Cases, name: str) -> None:
    """llama.cpp running our file gives the logits of transformers running the dequantized weights."""
    want = transformers_logits(cases[name]["dequantized"])
    got = llama_cpp_logits(cases[name]["ours"])
    assert np.abs(got - want).max() <= 1e-3 * (want.max() - want.min())
    assert (got.argmax(-1) == want.argmax(-1)).all()
