"""Ernie 4.5 (``Ernie4_5ForCausalLM`` -> ``ernie4_5``, ``Ernie4_5_MoeForCausalLM`` -> ``ernie4_5-moe``) end to end
against llama.cpp (issue 32).

Tiny random checkpoints of transformers' own classes, every parameter random (the norms and the MoE router's
``moe_statics.e_score_correction_bias`` included: tests/fixtures_models.py ``randomize``), a sentencepiece
``tokenizer.model`` (the kind Ernie 4.5 ships; llama.cpp's ``_set_vocab_sentencepiece``):

* dense: 2 layers, 4 heads of 16 (2 KV heads), the head tied to the embeddings as released;
* MoE: 3 layers (layer 0 dense: ``moe_layer_start_index`` 1), 4 experts, top-2, 2 shared experts, an untied
  head, no ``head_dim`` (Ernie4_5_MoeConfig has no such field: hidden / heads, as ERNIE-4.5-21B-A3B-PT's).

Two config layouts: ``release`` (ERNIE-4.5-0.3B-PT / -21B-A3B-PT's spelling: ``rope_theta`` at the root, the
remote-code class name ``Ernie4_5_ForCausalLM``, no ``moe_layer_end_index`` or ``moe_norm_min``;
``add_prefix_space`` false in tokenizer_config.json) and ``tf5`` (transformers 5's save_pretrained).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import fixtures_models
import numpy as np
import pytest
from fixtures_models import TOKENS, llama_cpp_logits, make_checkpoint, transformers_logits
from llama_cpp_sources import llama_cpp_dir
from test_family_qwen3next import assert_same_file

DENSE, MOE = "Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM"
ARCH = {DENSE: "ernie4_5", MOE: "ernie4_5-moe"}

fixtures_models._BASE.setdefault(DENSE, dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))
# intermediate_size // num_key_value_heads = the shared experts' width, as in every release (module docstring of
# ggufkit.converters.ernie)
fixtures_models._BASE.setdefault(MOE, dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
    moe_intermediate_size=32, moe_num_experts=4, moe_k=2, moe_num_shared_experts=2, moe_layer_start_index=1,
    moe_layer_interval=1, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))
fixtures_models._CLASSES.setdefault(DENSE, ("Ernie4_5Config", DENSE))
fixtures_models._CLASSES.setdefault(MOE, ("Ernie4_5_MoeConfig", MOE))
fixtures_models._VOCAB.setdefault(DENSE, "spm")
fixtures_models._VOCAB.setdefault(MOE, "spm")


def to_release_config(d: Path) -> None:
    """Rewrite a transformers 5 save in the spelling of baidu/ERNIE-4.5-*-PT's config.json and tokenizer."""
    path = d / "config.json"
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    config.update(rope_theta=rope["rope_theta"], torch_dtype="bfloat16", use_cache=False)
    config.pop("dtype", None)
    if config["model_type"] == "ernie4_5_moe":
        for key in ("moe_layer_end_index", "moe_norm_min", "output_router_logits", "router_aux_loss_coef"):
            config.pop(key)
        config.update(moe_capacity=[64, 64, 64], moe_gate="topk", moe_use_aux_free=True)
    else:
        config["architectures"] = ["Ernie4_5_ForCausalLM"]
    config["auto_map"] = {"AutoConfig": "configuration_ernie4_5.Ernie4_5Config"}
    path.write_text(json.dumps(dict(sorted(config.items())), indent=2))
    tok = d / "tokenizer_config.json"
    tok.write_text(json.dumps({**json.loads(tok.read_text()), "add_prefix_space": False}, indent=2))


def make_ernie(d: Path, hf_class: str, layout: str = "tf5", **overrides: Any) -> Path:
    """A tiny checkpoint of ``hf_class``; the release layout's sentencepiece model adds no dummy prefix, as its
    tokenizer_config.json's ``add_prefix_space`` false says."""
    if layout == "release":
        overrides.setdefault("vocab", "spm-no-prefix")
    make_checkpoint(d, hf_class, **overrides)
    if layout == "release":
        to_release_config(d)
    return d


