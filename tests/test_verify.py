"""`ggufkit verify`: structural problems beyond what the reader refuses, hashes, exit codes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from cli_helpers import invoke
from gguf_builders import RawGGUF, gstr, kv_str, tensor_info, u32, u64, valid_raw, write_model
from llama_cpp_sources import vocab_dir

from ggufkit.format import Metadata, TensorSpec, write_gguf
from ggufkit.format.values import VT
from ggufkit.verify import verify

F32 = int(gguf.GGMLQuantizationType.F32)


def _run(*args: str) -> tuple[int, dict]:
    result = invoke("verify", *args, "--json")
    return result.exit_code, json.loads(result.stdout)


def _meta_file(tmp_path: Path, build: callable) -> Path:  # type: ignore[valid-type]
    meta = Metadata()
    meta.set("general.architecture", VT.STRING, "llama")
    build(meta)
    path = tmp_path / "m.gguf"
    write_gguf(path, meta, [TensorSpec("w", gguf.GGMLQuantizationType.F32, (2, 8))], [np.ones((2, 8), np.float32)])
    return path


@pytest.mark.parametrize("name", ["ggml-vocab-llama-spm.gguf", "ggml-vocab-qwen2.gguf", "ggml-vocab-gpt-2.gguf"])
def test_llama_cpp_vocab_files_are_valid(name: str) -> None:
    report = verify(vocab_dir() / name)
    assert report.ok, report.problems
    assert report.n_tensors == 0 and report.n_kv > 10


def test_valid_file_exits_0_with_json_report(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m.gguf")
    code, data = _run(str(path))
    assert code == 0
    assert data["ok"] is True and data["problems"] == [] and data["tensors"] == 4
    assert "digest" not in data


def test_hash_gives_per_tensor_sha256_and_a_digest_of_all_tensor_data(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m.gguf")
    code, data = _run(str(path), "--hash")
    assert code == 0
    reader = gguf.GGUFReader(path)  # independent oracle for where each tensor's bytes are
    expected = {t.name: hashlib.sha256(t.data.tobytes()).hexdigest() for t in reader.tensors}
    assert data["tensor_sha256"] == expected
    assert data["digest"] == hashlib.sha256(b"".join(t.data.tobytes() for t in reader.tensors)).hexdigest()


def test_digest_of_a_shard_set_equals_that_of_the_single_file(tmp_path: Path) -> None:
    single = write_model(tmp_path / "single.gguf", n_tensors=5)
    write_model(tmp_path / "set.gguf", n_tensors=5, split_max_tensors=2)
    a = verify(single, hash_tensors=True)
    b = verify(tmp_path / "set-00002-of-00003.gguf", hash_tensors=True)
    assert b.ok and len(b.shards) == 3
    assert a.digest == b.digest and a.tensor_sha256 == b.tensor_sha256


def test_malformed_file_is_invalid_with_exit_2_and_the_reader_message(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(valid_raw().build()[:40])
    code, data = _run(str(path))
    assert code == 2 and data["ok"] is False
    assert data["problems"][0]["kind"] == "format"
    assert data["problems"][0]["message"] == "KV count 2 cannot fit in the 16 bytes left in the file"
    assert data["problems"][0]["offset"] == 16


def test_wrong_type_of_a_well_known_key_is_a_problem(tmp_path: Path) -> None:
    path = _meta_file(tmp_path, lambda m: m.set("llama.context_length", VT.INT32, 2048))
    code, data = _run(str(path))
    assert code == 2
    assert [p["kind"] for p in data["problems"]] == ["key_type"]
    assert "llama.context_length has type i32, llama.cpp reads u32" in data["problems"][0]["message"]


def test_tokenizer_arrays_of_different_lengths_and_ids_outside_the_vocab_are_problems(tmp_path: Path) -> None:
    def build(m: Metadata) -> None:
        m.set("tokenizer.ggml.tokens", VT.ARRAY, ["a", "b", "c"], VT.STRING)
        m.set("tokenizer.ggml.scores", VT.ARRAY, [0.0, 1.0], VT.FLOAT32)
        m.set("tokenizer.ggml.eos_token_id", VT.UINT32, 3)

    report = verify(_meta_file(tmp_path, build))
    messages = [p.message for p in report.problems]
    assert "tokenizer.ggml.scores has 2 items, tokenizer.ggml.tokens has 3" in messages
    assert "tokenizer.ggml.eos_token_id = 3 is outside the 3-token vocabulary" in messages


def test_bad_utf8_inside_a_string_array_is_found(tmp_path: Path) -> None:
    raw = valid_raw()
    raw.kvs.append(gstr("tokenizer.ggml.tokens") + u32(int(VT.ARRAY)) + u32(int(VT.STRING)) + u64(2)
                   + gstr("ok") + gstr(b"\xff\xfe"))
    path = tmp_path / "utf8.gguf"
    path.write_bytes(raw.build())
    report = verify(path)
    assert not report.ok and "item 1 of 'tokenizer.ggml.tokens' is not valid UTF-8" in report.problems[0].message


def test_offsets_llama_cpp_would_reject_are_a_layout_problem(tmp_path: Path) -> None:
    # b at 96 instead of 64: in bounds and aligned, so it reads, but llama.cpp wants packed tensors.
    raw = RawGGUF(kvs=[kv_str("general.architecture", "llama")],
                  infos=[tensor_info("a", [16], F32, 0), tensor_info("b", [4], F32, 96)],
                  data=bytes(128))
    path = tmp_path / "gap.gguf"
    path.write_bytes(raw.build())
    report = verify(path)
    assert [p.kind for p in report.problems] == ["layout"]
    assert "tensor 'b' has offset 96, llama.cpp expects 64" in report.problems[0].message


def test_split_tensor_count_must_match_in_a_single_file(tmp_path: Path) -> None:
    raw = valid_raw()
    raw.kvs.append(gstr("split.tensors.count") + u32(int(VT.INT32)) + u32(3))
    path = tmp_path / "split.gguf"
    path.write_bytes(raw.build())
    report = verify(path)
    assert [p.kind for p in report.problems] == ["split"]
    assert "split.tensors.count is 3 but the file holds 2 tensors" in report.problems[0].message


def test_missing_architecture_is_a_warning_not_a_problem(tmp_path: Path) -> None:
    path = tmp_path / "noarch.gguf"
    write_gguf(path, Metadata(), [], [])
    report = verify(path)
    assert report.ok and any("general.architecture is missing" in w for w in report.warnings)


@pytest.fixture(scope="module")
def gemma3_vlm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Gemma 3 vision-language checkpoint's text GGUF and ggufkit's f16 projector."""
    from fixtures_mmproj import copy_layout, make_vlm

    from ggufkit.converters import convert, convert_mmproj

    root = tmp_path_factory.mktemp("gemma3-vlm")
    model = copy_layout(make_vlm(root / "base", "Gemma3ForConditionalGeneration"), root / "released",
                        "Gemma3ForConditionalGeneration", "released")
    return (convert(model, root / "text.gguf", outtype="f32").outputs[0],
            convert_mmproj(model, root / "mmproj.gguf", outtype="f16").outputs[0])


