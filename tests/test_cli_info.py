"""`ggufkit info`: header, metadata summaries, tensors, totals and bits per weight, shard sets, PowerInfer."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from cli_helpers import invoke
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType
from gguf_builders import random_tensor_bytes, valid_raw, write_model
from llama_cpp_sources import vocab_dir

from ggufkit.format import Metadata, TensorSpec, write_gguf
from ggufkit.format.values import VT


def _info(path: Path) -> dict:
    result = invoke("info", str(path), "--json")
    assert result.exit_code == 0, result.stderr
    assert len(result.stdout.strip().splitlines()) == 1
    return json.loads(result.stdout)


def _mixed_model(path: Path) -> list[TensorSpec]:
    meta = Metadata()
    meta.set("general.architecture", VT.STRING, "llama")
    meta.set("general.file_type", VT.UINT32, int(LlamaFileType.MOSTLY_Q4_K_M))
    meta.set("tokenizer.ggml.scores", VT.ARRAY, [float(i) for i in range(20)], VT.FLOAT32)
    specs = [TensorSpec("token_embd.weight", GGMLQuantizationType.Q4_K, (4, 256)),
             TensorSpec("output.weight", GGMLQuantizationType.Q8_0, (2, 64)),
             TensorSpec("output_norm.weight", GGMLQuantizationType.F32, (64,))]
    write_gguf(path, meta, specs, [random_tensor_bytes(s.ggml_type, s.shape, i) for i, s in enumerate(specs)])
    return specs


def test_json_describes_header_metadata_tensors_and_bits_per_weight(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    specs = _mixed_model(path)
    d = _info(path)
    assert (d["magic"], d["version"], d["alignment"], d["architecture"]) == ("GGUF", 3, 32, "llama")
    assert d["powerinfer"] is False and d["shards"] == [str(path)] and d["file_size"] == path.stat().st_size
    assert d["file_type"] == {"value": 15, "name": "MOSTLY_Q4_K_M"}
    assert d["metadata"]["tokenizer.ggml.scores"] == {
        "type": "array[f32]", "value": {"type": "array[f32]", "length": 20, "first": [0, 1, 2, 3, 4, 5, 6, 7]}}
    assert d["metadata"]["ggufkit.slack"]["value"] == "<4096 bytes reserved>"
    reader = gguf.GGUFReader(path)
    for t, spec, theirs in zip(d["tensors"], specs, reader.tensors):
        assert (t["name"], t["type"], t["shape"]) == (spec.name, spec.ggml_type.name, list(spec.shape))
        assert t["ne"] == [int(x) for x in theirs.shape] and t["bytes"] == int(theirs.n_bytes)
        assert t["offset"] == theirs.data_offset - reader.data_offset
    # bits per weight from ggml's block sizes: Q4_K is 144 bytes per 256 weights = 4.5
    for name, stats in d["by_type"].items():
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
        assert stats["bits_per_weight"] == 8 * size / block
    total_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    total_params = sum(int(t.n_elements) for t in reader.tensors)
    assert d["totals"] == {"tensors": 3, "parameters": total_params, "bytes": total_bytes,
                           "bits_per_weight": 8 * total_bytes / total_params}


def test_human_output_shows_the_summary_lines(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _mixed_model(path)
    result = invoke("info", str(path))
    assert result.exit_code == 0
    out = result.stdout
    assert "format:       GGUF v3, alignment 32" in out and "architecture: llama" in out
    assert "file type:    15 (MOSTLY_Q4_K_M)" in out
    assert "token_embd.weight" in out and "Q4_K" in out and "4.5000" in out
    assert "[20 items] 0.0, 1.0" in out


def test_vocabulary_is_summarised_with_its_length_and_first_items() -> None:
    path = vocab_dir() / "ggml-vocab-llama-spm.gguf"
    tokens = _info(path)["metadata"]["tokenizer.ggml.tokens"]["value"]
    assert tokens["type"] == "array[str]" and tokens["length"] == 32000
    assert tokens["first"] == gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].contents(slice(0, 8))


def test_qwen2_size_vocabulary_length_matches_llama_cpp() -> None:
    import llama_cpp

    path = vocab_dir() / "ggml-vocab-qwen2.gguf"
    tokens = _info(path)["metadata"]["tokenizer.ggml.tokens"]["value"]
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    assert tokens["length"] == llm.n_vocab() == 151936


def test_shard_set_is_shown_as_one_model(tmp_path: Path) -> None:
    write_model(tmp_path / "m.gguf", n_tensors=3, split_max_tensors=1)
    d = _info(tmp_path / "m-00003-of-00003.gguf")
    assert len(d["shards"]) == 3 and [t["shard"] for t in d["tensors"]] == [0, 1, 2]
    assert d["totals"]["tensors"] == 3 and d["metadata"]["general.name"]["value"] == "tiny"
    result = invoke("info", str(tmp_path / "m-00001-of-00003.gguf"))
    assert "(+2 shards)" in result.stdout


def test_powerinfer_file_is_reported_as_such(tmp_path: Path) -> None:
    path = tmp_path / "p.gguf"
    path.write_bytes(valid_raw().build().replace(b"GGUF", b"PWRI", 1))
    d = _info(path)
    assert d["magic"] == "PWRI" and d["powerinfer"] is True
    assert "PowerInfer" in invoke("info", str(path)).stdout


def test_float_specials_are_valid_json(tmp_path: Path) -> None:
    meta = Metadata()
    meta.set("x.nan", VT.FLOAT32, float("nan"))
    meta.set("x.arr", VT.ARRAY, np.array([np.inf, 1.0], np.float32), VT.FLOAT32)
    path = tmp_path / "f.gguf"
    write_gguf(path, meta, [], [])
    d = _info(path)
    assert d["metadata"]["x.nan"]["value"] == "nan"
    assert d["metadata"]["x.arr"]["value"]["first"] == ["inf", 1.0]


# -- projector files (mmproj) ------------------------------------------------------------------------------------
VLM_CLASSES = ["Gemma3ForConditionalGeneration", "Idefics3ForConditionalGeneration", "LlavaForConditionalGeneration",
               "Mistral3ForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
               "Qwen3VLForConditionalGeneration"]


@pytest.fixture(scope="module")
def vlm_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Per vision-language class: its text GGUF and ggufkit's f16 projector, from the layout llama.cpp handles."""
    from fixtures_mmproj import ORACLE_LAYOUT, copy_layout, make_vlm

    from ggufkit.converters import convert, convert_mmproj

    out = {}
    for hf_class in VLM_CLASSES:
        root = tmp_path_factory.mktemp(hf_class)
        model = copy_layout(make_vlm(root / "base", hf_class), root / "model", hf_class, ORACLE_LAYOUT[hf_class])
        text = convert(model, root / "text.gguf", outtype="f32").outputs[0]
        out[hf_class] = (text, convert_mmproj(model, root / "mmproj.gguf", outtype="f16").outputs[0])
    return out


