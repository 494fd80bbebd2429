"""Granite 4 (IBM Granite 4.0 H: transformers' ``GraniteMoeHybridForCausalLM``, GGUF ``granitehybrid``) end to
end (issue 33).

Tiny random checkpoints of transformers' own class (every parameter random and non-zero: A_log, D, dt_bias,
norms, conv biases), with Mamba2 and attention layers, two SSM groups and Granite's four multipliers, in two
variants: MoE (4 experts, top-2, a shared MLP; tied head, as released) and dense (no experts: Granite 4 Micro;
an untied head), each saved by transformers 5 and rewritten into the released config.json's spelling.

* Config spellings. The released configs write ``layer_types`` as ``"mamba"`` / ``"attention"``, transformers 5
  saves ``"linear_attention"`` / ``"full_attention"``; llama.cpp's converter takes a layer for attention only
  when it reads ``"attention"``, so from a transformers-5 save it silently writes every layer as Mamba2.
  ggufkit converts both spellings to the file llama.cpp's converter writes from the release spelling.
* The file against llama.cpp's converter (every tensor's bytes, every key), llama.cpp's logits against
  transformers', the evaluator's logits against llama.cpp's (several scan chunks), ``ppl`` against
  llama-perplexity (F32, F16), KLD, ``imatrix`` (tests/test_eval_imatrix_archs.py LLAMA_CASES), ``--check``,
  llama-quantize's plan for every preset and whole files, ``release``.
* Where the two disagree: a dense transformers-5 save keeps ``num_experts_per_tok`` 2, which llama.cpp's converter
  writes as ``expert_used_count`` 2 next to ``expert_count`` 0, a file llama.cpp's loader aborts on
  (GGML_ASSERT n_expert_used <= n_expert); ggufkit writes 0, as the released Granite 4 Micro config says.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fixtures_models import _write_tokenizer, llama_cpp_logits, randomize, transformers_logits
from llama_cpp_sources import tool_path
from test_convert_archs import EXTRA_KEYS, _compared_key, llama_cpp_convert
from test_eval_archs_vs_llama_perplexity import F32_PATH, llama_perplexity

from ggufkit.converters import convert
from ggufkit.format import open_gguf

HF_CLASS = "GraniteMoeHybridForCausalLM"
CTX = 192  # two chunks of the scan (eval/layers_mamba2.py SCAN_CHUNK, 128 tokens) per sequence
CHUNKS = 3
#: 50257 GPT-2 tokens (llama.cpp's check hash "gpt-2"), the embedding padded to a multiple of 8 (llama.cpp's
#: converter pads the token list of a hybrid model to 8).
N_VOCAB = 50264

#: The MoE variant (Granite 4.0 H Tiny / Small's layout, scaled down).
MOE: dict[str, Any] = dict(
    vocab_size=N_VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True,
    embedding_multiplier=2.5, logits_scaling=1.7, residual_multiplier=0.6, attention_multiplier=0.09,
    num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48,
    layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16,
    mamba_d_head=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, position_embedding_type="nope",
    bos_token_id=50256, eos_token_id=50256, pad_token_id=50256)
#: The dense variant (Granite 4.0 H Micro: no experts, the shared MLP as the FFN), untied head.
DENSE: dict[str, Any] = {**MOE, "num_local_experts": 0, "num_experts_per_tok": 0, "intermediate_size": 48,
                         "tie_word_embeddings": False, "layer_types": ["attention", "mamba", "mamba", "attention"]}
VARIANTS = {"moe": MOE, "dense": DENSE}


def make_granite(d: Path, variant: str = "moe", layout: str = "v5", seed: int = 0, bf16: bool = False,
                 **overrides: Any) -> Path:
    """A tiny random Granite 4 checkpoint in ``d``: transformers 5's save (``layout="v5"``), or that save's
    config.json rewritten as the released configs spell it (``"release"``); float32, or bf16 as released."""
    import torch
    import transformers

    d.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(d, "real:gpt-2")
    config = transformers.GraniteMoeHybridConfig(**{**VARIANTS[variant], **overrides})
    config.architectures = [HF_CLASS]
    model = transformers.GraniteMoeHybridForCausalLM(config)
    randomize(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    if bf16:
        model = model.to(torch.bfloat16)
    model.save_pretrained(d)
    if layout == "release":
        to_release_config(d / "config.json")
    return d


def to_release_config(path: Path) -> None:
    """The released spelling (ibm-granite/granite-4.0-h-tiny's config.json): ``layer_types`` of ``"mamba"`` /
    ``"attention"``, ``rope_theta`` and ``rope_scaling`` at the root, keys transformers does not read, no
    ``time_step_limit``."""
    config = json.loads(path.read_text())
    params = config.pop("rope_parameters", None) or {}
    config.pop("time_step_limit", None)
    config["layer_types"] = ["attention" if t == "full_attention" else "mamba" for t in config["layer_types"]]
    config.update(rope_theta=int(params.get("rope_theta", 10000)), rope_scaling=None, init_method="mup",
                  normalization_function="rmsnorm", torch_dtype=config.pop("dtype", "bfloat16"),
                  transformers_version="4.56.0")
    path.write_text(json.dumps(config, indent=2))


def converted_by_llama_cpp(d: Path, variant: str = "moe") -> Path:
    """A tiny Granite 4 in the release spelling as llama.cpp's converter writes it (F32)."""
    return llama_cpp_convert(make_granite(d / "ckpt", variant, "release"), d / "f32.gguf")


def converted_by_ggufkit(d: Path, variant: str = "moe") -> Path:
    """A tiny Granite 4 saved by transformers 5, converted by ggufkit (F32)."""
    return Path(convert(make_granite(d / "ckpt", variant), d / "f32.gguf", outtype="f32").outputs[0])


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("granite4")
    return {f"{v}-{layout}": make_granite(d / f"{v}-{layout}", v, layout) for v in VARIANTS
            for layout in ("v5", "release")}


@pytest.fixture(scope="module")
def files(layouts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """llama.cpp's converter's files of the release layouts (``theirs-<variant>-<type>``) and ggufkit's of both
    layouts (``<variant>-<layout>-<type>``)."""
    d = tmp_path_factory.mktemp("granite4-files")
    out = {}
    for v in VARIANTS:
        for t in ("f32", "f16"):
            out[f"theirs-{v}-{t}"] = llama_cpp_convert(layouts[f"{v}-release"], d / f"theirs-{v}-{t}.gguf", t)
    for name, t in (("moe-v5", "f32"), ("moe-release", "f32"), ("dense-v5", "f32"), ("dense-release", "f32"),
                    ("moe-v5", "f16"), ("dense-v5", "f16"), ("moe-v5", "q8_0")):
        out[f"{name}-{t}"] = Path(convert(layouts[name], d / f"{name}-{t}.gguf", outtype=t).outputs[0])
    return out


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    from ggufkit.eval.perplexity import sample_text

    text = sample_text()[:8000]
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(text + "\n", encoding="utf-8")
    return text, path


def assert_same_file(theirs: Path, ours: Path) -> None:
    """Every tensor byte-identical (same order, types, shapes), every key of llama.cpp's file equal in ggufkit's
    (naming aside)."""
    with open_gguf(theirs) as a, open_gguf(ours) as b:
        assert [(t.name, t.ggml_type, t.ne) for t in a.tensors] == [(t.name, t.ggml_type, t.ne) for t in b.tensors]
        for t in a.tensors:
            assert bytes(a.raw(t)) == bytes(b.raw(b[t.name])), t.name
        keys = [k for k in a.kv if _compared_key(k)]
        extra = {k for k in b.kv if _compared_key(k)} - set(keys)
        assert extra <= set(EXTRA_KEYS), extra
        for key in keys:
            va, vb = a.get(key), b.get(key)
            assert a.kv[key].type == b.kv[key].type, key
            assert (np.array_equal(np.asarray(va), np.asarray(vb)) if isinstance(va, (list, np.ndarray))
                    else va == vb), key


# -- conversion ----------------------------------------------------------------------------------------------
def test_layouts_spell_the_schedule_as_released_and_as_transformers5(layouts: dict[str, Path]) -> None:
    release = json.loads((layouts["moe-release"] / "config.json").read_text())
    v5 = json.loads((layouts["moe-v5"] / "config.json").read_text())
    assert release["layer_types"] == ["mamba", "attention", "mamba", "mamba"] and release["rope_theta"] == 10000
    assert v5["layer_types"] == ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
    assert "rope_theta" not in v5 and v5["rope_parameters"]["rope_theta"] == 10000


def test_llama_cpps_converter_makes_every_layer_mamba2_from_a_transformers5_save(layouts: dict[str, Path],
                                                                               tmp_path: Path) -> None:
    """What ggufkit avoids: llama.cpp's converter (GraniteHybridModel.get_attn_layers) counts only
    ``"attention"`` entries, so the transformers-5 spelling gives no attention layer at all."""
    theirs = llama_cpp_convert(layouts["moe-v5"], tmp_path / "v5-theirs.gguf")
    with open_gguf(theirs) as f:
        assert list(f.get("granitehybrid.attention.head_count_kv")) == [0, 0, 0, 0]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("layout", ["v5", "release"])
def test_both_spellings_convert_to_llama_cpps_file_of_the_release_config(files: dict[str, Path], layouts: dict[str, Path],
                                                                         variant: str, layout: str) -> None:
    """Every tensor and key as llama.cpp's converter writes the release spelling, and llama.cpp runs
    transformers' model from it (f32: top-1 identical, within 1e-3 of the logit range)."""
    ours = files[f"{variant}-{layout}-f32"]
    if variant == "dense" and layout == "v5":
        with open_gguf(ours) as f:  # transformers 5 keeps num_experts_per_tok 2 unless told: written as 0
            assert f.get("granitehybrid.expert_used_count") == 0
    assert_same_file(files[f"theirs-{variant}-f32"], ours)
    want, got = transformers_logits(layouts[f"{variant}-{layout}"]), llama_cpp_logits(ours)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-3 * (want.max() - want.min())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_f16_and_q8_0_conversions(files: dict[str, Path], variant: str) -> None:
    """F16: llama.cpp's converter's bytes (1-D and norm tensors F32, ssm_a/ssm_d/conv kernel as it keeps them)."""
    assert_same_file(files[f"theirs-{variant}-f16"], files[f"{variant}-v5-f16"])
    with open_gguf(files["moe-v5-q8_0"]) as f:
        assert f.architecture == "granitehybrid"
    assert np.isfinite(llama_cpp_logits(files["moe-v5-q8_0"])).all()


def test_a_bf16_release_converts_to_llama_cpps_file(tmp_path: Path) -> None:
    """Granite 4 is released in bf16. ``A = -exp(A_log)`` is taken on the values widened to float32 and written
    F32, as llama.cpp's converter does; ggufkit once took the exp of the bf16 bit patterns (every A was -inf)."""
    ckpt = make_granite(tmp_path / "ckpt", "dense", "release", bf16=True)
    theirs = llama_cpp_convert(ckpt, tmp_path / "theirs.gguf", "bf16")
    ours = Path(convert(ckpt, tmp_path / "ours.gguf", outtype="bf16").outputs[0])
    assert_same_file(theirs, ours)
    with open_gguf(ours) as f:
        a = np.frombuffer(bytes(f.raw(f["blk.1.ssm_a"])), np.float32)
        assert np.isfinite(a).all() and (a < 0).all()


# -- evaluator -----------------------------------------------------------------------------------------------
def _llama_cpp_long_logits(gguf: Path, tokens: list[int]) -> np.ndarray:
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf), logits_all=True, n_ctx=256, n_batch=256, n_ubatch=256, n_threads=2,
                          verbose=False, type_k=0, type_v=0, flash_attn=False)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[:len(tokens)], dtype=np.float32)
    finally:
        llm.close()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_evaluator_logits_equal_llama_cpps_over_several_scan_chunks(files: dict[str, Path], variant: str) -> None:
    """200 tokens (two chunks of the scan, the state carried between them): the evaluator's logits
    against llama.cpp's token-by-token ggml_ssm_scan on the same F32 file, within 1e-4 of the logit range (the
    chunked scan sums in another order; measured 5e-6)."""
    from ggufkit.eval.model import load_model

    rng = np.random.default_rng(3)
    tokens = [int(t) for t in rng.integers(0, N_VOCAB, 200)]
    path = files[f"{variant}-v5-f32"]
    want = _llama_cpp_long_logits(path, tokens)
    with load_model(path, device="cpu") as m:
        got = m.logits(torch.tensor([tokens]))[0].numpy()
    assert np.abs(got - want).max() < 1e-4 * (want.max() - want.min())
    assert (got.argmax(-1) == want.argmax(-1)).mean() == 1.0


