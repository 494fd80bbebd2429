"""Qwen3.5 dense (``Qwen3_5ForCausalLM``, GGUF arch ``qwen35``) end to end against llama.cpp (issue 33).

Qwen3.5 mixes gated delta-net (linear attention) layers with gated full-attention layers (``layer_types``;
the release configs also say ``full_attention_interval: 4``). Tiny random checkpoints of transformers' own
class (tests/fixtures_models.py: 3 delta-net layers with 2 key heads and 4 value heads, so llama.cpp's
grouped-to-tiled value-head reorder matters, then one full-attention layer), every parameter random (A_log,
dt_bias, the norms and the conv kernel included), in two layouts:

* ``release``: config.json as Qwen/Qwen3.5-*'s text_config spells it (``full_attention_interval``,
  ``attn_output_gate``, ``partial_rotary_factor`` at the root as well, ``mtp_num_hidden_layers``, ...);
* ``tf5``: what transformers 5's ``save_pretrained`` writes (``layer_types`` only).

The evaluator (``ggufkit ppl``, ``imatrix``) is compared with llama.cpp's tools on the file llama.cpp's own
converter writes (``--no-mtp``: a checkpoint of transformers' class has no MTP tensors, and llama.cpp's
converter asserts without them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import fixtures_models
import numpy as np
import pytest
from fixtures_models import llama_cpp_logits, make_checkpoint, transformers_logits
from llama_cpp_sources import llama_cpp_dir

HF_CLASS = "Qwen3_5ForCausalLM"
LAYOUTS = ("release", "tf5")

# Layers 0-2 gated delta-net (2 key heads, 4 value heads: llama.cpp's tiled value-head reorder matters), layer 3
# full attention; head_dim 32 with a quarter rotated (n_rot 8) and M-RoPE sections [2, 1, 1] covering its 4 pairs
# (ggml_mrope_cache_init asserts the sections' sum is at most n_rot).
fixtures_models._BASE.setdefault(HF_CLASS, dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True}))
fixtures_models._CLASSES.setdefault(HF_CLASS, ("Qwen3_5TextConfig", HF_CLASS))
# Qwen3.5's own BPE (248k tokens, llama.cpp's check hash "qwen35") needs a rebuild tests/fixtures_tokenizers.py has
# no flavour for; Qwen2's BPE (check hash "qwen2", the same byte-level family) stands in.
fixtures_models._VOCAB.setdefault(HF_CLASS, "real:qwen2")


def to_release_config(path: Path) -> None:
    """Rewrite a transformers 5 config.json in the spelling of Qwen/Qwen3.5-*'s text_config (the keys
    transformers does not read included)."""
    config = json.loads(path.read_text())
    types = config["layer_types"]
    interval = types.index("full_attention") + 1 if "full_attention" in types else len(types) + 1
    rope = config.get("rope_parameters") or {}
    config.update(full_attention_interval=interval, attn_output_gate=True, mamba_ssm_dtype="float32",
                  mtp_num_hidden_layers=0, mtp_use_dedicated_embeddings=False, output_gate_type="swish",
                  partial_rotary_factor=rope.get("partial_rotary_factor", 0.25), torch_dtype="bfloat16",
                  bos_token_id=None, eos_token_id=151643)
    config.pop("dtype", None)
    path.write_text(json.dumps(dict(sorted(config.items())), indent=2))


def make_qwen35(dir: Path, layout: str, **overrides: Any) -> Path:
    """A tiny Qwen3.5 checkpoint in ``layout`` (``release`` or ``tf5``)."""
    d = make_checkpoint(dir, HF_CLASS, **overrides)
    if layout == "release":
        to_release_config(d / "config.json")
    return d


def llama_cpp_convert(model: Path, out: Path, outtype: str = "f32", *flags: str) -> Path:
    """llama.cpp's convert_hf_to_gguf.py (``--no-mtp`` unless ``flags`` say otherwise)."""
    root = llama_cpp_dir()
    env = {**os.environ, "PYTHONPATH": str(root / "gguf-py")}
    subprocess.run([sys.executable, str(root / "convert_hf_to_gguf.py"), str(model), "--outfile", str(out),
                    "--outtype", outtype, *(flags or ("--no-mtp",))], check=True, capture_output=True, env=env)
    return out


