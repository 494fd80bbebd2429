"""One runner over registry.yaml: every HF class is built with transformers' real model class (tiny, random,
seeded), converted, loaded in its target runtime and compared with transformers' logits.

Runtimes: llama.cpp (llama-cpp-python) for llama/qwen2/qwen3/qwen/gptneox; OPT (PowerInfer layout, which
llama.cpp cannot load) is covered structurally in test_convert_powerinfer.py.

Tolerances (max |logit difference|, logits of magnitude ~5): f32 1e-4 (gptneox 5e-3: llama.cpp's GELU is
the tanh approximation, transformers' the exact erf), f16 3e-2, bf16 0.2, q8_0 0.5. Top-1 must agree at
every position for f32 and f16; for bf16 and q8_0 (ggml rounds the activations too) the runtime's top-1 must score within the tolerance of
the reference's best. q4_k files must load and their logits correlate with the reference (> 0.95).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fixtures_models import llama_cpp_logits, make_checkpoint, transformers_logits

from ggufkit.converters import convert
from ggufkit.converters.registry import load_registry
from ggufkit.format import open_gguf

TOLERANCE = {"f32": 1e-4, "f16": 3e-2, "bf16": 0.2, "q8_0": 0.5}

#: (case id, HF class, checkpoint overrides, outtypes) - at least one case per registry entry.
CASES = [
    ("llama-spm-untied", "LlamaForCausalLM", {}, ("f32", "f16", "bf16", "q8_0", "q4_k")),
    ("llama-bpe-tied-bf16-linear-rope", "LlamaForCausalLM",
     {"vocab": "llama-bpe", "tie_word_embeddings": True, "dtype": "bfloat16",
      "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, ("auto",)),
    # llama3 rope: no scaling keys, a rope_freqs tensor instead (reference/convert.md §2.4).
    ("llama-llama3-rope", "LlamaForCausalLM",
     {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 32}}, ("f32",)),
    ("qwen2", "Qwen2ForCausalLM", {}, ("f32", "f16", "q4_k")),
    ("qwen3", "Qwen3ForCausalLM", {}, ("f32", "q8_0")),
    ("qwen1", "QWenLMHeadModel", {}, ("f32", "q4_k")),
    ("gptneox-v5-config", "GPTNeoXForCausalLM", {}, ("f32", "q8_0")),
    ("gptneox-v4-config-serial-residual", "GPTNeoXForCausalLM",
     {"config_style": "v4", "use_parallel_residual": False}, ("f32",)),
]
LLAMA_CPP_ARCHS = {"llama", "qwen2", "qwen3", "qwen", "gptneox"}


def test_runner_has_a_case_for_every_registry_entry() -> None:
    from test_convert_archs import CASES as ARCH_CASES
    from test_convert_mmproj import CLASSES as VISION_CLASSES
    from test_convert_mmproj_qwen import QWEN_CLASSES

    # OPT: test_convert_powerinfer.py; issue 11's architectures: test_convert_archs.py; the vision-language
    # classes (text halves and projectors): test_convert_mmproj.py, test_convert_mmproj_qwen.py.
    covered = {c[1] for c in CASES} | {"OPTForCausalLM"} | {c[1] for c in ARCH_CASES} | set(VISION_CLASSES)
    covered |= set(QWEN_CLASSES)
    # issue 33's hybrid families: each class in its own file, which converts it against llama.cpp's converter
    for hf_class, name in _FAMILY_FILES.items():
        assert hf_class in (Path(__file__).parent / name).read_text(), (hf_class, name)
    covered |= set(_FAMILY_FILES)
    assert covered == set(load_registry().entries)


_FAMILY_FILES = {"GraniteMoeHybridForCausalLM": "test_family_granite4.py",
                 "NemotronHForCausalLM": "test_family_nemotron_h.py", "FalconH1ForCausalLM": "test_family_falcon_h1.py",
                 "Qwen3_5ForCausalLM": "test_family_qwen35.py", "Qwen3NextForCausalLM": "test_family_qwen3next.py",
                 "Qwen3_5MoeForCausalLM": "test_family_qwen35moe.py",
                 "Qwen3_5ForConditionalGeneration": "test_convert_mmproj_qwen35.py",
                 "Qwen3_5MoeForConditionalGeneration": "test_convert_mmproj_qwen35.py",
                 "Lfm2ForCausalLM": "test_family_lfm2.py", "Lfm2MoeForCausalLM": "test_family_lfm2moe.py",
                 "Gemma3nForCausalLM": "test_family_gemma3n.py",
                 "Gemma3nForConditionalGeneration": "test_family_gemma3n_vlm.py",
                 "Llama4ForCausalLM": "test_family_llama4.py", "Llama4ForConditionalGeneration": "test_family_llama4.py",
                 "Glm4MoeForCausalLM": "test_family_glm4moe.py",
                 "Ernie4_5ForCausalLM": "test_family_ernie.py", "Ernie4_5_ForCausalLM": "test_family_ernie.py",
                 "Ernie4_5_MoeForCausalLM": "test_family_ernie.py",
                 "DeepseekV2ForCausalLM": "test_family_deepseek2.py", "DeepseekV3ForCausalLM": "test_family_deepseek2.py",
                 "Glm4MoeLiteForCausalLM": "test_family_glm4moelite.py", "GptOssForCausalLM": "test_family_gpt_oss.py"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, np.ndarray]]:
    """Each case's checkpoint and its transformers logits, built once."""
    out = {}
    for case, hf_class, overrides, _ in CASES:
        d = make_checkpoint(tmp_path_factory.mktemp(case), hf_class, **overrides)
        out[case] = (d, transformers_logits(d))
    return out