@pytest.mark.parametrize("name", ["moe-v5-f32", "dense-v5-f32", "moe-v5-f16"])
def test_ppl_equals_llama_perplexity(files: dict[str, Path], text_file: tuple[str, Path], name: str) -> None:
    """``ggufkit ppl`` against llama-perplexity on the bundled text, each chunk from an empty recurrent state:
    within 0.1 % (F16 with llama.cpp's F16 rounding of each matmul's input reproduced)."""
    from ggufkit.eval.perplexity import perplexity

    text, path = text_file
    ours = perplexity(files[name], text=text, ctx=CTX, chunks=CHUNKS, device="cpu",
                      ggml_rounding=name.endswith("f16"), kv_cache="f32")
    theirs, n_chunks = llama_perplexity(files[name], path, CTX, CHUNKS, *F32_PATH)
    assert ours.chunks == n_chunks == CHUNKS
    assert abs(ours.ppl / theirs - 1) < 1e-3, (ours.ppl, theirs)


def test_kl_divergence_of_a_q8_0_file_equals_llama_perplexitys(files: dict[str, Path], text_file: tuple[str, Path],
                                                               tmp_path: Path) -> None:
    """KLD of the Q8_0 conversion from the F32 one against llama-perplexity's --kl-divergence, within 3 %."""
    import re

    from ggufkit.eval import kl_divergence

    f32, q8 = files["moe-v5-f32"], files["moe-v5-q8_0"]
    text, path = text_file
    ours = kl_divergence(q8, f32, text=text, ctx=CTX, chunks=CHUNKS, device="cpu", ggml_rounding=True,
                         kv_cache="f32")
    logits = tmp_path / "base.kld"
    common = ["-f", str(path), "-c", str(CTX), "-b", str(CTX), "--chunks", str(CHUNKS), "-t", "2", "-nr", *F32_PATH]
    tool = str(tool_path("llama-perplexity"))
    subprocess.run([tool, "-m", str(f32), "--kl-divergence-base", str(logits), *common], check=True,
                   capture_output=True)
    theirs = None
    for _ in range(10):  # its logger thread sometimes loses the last lines
        r = subprocess.run([tool, "-m", str(q8), "--kl-divergence-base", str(logits), "--kl-divergence", *common],
                           check=True, capture_output=True, text=True)
        found = re.search(r"Mean\s+KLD:\s+([-0-9.]+)", r.stdout + r.stderr)
        if found is not None:
            theirs = float(found.group(1))
            break
    assert theirs is not None and theirs > 0 and ours.kld is not None
    assert abs(ours.kld["mean_kld"] / theirs - 1) < 3e-2, (ours.kld["mean_kld"], theirs)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_check_passes_and_fails_on_other_weights(layouts: dict[str, Path], files: dict[str, Path], variant: str,
                                                  tmp_path: Path) -> None:
    """``convert --check``: the conversion runs transformers' model; another seed's weights do not."""
    from ggufkit.eval.convert_check import check_conversion

    d = layouts[f"{variant}-v5"]
    report = convert(d, tmp_path / "ok.gguf", outtype="f32")
    ok = check_conversion(d, report.outputs[0], report.plan, device="cpu")
    assert ok.status == "passed", ok.failures
    other = convert(make_granite(tmp_path / "other", variant, seed=7), tmp_path / "other.gguf", outtype="f32")
    bad = check_conversion(d, other.outputs[0], other.plan, device="cpu")
    assert bad.status == "failed" and any(f.startswith("logits differ by") for f in bad.failures)


