"""Vision projectors (``convert --mmproj``) against their oracles.

- llama.cpp's converter (``convert_hf_to_gguf.py --mmproj`` from the llama-cpp-python 0.3.36 sdist, run as a
  subprocess) on the layout it handles: same tensor names, shapes, types and bytes, same keys and values
  (``general.name``, which it title-cases from the directory, and ggufkit's own keys aside).
- Every other layout of the same weights: the same projector from ggufkit.
- libmtmd (``llama_cpp.mtmd_cpp``) with the text GGUF: the image embeddings of ggufkit's projector equal those of
  llama.cpp's bit for bit, and transformers' vision tower + projector on the same pixels within 1e-3 of their range.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import invoke
from fixtures_mmproj import (
    ORACLE_LAYOUT,
    SAVED_LAYOUT,
    assert_refused,
    copy_layout,
    layout_checkpoints,
    layout_projectors,
    llama_cpp_mmproj,
    make_vlm,
    projector_keys,
    projector_tensors,
)
from fixtures_models import make_checkpoint

from ggufkit.converters import convert, convert_mmproj
from ggufkit.errors import TensorMappingError, UnsupportedArchitectureError, UsageError
from ggufkit.format import open_gguf

#: Projector classes, each built as transformers 5's save_pretrained writes it (SmolVLM2 as SmolVLM's).
PROJECTOR_CLASSES = ["Gemma3ForConditionalGeneration", "Idefics3ForConditionalGeneration",
                     "SmolVLMForConditionalGeneration", "LlavaForConditionalGeneration",
                     "Mistral3ForConditionalGeneration"]
#: The registry entries this file and test_convert_mmproj_released.py cover (test_convert_models reads it): the
#: projector classes, and VLlama3ForCausalLM, the text model's class released SmolVLM configs name.
CLASSES = [*PROJECTOR_CLASSES, "VLlama3ForCausalLM"]
PIXTRAL = {"LlavaForConditionalGeneration", "Mistral3ForConditionalGeneration"}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """Per class: each layout's checkpoint directory (same weights)."""
    return layout_checkpoints(tmp_path_factory, PROJECTOR_CLASSES)


