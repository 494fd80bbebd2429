"""Qwen2.5-VL and Qwen3-VL projectors (``convert --mmproj``) and text halves against their oracles.

Same oracles as test_convert_mmproj.py: llama.cpp's converter (tensors, types, bytes, keys), libmtmd through
llama-cpp-python (ggufkit's projector gives llama.cpp's projector's embeddings bit for bit) and transformers'
vision tower + merger on the same pixels (Qwen3-VL's deepstack features included).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fixtures_mmproj import (
    ORACLE_LAYOUT,
    SAVED_LAYOUT,
    assert_refused,
    layout_checkpoints,
    layout_projectors,
    llama_cpp_mmproj,
    make_vlm,
    projector_keys,
    projector_tensors,
)

from ggufkit.converters import convert, convert_mmproj
from ggufkit.errors import TensorMappingError, UnsupportedArchitectureError
from ggufkit.format import open_gguf

QWEN_CLASSES = ["Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration"]
#: (class, image side): Qwen2.5-VL at 112 px (one 112 px window, the issue's case) and 224 px (16x16 patches in
#: 2x2 windows: window attention in the layers outside fullatt_block_indexes); Qwen3-VL at 96 px = 3x3 tokens
#: (libmtmd enlarges images under 8 tokens).
IMAGES = [("Qwen2_5_VLForConditionalGeneration", 112), ("Qwen2_5_VLForConditionalGeneration", 224),
          ("Qwen3VLForConditionalGeneration", 96)]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """Per class: each layout's checkpoint directory (same weights)."""
    return layout_checkpoints(tmp_path_factory, QWEN_CLASSES)