def converted_by_llama_cpp(d: Path) -> Path:
    """A tiny Qwen3.5 (transformers 5's layout) in ``d``, converted to F32 by llama.cpp's converter."""
    return llama_cpp_convert(make_qwen35(d / "ckpt", "tf5"), d / "f32.gguf")


@pytest.fixture(scope="module", params=LAYOUTS)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    layout = request.param
    d = make_qwen35(tmp_path_factory.mktemp(f"qwen35-{layout}") / "m", layout)
    return {"layout": layout, "dir": d, "theirs": llama_cpp_convert(d, d.parent / "theirs.gguf")}


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    from ggufkit.eval.perplexity import sample_text

    text = sample_text()[:6000]
    path = tmp_path_factory.mktemp("qwen35-text") / "text.txt"
    path.write_text(text + "\n", encoding="utf-8")
    return text, path


# -- conversion ----------------------------------------------------------------------------------------
def assert_same_file(theirs: Path, ours: Path, *, ordered: bool = True) -> None:
    """Every tensor byte-identical (in the same order unless ``ordered`` is false) and every key equal, naming
    and ``ggufkit.*`` keys aside (test_convert_archs._compared_key), but the one key ggufkit adds:
    ``tokenizer.ggml.bos_token_id`` equal to the eos id (a BPE vocabulary without a bos token:
    converters/vocab.py uses its end-of-text token in both roles, where llama.cpp's converter writes none)."""
    from test_convert_archs import _compared_key

    from ggufkit.format import open_gguf

    with open_gguf(theirs) as a, open_gguf(ours) as b:
        listed = [[(t.name, t.ggml_type, t.ne) for t in f.tensors] for f in (a, b)]
        assert listed[0] == listed[1] if ordered else sorted(listed[0]) == sorted(listed[1])
        for t in a.tensors:
            assert bytes(a.raw(t)) == bytes(b.raw(b[t.name])), t.name
        keys_a = {k for k in a.kv if _compared_key(k)}
        keys_b = {k for k in b.kv if _compared_key(k)}
        assert keys_b - keys_a <= {"tokenizer.ggml.bos_token_id"} and keys_a <= keys_b, keys_a ^ keys_b
        if keys_b - keys_a:
            assert b.get("tokenizer.ggml.bos_token_id") == b.get("tokenizer.ggml.eos_token_id")
        for key in keys_a:
            va, vb = a.get(key), b.get(key)
            assert a.kv[key].type == b.kv[key].type, key
            if isinstance(va, (list, np.ndarray)):
                assert np.array_equal(np.asarray(va), np.asarray(vb)), key
            else:
                assert va == vb, key


def test_file_equals_llama_cpps_converter(case: dict[str, Any], tmp_path: Path) -> None:
    """Every tensor byte-identical (norms stored as 1 + w but the delta-net output norm, A = -exp(A_log), the
    conv kernel squeezed, value heads tiled in attn_qkv's v rows, attn_gate, ssm_alpha/beta/a/dt, the conv's v
    channels and ssm_out's columns), every key equal (the schedule as attention.recurrent_layers, the M-RoPE
    sections, ssm.*), in both layouts."""
    from ggufkit.converters import convert
    from ggufkit.format import open_gguf

    ours = convert(case["dir"], tmp_path / "ours.gguf", outtype="f32").outputs[0]
    assert_same_file(case["theirs"], ours)
    with open_gguf(ours) as f:
        assert f.architecture == "qwen35"
        assert list(f.get("qwen35.attention.recurrent_layers")) == [True, True, True, False]
        assert list(f.get("qwen35.rope.dimension_sections")) == [2, 1, 1, 0]
        assert f.get("qwen35.rope.dimension_count") == 8 and f.get("qwen35.ssm.inner_size") == 64


@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0"])
def test_other_outtypes_equal_llama_cpps_converter(outtype: str, tmp_path: Path) -> None:
    """Norms, A, dt and the conv kernel F32, matrices in the outtype, byte for byte (a quantized outtype in
    llama-quantize's tensor order, as for every architecture)."""
    from ggufkit.converters import convert

    d = make_qwen35(tmp_path / "m", "tf5")
    theirs = llama_cpp_convert(d, tmp_path / "theirs.gguf", outtype)
    ours = convert(d, tmp_path / "ours.gguf", outtype=outtype).outputs[0]
    assert_same_file(theirs, ours, ordered=outtype != "q8_0")


