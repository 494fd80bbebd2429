"""The quantization planner reproduces llama-quantize's per-tensor type choice, order and file type.

Oracle: ``llama_cpp.llama_model_quantize`` (llama-cpp-python 0.3.36) on tiny llama GGUF files built here;
its output's tensor names, order and types are compared with the plan. Name-only tables cover what a tiny
file cannot reach cheaply (Falcon, 70B, rules quoted from src/llama-quant.cpp).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fixtures_quantize import (
    arch_case,
    imatrix_values,
    llama_quantize,
    llama_tensor_shapes,
    make_gguf,
    make_llama_gguf,
)
from gguf import GGMLQuantizationType as QT
from gguf import LlamaFileType

from ggufkit.cli.quantize import TYPE_CHOICES as CLI_TYPE_CHOICES
from ggufkit.errors import MetadataKeyNotFoundError, QuantizationError, UsageError
from ggufkit.format import TensorSpec, open_gguf
from ggufkit.quant.llama_quantize.options import parse_tensor_type_option
from ggufkit.quant.llama_quantize.plan import QuantOptions, llama_order_key, plan_quantization
from ggufkit.quant.llama_quantize.presets import TYPE_CHOICES, get_preset

ALL_PRESETS = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k", "f16",
               "bf16", "f32"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("plan_models")
    return {
        "untied": make_llama_gguf(d / "untied.gguf", n_embd=256, n_ff=256, n_layer=8, n_vocab=256),
        "tied": make_llama_gguf(d / "tied.gguf", n_embd=256, n_ff=256, n_layer=8, n_vocab=256, tied=True),
        # rows of 288 (q/k/v/o/gate/up, embeddings) and 600 (ffn_down): K-quants must fall back, 600 even to F16
        "odd_rows": make_llama_gguf(d / "odd.gguf", n_embd=288, n_ff=600, n_layer=8, n_head=4, n_vocab=256,
                                    tied=True, dtype=QT.F32),
    }


def _plan(path: Path, target: str, options: QuantOptions | None = None):
    with open_gguf(path) as m:
        return plan_quantization(m.tensors, target, arch=m.architecture or "", metadata=m.kv, options=options)


def _oracle_types(src: Path, out: Path, target: str, **kw) -> tuple[list[tuple[str, QT]], int]:
    llama_quantize(src, out, target, **kw)
    with open_gguf(out) as m:
        return [(t.name, t.ggml_type) for t in m.tensors], int(m.get("general.file_type"))


@pytest.mark.parametrize("model", ["untied", "tied", "odd_rows"])
@pytest.mark.parametrize("target", ALL_PRESETS)
def test_plan_matches_llama_model_quantize(models, tmp_path, model, target):
    plan = _plan(models[model], target)
    expected, file_type = _oracle_types(models[model], tmp_path / "q.gguf", target)
    assert [(e.name, e.dst_type) for e in plan.entries] == expected
    assert int(plan.file_type) == file_type


OPTION_CASES = {
    "pure": (dict(pure=True), dict(pure=True)),
    "leave_output": (dict(leave_output_tensor=True), dict(leave_output_tensor=True)),
    "output_q8_0": (dict(output_tensor_type=QT.Q8_0), dict(output_tensor_type=QT.Q8_0)),
    "token_embd_q6_k": (dict(token_embedding_type=QT.Q6_K), dict(token_embedding_type=QT.Q6_K)),
    "tensor_type": (dict(tensor_types=(("attn_v", QT.Q8_0), ("blk\\.1\\.", QT.Q5_1))),
                    dict(tensor_types=(("attn_v", QT.Q8_0), ("blk\\.1\\.", QT.Q5_1)))),
}


@pytest.mark.parametrize("target", ["q4_k_m", "q4_0"])
@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_options_match_llama_model_quantize(models, tmp_path, target, case):
    ours, theirs = OPTION_CASES[case]
    plan = _plan(models["untied"], target, QuantOptions(**ours))
    expected, _ = _oracle_types(models["untied"], tmp_path / "q.gguf", target, **theirs)
    assert [(e.name, e.dst_type) for e in plan.entries] == expected


@pytest.mark.parametrize("target", ["q4_0", "q5_0", "q4_k_m"])
def test_imatrix_changes_plan_as_llama_model_quantize(models, tmp_path, target):
    path = models["untied"]
    values = {k: (s / c[:, None]).reshape(-1) for k, (s, c) in imatrix_values(path).items()}
    plan = _plan(path, target, QuantOptions(imatrix_sizes={k: v.size for k, v in values.items()}))
    expected, _ = _oracle_types(path, tmp_path / "q.gguf", target, imatrix=values)
    assert [(e.name, e.dst_type) for e in plan.entries] == expected
    if target == "q4_0":  # the guard for the first n_layer/8 ffn_down layers
        assert plan.entries[[e.name for e in plan.entries].index("blk.0.ffn_down.weight")].dst_type == QT.Q4_1


def test_fallback_entries_are_flagged_with_reason_and_share(models):
    plan = _plan(models["odd_rows"], "q4_k_m")
    by_name = {e.name: e for e in plan.entries}
    q = by_name["blk.0.attn_q.weight"]
    assert q.fallback and q.dst_type == QT.Q5_0
    assert q.reason == "row length 288 not a multiple of 256 (q4_k) -> q5_0 (fallback)"
    down = by_name["blk.0.ffn_down.weight"]  # use_more_bits layer: Q6_K -> Q8_0 -> 600 % 32 != 0 -> F16
    assert down.fallback and down.dst_type == QT.F16 and "f16" in down.reason
    tied = by_name["token_embd.weight"]  # output-like and 288 % 256 != 0: a preset rule, not a fallback
    assert tied.dst_type == QT.Q8_0 and not tied.fallback
    assert "not a multiple of 256 -> q8_0" in tied.reason
    assert by_name["blk.0.attn_norm.weight"].reason == "1-D tensor: kept as is"
    n_fb = sum(e.fallback for e in plan.entries)
    assert n_fb == len(plan.fallbacks) == 7 * 8
    weights = sum(e.n_elements for e in plan.fallbacks)
    assert plan.fallback_share == pytest.approx(weights / plan.n_elements)
    assert plan.fallback_summary().startswith(f"fallback: {n_fb} of {len(plan.entries)} tensors")


def test_no_fallback_turns_a_fallback_into_an_error_naming_the_tensor(models):
    with pytest.raises(QuantizationError, match=r"tensor 'blk\.0\.attn_k\.weight': row length 288.*--no-fallback"):
        _plan(models["odd_rows"], "q4_k_m", QuantOptions(no_fallback=True))
    assert not _plan(models["untied"], "q4_k_m", QuantOptions(no_fallback=True)).fallbacks


def test_user_override_reasons(models):
    plan = _plan(models["untied"], "q4_k_m", QuantOptions(tensor_types=(parse_tensor_type_option("ATTN_V=Q8_0"),),
                                                          token_embedding_type=QT.Q8_0))
    by_name = {e.name: e for e in plan.entries}
    assert by_name["blk.3.attn_v.weight"].reason == "user override --tensor-type attn_v=q8_0"
    assert by_name["token_embd.weight"].reason == "user override --token-embedding-type"
    assert by_name["output.weight"].reason == "output -> q6_k"
    assert by_name["blk.0.attn_v.weight"].dst_type == QT.Q8_0


def test_quantized_input_is_refused_without_allow_requantize(tmp_path, models):
    q8 = tmp_path / "q8.gguf"
    llama_quantize(models["untied"], q8, "q8_0")
    with pytest.raises(QuantizationError, match=r"already quantized as Q8_0; pass --allow-requantize"):
        _plan(q8, "q4_0")
    plan = _plan(q8, "q4_0", QuantOptions(allow_requantize=True))
    assert {e.action for e in plan.entries} == {"copy", "requantize"}
    # same type: plain copy, no flag needed
    assert {e.action for e in _plan(q8, "q8_0").entries} == {"copy"}


# --- other architectures: real tensor-name lists as convert_hf_to_gguf writes them -------------------------
@pytest.mark.parametrize("target", ["q4_k_m", "q4_k_s", "q5_k_m", "q4_0"])
@pytest.mark.parametrize("arch", ["gptneox", "qwen2", "mixtral"])
def test_other_architectures_match_llama_model_quantize(tmp_path, arch, target):
    gguf_arch, hp, tensors = arch_case(arch, n_layer=4 if arch == "mixtral" else 8)
    src = make_gguf(tmp_path / "m.gguf", gguf_arch, hp, tensors)
    plan = _plan(src, target)
    expected, file_type = _oracle_types(src, tmp_path / "q.gguf", target)
    assert [(e.name, e.dst_type) for e in plan.entries] == expected
    assert int(plan.file_type) == file_type


# --- name-only tables -----------------------------------------------------------------------------------
def _specs(n_layer: int, *, tied: bool = False, n_embd: int = 4096, n_ff: int = 11008, kv_dim: int = 1024,
           n_vocab: int = 32000) -> list[TensorSpec]:
    return [TensorSpec(n, QT.F16 if len(s) > 1 else QT.F32, s)
            for n, s in llama_tensor_shapes(n_embd, n_ff, n_layer, n_vocab, kv_dim, tied)]


def _counts(plan) -> dict[str, int]:
    return plan.type_counts()


def test_16_layer_llama_mixtures_match_the_verified_table():
    # reference/quant.md §7.4: counts measured with llama_model_quantize on a 16-layer model.
    meta = {"llama.block_count": 16, "llama.attention.head_count": 32, "llama.attention.head_count_kv": 8}
    specs = _specs(16, n_ff=11264)
    km = plan_quantization(specs, "q4_k_m", arch="llama", metadata=meta)
    assert _counts(km)["Q6_K"] == 17 and _counts(km)["Q4_K"] == 97
    ks = plan_quantization(specs, "q4_k_s", arch="llama", metadata=meta)
    q5 = sorted(e.name for e in ks.entries if e.dst_type == QT.Q5_K)
    assert q5 == sorted([f"blk.{i}.attn_v.weight" for i in range(4)] + ["blk.0.ffn_down.weight",
                                                                          "blk.1.ffn_down.weight"])
    q40 = plan_quantization(specs, "q4_0", arch="llama", metadata=meta,
                            options=QuantOptions(imatrix_sizes={"x": 1}))
    assert sorted(e.name for e in q40.entries if e.dst_type == QT.Q4_1) == ["blk.0.ffn_down.weight",
                                                                          "blk.1.ffn_down.weight"]


def test_70b_llama_upgrades_q4_k_attn_v_to_q5_k_but_65b_does_not():
    specs = _specs(80, kv_dim=1024, n_ff=28672, n_embd=8192)
    gqa = {"llama.block_count": 80, "llama.attention.head_count": 64, "llama.attention.head_count_kv": 8}
    mha = {**gqa, "llama.attention.head_count_kv": 64}
    q = plan_quantization(specs, "q4_k_s", arch="llama", metadata=gqa)
    v = [e for e in q.entries if e.name.endswith("attn_v.weight")]
    assert all(e.dst_type == QT.Q5_K for e in v) and "70B" in v[10].reason
    q65 = plan_quantization(specs, "q4_k_s", arch="llama", metadata=mha)
    assert {e.dst_type for e in q65.entries if e.name.endswith("attn_v.weight") and "blk.10." in e.name} == {QT.Q4_K}


def test_falcon_uses_q8_0_output_and_its_own_ffn_down_mix():
    specs = [TensorSpec("output.weight", QT.F16, (65024, 4544)), TensorSpec("token_embd.weight", QT.F16, (65024, 4544))]
    specs += [TensorSpec(f"blk.{i}.ffn_down.weight", QT.F16, (4544, 18176)) for i in range(32)]
    plan = plan_quantization(specs, "q4_k_m", arch="falcon", metadata={"falcon.block_count": 32})
    types = {e.name: e.dst_type for e in plan.entries}
    assert types["output.weight"] == QT.Q8_0
    assert [types[f"blk.{i}.ffn_down.weight"] for i in (0, 1, 2, 3, 5, 6, 31)] == [
        QT.Q6_K, QT.Q6_K, QT.Q5_K, QT.Q5_K, QT.Q4_K, QT.Q5_K, QT.Q5_K]


def test_eight_expert_model_bumps_attention_and_reads_layers_from_names():
    specs = [TensorSpec(f"blk.{i}.{n}", QT.F16, s) for i in (1, 0) for n, s in (
        ("attn_v.weight", (1024, 4096)), ("attn_k.weight", (1024, 4096)), ("attn_output.weight", (4096, 4096)),
        ("ffn_down_exps.weight", (8, 4096, 14336)))]
    plan = plan_quantization(specs, "q4_k_m", arch="llama", metadata={"llama.block_count": 2, "llama.expert_count": 8})
    types = {e.name: e.dst_type for e in plan.entries}
    assert types["blk.0.attn_v.weight"] == types["blk.1.attn_k.weight"] == QT.Q8_0
    assert types["blk.0.attn_output.weight"] == QT.Q5_K
    # layer from the name, not the counter: blk.1 comes second in the order but is layer 1 either way;
    # use_more_bits(i, 2) holds for i >= 7*2/8 = 1 only
    assert types["blk.0.ffn_down_exps.weight"] == QT.Q4_K and types["blk.1.ffn_down_exps.weight"] == QT.Q6_K
    bad = [TensorSpec("ffn_down_exps.weight", QT.F16, (8, 256, 256))]
    with pytest.raises(QuantizationError, match="cannot determine the layer"):
        plan_quantization(bad, "q4_k_m", arch="llama", metadata={"llama.block_count": 2, "llama.expert_count": 8})


def test_order_is_layer_then_bytes():
    names = ["blk.10.attn_q.weight", "token_embd.weight", "blk.2.ffn_up.weight", "blk.2.attn_k.weight",
             "output.weight", "output_norm.weight", "blk.0.x"]
    assert sorted(names, key=llama_order_key) == [
        "output.weight", "output_norm.weight", "token_embd.weight", "blk.0.x", "blk.2.attn_k.weight",
        "blk.2.ffn_up.weight", "blk.10.attn_q.weight"]


def test_names_and_types_are_checked():
    assert get_preset("Q4_K").name == "q4_k_m" and get_preset("q5_k").file_type == LlamaFileType.MOSTLY_Q5_K_M
    assert get_preset("Q3_K").name == "q3_k_m" and get_preset("15").name == "q4_k_m"
    assert get_preset("0").name == "f32" and get_preset("copy").only_copy
    with pytest.raises(UsageError, match="unknown quantization type 'q3_k_xl'"):
        get_preset("q3_k_xl")
    with pytest.raises(UsageError, match="unknown quantization type '99'"):
        get_preset("99")
    with pytest.raises(UsageError, match="malformed --tensor-type"):
        parse_tensor_type_option("attn_v")
    assert parse_tensor_type_option("attn_v=IQ2_XS") == ("attn_v", QT.IQ2_XS)
    with pytest.raises(UsageError, match="invalid --tensor-type type 'q8_k'"):
        parse_tensor_type_option("attn_v=q8_k")
    with pytest.raises(UsageError, match="bad regular expression"):
        parse_tensor_type_option("attn_v(=q8_0")
    assert CLI_TYPE_CHOICES == TYPE_CHOICES


def test_mixture_rules_need_the_block_count():
    specs = [TensorSpec("blk.0.ffn_down.weight", QT.F16, (256, 256))]
    with pytest.raises(MetadataKeyNotFoundError, match=r"llama\.block_count"):
        plan_quantization(specs, "q4_k_m", arch="llama", metadata={})
    assert plan_quantization(specs, "q4_k_m", arch="llama", metadata={},
                             options=QuantOptions(pure=True)).entries[0].dst_type == QT.Q4_K


def test_plan_json_has_stable_keys(models):
    d = _plan(models["untied"], "q4_k_m").to_dict()
    assert set(d) == {"target", "file_type", "file_type_name", "default_type", "tensors", "totals", "block_count",
                      "imatrix_required", "missing_kernels", "cpu_only_types"}
    assert set(d["tensors"][0]) == {"name", "shape", "src_type", "dst_type", "action", "reason", "bytes",
                                    "src_bytes", "bits_per_weight", "fallback", "imatrix", "requires_imatrix"}
    assert d["totals"]["bytes"] == sum(t["bytes"] for t in d["tensors"])
    assert np.isclose(d["totals"]["bits_per_weight"], d["totals"]["bytes"] * 8 / d["totals"]["parameters"], atol=1e-4)
