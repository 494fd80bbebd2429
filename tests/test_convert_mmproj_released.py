"""Vision projectors from config.json as the released checkpoints write it (issue 34), at the smallest vision
tower llama.cpp's converter accepts for each class (fixtures_mmproj.RELEASES).

Released configs differ from what transformers 5 saves (test_convert_mmproj*.py): SmolVLM's and SmolVLM2's name the
text model's class (``VLlama3ForCausalLM``) in text_config, SmolVLM2's vision_config leaves out the sizes
transformers defaults, transformers 4's spelling (torch_dtype, rope_theta), Qwen2.5-VL's text fields at the root.
Per release, against llama.cpp's converter (0.3.36, the sdist's convert_hf_to_gguf.py):

- the projector's tensors (names, shapes, types, bytes) and keys equal ``--mmproj``'s, and libmtmd encodes an
  image bit for bit alike with either;
- the text model equals llama.cpp's text conversion; ``convert --with-mmproj`` writes both files.

And the issue's other failure: a Qwen3-VL tower of 2 blocks (the merger's linear_fc2 is ``mm.2``, no vision block);
Pixtral's ``mm.1``/``mm.2`` and Qwen2.5-VL's merger on towers smaller than llama.cpp's converter maps them for.
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
from cli_helpers import invoke
from fixtures_mmproj import (
    RELEASES,
    llama_cpp_mmproj,
    make_released,
    projector_keys,
    projector_tensors,
)
from test_convert_mmproj import _encode

from ggufkit.converters import convert, convert_mmproj
from ggufkit.format import open_gguf

NAMES = list(RELEASES)
#: (text GGUF architecture, projector type) per class
KINDS = {"Gemma3ForConditionalGeneration": ("gemma3", "gemma3"), "Idefics3ForConditionalGeneration": ("llama", "idefics3"),
         "SmolVLMForConditionalGeneration": ("llama", "idefics3"), "LlavaForConditionalGeneration": ("llama", "pixtral"),
         "Mistral3ForConditionalGeneration": ("mistral3", "pixtral"),
         "Qwen2_5_VLForConditionalGeneration": ("qwen2vl", "qwen2.5vl_merger"),
         "Qwen3VLForConditionalGeneration": ("qwen3vl", "qwen3vl_merger")}


@pytest.fixture(scope="module")
def released(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per release: a checkpoint directory named ``released`` (llama.cpp's converter takes the model's name and
    version from the directory's; a neutral one keeps them out of the comparison)."""
    return {name: make_released(tmp_path_factory.mktemp(name) / "released", name) for name in NAMES}


def _llama_cpp_text(model: Path, out: Path) -> Path:
    from llama_cpp_sources import llama_cpp_dir

    root = llama_cpp_dir()
    run = subprocess.run([sys.executable, str(root / "convert_hf_to_gguf.py"), str(model), "--outfile", str(out),
                          "--outtype", "f32"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(root / "gguf-py")})
    assert run.returncode == 0, run.stderr[-2000:]
    return out


def _side(model: Path) -> int:
    """An image side at which libmtmd's resize is the identity: the tower's image size; Qwen's 112 px (Qwen2.5-VL's
    one window) and 96 px (Qwen3-VL: 3x3 tokens, libmtmd enlarges images under 8 tokens)."""
    config = json.loads((model / "config.json").read_text())
    archs = config["architectures"][0]
    if archs.startswith("Qwen2_5"):
        return 112
    if archs.startswith("Qwen3"):
        return 96
    return int(config["vision_config"]["image_size"])


@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
@pytest.mark.parametrize("name", NAMES)
def test_projector_equals_llama_cpp_converter(released: dict[str, Path], name: str, outtype: str,
                                              tmp_path: Path) -> None:
    model = released[name]
    run = llama_cpp_mmproj(model, tmp_path / "theirs.gguf", outtype)
    assert run.returncode == 0, run.stderr[-2000:]
    ours = convert_mmproj(model, tmp_path / "ours.gguf", outtype=outtype).outputs[0]
    theirs = projector_tensors(tmp_path / "theirs.gguf")
    assert theirs and projector_tensors(ours) == theirs
    assert projector_keys(ours) == projector_keys(tmp_path / "theirs.gguf")


