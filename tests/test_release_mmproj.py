"""`ggufkit release` of a vision-language checkpoint (tiny Gemma 3, real tokenizer files): the projector
(``mmproj-*.gguf``) is written once, equals what ``convert --mmproj`` writes, is listed with its hash in the
manifest and in the card (run with llama-mtmd-cli), loads in libmtmd beside a quant, is resumed like every other
step, and goes up with the release."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from cli_helpers import invoke

from ggufkit.converters import convert_mmproj

ARGS = ["--types", "q8_0", "--no-imatrix", "--ctx", "64", "--chunks", "2", "--device", "cpu"]
ROOT = Path(__file__).resolve().parents[1]
HF_CLASS = "Gemma3ForConditionalGeneration"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _artifacts(outdir: Path) -> dict[str, str]:
    return {p.relative_to(outdir).as_posix(): _sha(p) for p in sorted(outdir.rglob("*"))
            if p.is_file() and p.name != "hashes.json"}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fixtures_mmproj import copy_layout, make_vlm

    root = tmp_path_factory.mktemp("vlm")
    model = copy_layout(make_vlm(root / "base", HF_CLASS), root / "tiny-gemma3-vl", HF_CLASS, "released")
    (model / "README.md").write_text("---\nlicense: gemma\n---\n# tiny\n")
    return model


@pytest.fixture(scope="module")
def released(vlm: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("rel") / "out"
    result = invoke("release", str(vlm), "-o", str(out), *ARGS, "--json")
    assert result.exit_code == 0, result.stderr
    return out, json.loads(result.stdout)


MMPROJ = "mmproj-tiny-gemma3-vl-F16.gguf"
#: the text model's quant (its name carries the size label, as convert names it)
QUANT = "tiny-gemma3-vl-243K-Q8_0.gguf"


def test_projector_is_written_once_as_convert_mmproj_writes_it(released: tuple[Path, dict], vlm: Path,
                                                               tmp_path: Path) -> None:
    out, report = released
    assert report["ok"] and report["ran"].count("mmproj") == 1
    assert [p.name for p in out.glob("mmproj-*")] == [MMPROJ]
    alone = convert_mmproj(vlm, tmp_path / "alone.gguf", outtype="f16").outputs[0]
    assert _sha(out / MMPROJ) == _sha(alone)
    assert MMPROJ in report["files"] and report["projector"]["file"] == MMPROJ


def test_manifest_lists_the_projector_with_its_hash(released: tuple[Path, dict]) -> None:
    out, _ = released
    manifest = json.loads((out / "manifest.json").read_text())
    want = {"sha256": _sha(out / MMPROJ), "size": (out / MMPROJ).stat().st_size}
    assert manifest["files"][MMPROJ] == want
    assert manifest["steps"]["mmproj"]["outputs"] == {MMPROJ: want}
    p = manifest["projector"]
    assert {k: p[k] for k in ("file", "sha256", "size")} == {"file": MMPROJ, **want}
    assert (p["file_type"], p["projector_type"], p["image_size"], p["patch_size"]) == ("F16", "gemma3", 32, 8)
    assert p["tokens_per_image"] == 4 and manifest["parameters"]["mmproj_type"] == "f16"
    assert manifest["steps"]["mmproj"]["params"] == {"outtype": "f16"}


def test_card_lists_the_projector_and_runs_it_with_llama_mtmd_cli(released: tuple[Path, dict]) -> None:
    out, _ = released
    card = (out / "README.md").read_text()
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["pipeline_tag"] == "image-text-to-text" and "vision" in meta["tags"] and meta["license"] == "gemma"
    quant = QUANT
    assert (out / quant).is_file()
    row = next(line for line in card.splitlines() if line.startswith(f"| `{MMPROJ}`"))
    assert "F16 (vision projector)" in row and "gemma3, 4 tokens per 32 px image" in row
    assert f"llama-mtmd-cli -m {quant} --mmproj {MMPROJ} --image image.jpg" in card
    assert f"llama-server -m {quant} --mmproj {MMPROJ}" in card
    assert "llama-mtmd-cli -hf <user>/<repo>:Q8_0 --image" in card
    assert "ollama run hf.co/<user>/<repo>:Q8_0" in card
    assert f"- vision projector: `{MMPROJ}` (F16, projector type gemma3" in card


def test_projector_loads_in_libmtmd_beside_the_quant(released: tuple[Path, dict]) -> None:
    from mtmd_runtime import mtmd_image_embeddings

    out, report = released
    rgb = (np.arange(32 * 32 * 3) % 251).astype(np.uint8).reshape(32, 32, 3)
    chunks = mtmd_image_embeddings(out / QUANT, out / MMPROJ, rgb)
    assert [c.shape for c in chunks] == [(report["projector"]["tokens_per_image"], 64)]
    assert np.isfinite(chunks[0]).all() and float(np.ptp(chunks[0])) > 0


def test_rerun_runs_nothing_and_a_lost_projector_is_remade(released: tuple[Path, dict], vlm: Path,
                                                            tmp_path: Path) -> None:
    out = tmp_path / "again"
    shutil.copytree(released[0], out)
    before = _artifacts(out)
    result = invoke("release", str(vlm), "-o", str(out), *ARGS, "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ran"] == [] and "mmproj" in report["skipped"]
    assert _artifacts(out) == before
    (out / MMPROJ).unlink()
    report = json.loads(invoke("release", str(vlm), "-o", str(out), *ARGS, "--json").stdout)
    assert report["ran"] == ["mmproj"]
    assert _artifacts(out) == before


def test_other_projector_type_and_no_mmproj(released: tuple[Path, dict], vlm: Path, tmp_path: Path) -> None:
    out = tmp_path / "q8"
    shutil.copytree(released[0], out)
    report = json.loads(invoke("release", str(vlm), "-o", str(out), *ARGS, "--mmproj-type", "q8_0", "--json").stdout)
    # only the projector and what lists it change; the quants and their scores are kept
    assert report["ran"] == ["mmproj"] and report["projector"]["file"] == "mmproj-tiny-gemma3-vl-Q8_0.gguf"
    manifest = json.loads((out / "manifest.json").read_text())
    assert "mmproj-tiny-gemma3-vl-Q8_0.gguf" in manifest["files"] and MMPROJ not in manifest["files"]

    bare = tmp_path / "bare"
    result = invoke("release", str(vlm), "-o", str(bare), *ARGS, "--no-mmproj", "--json")
    assert result.exit_code == 0, result.stderr
    assert not list(bare.glob("mmproj-*")) and json.loads(result.stdout)["projector"] is None
    manifest = json.loads((bare / "manifest.json").read_text())
    assert "projector" not in manifest and "mmproj_type" not in manifest["parameters"]
    assert "mmproj" not in (bare / "README.md").read_text()


def test_dry_run_and_bad_input(vlm: Path, tmp_path: Path) -> None:
    out = tmp_path / "dry"
    result = invoke("release", str(vlm), "-o", str(out), *ARGS, "--dry-run", "--push", "me/vl-GGUF", "--json",
                    env={"HF_TOKEN": "hf_dummy_not_used"})
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert not out.exists()
    step = next(s for s in report["steps"] if s["step"] == "mmproj")
    assert step["action"] == "run" and step["files"] == [MMPROJ] and step["estimated_bytes"] > 0
    assert MMPROJ in report["push"]["files"]
    result = invoke("release", str(vlm), "-o", str(out), *ARGS, "--mmproj-type", "f16", "--no-mmproj")
    assert result.exit_code == 2 and "--no-mmproj" in result.stderr and not out.exists()
    assert len(result.stderr.strip().splitlines()) == 1


def test_push_sends_the_projector(released: tuple[Path, dict], vlm: Path, tmp_path: Path) -> None:
    from test_release import _HubStandIn

    out = tmp_path / "pushed"
    shutil.copytree(released[0], out)
    hub = _HubStandIn()
    try:
        env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": "hf_local_stand_in", "HF_HUB_DISABLE_XET": "1",
               "HF_HOME": str(tmp_path / "hf")}
        proc = subprocess.run([sys.executable, "-m", "ggufkit", "release", str(vlm), "-o", str(out), *ARGS,
                               "--push", "me/vl-GGUF", "--json"], cwd=ROOT, env=env, capture_output=True, text=True,
                              check=False)
    finally:
        hub.close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["ran"] == []
    sent = {i["value"]["path"] for c in hub.commits for i in c["items"] if i["key"] == "file"}
    assert MMPROJ in sent and QUANT in sent


def test_fan_out_then_card_only_equals_the_single_machine_release(vlm: Path, tmp_path: Path) -> None:
    args = ["--types", "q8_0,q4_0", *ARGS[2:]]
    single = tmp_path / "single"
    assert invoke("release", str(vlm), "-o", str(single), *args).exit_code == 0
    a, b = tmp_path / "a", tmp_path / "b"
    for out, qtype in ((a, "q8_0"), (b, "q4_0")):
        result = invoke("release", str(vlm), "-o", str(out), *args, "--only", qtype, "--json")
        assert result.exit_code == 0, result.stderr
        assert MMPROJ in json.loads(result.stdout)["files"]  # every machine writes the same projector
    assert _sha(a / MMPROJ) == _sha(b / MMPROJ)
    for p in b.rglob("*"):
        if p.is_file() and not (a / p.relative_to(b)).exists():
            (a / p.relative_to(b)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, a / p.relative_to(b))
    result = invoke("release", str(vlm), "-o", str(a), *args, "--card-only")
    assert result.exit_code == 0, result.stderr
    assert _artifacts(a) == _artifacts(single)


def test_a_vision_class_without_projector_support_is_refused_before_any_work(tmp_path: Path) -> None:
    from fixtures_models import make_checkpoint

    model = make_checkpoint(tmp_path / "llama-vision", "LlamaForCausalLM")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vision_config": {"hidden_size": 32}}))
    out = tmp_path / "out"
    result = invoke("release", str(model), "-o", str(out), *ARGS)
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "no projector support for LlamaForCausalLM" in result.stderr and "Gemma3ForConditionalGeneration" in \
        result.stderr and "--no-mmproj" in result.stderr
    assert not out.exists()
    result = invoke("release", str(model), "-o", str(out), *ARGS, "--no-mmproj", "--dry-run", "--json")
    assert result.exit_code == 0, result.stderr
    assert "mmproj" not in [s["step"] for s in json.loads(result.stdout)["steps"]]


def test_dry_run_sizes_of_projector_master_and_quant_are_the_files_sizes(released: tuple[Path, dict], vlm: Path,
                                                                        tmp_path: Path) -> None:
    """Issue 35: the dry run's sizes, planned before any file exists, are the sizes of the files written."""
    out, _ = released
    result = invoke("release", str(vlm), "-o", str(tmp_path / "dry"), *ARGS, "--dry-run", "--json")
    assert result.exit_code == 0, result.stderr
    sized = {s["files"][0]: s["estimated_bytes"] for s in json.loads(result.stdout)["steps"] if s["estimated_bytes"]}
    assert MMPROJ in sized and QUANT in sized and len(sized) == 3
    assert sized == {name: (out / name).stat().st_size for name in sized}