def llama_cpp_convert(model: Path, out: Path, outtype: str = "f32") -> Path:
    """llama.cpp's convert_hf_to_gguf.py (which refuses --mtp / --no-mtp for Ernie: it never writes MTP layers)."""
    root = llama_cpp_dir()
    env = {**os.environ, "PYTHONPATH": str(root / "gguf-py")}
    subprocess.run([sys.executable, str(root / "convert_hf_to_gguf.py"), str(model), "--outfile", str(out),
                    "--outtype", outtype], check=True, capture_output=True, env=env)
    return out


CASES = [(DENSE, "release"), (DENSE, "tf5"), (MOE, "release"), (MOE, "tf5")]


@pytest.fixture(scope="module", params=CASES, ids=[f"{ARCH[c]}-{lay}" for c, lay in CASES])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    hf_class, layout = request.param
    d = make_ernie(tmp_path_factory.mktemp(f"{ARCH[hf_class]}-{layout}") / "m", hf_class, layout)
    return {"class": hf_class, "layout": layout, "dir": d, "theirs": llama_cpp_convert(d, d.parent / "theirs.gguf")}


# -- conversion ------------------------------------------------------------------------------------------
def test_ggufkit_converts_each_layout_as_llama_cpps_converter(case: dict[str, Any], tmp_path: Path) -> None:
    """F32: every tensor byte-identical and every key equal (F16: test_ppl_and_imatrix_equal_llama_cpps), and
    ``convert --check`` passes (the evaluator runs transformers' model from the file); transformers has no class
    of the release's remote-code name Ernie4_5_ForCausalLM, so there the check says so and is skipped."""
    from ggufkit.converters import convert
    from ggufkit.eval.convert_check import check_conversion

    report = convert(case["dir"], tmp_path / "ours.gguf", outtype="f32")
    assert_same_file(case["theirs"], report.outputs[0])
    checked = check_conversion(case["dir"], report.outputs[0], report.plan, device="cpu")
    if (case["class"], case["layout"]) == (DENSE, "release"):
        assert checked.status == "skipped" and "Ernie4_5_ForCausalLM" in (checked.reason or "")
    else:
        assert checked.status == "passed", checked.failures


def test_llama_cpp_runs_transformers_model(case: dict[str, Any]) -> None:
    want = transformers_logits(case["dir"])
    got = llama_cpp_logits(case["theirs"])
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-3 * (want.max() - want.min())


# -- evaluator -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    from ggufkit.eval.perplexity import sample_text

    text = sample_text()[:4000]
    path = tmp_path_factory.mktemp("ernie-text") / "text.txt"
    path.write_text(text + "\n", encoding="utf-8")
    return text, path


def test_evaluator_logits_equal_llama_cpps(case: dict[str, Any]) -> None:
    import torch

    from ggufkit.eval.model import load_model

    want = llama_cpp_logits(case["theirs"])
    with load_model(case["theirs"], device="cpu") as m:
        if case["class"] == MOE:
            assert m.hparams.extra["moe"] == (False, True, True) and m.hparams.n_expert == 4
        got = m.logits(torch.tensor([TOKENS]))[0].numpy()
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-4 * (want.max() - want.min())


def test_ppl_and_imatrix_equal_llama_cpps(case: dict[str, Any], sample: tuple[str, Path], tmp_path: Path) -> None:
    """Perplexity of the F32 file (and, MoE release layout, llama.cpp's F16 one, which ggufkit's equals, with
    --ggml-rounding) within 0.1 % of
    llama-perplexity's, 2 chunks of 64 tokens; the importance matrix with llama-imatrix's entries (the router, each
    expert, the shared expert, the dense lead layer, the head) and in_sum2 within float32 noise."""
    from test_eval_archs_vs_llama_perplexity import F32_PATH, llama_perplexity
    from test_eval_imatrix_archs import F32_TOLERANCE
    from test_family_qwen3next import imatrix_against_llama

    from ggufkit.converters import convert
    from ggufkit.eval.perplexity import perplexity

    text, path = sample
    models = [(case["theirs"], False)]
    if (case["class"], case["layout"]) == (MOE, "release"):  # one F16 case (CI time)
        f16 = llama_cpp_convert(case["dir"], tmp_path / "f16.gguf", "f16")
        assert_same_file(f16, convert(case["dir"], tmp_path / "ours-f16.gguf", outtype="f16").outputs[0])
        models.append((f16, True))
    for model, rounding in models:
        ours = perplexity(model, text=text, ctx=64, chunks=2, device="cpu", ggml_rounding=rounding, kv_cache="f32")
        theirs, n_chunks = llama_perplexity(model, path, 64, 2, *F32_PATH)
        assert ours.chunks == n_chunks == 2
        assert abs(ours.ppl / theirs - 1) < 1e-3, (model.name, ours.ppl, theirs)
    if (case["class"], case["layout"]) == (MOE, "release"):
        _kld_equals_llama_perplexitys(case, text, path, tmp_path)
    rel = imatrix_against_llama(case["theirs"], path, tmp_path)
    if case["class"] == MOE:
        assert {n.split(".", 2)[-1] for n in rel if n.startswith("blk.1.")} >= {
            "ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
            "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"}
        assert "blk.0.ffn_up.weight" in rel
    assert max(rel.values()) <= F32_TOLERANCE, rel