@pytest.mark.parametrize("name", NAMES)
def test_libmtmd_embeddings_equal_llama_cpp_projector(released: dict[str, Path], name: str, tmp_path: Path) -> None:
    model = released[name]
    text = convert(model, tmp_path / "text.gguf", outtype="f32").outputs[0]
    theirs = tmp_path / "theirs.gguf"
    assert llama_cpp_mmproj(model, theirs, "f32").returncode == 0
    ours = convert_mmproj(model, tmp_path / "ours.gguf", outtype="f32").outputs[0]
    assert projector_tensors(ours) == projector_tensors(theirs)
    rgb = np.random.default_rng(7).integers(0, 256, (_side(model), _side(model), 3), dtype=np.uint8)
    want = _encode(text, theirs, rgb)
    got = _encode(text, ours, rgb)
    assert [g.tobytes() for g in got] == [w.tobytes() for w in want]


@pytest.mark.parametrize("name", NAMES)
def test_text_model_equals_llama_cpp_converter(released: dict[str, Path], name: str, tmp_path: Path) -> None:
    # SmolVLM's: by text_config's VLlama3ForCausalLM, as llama.cpp's converter picks it (LlamaModel).
    model = released[name]
    theirs = _llama_cpp_text(model, tmp_path / "theirs.gguf")
    ours = convert(model, tmp_path / "ours.gguf", outtype="f32").outputs[0]
    assert projector_tensors(ours) == projector_tensors(theirs)
    with open_gguf(theirs) as a, open_gguf(ours) as b:
        arch = a.get("general.architecture")
        assert (b.get("general.architecture"), arch) == (KINDS[RELEASES[name].hf_class][0],) * 2
        keys = [k for k in a.kv if k.startswith(f"{arch}.")]
        assert set(keys) == {k for k in b.kv if k.startswith(f"{arch}.")}
        for key in keys:
            assert np.array_equal(np.asarray(a.get(key)), np.asarray(b.get(key))), key


@pytest.mark.parametrize("name", NAMES)
def test_cli_with_mmproj_writes_text_model_and_projector(released: dict[str, Path], name: str,
                                                         tmp_path: Path) -> None:
    res = invoke("convert", str(released[name]), "--with-mmproj", "--outtype", "f16", "-o", str(tmp_path),
                 "--no-check", "--json")
    assert res.exit_code == 0, res.stderr
    data = json.loads(res.stdout)
    mm = Path(data["mmproj"]["outputs"][0])
    assert mm == tmp_path / "mmproj-released-F16.gguf"
    with open_gguf(Path(data["outputs"][0])) as text, open_gguf(mm) as proj:
        assert (text.architecture, proj.get("clip.projector_type")) == KINDS[RELEASES[name].hf_class]
    alone = convert_mmproj(released[name], tmp_path / "alone.gguf", outtype="f16").outputs[0]
    assert projector_tensors(mm) == projector_tensors(alone) and projector_keys(mm) == projector_keys(alone)


def test_smolvlm_projector_is_the_checkpoints_class_not_text_configs(released: dict[str, Path]) -> None:
    # The refusal: "--mmproj: no projector support for VLlama3ForCausalLM".
    for name in ("smolvlm", "smolvlm2"):
        config = json.loads((released[name] / "config.json").read_text())
        assert config["text_config"]["architectures"] == ["VLlama3ForCausalLM"]
        report = convert_mmproj(released[name], dry_run=True)
        assert report.plan.hf_class == RELEASES[name].hf_class


