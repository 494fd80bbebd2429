"""The converter's core rules: registry schema, complete mapping, transforms, checkpoints, naming, splitting."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from fixtures_models import make_checkpoint

from ggufkit.converters import convert
from ggufkit.converters.registry import DEFAULT_REGISTRY, parse_registry
from ggufkit.converters.transforms import Heads, neox_qkv, permute_q
from ggufkit.errors import CheckpointError, RegistryError, TensorMappingError, UnsupportedArchitectureError
from ggufkit.format import open_gguf

REGISTRY_TEXT = DEFAULT_REGISTRY.read_text()


def test_converters_modules_import_each_other_one_way_typing_imports_included() -> None:
    # issue 31: no circle inside converters/, not even through imports inside functions or under
    # TYPE_CHECKING, and no module of the package imports the package's __init__ (its public API).
    from test_layout import MODULES, imported_package_modules

    graph = {m: {n for n in imported_package_modules(p) if n.startswith("ggufkit.converters") and n != m}
             for m, p in MODULES if m.startswith("ggufkit.converters")}
    assert not [m for m, names in graph.items() if "ggufkit.converters" in names and m != "ggufkit.converters"]
    circles = []

    def visit(module: str, path: list[str]) -> None:
        for name in sorted(graph.get(module, ())):
            if name in path:
                circles.append(" -> ".join([*path[path.index(name):], name]))
            elif name not in done:
                visit(name, [*path, name])
        done.add(module)

    done: set[str] = set()
    for module in sorted(graph):
        visit(module, [module])
    assert not circles, circles


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM")


# -- registry ---------------------------------------------------------------------------------------
def test_shipped_registry_loads_and_every_entry_names_a_known_arch() -> None:
    reg = parse_registry(REGISTRY_TEXT)
    assert {e.arch for e in reg.entries.values()} == {"llama", "qwen2", "qwen3", "qwen", "gptneox", "opt", "qwen2moe",
                                                     "qwen3moe", "gemma2", "gemma3", "phi3", "mistral3", "qwen2vl",
                                                     "qwen3vl", "smollm3", "olmo2", "cohere2", "falcon-h1", "gemma3n",
                                                     "granitehybrid", "lfm2", "lfm2moe", "nemotron_h_moe", "qwen35",
                                                     "qwen35moe", "qwen3next", "llama4", "glm4moe",
                                                     "ernie4_5", "ernie4_5-moe", "deepseek2", "gpt-oss"}


@pytest.mark.parametrize(("old", "new", "message"), [
    ("  arch: gptneox\n", "  arch: gptneox\n  archh: x\n",
     r"entry 'GPTNeoXForCausalLM', field 'archh': unknown field"),
    ("    decoder.layers.{bid}.fc1: FFN_UP\n", "    decoder.layers.{bid}.fc1: FFN_UPP\n",
     r"entry 'OPTForCausalLM', field 'tensors': unknown GGUF tensor 'FFN_UPP'"),
    ("  arch: qwen\n", "  arch: qwenn\n", r"entry 'QWenLMHeadModel', field 'arch': unknown GGUF architecture"),
    ("    use_parallel_residual: {from: [use_parallel_residual], default: true}\n",
     "    use_parallel_residuals: [use_parallel_residual]\n",
     r"entry 'GPTNeoXForCausalLM', field 'hparams': unknown GGUF key \{arch\}.use_parallel_residuals"),
    ("  output: drop\n  powerinfer: true\n", "  output: 3\n  powerinfer: true\n",
     r"entry 'OPTForCausalLM', field 'output': expected a string"),
    ("  transforms: {FFN_DOWN_T: transpose}\n", "  transforms: {FFN_DOWN_T: flip}\n",
     r"field 'transforms': unknown transform 'flip'"),
    ("    decoder.embed_tokens: TOKEN_EMBD\n", "    decoder.embed_tokens: TOKEN_EMBD\n    decoder.embed_tokens: OUTPUT\n",
     r"duplicate key 'decoder.embed_tokens'"),
    ("    gpt_neox.embed_in: TOKEN_EMBD\n", "    gpt_neox.embed_in: ATTN_Q_NORM\n",
     r"'ATTN_Q_NORM' is not part of architecture 'gptneox'"),
])
def test_broken_registry_is_refused_naming_entry_and_field(old: str, new: str, message: str) -> None:
    assert old in REGISTRY_TEXT
    with pytest.raises(RegistryError, match=message):
        parse_registry(REGISTRY_TEXT.replace(old, new, 1))


def test_base_inheritance_merges_mappings_and_null_removes_a_key() -> None:
    reg = parse_registry(REGISTRY_TEXT)
    llama, qwen2, qwen3 = (reg.entries[n] for n in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"))
    assert qwen2.arch == "qwen2" and qwen2.hooks is None and llama.hooks == "llama"
    assert not any(r.transform for r in qwen2.tensors)
    assert {r.transform for r in llama.tensors} == {None, "permute_q", "permute_k"}
    assert {h.key for h in llama.hparams} - {h.key for h in qwen2.hparams} == {"vocab_size", "rope.dimension_count"}
    assert {r.tensor for r in qwen3.tensors} - {r.tensor for r in qwen2.tensors} == {"ATTN_Q_NORM", "ATTN_K_NORM"}


@pytest.mark.parametrize(("text", "message"), [
    ("A:\n  base: Nope\n  arch: llama\n", r"entry 'A', field 'base': unknown base entry 'Nope'"),
    ("A:\n  base: B\nB:\n  base: A\n", r"field 'base': base entries form a cycle"),
    ("A:\n  base: A\n", r"field 'base': base entries form a cycle"),
    ("A:\n  base: LlamaForCausalLM\n  hooks: nothere\n", r"entry 'A', field 'hooks': unknown hooks module"),
])
def test_broken_inheritance_is_refused(text: str, message: str) -> None:
    with pytest.raises(RegistryError, match=message):
        parse_registry(REGISTRY_TEXT + "\n" + text)


def test_every_hooks_module_named_in_the_registry_defines_hooks() -> None:
    from ggufkit.converters.hooks import HOOK_FAMILIES, hooks_for

    entries = parse_registry(REGISTRY_TEXT).entries.values()
    named = ({e.hooks for e in entries} | {e.mmproj.hooks for e in entries if e.mmproj is not None}) - {None}
    assert named == set(HOOK_FAMILIES)
    for family in named:
        assert hooks_for(family), family


# -- transforms ---------------------------------------------------------------------------------------
def test_neox_qkv_regroups_per_head_interleaving_into_q_k_v_blocks() -> None:
    n_head, d, n_embd = 3, 4, 5
    w = np.arange(n_head * 3 * d * n_embd, dtype=np.float32).reshape(n_head * 3 * d, n_embd)
    out = neox_qkv(w, Heads(n_head, n_head))
    for part in range(3):  # q, k, v
        for h in range(n_head):
            src = w[(h * 3 + part) * d:(h * 3 + part + 1) * d]
            np.testing.assert_array_equal(out[part * n_head * d + h * d:part * n_head * d + (h + 1) * d], src)
    bias = np.arange(n_head * 3 * d, dtype=np.float32)
    np.testing.assert_array_equal(neox_qkv(bias, Heads(n_head, n_head)), out[:, 0] // n_embd)


def test_permute_q_pairs_row_i_with_row_i_plus_half_head() -> None:
    n, d = 2, 8
    w = np.arange(n * d, dtype=np.float32)[:, None].repeat(3, 1)
    out = permute_q(w, Heads(n, n))
    for h in range(n):
        for i in range(d // 2):
            for j in range(2):
                assert out[h * d + 2 * i + j, 0] == w[h * d + j * d // 2 + i, 0]


# -- mapping -----------------------------------------------------------------------------------------
def test_unknown_source_tensor_is_a_mapping_error_naming_it(llama: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    d = tmp_path / "m"
    d.mkdir()
    for f in llama.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.0.mlp.mystery_proj.weight"] = np.zeros((4, 4), np.float32)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(TensorMappingError, match=r"model\.layers\.0\.mlp\.mystery_proj\.weight"):
        convert(d, tmp_path / "out.gguf", outtype="f32")
    assert not (tmp_path / "out.gguf").exists()
    del tensors["model.layers.0.mlp.mystery_proj.weight"]
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(TensorMappingError, match=r"missing source tensors for blk\.1\.ffn_up\.weight"):
        convert(d, tmp_path / "out.gguf", outtype="f32")


def test_unknown_class_lists_the_supported_ones(llama: Path, tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    config = json.loads((llama / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match=r"'MambaForCausalLM' is not supported; supported: "
                                                           r"Cohere2ForCausalLM, .*FalconH1ForCausalLM, "
                                                           r"GPTNeoXForCausalLM, Gemma2ForCausalLM, .*LlamaForCausalLM"):
        convert(d, tmp_path / "out.gguf")


# -- checkpoints --------------------------------------------------------------------------------------
def test_bin_checkpoint_converts_to_the_same_tensors_as_safetensors(llama: Path, tmp_path: Path) -> None:
    d = make_checkpoint(tmp_path / "bin", "LlamaForCausalLM", bin=True)
    assert (d / "pytorch_model.bin").exists() and not list(d.glob("*.safetensors"))
    a = convert(llama, tmp_path / "a.gguf", outtype="f32").outputs[0]
    b = convert(d, tmp_path / "b.gguf", outtype="f32").outputs[0]
    with open_gguf(a) as ma, open_gguf(b) as mb:
        assert [t.name for t in ma.tensors] == [t.name for t in mb.tensors]
        for t in ma.tensors:
            assert bytes(ma.raw(t)) == bytes(mb.raw(mb[t.name])), t.name


class _Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.mkdir, (self.marker,))


def test_pickle_that_would_run_code_is_refused(llama: Path, tmp_path: Path) -> None:
    import torch

    d = tmp_path / "evil"
    d.mkdir()
    (d / "config.json").write_text((llama / "config.json").read_text())
    marker = tmp_path / "pwned"
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2), "x": _Exploit(str(marker))},
               d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"refused to load: the pickle needs more than tensors"):
        convert(d, tmp_path / "out.gguf")
    assert not marker.exists()
    assert not (tmp_path / "out.gguf").exists()


def test_truncated_safetensors_header_is_a_checkpoint_error(llama: Path, tmp_path: Path) -> None:
    d = tmp_path / "t"
    d.mkdir()
    (d / "config.json").write_text((llama / "config.json").read_text())
    (d / "model.safetensors").write_bytes((llama / "model.safetensors").read_bytes()[:5000])
    with pytest.raises(CheckpointError, match="outside the file"):
        convert(d, tmp_path / "out.gguf")


# -- plan, naming, splitting ------------------------------------------------------------------------------
def test_dry_run_plans_every_tensor_and_writes_nothing(llama: Path, tmp_path: Path) -> None:
    report = convert(llama, tmp_path / "out.gguf", outtype="f16", dry_run=True)
    assert report.outputs == [] and not list(tmp_path.iterdir())
    d = report.as_dict()
    q = next(t for t in d["tensors"] if t["name"] == "blk.0.attn_q.weight")
    assert q == {"name": "blk.0.attn_q.weight", "source": "model.layers.0.self_attn.q_proj.weight",
                 "shape": [64, 64], "src_dtype": "F32", "type": "F16", "transform": "permute_q", "reason": "outtype"}
    assert d["metadata"]["llama.attention.head_count_kv"] == 2


def test_default_output_name_follows_the_hub_convention(llama: Path, tmp_path: Path) -> None:
    report = convert(llama, tmp_path, outtype="f16")
    assert report.outputs == [tmp_path / f"{llama.name}-115K-F16.gguf"]
    templated = convert(llama, tmp_path / "m-{ftype}.gguf", outtype="bf16")
    assert templated.outputs == [tmp_path / "m-bf16.gguf"]


def test_split_max_size_writes_a_shard_set_readable_as_one_model(llama: Path, tmp_path: Path) -> None:
    report = convert(llama, tmp_path / "m.gguf", outtype="f32", split_max_size=150_000)
    assert len(report.outputs) >= 3 and report.outputs[0].name == f"m-00001-of-{len(report.outputs):05d}.gguf"
    with open_gguf(report.outputs[0]) as m:
        assert len(m) == len(report.plan.entries)


def test_vocab_only_writes_metadata_and_no_tensors(llama: Path, tmp_path: Path) -> None:
    report = convert(llama, tmp_path / "v.gguf", vocab_only=True)
    with open_gguf(report.outputs[0]) as m:
        assert len(m) == 0 and len(m.get("tokenizer.ggml.tokens")) == 320
        assert m.get("llama.block_count") == 2 and "general.size_label" not in m.kv


def test_metadata_file_overrides_general_keys(llama: Path, tmp_path: Path) -> None:
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"general.name": "Tiny Llama", "general.author": "ggufkit tests",
                                "general.tags": ["a", "b"]}))
    report = convert(llama, tmp_path / "m.gguf", outtype="f16", metadata_file=meta)
    with open_gguf(report.outputs[0]) as m:
        assert m.get("general.name") == "Tiny Llama" and m.get("general.basename") == "Tiny-Llama"
        assert m.get("general.author") == "ggufkit tests" and m.get("general.tags") == ["a", "b"]


def test_sharded_safetensors_with_index_convert_like_one_file(llama: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    d = tmp_path / "sharded"
    d.mkdir()
    for f in llama.iterdir():
        if f.name != "model.safetensors":
            (d / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(llama / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(d / shard))
        weight_map.update({n: shard for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    a = convert(llama, tmp_path / "a.gguf", outtype="f16").outputs[0]
    b = convert(d, tmp_path / "b.gguf", outtype="f16")
    with open_gguf(a) as ma, open_gguf(b.outputs[0]) as mb:
        for t in ma.tensors:
            assert bytes(ma.raw(t)) == bytes(mb.raw(mb[t.name])), t.name
        assert mb.get("ggufkit.source.sha256").count("\n") == 1  # one line per shard
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="index names missing or invalid files: model-00002-of-00002"):
        convert(d, tmp_path / "c.gguf")


def test_sharded_bin_checkpoint_with_index_is_read_through_weights_only_loads(llama: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    d = tmp_path / "binshards"
    d.mkdir()
    (d / "config.json").write_text((llama / "config.json").read_text())
    for name in ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        (d / name).write_bytes((llama / name).read_bytes())
    tensors = load_file(str(llama / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[:5], names[5:])):
        shard = f"pytorch_model-{i + 1:05d}-of-00002.bin"
        torch.save({n: tensors[n] for n in part}, d / shard)
        weight_map.update({n: shard for n in part})
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a = convert(llama, tmp_path / "a.gguf", outtype="bf16").outputs[0]
    b = convert(d, tmp_path / "b.gguf", outtype="bf16").outputs[0]
    with open_gguf(a) as ma, open_gguf(b) as mb:
        assert [t.name for t in ma.tensors] == [t.name for t in mb.tensors]
        for t in ma.tensors:
            assert bytes(ma.raw(t)) == bytes(mb.raw(mb[t.name])), t.name


def test_fast_bf16_to_f16_equals_the_float_path_for_every_bit_pattern() -> None:
    from ggufkit.converters.stream import bf16_to_f16

    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    with np.errstate(over="ignore"):
        want = (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float16)
    np.testing.assert_array_equal(bf16_to_f16(bits.reshape(256, 256)).view(np.uint16).ravel(), want.view(np.uint16))


@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0"])
def test_chunked_conversion_gives_the_same_bytes_as_whole_tensors(llama: Path, tmp_path: Path, outtype: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from ggufkit.converters import stream

    whole = convert(llama, tmp_path / "whole.gguf", outtype=outtype).outputs[0]
    monkeypatch.setattr(stream, "CHUNK_ELEMENTS", 200)  # a few rows per chunk, ragged last chunk
    chunked = convert(llama, tmp_path / "chunked.gguf", outtype=outtype).outputs[0]
    assert whole.read_bytes() == chunked.read_bytes()


# -- memory ------------------------------------------------------------------------------------------
def _bf16_memmap(path: Path, shape: tuple[int, int], offset: int = 136) -> tuple[np.memmap, np.ndarray]:
    """A read-only memmap of random bf16 bits at an offset that is not a page boundary (like safetensors)."""
    rng = np.random.default_rng(7)
    bits = (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    path.write_bytes(b"\0" * offset + bits.tobytes())
    return np.memmap(path, dtype=np.uint16, mode="r", offset=offset, shape=shape), bits


def _mapping_rss(path: Path) -> int:
    """Resident bytes of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside, found = 0, False, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            inside = line.endswith(str(path))
            found = found or inside
        elif inside and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    assert found, "the mapping is not listed"
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc/self/smaps")
@pytest.mark.parametrize("outtype", ["q8_0", "f16", "q4_k"])
def test_encoding_a_memmapped_tensor_releases_its_pages_and_keeps_the_bytes(tmp_path: Path, outtype: str) -> None:
    from gguf import GGMLQuantizationType as Q

    from ggufkit.converters.stream import encode, to_float32
    from ggufkit.quant import quantize

    qtype = {"q8_0": Q.Q8_0, "f16": Q.F16, "q4_k": Q.Q4_K}[outtype]
    arr, bits = _bf16_memmap(tmp_path / "w.bin", (1024, 2048))  # 2 chunks of 2^20 elements, 4 MiB mapped
    got = encode(arr, "BF16", qtype)
    # Every page was read; all of them were handed back while the mapping is still open.
    assert _mapping_rss(tmp_path / "w.bin") <= 2 * 4096
    want = quantize(to_float32(bits, "BF16"), qtype).view(got.dtype).reshape(got.shape)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    del arr


def test_quantized_encode_allocates_the_output_and_one_chunk_not_a_float32_copy(tmp_path: Path) -> None:
    import tracemalloc

    from gguf import GGMLQuantizationType as Q

    from ggufkit.converters.stream import CHUNK_ELEMENTS, encode

    arr, _ = _bf16_memmap(tmp_path / "w.bin", (2048, 2048))  # 4M elements: a float32 copy is 16 MiB
    encode(arr[:64], "BF16", Q.Q8_0)  # kernel loaded before measuring
    tracemalloc.start()
    try:
        out = encode(arr, "BF16", Q.Q8_0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Output, plus one chunk widened to 32 bits and quantized: under half of a float32 copy of the tensor (the
    # whole-tensor path peaked at output + 16 MiB).
    assert arr.size >= 4 * CHUNK_ELEMENTS
    assert peak < out.nbytes + 2 * arr.size, peak
    del arr