@pytest.mark.parametrize("outtype", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("hf_class", QWEN_CLASSES)
def test_projector_equals_llama_cpp_converter(qwen: dict[str, dict[str, Path]], hf_class: str, outtype: str,
                                              tmp_path: Path) -> None:
    # The 3-D patch embedding as two frames (v.patch_embd.weight, .weight.1), Qwen2.5-VL's qkv as Q/K/V and its
    # n_wa_pattern, Qwen3-VL's deepstack mergers numbered by vision layer (0 and 2) and is_deepstack_layers.
    model = qwen[hf_class][ORACLE_LAYOUT[hf_class]]
    theirs = tmp_path / "theirs.gguf"
    run = llama_cpp_mmproj(model, theirs, outtype)
    assert run.returncode == 0, run.stderr[-2000:]
    ours = convert_mmproj(model, tmp_path / "ours.gguf", outtype=outtype).outputs[0]
    a, b = projector_tensors(theirs), projector_tensors(ours)
    assert "v.patch_embd.weight.1" in a and sorted(a) == sorted(b)
    for name in a:
        assert a[name] == b[name], name
    assert projector_keys(theirs) == projector_keys(ours)
    if hf_class == "Qwen3VLForConditionalGeneration":
        assert {"v.deepstack.0.fc1.weight", "v.deepstack.2.fc1.weight"} <= set(a)
    else:
        assert projector_keys(ours)["clip.vision.n_wa_pattern"][1] == 2


@pytest.mark.parametrize("hf_class", QWEN_CLASSES)
def test_bf16_checkpoint_projector_equals_llama_cpp_converter(hf_class: str, tmp_path: Path) -> None:
    model = make_vlm(tmp_path / "bf16", hf_class, dtype="bfloat16")
    run = llama_cpp_mmproj(model, tmp_path / "theirs.gguf", "auto")
    assert run.returncode == 0, run.stderr[-2000:]
    ours = convert_mmproj(model, tmp_path / "ours.gguf", outtype="auto").outputs[0]
    assert projector_tensors(tmp_path / "theirs.gguf") == projector_tensors(ours)
    assert projector_keys(tmp_path / "theirs.gguf") == projector_keys(ours)


def test_qwen25_released_config_style_equals_llama_cpp_converter(qwen: dict[str, dict[str, Path]],
                                                                  tmp_path: Path) -> None:
    # The hub's Qwen2.5-VL config.json (transformers 4.49): the text fields at the root, no text_config, no
    # model_type in vision_config.
    model = shutil.copytree(qwen["Qwen2_5_VLForConditionalGeneration"]["released"], tmp_path / "hub")
    config = json.loads((model / "config.json").read_text())
    config = {**config, **config.pop("text_config"), "model_type": "qwen2_5_vl"}
    config["vision_config"].pop("model_type")
    (model / "config.json").write_text(json.dumps(config))
    run = llama_cpp_mmproj(model, tmp_path / "theirs.gguf", "f16")
    assert run.returncode == 0, run.stderr[-2000:]
    ours = convert_mmproj(model, tmp_path / "ours.gguf", outtype="f16").outputs[0]
    assert projector_tensors(tmp_path / "theirs.gguf") == projector_tensors(ours)
    assert projector_keys(tmp_path / "theirs.gguf") == projector_keys(ours)


@pytest.mark.parametrize("hf_class", QWEN_CLASSES)
def test_every_layout_gives_the_same_projector(qwen: dict[str, dict[str, Path]], hf_class: str,
                                               tmp_path: Path) -> None:
    projectors = layout_projectors(qwen[hf_class], tmp_path)
    want = next(iter(projectors.values()))
    for layout, got in projectors.items():
        assert got == want, layout


def test_llama_cpp_converter_writes_no_tower_from_the_prefixed_qwen25_layout(qwen: dict[str, dict[str, Path]],
                                                                           tmp_path: Path) -> None:
    # Qwen2VLVisionModel.filter_tensors keeps only names starting with "visual.": from transformers 4.5x's
    # model.visual.* it writes a projector without a single tensor and reports success; ggufkit writes the same
    # projector as from the released files (test_every_layout_gives_the_same_projector).
    run = llama_cpp_mmproj(qwen["Qwen2_5_VLForConditionalGeneration"]["prefixed"], tmp_path / "x.gguf", "f16")
    assert run.returncode == 0 and projector_tensors(tmp_path / "x.gguf") == {}


@pytest.mark.parametrize("hf_class", QWEN_CLASSES)
def test_text_model_equals_llama_cpp_converter(qwen: dict[str, dict[str, Path]], hf_class: str,
                                               tmp_path: Path) -> None:
    # qwen2vl / qwen3vl: the M-RoPE sections padded to 4, Qwen3-VL's deepstack input count.
    from llama_cpp_sources import llama_cpp_dir

    model = qwen[hf_class]["released"]
    root = llama_cpp_dir()
    run = subprocess.run([sys.executable, str(root / "convert_hf_to_gguf.py"), str(model), "--outfile",
                          str(tmp_path / "theirs.gguf"), "--outtype", "f16"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(root / "gguf-py")})
    assert run.returncode == 0, run.stderr[-2000:]
    ours = convert(model, tmp_path / "ours.gguf", outtype="f16").outputs[0]
    assert projector_tensors(tmp_path / "theirs.gguf") == projector_tensors(ours)
    with open_gguf(tmp_path / "theirs.gguf") as a, open_gguf(ours) as b:
        arch = a.get("general.architecture")
        assert b.get("general.architecture") == arch
        keys = [k for k in a.kv if k.startswith(f"{arch}.")]
        assert f"{arch}.rope.dimension_sections" in keys
        assert set(keys) == {k for k in b.kv if k.startswith(f"{arch}.")}
        for key in keys:
            assert np.array_equal(np.asarray(a.get(key)), np.asarray(b.get(key))), key


@pytest.mark.parametrize("hf_class", QWEN_CLASSES)
def test_every_layout_gives_the_same_text_model(qwen: dict[str, dict[str, Path]], hf_class: str,
                                                tmp_path: Path) -> None:
    want = None
    for layout, model in qwen[hf_class].items():
        got = projector_tensors(convert(model, tmp_path / f"{layout}.gguf", outtype="f16").outputs[0])
        if want is None:
            want = got
        assert got == want, layout


def _pixels(model_dir: Path, rgb: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Qwen2VLImageProcessor's patches of an image already at a multiple of patch x merge: normalized, the frame
    repeated (temporal patch 2), flattened merge window by merge window."""
    vision = json.loads((model_dir / "config.json").read_text())["vision_config"]
    prep = json.loads((model_dir / "preprocessor_config.json").read_text())
    mean, std = np.array(prep["image_mean"], np.float32), np.array(prep["image_std"], np.float32)
    frame = ((rgb.astype(np.float32) / 255 - mean) / std).transpose(2, 0, 1)
    ps, m, t = vision["patch_size"], vision["spatial_merge_size"], vision["temporal_patch_size"]
    gh, gw = rgb.shape[0] // ps, rgb.shape[1] // ps
    frames = np.stack([frame] * t)
    patches = frames.reshape(1, t, 3, gh // m, m, ps, gw // m, m, ps).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(patches.reshape(gh * gw, 3 * t * ps * ps)), [1, gh, gw]


def _transformers_features(model_dir: Path, rgb: np.ndarray) -> np.ndarray:
    """The merger's output per image token; Qwen3-VL's deepstack features appended, as libmtmd lays them out."""
    import torch
    import transformers

    config = json.loads((model_dir / "config.json").read_text())
    model = getattr(transformers, config["architectures"][0]).from_pretrained(model_dir).eval()
    pixels, grid = _pixels(model_dir, rgb)
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values=torch.from_numpy(pixels),
                                             image_grid_thw=torch.tensor([grid]))
    feats = out.pooler_output[0]
    if getattr(out, "deepstack_features", None):
        feats = torch.cat([feats, *[f[0] for f in out.deepstack_features]], dim=-1)
    return np.asarray(feats.float().numpy())


#: transformers' features vs libmtmd's, as a fraction of their range: the issue's 1e-3 for Qwen3-VL (measured
#: 1.7e-4 at 96 px); the same for Qwen2.5-VL, measured 2.5e-4 at 224 px (2x2 windows) and 2.3e-4 at 112 px (one
#: window), far below the ~1e-2 the issue reports for llama.cpp's own projector at 112 px.
HF_BOUND = {"Qwen2_5_VLForConditionalGeneration": 1e-3, "Qwen3VLForConditionalGeneration": 1e-3}


@pytest.mark.parametrize(("hf_class", "side"), IMAGES)
def test_libmtmd_embeddings(qwen: dict[str, dict[str, Path]], hf_class: str, side: int, tmp_path: Path) -> None:
    from mtmd_runtime import mtmd_image_embeddings

    model = qwen[hf_class][ORACLE_LAYOUT[hf_class]]
    text = convert(model, tmp_path / "text.gguf", outtype="f32").outputs[0]
    theirs = tmp_path / "theirs.gguf"
    assert llama_cpp_mmproj(model, theirs, "f32").returncode == 0
    rgb = np.random.default_rng(7).integers(0, 256, (side, side, 3), dtype=np.uint8)
    ref = mtmd_image_embeddings(text, theirs, rgb)
    for layout, d in qwen[hf_class].items():
        ours = convert_mmproj(d, tmp_path / f"ours-{layout}.gguf", outtype="f32").outputs[0]
        got = mtmd_image_embeddings(text, ours, rgb)
        assert [g.tobytes() for g in got] == [r.tobytes() for r in ref], layout
    hf = _transformers_features(qwen[hf_class][SAVED_LAYOUT[hf_class]], rgb)
    assert len(ref) == 1 and ref[0].shape == hf.shape
    assert float(np.abs(ref[0] - hf).max()) <= HF_BOUND[hf_class] * float(np.ptp(hf))


@pytest.mark.parametrize("hf_class", QWEN_CLASSES)
def test_cli_with_mmproj_writes_text_model_and_projector(qwen: dict[str, dict[str, Path]], hf_class: str,
                                                         tmp_path: Path) -> None:
    from cli_helpers import invoke

    res = invoke("convert", str(qwen[hf_class]["released"]), "--with-mmproj", "--outtype", "f16", "-o",
                 str(tmp_path), "--no-check", "--json")
    assert res.exit_code == 0, res.stderr
    data = json.loads(res.stdout)
    mm = Path(data["mmproj"]["outputs"][0])
    assert mm == tmp_path / "mmproj-released-F16.gguf"
    want = {"Qwen2_5_VLForConditionalGeneration": ("qwen2vl", "qwen2.5vl_merger"),
            "Qwen3VLForConditionalGeneration": ("qwen3vl", "qwen3vl_merger")}[hf_class]
    with open_gguf(Path(data["outputs"][0])) as text, open_gguf(mm) as proj:
        assert (text.architecture, proj.get("clip.projector_type")) == want


# -- bad input: one line, exit 2, nothing written ---------------------------------------------------------------
def _edited(src: Path, dst: Path, **vision: object) -> Path:
    model = shutil.copytree(src, dst)
    config = json.loads((model / "config.json").read_text())
    config["vision_config"].update(vision)
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.mark.parametrize("hf_class", QWEN_CLASSES)
@pytest.mark.parametrize(("field", "value", "needle"), [("hidden_size", 48, "has shape"),
                                                        ("depth", 2, "block 2 >= clip.vision.block_count"),
                                                        ("patch_size", 8, "has shape")])
def test_tensors_not_matching_config_areassert_refused(qwen: dict[str, dict[str, Path]], hf_class: str, field: str,
                                                 value: int, needle: str, tmp_path: Path) -> None:
    model = _edited(qwen[hf_class]["released"], tmp_path / "bad", **{field: value})
    with pytest.raises(TensorMappingError, match=needle):
        convert_mmproj(model, tmp_path / "x.gguf")
    assert_refused(model, tmp_path, needle)


@pytest.mark.parametrize(("vision", "needle"), [({"fullatt_block_indexes": [1, 2]}, "not evenly spaced"),
                                                ({"window_size": 224}, "window_size 224"),
                                                ({"fullatt_block_indexes": None}, "fullatt_block_indexes")])
def test_qwen25_window_settings_libmtmd_cannot_run_areassert_refused(qwen: dict[str, dict[str, Path]], vision: dict,
                                                               needle: str, tmp_path: Path) -> None:
    model = _edited(qwen["Qwen2_5_VLForConditionalGeneration"]["released"], tmp_path / "bad", **vision)
    with pytest.raises(UnsupportedArchitectureError, match=needle):
        convert_mmproj(model, tmp_path / "x.gguf")
    assert_refused(model, tmp_path, needle)


def test_deepstack_index_beyond_depth_isassert_refused(qwen: dict[str, dict[str, Path]], tmp_path: Path) -> None:
    model = _edited(qwen["Qwen3VLForConditionalGeneration"]["released"], tmp_path / "bad",
                    deepstack_visual_indexes=[0, 5])
    with pytest.raises(TensorMappingError, match="deepstack_visual_indexes"):
        convert_mmproj(model, tmp_path / "x.gguf")
    assert_refused(model, tmp_path, "deepstack_visual_indexes")
