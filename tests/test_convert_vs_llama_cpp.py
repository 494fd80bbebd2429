"""Oracle: llama.cpp's own converter (convert_hf_to_gguf.py from the llama-cpp-python 0.3.36 sdist's vendored
tree, run as a subprocess with its gguf-py) on the same tiny checkpoint. Where llama.cpp's output is correct,
ours must hold the same tensors, byte for byte, and the same architecture keys."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fixtures_models import make_checkpoint
from llama_cpp_sources import llama_cpp_dir

from ggufkit.converters import convert
from ggufkit.format import open_gguf


def _llama_cpp_convert(model: Path, out: Path, outtype: str) -> Path:
    root = llama_cpp_dir()
    env = {**os.environ, "PYTHONPATH": str(root / "gguf-py")}
    subprocess.run([sys.executable, str(root / "convert_hf_to_gguf.py"), str(model), "--outfile", str(out),
                    "--outtype", outtype], check=True, capture_output=True, env=env)
    return out


# Only Llama+SPM: llama.cpp's converter refuses our locally trained BPE tokenizers (unknown pre-tokenizer
# hash) and crashes on GPT-NeoX configs under transformers 5 (reference/convert.md §1.2).
@pytest.mark.parametrize("outtype", ["f16"])
def test_tensors_and_hparams_are_byte_identical_to_llama_cpp_converter(outtype: str, tmp_path: Path) -> None:
    d = make_checkpoint(tmp_path / "m", "LlamaForCausalLM")
    theirs = _llama_cpp_convert(d, tmp_path / "theirs.gguf", outtype)
    ours = convert(d, tmp_path / "ours.gguf", outtype=outtype).outputs[0]
    with open_gguf(theirs) as a, open_gguf(ours) as b:
        assert sorted((t.name, t.ggml_type, t.ne) for t in a.tensors) == \
            sorted((t.name, t.ggml_type, t.ne) for t in b.tensors)
        for t in a.tensors:
            assert bytes(a.raw(t)) == bytes(b.raw(b[t.name])), t.name
        arch = a.get("general.architecture")
        for key in a.kv:
            if key.startswith(f"{arch}.") or key in ("general.quantization_version", "general.file_type"):
                assert key in b.kv, key
                assert np.all(np.asarray(a.get(key)) == np.asarray(b.get(key))), key


MODEL_CARD = """---
license: apache-2.0
license_name: tiny-licence
base_model:
- meta-llama/Llama-3.2-1B
- https://huggingface.co/Qwen/Qwen2.5-0.5B
language:
- en
- fr
- "no"
tags:
- text-generation
- llama
pipeline_tag: text-generation
datasets:
- HuggingFaceFW/fineweb
author: A. Publisher
description: a tiny random Llama
---

# A tiny Llama
"""


def test_general_keys_from_the_model_card_equal_llama_cpp_converters(tmp_path: Path) -> None:
    d = make_checkpoint(tmp_path / "m", "LlamaForCausalLM")
    (d / "README.md").write_text(MODEL_CARD, encoding="utf-8")
    theirs = _llama_cpp_convert(d, tmp_path / "theirs.gguf", "f16")
    ours = convert(d, tmp_path / "ours.gguf", outtype="f16").outputs[0]
    with open_gguf(theirs) as a, open_gguf(ours) as b:
        # ggufkit names files its own way (general.name is the folder's name, as given)
        keys = [k for k in a.kv if k.startswith("general.") and k not in ("general.name",)]
        for prefix in ("general.license", "general.base_model.", "general.languages", "general.tags",
                       "general.dataset.", "general.author", "general.description"):
            assert any(k.startswith(prefix) for k in keys), prefix
        for key in keys:
            assert key in b.kv, key
            want, got = a.get(key), b.get(key)
            if not isinstance(want, str) and hasattr(want, "__len__"):
                assert list(got) == list(want), key
            else:
                assert got == want, key


def test_llama3_rope_factors_are_llama_cpps_bits(tmp_path: Path) -> None:
    """Llama 3.1/3.2's rope scaling: ``rope_freqs`` as llama.cpp's LlamaModel.generate_extra_tensors computes it
    in torch float32, the factors in the smoothed band between the low and high frequency wavelengths included
    (head size 16, theta 500000: a frequency falls in the band; float64 arithmetic rounds some of them one bit
    away)."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    d = make_checkpoint(tmp_path / "m", "LlamaForCausalLM", rope_scaling=scaling, rope_theta=500000.0)
    theirs = _llama_cpp_convert(d, tmp_path / "theirs.gguf", "f32")
    ours = convert(d, tmp_path / "ours.gguf", outtype="f32").outputs[0]
    with open_gguf(theirs) as a, open_gguf(ours) as b:
        want = np.asarray(a.raw(a["rope_freqs.weight"]))
        assert ((want != 1.0) & (want != 8.0)).any()  # the smoothed band is exercised
        assert bytes(b.raw(b["rope_freqs.weight"])) == want.tobytes()
