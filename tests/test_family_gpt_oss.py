"""gpt-oss (``GptOssForCausalLM``, GGUF arch ``gpt-oss``) end to end against llama.cpp (issue 32).

gpt-oss alternates sliding-window and full attention layers, adds a learned sink per head to the attention
softmax, has biases on every projection, routes with a biased softmax over the top-k router logits, and runs its
experts' clamped SwiGLU from a gate_up_proj whose gate and up columns are interleaved. Tiny random checkpoints of
transformers' own class: 4 layers (sliding window 8, so the 16-token logits check crosses it), 4 experts, top-2,
every parameter random (sinks, router bias, expert biases, norms: tests/fixtures_models.py ``randomize``). The
tokenizer is GPT-2's BPE (check hash "gpt-2"): gpt-oss's o200k BPE (check hash "gpt-4o", in
converters/pretokenizer.py) has no vocab file in llama.cpp's tree and cannot be fetched without network.

Layouts:

* ``release``: config.json as openai/gpt-oss-20b spells it (``rope_scaling`` and ``rope_theta`` at the root,
  ``experts_per_token``, ``initial_context_length``, no ``swiglu_alpha``), float weights;
* ``mxfp4``: the release config with ``quantization_config.quant_method`` ``mxfp4`` and the experts as released
  (``*_blocks`` / ``*_scales``; random codes and exponents), the rest BF16: written as GGUF MXFP4 tensors,
  byte-identical to llama.cpp's repacking;
* ``dequantized``: what transformers 5 saves after loading the MXFP4 checkpoint with ``Mxfp4Config(dequantize=
  True)`` (float experts, no quantization_config; transformers 5's spelling: ``rope_parameters``,
  ``swiglu_alpha``, the spelling of the ``tf5`` checkpoint the others are made from).

llama.cpp and transformers disagree on one thing: YaRN with ``truncate: false`` (gpt-oss's configs). transformers
then keeps the correction range unrounded, as OpenAI's reference RotaryEmbedding does; llama.cpp's
ggml_rope_yarn_corr_dims always floors / ceils it. The file means llama.cpp's rope, so the logits are compared
with transformers running ``truncate: true`` (and the difference is shown to be that alone).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import fixtures_models
import numpy as np
import pytest
from fixtures_models import TOKENS, llama_cpp_logits, make_checkpoint
from llama_cpp_sources import llama_cpp_dir

HF_CLASS = "GptOssForCausalLM"
LAYOUTS = ("release", "mxfp4", "dequantized")

fixtures_models._BASE.setdefault(HF_CLASS, dict(
    hidden_size=64, intermediate_size=64, head_dim=16, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
    max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=50256))
fixtures_models._CLASSES.setdefault(HF_CLASS, ("GptOssConfig", HF_CLASS))
fixtures_models._VOCAB.setdefault(HF_CLASS, "real:gpt-2")


def to_release_config(path: Path) -> None:
    """Rewrite a transformers 5 config.json in openai/gpt-oss-20b's spelling."""
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    config.pop("swiglu_alpha")
    config.pop("dtype", None)
    config.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope, experts_per_token=config["num_experts_per_tok"],
                  initial_context_length=4096, torch_dtype="bfloat16", transformers_version="4.55.0.dev0")
    path.write_text(json.dumps(dict(sorted(config.items())), indent=2))


def to_mxfp4(src: Path, dst: Path, seed: int = 1) -> Path:
    """``src`` as released: experts as MXFP4 ``*_blocks`` [n_expert, out, in / 32, 16] and ``*_scales``
    [n_expert, out, in / 32] (random codes, exponents 2^-9..2^-5), everything else BF16, quantization_config."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    rng = np.random.default_rng(seed)
    out = {}
    for name, value in load_file(dst / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            n_exp, n_in, n_out = value.shape
            out[name + "_blocks"] = torch.from_numpy(rng.integers(0, 256, (n_exp, n_out, n_in // 32, 16), np.uint8))
            out[name + "_scales"] = torch.from_numpy(rng.integers(118, 123, (n_exp, n_out, n_in // 32), np.uint8))
        else:
            out[name] = value.to(torch.bfloat16)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def reference_model(d: Path, truncate: bool = True) -> Any:
    """transformers' model of checkpoint ``d`` in float32 (an MXFP4 one dequantized, as transformers does on CPU),
    YaRN's ``truncate`` as given (module docstring)."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(d)
    config.rope_parameters = {**config.rope_parameters, "truncate": truncate}
    kwargs: dict[str, Any] = {}
    if getattr(config, "quantization_config", None):
        kwargs["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(d, config=config, dtype=torch.float32,
                                                             **kwargs).eval()