# -- issue 34: checkpoints whose config.json is as released (fixtures_mmproj.RELEASES) ---------------------------
#: The text model's GGUF architecture per class (what release converts, then scores with the evaluator).
TEXT_ARCH = {"Gemma3ForConditionalGeneration": "gemma3", "Idefics3ForConditionalGeneration": "llama",
             "SmolVLMForConditionalGeneration": "llama", "LlavaForConditionalGeneration": "llama",
             "Mistral3ForConditionalGeneration": "mistral3", "Qwen2_5_VLForConditionalGeneration": "qwen2vl",
             "Qwen3VLForConditionalGeneration": "qwen3vl"}


def _release_names(scored: bool) -> list[str]:
    """Releases whose text model the evaluator scores (``scored``), or not (M-RoPE and Mistral 3 text models:
    ggufkit.eval.arch.ARCH_TRAITS has no row for them yet)."""
    from fixtures_mmproj import RELEASES

    from ggufkit.eval.arch import ARCH_TRAITS

    return [n for n, r in RELEASES.items() if (TEXT_ARCH[r.hf_class] in ARCH_TRAITS) == scored]


def _release(name: str, tmp_path: Path) -> tuple[Path, Path, Any]:
    from fixtures_mmproj import make_released

    model = make_released(tmp_path / "src" / "released", name)
    out = tmp_path / "out"
    return model, out, invoke("release", str(model), "-o", str(out), *ARGS, "--json")