# -- quantization --------------------------------------------------------------------------------------------
#: A Granite 4 wide enough for every k-quant (rows of 256 and 512), 8 layers of which two attend.
WIDE = dict(hidden_size=256, intermediate_size=256, shared_intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=1, mamba_n_heads=8, mamba_d_head=64, num_hidden_layers=8,
            layer_types=["mamba", "mamba", "attention", "mamba", "mamba", "mamba", "attention", "mamba"])


@pytest.fixture(scope="module")
def quant_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A wide MoE Granite 4 converted to F16 by ggufkit, and an importance matrix of the entries llama-imatrix
    collects from it (no ssm_conv1d, ssm_a, ssm_d or norms)."""
    from fixtures_quantize import imatrix_values, write_imatrix_gguf

    d = tmp_path_factory.mktemp("granite4-quant")
    ckpt = make_granite(d / "ckpt", "moe", seed=4, **WIDE)
    src = Path(convert(ckpt, d / "f16.gguf", outtype="f16").outputs[0])
    values = {k: v for k, v in imatrix_values(src).items()
              if not any(s in k for s in ("ssm_conv1d", "ssm_a", "ssm_d", "_norm", "token_embd"))}
    return src, write_imatrix_gguf(d / "imatrix.gguf", values)


def test_every_preset_plans_as_llama_quantize(quant_model: tuple[Path, Path]) -> None:
    """llama_tensor_get_type's choice for every tensor under every preset, with and without an importance
    matrix (``llama-quantize --dry-run``): ssm_conv1d, ssm_a, ssm_d, the router and norms kept, attn_v counted
    over the attention layers only."""
    from test_quant_presets_oracle import dry_run_types, planned_types

    from ggufkit.quant.llama_quantize.plan import QuantOptions
    from ggufkit.quant.llama_quantize.presets import TYPE_CHOICES

    src, imat = quant_model
    with open_gguf(imat) as m:
        sizes = {t.name[:-len(".in_sum2")]: t.n_elements for t in m.tensors if t.name.endswith(".in_sum2")}
    mismatches = []
    for target in TYPE_CHOICES:
        for flags, options in (((), QuantOptions(dry_run=True)),
                               (("--imatrix", str(imat)), QuantOptions(dry_run=True, imatrix_sizes=sizes))):
            expected = dry_run_types(src, target, *flags)
            ours = planned_types(src, target, options)
            if ours != expected:
                mismatches.append((target, bool(flags), None if ours is None or expected is None else
                                   [(a, b) for a, b in zip(ours, expected) if a != b][:3]))
    assert not mismatches


@pytest.mark.parametrize(("target", "with_imatrix"), [("q4_k_m", False), ("q3_k_s", False), ("q6_k", False),
                                                      ("q2_k", True), ("iq3_xs", True), ("iq4_nl", True)])
def test_quantized_file_equals_llama_quantize(quant_model: tuple[Path, Path], target: str, with_imatrix: bool,
                                              tmp_path: Path) -> None:
    """Whole files, byte for byte and key for key, as the llama-quantize binary writes them."""
    from ggufkit.quant.llama_quantize.pipeline import quantize_file

    src, imat = quant_model
    flags = ["--imatrix", str(imat)] if with_imatrix else []
    r = subprocess.run([str(tool_path("llama-quantize")), *flags, str(src), str(tmp_path / "ref.gguf"),
                        target.upper(), "2"], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    quantize_file(src, tmp_path / "ours.gguf", target, imatrix=imat if with_imatrix else None, threads=2,
                  device="cpu")
    with open_gguf(tmp_path / "ref.gguf") as a, open_gguf(tmp_path / "ours.gguf") as b:
        assert [(t.name, t.ggml_type, t.ne) for t in a.tensors] == [(t.name, t.ggml_type, t.ne) for t in b.tensors]
        for ta, tb in zip(a.tensors, b.tensors):
            assert bytes(a.raw(ta)) == bytes(b.raw(tb)), f"bytes differ in {ta.name} ({ta.ggml_type.name})"
        keys = [k for k in a.kv if not k.startswith("ggufkit.")]
        assert keys == [k for k in b.kv if not k.startswith("ggufkit.")]
        for key in keys:
            va, vb = a.get(key), b.get(key)
            assert np.array_equal(np.asarray(va), np.asarray(vb)) if isinstance(va, (list, np.ndarray)) \
                else va == vb, key


# -- release -------------------------------------------------------------------------------------------------
def test_release_of_a_tiny_granite4(text_file: tuple[str, Path], tmp_path: Path) -> None:
    """``release`` end to end: F16 master, importance matrix, a Q8_0 file whose perplexity and KLD the manifest
    reports; every GGUF loads in llama.cpp."""
    from ggufkit.release import release

    ckpt = make_granite(tmp_path / "tiny-granite-4.0-h", "moe", "release")
    out = tmp_path / "release"
    result = release(ckpt, out, types=["q8_0"], master="f16", imatrix_text=text_file[1], ctx=64, chunks=2,
                     imatrix_chunks=2, device="cpu")
    assert result.ok, result.failures
    ggufs = [out / f for f in result.files if f.endswith(".gguf") and ".imatrix" not in f]
    assert len(ggufs) == 2 and any(p.name.endswith("-Q8_0.gguf") for p in ggufs), result.files
    for path in ggufs:
        with open_gguf(path) as f:
            assert f.architecture == "granitehybrid"
        assert np.isfinite(llama_cpp_logits(path)).all()


# -- refusals ------------------------------------------------------------------------------------------------
def _config(**changes: Any) -> dict[str, Any]:
    """Granite 4.0 H Tiny's released config.json (the keys the hooks read), with ``changes``."""
    config: dict[str, Any] = {
        "architectures": [HF_CLASS], "model_type": "granitemoehybrid", "hidden_size": 1536,
        "intermediate_size": 512, "shared_intermediate_size": 1024, "num_hidden_layers": 10,
        "num_attention_heads": 12, "num_key_value_heads": 4, "num_local_experts": 64, "num_experts_per_tok": 6,
        "layer_types": ["mamba"] * 5 + ["attention"] + ["mamba"] * 4, "mamba_n_heads": 48, "mamba_d_head": 64,
        "mamba_n_groups": 1, "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_conv_bias": True,
        "mamba_proj_bias": False, "attention_bias": False, "hidden_act": "silu", "position_embedding_type": "nope",
        "rope_theta": 10000, "rope_scaling": None, "vocab_size": 100352, "tie_word_embeddings": True,
        "embedding_multiplier": 12, "logits_scaling": 6, "residual_multiplier": 0.22,
        "attention_multiplier": 0.0078125}
    config.update(changes)
    return config