def reference_logits(d: Path, truncate: bool = True) -> Any:
    import torch

    with torch.no_grad():
        return reference_model(d, truncate)(torch.tensor([TOKENS])).logits[0].float().numpy()


def make_models(root: Path, **overrides: Any) -> dict[str, Path]:
    """One tiny checkpoint in every layout (module docstring) under ``root``, all of the same weights."""
    models = {"tf5": make_checkpoint(root / "tf5", HF_CLASS, **overrides)}
    models["release"] = Path(shutil.copytree(models["tf5"], root / "release"))
    to_release_config(models["release"] / "config.json")
    models["mxfp4"] = to_mxfp4(models["release"], root / "mxfp4")
    models["dequantized"] = root / "dequantized"
    reference_model(models["mxfp4"], truncate=False).save_pretrained(models["dequantized"])
    for f in models["mxfp4"].glob("tokenizer*"):
        shutil.copy(f, models["dequantized"] / f.name)
    return models


def llama_cpp_convert(model: Path, out: Path, outtype: str = "f32") -> Path:
    root = llama_cpp_dir()
    env = {**os.environ, "PYTHONPATH": str(root / "gguf-py")}
    subprocess.run([sys.executable, str(root / "convert_hf_to_gguf.py"), str(model), "--outfile", str(out),
                    "--outtype", outtype], check=True, capture_output=True, env=env)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_models(tmp_path_factory.mktemp("gpt-oss"))


@pytest.fixture(scope="module", params=LAYOUTS)
def case(request: pytest.FixtureRequest, models: dict[str, Path]) -> dict[str, Any]:
    d = models[request.param]
    return {"layout": request.param, "dir": d, "theirs": llama_cpp_convert(d, d.parent / f"{d.name}.gguf")}


def converted(models: dict[str, Path], layout: str) -> Path:
    """llama.cpp's F32 file of ``layout`` (the one ``case`` made, when it ran first)."""
    d = models[layout]
    out = d.parent / f"{d.name}.gguf"
    return out if out.exists() else llama_cpp_convert(d, out)


def test_the_layouts_are_spelled_as_released_and_as_transformers_5_saves_them(case: dict[str, Any]) -> None:
    config = json.loads((case["dir"] / "config.json").read_text())
    if case["layout"] in ("release", "mxfp4"):
        assert config["rope_scaling"]["rope_type"] == "yarn" and "rope_parameters" not in config
        assert "swiglu_alpha" not in config and config["experts_per_token"] == 2
    else:
        assert config["rope_parameters"]["rope_type"] == "yarn" and config["swiglu_alpha"] == 1.702
    assert ("quantization_config" in config) == (case["layout"] == "mxfp4")


# -- conversion ------------------------------------------------------------------------------------------
def assert_same_file(theirs: Path, ours: Path) -> None:
    """Every tensor byte-identical, same type and in llama.cpp's order; every key of llama.cpp's file equal in
    ggufkit's (``general.*`` naming and provenance aside), and no other."""
    from test_convert_archs import _compared_key

    from ggufkit.format import open_gguf

    with open_gguf(theirs) as a, open_gguf(ours) as b:
        assert [(t.name, t.ggml_type, t.ne) for t in a.tensors] == [(t.name, t.ggml_type, t.ne) for t in b.tensors]
        for t in a.tensors:
            assert bytes(a.raw(t)) == bytes(b.raw(b[t.name])), t.name
        keys = [k for k in a.kv if _compared_key(k)]
        assert {k for k in b.kv if _compared_key(k)} == set(keys)
        for key in keys:
            va, vb = a.get(key), b.get(key)
            assert a.kv[key].type == b.kv[key].type, key
            assert (np.array_equal(np.asarray(va), np.asarray(vb)) if isinstance(va, (list, np.ndarray))
                    else va == vb), key


