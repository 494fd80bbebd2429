"""Qwen3.5-MoE text model (``Qwen3_5MoeForCausalLM``, GGUF arch ``qwen35moe``) end to end against llama.cpp
(issue 33).

Qwen3.5's gated delta-net and gated full-attention layers (separate ``in_proj_qkv`` / ``in_proj_z`` /
``in_proj_b`` / ``in_proj_a``, value heads reordered from grouped to tiled by llama.cpp's converter, interleaved
M-RoPE) with Qwen3-Next's mixture of experts (softmax router, renormalised top-k, sigmoid-gated shared expert).
Tiny random checkpoints of transformers' own class as tests/test_family_qwen3next.py builds them (4 layers
alternating delta-net / full attention, 2 key and 4 value heads, 4 experts, top-2, every parameter random),
head_dim 32 with a quarter rotated (n_rot 8) and M-RoPE sections [2, 1, 1] (ggml_mrope_cache_init asserts their
sum fits n_rot). Qwen2's BPE stands in for Qwen3.5's 248k one (check hash "qwen35"; tests/fixtures_tokenizers.py
has no rebuild of it). Two config layouts:

* ``release``: the text_config spelling of Qwen/Qwen3.5-35B-A3B (``full_attention_interval`` and no
  ``layer_types``, ``partial_rotary_factor`` at the root too, ``attn_output_gate``, ``mtp_*``);
* ``tf5``: transformers 5's ``save_pretrained`` (``layer_types``).

The evaluator runs it with Qwen3.5's forward (eval/family_qwen35.py) and the standard MoE FFN.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import fixtures_models
import numpy as np
import pytest
from fixtures_models import llama_cpp_logits, transformers_logits
from test_family_qwen3next import (
    MOE_ENTRIES,
    assert_every_preset_plans_as_llama_quantize,
    imatrix_against_llama,
    llama_cpp_convert,
    make_model,
    quant_case,
)

HF_CLASS = "Qwen3_5MoeForCausalLM"
LAYOUTS = ("release", "tf5")

fixtures_models._BASE.setdefault(HF_CLASS, dict(
    hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
    layer_types=["linear_attention", "full_attention"] * 2, max_position_embeddings=128, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=None, eos_token_id=151643,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True}))
fixtures_models._CLASSES.setdefault(HF_CLASS, ("Qwen3_5MoeTextConfig", HF_CLASS))
fixtures_models._VOCAB.setdefault(HF_CLASS, "real:qwen2")


def to_release_config(path: Path) -> None:
    """Rewrite a transformers 5 config.json in the spelling of Qwen/Qwen3.5-35B-A3B's text_config."""
    config = json.loads(path.read_text())
    types = config.pop("layer_types")
    interval = types.index("full_attention") + 1
    assert types == ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(len(types))]
    rope = config.get("rope_parameters") or {}
    config.update(full_attention_interval=interval, attn_output_gate=True, mtp_num_hidden_layers=0,
                  mtp_use_dedicated_embeddings=False, partial_rotary_factor=rope["partial_rotary_factor"],
                  torch_dtype="bfloat16")
    config.pop("dtype", None)
    path.write_text(json.dumps(dict(sorted(config.items())), indent=2))


@pytest.fixture(scope="module", params=LAYOUTS)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    layout = request.param
    d = make_model(tmp_path_factory.mktemp(f"qwen35moe-{layout}") / "m", HF_CLASS, layout, to_release_config)
    return {"layout": layout, "dir": d, "theirs": llama_cpp_convert(d, d.parent / "theirs.gguf")}


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    from ggufkit.eval.perplexity import sample_text

    text = sample_text()[:6000]
    path = tmp_path_factory.mktemp("qwen35moe-text") / "text.txt"
    path.write_text(text + "\n", encoding="utf-8")
    return text, path