@pytest.mark.parametrize(("spelling", "recurrent"), [
    ({"layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"]},
     [True, False, True, False]),
    ({"layer_types": None, "full_attention_interval": 2}, [True, False, True, False]),
    ({"layer_types": None}, [True, True, True, False]),
])
def test_every_schedule_spelling(spelling: dict[str, Any], recurrent: list[bool], tmp_path: Path) -> None:
    """The layer schedule as ``layer_types`` (transformers 5, the release text_config), as
    ``full_attention_interval`` alone (an older spelling Qwen3_5TextConfig still reads) and as neither (the
    default interval 4): llama.cpp's file (its converter sees AutoConfig's layer_types in every case), and
    transformers' model in llama.cpp."""
    from ggufkit.converters import convert
    from ggufkit.format import open_gguf

    types = ["linear_attention" if r else "full_attention" for r in recurrent]
    d = make_qwen35(tmp_path / "m", "tf5", layer_types=types)
    config = json.loads((d / "config.json").read_text())
    for key, value in spelling.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (d / "config.json").write_text(json.dumps(config, indent=2))
    theirs = llama_cpp_convert(d, tmp_path / "theirs.gguf")
    ours = convert(d, tmp_path / "ours.gguf", outtype="f32").outputs[0]
    assert_same_file(theirs, ours)
    with open_gguf(ours) as f:
        assert list(f.get("qwen35.attention.recurrent_layers")) == recurrent
    want = transformers_logits(d)
    got = llama_cpp_logits(ours)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-3 * (want.max() - want.min())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_check_passes_and_fails_on_other_weights(layout: str, tmp_path: Path) -> None:
    """``convert --check`` runs Qwen3.5 (transformers' model against the evaluator's) in both layouts. With the
    locally trained Qwen2-style BPE: the rebuilt real Qwen2 vocabulary's ``</s>`` is an ordinary token to the
    rebuilt tokenizer.json but a special one in the GGUF, which --check's tokenizer probe reports (a fixture
    artefact, not Qwen3.5's)."""
    from ggufkit.converters import convert
    from ggufkit.eval.convert_check import check_conversion

    d = make_qwen35(tmp_path / "m", layout, vocab="qwen2")
    report = convert(d, tmp_path / "ours.gguf", outtype="f32")
    ok = check_conversion(d, report.outputs[0], report.plan, device="cpu")
    assert ok.status == "passed", ok.failures
    other = make_qwen35(tmp_path / "other", layout, vocab="qwen2", seed=7)
    bad = check_conversion(d, convert(other, tmp_path / "other.gguf", outtype="f32").outputs[0],
                           report.plan, device="cpu")
    assert bad.status == "failed" and any(f.startswith("logits differ by") for f in bad.failures)


# -- runtime and evaluator -------------------------------------------------------------------------------
def test_llama_cpp_runs_transformers_model(case: dict[str, Any]) -> None:
    """llama.cpp's file computes transformers' model (its fused gated delta-net op sums token by token,
    transformers' chunked rule in chunks of 64: float32 rounding apart, the same logits)."""
    want = transformers_logits(case["dir"])
    got = llama_cpp_logits(case["theirs"])
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-3 * (want.max() - want.min())


def test_evaluator_logits_equal_llama_cpps(case: dict[str, Any]) -> None:
    import torch
    from fixtures_models import TOKENS

    from ggufkit.eval.model import load_model

    want = llama_cpp_logits(case["theirs"])
    with load_model(case["theirs"], device="cpu") as m:
        assert m.hparams.extra["recurrent"] == (True, True, True, False)
        got = m.logits(torch.tensor([TOKENS]))[0].numpy()
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-4 * (want.max() - want.min())


