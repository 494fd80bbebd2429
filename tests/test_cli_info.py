"""`ggufkit info`: header, metadata summaries, tensors, totals and bits per weight, shard sets, PowerInfer."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
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