def test_ggufkit_converts_each_layout_as_llama_cpps_converter(case: dict[str, Any], tmp_path: Path) -> None:
    """Sinks as attn_sinks.weight, the interleaved gate_up split into gate (even) and up (odd) rows, the expert
    biases, the YaRN keys from either spelling; an MXFP4 checkpoint's experts as GGUF MXFP4 (first in the file,
    as llama.cpp's generate_extra_tensors writes them) and the file type MXFP4_MOE whatever the float outtype."""
    from ggufkit.converters import convert

    ours = convert(case["dir"], tmp_path / "ours.gguf", outtype="f32").outputs[0]
    assert_same_file(case["theirs"], ours)
    assert_types(ours, case["layout"], "f32")


def test_an_mxfp4_checkpoint_to_bf16_keeps_its_mxfp4_experts(models: dict[str, Path], tmp_path: Path) -> None:
    """Another float outtype: the MXFP4 experts stay MXFP4 (not dequantized, not requantized: the bytes of
    llama.cpp's F32 file), the file type is MXFP4_MOE whatever the float outtype (ModelBase.prepare_metadata),
    the other matrices BF16. (llama.cpp's own BF16 conversion is left out for CI time: the float encodings are
    the shared ones every family's tests compare.)"""
    from ggufkit.converters import convert
    from ggufkit.format import open_gguf

    ours = convert(models["mxfp4"], tmp_path / "ours.gguf", outtype="bf16").outputs[0]
    assert_types(ours, "mxfp4", "bf16")
    with open_gguf(converted(models, "mxfp4")) as a, open_gguf(ours) as b:
        assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
        for t in a.tensors:
            if t.ggml_type.name == "MXFP4":
                assert bytes(a.raw(t)) == bytes(b.raw(b[t.name])), t.name


def test_an_mxfp4_checkpoint_to_q8_0_keeps_its_mxfp4_experts(models: dict[str, Path], tmp_path: Path) -> None:
    """A quantized outtype: the experts stay MXFP4 as llama.cpp's converter keeps them at any outtype
    (GptOssModel.generate_extra_tensors), the rest Q8_0: every tensor of llama.cpp's q8_0 file, same type and
    bytes, and its file type (a quantized outtype writes tensors in llama-quantize's order, as for every family).
    ggufkit once fed the repacked MXFP4 blocks to the Q8_0 quantizer and refused the conversion."""
    from ggufkit.converters import convert
    from ggufkit.format import open_gguf

    ours = convert(models["mxfp4"], tmp_path / "ours.gguf", outtype="q8_0").outputs[0]
    theirs = llama_cpp_convert(models["mxfp4"], tmp_path / "theirs.gguf", "q8_0")
    with open_gguf(theirs) as a, open_gguf(ours) as b:
        assert sorted(t.name for t in a.tensors) == sorted(t.name for t in b.tensors)
        assert {t.ggml_type.name for t in b.tensors if t.name.endswith("_exps.weight")} == {"MXFP4"}
        for t in a.tensors:
            assert (t.ggml_type, t.ne) == (b[t.name].ggml_type, b[t.name].ne), t.name
            assert bytes(a.raw(t)) == bytes(b.raw(b[t.name])), t.name
        assert a.get("general.file_type") == b.get("general.file_type")


def assert_types(ours: Path, layout: str, outtype: str) -> None:
    from gguf import GGMLQuantizationType as QT
    from gguf import LlamaFileType

    from ggufkit.format import open_gguf

    with open_gguf(ours) as f:
        assert f.get("gpt-oss.attention.sliding_window") == 8 and f.get("gpt-oss.rope.scaling.factor") == 32
        experts = [t for t in f.tensors if "_exps.weight" in t.name]
        mxfp4 = layout == "mxfp4"
        assert {t.ggml_type for t in experts} == {QT.MXFP4 if mxfp4 else QT[outtype.upper()]}
        assert f.get("general.file_type") == (LlamaFileType.MOSTLY_MXFP4_MOE if mxfp4
                                              else LlamaFileType["ALL_F32" if outtype == "f32" else "MOSTLY_BF16"])
        if mxfp4:
            assert [t.name for t in f.tensors][:3] == ["blk.0.ffn_down_exps.weight", "blk.0.ffn_gate_exps.weight",
                                                      "blk.0.ffn_up_exps.weight"]


