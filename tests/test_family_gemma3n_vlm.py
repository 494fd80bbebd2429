"""Gemma 3n's released checkpoints (google/gemma-3n-E2B, -E4B and their -it) are ``Gemma3nForConditionalGeneration``:
the text model under ``model.language_model.``, beside a MobileNet-V5 vision tower, a Conformer audio tower and
their embedders (``model.vision_tower.``, ``model.audio_tower.``, ``model.embed_vision.``, ``model.embed_audio.``),
the text hyperparameters in ``text_config`` (issue 33). llama.cpp's converter converts its text half with the same
class as ``Gemma3nForCausalLM`` (conversion/gemma.py ``Gemma3NModel``: ``language_model.`` removed from each name by
ModelBase.filter_tensors, the towers skipped by TextModel.filter_tensors); the towers are the projector's
(``--mmproj``, not asked here).

The tiny checkpoints are the text models of tests/test_family_gemma3n.py (transformers' Gemma3nForCausalLM,
random weights, in the released layout and as transformers 5 saves them) moved under ``model.language_model.``
with a few tower tensors of the released names beside them (transformers' vision tower needs timm, which the
tests do not install; no converter reads the towers' values), and the config as transformers' Gemma3nConfig
writes it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_convert_archs import llama_cpp_convert
from test_family_cohere2 import _assert_same_file
from test_family_gemma3n import make_gemma3n, to_release

from ggufkit.converters import convert
from ggufkit.format import open_gguf

#: A few tensors of each tower, as google/gemma-3n-E2B's model.safetensors.index.json names them.
TOWER_TENSORS = {
    "model.vision_tower.timm_model.conv_stem.conv.weight": (8, 3, 3, 3),
    "model.vision_tower.timm_model.blocks.0.0.conv_exp.weight": (16, 8, 3, 3),
    "model.vision_tower.timm_model.blocks.0.0.bn1.weight": (16,),
    "model.vision_tower.timm_model.msfa.ffn.pw_proj.conv.weight": (32, 16, 1, 1),
    "model.embed_vision.embedding.weight": (128, 32),
    "model.embed_vision.hard_embedding_norm.weight": (32,),
    "model.embed_vision.soft_embedding_norm.weight": (32,),
    "model.embed_vision.embedding_projection.weight": (96, 32),
    "model.audio_tower.subsample_conv_projection.conv_0.conv.weight": (8, 1, 3, 3),
    "model.audio_tower.conformer.0.attention.attn.q_proj.weight": (24, 24),
    "model.audio_tower.conformer.0.ffw_layer_start.ffw_layer_1.weight": (48, 24),
    "model.embed_audio.embedding.weight": (128, 24),
    "model.embed_audio.embedding_projection.weight": (96, 24),
}


def to_conditional_generation(text: Path, dst: Path) -> Path:
    """``text`` (a Gemma3nForCausalLM checkpoint) as the text half of a Gemma3nForConditionalGeneration one."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    shutil.copytree(text, dst)
    text_config = json.loads((dst / "config.json").read_text())
    for key in ("architectures", "transformers_version", "dtype", "torch_dtype"):
        text_config.pop(key, None)
    config = transformers.Gemma3nConfig(text_config=transformers.Gemma3nTextConfig(**text_config)).to_dict()
    # the text half as the text checkpoint spells it (the release's transformers-4 keys, or transformers 5's)
    config.update(architectures=["Gemma3nForConditionalGeneration"], text_config={**text_config,
                                                                                 "model_type": "gemma3n_text"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(11)
    out = {name.replace("model.", "model.language_model.", 1): w for name, w in weights.items()}
    out.update({name: torch.randn(shape, generator=g) for name, shape in TOWER_TENSORS.items()})
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gemma3n-vlm")
    v5 = make_gemma3n(d / "v5", n_layer=22)
    release = to_release(v5, d / "release")
    return {"text-v5": v5, "text-release": release,
            "vlm-v5": to_conditional_generation(v5, d / "vlm-v5"),
            "vlm-release": to_conditional_generation(release, d / "vlm-release")}


def test_the_fixture_is_a_conditional_generation_checkpoint(checkpoints: dict[str, Path]) -> None:
    from safetensors import safe_open

    config = json.loads((checkpoints["vlm-release"] / "config.json").read_text())
    assert config["architectures"] == ["Gemma3nForConditionalGeneration"]
    assert {"text_config", "vision_config", "audio_config"} <= set(config)
    assert "rope_local_base_freq" in config["text_config"]  # the release's spelling, kept in text_config
    with safe_open(str(checkpoints["vlm-release"] / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.language_model.layers.0.altup.router_norm.weight" in names
    assert not any(n.startswith("model.layers.") for n in names)
    assert set(TOWER_TENSORS) <= names


def test_text_half_converts_to_llama_cpps_file(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """The released layout: every tensor and key of llama.cpp's converter's file, the towers left out."""
    theirs = llama_cpp_convert(checkpoints["vlm-release"], tmp_path / "theirs.gguf", "f16")
    ours = convert(checkpoints["vlm-release"], tmp_path / "ours.gguf", outtype="f16").outputs[0]
    _assert_same_file(theirs, ours)


@pytest.mark.parametrize("layout", ["release", "v5"])
def test_text_half_is_the_text_models_file(checkpoints: dict[str, Path], tmp_path: Path, layout: str) -> None:
    """Both layouts: the same tensors and keys as the text model's own checkpoint gives (naming aside), so
    what tests/test_family_gemma3n.py shows of that file (llama.cpp runs it as transformers does; ppl, imatrix,
    quantize, release) holds for the released checkpoints."""
    vlm = convert(checkpoints[f"vlm-{layout}"], tmp_path / "vlm.gguf", outtype="f32").outputs[0]
    text = convert(checkpoints[f"text-{layout}"], tmp_path / "text.gguf", outtype="f32").outputs[0]
    with open_gguf(vlm) as a, open_gguf(text) as b:
        assert [(t.name, t.ggml_type, t.ne) for t in a.tensors] == [(t.name, t.ggml_type, t.ne) for t in b.tensors]
        for t in a.tensors:
            assert bytes(a.raw(t)) == bytes(b.raw(b[t.name])), t.name
        keys = [k for k in a.kv if not k.startswith(("general.name", "general.basename", "ggufkit."))]
        assert keys == [k for k in b.kv if not k.startswith(("general.name", "general.basename", "ggufkit."))]
        for key in keys:
            assert str(a.get(key)) == str(b.get(key)), key