def _kld_equals_llama_perplexitys(case: dict[str, Any], text: str, path: Path, tmp_path: Path) -> None:
    """KLD of ggufkit's Q8_0 conversion from llama.cpp's F32 one against llama-perplexity's --kl-divergence,
    within 3 %."""
    from llama_cpp_sources import tool_path
    from test_eval_archs_vs_llama_perplexity import F32_PATH

    from ggufkit.converters import convert
    from ggufkit.eval import kl_divergence

    f32, q8 = case["theirs"], convert(case["dir"], tmp_path / "q8.gguf", outtype="q8_0").outputs[0]
    # 4 chunks: with 2 llama-perplexity prints no KLD statistics
    ours = kl_divergence(q8, f32, text=text, ctx=64, chunks=4, device="cpu", ggml_rounding=True, kv_cache="f32")
    logits = tmp_path / "base.kld"
    common = ["-f", str(path), "-c", "64", "-b", "64", "--chunks", "4", "-t", "2", "-nr", *F32_PATH]
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


# -- the converter's hooks (what registry.yaml cannot say) ------------------------------------------------
def _config(moe: bool, **fields: Any) -> dict[str, Any]:
    base = {"model_type": "ernie4_5_moe" if moe else "ernie4_5", "architectures": [MOE if moe else DENSE],
            "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 128}
    return {**base, **fields}


@pytest.mark.parametrize(("config", "head_dim"), [
    (_config(False, head_dim=16), 16),
    # no key: Ernie4_5Config's default 128, as llama.cpp's converter reads it through AutoConfig
    (_config(False), 128),
    # an explicit null: hidden / heads (Ernie4_5Config.__post_init__)
    (_config(False, head_dim=None), 16),
    (_config(True, head_dim=32), 32),
    # Ernie4_5_MoeConfig has no head_dim: hidden / heads, and no key (llama.cpp's loader derives the same)
    (_config(True), None),
])
def test_the_head_size_is_transformers_in_every_spelling(config: dict[str, Any], head_dim: int | None) -> None:
    from ggufkit.converters import ernie
    from ggufkit.format.values import VT

    arch = "ernie4_5-moe" if config["model_type"] == "ernie4_5_moe" else "ernie4_5"
    out = ernie.hparams(config, {f"{arch}.block_count": (VT.UINT32, 4)}, ())
    assert out.get(f"{arch}.attention.key_length") == (None if head_dim is None else (VT.UINT32, head_dim))
    assert out.get(f"{arch}.attention.value_length") == out.get(f"{arch}.attention.key_length")
    assert ernie.hparams(config, {}, ()) == {}  # --vocab-only


@pytest.mark.parametrize(("fields", "width"), [
    ({"moe_num_shared_experts": 2, "moe_intermediate_size": 32}, 64),
    # transformers' defaults (2 of 1536) where the config names neither
    ({}, 3072),
    # llama.cpp's converter writes intermediate_size // num_key_value_heads = 64, a width its loader rejects
    ({"moe_num_shared_experts": 1, "moe_intermediate_size": 32}, 32),
    ({"moe_num_shared_experts": 0}, None),
])
def test_the_shared_expert_width_is_the_one_transformers_builds(fields: dict[str, Any], width: int | None) -> None:
    from ggufkit.converters import ernie
    from ggufkit.format.values import VT

    out = ernie.hparams(_config(True, **fields), {"ernie4_5-moe.block_count": (VT.UINT32, 4)}, ())
    want = None if width is None else (VT.UINT32, width)
    assert out.get("ernie4_5-moe.expert_shared_feed_forward_length") == want
    assert out["ernie4_5-moe.rope.freq_base"] == (VT.FLOAT32, 500000.0)  # Ernie's default_theta


@pytest.mark.parametrize(("moe", "fields", "message"), [
    (False, {"use_bias": True}, "use_bias true"),
    (True, {"use_bias": True}, "use_bias true"),
    (False, {"hidden_act": "gelu"}, "hidden_act gelu"),
    (True, {"moe_layer_interval": 2}, "moe_layer_interval 2"),
    (True, {"moe_layer_end_index": 2}, "moe_layer_end_index 2 of 4 layers"),
    (True, {"moe_layer_start_index": 4}, "moe_layer_start_index 4 of 4 layers"),
])
def test_checkpoints_llama_cpp_cannot_represent_are_refused(moe: bool, fields: dict[str, Any], message: str) -> None:
    from ggufkit.converters import ernie
    from ggufkit.errors import UnsupportedArchitectureError

    with pytest.raises(UnsupportedArchitectureError, match=re.escape(message)):
        ernie.check_config(_config(moe, **fields))
    for ok in ({}, {"moe_layer_end_index": -1}, {"moe_layer_end_index": 3}, {"moe_layer_start_index": 0}):
        ernie.check_config(_config(moe, **ok))


def test_a_refused_checkpoint_exits_2_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Through the CLI: exit 2, one line, nothing written, before any tensor is read (transformers 5's config of a
    layer interval of 2: layer 1 MoE, layers 0 and 2 dense, which llama.cpp's loader would want as experts)."""
    import transformers

    from ggufkit.cli import cli
    from ggufkit.cli._errors import run_cli

    d = tmp_path / "m"
    config = transformers.Ernie4_5_MoeConfig(**{**fixtures_models._BASE[MOE], "vocab_size": 320,
                                                "moe_layer_interval": 2, "moe_layer_start_index": 0})
    config.architectures = [MOE]
    config.save_pretrained(d)
    capsys.readouterr()
    code = run_cli(cli, ["convert", str(d), "-o", str(tmp_path / "x.gguf")])
    err = capsys.readouterr().err
    assert code == 2 and "ernie4_5-moe: llama.cpp would compute another model: moe_layer_interval 2" in err
    assert err.count("\n") == 1 and not (tmp_path / "x.gguf").exists()


def to_paddle(src: Path, dst: Path) -> Path:
    """``src`` (a -PT layout) as Baidu's -Paddle releases store it: tensors under ``ernie.``, q/k/v fused into
    ``qkv_proj`` and gate/up into ``up_gate_proj``, every linear weight [in, out] (Paddle's nn.Linear; a -Paddle
    shard lists ``ernie.layers.N.self_attn.qkv_proj.weight`` as [hidden, (heads + 2 kv heads) * head_dim])."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    w = load_file(dst / "model.safetensors")
    fused = {"q_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")), "gate_proj": ("up_gate_proj", ("gate_proj", "up_proj"))}
    out = {}
    for name, t in w.items():
        stem, _, leaf = name.removesuffix(".weight").rpartition(".")
        if leaf in ("k_proj", "v_proj", "up_proj"):
            continue
        if leaf in fused:
            into, parts = fused[leaf]
            name, t = f"{stem}.{into}.weight", torch.cat([w[f"{stem}.{p}.weight"] for p in parts])
        if t.ndim == 2 and "embed_tokens" not in name and name != "lm_head.weight":
            t = t.T.contiguous()
        out[name.replace("model.", "ernie.", 1) if name.startswith("model.") else name] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_a_paddle_layout_checkpoint_is_refused_naming_the_pt_release(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A -Paddle release: llama.cpp's converter stops on it with a torch error (it splits the [in, out] qkv_proj
    along the wrong axis: conversion/ernie.py Ernie4_5Model.modify_tensors), so there is no file to match; ggufkit
    refuses it in one line naming the -PT release (before: "no rule for source tensors ...; add them to
    registry.yaml"), nothing written."""
    from ggufkit.cli import cli
    from ggufkit.cli._errors import run_cli

    d = to_paddle(make_ernie(tmp_path / "ERNIE-Tiny-PT", DENSE, "release"), tmp_path / "ERNIE-Tiny-Paddle")
    capsys.readouterr()
    code = run_cli(cli, ["convert", str(d), "-o", str(tmp_path / "x.gguf")])
    err = capsys.readouterr().err
    assert code == 2 and "ernie4_5: a PaddlePaddle-layout checkpoint" in err and "-PT repository" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "x.gguf").exists()

# -- quantization ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quant_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A wider ernie4_5-moe file (rows of 256 for the k-quants) converted by ggufkit to F16, and an imatrix."""
    from fixtures_quantize import imatrix_values, write_imatrix_gguf

    from ggufkit.converters import convert

    d = tmp_path_factory.mktemp("ernie-quant")
    ckpt = make_ernie(d / "ckpt", MOE, hidden_size=256, intermediate_size=1024, moe_intermediate_size=256)
    model = Path(convert(ckpt, d / "ernie.gguf", outtype="f16").outputs[0])
    return {"model": model, "imatrix": write_imatrix_gguf(d / "imatrix.gguf", imatrix_values(model))}


@pytest.mark.parametrize("with_imatrix", [False, True])
def test_every_preset_plans_as_llama_quantize(quant_model: dict[str, Path], with_imatrix: bool) -> None:
    """llama_tensor_get_type's choice for every tensor of every TYPE (llama-quantize --dry-run): the router and
    correction bias kept, the experts and shared expert by their rules, the dense lead layer's FFN."""
    from test_family_qwen3next import assert_every_preset_plans_as_llama_quantize

    assert_every_preset_plans_as_llama_quantize(quant_model, with_imatrix)


@pytest.mark.parametrize(("target", "with_imatrix"), [("q4_k_m", False), ("q2_k", True), ("iq4_xs", True),
                                                      ("q5_0", False)])
def test_whole_files_equal_llama_quantize(quant_model: dict[str, Path], target: str, with_imatrix: bool,
                                          tmp_path: Path) -> None:
    from fixtures_quantize import assert_same_quantized
    from llama_cpp_sources import tool_path

    from ggufkit.quant import quantize_file

    ref, ours = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    flags = ["--imatrix", str(quant_model["imatrix"])] if with_imatrix else []
    subprocess.run([str(tool_path("llama-quantize")), *flags, str(quant_model["model"]), str(ref), target.upper(),
                    "2"], check=True, capture_output=True)
    quantize_file(quant_model["model"], ours, target, imatrix=quant_model["imatrix"] if with_imatrix else None,
                  threads=2)
    assert_same_quantized(ref, ours)


# -- release -------------------------------------------------------------------------------------------------
def test_release_end_to_end(tmp_path: Path) -> None:
    """``ggufkit release`` of an Ernie 4.5 MoE checkpoint (release layout): F16 master, importance matrix (with
    each expert's entries), a quantized file, both loaded by llama.cpp."""
    from ggufkit.format import open_gguf
    from ggufkit.release import release

    ckpt = make_ernie(tmp_path / "ERNIE-4.5-Tiny-PT", MOE, "release")
    out = tmp_path / "release"
    result = release(ckpt, out, types=["q4_k_m"], master="f16", ctx=64, chunks=2, imatrix_chunks=2, device="cpu")
    assert result.ok, result.failures
    master = next(out / f for f in result.files if f.endswith("-F16.gguf"))
    quantized = next(out / f for f in result.files if f.endswith("-Q4_K_M.gguf"))
    with open_gguf(quantized) as f:
        assert f.architecture == "ernie4_5-moe" and f.get("quantize.imatrix.chunks_count") == 2
    for path in (master, quantized):
        assert np.isfinite(llama_cpp_logits(path)).all()


def tiny_f32(d: Path, hf_class: str = MOE) -> Path:
    """A tiny Ernie 4.5 (``hf_class``) as transformers 5 saves it, converted to F32 by ggufkit
    (tests/test_eval_imatrix_archs.py)."""
    from ggufkit.converters import convert

    return Path(convert(make_ernie(d / "ckpt", hf_class), d / "f32.gguf", outtype="f32").outputs[0])