def test_mxfp4_repack_is_llama_cpps_bit_for_bit() -> None:
    """repack_mxfp4 against GptOssModel.transform_nibble_layout + repack_mxfp4 re-done with torch, on every byte
    value and several exponents; and the values are transformers' dequantized ones (E2M1 x 2^(e-127) equals
    ggml's doubled E2M1 x 2^(e-128))."""
    import torch

    from ggufkit.converters.mxfp4_source import repack_mxfp4
    from ggufkit.eval.dequant import dequantize

    rng = np.random.default_rng(0)
    blocks = np.arange(256, dtype=np.uint8).reshape(2, 8, 1, 16)[:, :, [0, 0]]
    blocks = np.concatenate([blocks, rng.integers(0, 256, (2, 8, 2, 16), np.uint8)], axis=2)  # [2, 8, 4, 16]
    scales = rng.integers(100, 140, (2, 8, 4), np.uint8)

    t = torch.from_numpy(blocks)
    lo, hi = t & 0x0F, t & 0xF0
    t = (lo << 4) | (hi >> 4)
    a, b = t.chunk(2, dim=-1)
    a = torch.stack(((a & 0xF0).view(-1, 1), (a << 4).view(-1, 1)), dim=2).view(t.shape)
    b = torch.stack(((b >> 4).view(-1, 1), (b & 0x0F).view(-1, 1)), dim=2).view(t.shape)
    t = a | b
    t = ((t & 0xF0) >> 4) | ((t & 0x0F) << 4)
    want = torch.concat((torch.from_numpy(scales).unsqueeze(-1), t), dim=-1).reshape(2, 8, 4 * 17).numpy()
    got = repack_mxfp4(blocks, scales)
    assert got.dtype == np.uint8 and np.array_equal(got, want)

    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    from gguf import GGMLQuantizationType as QT

    ours = dequantize(torch.from_numpy(got.reshape(16, 4 * 17)), QT.MXFP4, 128).reshape(2, 8, 128)
    assert torch.equal(ours, hf.transpose(1, 2))


# -- runtime -----------------------------------------------------------------------------------------------
def test_llama_cpp_runs_transformers_model(case: dict[str, Any]) -> None:
    """llama.cpp on llama.cpp's file (byte-identical to ggufkit's, above) computes transformers' model: sinks,
    sliding window, biased router, clamped SwiGLU; the MXFP4 layout against transformers dequantizing it."""
    want = reference_logits(case["dir"])
    got = llama_cpp_logits(case["theirs"])
    assert (got.argmax(-1) == want.argmax(-1)).all()
    # ggml's CPU MXFP4 matmul quantizes its activations to Q8_0 (ggml-cpu type_traits: vec_dot_type): 1.5e-3 of
    # the range measured; every other layout is float32 throughout
    tolerance = 5e-3 if case["layout"] == "mxfp4" else 1e-3
    assert np.abs(got - want).max() < tolerance * (want.max() - want.min())


def test_yarn_truncate_false_is_where_transformers_and_llama_cpp_differ(models: dict[str, Path]) -> None:
    """With gpt-oss's ``truncate: false`` transformers rounds nothing (as OpenAI's reference rope); llama.cpp
    floors / ceils the correction dims: the logits move by more than the tolerance (0.4 % of the range here)."""
    d = models["dequantized"]
    ours = llama_cpp_logits(converted(models, "dequantized"))
    rel = [np.abs(ours - reference_logits(d, t)).max() / np.ptp(ours) for t in (True, False)]
    assert rel[0] < 1e-5 < 1e-3 < rel[1]


# -- the converter's hooks ----------------------------------------------------------------------------------
def _config(**fields: Any) -> dict[str, Any]:
    return {"model_type": "gpt_oss", "num_hidden_layers": 4, **fields}


@pytest.mark.parametrize(("overrides", "message"), [
    ({"layer_types": ["full_attention", "sliding_attention"] * 2}, "a layer schedule other than sliding/full"),
    ({"layer_types": ["sliding_attention"] * 4}, "a layer schedule other than sliding/full"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types must list 4 entries"),
    ({"swiglu_limit": 10.0}, "swiglu_limit 10.0 (llama.cpp's graph computes 7.0)"),
    ({"swiglu_alpha": 1.0}, "swiglu_alpha 1.0 (llama.cpp's graph computes 1.702)"),
    ({"attention_bias": False}, "no attention biases"),
])
def test_checkpoints_llama_cpp_cannot_represent_are_refused(overrides: dict[str, Any], message: str) -> None:
    from ggufkit.converters import gpt_oss
    from ggufkit.errors import UnsupportedArchitectureError

    with pytest.raises(UnsupportedArchitectureError, match=re.escape(message)):
        gpt_oss.check_config(_config(**overrides))


def test_class_defaults_fill_what_a_config_leaves_out() -> None:
    """llama.cpp's converter reads the config through AutoConfig: no rope spelling at all is GptOssConfig's YaRN
    (factor 32 over 4096), no layer_types its alternating schedule (accepted)."""
    from ggufkit.converters import gpt_oss
    from ggufkit.format.values import VT

    gpt_oss.check_config(_config())
    out = gpt_oss.hparams(_config(), {})
    assert out["gpt-oss.rope.scaling.type"] == (VT.STRING, "yarn")
    assert out["gpt-oss.rope.scaling.factor"] == (VT.FLOAT32, 32.0)
    assert out["gpt-oss.rope.scaling.original_context_length"] == (VT.UINT32, 4096)
    assert gpt_oss.hparams(_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}), {}) == {}