def test_ppl_equals_llama_perplexity(case: dict[str, Any], sample: tuple[str, Path], tmp_path: Path) -> None:
    """F32 and F16 files, 4 chunks of 64 tokens, each chunk from an empty recurrent state."""
    from test_eval_archs_vs_llama_perplexity import F32_PATH, llama_perplexity

    from ggufkit.eval.perplexity import perplexity

    text, path = sample
    f16 = llama_cpp_convert(case["dir"], tmp_path / "f16.gguf", "f16")
    for model, rounding in ((case["theirs"], False), (f16, True)):
        ours = perplexity(model, text=text, ctx=64, chunks=4, device="cpu", ggml_rounding=rounding, kv_cache="f32")
        theirs, n_chunks = llama_perplexity(model, path, 64, 4, *F32_PATH)
        assert ours.chunks == n_chunks == 4
        assert abs(ours.ppl / theirs - 1) < 1e-3, (model.name, ours.ppl, theirs)


def test_imatrix_equals_llama_imatrix(case: dict[str, Any], sample: tuple[str, Path], tmp_path: Path) -> None:
    """Every matmul of both layer kinds (the delta-net's qkv, gate, beta, alpha and ssm_out; the gated
    attention's q/k/v/output) and the untied head: llama-imatrix's entries and counts, ``in_sum2`` within
    float32 noise. ssm_conv1d is not a matmul and has no entry."""
    from test_eval_imatrix import F32_ATTENTION, llama_imatrix, ours, relative_l2
    from test_eval_imatrix_archs import CHUNKS, CTX, F32_TOLERANCE, _collectable

    ref, mine = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    common = ["-f", sample[1], "-c", CTX, "--chunks", CHUNKS, "--process-output"]
    llama_imatrix("-m", case["theirs"], "-o", ref, *common, *F32_ATTENTION)
    ours(case["theirs"], "-o", mine, *common)
    rel = relative_l2(mine, ref)
    assert set(rel) == _collectable(case["theirs"])
    assert {n.split(".", 2)[-1] for n in rel if n.startswith("blk.0.")} == {
        "attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight", "ssm_out.weight",
        "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"}
    assert {n.split(".", 2)[-1] for n in rel if n.startswith("blk.3.")} == {
        "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight",
        "ffn_up.weight", "ffn_down.weight"}
    assert max(rel.values()) <= F32_TOLERANCE, rel


# -- quantization --------------------------------------------------------------------------------------
def qwen35_gguf(path: Path, n_layer: int = 8, d: int = 256, ff: int = 512) -> Path:
    """A Qwen3.5 file as llama.cpp's converter writes it (checkpoint order; layers 3 and 7 full attention, the
    others delta-net with 2 key and 4 value heads of 64), F16 matrices and F32 vectors (the conv kernel F32, as
    the converter keeps it), seeded random values: enough for llama-quantize, which reads the hparams."""
    from gguf import GGMLQuantizationType as QT

    from ggufkit.format import Metadata, TensorSpec, write_gguf
    from ggufkit.format.values import VT

    hd, nk, nv = 64, 2, 4
    kd, vd = nk * hd, nv * hd
    conv = 2 * kd + vd
    recurrent = [(i + 1) % 4 != 0 for i in range(n_layer)]
    linear = [("attn_norm.weight", (d,)), ("ssm_a", (nv,)), ("ssm_conv1d.weight", (conv, 4)),
              ("ssm_dt.bias", (nv,)), ("ssm_alpha.weight", (nv, d)), ("ssm_beta.weight", (nv, d)),
              ("attn_qkv.weight", (conv, d)), ("attn_gate.weight", (vd, d)), ("ssm_norm.weight", (hd,)),
              ("ssm_out.weight", (d, vd)), ("ffn_down.weight", (d, ff)), ("ffn_gate.weight", (ff, d)),
              ("ffn_up.weight", (ff, d)), ("post_attention_norm.weight", (d,))]
    full = [("attn_norm.weight", (d,)), ("ffn_down.weight", (d, ff)), ("ffn_gate.weight", (ff, d)),
            ("ffn_up.weight", (ff, d)), ("post_attention_norm.weight", (d,)), ("attn_k_norm.weight", (hd,)),
            ("attn_k.weight", (2 * hd, d)), ("attn_output.weight", (d, 4 * hd)), ("attn_q_norm.weight", (hd,)),
            ("attn_q.weight", (2 * 4 * hd, d)), ("attn_v.weight", (2 * hd, d))]
    tensors = [("output.weight", (256, d)), ("token_embd.weight", (256, d))]
    for i in range(n_layer):
        tensors += [(f"blk.{i}.{n}", s) for n, s in (linear if recurrent[i] else full)]
    tensors.append(("output_norm.weight", (d,)))
    hp = {"block_count": n_layer, "context_length": 256, "embedding_length": d, "feed_forward_length": ff,
          "attention.head_count": 4, "attention.head_count_kv": 2, "rope.freq_base": 1e7,
          "attention.layer_norm_rms_epsilon": 1e-6, "attention.key_length": hd, "attention.value_length": hd,
          "ssm.conv_kernel": 4, "ssm.state_size": hd, "ssm.group_count": nk, "ssm.time_step_rank": nv,
          "ssm.inner_size": vd, "full_attention_interval": 4, "rope.dimension_count": 16}
    meta = Metadata()
    meta.set("general.architecture", VT.STRING, "qwen35")
    for key, value in hp.items():
        meta.set(f"qwen35.{key}", VT.FLOAT32 if isinstance(value, float) else VT.UINT32, value)
    meta.set("qwen35.rope.dimension_sections", VT.ARRAY, [11, 11, 10, 0], VT.INT32)
    meta.set("qwen35.attention.recurrent_layers", VT.ARRAY, recurrent, VT.BOOL)
    rng = np.random.default_rng(5)
    specs, arrays = [], []
    for name, shape in tensors:
        arr = (0.02 * rng.standard_normal(shape)).astype(np.float32)
        f32 = len(shape) == 1 or name.endswith("ssm_conv1d.weight")
        specs.append(TensorSpec(name, QT.F32 if f32 else QT.F16, shape))
        arrays.append(arr if f32 else arr.astype(np.float16))
    write_gguf(path, meta, specs, arrays, slack_bytes=0)
    return path