@pytest.mark.parametrize("outtype", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("hf_class", PROJECTOR_CLASSES)
def test_projector_equals_llama_cpp_converter(vlm: dict[str, dict[str, Path]], hf_class: str, outtype: str,
                                              tmp_path: Path) -> None:
    model = vlm[hf_class][ORACLE_LAYOUT[hf_class]]
    theirs = tmp_path / "theirs.gguf"
    run = llama_cpp_mmproj(model, theirs, outtype)
    assert run.returncode == 0, run.stderr[-2000:]
    ours = convert_mmproj(model, tmp_path / "ours.gguf", outtype=outtype).outputs[0]
    a, b = projector_tensors(theirs), projector_tensors(ours)
    assert list(a) and sorted(a) == sorted(b)
    for name in a:
        assert a[name] == b[name], name
    assert projector_keys(theirs) == projector_keys(ours)


@pytest.fixture(scope="module")
def vlm_bf16(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per class: a bf16 checkpoint (as publishers ship them) in the layout llama.cpp's converter handles."""
    out = {}
    for hf_class in PROJECTOR_CLASSES:
        root = tmp_path_factory.mktemp(f"{hf_class}-bf16")
        base = make_vlm(root / "base", hf_class, dtype="bfloat16")
        out[hf_class] = copy_layout(base, root / "oracle", hf_class, ORACLE_LAYOUT[hf_class])
    return out


@pytest.mark.parametrize("outtype", ["auto", "q8_0"])
@pytest.mark.parametrize("hf_class", PROJECTOR_CLASSES)
def test_bf16_checkpoint_projector_equals_llama_cpp_converter(vlm_bf16: dict[str, Path], hf_class: str,
                                                              outtype: str, tmp_path: Path) -> None:
    # bf16 sources are widened to f32 before llama.cpp's modify_tensors: Gemma 3's soft_emb_norm + 1 is in f32.
    model = vlm_bf16[hf_class]
    run = llama_cpp_mmproj(model, tmp_path / "theirs.gguf", outtype)
    assert run.returncode == 0, run.stderr[-2000:]
    ours = convert_mmproj(model, tmp_path / "ours.gguf", outtype=outtype).outputs[0]
    assert projector_tensors(tmp_path / "theirs.gguf") == projector_tensors(ours)
    assert projector_keys(tmp_path / "theirs.gguf") == projector_keys(ours)


@pytest.mark.parametrize("hf_class", PROJECTOR_CLASSES)
def test_every_layout_gives_the_same_projector(vlm: dict[str, dict[str, Path]], hf_class: str,
                                               tmp_path: Path) -> None:
    projectors = layout_projectors(vlm[hf_class], tmp_path)
    want = next(iter(projectors.values()))
    for layout, got in projectors.items():
        assert got == want, layout


def test_llama_cpp_converter_fails_on_transformers5_gemma3_layout(vlm: dict[str, dict[str, Path]],
                                                                  tmp_path: Path) -> None:
    # What ggufkit's layouts add: llama.cpp's converter cannot map transformers 5's vision_tower.embeddings.*.
    run = llama_cpp_mmproj(vlm["Gemma3ForConditionalGeneration"]["transformers5"], tmp_path / "x.gguf", "f32")
    assert run.returncode != 0 and "Can not map tensor" in run.stderr


def _image(size: int) -> np.ndarray:
    # At the encoder's own size, so libmtmd's resize is the identity and both sides see the same pixels.
    return np.random.default_rng(7).integers(0, 256, (size, size, 3), dtype=np.uint8)


def _transformers_image_features(model_dir: Path, rgb: np.ndarray) -> np.ndarray:
    import torch
    import transformers

    prep = json.loads((model_dir / "preprocessor_config.json").read_text())
    mean, std = np.array(prep["image_mean"], np.float32), np.array(prep["image_std"], np.float32)
    pixels = ((rgb.astype(np.float32) / 255 - mean) / std).transpose(2, 0, 1)[None]
    config = json.loads((model_dir / "config.json").read_text())
    if config["architectures"][0] in ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"):
        pixels = pixels[None]  # [batch, images, channels, height, width]
    model = getattr(transformers, config["architectures"][0]).from_pretrained(model_dir).eval()
    extra = {}
    if config["architectures"][0] in PIXTRAL:
        extra["image_sizes"] = torch.tensor([rgb.shape[:2]])
    with torch.no_grad():
        out = model.get_image_features(pixel_values=torch.from_numpy(np.ascontiguousarray(pixels)), **extra)
    out = getattr(out, "pooler_output", out)
    if isinstance(out, (list, tuple)):
        out = torch.cat(list(out))
    return np.asarray(out.reshape(-1, out.shape[-1]).float().numpy())


@pytest.mark.parametrize("hf_class", PROJECTOR_CLASSES)
def test_libmtmd_embeddings(vlm: dict[str, dict[str, Path]], hf_class: str, tmp_path: Path) -> None:
    model = vlm[hf_class][ORACLE_LAYOUT[hf_class]]
    text = convert(model, tmp_path / "text.gguf", outtype="f32").outputs[0]
    theirs = tmp_path / "theirs.gguf"
    assert llama_cpp_mmproj(model, theirs, "f32").returncode == 0
    size = json.loads((model / "config.json").read_text())["vision_config"]["image_size"]
    rgb = _image(size)
    ref = _encode(text, theirs, rgb)
    hf = _transformers_image_features(vlm[hf_class][SAVED_LAYOUT[hf_class]], rgb)
    for layout, d in vlm[hf_class].items():
        ours = convert_mmproj(d, tmp_path / f"ours-{layout}.gguf", outtype="f32").outputs[0]
        got = _encode(text, ours, rgb)
        assert [g.tobytes() for g in got] == [r.tobytes() for r in ref], layout
    # Every chunk (Idefics3: the one tile and the overview) holds the same pixels at the encoder's size.
    for chunk in ref:
        if hf_class in PIXTRAL:
            chunk = _without_breaks(chunk, hf.shape[0], _img_break_row(model))
        assert hf.shape == chunk.shape
        assert float(np.abs(chunk - hf).max()) <= 1e-3 * float(np.ptp(hf))


def _encode(text: Path, mmproj: Path, rgb: np.ndarray) -> list[np.ndarray]:
    """libmtmd's embeddings, retried while they hold NaN: llama-cpp-python 0.3.36's libmtmd now and then writes
    NaN into a Pixtral [IMG_BREAK] row (about one run in six here, with llama.cpp's own projector as with
    ggufkit's, flash attention on or off); every other value is the same from run to run. Once a process
    has given NaN it may keep giving it (stop 27's CI: 8 in-process runs in a row), so after 3 in-process
    tries each retry is a fresh Python process."""
    from mtmd_runtime import mtmd_image_embeddings

    for _ in range(3):
        out = mtmd_image_embeddings(text, mmproj, rgb)
        if all(np.isfinite(o).all() for o in out):
            return out
    for attempt in range(6):
        out = _encode_in_fresh_process(text, mmproj, rgb, mmproj.with_suffix(f".try{attempt}.npz"))
        if all(np.isfinite(o).all() for o in out):
            return out
    raise AssertionError(f"libmtmd gave NaN in 3 in-process and 6 fresh-process runs with {mmproj.name}")


def _encode_in_fresh_process(text: Path, mmproj: Path, rgb: np.ndarray, out: Path) -> list[np.ndarray]:
    image = out.with_suffix(".rgb.npy")
    np.save(image, rgb)
    script = ("import sys, numpy as np; from mtmd_runtime import mtmd_image_embeddings as f; "
              "a = sys.argv[1:]; np.savez(a[3], *f(a[0], a[1], np.load(a[2])))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", script, str(text), str(mmproj), str(image), str(out)], check=True,
                   env=env, capture_output=True, timeout=600)
    with np.load(out) as saved:
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]


