"""The architectures of issue 11, each against llama.cpp end to end, on tiny random checkpoints from
transformers' own classes:

1. convert: ggufkit's file vs llama.cpp's converter (convert_hf_to_gguf.py of the vendored 0.3.36 tree) -
   every tensor byte-identical, every key equal both ways (``general.*`` naming and ggufkit's provenance
   keys aside);
2. the file loads in llama.cpp (llama-cpp-python) and its f32 logits match transformers' (top-1 identical,
   max |Δ| < 1e-4 as for the other architectures);
3. ``ggufkit ppl`` equals llama.cpp's perplexity on the same file and tokens within 0.1 %;
4. ``convert --check`` passes, and fails on a conversion of other weights.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixtures_models import TOKENS, llama_cpp_logits, make_checkpoint, transformers_logits
from llama_cpp_sources import llama_cpp_dir

from ggufkit.converters import convert
from ggufkit.eval.convert_check import check_conversion
from ggufkit.eval.perplexity import perplexity
from ggufkit.format import open_gguf

#: (case id, HF class, checkpoint overrides).
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("mistral", "MistralForCausalLM", {}),
    ("mixtral", "MixtralForCausalLM", {}),
    ("qwen2moe", "Qwen2MoeForCausalLM", {}),
    ("qwen3moe", "Qwen3MoeForCausalLM", {}),
    ("gemma2", "Gemma2ForCausalLM", {}),
    ("gemma3", "Gemma3ForCausalLM", {}),
    ("gemma3-multimodal", "Gemma3ForConditionalGeneration", {}),
    # OLMo 2: post-norm blocks, whole-projection q/k norms (tests/test_family_olmo2.py: both config layouts).
    ("olmo2", "Olmo2ForCausalLM", {}),
    # Phi-3's specials after the sentencepiece pieces, the embedding padded beyond them ([PAD{i}] rows).
    ("phi3", "Phi3ForCausalLM", {"extra_vocab": 8}),
    # tokenizer.json only (byte-fallback BPE): llama.cpp's LlamaHfVocab path.
    ("llama-hf-vocab", "LlamaForCausalLM", {"vocab": "llama-hf"}),
    # as transformers 5 saves it (rope_parameters); layer 3 a NoPE layer (tests/test_family_smollm3.py)
    ("smollm3", "SmolLM3ForCausalLM", {}),
    # the released config's spelling (rotary_pct, which llama.cpp's converter needs, sliding_window_pattern):
    # three sliding-window layers with RoPE and a global one without (tests/test_family_cohere2.py)
    ("cohere2", "Cohere2ForCausalLM", {"config_style": "release"}),
]
CTX = 32
#: Keys ggufkit writes and llama.cpp's converter leaves out, each equal to what llama.cpp's loader assumes
#: without it (converters/vocab.py writes sentencepiece's own ids explicitly).
EXTRA_KEYS = {"tokenizer.ggml.unknown_token_id": 0}


def llama_cpp_convert(model: Path, out: Path, outtype: str = "f32") -> Path:
    root = llama_cpp_dir()
    env = {**os.environ, "PYTHONPATH": str(root / "gguf-py")}
    subprocess.run([sys.executable, str(root / "convert_hf_to_gguf.py"), str(model), "--outfile", str(out),
                    "--outtype", outtype], check=True, capture_output=True, env=env)
    return out


#: Phi-3's added tokens (special ones are CONTROL, the others USER_DEFINED in llama.cpp's Phi3 vocab).
PHI3_SPECIALS = [("<|endoftext|>", True), ("<|assistant|>", True), ("<|end|>", True), ("<|user|>", True),
                 ("<|placeholder1|>", False)]


def add_phi3_specials(d: Path) -> None:
    """Phi-3's added tokens at ids 320.. in tokenizer_config.json, as the hub's Phi-3 files list them
    (llama.cpp's loader marks "<|endoftext|>" itself when the model's name says Phi-3)."""
    import json

    config = json.loads((d / "tokenizer_config.json").read_text())
    for i, (text, special) in enumerate(PHI3_SPECIALS, 320):
        config["added_tokens_decoder"][str(i)] = {"content": text, "lstrip": False, "normalized": False,
                                                  "rstrip": special, "single_word": False, "special": special}
    (d / "tokenizer_config.json").write_text(json.dumps(config))


def _compared_key(key: str) -> bool:
    # every general.* key llama.cpp writes (type, sampling, model card) but the naming: ggufkit takes the name
    # from the folder as given (llama.cpp title-cases it and splits it into basename, finetune and version) and
    # labels MoE sizes by total parameters (llama.cpp's gguf.size_label writes 4x...)
    naming = key in ("general.name", "general.basename", "general.finetune", "general.version",
                     "general.size_label")
    return not naming and not key.startswith("ggufkit.")


@pytest.fixture(scope="module", params=[c[0] for c in CASES])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    name, hf_class, overrides = next(c for c in CASES if c[0] == request.param)
    d = make_checkpoint(tmp_path_factory.mktemp(name), hf_class, **overrides)
    if hf_class == "Phi3ForCausalLM":
        add_phi3_specials(d)
    report = convert(d, d.parent / "ours.gguf", outtype="f32")
    return {"name": name, "dir": d, "ours": report.outputs[0], "plan": report.plan}


def test_file_equals_llama_cpp_converters(case: dict[str, Any]) -> None:
    theirs = llama_cpp_convert(case["dir"], case["dir"].parent / "theirs.gguf")
    with open_gguf(theirs) as a, open_gguf(case["ours"]) as b:
        assert [(t.name, t.ggml_type, t.ne) for t in a.tensors] == [(t.name, t.ggml_type, t.ne) for t in b.tensors]
        for t in a.tensors:
            assert bytes(a.raw(t)) == bytes(b.raw(b[t.name])), t.name
        keys_a = [k for k in a.kv if _compared_key(k)]
        keys_b = [k for k in b.kv if _compared_key(k)]
        extra = set(keys_b) - set(keys_a)
        assert set(keys_a) <= set(keys_b) and extra <= set(EXTRA_KEYS), extra
        assert all(b.get(k) == EXTRA_KEYS[k] for k in extra)
        for key in keys_a:
            va, vb = a.get(key), b.get(key)
            assert a.kv[key].type == b.kv[key].type, key
            if isinstance(va, (list, np.ndarray)):
                assert np.array_equal(np.asarray(va), np.asarray(vb)), key
            else:
                assert va == vb, key


#: f32 logit tolerance where llama.cpp's CPU GELU differs from transformers' gelu_pytorch_tanh: ggml
#: evaluates GELU through a float16 lookup table (ggml-cpu vec.h ggml_vec_gelu_f32, GGML_GELU_FP16), as for
#: gptneox in test_convert_models.py. Measured on the 6-layer gemma3 case: llama.cpp vs transformers 9.6e-3;
#: vs ggufkit's evaluator with that f16 table emulated 1.5e-4.
GELU_TOLERANCE = 2e-2


def test_llama_cpp_logits_match_transformers(case: dict[str, Any]) -> None:
    want = transformers_logits(case["dir"])
    got = llama_cpp_logits(case["ours"])
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < (GELU_TOLERANCE if case["name"].startswith("gemma") else 1e-4)


def _llama_cpp_ppl(path: Path, tokens: list[int], ctx: int, bos: int | None) -> tuple[float, int]:
    """llama.cpp (llama-cpp-python) scoring llama-perplexity's chunks (second half; the first token
    overwritten by BOS when the vocabulary adds one)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True, verbose=False,
                n_threads=2, seed=0, type_k=0, type_v=0)
    nll = []
    try:
        for k in range(len(tokens) // ctx):
            window = tokens[k * ctx:(k + 1) * ctx]
            if bos is not None:
                window[0] = bos
            llm.reset()
            llm.eval(window)
            logits = np.asarray(llm.scores[:ctx], dtype=np.float64)
            for j in range(ctx // 2, ctx - 1):
                row = logits[j]
                nll.append(row.max() + np.log(np.exp(row - row.max()).sum()) - row[tokens[k * ctx + j + 1]])
    finally:
        llm.close()
    return float(np.exp(np.mean(nll))), len(nll)


def test_ggufkit_ppl_equals_llama_cpps(case: dict[str, Any]) -> None:
    rng = np.random.default_rng(5)
    tokens = [int(t) for t in rng.choice(np.asarray(TOKENS), size=3 * CTX + 3)]
    ours = perplexity(case["ours"], tokens=tokens, ctx=CTX, device="cpu")
    ppl, n_scored = _llama_cpp_ppl(case["ours"], tokens, CTX, ours.bos_id if ours.add_bos else None)
    assert ours.tokens_scored == n_scored
    assert abs(ours.ppl / ppl - 1) < 1e-3, (ours.ppl, ppl)


def test_check_passes_and_fails_on_other_weights(case: dict[str, Any], tmp_path: Path) -> None:
    hf_class, overrides = next((c[1], c[2]) for c in CASES if c[0] == case["name"])
    ok = check_conversion(case["dir"], case["ours"], case["plan"], device="cpu")
    if case["name"] == "llama-hf-vocab":
        # llama.cpp's LlamaHfVocab scores every piece -1000, so its SPM tokenizer merges in another order
        # than the checkpoint's BPE on some texts (whitespace runs, text around special tokens): the file is
        # llama.cpp's, and --check says where it tokenizes differently; the weights agree.
        assert ok.status == "failed" and ok.failures and all(f.startswith("tokens differ") for f in ok.failures)
        assert ok.top1_agreement == 1.0 and ok.rel_diff < 1e-4
    else:
        assert ok.status == "passed", ok.failures
    other = make_checkpoint(tmp_path / "other", hf_class, seed=7, **overrides)
    if hf_class == "Phi3ForCausalLM":
        add_phi3_specials(other)
    report = convert(other, tmp_path / "other.gguf", outtype="f32")
    bad = check_conversion(case["dir"], report.outputs[0], report.plan, device="cpu")
    assert bad.status == "failed" and any(f.startswith("logits differ by") for f in bad.failures)


MOE_CASES = ("mixtral", "qwen2moe", "qwen3moe")


def _n_dims(ne: tuple[int, ...]) -> tuple[int, ...]:
    """``ne`` without trailing 1s (ggml_n_dims), at least one dimension."""
    while len(ne) > 1 and ne[-1] == 1:
        ne = ne[:-1]
    return ne


@pytest.mark.parametrize("name", MOE_CASES)
def test_moe_f16_and_one_pass_q8_0_with_3d_experts(name: str, tmp_path: Path) -> None:
    """f16: the router stays F32 and the stacked experts are F16, byte for byte as llama.cpp's converter
    writes them; q8_0 in one pass equals quantizing the f32 conversion, 3-D expert tensors included."""
    from ggufkit.quant import quantize_file

    hf_class, overrides = next((c[1], c[2]) for c in CASES if c[0] == name)
    d = make_checkpoint(tmp_path / name, hf_class, **overrides)
    theirs = llama_cpp_convert(d, tmp_path / "theirs.gguf", "f16")
    ours = convert(d, tmp_path / "ours.gguf", outtype="f16").outputs[0]
    with open_gguf(theirs) as a, open_gguf(ours) as b:
        assert [(t.name, t.ggml_type, t.ne) for t in a.tensors] == [(t.name, t.ggml_type, t.ne) for t in b.tensors]
        assert any(len(t.ne) == 3 for t in a.tensors)
        for t in a.tensors:
            assert bytes(a.raw(t)) == bytes(b.raw(b[t.name])), t.name
    f32 = convert(d, tmp_path / "f32.gguf", outtype="f32").outputs[0]
    quantize_file(f32, tmp_path / "requant.gguf", "q8_0")
    direct = convert(d, tmp_path / "direct.gguf", outtype="q8_0").outputs[0]
    with open_gguf(tmp_path / "requant.gguf") as a, open_gguf(direct) as b:
        # the quantizer writes ggml_n_dims dimensions as llama-quantize does (qwen2moe's [1, n_embd]
        # ffn_gate_inp_shexp becomes 1-D); the converter keeps the checkpoint's 2-D shape, as llama.cpp's
        assert [(t.name, t.ggml_type, _n_dims(t.ne)) for t in a.tensors] == [
            (t.name, t.ggml_type, _n_dims(t.ne)) for t in b.tensors]
        assert any(len(t.ne) == 3 and t.ggml_type.name == "Q8_0" for t in b.tensors)
        for t in a.tensors:
            assert bytes(a.raw(t)) == bytes(b.raw(b[t.name])), t.name
    assert np.isfinite(llama_cpp_logits(direct)).all()


@pytest.mark.parametrize(("hf_class", "overrides", "message"), [
    ("Qwen3MoeForCausalLM", {"norm_topk_prob": False},
     "qwen3_moe: norm_topk_prob is false, but llama.cpp's graph always renormalises"),
    ("Qwen2MoeForCausalLM", {"norm_topk_prob": True},
     "qwen2_moe: norm_topk_prob is true, but llama.cpp's graph never renormalises"),
    ("Gemma2ForCausalLM", {"tie_word_embeddings": False},
     "gemma2: llama.cpp would compute another model: an lm_head not tied to the embeddings"),
    ("Gemma2ForCausalLM", {"query_pre_attn_scalar": 256},
     "gemma2: llama.cpp would compute another model: query_pre_attn_scalar 256"),
    ("Gemma3ForCausalLM", {"layer_types": ["full_attention", "sliding_attention"], "num_hidden_layers": 2},
     "gemma3_text: llama.cpp would compute another model: layer_types other than llama.cpp's fixed pattern"),
    ("Phi3ForCausalLM", {"rope_scaling": {"rope_type": "longrope", "long_factor": [1.0] * 8,
                                          "short_factor": [1.0] * 8}, "max_position_embeddings": 256},
     "Phi-3 with longrope scaling"),
])
def test_checkpoints_llama_cpp_would_compute_differently_are_refused(
        hf_class: str, overrides: dict[str, Any], message: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    from ggufkit.cli import cli
    from ggufkit.cli._errors import run_cli

    d = make_checkpoint(tmp_path / "m", hf_class, **{"num_hidden_layers": 1, **overrides})
    capsys.readouterr()
    code = run_cli(cli, ["convert", str(d), "-o", str(tmp_path / "x.gguf")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1
    assert not (tmp_path / "x.gguf").exists()


def test_check_is_skipped_visibly_for_an_arch_the_evaluator_cannot_run(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from ggufkit.eval.arch import ARCH_TRAITS

    d = make_checkpoint(tmp_path / "m", "MistralForCausalLM", num_hidden_layers=1)
    report = convert(d, tmp_path / "m.gguf", outtype="f32")
    monkeypatch.delitem(ARCH_TRAITS, "llama")  # an architecture the table has no row for
    result = check_conversion(d, report.outputs[0], report.plan, device="cpu")
    assert result.status == "skipped" and not result.passed
    assert result.reason is not None and result.reason.startswith(
        "the evaluator cannot run this file: cannot evaluate 'llama': the evaluator has no traits")


@pytest.mark.parametrize("hf_class", ["Gemma2ForCausalLM", "Gemma3ForCausalLM"])
def test_bf16_gemma_norms_add_one_in_float32_as_llama_cpp_does(hf_class: str, tmp_path: Path) -> None:
    """llama.cpp's converter widens bf16 tensors to f32 before Gemma's ``1 + w`` (conversion/base.py
    ``ModelBase.prepare_tensors``): every norm of a bf16 checkpoint equals its file byte for byte."""
    d = make_checkpoint(tmp_path / "m", hf_class, dtype="bfloat16")
    ours = convert(d, tmp_path / "ours.gguf", outtype="bf16").outputs[0]
    theirs = llama_cpp_convert(d, tmp_path / "theirs.gguf", outtype="bf16")
    with open_gguf(theirs) as a, open_gguf(ours) as b:
        norms = [t.name for t in a.tensors if "norm" in t.name]
        assert norms
        assert [(t.name, t.ggml_type) for t in a.tensors] == [(t.name, t.ggml_type) for t in b.tensors]
        for t in a.tensors:
            assert bytes(a.raw(t)) == bytes(b.raw(b[t.name])), t.name