@pytest.mark.parametrize(("case", "outtype"), [(c[0], t) for c in CASES for t in c[3]])
def test_converted_model_gives_transformers_logits_in_llama_cpp(case: str, outtype: str, checkpoints: dict,
                                                               tmp_path: Path) -> None:
    d, want = checkpoints[case]
    report = convert(d, tmp_path / "model.gguf", outtype=outtype)
    assert report.plan.arch in LLAMA_CPP_ARCHS
    got = llama_cpp_logits(report.outputs[0])
    resolved = report.plan.outtype
    if resolved == "q4_k_m":
        # 4-bit weights of a tiny random model move logits a lot; the file must still load and track the
        # reference closely overall (its bytes equal `ggufkit quantize`'s, tested below).
        assert np.isfinite(got).all() and np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.95
        return
    tol = TOLERANCE[resolved] * (50 if report.plan.arch == "gptneox" and resolved == "f32" else 1)
    assert np.abs(got - want).max() < tol
    if resolved in ("f32", "f16"):
        assert (got.argmax(-1) == want.argmax(-1)).all()
    else:
        # bf16 and q8_0 also round activations (ggml's matmul converts them to the weight's type); where the reference's top two are closer than that noise, the
        # runtime's choice must still be one the reference scores within the tolerance of its best.
        chosen = want[np.arange(len(want)), got.argmax(-1)]
        assert (chosen >= want.max(-1) - tol).all()


def test_bf16_checkpoint_converts_to_bf16_without_a_float32_round_trip(checkpoints: dict, tmp_path: Path) -> None:
    from safetensors import safe_open

    d, _ = checkpoints["llama-bpe-tied-bf16-linear-rope"]
    report = convert(d, tmp_path / "m.gguf")
    assert report.plan.outtype == "bf16" and report.plan.file_type == 32
    with open_gguf(report.outputs[0]) as m, safe_open(d / "model.safetensors", "pt") as st:
        emb = st.get_tensor("model.embed_tokens.weight")
        import torch

        bits = emb.view(torch.int16).numpy().view(np.uint16)
        np.testing.assert_array_equal(m.data(m["token_embd.weight"]), bits)
        assert "output.weight" not in {t.name for t in m.tensors}  # tied: llama falls back to token_embd
        assert m.get("llama.rope.scaling.type") == "linear" and m.get("llama.rope.scaling.factor") == 2.0