def _img_break_row(model: Path) -> np.ndarray:
    from safetensors.numpy import load_file

    tokens = json.loads((model / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    token = next(int(i) for i, t in tokens.items() if t["content"] == "[IMG_BREAK]")
    weights = load_file(str(model / "model.safetensors"))
    emb = next(v for k, v in weights.items() if k.endswith("embed_tokens.weight"))
    return np.asarray(emb[token], np.float32)


def _without_breaks(chunk: np.ndarray, n_image: int, row: np.ndarray) -> np.ndarray:
    """libmtmd's Pixtral output has the [IMG_BREAK] embedding after every row of patches but the last
    (clip.cpp: clip_n_output_tokens); they must be that row exactly, and are dropped for the comparison."""
    side = round(n_image ** 0.5)
    assert side * side == n_image and chunk.shape[0] == n_image + side - 1
    breaks = [r * (side + 1) + side for r in range(side - 1)]
    for b in breaks:
        assert chunk[b].tobytes() == row.tobytes()
    return np.delete(chunk, breaks, axis=0)


def test_cli_writes_hub_name_and_info_shows_projector(vlm: dict[str, dict[str, Path]], tmp_path: Path) -> None:
    model = vlm["Gemma3ForConditionalGeneration"]["released"]
    res = invoke("convert", str(model), "--mmproj", "--outtype", "f16", "-o", str(tmp_path), "--json")
    assert res.exit_code == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["ok"] and data["outputs"] == [str(tmp_path / "mmproj-released-F16.gguf")]
    info = json.loads(invoke("info", data["outputs"][0], "--json").stdout)
    assert info["architecture"] == "clip"
    assert info["projector"]["projector_type"] == "gemma3"
    assert (info["projector"]["image_size"], info["projector"]["patch_size"]) == (32, 8)
    ver = invoke("verify", data["outputs"][0], "--json")
    assert ver.exit_code == 0 and json.loads(ver.stdout)["projector"]["projector_type"] == "gemma3"


def test_cli_with_mmproj_writes_both(vlm: dict[str, dict[str, Path]], tmp_path: Path) -> None:
    model = vlm["Gemma3ForConditionalGeneration"]["released"]
    res = invoke("convert", str(model), "--with-mmproj", "--outtype", "f16", "-o", str(tmp_path), "--no-check",
                 "--json")
    assert res.exit_code == 0, res.stderr
    data = json.loads(res.stdout)
    assert Path(data["outputs"][0]).is_file()
    mm = Path(data["mmproj"]["outputs"][0])
    assert mm == tmp_path / "mmproj-released-F16.gguf"
    with open_gguf(Path(data["outputs"][0])) as text, open_gguf(mm) as proj:
        assert text.architecture == "gemma3" and proj.architecture == "clip"


# -- bad input: one line, exit 2, nothing written ---------------------------------------------------------------
def test_text_only_checkpoint_isassert_refused(tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path / "llama", "LlamaForCausalLM")
    with pytest.raises(UsageError, match="text-only"):
        convert_mmproj(model, tmp_path / "x.gguf")
    assert_refused(model, tmp_path, "text-only")


def test_unsupported_vision_class_names_the_supported_ones(vlm: dict[str, dict[str, Path]], tmp_path: Path) -> None:
    import shutil

    model = shutil.copytree(vlm["Gemma3ForConditionalGeneration"]["released"], tmp_path / "other")
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["PaliGemmaForConditionalGeneration"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="Gemma3ForConditionalGeneration"):
        convert_mmproj(model, tmp_path / "x.gguf")
    assert_refused(model, tmp_path, "supported: Gemma3ForConditionalGeneration")


@pytest.mark.parametrize(("field", "value", "needle"), [("hidden_size", 48, "has shape"),
                                                        ("num_hidden_layers", 2, "missing vision tensors"),
                                                        ("patch_size", 4, "has shape")])
def test_tensors_not_matching_config_areassert_refused(vlm: dict[str, dict[str, Path]], tmp_path: Path, field: str,
                                                 value: int, needle: str) -> None:
    import shutil

    model = shutil.copytree(vlm["Gemma3ForConditionalGeneration"]["transformers5"], tmp_path / "bad")
    config = json.loads((model / "config.json").read_text())
    config["vision_config"][field] = value
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(TensorMappingError, match=needle):
        convert_mmproj(model, tmp_path / "x.gguf")
    assert_refused(model, tmp_path, needle)


@pytest.mark.parametrize("hf_class", sorted(PIXTRAL))
def test_llama_cpp_converter_drops_img_break_in_the_released_pixtral_layout(vlm: dict[str, dict[str, Path]],
                                                                          hf_class: str, tmp_path: Path) -> None:
    # llama.cpp issue 24235: its projector from the hub's layout lacks v.token_embd.img_break; ggufkit's has it.
    model = vlm[hf_class]["released"]
    assert llama_cpp_mmproj(model, tmp_path / "theirs.gguf", "f16").returncode == 0
    ours = convert_mmproj(model, tmp_path / "ours.gguf", outtype="f16").outputs[0]
    theirs_names, ours_names = set(projector_tensors(tmp_path / "theirs.gguf")), set(projector_tensors(ours))
    assert ours_names - theirs_names == {"v.token_embd.img_break"}


@pytest.mark.parametrize(("old", "new", "message"), [
    ("    projector_type: gemma3\n", "    projector_type: gemma33\n", "unknown projector_type 'gemma33'"),
    ("      clip.use_gelu: {default: true}\n", "      clip.use_gleu: {default: true}\n", "unknown clip key"),
    ("      multi_modal_projector.mm_soft_emb_norm: V_MM_SOFT_EMB_NORM\n",
     "      multi_modal_projector.mm_soft_emb_norm: ATTN_Q\n", "not part of architecture 'clip'"),
    ("    types: {V_MM_INP_PROJ: f16,", "    types: {V_MM_INP_PROJ: q4,", "types: 'V_MM_INP_PROJ'"),
    ("      token: \"[IMG_BREAK]\"\n", "      token: 3\n", "'token' must be the token's text"),
])
def test_broken_projector_section_is_refused(old: str, new: str, message: str) -> None:
    from ggufkit.converters.registry import DEFAULT_REGISTRY, parse_registry
    from ggufkit.errors import RegistryError

    text = DEFAULT_REGISTRY.read_text(encoding="utf-8")
    assert old in text
    with pytest.raises(RegistryError, match=message):
        parse_registry(text.replace(old, new, 1))


@pytest.mark.parametrize("hf_class", sorted(PIXTRAL))
def test_text_model_equals_llama_cpp_converter(vlm: dict[str, dict[str, Path]], hf_class: str,
                                               tmp_path: Path) -> None:
    # The text half of --with-mmproj (LLaVA: llama, Mistral 3: mistral3), as llama.cpp's converter writes it.
    import os
    import subprocess
    import sys

    from llama_cpp_sources import llama_cpp_dir

    model = vlm[hf_class]["released"]
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
        for key in a.kv:
            if key.startswith(f"{arch}."):
                assert np.array_equal(np.asarray(a.get(key)), np.asarray(b.get(key))), key


def test_outtype_llama_cpp_does_not_write_projectors_in_isassert_refused(vlm: dict[str, dict[str, Path]],
                                                                   tmp_path: Path) -> None:
    model = vlm["Gemma3ForConditionalGeneration"]["released"]
    with pytest.raises(UsageError, match="q4_k_m"):
        convert_mmproj(model, tmp_path / "x.gguf", outtype="q4_k_m")
    out = tmp_path / "out"
    out.mkdir()
    res = invoke("convert", str(model), "--mmproj", "--outtype", "q4_k_m", "-o", str(out))
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1 and list(out.iterdir()) == []


def test_list_names_the_projector_of_each_vision_class() -> None:
    data = json.loads(invoke("convert", "--list", "--json").stdout)
    projectors = {a["hf_class"]: a["mmproj"] for a in data["architectures"] if a["mmproj"]}
    assert projectors == {"Gemma3ForConditionalGeneration": "gemma3", "Idefics3ForConditionalGeneration": "idefics3",
                          "SmolVLMForConditionalGeneration": "idefics3",
                          "LlavaForConditionalGeneration": "pixtral", "Mistral3ForConditionalGeneration": "pixtral",
                          "Qwen2_5_VLForConditionalGeneration": "qwen2.5vl_merger",
                          "Qwen3VLForConditionalGeneration": "qwen3vl_merger",
                          "Qwen3_5ForConditionalGeneration": "qwen3vl_merger",
                          "Qwen3_5MoeForConditionalGeneration": "qwen3vl_merger"}