@pytest.fixture(scope="module")
def quant_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from fixtures_quantize import imatrix_values, write_imatrix_gguf

    d = tmp_path_factory.mktemp("qwen35-quant")
    model = qwen35_gguf(d / "qwen35.gguf")
    values = {k: v for k, v in imatrix_values(model).items() if not k.endswith("ssm_conv1d.weight")}
    return {"model": model, "imatrix": write_imatrix_gguf(d / "imatrix.gguf", values)}


@pytest.mark.parametrize("with_imatrix", [False, True])
def test_every_preset_plans_as_llama_quantize(quant_model: dict[str, Path], with_imatrix: bool) -> None:
    """llama_tensor_get_type's choice for every tensor and every TYPE (llama-quantize --dry-run): the conv
    kernel kept, attn_qkv of the delta-net layers counted with the attention layers' attn_v (category
    ATTENTION_QKV, n_attention_wv), the small ssm_alpha/ssm_beta rows falling back where a row is no block."""
    from test_quant_presets_oracle import dry_run_types, planned_types

    from ggufkit.format import open_gguf
    from ggufkit.quant.llama_quantize.plan import QuantOptions
    from ggufkit.quant.llama_quantize.presets import TYPE_CHOICES

    flags: tuple[str, ...] = ()
    options = QuantOptions(dry_run=True)
    if with_imatrix:
        flags = ("--imatrix", str(quant_model["imatrix"]))
        with open_gguf(quant_model["imatrix"]) as m:
            sizes = {t.name[:-len(".in_sum2")]: t.n_elements for t in m.tensors if t.name.endswith(".in_sum2")}
        options = QuantOptions(dry_run=True, imatrix_sizes=sizes)
    mismatches = [t for t in TYPE_CHOICES
                  if planned_types(quant_model["model"], t, options) != dry_run_types(quant_model["model"], t, *flags)]
    assert not mismatches


#: With an importance matrix, whole files of these TYPEs (every TYPE's plan is checked above; the 1- and 2-bit IQ
#: quantizers take minutes here).
WITH_IMATRIX = ("q2_k", "q3_k_s", "q4_0", "q4_k_m", "q5_k_s", "q6_k", "iq2_xs", "iq3_xxs", "iq4_xs")


