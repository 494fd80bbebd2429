"""FP8 checkpoints as released (issue 32): ``quantization_config.quant_method = "fp8"``.

Tiny random checkpoints of transformers' own classes (Qwen3, Qwen3-MoE, Llama) stored the way the FP8 releases
store them (DeepSeek-V3/R1, Qwen3-*-FP8, GLM-4.5-FP8): every linear layer's weight as ``float8_e4m3fn`` with a
``weight_scale_inv`` beside it (128x128 blocks as released, smaller blocks with partial edge blocks, one scale
per output channel, one per tensor), embeddings, norms, routers and the head left unquantized.

Oracles: llama.cpp's converter on the same files (every tensor byte-identical, every key equal), llama-quantize
on its F32 file for the one-pass quantized outtype, and transformers running the dequantized weights against
llama.cpp running our file. Before issue 32 an FP8 checkpoint was refused (its F8_E4M3 dtype was unknown).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_helpers import invoke
from fixtures_models import llama_cpp_logits, make_checkpoint, transformers_logits
from llama_cpp_sources import llama_cpp_dir, tool_path
from test_convert_archs import EXTRA_KEYS, _compared_key, llama_cpp_convert

from ggufkit.converters import convert
from ggufkit.format import open_gguf

#: FP8 e4m3's largest finite value
FP8_MAX = 448.0


def assert_same_file(theirs: Path, ours: Path) -> None:
    """Every tensor (name, type, shape, bytes) and every key as llama.cpp's converter writes them (naming and
    ggufkit's provenance keys aside; sentencepiece's explicit unknown_token_id as tests/test_convert_archs.py
    allows it)."""
    with open_gguf(theirs) as a, open_gguf(ours) as b:
        assert [(t.name, t.ggml_type, t.ne) for t in a.tensors] == [(t.name, t.ggml_type, t.ne) for t in b.tensors]
        for t in a.tensors:
            assert bytes(a.raw(t)) == bytes(b.raw(b[t.name])), t.name
        keys_a = {k for k in a.kv if _compared_key(k)}
        keys_b = {k for k in b.kv if _compared_key(k)}
        assert keys_a <= keys_b and keys_b - keys_a <= set(EXTRA_KEYS), keys_a ^ keys_b
        for key in keys_a:
            va, vb = a.get(key), b.get(key)
            same = np.array_equal(np.asarray(va), np.asarray(vb)) if isinstance(va, (list, np.ndarray)) else va == vb
            assert a.kv[key].type == b.kv[key].type and same, key


def quantized_linear(name: str, shape: tuple[int, ...]) -> bool:
    """The tensors the FP8 releases store in FP8: every linear weight inside a decoder layer (the router
    ``mlp.gate`` and the norms stay in the checkpoint's dtype)."""
    return ".layers." in name and name.endswith("proj.weight") and len(shape) == 2


def fp8_weight(w: Any, scheme: str, block: tuple[int, int]) -> tuple[Any, Any]:
    """(float8_e4m3fn weight, float32 scale_inv) of a float32 matrix: absmax / 448 per 128x128-style block,
    per output channel ([rows, 1]) or per tensor ([])."""
    import torch

    rows, cols = w.shape
    if scheme == "block":
        b0, b1 = block
        nr, nc = -(-rows // b0), -(-cols // b1)
        padded = torch.zeros(nr * b0, nc * b1)
        padded[:rows, :cols] = w
        amax = padded.reshape(nr, b0, nc, b1).abs().amax(dim=(1, 3))
        scale = (amax / FP8_MAX).clamp(min=1e-12)
        full = scale.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[:rows, :cols]
    elif scheme == "channel" or (scheme == "mixed" and rows == cols):
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        full = scale
    else:
        scale = (w.abs().amax() / FP8_MAX).clamp(min=1e-12)
        full = scale
    return (w / full).to(torch.float8_e4m3fn), scale.float()


def store_fp8(d: Path, *, scheme: str = "block", block: tuple[int, int] = (128, 128),
              scale_dtype: str = "float32", dequantized: Path | None = None) -> Path:
    """Rewrite checkpoint ``d`` as an FP8 release stores it; with ``dequantized``, also write there the same
    checkpoint with the dequantized weights (float32, no quantization_config) for transformers."""
    import torch
    from safetensors.torch import load_file, save_file

    files = sorted(d.glob("*.safetensors"))
    state: dict[str, Any] = {}
    for f in files:
        state.update(load_file(f))
    out: dict[str, Any] = {}
    plain: dict[str, Any] = {}
    for name, t in state.items():
        if quantized_linear(name, tuple(t.shape)):
            q, s = fp8_weight(t.float(), scheme, block)
            s = s.to(getattr(torch, scale_dtype))
            out[name], out[name + "_scale_inv"] = q, s
            full = s.float()
            if scheme == "block":
                full = full.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:t.shape[0], :t.shape[1]]
            plain[name] = q.float() * full
        else:
            out[name] = plain[name] = t
    for f in files:
        f.unlink()
    save_file(out, d / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((d / "config.json").read_text())
    if dequantized is not None:
        shutil.copytree(d, dequantized)
        (dequantized / "model.safetensors").unlink()
        save_file({k: v.float().contiguous() for k, v in plain.items()}, dequantized / "model.safetensors",
                  metadata={"format": "pt"})
    quant: dict[str, Any] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
    if scheme == "block":
        quant["weight_block_size"] = list(block)
    config["quantization_config"] = quant
    (d / "config.json").write_text(json.dumps(config, indent=2))
    return d


#: (case, HF class, stored dtype, scheme, block, scale dtype)
CASES = [
    # Qwen3-*-FP8 / DeepSeek-V3 layout: bf16 checkpoint, 128x128 blocks larger than these tiny matrices
    ("qwen3-block128", "Qwen3ForCausalLM", "bfloat16", "block", (128, 128), "float32"),
    # blocks that leave partial edge blocks in both dimensions; bf16 scales
    ("qwen3moe-block", "Qwen3MoeForCausalLM", "float32", "block", (24, 40), "bfloat16"),
    # no weight_block_size: square matrices (q, o) one scale per output channel ([rows, 1]), the others one
    # per tensor ([]); an f16 checkpoint
    ("llama-channel-tensor", "LlamaForCausalLM", "float16", "mixed", (0, 0), "float32"),
]


class Cases:
    """The checkpoints of :data:`CASES`, each built (and converted to F32 by both converters) once per module."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.built: dict[str, dict[str, Any]] = {}

    def __getitem__(self, name: str) -> dict[str, Any]:
        if name not in self.built:
            _, hf_class, dtype, scheme, block, scale_dtype = next(c for c in CASES if c[0] == name)
            root = self.factory.mktemp(name)
            # llama.cpp's converter needs a BPE it knows by hash: GPT-2's for the Qwen classes (Llama: SPM)
            vocab = {"vocab": "real:gpt-2"} if hf_class.startswith("Qwen") else {}
            d = make_checkpoint(root / "m", hf_class, dtype=dtype, **vocab)
            store_fp8(d, scheme=scheme, block=block, scale_dtype=scale_dtype, dequantized=root / "dequantized")
            self.built[name] = {"dir": d, "root": root, "dequantized": root / "dequantized",
                                "ours_f32": convert(d, root / "ours-f32.gguf", outtype="f32").outputs[0],
                                "theirs_f32": llama_cpp_convert(d, root / "theirs-f32.gguf", "f32")}
        return self.built[name]


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> Cases:
    return Cases(tmp_path_factory)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_fp8_source_equals_llama_cpp_converter(cases: Cases, name: str) -> None:
    """Every tensor byte-identical to llama.cpp's converter on the same FP8 files (dequant_model's
    ``weight.float() * scale``), F32 outtype: the dequantized values themselves."""
    assert_same_file(cases[name]["theirs_f32"], cases[name]["ours_f32"])


def test_fp8_auto_outtype_and_logits(cases: Cases) -> None:
    """``auto`` follows the unquantized bf16 tensors (llama.cpp's GUESSED rule passes over FP8 ones), and
    llama.cpp running our file gives the logits of transformers running the dequantized weights."""
    case = cases["qwen3-block128"]
    d, root = case["dir"], case["root"]
    auto = convert(d, root / "ours-auto.gguf").outputs[0]
    bf16 = convert(d, root / "ours-bf16.gguf", outtype="bf16").outputs[0]
    assert auto.read_bytes() == bf16.read_bytes()
    with open_gguf(auto) as f:
        assert f["blk.0.attn_q.weight"].ggml_type.name == "BF16"
    want = transformers_logits(case["dequantized"])
    got = llama_cpp_logits(case["ours_f32"])
    assert np.abs(got - want).max() <= 1e-3 * (want.max() - want.min())
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_fp8_as_q8_equals_llama_cpp_converter(cases: Cases) -> None:
    """``convert --fp8-as-q8``: the FP8 weights (stacked experts included) Q8_0, the rest in the outtype, as
    llama.cpp's converter ``--fp8-as-q8`` writes them (conversion/base.py: tensor_force_quant)."""
    case = cases["qwen3moe-block"]
    d, root = case["dir"], case["root"]
    theirs = root / "theirs-fp8q8.gguf"
    env = {**os.environ, "PYTHONPATH": str(llama_cpp_dir() / "gguf-py")}
    subprocess.run([sys.executable, str(llama_cpp_dir() / "convert_hf_to_gguf.py"), str(d), "--outfile",
                    str(theirs), "--outtype", "bf16", "--fp8-as-q8"], check=True, capture_output=True, env=env)
    ours = root / "ours-fp8q8.gguf"
    result = invoke("convert", str(d), "-o", str(ours), "--outtype", "bf16", "--fp8-as-q8", "--no-check")
    assert result.exit_code == 0, result.output
    assert_same_file(theirs, ours)
    with open_gguf(ours) as f:
        types = {t.name: t.ggml_type.name for t in f.tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.0.attn_q.weight"] == "Q8_0"
    assert types["token_embd.weight"] == "BF16" and types["blk.0.ffn_gate_inp.weight"] == "F32"


def test_fp8_one_pass_q4_k_m_equals_llama_quantize(cases: Cases) -> None:
    """FP8 straight to Q4_K_M in one pass: the file llama-quantize writes from llama.cpp's F32 conversion."""
    case = cases["qwen3moe-block"]
    root = case["root"]
    theirs = root / "theirs-q4_k_m.gguf"
    subprocess.run([str(tool_path("llama-quantize")), str(case["theirs_f32"]), str(theirs), "Q4_K_M"], check=True,
                   capture_output=True)
    ours = convert(case["dir"], root / "ours-q4_k_m.gguf", outtype="q4_k_m").outputs[0]
    with open_gguf(theirs) as a, open_gguf(ours) as b:
        assert [(t.name, t.ggml_type) for t in a.tensors] == [(t.name, t.ggml_type) for t in b.tensors]
        for t in a.tensors:
            assert bytes(a.raw(t)) == bytes(b.raw(b[t.name])), t.name


def test_fp8_bytes_are_never_read_as_values(cases: Cases) -> None:
    """A reader that does not dequantize (a projector's, the check's) gets a one-line refusal for an FP8 tensor,
    never its bytes as numbers; the conversion's checkpoint reads it dequantized."""
    from ggufkit.converters.checkpoint import Checkpoint
    from ggufkit.converters.plan import open_source
    from ggufkit.errors import CheckpointError

    d = cases["llama-channel-tensor"]["dir"]
    name = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(CheckpointError, match="stored as F8_E4M3"):
        Checkpoint(d).read(name)
    src = open_source(d, vocab_only=False)
    assert src.checkpoint is not None and src.checkpoint.read(name).dtype == np.float32
