"""Llama 4 as its checkpoints come that tests/test_family_llama4.py does not cover (issue 32): BF16 weights (Scout
and Maverick are released in bf16) in the layout transformers 5's ``save_pretrained`` writes for
``Llama4ForConditionalGeneration`` (``language_model.`` prefix, text_config with ``rope_parameters``,
``layer_types``, ``moe_layers`` and ``no_rope_layers`` spelled out, a vision tower llama.cpp's converter leaves
out). The same tiny model as there (tests/test_family_llama4.py's module docstring).

* Converted with ``--outtype auto`` (BF16 for a bf16 checkpoint, in both converters): every tensor and key of
  llama.cpp's converter's file.
* llama.cpp runs transformers' model: ggufkit's F32 file of it (bf16 widened exactly) within 1e-3 of the logit
  range, and llama.cpp's BF16 file with the same top token (ggml's BF16 matmul rounds its activations to bf16,
  its CPU ``vec_dot_type`` for BF16: 0.8 % of the range here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixtures_models import llama_cpp_logits, make_checkpoint
from test_family_llama4 import VLM, _reference_logits
from test_family_qwen3next import assert_same_file, llama_cpp_convert


@pytest.fixture(scope="module")
def bf16_vlm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A bf16 Llama4ForConditionalGeneration as transformers 5 saves it, and llama.cpp's ``auto`` file of it."""
    d = make_checkpoint(tmp_path_factory.mktemp("llama4-bf16") / "m", VLM, dtype="bfloat16")
    return {"dir": d, "theirs": llama_cpp_convert(d, d.parent / "theirs.gguf", "auto", "--verbose")}


def test_bf16_checkpoint_in_transformers_5_layout_converts_as_llama_cpps_converter(
        bf16_vlm: dict[str, Any], tmp_path: Path) -> None:
    import json

    from ggufkit.converters import convert
    from ggufkit.format import open_gguf

    text = json.loads((bf16_vlm["dir"] / "config.json").read_text())["text_config"]
    assert {"rope_parameters", "layer_types", "moe_layers", "no_rope_layers"} <= set(text)  # transformers 5's
    ours = convert(bf16_vlm["dir"], tmp_path / "ours.gguf", outtype="auto").outputs[0]
    assert_same_file(bf16_vlm["theirs"], ours)
    with open_gguf(ours) as f:
        assert f.architecture == "llama4" and f["blk.1.ffn_up_exps.weight"].ggml_type.name == "BF16"
        assert not any(t.name.startswith(("v.", "mm.")) for t in f.tensors)


def test_llama_cpp_runs_the_bf16_checkpoints_model(bf16_vlm: dict[str, Any], tmp_path: Path) -> None:
    from ggufkit.converters import convert

    want = _reference_logits(bf16_vlm["dir"])  # the ConditionalGeneration's language model, bf16 -> f32
    f32 = convert(bf16_vlm["dir"], tmp_path / "f32.gguf", outtype="f32").outputs[0]
    for path, tolerance in ((f32, 1e-3), (bf16_vlm["theirs"], 2e-2)):
        got = llama_cpp_logits(path)
        assert (got.argmax(-1) == want.argmax(-1)).all(), path.name
        assert np.abs(got - want).max() < tolerance * (want.max() - want.min()), path.name
