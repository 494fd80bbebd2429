"""`ggufkit release` of the Qwen3.5 VLMs (issue 33): a tiny Qwen3_5ForConditionalGeneration /
Qwen3_5MoeForConditionalGeneration whose config.json is as released (tests/fixtures_mmproj.py
qwen35_released_config). The projector (Qwen3-VL's, qwen3vl_merger) is written once and equals what
``convert --mmproj`` writes, the text model (qwen35 / qwen35moe) is converted, quantized and scored, the manifest
and the card list the projector, and libmtmd encodes an image with the projector beside the quant."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import invoke

from ggufkit.converters import convert_mmproj
from ggufkit.format import open_gguf

ARGS = ["--types", "q8_0", "--no-imatrix", "--ctx", "64", "--chunks", "2", "--device", "cpu"]
MMPROJ = "mmproj-released-F16.gguf"
#: class -> the text model's GGUF architecture
CLASSES = {"Qwen3_5ForConditionalGeneration": "qwen35", "Qwen3_5MoeForConditionalGeneration": "qwen35moe"}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# One class (CI time): the dense VLM's projector is the same section and its text half is tested in
# test_convert_mmproj_qwen35.py; measured, the dense release passes too.
@pytest.mark.parametrize("hf_class", ["Qwen3_5MoeForConditionalGeneration"])
def test_release_end_to_end_with_the_projector(hf_class: str, tmp_path: Path) -> None:
    from fixtures_mmproj import copy_layout, make_vlm, qwen35_released_config
    from mtmd_runtime import mtmd_image_embeddings

    base = make_vlm(tmp_path / "src" / "saved", hf_class)
    model = qwen35_released_config(copy_layout(base, tmp_path / "src" / "released", hf_class, "released"))
    out = tmp_path / "out"
    result = invoke("release", str(model), "-o", str(out), *ARGS, "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] and report["ran"].count("mmproj") == 1 and not report["failures"]
    # the projector: convert --mmproj's bytes, in the report, the manifest and the card
    assert report["projector"]["file"] == MMPROJ and report["projector"]["projector_type"] == "qwen3vl_merger"
    assert _sha(out / MMPROJ) == _sha(convert_mmproj(model, tmp_path / "alone.gguf", outtype="f16").outputs[0])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["files"][MMPROJ] == {"sha256": _sha(out / MMPROJ), "size": (out / MMPROJ).stat().st_size}
    assert manifest["projector"]["projector_type"] == "qwen3vl_merger"
    card = (out / "README.md").read_text()
    # the text model: converted, quantized and scored
    quant = next(p for p in out.glob("*-Q8_0.gguf") if not p.name.startswith("mmproj-"))
    assert f"llama-mtmd-cli -m {quant.name} --mmproj {MMPROJ} --image image.jpg" in card
    with open_gguf(quant) as g:
        assert g.architecture == CLASSES[hf_class]
    row = report["rows"][0]
    assert row["type"] == "Q8_0" and np.isfinite(row["ppl"]) and row["mean_kld"] >= 0
    # libmtmd encodes an image (96 px: 3x3 tokens of the text model's width) with the projector beside the quant
    rgb = (np.arange(96 * 96 * 3) % 251).astype(np.uint8).reshape(96, 96, 3)
    chunks = mtmd_image_embeddings(quant, out / MMPROJ, rgb)
    assert [c.shape for c in chunks] == [(9, 64)]
    assert np.isfinite(chunks[0]).all() and float(np.ptp(chunks[0])) > 0
