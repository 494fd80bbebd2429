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