@pytest.mark.parametrize("hf_class", VLM_CLASSES)
def test_projector_tokens_per_image_are_those_libmtmd_makes(vlm_files: dict[str, tuple[Path, Path]],
                                                             hf_class: str) -> None:
    from mtmd_runtime import mtmd_image_embeddings

    text, mmproj = vlm_files[hf_class]
    p = _info(mmproj)["projector"]
    size = p["image_size"]
    rgb = (np.arange(size * size * 3) % 251).astype(np.uint8).reshape(size, size, 3)
    chunks = mtmd_image_embeddings(text, mmproj, rgb)
    # Idefics3 (SmolVLM) gives the tile and an overview of the same size: each has the tokens of one image.
    assert p["tokens_per_image"] > 0
    assert [c.shape[0] for c in chunks] == [p["tokens_per_image"]] * len(chunks)


def test_projector_info_shows_clip_keys_types_and_sizes(vlm_files: dict[str, tuple[Path, Path]]) -> None:
    _, mmproj = vlm_files["Mistral3ForConditionalGeneration"]
    d = _info(mmproj)
    p = d["projector"]
    assert d["architecture"] == "clip" and p["projector_type"] == "pixtral" and p["modalities"] == ["vision"]
    assert (p["image_size"], p["patch_size"], p["patches_per_image"]) == (64, 8, 64)
    # 64 patches merged 2x2 (clip.vision.spatial_merge_size) in 4 rows of 4, an [IMG_BREAK] after each but the last
    assert p["tokens_per_image"] == 19
    clip = {k: v["value"] for k, v in d["metadata"].items() if k.startswith("clip.")}
    assert set(p["clip_keys"]) == set(clip) and p["clip_keys"]["clip.vision.spatial_merge_size"] == 2
    assert len(p["clip_keys"]["clip.vision.image_mean"]) == 3
    text = invoke("info", str(mmproj)).stdout
    assert "projector:    pixtral (vision), image 64 px, patch 8 px (64 patches, 19 tokens per image)" in text


def test_tokens_per_image_follows_clip_cpp_per_projector_type() -> None:
    from ggufkit.summary import tokens_per_image

    # clip.cpp clip_n_output_tokens on an image_size square: Gemma 3 896/14 = 64 per side, merged 4x4 -> 256
    assert tokens_per_image("gemma3", 896, 14) == 256
    assert tokens_per_image("gemma3", 896, 14, scale_factor=2) == 1024
    # SmolVLM-256M: 512/16 = 32 per side, pixel shuffle by 4 -> 64 per tile
    assert tokens_per_image("idefics3", 512, 16, scale_factor=4) == 64
    # Qwen2.5-VL / Qwen3-VL: 2x2 patches merged -> (image / (2 * patch))^2
    assert tokens_per_image("qwen2.5vl_merger", 560, 14) == 400
    assert tokens_per_image("qwen3vl_merger", 768, 16, spatial_merge_size=2) == 576
    # Pixtral's budget is 1024 tokens (mtmd-image.cpp calc_size_preserved_ratio): Pixtral 12B's 1024 px image
    # (64 x 64 patches) is shrunk to 512 px, 32 x 32 patches and 31 [IMG_BREAK]s; Mistral Small 3.1's 1540 px
    # (55 x 55 merged 2x2 patches of 14 px) to 896 px, 32 x 32 merged patches
    assert tokens_per_image("pixtral", 1024, 16, img_break=True) == 32 * 32 + 31
    assert tokens_per_image("pixtral", 1540, 14, spatial_merge_size=2, img_break=True) == 32 * 32 + 31
    assert tokens_per_image("pixtral", 1024, 16) == 32 * 32
    # Qwen-VL's lower budget (8 tokens) grows a 64 px image to 96 px: 3 x 3 merged patches
    assert tokens_per_image("qwen3vl_merger", 64, 16) == 9
    assert tokens_per_image("some_future_type", 1024, 16) is None