def test_every_schedule_spelling_reads_the_same_layers() -> None:
    from ggufkit.converters.granite_hybrid import check_config, schedule

    want = [False] * 5 + [True] + [False] * 4
    v5 = ["full_attention" if a else "linear_attention" for a in want]
    for config in (_config(), _config(layer_types=v5), _config(layer_types=None, layers_block_type=v5),
                   _config(layers_block_type=v5)):
        check_config(config)
        assert schedule(config) == want


@pytest.mark.parametrize(("changes", "message"), [
    (dict(layer_types=None, attn_layer_indices=[5]), "transformers' GraniteMoeHybridConfig ignores"),
    (dict(layer_types=None), "no layer schedule"),
    (dict(layer_types=["mamba"] * 10, layers_block_type=["mamba"] * 9 + ["attention"]), "disagree"),
    (dict(layer_types=["mamba"] * 9 + ["cross"]), "layer kinds ['cross']"),
    (dict(layer_types=["attention"] * 10), "no Mamba2 layer"),
    (dict(layer_types=["mamba"] * 10), "no attention layer"),
    (dict(num_hidden_layers=12), "num_hidden_layers 12 but a schedule of 10"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(mamba_expand=3, mamba_n_heads=72), "mamba_expand 3"),
    (dict(mamba_proj_bias=True), "mamba_proj_bias"),
    (dict(mamba_conv_bias=False), "no conv bias"),
    (dict(attention_bias=True), "attention biases"),
    (dict(position_embedding_type="rope"), "RoPE"),
    (dict(time_step_limit=[0.0, 10.0]), "time_step_limit"),
    (dict(vocab_size=100351), "vocab_size 100351 not a multiple of 8"),
    (dict(num_experts_per_tok=65), "65 experts per token of 64"),
    (dict(num_local_experts=0, num_experts_per_tok=0), "shared MLP's width 1024 is not intermediate_size 512"),
])
def test_configs_llama_cpp_would_run_as_another_model_are_refused(changes: dict[str, Any], message: str) -> None:
    from ggufkit.converters.granite_hybrid import check_config
    from ggufkit.errors import GGUFKitError

    with pytest.raises(GGUFKitError) as err:
        check_config(_config(**changes))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_transformers5_infinity_and_micro_configs_pass() -> None:
    from ggufkit.converters.granite_hybrid import check_config

    check_config(_config(time_step_limit=[0.0, {"__float__": "Infinity"}]))
    check_config(_config(num_local_experts=0, num_experts_per_tok=0, intermediate_size=1024))


def test_convert_refuses_in_one_line_exit_2_and_writes_nothing(tmp_path: Path) -> None:
    ckpt = make_granite(tmp_path / "m", "moe", "release")
    config = json.loads((ckpt / "config.json").read_text())
    config["position_embedding_type"] = "rope"
    (ckpt / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out.gguf"
    r = subprocess.run(["python", "-m", "ggufkit", "convert", str(ckpt), "-o", str(out)], capture_output=True,
                       text=True, check=False)
    assert r.returncode == 2 and not out.exists()
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "RoPE" in lines[0] and "Traceback" not in r.stderr, r.stderr