@pytest.mark.parametrize("name", _release_names(scored=True))
def test_release_of_a_checkpoint_configured_as_released(name: str, tmp_path: Path) -> None:
    # SmolVLM's config names the text model's class (VLlama3ForCausalLM) in text_config: refused before any work
    # until issue 34. The projector is convert --mmproj's and loads beside the quant.
    from test_convert_mmproj import _encode  # retried while libmtmd gives NaN (Pixtral's [IMG_BREAK] row)

    model, out, result = _release(name, tmp_path)
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    mmproj = report["projector"]["file"]
    assert mmproj == "mmproj-released-F16.gguf" and mmproj in report["files"]
    assert _sha(out / mmproj) == _sha(convert_mmproj(model, tmp_path / "alone.gguf", outtype="f16").outputs[0])
    quant = next(p for p in out.glob("*-Q8_0.gguf") if not p.name.startswith("mmproj-"))
    side = int(json.loads((model / "config.json").read_text())["vision_config"]["image_size"])
    rgb = (np.arange(side * side * 3) % 251).astype(np.uint8).reshape(side, side, 3)
    chunks = _encode(quant, out / mmproj, rgb)
    assert chunks and all(float(np.ptp(c)) > 0 for c in chunks)


@pytest.mark.parametrize("name", _release_names(scored=False))
def test_release_writes_the_projector_then_stops_at_a_text_model_the_evaluator_cannot_score(name: str,
                                                                                          tmp_path: Path) -> None:
    # Qwen3-VL with a 2-block tower was refused before any work until issue 34. Now the projector (written first)
    # is convert --mmproj's; the run then stops, in one line, where the evaluator has no traits for the text
    # model's architecture (when ARCH_TRAITS gains them, these cases move to the test above).
    from fixtures_mmproj import RELEASES

    model, out, result = _release(name, tmp_path)
    arch = TEXT_ARCH[RELEASES[name].hf_class]
    assert result.exit_code == 2 and f"cannot evaluate {arch!r}" in result.stderr, result.stderr
    assert _sha(out / "mmproj-released-F16.gguf") == _sha(
        convert_mmproj(model, tmp_path / "alone.gguf", outtype="f16").outputs[0])