def test_a_refused_checkpoint_exits_2_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ggufkit.cli import cli
    from ggufkit.cli._errors import run_cli

    d = make_checkpoint(tmp_path / "m", HF_CLASS, swiglu_limit=10.0)
    capsys.readouterr()
    code = run_cli(cli, ["convert", str(d), "-o", str(tmp_path / "x.gguf")])
    err = capsys.readouterr().err
    assert code == 2 and "gpt_oss: llama.cpp would compute another model: swiglu_limit 10.0" in err
    assert err.count("\n") == 1 and not (tmp_path / "x.gguf").exists()


# -- evaluator ---------------------------------------------------------------------------------------------
def tiny_f32(d: Path) -> Path:
    """A tiny gpt-oss as transformers 5 saves it, converted to F32 by ggufkit (tests/test_eval_imatrix_archs.py)."""
    from ggufkit.converters import convert

    return Path(convert(make_checkpoint(d / "ckpt", HF_CLASS), d / "f32.gguf", outtype="f32").outputs[0])


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    from ggufkit.eval.perplexity import sample_text

    text = sample_text()[:6000]
    path = tmp_path_factory.mktemp("gpt-oss-text") / "text.txt"
    path.write_text(text + "\n", encoding="utf-8")
    return text, path


@pytest.mark.parametrize("layout", ["dequantized", "mxfp4"])
def test_evaluator_logits_equal_llama_cpps(models: dict[str, Path], layout: str) -> None:
    """eval/family_gpt_oss.py on llama.cpp's file: YaRN, sinks, the window, the biased router and clamped SwiGLU;
    the MXFP4 experts read as they are, with ggml's Q8_0 rounding of their inputs (--ggml-rounding)."""
    import torch

    from ggufkit.eval.model import load_model

    path = converted(models, layout)
    want = llama_cpp_logits(path)
    with load_model(path, device="cpu", ggml_rounding=layout == "mxfp4") as m:
        assert m.hparams.extra["n_swa"] == 8 and m.hparams.yarn.freq_scale == 1 / 32
        got = m.logits(torch.tensor([TOKENS]))[0].numpy()
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < (1e-3 if layout == "mxfp4" else 1e-5) * np.ptp(want)


def test_ppl_equals_llama_perplexity(models: dict[str, Path], sample: tuple[str, Path]) -> None:
    """F32 file and the MXFP4 one (F16 elsewhere, ggml's rounding), 4 chunks of 64 tokens (windows of 8)."""
    from test_eval_archs_vs_llama_perplexity import F32_PATH, llama_perplexity

    from ggufkit.eval.perplexity import perplexity

    text, path = sample
    from ggufkit.converters import convert

    # ggufkit's F16 conversion: llama.cpp's MXFP4 bytes (test_an_mxfp4_checkpoint_to_bf16_keeps_its_mxfp4_experts)
    f16 = convert(models["mxfp4"], models["mxfp4"].parent / "mxfp4-f16.gguf", outtype="f16").outputs[0]
    for model, rounding in ((converted(models, "dequantized"), False), (f16, True)):
        ours = perplexity(model, text=text, ctx=64, chunks=4, device="cpu", ggml_rounding=rounding, kv_cache="f32")
        theirs, n_chunks = llama_perplexity(model, path, 64, 4, *F32_PATH)
        assert ours.chunks == n_chunks == 4
        assert abs(ours.ppl / theirs - 1) < 1e-3, (model.name, ours.ppl, theirs)