@pytest.mark.parametrize("target", ["q8_0", "q4_0", "q4_1", "q4_k_m"])
def test_quantized_outtype_equals_quantizing_the_f32_conversion(target: str, checkpoints: dict,
                                                                tmp_path: Path) -> None:
    from ggufkit.quant import quantize_file

    d, _ = checkpoints["llama-spm-untied"]
    f32 = convert(d, tmp_path / "f32.gguf", outtype="f32").outputs[0]
    quantize_file(f32, tmp_path / "requant.gguf", target)
    direct = convert(d, tmp_path / "direct.gguf", outtype=target).outputs[0]
    with open_gguf(tmp_path / "requant.gguf") as a, open_gguf(direct) as b:
        assert [(t.name, t.ggml_type, t.ne) for t in a.tensors] == [(t.name, t.ggml_type, t.ne) for t in b.tensors]
        for t in a.tensors:
            assert bytes(a.raw(t)) == bytes(b.raw(b[t.name])), t.name
        assert a.get("general.file_type") == b.get("general.file_type")
    assert np.isfinite(llama_cpp_logits(direct)).all()


def test_llama_metadata_has_every_key_llama_cpp_writes_plus_provenance(checkpoints: dict, tmp_path: Path) -> None:
    import hashlib

    d, _ = checkpoints["llama-spm-untied"]
    path = convert(d, tmp_path / "m.gguf", outtype="f16").outputs[0]
    # reference/convert.md §1.1, the verified key list of llama.cpp's converter for this config.
    expected = ["general.architecture", "general.type", "general.name", "general.size_label", "llama.block_count",
                "llama.context_length", "llama.embedding_length", "llama.feed_forward_length",
                "llama.attention.head_count", "llama.attention.head_count_kv", "llama.rope.freq_base",
                "llama.attention.layer_norm_rms_epsilon", "llama.attention.key_length",
                "llama.attention.value_length", "general.file_type", "llama.vocab_size",
                "llama.rope.dimension_count", "general.quantization_version", "tokenizer.ggml.model",
                "tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"]
    with open_gguf(path) as m:
        assert not [k for k in expected if k not in m.kv]
        assert next(iter(m.kv)) == "general.architecture"
        assert m.get("llama.rope.dimension_count") == 16 and m.get("general.file_type") == 1
        digest = hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()
        assert m.get("ggufkit.source.sha256") == f"{digest}  model.safetensors"
        assert m.get("ggufkit.version")
        # Norms and 1-D tensors stay F32, matrices take the outtype.
        assert m["blk.0.attn_norm.weight"].type_name == "F32" and m["blk.0.attn_q.weight"].type_name == "F16"


#: Keys llama.cpp's converter writes per architecture (reference/convert.md §1.2-§1.5), plus our additions.
ARCH_KEYS = {
    "qwen2": ["block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
              "attention.head_count_kv", "rope.freq_base", "attention.layer_norm_rms_epsilon"],
    "qwen3": ["block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
              "attention.head_count_kv", "rope.freq_base", "attention.layer_norm_rms_epsilon",
              "attention.key_length", "attention.value_length"],
    # + layer_norm_rms_epsilon, which llama.cpp's converter omits and its loader requires.
    "qwen": ["block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
             "rope.freq_base", "attention.layer_norm_epsilon", "attention.layer_norm_rms_epsilon"],
    "gptneox": ["context_length", "embedding_length", "block_count", "feed_forward_length", "rope.dimension_count",
                "attention.head_count", "use_parallel_residual", "attention.layer_norm_epsilon"],
}


@pytest.mark.parametrize("case", ["qwen2", "qwen3", "qwen1", "gptneox-v5-config", "gptneox-v4-config-serial-residual"])
def test_every_key_llama_cpp_writes_is_written(case: str, checkpoints: dict) -> None:
    d, _ = checkpoints[case]
    plan = convert(d, None, outtype="f16", dry_run=True).plan
    keys = [k for k in plan.metadata if k.startswith(f"{plan.arch}.")]
    assert [f"{plan.arch}.{k}" for k in ARCH_KEYS[plan.arch]] == [k for k in keys if k.split(".", 1)[1] in
                                                                  ARCH_KEYS[plan.arch]]
    assert plan.metadata["general.file_type"].value == 1
    if plan.arch == "gptneox":
        # 0.25 x head size 16, from rotary_pct (transformers 4) or partial_rotary_factor (transformers 5).
        assert plan.metadata["gptneox.rope.dimension_count"].value == 4
        parallel = plan.metadata["gptneox.use_parallel_residual"].value
        assert parallel is (case == "gptneox-v5-config")