@pytest.mark.parametrize("with_imatrix", [False, True])
def test_whole_files_equal_llama_quantize(quant_model: dict[str, Path], tmp_path: Path, with_imatrix: bool) -> None:
    """Every TYPE without an importance matrix (:data:`WITH_IMATRIX` with one), whole files (tensors, bytes,
    keys) against the llama-quantize binary; where it refuses (an IQ type without an importance matrix) ggufkit
    refuses too."""
    from fixtures_quantize import assert_same_quantized
    from llama_cpp_sources import tool_path

    from ggufkit.errors import GGUFKitError
    from ggufkit.quant import quantize_file
    from ggufkit.quant.llama_quantize.presets import TYPE_CHOICES

    flags = ["--imatrix", str(quant_model["imatrix"])] if with_imatrix else []
    compared = 0
    for target in WITH_IMATRIX if with_imatrix else TYPE_CHOICES:
        ref, ours = tmp_path / f"ref-{target}.gguf", tmp_path / f"ours-{target}.gguf"
        r = subprocess.run([str(tool_path("llama-quantize")), *flags, str(quant_model["model"]), str(ref),
                            target.upper(), "2"], capture_output=True)
        try:
            quantize_file(quant_model["model"], ours, target,
                          imatrix=quant_model["imatrix"] if with_imatrix else None, threads=2)
        except GGUFKitError:
            assert r.returncode != 0, target
            continue
        assert r.returncode == 0, target
        assert_same_quantized(ref, ours)
        compared += 1
        ref.unlink()
        ours.unlink()
    assert compared >= (len(WITH_IMATRIX) if with_imatrix else 25)


# -- release -------------------------------------------------------------------------------------------
def test_release_end_to_end(tmp_path: Path) -> None:
    """``release`` of a tiny Qwen3.5 in the released layout: F16 master, importance matrix (llama-imatrix's
    entries on that master: no ssm_conv1d), Q8_0 and Q4_K_M, card; every file loads in llama.cpp and the
    master's reported perplexity is llama-perplexity's."""
    from test_eval_archs_vs_llama_perplexity import F32_PATH, llama_perplexity
    from test_eval_imatrix import F32_ATTENTION, llama_imatrix

    from ggufkit.eval.perplexity import sample_text
    from ggufkit.format import open_gguf
    from ggufkit.quant.imatrix.collector import read_raw_imatrix
    from ggufkit.release import release

    ckpt = make_qwen35(tmp_path / "tiny-qwen35", "release", hidden_size=256, intermediate_size=256)
    text = tmp_path / "text.txt"
    text.write_text(sample_text()[:6000] + "\n", encoding="utf-8")
    out = tmp_path / "release"
    result = release(ckpt, out, types=["q8_0", "q4_k_m"], master="f16", imatrix_text=text, eval_text=text,
                     ctx=64, chunks=2, imatrix_chunks=2, device="cpu")
    assert result.ok, result.failures
    master = next(out / f for f in result.files if f.endswith("-F16.gguf"))
    imatrix = next(out / f for f in result.files if ".imatrix" in f)
    quants = [out / f for f in result.files if f.endswith(("-Q8_0.gguf", "-Q4_K_M.gguf"))]
    assert len(quants) == 2
    for path in (master, *quants):
        with open_gguf(path) as f:
            assert f.architecture == "qwen35"
        assert np.isfinite(llama_cpp_logits(path)).all()
    ref = tmp_path / "ref.gguf"
    llama_imatrix("-m", master, "-f", text, "-c", 64, "--chunks", 2, "-o", ref, *F32_ATTENTION)
    assert sorted(read_raw_imatrix(imatrix).entries) == sorted(read_raw_imatrix(ref).entries)
    manifest = json.loads((out / "manifest.json").read_text())
    reported = manifest["steps"]["eval-master"]["results"]["ppl"]
    theirs, _ = llama_perplexity(master, text, 64, 2, *F32_PATH)
    # release evaluates the F16 master with float32 activations, llama-perplexity rounds each matmul's input to
    # F16 first: on this random 256-wide model (PPL ~6.5e9, very sensitive) that is 0.12 % (measured)
    assert abs(reported / theirs - 1) < 2e-3, (reported, theirs)