def test_imatrix_equals_llama_imatrix(models: dict[str, Path], sample: tuple[str, Path], tmp_path: Path) -> None:
    """Q/K/V, the output projection, the router, the three expert matmuls (counts per expert) and the head:
    llama-imatrix's entries and counts, ``in_sum2`` within float32 noise; sinks and biases are no matmuls."""
    from test_eval_imatrix import F32_ATTENTION, llama_imatrix, ours, relative_l2
    from test_eval_imatrix_archs import CHUNKS, CTX, F32_TOLERANCE, _collectable

    model = converted(models, "dequantized")
    ref, mine = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    common = ["-f", sample[1], "-c", CTX, "--chunks", CHUNKS, "--process-output"]
    llama_imatrix("-m", model, "-o", ref, *common, *F32_ATTENTION)
    ours(model, "-o", mine, *common)
    rel = relative_l2(mine, ref)
    assert set(rel) == _collectable(model)
    assert {n.split(".", 2)[-1] for n in rel if n.startswith("blk.0.")} == {
        "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate_inp.weight",
        "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"}
    assert max(rel.values()) <= F32_TOLERANCE, rel


# -- quantization ----------------------------------------------------------------------------------------
def gpt_oss_gguf(path: Path, mxfp4: bool, n_layer: int = 4, d: int = 256, ff: int = 256, n_exp: int = 8) -> Path:
    """A ``gpt-oss`` file as llama.cpp's converter writes one (its tensor order; sinks, biases and norms F32, the
    router F32), 8 experts (llama_tensor_get_type's >= 8 rules), 4 heads of 64 over 2 KV heads: matrices F16, or
    the experts MXFP4 as from a released checkpoint (random blocks, file type MXFP4_MOE, first in the file)."""
    from gguf import GGMLQuantizationType as QT
    from gguf import LlamaFileType

    from ggufkit.converters.mxfp4_source import repack_mxfp4
    from ggufkit.format import Metadata, TensorSpec, write_gguf
    from ggufkit.format.values import VT

    hd, nh, nkv = 64, 4, 2
    experts = [("ffn_down_exps.weight", (n_exp, d, ff)), ("ffn_gate_exps.weight", (n_exp, ff, d)),
               ("ffn_up_exps.weight", (n_exp, ff, d))]
    block = [("attn_norm.weight", (d,)), *([] if mxfp4 else experts[:1]), ("ffn_down_exps.bias", (n_exp, d)),
             *([] if mxfp4 else experts[1:]), ("ffn_gate_exps.bias", (n_exp, ff)), ("ffn_up_exps.bias", (n_exp, ff)),
             ("ffn_gate_inp.bias", (n_exp,)), ("ffn_gate_inp.weight", (n_exp, d)),
             ("post_attention_norm.weight", (d,)), ("attn_k.bias", (nkv * hd,)), ("attn_k.weight", (nkv * hd, d)),
             ("attn_output.bias", (d,)), ("attn_output.weight", (d, nh * hd)), ("attn_q.bias", (nh * hd,)),
             ("attn_q.weight", (nh * hd, d)), ("attn_sinks.weight", (nh,)), ("attn_v.bias", (nkv * hd,)),
             ("attn_v.weight", (nkv * hd, d))]
    tensors = [(f"blk.{i}.{n}", s) for i in range(n_layer) for n, s in experts] if mxfp4 else []
    tensors += [("output.weight", (256, d)), ("token_embd.weight", (256, d))]
    tensors += [(f"blk.{i}.{n}", s) for i in range(n_layer) for n, s in block]
    tensors.append(("output_norm.weight", (d,)))
    meta = Metadata()
    meta.set("general.architecture", VT.STRING, "gpt-oss")
    meta.set("general.file_type", VT.UINT32, int(LlamaFileType.MOSTLY_MXFP4_MOE if mxfp4 else LlamaFileType.MOSTLY_F16))
    hp: dict[str, int | float] = {
        "block_count": n_layer, "context_length": 131072, "embedding_length": d, "feed_forward_length": ff,
        "attention.head_count": nh, "attention.head_count_kv": nkv, "rope.freq_base": 150000.0,
        "attention.layer_norm_rms_epsilon": 1e-5, "expert_count": n_exp, "expert_used_count": 2,
        "attention.key_length": hd, "attention.value_length": hd, "attention.sliding_window": 128,
        "expert_feed_forward_length": ff}
    for key, value in hp.items():
        meta.set(f"gpt-oss.{key}", VT.FLOAT32 if isinstance(value, float) else VT.UINT32, value)
    rng = np.random.default_rng(7)
    specs, arrays = [], []
    for name, shape in tensors:
        if mxfp4 and "_exps.weight" in name:
            blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // 32, 16), np.uint8)
            scales = rng.integers(118, 123, (*shape[:-1], shape[-1] // 32), np.uint8)
            specs.append(TensorSpec(name, QT.MXFP4, shape))
            arrays.append(repack_mxfp4(blocks, scales))
            continue
        arr = (0.02 * rng.standard_normal(shape)).astype(np.float32)
        f32 = len(shape) == 1 or not name.endswith(".weight") or name.endswith("ffn_gate_inp.weight")
        specs.append(TensorSpec(name, QT.F32 if f32 else QT.F16, shape))
        arrays.append(arr if f32 else arr.astype(np.float16))
    write_gguf(path, meta, specs, arrays, slack_bytes=0)
    return path


@pytest.fixture(scope="module")
def quant_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from fixtures_quantize import imatrix_values, write_imatrix_gguf

    d = tmp_path_factory.mktemp("gpt-oss-quant")
    out = {"f16": gpt_oss_gguf(d / "f16.gguf", False), "mxfp4": gpt_oss_gguf(d / "mxfp4.gguf", True)}
    out["imatrix"] = write_imatrix_gguf(d / "imatrix.gguf", imatrix_values(out["f16"]))
    return out


@pytest.mark.parametrize(("source", "with_imatrix"), [("f16", False), ("f16", True), ("mxfp4", False)])
def test_every_preset_plans_as_llama_quantize(quant_models: dict[str, Path], source: str,
                                              with_imatrix: bool) -> None:
    """llama_tensor_get_type's choice for every tensor and every TYPE (llama-quantize --dry-run): attention,
    the router kept F32, the 8-expert rules, MXFP4_MOE's experts; from MXFP4 experts (with --allow-requantize)
    MXFP4_MOE keeps them as they are and every other TYPE requantizes them as llama-quantize does."""
    from test_quant_presets_oracle import dry_run_types, planned_types

    from ggufkit.format import open_gguf
    from ggufkit.quant.llama_quantize.plan import QuantOptions
    from ggufkit.quant.llama_quantize.presets import TYPE_CHOICES

    model = quant_models[source]
    flags: list[str] = ["--allow-requantize"] if source == "mxfp4" else []
    options = QuantOptions(dry_run=True, allow_requantize=source == "mxfp4")
    if with_imatrix:
        flags += ["--imatrix", str(quant_models["imatrix"])]
        with open_gguf(quant_models["imatrix"]) as m:
            sizes = {t.name[:-len(".in_sum2")]: t.n_elements for t in m.tensors if t.name.endswith(".in_sum2")}
        options = QuantOptions(dry_run=True, imatrix_sizes=sizes)
    planned = {t: planned_types(model, t, options) for t in TYPE_CHOICES}
    assert not [t for t in TYPE_CHOICES if planned[t] != dry_run_types(model, t, *flags)]
    if source == "mxfp4":
        from gguf import GGMLQuantizationType as QT

        kept = planned["mxfp4_moe"]
        assert kept is not None and {ty for n, ty in kept if "_exps.weight" in n} == {QT.MXFP4}


@pytest.mark.parametrize(("source", "target", "with_imatrix"), [
    ("f16", "mxfp4_moe", False), ("f16", "q4_k_m", True), ("f16", "iq4_xs", True), ("mxfp4", "mxfp4_moe", False),
    ("mxfp4", "q4_k_m", False)])
def test_whole_files_equal_llama_quantize(quant_models: dict[str, Path], source: str, target: str,
                                          with_imatrix: bool, tmp_path: Path) -> None:
    """Whole files (tensors, bytes, keys) against the llama-quantize binary: MXFP4_MOE from F16 (experts quantized
    to MXFP4, the rest Q8_0) and from MXFP4 experts (copied as they are), a K-quant and an IQ type with an
    importance matrix, and MXFP4 experts requantized (--allow-requantize: dequantized exactly, then Q4_K_M)."""
    from fixtures_quantize import assert_same_quantized
    from llama_cpp_sources import tool_path

    from ggufkit.quant import quantize_file

    model = quant_models[source]
    flags = ["--imatrix", str(quant_models["imatrix"])] if with_imatrix else []
    flags += ["--allow-requantize"] if source == "mxfp4" else []
    ref, ours = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    subprocess.run([str(tool_path("llama-quantize")), *flags, str(model), str(ref), target.upper(), "2"],
                   check=True, capture_output=True)
    quantize_file(model, ours, target, imatrix=quant_models["imatrix"] if with_imatrix else None, threads=2,
                  allow_requantize=source == "mxfp4")
    assert_same_quantized(ref, ours)


def test_release_end_to_end(models: dict[str, Path], tmp_path: Path) -> None:
    """``ggufkit release`` of a gpt-oss checkpoint as released (MXFP4 experts): a BF16 master that keeps them, an
    importance matrix collected by the evaluator, MXFP4_MOE (the master's MXFP4 experts copied as they are, the
    rest Q8_0) and Q8_0 (the experts requantized, as llama-quantize --allow-requantize), each loaded by llama.cpp;
    the master's perplexity near llama-perplexity's (release scores without ggml's BF16 / Q8_0 input rounding)."""
    from gguf import GGMLQuantizationType as QT
    from test_eval_archs_vs_llama_perplexity import F32_PATH, llama_perplexity

    from ggufkit.format import open_gguf
    from ggufkit.release import release
    from ggufkit.release.plan import TextInput

    ckpt = Path(shutil.copytree(models["mxfp4"], tmp_path / "gpt-oss-tiny"))
    out = tmp_path / "release"
    result = release(ckpt, out, types=["mxfp4_moe", "q8_0"], ctx=64, chunks=2, imatrix_chunks=2, device="cpu")
    assert result.ok, result.failures
    files = {f.rsplit("-", 1)[1].removesuffix(".gguf"): out / f for f in result.files
             if f.endswith(".gguf") and not f.endswith(".imatrix.gguf")}
    with open_gguf(files["BF16"]) as m, open_gguf(files["MXFP4_MOE"]) as a, open_gguf(files["Q8_0"]) as b:
        assert a.architecture == "gpt-oss" and a.get("quantize.imatrix.chunks_count") == 2
        experts = [t.name for t in m.tensors if "_exps.weight" in t.name]
        assert {m[n].ggml_type for n in experts} == {a[n].ggml_type for n in experts} == {QT.MXFP4}
        assert all(bytes(m.raw(m[n])) == bytes(a.raw(a[n])) for n in experts)
        assert {b[n].ggml_type for n in experts} == {QT.Q8_0}
    for path in files.values():
        assert np.isfinite(llama_cpp_logits(path)).all()
    text = tmp_path / "eval.txt"
    text.write_text(TextInput.bundled("evaluation").text, encoding="utf-8")
    theirs, _ = llama_perplexity(files["BF16"], text, 64, 2, *F32_PATH)
    assert result.master is not None and abs(result.master["ppl"] / theirs - 1) < 2e-2, (result.master, theirs)


def test_mxfp4_on_another_class_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """llama.cpp's converter repacks MXFP4 only for gpt-oss (its base dequant_model raises "Quant method is not
    yet supported: 'mxfp4'" for any other class): exit 2, one line, nothing written."""
    from ggufkit.cli import cli
    from ggufkit.cli._errors import run_cli

    d = make_checkpoint(tmp_path / "m", "LlamaForCausalLM")
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (d / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    code = run_cli(cli, ["convert", str(d), "-o", str(tmp_path / "x.gguf")])
    err = capsys.readouterr().err
    assert code == 2 and "LlamaForCausalLM: quantization_config.quant_method 'mxfp4' is not supported" in err
    assert err.count("\n") == 1 and not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize(("layout", "outtype", "status"), [("release", "bf16", "passed"), ("tf5", "q8_0", "passed")])
def test_convert_check(models: dict[str, Path], tmp_path: Path, layout: str, outtype: str, status: str) -> None:
    """``convert --check`` (on by default): transformers' reference runs YaRN with ``truncate`` as llama.cpp
    computes it (the released ``truncate: false`` was 40 % of the logit range away), and a Q8_0 file whose experts
    the hooks split and transpose is compared against a reference rounded in the GGUF's rows
    (converters/gpt_oss.py ``reference_view``; the check skipped it before)."""
    from ggufkit.converters import convert
    from ggufkit.eval.convert_check import check_conversion

    report = convert(models[layout], tmp_path / "m.gguf", outtype=outtype)
    result = check_conversion(models[layout], report.outputs[0], report.plan, device="cpu")
    assert result.status == status, (result.reason, result.failures)