def test_llama_cpp_runs_transformers_model(case: dict[str, Any]) -> None:
    """llama.cpp's file computes transformers' model (a scan summed in another order: measured 7e-6 of the
    logit range)."""
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
        assert m.hparams.extra["recurrent"] == (True, False, True, False) and m.hparams.n_expert == 4
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
    """The delta-net's attn_qkv, attn_gate, ssm_beta, ssm_alpha and ssm_out, the gated attention's q/k/v/output,
    the router, experts and shared expert, and the head: llama-imatrix's entries, ``in_sum2`` within float32
    noise."""
    from test_eval_imatrix_archs import F32_TOLERANCE

    rel = imatrix_against_llama(case["theirs"], sample[1], tmp_path)
    assert {n.split(".", 2)[-1] for n in rel if n.startswith("blk.0.")} == {
        "attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight", "ssm_out.weight",
        *MOE_ENTRIES}
    assert {n.split(".", 2)[-1] for n in rel if n.startswith("blk.1.")} == {
        "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", *MOE_ENTRIES}
    assert max(rel.values()) <= F32_TOLERANCE, rel


def test_value_heads_are_tiled_as_llama_cpps_converter_does() -> None:
    """rewrite_tensors reorders Qwen3.5's value heads from grouped (by key head) to tiled in every tensor that
    has them (_LinearAttentionVReorderBase.modify_tensors), and only where there are more V than K heads."""
    from ggufkit.converters import qwen3next

    config = {"model_type": "qwen3_5_moe_text", "linear_key_head_dim": 2, "linear_value_head_dim": 2,
              "linear_num_key_heads": 2, "linear_num_value_heads": 4}
    z = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)  # 4 value heads of 2 rows, grouped [k0v0 k0v1 k1v0 k1v1]
    b = np.arange(4, dtype=np.float32).reshape(4, 1)
    raw = [("blk.0.attn_gate.weight", "z", "ATTN_GATE", (8, 3), "F32", None),
           ("blk.0.ssm_beta.weight", "b", "SSM_BETA", (4, 1), "F32", None)]
    loaders = {"blk.0.attn_gate.weight": lambda: z, "blk.0.ssm_beta.weight": lambda: b}
    qwen3next.rewrite_tensors(raw, loaders, config)
    heads = z.reshape(4, 2, 3)
    assert np.array_equal(loaders["blk.0.attn_gate.weight"](), heads[[0, 2, 1, 3]].reshape(8, 3))
    assert np.array_equal(loaders["blk.0.ssm_beta.weight"]()[:, 0], [0, 2, 1, 3])
    same = {"blk.0.attn_gate.weight": lambda: z}
    qwen3next.rewrite_tensors(raw[:1], same, {**config, "linear_num_value_heads": 2})
    assert np.array_equal(same["blk.0.attn_gate.weight"](), z)


@pytest.fixture(scope="module")
def quant_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return quant_case(tmp_path_factory.mktemp("qwen35moe-quant"), "qwen35moe")


@pytest.mark.parametrize("with_imatrix", [False, True])
def test_every_preset_plans_as_llama_quantize(quant_model: dict[str, Path], with_imatrix: bool) -> None:
    assert_every_preset_plans_as_llama_quantize(quant_model, with_imatrix)


def tiny_f32(d: Path) -> Path:
    """A tiny Qwen3.5-MoE as transformers 5 saves it, converted to F32 by ggufkit (tests/test_eval_imatrix_archs.py)."""
    from ggufkit.converters import convert

    return Path(convert(make_model(d / "ckpt", HF_CLASS, "tf5", to_release_config), d / "f32.gguf",
                        outtype="f32").outputs[0])


@pytest.mark.parametrize("outtype", ["f32", "f16"])
def test_ggufkit_converts_each_layout_as_llama_cpps_converter(case: dict[str, Any], outtype: str,
                                                              tmp_path: Path) -> None:
    """Both spellings of the schedule, the V heads tiled, the M-RoPE sections, the conv kernel F32: llama.cpp's
    file (its converter needs --no-mtp here; ggufkit no flag)."""
    from test_family_qwen3next import assert_same_file

    from ggufkit.converters import convert
    from ggufkit.format import open_gguf

    theirs = case["theirs"] if outtype == "f32" else llama_cpp_convert(case["dir"], tmp_path / "t.gguf", outtype)
    ours = convert(case["dir"], tmp_path / "ours.gguf", outtype=outtype).outputs[0]
    assert_same_file(theirs, ours)
    with open_gguf(ours) as f:
        assert list(f.get("qwen35moe.attention.recurrent_layers")) == [True, False, True, False]
        assert list(f.get("qwen35moe.rope.dimension_sections")) == [2, 1, 1, 0]