def test_smolvlm2_tower_sizes_default_as_transformers(released: dict[str, Path], tmp_path: Path) -> None:
    # SmolVLM2-500M's vision_config has no num_hidden_layers, intermediate_size or layer_norm_eps:
    # SmolVLMVisionConfig's 12, 3072 and 1e-6 (what llama.cpp's converter reads through AutoConfig).
    model = released["smolvlm2"]
    vision = json.loads((model / "config.json").read_text())["vision_config"]
    assert not {"num_hidden_layers", "intermediate_size", "layer_norm_eps"} & set(vision)
    keys = projector_keys(convert_mmproj(model, tmp_path / "p.gguf", outtype="f16").outputs[0])
    assert keys["clip.vision.block_count"][1] == 12 and keys["clip.vision.feed_forward_length"][1] == 3072
    assert keys["clip.vision.attention.layer_norm_epsilon"][1] == pytest.approx(1e-6)


#: The text model's class a config could name in text_config (llama.cpp's converter converts the text model by it)
TEXT_CLASSES = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM", "LlavaForConditionalGeneration": "MistralForCausalLM",
                "Mistral3ForConditionalGeneration": "MistralForCausalLM", "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM"}


@pytest.mark.parametrize("name", [n for n in NAMES if RELEASES[n].hf_class in TEXT_CLASSES])
def test_nested_architectures_do_not_change_the_projector(released: dict[str, Path], name: str,
                                                          tmp_path: Path) -> None:
    # SmolVLM's text_config class, for every class; vision_config's "architectures": null (as full config dumps
    # write it). The projector is the checkpoint's class's, byte for byte the release config's.
    model = shutil.copytree(released[name], tmp_path / "nested" / "released")
    config = json.loads((model / "config.json").read_text())
    config["text_config"]["architectures"] = [TEXT_CLASSES[RELEASES[name].hf_class]]
    config["vision_config"]["architectures"] = None
    (model / "config.json").write_text(json.dumps(config))
    want = convert_mmproj(released[name], tmp_path / "want.gguf", outtype="f16").outputs[0]
    got = convert_mmproj(model, tmp_path / "got.gguf", outtype="f16").outputs[0]
    assert projector_tensors(got) == projector_tensors(want) and projector_keys(got) == projector_keys(want)


# -- towers smaller than llama.cpp's converter maps the projector's numbered layers for ----------------------------
@pytest.mark.parametrize(("name", "blocks", "tower"), [
    ("pixtral", 1, {"num_hidden_layers": 1}),
    ("qwen2.5-vl", 1, {"depth": 1, "fullatt_block_indexes": [0]}),
])
def test_small_towers_give_llama_cpp_converters_projector_from_a_larger_config(name: str, blocks: int,
                                                                              tower: dict, tmp_path: Path) -> None:
    # llama.cpp's converter maps multi_modal_projector.linear_{1,2} / visual.merger.mlp.{0,2} only below its
    # block count, so it refuses a 1-block tower. Given the same weights with a config that says 3 blocks (it does
    # not check that every block is there) it writes the same tensors; the keys differ only in the block count.
    model = make_released(tmp_path / "released", name, **tower)
    refused = llama_cpp_mmproj(model, tmp_path / "x.gguf", "f16")
    assert refused.returncode != 0 and "Can not map tensor" in refused.stderr
    ours = convert_mmproj(model, tmp_path / "ours.gguf", outtype="f16").outputs[0]
    larger = shutil.copytree(model, tmp_path / "larger" / "released")
    config = json.loads((larger / "config.json").read_text())
    config["vision_config"]["depth" if "depth" in tower else "num_hidden_layers"] = 3
    (larger / "config.json").write_text(json.dumps(config))
    run = llama_cpp_mmproj(larger, tmp_path / "theirs.gguf", "f16")
    assert run.returncode == 0, run.stderr[-2000:]
    assert projector_tensors(ours) == projector_tensors(tmp_path / "theirs.gguf")
    theirs_keys, ours_keys = projector_keys(tmp_path / "theirs.gguf"), projector_keys(ours)
    assert ours_keys.pop("clip.vision.block_count")[1] == blocks
    assert theirs_keys.pop("clip.vision.block_count")[1] == 3
    assert ours_keys == theirs_keys