def test_projector_file_is_valid_and_described(gemma3_vlm: tuple[Path, Path]) -> None:
    code, report = _run(str(gemma3_vlm[1]))
    assert code == 0 and report["ok"], report
    p = report["projector"]
    assert (p["projector_type"], p["modalities"], p["image_size"], p["patch_size"]) == ("gemma3", ["vision"], 32, 8)
    # (32/8)^2 = 16 patches, merged 2x2 (clip.vision.projector.scale_factor from mm_tokens_per_image = 4)
    assert p["tokens_per_image"] == 4 and p["clip_keys"]["clip.vision.projector.scale_factor"] == 2
    text = invoke("verify", str(gemma3_vlm[1])).stdout
    assert "projector: gemma3 (vision), image 32 px, patch 8 px, 4 tokens per image" in text


def test_projector_without_image_std_is_a_problem_libmtmd_agrees(gemma3_vlm: tuple[Path, Path],
                                                                 tmp_path: Path) -> None:
    from mtmd_runtime import mtmd_image_embeddings

    text, mmproj = gemma3_vlm
    broken = tmp_path / "broken.gguf"
    res = invoke("set-meta", str(mmproj), "--delete", "clip.vision.image_std", "-o", str(broken))
    assert res.exit_code == 0, res.stderr
    code, report = _run(str(broken))
    assert code == 2 and not report["ok"]
    assert [p["kind"] for p in report["problems"]] == ["projector"]
    assert "clip.vision.image_std" in report["problems"][0]["message"]
    with pytest.raises(AssertionError, match="libmtmd could not load"):
        mtmd_image_embeddings(text, broken, np.zeros((32, 32, 3), np.uint8))
    mtmd_image_embeddings(text, mmproj, np.zeros((32, 32, 3), np.uint8))  # the file it was made from loads
